# SPDX-License-Identifier: Apache-2.0
"""Triton kernels of the selection: top-K blocks per (token, index head) from a score row.

Each score is packed with its block id into one int64 whose order is (score, then lower block)
(`pack_score_key`), so keys are distinct and a plain top-k on them obeys the tie rule; forced
blocks get the largest keys. A row is cut into SEG-wide segments, one program each
(`_segment_topk_kernel`, grid (T, H, segments)), which keeps its segment's best KP keys with
Triton's bitonic top-k; with one segment that program writes the answer itself, otherwise
`_merge_topk_kernel` takes the best K of the segments' candidates. Splitting the row lets a
single 1M-token request (8192 blocks) use many programs instead of one.
Bytes: reads n * 4 bytes of scores per row (+ segments * KP * 8 of candidates), writes K * 4.
"""

import triton
import triton.language as tl

from ..common.triton_utils import (EMPTY_KEY, FORCED_SCORE_KEY, pack_score_key, token_position,
                                   unpack_block)


@triton.jit
def _causal_blocks(cu_ptr, seq_lens_ptr, num_requests, t, BLOCK: tl.constexpr):
    """n = p // B + 1 for token t; 0 for padding."""
    _, pos = token_position(cu_ptr, seq_lens_ptr, num_requests, t)
    return tl.where(pos >= 0, pos // BLOCK + 1, 0)


@triton.jit
def _write_ascending(out_row, stride_ok, best, TOPK: tl.constexpr, KP: tl.constexpr):
    """The first TOPK keys of `best` (descending) as ascending block ids, then -1."""
    slots = tl.arange(0, KP)
    keep = (slots < TOPK) & (best != EMPTY_KEY)
    blocks = tl.sort(tl.where(keep, unpack_block(best), 2**31 - 1))
    tl.store(out_row + slots * stride_ok, tl.where(blocks == 2**31 - 1, -1, blocks),
             mask=slots < TOPK)


@triton.jit
def _segment_topk_kernel(scores_ptr, cu_ptr, seq_lens_ptr, out_ptr, cand_ptr, num_requests,
                         num_segments, stride_st, stride_sh, stride_sb, stride_ot, stride_oh,
                         stride_ok, TOPK: tl.constexpr, KP: tl.constexpr, INIT: tl.constexpr,
                         LOCAL: tl.constexpr, BLOCK: tl.constexpr, SEG: tl.constexpr,
                         SINGLE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    seg = tl.program_id(2)
    num_heads = tl.num_programs(1)
    n = _causal_blocks(cu_ptr, seq_lens_ptr, num_requests, t, BLOCK)
    slots = tl.arange(0, KP)
    out_row = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh
    if n <= TOPK:
        # every causal block, ascending, then -1 (the first segment writes it; no scores read)
        if seg == 0:
            tl.store(out_row + slots * stride_ok, tl.where(slots < n, slots, -1),
                     mask=slots < TOPK)
    else:
        b = seg * SEG + tl.arange(0, SEG)
        live = b < n
        row = scores_ptr + t.to(tl.int64) * stride_st + h * stride_sh
        s = tl.load(row + b.to(tl.int64) * stride_sb, mask=live, other=float("-inf"))
        key = pack_score_key(s, b)
        forced = (b < INIT) | (b >= n - LOCAL)
        key = tl.where(forced, (FORCED_SCORE_KEY << 32) + (0xFFFFFFFF - b.to(tl.int64)), key)
        key = tl.where(live, key, EMPTY_KEY)
        best = tl.topk(key, KP)  # [KP], descending
        if SINGLE:
            _write_ascending(out_row, stride_ok, best, TOPK, KP)
        else:
            # candidates [T, H, segments, KP], contiguous
            base = ((t.to(tl.int64) * num_heads + h) * num_segments + seg) * KP
            tl.store(cand_ptr + base + slots, best)


@triton.jit
def _merge_topk_kernel(cand_ptr, cu_ptr, seq_lens_ptr, out_ptr, num_requests, num_segments,
                       stride_ot, stride_oh, stride_ok, TOPK: tl.constexpr, KP: tl.constexpr,
                       BLOCK: tl.constexpr, SEG: tl.constexpr, CANDP: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    n = _causal_blocks(cu_ptr, seq_lens_ptr, num_requests, t, BLOCK)
    if n > TOPK:
        # segments past the row's causal blocks wrote nothing: read only those that exist
        live_segs = (n + SEG - 1) // SEG
        c = tl.arange(0, CANDP)
        base = (t.to(tl.int64) * num_heads + h) * num_segments * KP
        key = tl.load(cand_ptr + base + c, mask=c < live_segs * KP, other=EMPTY_KEY)
        best = tl.topk(key, KP)
        _write_ascending(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh, stride_ok, best,
                         TOPK, KP)
