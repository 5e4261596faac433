# SPDX-License-Identifier: Apache-2.0
"""Which implementation a call runs: CUDA tensors run the Triton kernels; CPU tensors run the
reference, except under TRITON_INTERPRET=1, where they run the kernels through the interpreter."""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_kernels(t) -> bool:
    """Non-tensors go to the reference, whose validation names them."""
    if not isinstance(t, torch.Tensor):
        return False
    return t.is_cuda or (INTERPRET and t.device.type == "cpu")


def backend_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        return "triton-interpreter" if INTERPRET else "reference"
    return "unsupported"
