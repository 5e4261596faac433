# SPDX-License-Identifier: Apache-2.0
"""Which implementation a call runs: CUDA tensors run the Triton kernels; CPU tensors run the
reference, except under TRITON_INTERPRET=1, where they run the kernels through the interpreter."""

from __future__ import annotations

import functools

import torch

from ._interpreter import INTERPRET


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
