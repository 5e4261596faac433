# SPDX-License-Identifier: Apache-2.0
"""Triton kernel of sparse attention for long requests (q_len > SMALL_Q: prefill chunks).

Grid (ceil(T / QT), Hkv): program (i, g) takes packed tokens [i*QT, (i+1)*QT) of every long
request overlapping them and runs QT tokens x G query heads = M rows of the matrix unit at once.
Neighbouring tokens of a prefill chunk mostly select the same blocks, so the program walks the
*union* of its tokens' selections (sorted, repeats removed, computed in registers up front) and
masks each block to the rows whose token selected it. Against one token per program this reads
each shared block once per tile instead of once per token and feeds M rows instead of G to each
matrix instruction.
Flops: 4 * Hq * D * |J| per token for the useful part; each union block costs M rows.
"""

import triton
import triton.language as tl

from ..common.triton_utils import find_request

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _attend_token_range(q_ptr, k_ptr, v_ptr, idx_ptr, bt_row_ptr, out_ptr, lse_ptr, t_begin,
                        t_end, t_req, seq_len, q_len, g, qk_scale, v_scale,
                        stride_qt, stride_qh, stride_qd, stride_kp, stride_kb, stride_kh,
                        stride_kd, stride_vp, stride_vb, stride_vh, stride_vd, stride_it,
                        stride_ih, stride_ik, stride_btb, stride_ot, stride_oh, stride_od,
                        stride_lt, stride_lh, NUM_KV_HEADS: tl.constexpr,
                        NUM_INDEX_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                        QT: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TOPK: tl.constexpr,
                        KP: tl.constexpr, HAS_SCALE: tl.constexpr, IEEE: tl.constexpr):
    M: tl.constexpr = QT * GP
    N: tl.constexpr = QT * KP
    rows = tl.arange(0, M)
    tok = t_begin + rows // GP  # [M]
    head = g * G + rows % GP
    row_live = (tok < t_end) & (rows % GP < G)
    pos = seq_len - q_len + (tok - t_req)  # [M]
    n_row = pos // BLOCK + 1
    d = tl.arange(0, D)
    offs = tl.arange(0, BLOCK)
    ih = g * NUM_INDEX_HEADS // NUM_KV_HEADS

    # each row's selection [M, KP], cleaned: entries < 0 or >= the row's n never match
    kk = tl.arange(0, KP)
    ids_rows = tl.load(idx_ptr + tok.to(tl.int64)[:, None] * stride_it + ih * stride_ih
                       + kk[None, :] * stride_ik, mask=row_live[:, None] & (kk[None, :] < TOPK),
                       other=-1)
    ids_rows = tl.where((ids_rows >= 0) & (ids_rows < n_row[:, None]), ids_rows, -1)

    # the union of the tile's selections: [QT * KP] ids (one row per token), sorted, first
    # occurrences compacted to the front
    e = tl.arange(0, N)
    e_tok = t_begin + e // KP
    e_k = e % KP
    e_n = (seq_len - q_len + (e_tok - t_req)) // BLOCK + 1
    ids = tl.load(idx_ptr + e_tok.to(tl.int64) * stride_it + ih * stride_ih + e_k * stride_ik,
                  mask=(e_tok < t_end) & (e_k < TOPK), other=-1)
    BIG: tl.constexpr = 2**31 - 1
    ids = tl.where((ids >= 0) & (ids < e_n), ids, BIG)
    ids = tl.sort(ids)
    # sorted: entry i is a first occurrence iff i equals the count of smaller entries
    smaller = tl.sum((ids[None, :] < ids[:, None]).to(tl.int32), axis=1)
    first = (smaller == e) & (ids != BIG)
    slot = tl.cumsum(first.to(tl.int32), axis=0) - 1
    num_blocks = tl.sum(first.to(tl.int32), axis=0)
    union = tl.sum(tl.where(first[None, :] & (slot[None, :] == e[:, None]), ids[None, :], 0),
                   axis=1)  # [N]: union[j] for j < num_blocks
    union_pages = tl.load(bt_row_ptr + union * stride_btb, mask=e < num_blocks, other=-1)

    q = tl.load(q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=row_live[:, None], other=0.0)  # [M, D]
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    for j in range(0, num_blocks):
        pick = e == j
        blk = tl.sum(tl.where(pick, union, 0), axis=0)
        page = tl.sum(tl.where(pick, union_pages, 0), axis=0).to(tl.int64)
        page_ok = page >= 0
        # rows whose token selected this block
        chosen = tl.max((ids_rows == blk).to(tl.int32), axis=1) > 0  # [M]
        key_pos = blk * BLOCK + offs
        k = tl.load(k_ptr + page * stride_kp + offs[:, None] * stride_kb + g * stride_kh
                    + d[None, :] * stride_kd, mask=page_ok, other=0.0)  # [BLOCK, D]
        v = tl.load(v_ptr + page * stride_vp + offs[:, None] * stride_vb + g * stride_vh
                    + d[None, :] * stride_vd, mask=page_ok, other=0.0)  # [BLOCK, D]
        # the own block's tail may never have been written: zero V past the last row's position
        v = tl.where((key_pos <= seq_len - 1)[:, None], v, 0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))  # [M, BLOCK]
        vis = chosen[:, None] & (key_pos[None, :] <= pos[:, None]) & page_ok
        s = tl.where(vis, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - shift[:, None])
        alpha = tl.exp2(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if HAS_SCALE:
        acc = acc * v_scale
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    tl.store(out_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
             + d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty), mask=row_live[:, None])
    tl.store(lse_ptr + tok.to(tl.int64) * stride_lt + head * stride_lh, lse, mask=row_live)


@triton.jit
def _sparse_attention_tile_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, cu_ptr, seq_lens_ptr, bt_ptr,
                                  out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr, sm_scale,
                                  num_requests, num_tokens,
                                  stride_qt, stride_qh, stride_qd,
                                  stride_kp, stride_kb, stride_kh, stride_kd,
                                  stride_vp, stride_vb, stride_vh, stride_vd,
                                  stride_it, stride_ih, stride_ik, stride_btr, stride_btb,
                                  stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
                                  NUM_KV_HEADS: tl.constexpr, NUM_INDEX_HEADS: tl.constexpr,
                                  G: tl.constexpr, GP: tl.constexpr, QT: tl.constexpr,
                                  D: tl.constexpr,
                                  BLOCK: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr,
                                  SMALL_Q: tl.constexpr, HAS_SCALE: tl.constexpr,
                                  IEEE: tl.constexpr):
    tile_begin = tl.program_id(0) * QT
    g = tl.program_id(1)
    tile_end = tl.minimum(tile_begin + QT, num_tokens)
    qk_scale = sm_scale * LOG2E
    v_scale = 1.0
    if HAS_SCALE:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    r = find_request(cu_ptr, num_requests, tile_begin)
    while r < num_requests:
        t_req = tl.load(cu_ptr + r)
        t_next = tl.load(cu_ptr + r + 1)
        if t_req >= tile_end:
            r = num_requests
        else:
            q_len = t_next - t_req
            seq_len = tl.load(seq_lens_ptr + r)
            if (q_len > SMALL_Q) & (seq_len >= q_len):
                _attend_token_range(
                    q_ptr, k_ptr, v_ptr, idx_ptr, bt_ptr + r.to(tl.int64) * stride_btr, out_ptr,
                    lse_ptr, tl.maximum(t_req, tile_begin), tl.minimum(t_next, tile_end), t_req,
                    seq_len, q_len, g, qk_scale, v_scale, stride_qt, stride_qh, stride_qd,
                    stride_kp, stride_kb, stride_kh, stride_kd, stride_vp, stride_vb, stride_vh,
                    stride_vd, stride_it, stride_ih, stride_ik, stride_btb, stride_ot,
                    stride_oh, stride_od, stride_lt, stride_lh, NUM_KV_HEADS, NUM_INDEX_HEADS,
                    G, GP, QT, D, BLOCK, TOPK, KP, HAS_SCALE, IEEE)
            r += 1
