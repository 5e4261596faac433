# SPDX-License-Identifier: Apache-2.0
"""What the tests share (importable as `helpers`: tests/ is on sys.path through conftest.py):
random steps and inputs (steps.py), the tolerance table and checks (checks.py) and a recording
stand-in for a kernel (recording.py; the dense-attention comparison path is openmsa.dense); for
tests/test_vllm.py, a released-layout MiniMax-M3 checkpoint and the transformers side
(m3_checkpoint.py), the vLLM run (vllm_worker.py, vllm_cpu/) and a CP rank (vllm_cp_worker.py)."""

from .checks import TOLERANCES, assert_close, assert_selection_near_optimal
from .recording import RecordingKernel
from .steps import (Step, compact_pages, cuda_step, make_step, nan_poison, random_index_inputs,
                    random_kv_cache, to_device)

__all__ = ["Step", "make_step", "TOLERANCES", "assert_close", "random_index_inputs",
           "random_kv_cache", "to_device", "nan_poison", "assert_selection_near_optimal",
           "RecordingKernel", "cuda_step", "compact_pages"]
