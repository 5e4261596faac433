# SPDX-License-Identifier: Apache-2.0
"""Triton kernels of the selection: top-K blocks per (token, index head) from a score row.

Each score maps to an int32 key whose integer order is the score's order (`score_key`; forced
blocks get the largest key, blocks that do not exist the smallest). A row is cut into SEG-wide
segments, one program each (`_segment_topk_kernel`, grid (T, H, segments)); with one segment that
program writes the answer itself, otherwise it writes its best K as candidates (packed with their
block ids, `pack_key`, in block order) and `_merge_topk_kernel` picks the best K of the
segments' candidates. Splitting the row lets a single 1M-token request (8192 blocks) use many
programs instead of one.

Both pick by threshold, not by sorting (`_threshold_select`): a bitwise binary search finds the
K-th largest key (one compare and one count over the row per bit, stopping as soon as exactly K
keys reach the threshold), then every key above it is taken, and of the keys equal to it the
lowest blocks (a running count in block order), which is MSA's tie rule. The picked blocks come
out in ascending order by a running count as well, so nothing is sorted. On long segments
(CAP > 0) the keys that can be picked at all (those reaching a lower bound, the K-th largest of
NG group maxima) are first packed into a CAP-slot scratch row, and the search runs on those few.
That is the throughput path (prefill: tens of thousands of rows, one warp each). With few
programs (decode at small batch) one program's latency matters instead, and Triton's bitonic
`tl.topk` on the packed keys (no chain of row-wide counts) is faster: `BY_SORT`, chosen by
plan.py from the program count.
Bytes: reads n * 4 bytes of scores per row (+ segments * KP * 8 of candidates), writes K * 4.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ...common.triton_utils import (EMPTY_KEY, FORCED_SCORE_KEY, pack_key, score_key,
                                   token_position, unpack_block)

# the int32 key of a block that does not exist: below every real key (-inf's is 0x807FFFFF)
DEAD_KEY = tl.constexpr(-(2 ** 31))


@triton.jit
def _causal_blocks(cu_ptr, seq_lens_ptr, num_requests, table_width, t, BLOCK: tl.constexpr,
                   num_tokens):
    """n = p // B + 1 for token t of the step's num_tokens tokens; 0 for padding (so n <=
    table_width, the score rows' width). Requests of equal q_len hold token t in request
    t * R // T (see find_request)."""
    guess = (t.to(tl.int64) * num_requests // num_tokens).to(tl.int32)
    _, pos = token_position(cu_ptr, seq_lens_ptr, num_requests, num_tokens, table_width,
                            t, guess, BLOCK)
    return tl.where(pos >= 0, pos // BLOCK + 1, 0)


@triton.jit
def _kth_key(key, TOPK: tl.constexpr, GROUPS: tl.constexpr):
    """The TOPK-th largest of the int32 `key` [N], counting equal keys separately (DEAD_KEY when
    fewer than TOPK entries are live). GROUPS >= TOPK, a power of two dividing N."""
    # work in unsigned order (x ^ DEAD_KEY maps the signed order onto it). The K-th largest key
    # lies between the smallest of GROUPS group maxima (each group holds a key at least that
    # large, so GROUPS >= K keys do) and the largest key: the bits those two bounds share are
    # the answer's, and the search starts below them (about half of the 32 bits on real scores)
    grouped = tl.reshape(key, [GROUPS, key.shape[0] // GROUPS], can_reorder=True)
    low = tl.min(tl.max(grouped, axis=1), axis=0) ^ DEAD_KEY
    high = tl.max(key, axis=0) ^ DEAD_KEY
    differ = low ^ high
    # the highest bit where they differ (-1: equal bounds, the answer is known); shift amounts
    # stay in [0, 31] (an out-of-range shift is undefined even where its result is unused)
    bit = 31
    while (bit >= 0) & (((differ >> tl.maximum(bit, 0)) & 1) == 0):
        bit -= 1
    # the bits above it are known (at bit 31, 2 << 31 wraps to 0: none are)
    prefix = high & tl.where(bit >= 0, ~((2 << tl.maximum(bit, 0)) - 1), -1)
    # then bit by bit from there: the largest t with count(key >= t) >= TOPK
    searching = bit >= 0
    while searching:
        cand = prefix | (1 << bit)
        count = tl.sum((key >= (cand ^ DEAD_KEY)).to(tl.int32), axis=0)
        prefix = tl.where(count >= TOPK, cand, prefix)
        bit -= 1
        # stop early once exactly K keys reach it: the lower bits cannot change the set
        searching = (bit >= 0) & (count != TOPK)
    return prefix ^ DEAD_KEY


@triton.jit
def _threshold_select(key, TOPK: tl.constexpr, GROUPS: tl.constexpr):
    """Mask of the TOPK largest entries of the int32 `key` [N] (DEAD_KEY entries never; fewer
    than TOPK live entries: all of them); of equal keys the earliest win. GROUPS >= TOPK, a
    power of two dividing N."""
    thresh = _kth_key(key, TOPK, GROUPS)
    above = key > thresh
    tied = (key == thresh) & (key != DEAD_KEY)
    need = TOPK - tl.sum(above.to(tl.int32), axis=0)
    return above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))


@triton.jit
def _store_in_order(out_row, stride_ok, picked, blocks, TOPK: tl.constexpr, KP: tl.constexpr):
    """The picked blocks (given in ascending order) into out_row[0:count], then -1 up to TOPK."""
    slot = tl.cumsum(picked.to(tl.int32), axis=0) - 1
    tl.store(out_row + slot * stride_ok, blocks, mask=picked)
    count = tl.sum(picked.to(tl.int32), axis=0)
    slots = tl.arange(0, KP)
    tl.store(out_row + slots * stride_ok, tl.full([KP], -1, tl.int32),
             mask=(slots >= count) & (slots < TOPK))


@triton.jit
def _write_picked(out_row, stride_ok, cand_row, picked, packed, blocks, TOPK: tl.constexpr,
                  KP: tl.constexpr, SINGLE: tl.constexpr):
    """The threshold path's output: with one segment the picked blocks (in ascending order) into
    the row; otherwise their packed keys as this segment's candidates, in block order, then
    EMPTY_KEY up to KP."""
    if SINGLE:
        _store_in_order(out_row, stride_ok, picked, blocks, TOPK, KP)
    else:
        slot = tl.cumsum(picked.to(tl.int32), axis=0) - 1
        tl.store(cand_row + slot, packed, mask=picked)
        count = tl.sum(picked.to(tl.int32), axis=0)
        slots = tl.arange(0, KP)
        tl.store(cand_row + slots, tl.full([KP], EMPTY_KEY, tl.int64), mask=slots >= count)


@triton.jit
def _write_ascending(out_row, stride_ok, best, TOPK: tl.constexpr, KP: tl.constexpr):
    """The sort path's output: the first TOPK packed keys of `best` (descending) as ascending
    block ids, then -1."""
    slots = tl.arange(0, KP)
    keep = (slots < TOPK) & (best != EMPTY_KEY)
    blocks = tl.sort(tl.where(keep, unpack_block(best), 2**31 - 1))
    tl.store(out_row + slots * stride_ok, tl.where(blocks == 2**31 - 1, -1, blocks),
             mask=slots < TOPK)


@triton.jit
def _segment_keys(row, b, n, stride_sb, INIT: tl.constexpr, LOCAL: tl.constexpr):
    """The int32 keys of blocks b of a score row (forced blocks the largest, blocks past the
    row's n causal ones DEAD_KEY) and which of them exist."""
    live = b < n
    s = tl.load(row + b.to(tl.int64) * stride_sb, mask=live, other=float("-inf"))
    forced = (b < INIT) | (b >= n - LOCAL)
    key = tl.where(forced, FORCED_SCORE_KEY, score_key(s))
    return tl.where(live, key, DEAD_KEY), live


@triton.jit
def _read_candidates(scratch_row, n_cand, CAP: tl.constexpr):
    """The n_cand packed keys a program stored in its scratch row, as [CAP] packed keys
    (EMPTY_KEY past n_cand) and their int32 keys (DEAD_KEY there); the barrier orders the
    other threads' stores before the loads."""
    tl.debug_barrier()  # the packed keys are read back by other threads
    c = tl.arange(0, CAP)
    packed = tl.load(scratch_row + c, mask=c < n_cand, other=EMPTY_KEY)
    return packed, tl.where(packed == EMPTY_KEY, DEAD_KEY, (packed >> 32).to(tl.int32))


@triton.jit
def _chunked_select(row, seg_base, n, stride_sb, out_row, stride_ok, cand_row, scratch_row,
                    TOPK: tl.constexpr, KP: tl.constexpr, INIT: tl.constexpr,
                    LOCAL: tl.constexpr, SEG: tl.constexpr, CH: tl.constexpr,
                    CAP: tl.constexpr, NG: tl.constexpr, SINGLE: tl.constexpr):
    """The threshold path on a SEG-block segment read in SEG // CH chunks, so that no tensor is
    SEG wide: the registers of a one-warp program (~160 at SEG = 1024 read whole) are what
    limit the programs per SM. Same result as the whole-segment path: the K-th largest of NG
    group maxima bounds the answer; the keys reaching it are packed into the CAP-slot scratch
    row (chunk by chunk, in block order) and searched there; more than CAP of them (ties, -inf
    rows) fall back to a bit search whose counts re-read the chunks (slow, and rare)."""
    NCH: tl.constexpr = SEG // CH
    GPC: tl.constexpr = NG // NCH  # groups per chunk
    c_idx = tl.arange(0, CH)
    chunk_of = tl.arange(0, NCH)[:, None]
    gm = tl.full([NCH, GPC], DEAD_KEY, tl.int32)
    for ci in range(NCH):
        key, _ = _segment_keys(row, seg_base + ci * CH + c_idx, n, stride_sb, INIT, LOCAL)
        gmc = tl.max(tl.reshape(key, [GPC, CH // GPC], can_reorder=True), axis=1)
        gm = tl.where(chunk_of == ci, gmc[None, :], gm)
    bound = _kth_key(tl.reshape(gm, [NG], can_reorder=True), TOPK, KP)
    n_cand = 0
    for ci in range(NCH):
        b = seg_base + ci * CH + c_idx
        key, live = _segment_keys(row, b, n, stride_sb, INIT, LOCAL)
        cand = (key >= bound) & live
        slot = n_cand + tl.cumsum(cand.to(tl.int32), axis=0) - 1
        tl.store(scratch_row + slot, pack_key(key, b), mask=cand & (slot < CAP))
        n_cand += tl.sum(cand.to(tl.int32), axis=0)
    if n_cand <= CAP:
        packed, ckey = _read_candidates(scratch_row, n_cand, CAP)
        _write_picked(out_row, stride_ok, cand_row, _threshold_select(ckey, TOPK, KP),
                      packed, unpack_block(packed), TOPK, KP, SINGLE)
    else:
        # the K-th largest key by a bit search over all 32 bits (unsigned order, as _kth_key),
        # each count summed over the chunks
        prefix = 0
        bit = 31
        searching = True
        while searching:
            cand_t = prefix | (1 << bit)
            count = 0
            for ci in range(NCH):
                key, _ = _segment_keys(row, seg_base + ci * CH + c_idx, n, stride_sb, INIT,
                                       LOCAL)
                count += tl.sum((key >= (cand_t ^ DEAD_KEY)).to(tl.int32), axis=0)
            prefix = tl.where(count >= TOPK, cand_t, prefix)
            bit -= 1
            searching = (bit >= 0) & (count != TOPK)
        thresh = prefix ^ DEAD_KEY
        n_above = 0
        for ci in range(NCH):
            key, _ = _segment_keys(row, seg_base + ci * CH + c_idx, n, stride_sb, INIT, LOCAL)
            n_above += tl.sum((key > thresh).to(tl.int32), axis=0)
        need = TOPK - n_above
        # then the picked blocks in block order: every key above, and of the keys equal to the
        # threshold the first `need` (running counts across the chunks)
        n_tied = 0
        n_picked = 0
        for ci in range(NCH):
            b = seg_base + ci * CH + c_idx
            key, _ = _segment_keys(row, b, n, stride_sb, INIT, LOCAL)
            tied = (key == thresh) & (key != DEAD_KEY)
            picked = (key > thresh) | (tied & (n_tied + tl.cumsum(tied.to(tl.int32), axis=0)
                                               <= need))
            slot = n_picked + tl.cumsum(picked.to(tl.int32), axis=0) - 1
            if SINGLE:
                tl.store(out_row + slot * stride_ok, b, mask=picked)
            else:
                tl.store(cand_row + slot, pack_key(key, b), mask=picked)
            n_tied += tl.sum(tied.to(tl.int32), axis=0)
            n_picked += tl.sum(picked.to(tl.int32), axis=0)
        slots = tl.arange(0, KP)
        if SINGLE:
            tl.store(out_row + slots * stride_ok, tl.full([KP], -1, tl.int32),
                     mask=(slots >= n_picked) & (slots < TOPK))
        else:
            tl.store(cand_row + slots, tl.full([KP], EMPTY_KEY, tl.int64),
                     mask=slots >= n_picked)


@triton.jit
def _segment_topk_kernel(scores_ptr, cu_ptr, seq_lens_ptr, out_ptr, cand_ptr, scratch_ptr,
                         num_requests, table_width, num_segments, stride_st, stride_sh,
                         stride_sb, stride_ot, stride_oh, stride_ok, TOPK: tl.constexpr,
                         KP: tl.constexpr,
                         INIT: tl.constexpr, LOCAL: tl.constexpr, BLOCK: tl.constexpr,
                         SEG: tl.constexpr, SINGLE: tl.constexpr, BY_SORT: tl.constexpr,
                         CAP: tl.constexpr, NG: tl.constexpr, PDL: tl.constexpr = False,
                         CH: tl.constexpr = 0):
    segment_topk(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0),
                 tl.num_programs(1), scores_ptr, cu_ptr, seq_lens_ptr, out_ptr, cand_ptr,
                 scratch_ptr, num_requests, table_width, num_segments, stride_st, stride_sh,
                 stride_sb, stride_ot, stride_oh, stride_ok, TOPK, KP, INIT, LOCAL, BLOCK, SEG,
                 SINGLE, BY_SORT, CAP, NG, PDL, CH)


@triton.jit
def segment_topk(t, h, seg, num_tokens, num_heads, scores_ptr, cu_ptr, seq_lens_ptr, out_ptr,
                 cand_ptr, scratch_ptr, num_requests, table_width, num_segments, stride_st,
                 stride_sh, stride_sb, stride_ot, stride_oh, stride_ok, TOPK: tl.constexpr,
                 KP: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
                 BLOCK: tl.constexpr, SEG: tl.constexpr, SINGLE: tl.constexpr,
                 BY_SORT: tl.constexpr, CAP: tl.constexpr, NG: tl.constexpr,
                 PDL: tl.constexpr, CH: tl.constexpr):
    """Program (t, h, seg) of the segment launch (the module's docstring) for a step of
    num_tokens tokens and num_heads index heads."""
    n = _causal_blocks(cu_ptr, seq_lens_ptr, num_requests, table_width, t, BLOCK, num_tokens)
    if PDL:
        # launched while the scoring launch was still running (programmatic dependent launch):
        # the step's offsets above are inputs, but the scores (and every write) wait until that
        # launch has finished and its stores are visible. This launch lets the merge launch
        # start early in turn.
        gdc_wait()
        gdc_launch_dependents()
    slots = tl.arange(0, KP)
    out_row = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh
    if n <= TOPK:
        # every causal block, ascending, then -1 (the first segment writes it; no scores read)
        if seg == 0:
            tl.store(out_row + slots * stride_ok, tl.where(slots < n, slots, -1),
                     mask=slots < TOPK)
    elif (CH > 0) & (CAP > 0) & (not BY_SORT):
        # the same selection, read in chunks (fewer registers: more programs per SM)
        row = scores_ptr + t.to(tl.int64) * stride_st + h * stride_sh
        base = ((t.to(tl.int64) * num_heads + h) * num_segments + seg) * KP
        row_scratch = scratch_ptr + ((t.to(tl.int64) * num_heads + h) * num_segments
                                     + seg) * CAP
        _chunked_select(row, seg * SEG, n, stride_sb, out_row, stride_ok, cand_ptr + base,
                        row_scratch, TOPK, KP, INIT, LOCAL, SEG, CH, CAP, NG, SINGLE)
    else:
        b = seg * SEG + tl.arange(0, SEG)
        row = scores_ptr + t.to(tl.int64) * stride_st + h * stride_sh
        key, live = _segment_keys(row, b, n, stride_sb, INIT, LOCAL)
        base = ((t.to(tl.int64) * num_heads + h) * num_segments + seg) * KP
        if BY_SORT:
            best = tl.topk(tl.where(live, pack_key(key, b), EMPTY_KEY), KP)  # descending
            if SINGLE:
                _write_ascending(out_row, stride_ok, best, TOPK, KP)
            else:
                tl.store(cand_ptr + base + slots, best)
        elif CAP > 0:
            # the K-th largest of NG group maxima bounds the answer from below (K groups hold a
            # key at least that large): only keys reaching it can be picked, usually a few dozen
            # of the SEG, so they are packed into this program's CAP-slot scratch row (in block
            # order) and searched there instead of the whole segment
            group_max = tl.max(tl.reshape(key, [NG, SEG // NG], can_reorder=True), axis=1)
            cand = (key >= _kth_key(group_max, TOPK, KP)) & live
            n_cand = tl.sum(cand.to(tl.int32), axis=0)
            if n_cand <= CAP:
                row_scratch = scratch_ptr + ((t.to(tl.int64) * num_heads + h) * num_segments
                                             + seg) * CAP
                tl.store(row_scratch + tl.cumsum(cand.to(tl.int32), axis=0) - 1,
                         pack_key(key, b), mask=cand)
                packed, ckey = _read_candidates(row_scratch, n_cand, CAP)
                _write_picked(out_row, stride_ok, cand_ptr + base,
                              _threshold_select(ckey, TOPK, KP), packed,
                              unpack_block(packed), TOPK, KP, SINGLE)
            else:
                # too many keys reach the bound (ties, -inf rows): search the whole segment
                _write_picked(out_row, stride_ok, cand_ptr + base,
                              _threshold_select(key, TOPK, KP), pack_key(key, b), b,
                              TOPK, KP, SINGLE)
        else:
            _write_picked(out_row, stride_ok, cand_ptr + base,
                          _threshold_select(key, TOPK, KP), pack_key(key, b), b, TOPK,
                          KP, SINGLE)


@triton.jit
def _merge_topk_kernel(cand_ptr, cu_ptr, seq_lens_ptr, out_ptr, num_requests, table_width,
                       num_segments, stride_ot, stride_oh, stride_ok, TOPK: tl.constexpr,
                       KP: tl.constexpr,
                       BLOCK: tl.constexpr, SEG: tl.constexpr, CANDP: tl.constexpr,
                       BY_SORT: tl.constexpr, PDL: tl.constexpr = False):
    merge_topk(tl.program_id(0), tl.program_id(1), tl.num_programs(0), tl.num_programs(1),
               cand_ptr, cu_ptr, seq_lens_ptr, out_ptr, num_requests, table_width,
               num_segments, stride_ot, stride_oh, stride_ok, TOPK, KP, BLOCK, SEG, CANDP,
               BY_SORT, PDL)


@triton.jit
def merge_topk(t, h, num_tokens, num_heads, cand_ptr, cu_ptr, seq_lens_ptr, out_ptr,
               num_requests, table_width, num_segments, stride_ot, stride_oh, stride_ok,
               TOPK: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, SEG: tl.constexpr,
               CANDP: tl.constexpr, BY_SORT: tl.constexpr, PDL: tl.constexpr):
    """Row (t, h) of the merge launch: the best TOPK of the row's segments' candidates."""
    n = _causal_blocks(cu_ptr, seq_lens_ptr, num_requests, table_width, t, BLOCK, num_tokens)
    if PDL:
        gdc_wait()  # the segment launch's candidates (see _segment_topk_kernel)
    if n > TOPK:
        # segments past the row's causal blocks wrote nothing: read only those that exist. On
        # the threshold path the candidates are in ascending block order (segments in order,
        # each in block order), so the earliest of equal keys is the lowest block (the tie rule);
        # the sort path's packed keys carry the rule themselves
        live_segs = (n + SEG - 1) // SEG
        c = tl.arange(0, CANDP)
        base = (t.to(tl.int64) * num_heads + h) * num_segments * KP
        packed = tl.load(cand_ptr + base + c, mask=c < live_segs * KP, other=EMPTY_KEY)
        out_row = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh
        if BY_SORT:
            _write_ascending(out_row, stride_ok, tl.topk(packed, KP), TOPK, KP)
        else:
            key = tl.where(packed == EMPTY_KEY, DEAD_KEY, (packed >> 32).to(tl.int32))
            picked = _threshold_select(key, TOPK, KP)
            _store_in_order(out_row, stride_ok, picked, unpack_block(packed), TOPK, KP)


# The group-bound path for long rows (plan.py, IndexerConfig.group.min_blocks): a row of n
# blocks is read once by a wide, memory-bound launch that reduces it to ceil(n / GS) group
# maxima of keys, and one program per row then needs two dependent reads instead of a chain per
# segment: the K-th largest
# group maximum bounds the answer from below (K groups hold a key at least that large), so only
# the groups reaching it (usually about K of them) can hold a picked block, and of their blocks
# only those whose key reaches it too. Those, packed in block order into the row's scratch
# slots, are the candidates of an exact threshold selection (tie rule included). More than CG
# such groups (ties, -inf rows) fall back to the chunked search of the whole row, more than CAP
# such blocks to the search over the groups' blocks.


@triton.jit
def _group_max_kernel(scores_ptr, cu_ptr, seq_lens_ptr, gmax_ptr, num_requests, table_width,
                      stride_st, stride_sh, stride_sb, stride_gt, stride_gh, TOPK: tl.constexpr,
                      INIT: tl.constexpr, LOCAL: tl.constexpr, BLOCK: tl.constexpr,
                      GS: tl.constexpr, GB: tl.constexpr):
    """gmax[t, h, g] = the largest key of blocks [g * GS, g * GS + GS) of score row (t, h) (forced
    blocks the largest key, blocks past n DEAD_KEY), for the GB groups of program (t, h, i); rows
    of at most TOPK blocks are skipped (every block is picked, nothing is read)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    n = _causal_blocks(cu_ptr, seq_lens_ptr, num_requests, table_width, t, BLOCK,
                       tl.num_programs(0))
    g = tl.program_id(2) * GB + tl.arange(0, GB)
    if (n > TOPK) & (tl.program_id(2) * GB * GS < n):
        b = g[:, None] * GS + tl.arange(0, GS)[None, :]
        row = scores_ptr + t.to(tl.int64) * stride_st + h * stride_sh
        key, _ = _segment_keys(row, b, n, stride_sb, INIT, LOCAL)
        tl.store(gmax_ptr + t.to(tl.int64) * stride_gt + h * stride_gh + g, tl.max(key, axis=1),
                 mask=g * GS < n)


@triton.jit
def _group_bound_select_kernel(scores_ptr, cu_ptr, seq_lens_ptr, gmax_ptr, out_ptr, scratch_ptr,
                               num_requests, table_width, stride_st, stride_sh, stride_sb,
                               stride_gt, stride_gh, stride_ot, stride_oh, stride_ok,
                               TOPK: tl.constexpr,
                               KP: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
                               BLOCK: tl.constexpr, GS: tl.constexpr, NGP: tl.constexpr,
                               CG: tl.constexpr, CAP: tl.constexpr, CH: tl.constexpr):
    """The top-K of row (t, h) from its NGP-padded group maxima (see above); scratch: CAP int64
    slots for this row (candidate group ids here, or the fallback's packed keys)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    n = _causal_blocks(cu_ptr, seq_lens_ptr, num_requests, table_width, t, BLOCK,
                       tl.num_programs(0))
    out_row = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh
    slots = tl.arange(0, KP)
    if n <= TOPK:
        tl.store(out_row + slots * stride_ok, tl.where(slots < n, slots, -1), mask=slots < TOPK)
    else:
        row = scores_ptr + t.to(tl.int64) * stride_st + h * stride_sh
        scratch_row = scratch_ptr + (t.to(tl.int64) * num_heads + h) * CAP
        g = tl.arange(0, NGP)
        ng = (n + GS - 1) // GS
        gm = tl.load(gmax_ptr + t.to(tl.int64) * stride_gt + h * stride_gh + g, mask=g < ng,
                     other=DEAD_KEY)
        bound = _kth_key(gm, TOPK, KP)
        reach = (gm >= bound) & (g < ng)
        n_groups = tl.sum(reach.to(tl.int32), axis=0)
        if n_groups <= CG:
            # the reaching groups' ids, ascending, through the scratch row
            tl.store(scratch_row + tl.cumsum(reach.to(tl.int32), axis=0) - 1, g.to(tl.int64),
                     mask=reach)
            tl.debug_barrier()  # written by other threads than those reading them back
            c = tl.arange(0, CG)
            gid = tl.load(scratch_row + c, mask=c < n_groups, other=-1).to(tl.int32)
            # their blocks in block order (groups ascending, blocks ascending in each)
            used = tl.reshape((gid >= 0)[:, None] & (tl.arange(0, GS) >= 0)[None, :], [CG * GS])
            # (an unused slot reads block 0, never picked: its key is DEAD_KEY below)
            b = tl.where(used, tl.reshape(gid[:, None] * GS + tl.arange(0, GS)[None, :],
                                          [CG * GS]), 0)
            key, live = _segment_keys(row, b, n, stride_sb, INIT, LOCAL)
            key = tl.where(used & live, key, DEAD_KEY)
            # of those, only the keys reaching the bound can be picked (usually a few dozen of
            # the CG * GS): packed into the scratch row (in block order) and searched there
            cand = (key >= bound) & (key != DEAD_KEY)
            n_cand = tl.sum(cand.to(tl.int32), axis=0)
            if n_cand <= CAP:
                tl.debug_barrier()  # every thread has read the group ids the row held
                tl.store(scratch_row + tl.cumsum(cand.to(tl.int32), axis=0) - 1,
                         pack_key(key, b), mask=cand)
                packed, ckey = _read_candidates(scratch_row, n_cand, CAP)
                _store_in_order(out_row, stride_ok, _threshold_select(ckey, TOPK, KP),
                                unpack_block(packed), TOPK, KP)
            else:
                _store_in_order(out_row, stride_ok, _threshold_select(key, TOPK, KP), b, TOPK,
                                KP)
        else:
            _chunked_select(row, 0, n, stride_sb, out_row, stride_ok, scratch_row, scratch_row,
                            TOPK, KP, INIT, LOCAL, NGP * GS, CH, CAP, NGP, True)
