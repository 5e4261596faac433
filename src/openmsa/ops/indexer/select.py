# SPDX-License-Identifier: Apache-2.0
"""Triton kernel of the selection: top-K blocks per (token, index head) from a score row.

One program per (token, index head). Each score is packed with its block id into one int64 whose
order is (score, then lower block) (`pack_score_key`), so keys are distinct and the top K by a
plain sort obeys the tie rule. The row streams in CHUNK-wide pieces; a piece is sorted and merged
into the running top KP only when its best key beats the running K-th, which after the first
pieces is rare, so a long row costs about one read of its scores.
Bytes: reads n * 4 bytes of scores per row, writes K * 4.
"""

import triton
import triton.language as tl

from ..common.triton_utils import (EMPTY_KEY, FORCED_SCORE_KEY, find_request, pack_score_key,
                                   unpack_block)


@triton.jit
def _first_row(x, ROWS: tl.constexpr, KP: tl.constexpr):
    """Row 0 of x reshaped [ROWS, KP]: the first KP entries of a sorted vector."""
    x2 = tl.reshape(x, [ROWS, KP])
    r = tl.arange(0, ROWS)
    return tl.max(tl.where(r[:, None] == 0, x2, EMPTY_KEY), axis=0)


@triton.jit
def _select_topk_kernel(scores_ptr, cu_ptr, seq_lens_ptr, out_ptr, num_requests,
                        stride_st, stride_sh, stride_sb, stride_ot, stride_oh, stride_ok,
                        TOPK: tl.constexpr, KP: tl.constexpr, INIT: tl.constexpr,
                        LOCAL: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    r = find_request(cu_ptr, num_requests, t)
    n = 0
    if r < num_requests:
        t_req = tl.load(cu_ptr + r)
        q_len = tl.load(cu_ptr + r + 1) - t_req
        seq_len = tl.load(seq_lens_ptr + r)
        pos = seq_len - q_len + (t - t_req)
        # a request with q_len > seq_len is malformed: all its tokens are padding
        n = tl.where(seq_len >= q_len, pos // BLOCK + 1, 0)
    slots = tl.arange(0, KP)
    out_row = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh
    if n <= TOPK:
        # every causal block, ascending, then -1
        tl.store(out_row + slots * stride_ok, tl.where(slots < n, slots, -1), mask=slots < TOPK)
    else:
        row = scores_ptr + t.to(tl.int64) * stride_st + h * stride_sh
        best = tl.full([KP], EMPTY_KEY, tl.int64)
        # the running K-th best key: a piece must beat it to matter
        kth = EMPTY_KEY
        c = tl.arange(0, CHUNK)
        for start in range(0, n, CHUNK):
            b = start + c
            live = b < n
            s = tl.load(row + b.to(tl.int64) * stride_sb, mask=live, other=float("-inf"))
            key = pack_score_key(s, b)
            forced = (b < INIT) | (b >= n - LOCAL)
            key = tl.where(forced, (FORCED_SCORE_KEY << 32) + (0xFFFFFFFF - b.to(tl.int64)), key)
            key = tl.where(live, key, EMPTY_KEY)
            if tl.max(key, axis=0) > kth:
                top = _first_row(tl.sort(key, descending=True), CHUNK // KP, KP)
                both = tl.reshape(tl.join(best, top), [2 * KP])
                best = _first_row(tl.sort(both, descending=True), 2, KP)
                kth = tl.sum(tl.where(slots == TOPK - 1, best, 0), axis=0)
        # keep the first TOPK of the descending list, then write ascending block ids
        keep = (slots < TOPK) & (best != EMPTY_KEY)
        blocks = tl.where(keep, unpack_block(best), 2**31 - 1)
        blocks = tl.sort(blocks)
        tl.store(out_row + slots * stride_ok, tl.where(blocks == 2**31 - 1, -1, blocks),
                 mask=slots < TOPK)
