# SPDX-License-Identifier: Apache-2.0
"""Which implementation a call runs: CUDA tensors run the Triton kernels; CPU tensors run the
reference, except under TRITON_INTERPRET=1, where they run the kernels through the interpreter.
Also the small helpers every launcher shares."""

from __future__ import annotations

import functools
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpreter_knows_fnuz() -> None:
    """Triton 3.6's interpreter stores every fp8 type as bytes and converts them bit by bit, but
    its dtype-to-IR table leaves out fp8e4b8 (torch.float8_e4m3fnuz, AMD gfx942's fp8), so a
    kernel given an fnuz pointer fails at its first pointer arithmetic. This adds that one entry
    to the table the interpreter patches in for each launch (nothing else changes; a no-op on a
    Triton that has it)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_core", None)
    if patch is None or getattr(patch, "openmsa_fnuz", False):
        return

    def patch_with_fnuz(lang, scope):
        patch(lang, scope)
        to_ir = lang.dtype.to_ir

        def fnuz_to_ir(self, builder):
            if self.name == "fp8e4b8":
                return builder.get_fp8e4b8_ty()
            return to_ir(self, builder)
        scope.set_attr(lang.dtype, "to_ir", fnuz_to_ir)

    patch_with_fnuz.openmsa_fnuz = True
    interpreter._patch_lang_core = patch_with_fnuz


if INTERPRET:
    _interpreter_knows_fnuz()


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


# the Triton minor versions whose Gluon the Hopper kernels (scores_ws.py, prefill_ws.py) are
# written for and tested on; Gluon is experimental and its API moves between minor versions
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
