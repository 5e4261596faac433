# SPDX-License-Identifier: Apache-2.0
"""The fused per-layer preparation in one launch: grid (T, role tiles), where a program takes up
to HT heads of one role of one token from the fused projection row `[q | k | v | iq | ik]`:

* q tiles: RMSNorm(q_norm) -> RoPE -> q_out;
* kv tiles: RMSNorm(k_norm) -> RoPE -> k_cache, and v (untouched) -> v_cache, at `slot`;
* index-q tiles: RMSNorm(index_q_norm) -> RoPE -> cast -> index_q_out;
* the index-k program: RMSNorm(index_k_norm) -> RoPE -> saturating cast -> index_cache at
  `index_slot`; into an NVFP4 index cache (INDEX_NVFP4) it is quantized by `nvfp4_store`, the
  same helper as write_index_cache's.

A slot outside its cache's [0, P * B) (`num_slots`, `num_index_slots`) writes nothing: negative
for padding, or past the cache (docs/spec.md, "Bounds").

Bytes per token: read the row (qkv dtype), write q, index_q, k, v, index_k: memory bound.

RoPE angles come from a two-level fp32 table built in float64 on the host (`rope_table`):
angle(p) = angle(p mod 1024) + angle(1024 * (p div 1024)) (1024: geometry.ROPE_FINE, the table's
layout), combined with the angle-sum formulas.
A single fp32 product p * inv_freq would be 0.06 rad off at p = 1M (one fp32 ulp of 1e6).
With FP32_ANGLES (the config's `rope_angles="fp32"`) the table's first row holds the fp32 inverse
frequencies instead and the angle is that fp32 product, as transformers and vLLM form it.
The inverse frequencies may be YaRN's (`openmsa.rope`); ROPE_SCALE is YaRN's attention factor on
cos and sin (1.0 without scaling).
"""

import triton
import triton.language as tl

from .write import kv_scales, nvfp4_store, saturate_to


@triton.jit
def _norm_rope(row_ptr, stride_c, col0, nheads, w_ptr, pos, table_ptr, eps,
               HT: tl.constexpr, DIM: tl.constexpr, DP: tl.constexpr, ROT: tl.constexpr,
               NCOARSE: tl.constexpr, FP32_ANGLES: tl.constexpr, ROPE_SCALE: tl.constexpr):
    """Gemma RMSNorm then NeoX RoPE on the first ROT dims of heads [0, nheads) of a tile that
    starts at column col0 of a projection row; returns (fp32 [HT, DP], mask)."""
    h = tl.arange(0, HT)[:, None]
    d = tl.arange(0, DP)[None, :]
    mask = (h < nheads) & (d < DIM)
    return norm_rope_rows(row_ptr + (col0 + h * DIM) * stride_c, stride_c, mask, w_ptr, pos,
                          table_ptr, eps, DIM, DP, ROT, NCOARSE, FP32_ANGLES, ROPE_SCALE), mask


@triton.jit
def norm_rope_rows(base, stride_c, mask, w_ptr, pos, table_ptr, eps, DIM: tl.constexpr,
                   DP: tl.constexpr, ROT: tl.constexpr, NCOARSE: tl.constexpr,
                   FP32_ANGLES: tl.constexpr, ROPE_SCALE: tl.constexpr):
    """Gemma RMSNorm then NeoX RoPE on the first ROT dims of rows of DIM values: base [R, 1]
    points at each row's first value (stride_c apart), mask [R, DP], pos a position per row
    ([R, 1]) or one for all; returns fp32 [R, DP]. The fused preparation's tiles and the
    scoring launch that prepares its own index query (kernels in ops/indexer) share it."""
    d = tl.arange(0, DP)[None, :]
    x = tl.load(base + d * stride_c, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / DIM + eps)
    w = tl.load(w_ptr + d, mask=d < DIM, other=0.0).to(tl.float32)
    y = x * inv_rms[:, None] * (1.0 + w)
    if ROT > 0:
        HALF: tl.constexpr = ROT // 2
        rot = d < ROT
        # the other half of each rotated pair (reloaded: a register shuffle across the tile's
        # columns is not expressible in Triton, and the row is in L1 already)
        partner = tl.where(d < HALF, d + HALF, tl.where(rot, d - HALF, d))
        xp = tl.load(base + partner * stride_c, mask=mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=d < DIM, other=0.0).to(tl.float32)
        yp = xp * inv_rms[:, None] * (1.0 + wp)
        j = tl.where(d < HALF, d, d - HALF)
        p = tl.maximum(pos, 0)
        if FP32_ANGLES:
            f = tl.load(table_ptr + j, mask=rot, other=0.0)
            ang = p.to(tl.float32) * f
            cos = tl.cos(ang)
            sin = tl.sin(ang)
        else:
            lo = p % 1024
            hi = tl.minimum(p // 1024, NCOARSE - 1)
            fine = table_ptr + lo * ROT + j
            coarse = table_ptr + (1024 + hi) * ROT + j
            c1 = tl.load(fine, mask=rot, other=1.0)
            s1 = tl.load(fine + HALF, mask=rot, other=0.0)
            c2 = tl.load(coarse, mask=rot, other=1.0)
            s2 = tl.load(coarse + HALF, mask=rot, other=0.0)
            cos = c1 * c2 - s1 * s2
            sin = s1 * c2 + c1 * s2
        if ROPE_SCALE != 1.0:
            cos = cos * ROPE_SCALE
            sin = sin * ROPE_SCALE
        sign = tl.where(d < HALF, -1.0, 1.0)
        y = tl.where(rot, y * cos + sign * yp * sin, y)
    return y


@triton.jit
def _fused_prepare_kernel(
        qkv_ptr, pos_ptr, qw_ptr, kw_ptr, iqw_ptr, ikw_ptr, table_ptr,
        k_cache_ptr, v_cache_ptr, slot_ptr, index_cache_ptr, index_slot_ptr,
        k_scale_ptr, v_scale_ptr, q_out_ptr, iq_out_ptr, eps, num_slots, num_index_slots,
        stride_xt, stride_xc,
        stride_kcp, stride_kcb, stride_kch, stride_kcd,
        stride_vcp, stride_vcb, stride_vch, stride_vcd,
        stride_icp, stride_icb, stride_icd,
        stride_qt, stride_qh, stride_qd, stride_it, stride_ih, stride_id,
        HQ: tl.constexpr, HKV: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
        DI: tl.constexpr, DP: tl.constexpr, DIP: tl.constexpr, ROT: tl.constexpr,
        NCOARSE: tl.constexpr, FP32_ANGLES: tl.constexpr, ROPE_SCALE: tl.constexpr,
        BLOCK: tl.constexpr, IBLOCK: tl.constexpr, HT: tl.constexpr,
        KV_SATURATE: tl.constexpr, INDEX_SATURATE: tl.constexpr, IQ_SATURATE: tl.constexpr,
        HAS_SCALE: tl.constexpr, INDEX_NVFP4: tl.constexpr):
    prepare_tile(tl.program_id(0), tl.program_id(1), qkv_ptr, pos_ptr, qw_ptr, kw_ptr, iqw_ptr,
                 ikw_ptr, table_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, index_cache_ptr,
                 index_slot_ptr, k_scale_ptr, v_scale_ptr, q_out_ptr, iq_out_ptr, eps, num_slots,
                 num_index_slots, stride_xt, stride_xc, stride_kcp, stride_kcb, stride_kch,
                 stride_kcd, stride_vcp, stride_vcb, stride_vch, stride_vcd, stride_icp,
                 stride_icb, stride_icd, stride_qt, stride_qh, stride_qd, stride_it, stride_ih,
                 stride_id, HQ, HKV, H, D, DI, DP, DIP, ROT, NCOARSE, FP32_ANGLES, ROPE_SCALE,
                 BLOCK, IBLOCK, HT, KV_SATURATE, INDEX_SATURATE, IQ_SATURATE, HAS_SCALE,
                 INDEX_NVFP4)


@triton.jit
def prepare_tile(
        t, tile, qkv_ptr, pos_ptr, qw_ptr, kw_ptr, iqw_ptr, ikw_ptr, table_ptr,
        k_cache_ptr, v_cache_ptr, slot_ptr, index_cache_ptr, index_slot_ptr,
        k_scale_ptr, v_scale_ptr, q_out_ptr, iq_out_ptr, eps, num_slots, num_index_slots,
        stride_xt, stride_xc,
        stride_kcp, stride_kcb, stride_kch, stride_kcd,
        stride_vcp, stride_vcb, stride_vch, stride_vcd,
        stride_icp, stride_icb, stride_icd,
        stride_qt, stride_qh, stride_qd, stride_it, stride_ih, stride_id,
        HQ: tl.constexpr, HKV: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
        DI: tl.constexpr, DP: tl.constexpr, DIP: tl.constexpr, ROT: tl.constexpr,
        NCOARSE: tl.constexpr, FP32_ANGLES: tl.constexpr, ROPE_SCALE: tl.constexpr,
        BLOCK: tl.constexpr, IBLOCK: tl.constexpr, HT: tl.constexpr,
        KV_SATURATE: tl.constexpr, INDEX_SATURATE: tl.constexpr, IQ_SATURATE: tl.constexpr,
        HAS_SCALE: tl.constexpr, INDEX_NVFP4: tl.constexpr):
    """Tile `tile` of token t of the fused preparation (the module's docstring); the
    preparation's own launch runs one per program, and the scoring launch that also prepares
    (ops/indexer/kernels/scores.py, PREPARE) runs them after its scoring programs."""
    NQ: tl.constexpr = (HQ + HT - 1) // HT
    NKV: tl.constexpr = (HKV + HT - 1) // HT
    NI: tl.constexpr = (H + HT - 1) // HT
    # (t may be a loop's int: the scoring launch that prepares loops over tokens)
    t64 = tl.cast(t, tl.int64)
    row = qkv_ptr + t64 * stride_xt
    pos = tl.load(pos_ptr + t).to(tl.int32)
    hh = tl.arange(0, HT)[:, None]
    if tile < NQ:
        h0 = tile * HT
        y, mask = _norm_rope(row, stride_xc, h0 * D, HQ - h0, qw_ptr, pos, table_ptr, eps,
                             HT, D, DP, ROT, NCOARSE, FP32_ANGLES, ROPE_SCALE)
        d = tl.arange(0, DP)[None, :]
        dst = q_out_ptr + t64 * stride_qt + (h0 + hh) * stride_qh + d * stride_qd
        tl.store(dst, y.to(q_out_ptr.dtype.element_ty), mask=mask)
    elif tile < NQ + NKV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if (slot >= 0) & (slot < num_slots):
            h0 = (tile - NQ) * HT
            page = slot // BLOCK
            off = slot % BLOCK
            k_scale, v_scale = kv_scales(k_scale_ptr, v_scale_ptr, HAS_SCALE)
            k, mask = _norm_rope(row, stride_xc, (HQ + h0) * D, HKV - h0, kw_ptr, pos,
                                 table_ptr, eps, HT, D, DP, ROT, NCOARSE, FP32_ANGLES, ROPE_SCALE)
            d = tl.arange(0, DP)[None, :]
            dst = (k_cache_ptr + page * stride_kcp + off * stride_kcb + (h0 + hh) * stride_kch
                   + d * stride_kcd)
            tl.store(dst, saturate_to(k / k_scale, k_cache_ptr.dtype.element_ty, KV_SATURATE),
                     mask=mask)
            v = tl.load(row + ((HQ + HKV + h0 + hh) * D + d) * stride_xc, mask=mask)
            dst = (v_cache_ptr + page * stride_vcp + off * stride_vcb + (h0 + hh) * stride_vch
                   + d * stride_vcd)
            tl.store(dst, saturate_to(v.to(tl.float32) / v_scale,
                                      v_cache_ptr.dtype.element_ty, KV_SATURATE), mask=mask)
    elif tile < NQ + NKV + NI:
        h0 = (tile - NQ - NKV) * HT
        y, mask = _norm_rope(row, stride_xc, (HQ + 2 * HKV) * D + h0 * DI, H - h0, iqw_ptr, pos,
                             table_ptr, eps, HT, DI, DIP, ROT, NCOARSE, FP32_ANGLES, ROPE_SCALE)
        d = tl.arange(0, DIP)[None, :]
        dst = iq_out_ptr + t64 * stride_it + (h0 + hh) * stride_ih + d * stride_id
        tl.store(dst, saturate_to(y, iq_out_ptr.dtype.element_ty, IQ_SATURATE), mask=mask)
    else:
        slot = tl.load(index_slot_ptr + t).to(tl.int64)
        in_cache = (slot >= 0) & (slot < num_index_slots)
        if INDEX_NVFP4:
            if in_cache:
                # a one-row tile: the quantizer takes the key as [128] (DI == IBLOCK == 128)
                y, _ = _norm_rope(row, stride_xc, (HQ + 2 * HKV) * D + H * DI, 1, ikw_ptr, pos,
                                  table_ptr, eps, 1, DI, DIP, ROT, NCOARSE, FP32_ANGLES,
                                  ROPE_SCALE)
                nvfp4_store(index_cache_ptr + (slot // IBLOCK) * stride_icp, slot % IBLOCK,
                            tl.reshape(y, (DIP,)))
        elif in_cache:
            y, mask = _norm_rope(row, stride_xc, (HQ + 2 * HKV) * D + H * DI, 1, ikw_ptr, pos,
                                 table_ptr, eps, HT, DI, DIP, ROT, NCOARSE, FP32_ANGLES, ROPE_SCALE)
            d = tl.arange(0, DIP)[None, :]
            dst = (index_cache_ptr + (slot // IBLOCK) * stride_icp + (slot % IBLOCK) * stride_icb
                   + hh * 0 + d * stride_icd)
            tl.store(dst, saturate_to(y, index_cache_ptr.dtype.element_ty, INDEX_SATURATE),
                     mask=mask)
