# SPDX-License-Identifier: Apache-2.0
"""Triton kernels of the cache writes: one program per token, rows scattered by slot mapping; a
slot outside [0, P * B) (negative for padding, or past the cache) writes nothing (docs/spec.md,
"Bounds"), checked once per program against the cache's slot count.
Bytes: reads T * row * bytes(src), writes T * row * bytes(cache) (72 bytes for an NVFP4 index
cache, whose quantizer `nvfp4_store` the fused preparation shares)."""

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


# Every step below is exact integer or correctly rounded fp32 math, so the bytes are the same on
# every back end, Triton's interpreter included: its fp32 -> fp8 cast and its fma are not
# IEEE-exact, and the GPU's plain `/` is an approximate division.

@triton.jit
def _e4m3_round(s):
    """(e4m3fn byte, its fp32 value) of fp32 s in [2^-9, 448], rounded to nearest even on the
    bits: keep 3 mantissa bits (fewer below 2^-6, where e4m3 is subnormal with step 2^-9)."""
    b = s.to(tl.int32, bitcast=True)
    e = ((b >> 23) & 0xFF) - 127
    shift = 20 + tl.maximum(-6 - e, 0)
    # the kept part's last bit; at shift 23 (s < 2^-8) it is the implicit 1 of 1 * 2^-9
    lsb = tl.where(shift == 23, 1, (b >> shift) & 1)
    b = ((b + (1 << (shift - 1)) - 1 + lsb) >> shift) << shift
    v = b.to(tl.float32, bitcast=True)
    e = ((b >> 23) & 0xFF) - 127
    byte = tl.where(e >= -6, ((e + 7) << 3) | ((b >> 20) & 7), (v * 512.0).to(tl.int32))
    return byte.to(tl.uint8), v


@triton.jit
def _mul_toward_zero(x, r):
    """fp32 x * r rounded toward zero, for r > 0 normal: the 48-bit product of the significands
    in int64 truncated to 24 bits. Only products in [1/8, 8] take this path: below, every
    rounding gives code 0, above, code 7 (and there the exponent could leave fp32's range)."""
    p = x * r
    xb = x.to(tl.int32, bitcast=True)
    rb = r.to(tl.int32, bitcast=True)
    prod = ((xb & 0x7FFFFF) | 0x800000).to(tl.int64) * ((rb & 0x7FFFFF) | 0x800000).to(tl.int64)
    wide = prod >= (1 << 47)
    m = tl.where(wide, prod >> 24, prod >> 23).to(tl.float32)
    k = ((xb >> 23) & 0xFF) + ((rb >> 23) & 0xFF) - 300 + tl.where(wide, 24, 23)
    pow2 = ((tl.minimum(tl.maximum(k, -126), 127) + 127) << 23).to(tl.float32, bitcast=True)
    mag = m * pow2
    a = tl.abs(p)
    return tl.where((a >= 0.125) & (a <= 8.0), tl.where(x < 0, -mag, mag), p)


@triton.jit
def _e2m1(x, r):
    """4-bit E2M1 codes of x * r (rounded toward zero first): nearest, ties to the even code,
    saturating at 6; sign in bit 3, none on a zero code. Counting the midpoints a magnitude lies
    below (<= where the lower code is even) gives 7 for NaN, as the reference does."""
    m = tl.abs(_mul_toward_zero(x, r))
    below = ((m <= 0.25).to(tl.int32) + (m < 0.75).to(tl.int32) + (m <= 1.25).to(tl.int32)
             + (m < 1.75).to(tl.int32) + (m <= 2.5).to(tl.int32) + (m < 3.5).to(tl.int32)
             + (m <= 5.0).to(tl.int32))
    code = 7 - below
    return tl.where((x < 0) & (code != 0), code | 8, code)


@triton.jit
def nvfp4_store(page_ptr, t, x):
    """Quantizes one token's index key x (fp32 [128]) as vLLM's NVFP4 writer does and stores its
    64 code bytes at page_ptr + t * 64 and 8 scale bytes at page_ptr + 8192 + t * 8 (page_ptr:
    uint8, the page's first byte). Per 16 dims: s = e4m3(max(amax / 6, 2^-9)), r = 1 / s; a
    group holding a NaN stores the NaN scale 0x7F and codes 7 (so it reads back as NaN, as the
    reference's NaN amax gives), decided by compares: a max instruction would skip the NaN on
    the GPU and keep it in the interpreter."""
    # [group g, pair i]: dims 16g + 2i (low nibble of byte 8g + i) and 16g + 2i + 1 (high)
    lo, hi = tl.split(tl.reshape(x, (8, 8, 2)))
    nan = tl.max(((lo != lo) | (hi != hi)).to(tl.int32), axis=1) > 0
    amax = tl.maximum(tl.max(tl.where(lo == lo, tl.abs(lo), 0.0), axis=1),
                      tl.max(tl.where(hi == hi, tl.abs(hi), 0.0), axis=1))
    s = tl.minimum(tl.maximum(tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)),
                              2.0 ** -9), 448.0)
    scale, v = _e4m3_round(s)
    scale = tl.where(nan, 0x7F, scale).to(tl.uint8)
    r = tl.div_rn(tl.full(v.shape, 1.0, tl.float32), v)[:, None]
    codes = (_e2m1(lo, r) | (_e2m1(hi, r) << 4)).to(tl.uint8)
    codes = tl.where(nan[:, None], 0x77, codes).to(tl.uint8)
    g = tl.arange(0, 8)
    tl.store(page_ptr + t * 64 + g[:, None] * 8 + g[None, :], codes)
    tl.store(page_ptr + 8192 + t * 8 + g, scale)


@triton.jit
def _write_index_cache_kernel(src_ptr, cache_ptr, slot_ptr, num_slots, stride_st, stride_sd,
                              stride_cp, stride_cb, stride_cd, BLOCK: tl.constexpr,
                              DI: tl.constexpr, DIP: tl.constexpr, SATURATE: tl.constexpr,
                              NVFP4: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        d = tl.arange(0, DIP)
        x = tl.load(src_ptr + t.to(tl.int64) * stride_st + d * stride_sd, mask=d < DI)
        if NVFP4:
            # a page is 9216 bytes (codes, then scales) at stride_cp; DI == BLOCK == 128
            nvfp4_store(cache_ptr + (slot // BLOCK) * stride_cp, slot % BLOCK, x.to(tl.float32))
        else:
            dst = (cache_ptr + (slot // BLOCK) * stride_cp + (slot % BLOCK) * stride_cb
                   + d * stride_cd)
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
                           v_scale_ptr, num_slots, stride_kt, stride_kh, stride_kd, stride_vt,
                           stride_vh, stride_vd, stride_kcp, stride_kcb, stride_kch, stride_kcd,
                           stride_vcp, stride_vcb, stride_vch, stride_vcd, BLOCK: tl.constexpr,
                           HKV: tl.constexpr, HKVP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                           SATURATE: tl.constexpr, HAS_SCALE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        page = slot // BLOCK
        offset = slot % BLOCK
        k_scale, v_scale = kv_scales(k_scale_ptr, v_scale_ptr, HAS_SCALE)
        _write_kv_row(k_ptr, k_cache_ptr, t, page, offset, k_scale, stride_kt, stride_kh,
                      stride_kd, stride_kcp, stride_kcb, stride_kch, stride_kcd, HKV, HKVP, D, DP,
                      SATURATE)
        _write_kv_row(v_ptr, v_cache_ptr, t, page, offset, v_scale, stride_vt, stride_vh,
                      stride_vd, stride_vcp, stride_vcb, stride_vch, stride_vcd, HKV, HKVP, D, DP,
                      SATURATE)
