# SPDX-License-Identifier: Apache-2.0
"""Triton kernels of the cache writes: one program per token, rows scattered by slot mapping.
Bytes: reads T * row * bytes(src), writes T * row * bytes(cache)."""

import triton
import triton.language as tl


@triton.jit
def saturate_to(x, dtype: tl.constexpr, SATURATE: tl.constexpr):
    """Cast for a cache; fp8 saturates at +-448 (e4m3fnuz, AMD gfx942's: +-240) through
    compares, so NaN stays NaN (min/max instructions would turn it into a number)."""
    if SATURATE:
        x = x.to(tl.float32)
        if dtype == tl.float8e4b8:
            x = tl.where(x > 240.0, 240.0, tl.where(x < -240.0, -240.0, x))
            # fnuz's one NaN is 0x80 (the bits of OCP's -0.0) and its one zero 0x00: both set
            # by hand, so that -0.0 never becomes NaN (Triton's interpreter converts bit by
            # bit, and its NaN would come out a number)
            bits = x.to(dtype).to(tl.uint8, bitcast=True)
            bits = tl.where(x != x, 0x80, tl.where(x == 0.0, 0, bits)).to(tl.uint8)
            return bits.to(dtype, bitcast=True)
        else:
            x = tl.where(x > 448.0, 448.0, tl.where(x < -448.0, -448.0, x))
    return x.to(dtype)


@triton.jit
def kv_scales(k_scale_ptr, v_scale_ptr, HAS_SCALE: tl.constexpr):
    """The per-tensor scales of an fp8 main cache (the cache stores x / scale); 1.0 without."""
    k_scale = 1.0
    v_scale = 1.0
    if HAS_SCALE:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    return k_scale, v_scale


@triton.jit
def _write_index_cache_kernel(src_ptr, cache_ptr, slot_ptr, stride_st, stride_sd, stride_cp,
                              stride_cb, stride_cd, BLOCK: tl.constexpr, DI: tl.constexpr,
                              DIP: tl.constexpr, SATURATE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, DIP)
        x = tl.load(src_ptr + t.to(tl.int64) * stride_st + d * stride_sd, mask=d < DI)
        dst = cache_ptr + (slot // BLOCK) * stride_cp + (slot % BLOCK) * stride_cb + d * stride_cd
        tl.store(dst, saturate_to(x, cache_ptr.dtype.element_ty, SATURATE), mask=d < DI)


@triton.jit
def _write_kv_row(src_ptr, cache_ptr, t, page, offset, scale, stride_st, stride_sh, stride_sd,
                  stride_cp, stride_cb, stride_ch, stride_cd, HKV: tl.constexpr,
                  HKVP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                  SATURATE: tl.constexpr):
    h = tl.arange(0, HKVP)[:, None]
    d = tl.arange(0, DP)[None, :]
    mask = (h < HKV) & (d < D)
    x = tl.load(src_ptr + t.to(tl.int64) * stride_st + h * stride_sh + d * stride_sd, mask=mask)
    x = x.to(tl.float32) / scale
    dst = cache_ptr + page * stride_cp + offset * stride_cb + h * stride_ch + d * stride_cd
    tl.store(dst, saturate_to(x, cache_ptr.dtype.element_ty, SATURATE), mask=mask)


@triton.jit
def _write_kv_cache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr,
                           v_scale_ptr, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh,
                           stride_vd, stride_kcp, stride_kcb, stride_kch, stride_kcd, stride_vcp,
                           stride_vcb, stride_vch, stride_vcd, BLOCK: tl.constexpr,
                           HKV: tl.constexpr, HKVP: tl.constexpr, D: tl.constexpr,
                           DP: tl.constexpr, SATURATE: tl.constexpr, HAS_SCALE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        page = slot // BLOCK
        offset = slot % BLOCK
        k_scale, v_scale = kv_scales(k_scale_ptr, v_scale_ptr, HAS_SCALE)
        _write_kv_row(k_ptr, k_cache_ptr, t, page, offset, k_scale, stride_kt, stride_kh,
                      stride_kd, stride_kcp, stride_kcb, stride_kch, stride_kcd, HKV, HKVP, D, DP,
                      SATURATE)
        _write_kv_row(v_ptr, v_cache_ptr, t, page, offset, v_scale, stride_vt, stride_vh,
                      stride_vd, stride_vcp, stride_vcb, stride_vch, stride_vcd, HKV, HKVP, D, DP,
                      SATURATE)
