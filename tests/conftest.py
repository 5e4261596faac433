# SPDX-License-Identifier: Apache-2.0
"""Test tiers (README.md, Test; docs/contributing.md): `reference` runs anywhere; `interpret`
needs TRITON_INTERPRET=1 (set before openmsa is imported, i.e. in the environment of the pytest
run); `gpu` needs CUDA.

The `kernel_device` fixture gives the device on which the public ops run the Triton kernels:
"cpu" under the interpreter, "cuda" on a GPU. This file applies to every folder below it
(tests/ops, tests/plans), and puts tests/ on sys.path, so tests import `helpers` and `brute`."""

import os

# every planned launch checked against Triton's own key (ops/common/launch.py); set before
# openmsa is imported
os.environ.setdefault("OPENMSA_VERIFY_PLAN_KEYS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_interp = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (CPU kernels) or a GPU")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_ref = pytest.mark.skip(reason="reference tier runs without TRITON_INTERPRET")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpret" in item.keywords and not (INTERPRET or HAS_CUDA):
            item.add_marker(skip_interp)
        # the reference tier's public-dispatch checks assume CPU tensors reach the reference
        if "reference" in item.keywords and INTERPRET and "dispatch" in item.keywords:
            item.add_marker(skip_ref)


@pytest.fixture
def kernel_device():
    """Where the public ops run the kernels: the GPU when there is one, else the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"
