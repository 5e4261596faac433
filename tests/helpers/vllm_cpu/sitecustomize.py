# SPDX-License-Identifier: Apache-2.0
"""For the vLLM test's processes (tests/test_vllm.py puts this folder on PYTHONPATH): vLLM's
MiniMax-M3 package imports `torchvision.transforms.InterpolationMode` (its image processor), and
the registry's torchvision does not load beside the CPU torch. Where no torchvision is
installed, a stub holding that enum alone is put on the path *after* transformers has cached
that torchvision is absent, so transformers' image code keeps away from the stub."""

import importlib.util
import os
import sys

if importlib.util.find_spec("torchvision") is None:
    try:
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()  # cached: False
    except ImportError:
        pass
    sys.path.append(os.path.join(os.path.dirname(__file__), "stub"))
