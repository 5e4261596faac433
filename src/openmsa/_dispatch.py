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


# the torch dtype of each float type the interpreter stores as bits (by Triton's type name)
_TORCH_FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                 "fp8e4nv": torch.float8_e4m3fn, "fp8e4b8": torch.float8_e4m3fnuz,
                 "fp8e5": torch.float8_e5m2}
_SIGNED_BITS = {8: torch.int8, 16: torch.int16, 32: torch.int32}


def _interpreter_converts_like_the_gpu() -> None:
    """Triton 3.6's interpreter converts between float types bit by bit (`_convert_float`), and
    wrongly: fp32 -> bf16 truncates (half the values one ulp off), fp32 -> fp8 e4m3 rounds half
    up without the carry into the exponent (1.99 -> 1.0; 2-3% of random values), NaN becomes
    384 and the e4m3 NaN byte reads back as 480; and `tl.dot` multiplies bf16 tiles as their
    uint16 bits (index scores of ~1e10). This puts torch's conversions in its place (round to
    nearest even, NaN kept; into fp8 saturating at the largest finite value, as the GPU's
    cvt.rn.satfinite) for the types torch has, and runs a dot with a bf16 operand on fp32
    values (exact products, fp32 sums, as the GPU's MMA). The GPU's code is untouched: this is
    the interpreter's own Python. Elementwise bf16 arithmetic stays wrong (uint16 bits), which
    is why the kernels do their math in fp32 and why the attention kernels refuse bf16 under
    the interpreter (support.py). A no-op on a Triton without these functions; the interpreter
    tier's tests hold it to bit-exact casts (tests/test_interpreter.py)."""
    try:
        import numpy as np
        from triton.runtime import interpreter
        import triton.language as tl
    except ImportError:
        return
    convert = getattr(interpreter, "_convert_float", None)
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if convert is None or builder is None or getattr(convert, "openmsa", False):
        return
    rtz = interpreter._ir.ROUNDING_MODE.RTZ

    def convert_float(data, src_type, dst_type, rounding_mode):
        src = _TORCH_FLOATS.get(src_type.name)
        dst = _TORCH_FLOATS.get(dst_type.name)
        if src is None or dst is None or rounding_mode == rtz:
            return convert(data, src_type, dst_type, rounding_mode)
        bits = np.ascontiguousarray(data).view(f"int{src_type.primitive_bitwidth}")
        x = torch.from_numpy(bits.copy()).view(src)
        if dst.is_floating_point and dst.itemsize == 1 and src.itemsize > 1:
            big = torch.finfo(dst).max
            x = x.clamp(-big, big)  # (NaN stays NaN)
        out = x.to(dst).view(_SIGNED_BITS[dst_type.primitive_bitwidth]).numpy()
        return out.view(f"uint{dst_type.primitive_bitwidth}").reshape(np.shape(data))

    convert_float.openmsa = True
    interpreter._convert_float = convert_float
    create_dot = builder.create_dot

    def dot_in_fp32(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype, b.dtype):
            a, b = (interpreter.TensorHandle(
                convert_float(x.data, x.dtype, tl.float32, None).view(np.float32), tl.float32)
                if x.dtype != tl.float32 else x for x in (a, b))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = dot_in_fp32


if INTERPRET:
    _interpreter_knows_fnuz()
    _interpreter_converts_like_the_gpu()


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
