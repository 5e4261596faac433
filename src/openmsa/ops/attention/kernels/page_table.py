# SPDX-License-Identifier: Apache-2.0
"""Triton kernel that turns a selection into a page table for other paged-attention kernels.

One program per (token, KV head): its selection row (index head g*H//Hkv) is cleaned (entries
< 0, >= n or repeated dropped, and those whose table entry names no page: outside
[0, num_pages)), ordered full blocks ascending then the token's own block last,
and written as physical sub-page ids (page * B/S + j for sub-pages of S tokens). The row's context
length counts the full blocks' tokens plus the own block's causal ones, so a kernel that attends
one query row to `context_len` tokens through this table computes exactly MSA's set J.
Bytes: reads K ids and K page ids per row, writes K * B/S + 1 int32.
"""

import triton
import triton.language as tl

from ...common.triton_utils import token_position


@triton.jit
def _sparse_page_table_kernel(idx_ptr, cu_ptr, seq_lens_ptr, bt_ptr, pages_ptr, lens_ptr,
                              num_requests, table_width, num_pages, stride_it, stride_ih,
                              stride_ik, stride_btr, stride_btb, stride_pr, stride_pc,
                              NUM_KV_HEADS: tl.constexpr, NUM_INDEX_HEADS: tl.constexpr,
                              TOPK: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                              SUB: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    S: tl.constexpr = BLOCK // SUB
    # requests of equal q_len hold token t in request t * R // T (see find_request); the grid's
    # first dimension is T
    guess = (t.to(tl.int64) * num_requests // tl.num_programs(0)).to(tl.int32)
    r, pos = token_position(cu_ptr, seq_lens_ptr, num_requests, tl.num_programs(0), table_width,
                            t, guess, BLOCK)
    n = tl.where(pos >= 0, pos // BLOCK + 1, 0)
    r_safe = tl.minimum(r, num_requests - 1).to(tl.int64)
    kk = tl.arange(0, KP)
    ih = g * NUM_INDEX_HEADS // NUM_KV_HEADS
    ids = tl.load(idx_ptr + t.to(tl.int64) * stride_it + ih * stride_ih + kk * stride_ik,
                  mask=kk < TOPK, other=-1)
    ok = (ids >= 0) & (ids < n)
    earlier = kk[None, :] < kk[:, None]
    dup = tl.sum((earlier & (ids[None, :] == ids[:, None]) & ok[None, :]).to(tl.int32), axis=1) > 0
    ok = ok & ~dup
    # (n <= the table's width: an entry kept so far lies inside the table row)
    page = tl.load(bt_ptr + r_safe * stride_btr + tl.where(ok, ids, 0) * stride_btb, mask=ok,
                   other=0)  # [KP]
    ok = ok & (page >= 0) & (page < num_pages)
    # order: full blocks ascending, the own block (n - 1) after them, dropped entries last; each
    # entry's page (in [0, 2^31)) rides in the low half of its sort key
    own = ok & (ids == n - 1)
    key = tl.where(ok, tl.where(own, 2**30, ids), 2**31 - 1)
    packed = tl.sort((key.to(tl.int64) << 32) | tl.where(ok, page, 0).to(tl.int64))
    key = (packed >> 32).to(tl.int32)
    page = (packed & 0xFFFFFFFF).to(tl.int32)
    live = key != 2**31 - 1
    has_own = tl.sum(own.to(tl.int32), axis=0)
    num_full = tl.sum(live.to(tl.int32), axis=0) - has_own
    own_tokens = tl.where(has_own > 0, pos - (n - 1) * BLOCK + 1, 0)
    # [KP, S] sub-pages; the own block keeps only the sub-pages holding causal tokens
    j = tl.arange(0, S)
    is_own = (key == 2**30)[:, None]
    keep = live[:, None] & (~is_own | (j[None, :] * SUB < own_tokens))
    sub = tl.where(keep, page[:, None] * S + j[None, :], 0)
    col = kk[:, None] * S + j[None, :]
    row = t.to(tl.int64) * NUM_KV_HEADS + g
    tl.store(pages_ptr + row * stride_pr + col * stride_pc, sub, mask=col < TOPK * S)
    tl.store(lens_ptr + row, num_full * BLOCK + own_tokens)
