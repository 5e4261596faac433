# SPDX-License-Identifier: Apache-2.0
"""Triton kernels of sparse attention for prefill chunks: tiles of tokens over the union of their
selections.

Why: the per-token kernel (token.py) runs one token's G query heads (16 for M3) as the matrix
unit's rows and reads 16 blocks of K/V per (token, KV head); an 8K chunk then reads 32 GB of K/V
at TP1, almost all from L2, and that L2 traffic bounds it (docs/performance.md). Neighbouring
tokens of a prompt mostly select the same blocks (and always share their own block), so a tile
of QT consecutive tokens reads each block of the union of their selections once, for QT * G rows.

Three launches, all on fixed grids (no host synchronisation; CUDA-graph safe):
1. `_tile_plan_kernel`, grid (ceil(T / QT), Hkv): for tile i (packed tokens [i*QT, (i+1)*QT))
   and KV head g, the union of the tokens' selected pages, ascending, into a workspace, and
   blocks[i, g] = its size when the tile lies inside one request with valid positions and
   U * QT <= waste * (sum of the tokens' distinct selected pages), i.e. the rows multiplied
   against blocks their token did not select stay below `waste` times the useful ones; else -1.
2. `_sparse_attention_tile_kernel`: one program per (tile, KV head) item, or (PERSISTENT) a
   program per resident slot walking items with a stride; a taken item runs QT tokens x G heads
   = M rows against each union block.
3. The per-token kernel (token.py) with TILE_QT: skips tokens of taken tiles.
The plan is its own light launch (one warp per item) because the tile kernel's registers and
shared memory allow two programs per SM: planning inside it cost more than the separate launch
on chunks whose tiles all fall back. The tile kernel itself is bound by the latency of its
serial QK^T -> softmax -> PV chain, not by L2 (docs/performance.md).

Per union block, the rows whose token selected it see its keys up to their own causal cut; the
other rows see none (p = 0). Keys past every row's cut are not loaded (the own block's tail may
never have been written: a NaN there would reach P @ V as 0 * NaN). The union is walked in
ascending page order, a fixed order for fixed inputs: results are deterministic.
Flops: 4 * D * (QT * G rows) * 128 per union block; the useful part 4 * Hq * D * 128 * |J|
per token.
"""

import triton
import triton.language as tl

from ...common.triton_utils import tile_position
from .token import scaled_q

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
NO_PAGE: tl.constexpr = tl.constexpr(2**31 - 1)



@triton.jit
def _segment_or(start_a, a, start_b, b):
    """The combine of an OR scan that restarts where `start` is set (segments of a sorted run)."""
    return start_a | start_b, tl.where(start_b != 0, b, a | b)


@triton.jit
def _shift(x, by: tl.constexpr):
    """x[i - by] at i (clamped at the ends; the callers mask those positions)."""
    n: tl.constexpr = x.shape[0]
    i = tl.arange(0, n)
    return tl.gather(x, tl.minimum(tl.maximum(i - by, 0), n - 1), 0)


@triton.jit
def _tile_plan_kernel(idx_ptr, cu_ptr, seq_lens_ptr, bt_ptr, blocks_ptr, union_ptr,
                      num_requests, num_tokens, table_width, num_pages, stride_it, stride_ih,
                      stride_ik, stride_btr, stride_btb, waste, NUM_KV_HEADS: tl.constexpr,
                      NUM_INDEX_HEADS: tl.constexpr, QT: tl.constexpr, BLOCK: tl.constexpr,
                      TOPK: tl.constexpr, KP: tl.constexpr):
    # (waste after the strides: the launch plan passes it by keyword with the constexprs)
    tile = tl.program_id(0)
    g = tl.program_id(1)
    t0 = tile * QT
    N: tl.constexpr = QT * KP
    # (whole is false for a tile holding padding, a malformed request's tokens or any token of a
    # malformed step: those go to the per-token kernel, which gives them out = 0, lse = -inf)
    r, first_pos, whole = tile_position(cu_ptr, seq_lens_ptr, num_requests, num_tokens,
                                        table_width, t0, QT, BLOCK)
    ih = g * NUM_INDEX_HEADS // NUM_KV_HEADS
    # the tile's selections as N = QT * KP entries (token-major): page ids, NO_PAGE where the
    # entry is < 0, beyond the token's causal blocks, or maps to no page of the cache (< 0 or
    # >= num_pages: read nothing), so the tile kernels only read pages in [0, num_pages)
    e = tl.arange(0, N)
    e_pos = first_pos + e // KP
    e_ids = tl.load(idx_ptr + (t0 + e // KP).to(tl.int64) * stride_it + ih * stride_ih
                    + (e % KP) * stride_ik, mask=whole & (e % KP < TOPK), other=-1)
    e_ok = (e_ids >= 0) & (e_ids <= e_pos // BLOCK)
    e_pages = tl.load(bt_ptr + r.to(tl.int64) * stride_btr + tl.where(e_ok, e_ids, 0) * stride_btb,
                      mask=e_ok, other=-1)
    e_pages = tl.where(e_ok & (e_pages >= 0) & (e_pages < num_pages), e_pages, NO_PAGE)
    live = e_pages != NO_PAGE
    e_blk = tl.where(live, e_ids, -1)
    item = tile * NUM_KV_HEADS + g
    _plan_union(e, e_pages, e_blk, live, whole, waste, blocks_ptr, union_ptr, item, QT, KP)


@triton.jit
def _plan_union(e, e_pages, e_blk, live, whole, waste, blocks_ptr, union_ptr, item,
                QT: tl.constexpr, KP: tl.constexpr):
    """The tile's union from its N = QT * KP entries sorted by (page, entry), O(N log^2 N): a
    page's entries are then one run, in token order, so each question is about a neighbour.
    Per run: its first entry makes a union slot (ranked by page: ascending page order); an entry
    whose predecessor is its own token's is a repeated id (counted once in the useful blocks);
    a predecessor under another block id means a table mapping two of the request's blocks to
    one page, which would need two causal cuts for one page: such a tile goes to the per-token
    kernel. The tokens that selected a page are an OR over its run (a bit per token: QT <= 16).
    The tile is taken (its union size, else -1) when it lies inside one request with valid
    positions and union blocks x QT <= waste x useful blocks."""
    N: tl.constexpr = QT * KP
    key = tl.sort(e_pages.to(tl.int64) * N + e)  # NO_PAGE last
    s_e = (key % N).to(tl.int32)
    s_page = (key // N).to(tl.int32)
    s_tok = s_e // KP
    s_blk = tl.gather(e_blk, s_e, 0)
    s_live = s_page != NO_PAGE
    same_prev = (e > 0) & (_shift(s_page, 1) == s_page)
    first = s_live & ~same_prev
    last = s_live & ((e == N - 1) | (_shift(s_page, -1) != s_page))
    repeat = same_prev & (_shift(s_tok, 1) == s_tok)
    useful = tl.sum((s_live & ~repeat).to(tl.int32), axis=0)
    num_blocks = tl.sum(first.to(tl.int32), axis=0)
    aliased = tl.max((s_live & same_prev & (_shift(s_blk, 1) != s_blk)).to(tl.int32),
                     axis=0) > 0
    take = whole & (num_blocks * QT <= waste * useful) & ~aliased
    tl.store(blocks_ptr + item, tl.where(take, num_blocks, -1))
    # per run, the OR of its tokens' bits reaches its last entry; its slot is the run's rank
    _, bits = tl.associative_scan((first.to(tl.int32), (1 << s_tok).to(tl.int32)), 0,
                                  _segment_or)
    rank = tl.cumsum(first.to(tl.int32), 0) - 1
    slot = union_ptr + item.to(tl.int64) * (3 * N) + tl.where(last, rank, 0)
    tl.store(slot, s_page, mask=take & last)
    tl.store(slot + N, s_blk, mask=take & last)
    tl.store(slot + 2 * N, bits, mask=take & last)


@triton.jit
def _sparse_attention_tile_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, seq_lens_ptr, out_ptr, lse_ptr,
                                  blocks_ptr, union_ptr, k_scale_ptr, v_scale_ptr, sm_scale,
                                  num_requests, num_tokens, table_width, num_items,
                                  stride_qt, stride_qh, stride_qd,
                                  stride_kp, stride_kb, stride_kh, stride_kd,
                                  stride_vp, stride_vb, stride_vh, stride_vd,
                                  stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
                                  NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                                  QT: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                                  KP: tl.constexpr, SUB: tl.constexpr, HAS_SCALE: tl.constexpr,
                                  IEEE: tl.constexpr, F16_COMPUTE: tl.constexpr,
                                  PERSISTENT: tl.constexpr):
    M: tl.constexpr = QT * GP
    N: tl.constexpr = QT * KP
    PARTS: tl.constexpr = BLOCK // SUB
    if PERSISTENT:
        # (tile, KV head) items with a stride: a tile the plan left costs one load
        for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
            num_blocks = tl.load(blocks_ptr + item)
            if num_blocks >= 0:
                _attend_tile(q_ptr, k_ptr, v_ptr, cu_ptr, seq_lens_ptr, out_ptr, lse_ptr,
                             union_ptr, k_scale_ptr, v_scale_ptr, sm_scale, num_requests,
                             num_tokens, table_width, item, num_blocks, stride_qt, stride_qh,
                             stride_qd, stride_kp, stride_kb, stride_kh, stride_kd, stride_vp,
                             stride_vb, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
                             stride_lt, stride_lh, NUM_KV_HEADS, G, GP, QT, D, BLOCK, SUB,
                             HAS_SCALE, IEEE, F16_COMPUTE, M, N, PARTS)
    else:
        # one program per item: a tile the plan left exits after one load
        item = tl.program_id(0)
        num_blocks = tl.load(blocks_ptr + item)
        if num_blocks >= 0:
            _attend_tile(q_ptr, k_ptr, v_ptr, cu_ptr, seq_lens_ptr, out_ptr, lse_ptr, union_ptr,
                         k_scale_ptr, v_scale_ptr, sm_scale, num_requests, num_tokens, table_width,
                         item, num_blocks, stride_qt, stride_qh, stride_qd, stride_kp, stride_kb,
                         stride_kh, stride_kd, stride_vp, stride_vb, stride_vh, stride_vd,
                         stride_ot, stride_oh, stride_od, stride_lt, stride_lh, NUM_KV_HEADS, G, GP,
                         QT, D, BLOCK, SUB, HAS_SCALE, IEEE, F16_COMPUTE, M, N, PARTS)


@triton.jit
def _attend_tile(q_ptr, k_ptr, v_ptr, cu_ptr, seq_lens_ptr, out_ptr, lse_ptr, union_ptr,
                 k_scale_ptr, v_scale_ptr, sm_scale, num_requests, num_tokens, table_width, item,
                 num_blocks, stride_qt, stride_qh, stride_qd, stride_kp, stride_kb, stride_kh,
                 stride_kd, stride_vp, stride_vb, stride_vh, stride_vd, stride_ot, stride_oh,
                 stride_od, stride_lt, stride_lh, NUM_KV_HEADS: tl.constexpr, G: tl.constexpr,
                 GP: tl.constexpr, QT: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                 SUB: tl.constexpr, HAS_SCALE: tl.constexpr, IEEE: tl.constexpr,
                 F16_COMPUTE: tl.constexpr, M: tl.constexpr, N: tl.constexpr, PARTS: tl.constexpr):
    tile = item // NUM_KV_HEADS
    g = item % NUM_KV_HEADS
    # (64-bit: a head-major cache view can put the head offset past 2^31 elements)
    g64 = g.to(tl.int64)
    t0 = tile * QT
    # (the plan took this tile: it is whole)
    _, first_pos, _ = tile_position(cu_ptr, seq_lens_ptr, num_requests, num_tokens, table_width,
                                    t0, QT, BLOCK)
    union_row = union_ptr + tl.cast(item, tl.int64) * (3 * N)
    # rows: token-major, QT tokens x GP head slots
    rows = tl.arange(0, M)
    tok = t0 + rows // GP
    head = g * G + rows % GP
    head_ok = rows % GP < G
    pos = first_pos + rows // GP  # [M]
    ALL_TOKENS: tl.constexpr = (1 << QT) - 1

    d = tl.arange(0, D)
    offs = tl.arange(0, SUB)
    q = tl.load(q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=head_ok[:, None], other=0.0)  # [M, D]
    # fp8 K/V run the matrix unit in fp16, as in token.py (why: there)
    q, qk_scale = scaled_q(q, sm_scale, k_scale_ptr, F16_COMPUTE, HAS_SCALE)
    # the loop takes row maxima of the raw scores and applies the scale inside the exponent
    # (one FMA per score, not a multiply and an add); that needs a positive scale, so a
    # negative one moves its sign onto q (exact)
    q = tl.where(qk_scale < 0, -q, q)
    qk_scale = tl.abs(qk_scale)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    for step in range(0, num_blocks * PARTS):
        # the plan's slot: page, block id and which tokens selected it, as scalars, so the
        # step needs no reduction across the program (each one a barrier)
        j = step // PARTS
        page = tl.load(union_row + j)
        base = tl.load(union_row + N + j) * BLOCK
        bits = tl.load(union_row + 2 * N + j)
        # last visible offset per row (-1: its token did not select the block)
        cut_row = tl.where(((bits >> (rows // GP)) & 1) != 0, pos - base, -1)  # [M]
        # tokens are consecutive positions: the largest cut is the highest bit's token's, the
        # smallest the first token's when every token selected the block
        last = 0
        for k in tl.static_range(1, QT):
            last += (bits >= (1 << k)).to(tl.int32)
        max_cut = first_pos + last - base
        min_cut = tl.where(bits == ALL_TOKENS, first_pos - base, -1)
        key_off = (step % PARTS) * SUB + offs
        # keys past every row's cut are not read
        loaded = key_off <= max_cut
        p64 = page.to(tl.int64)
        # the page's address as one scalar, then 32-bit offsets inside it: one 64-bit add per
        # address instead of 64-bit products and sums per term (fewer instructions and
        # registers; checks.py bounds the offsets)
        k = tl.load(k_ptr + (p64 * stride_kp + g64 * stride_kh)
                    + (key_off[:, None] * stride_kb + d[None, :] * stride_kd),
                    mask=loaded[:, None], other=0.0)  # [SUB, D]
        v = tl.load(v_ptr + (p64 * stride_vp + g64 * stride_vh)
                    + (key_off[:, None] * stride_vb + d[None, :] * stride_vd),
                    mask=loaded[:, None], other=0.0)  # [SUB, D]
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))  # [M, SUB]
        # mask only a step some row does not see whole (a block some token did not select, or
        # a token's own block): most steps of a shared selection skip it
        if min_cut < (step % PARTS) * SUB + SUB - 1:
            s = tl.where(key_off[None, :] <= cut_row[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * qk_scale - shift[:, None])
        alpha = tl.exp2(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        m_i = m_new
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc + pv
    if HAS_SCALE:
        acc = acc * tl.load(v_scale_ptr)
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    tl.store(out_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
             + d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None])
    tl.store(lse_ptr + tok.to(tl.int64) * stride_lt + head * stride_lh, lse, mask=head_ok)
