# SPDX-License-Identifier: Apache-2.0
"""What the launch plans may ask of a CUDA device, each asked once (cached): its SM count and
compute capability, and whether the Hopper Gluon kernels can be used with the installed Triton.
ops/common/plan.py's DeviceFacts gathers them; support.py reads them to say why a device cannot
run a layer."""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["capability", "gluon_hopper_available", "num_sms", "GLUON_TRITON"]


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device (cached)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


# the Triton minor versions whose Gluon the Hopper kernels (the indexer's scores_gluon.py, the
# attention's tile_gluon.py) are written for and tested on; Gluon is experimental and its API
# moves between minor versions
GLUON_TRITON = ((3, 6),)


@functools.lru_cache(maxsize=None)
def gluon_hopper_available() -> bool:
    """Whether the Gluon kernels for Hopper can be used: the installed Triton is a version they
    were tested on and has the Gluon modules they import. OPENMSA_GLUON=0 turns them off, =1
    on for any Triton that has the modules (an untested version may fail to compile them).
    Without them the Triton kernels run: same results, slower prefill on Hopper."""
    setting = os.environ.get("OPENMSA_GLUON", "")
    if setting == "0":
        return False
    try:
        import triton
        from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
            mbarrier, tma, warpgroup_mma)
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    return setting == "1" or version in GLUON_TRITON


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached: no query per call)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
