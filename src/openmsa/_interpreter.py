# SPDX-License-Identifier: Apache-2.0
"""Triton's interpreter (TRITON_INTERPRET=1), made to convert and multiply as the GPU does.
Imported before any launch (by `_dispatch`); a no-op without the interpreter."""

from __future__ import annotations

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
