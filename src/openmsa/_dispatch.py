# SPDX-License-Identifier: Apache-2.0
"""Which implementation a call runs: CUDA tensors run the Triton kernels; CPU tensors run the
reference, except under TRITON_INTERPRET=1, where they run the kernels through the interpreter.
Also the small helpers every launcher shares."""

from __future__ import annotations

import functools
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_kernels(t) -> bool:
    """Non-tensors go to the reference, whose validation names them."""
    if not isinstance(t, torch.Tensor):
        return False
    return t.is_cuda or (INTERPRET and t.device.type == "cpu")


def on_tensor_device(op):
    """Runs a public op with the CUDA device of its first argument current, as torch's own ops
    do. Triton launches on the current device (its stream, its kernels), so without this a
    process driving several GPUs that calls an op on tensors of another GPU than the current one
    would launch where the data is not. The check is two C calls per op; the other arguments are
    validated to be on the same device."""

    @functools.wraps(op)
    def guarded(first, *args, **kwargs):
        if isinstance(first, torch.Tensor) and first.is_cuda:
            index = first.get_device()
            if index != torch.cuda.current_device():
                with torch.cuda.device(index):
                    return op(first, *args, **kwargs)
        return op(first, *args, **kwargs)

    return guarded


def backend_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        return "triton-interpreter" if INTERPRET else "reference"
    return "unsupported"


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device (cached)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached: no query per call)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def scale_tensor(value, device) -> torch.Tensor:
    """A dequantisation scale as a one-element fp32 device tensor (a float becomes one)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(1).float()
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


def scale_args(k_scale, v_scale, device, placeholder: torch.Tensor):
    """(HAS_SCALE, k scale pointer, v scale pointer) for a launch. Without scales the kernel never
    reads the pointers, so any tensor stands in: no fill kernel per call for a constant 1.0."""
    if k_scale is None and v_scale is None:
        return False, placeholder, placeholder
    return (True, scale_tensor(1.0 if k_scale is None else k_scale, device),
            scale_tensor(1.0 if v_scale is None else v_scale, device))
