# SPDX-License-Identifier: Apache-2.0
"""Gluon kernel of the selection for short score rows: one thread per (token, head) row.

select.py gives each row one warp: the row's keys are spread over the 32 lanes, so each step of
the threshold search is a warp-wide sum (a chain of shuffles), ~410 warp instructions per row on
rows of <= 64 blocks, and a launch of one-warp programs stops at 32 programs per SM. A prefill
chunk with little context is many such rows: an 8K chunk with no context at 4 index heads has
32768 rows of 1-64 blocks, and their selection took ~22 µs beside ~40 of scoring
(docs/performance.md, "Indexer prefill"). Here a thread holds a whole row of SEG <= 64 keys in
its registers (a [32 * num_warps, SEG] tile, SEG contiguous per thread), so every count of the
search is a sum inside one thread, and a warp searches 32 rows at once. Triton cannot be told to
lay a tile out that way (it spreads a 64-wide row over 16 lanes), hence Gluon.

Same selection as select.py's threshold path (read `_kth_key` and `_threshold_select` first):
keys from `score_key`, forced blocks the largest key, blocks past the row's n causal ones
DEAD_KEY; the K-th largest key found by a bitwise search that starts below the bits shared by
the row's largest key and a lower bound, and stops once exactly K keys reach the candidate;
every key above it is picked, and of the keys equal to it the lowest blocks (MSA's tie rule);
the picks are written in ascending order, then -1 up to K. The lower bound is the smallest of
G >= K group maxima (each group holds a key at least that large), taken over the groups that
hold a causal block when there are at least K of them, else the smallest causal key.

Used on Hopper with the Gluon the other kernels are tested on (api.py, `_short_rows_eligible`),
for launches of many rows (the threshold path) whose rows have at most 64 blocks; the
interpreter and everything else keep select.py.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# the int32 key of a block that does not exist (select.py's DEAD_KEY), of a forced block
# (triton_utils.FORCED_SCORE_KEY)
DEAD = gl.constexpr(-(2 ** 31))
FORCED = gl.constexpr(0x7FFFFFFF)


@gluon.jit
def _score_key(s):
    """triton_utils.score_key: an int32 whose integer order is the score's, NaN as -inf."""
    s = gl.where(s != s, float("-inf"), s)
    s = gl.where(s == 0.0, 0.0, s)
    bits = s.to(gl.int32, bitcast=True)
    return gl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@gluon.jit
def _top_bit(x):
    """The index of x's highest set bit, -1 for 0 (PTX bfind)."""
    return gl.inline_asm_elementwise("bfind.u32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _count_at_least(key, c):
    """Per row, how many of its keys are >= c (c per row, [rows, 1]). Written as PTX `set`
    (-1 or 0 per key) and a plain sum: summing the comparisons as booleans lets LLVM pack them
    into bit masks for a popcount, ~5 PTX instructions per key in the search's loop."""
    ge = gl.inline_asm_elementwise("set.ge.s32.s32 $0, $1, $2;", "=r,r,r", [key, c],
                                   dtype=gl.int32, is_pure=True, pack=1)
    return -gl.sum(ge, axis=1)


@gluon.jit
def _causal_blocks(cu_ptr, seq_lens_ptr, num_requests, t, BLOCK: gl.constexpr):
    """n = position // BLOCK + 1 of each packed token t (0 for padding: a token past cu[R], or
    of a request with q_len > seq_len); triton_utils.token_position, one binary search per
    thread over the R + 1 offsets."""
    lo = gl.zeros_like(t)
    hi = gl.zeros_like(t) + num_requests
    # floor(log2(R)) + 1 halvings empty any interval of R
    steps = 0
    left = num_requests
    while left > 0:
        left = left // 2
        steps += 1
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) // 2
        after = gl.load(cu_ptr + mid + 1, mask=active, other=0) > t
        hi = gl.where(active & after, mid, hi)
        lo = gl.where(active & (after == 0), mid + 1, lo)
    real = lo < num_requests
    t_req = gl.load(cu_ptr + lo, mask=real, other=0)
    q_len = gl.load(cu_ptr + lo + 1, mask=real, other=0) - t_req
    seq_len = gl.load(seq_lens_ptr + lo, mask=real, other=0)
    pos = gl.where(real & (seq_len >= q_len), seq_len - q_len + (t - t_req), -1)
    return gl.where(pos >= 0, pos // BLOCK + 1, 0)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _rank_in_order(x):
    """Per element of a [rows, SEG] 0/1 int32 tile, how many set elements of its row come up to
    and including it (inside each thread: a thread holds its row)."""
    return gl.associative_scan(x, 1, _add)


@gluon.jit
def _short_rows_topk_kernel(scores_ptr, cu_ptr, seq_lens_ptr, out_ptr, num_requests, num_rows,
                            max_blocks, stride_st, stride_sh, stride_sb, stride_ot, stride_oh,
                            stride_ok, H: gl.constexpr, TOPK: gl.constexpr, KP: gl.constexpr,
                            INIT: gl.constexpr, LOCAL: gl.constexpr, BLOCK: gl.constexpr,
                            G: gl.constexpr, W: gl.constexpr, VEC: gl.constexpr, TPR: gl.constexpr,
                            num_warps: gl.constexpr):
    # a row's SEG = G * W blocks in one thread's registers
    SEG: gl.constexpr = G * W
    row_l: gl.constexpr = gl.BlockedLayout([1, SEG // TPR], [32 // TPR, TPR], [num_warps, 1],
                                           [1, 0])
    r_l: gl.constexpr = gl.SliceLayout(1, row_l)
    ROWS: gl.constexpr = 32 // TPR * num_warps
    rows = gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=r_l)
    t = rows // H
    h = rows % H
    n = gl.where(rows < num_rows, _causal_blocks(cu_ptr, seq_lens_ptr, num_requests, t, BLOCK),
                 0)
    b = gl.expand_dims(gl.arange(0, SEG, layout=gl.SliceLayout(0, row_l)), 0)
    n2 = gl.expand_dims(n, 1)
    live = b < n2
    row = scores_ptr + t.to(gl.int64) * stride_st + h.to(gl.int64) * stride_sh
    # whole VEC-block pieces (one 16-byte load each for VEC = 4: the mask is constant over a
    # piece, the tail's extra blocks are inside the row when VEC divides its width, and the
    # keys past n ignore them); a causal count past the width reads nothing beyond it
    bound = gl.minimum(n2, max_blocks)
    s = gl.load(gl.expand_dims(row, 1) + b * stride_sb, mask=(b // VEC) * VEC < bound,
                other=float("-inf"))
    forced = (b < INIT) | (b >= n2 - LOCAL)
    key = gl.where(live, gl.where(forced, FORCED, _score_key(s)), DEAD)

    # the search, in unsigned order (x ^ DEAD maps the signed order onto it), from below the
    # bits the largest key shares with the lower bound; rows of at most TOPK causal blocks skip
    # it (prefix 0: the threshold is DEAD, so every causal block is picked)
    high = gl.max(key, axis=1) ^ DEAD
    # (a group past the causal blocks holds only DEAD keys: its maximum takes no part)
    group_max = gl.max(gl.reshape(key, [ROWS, G, W]), axis=2)
    low_groups = gl.convert_layout(gl.min(gl.where(group_max == DEAD, FORCED, group_max), axis=1),
                                   r_l)
    low_keys = gl.min(gl.where(live, key, FORCED), axis=1)
    live_groups = (n + (W - 1)) // W
    low = gl.where(live_groups >= TOPK, low_groups, low_keys) ^ DEAD
    bit = _top_bit(low ^ high)
    # the bits above it are known (at bit 31, 2 << 31 wraps to 0: none are)
    prefix = gl.where(bit >= 0, high & ~((2 << gl.maximum(bit, 0)) - 1), high)
    searching = (n > TOPK) & (bit >= 0)
    prefix = gl.where(n > TOPK, prefix, 0)
    while gl.max(searching.to(gl.int32), axis=0) > 0:
        cand = prefix | (1 << gl.maximum(bit, 0))
        count = _count_at_least(key, gl.expand_dims(cand ^ DEAD, 1))
        prefix = gl.where(searching & (count >= TOPK), cand, prefix)
        bit = gl.where(searching, bit - 1, bit)
        # stop once exactly K keys reach it: the lower bits cannot change the set
        searching = searching & (bit >= 0) & (count != TOPK)
    thresh = gl.expand_dims(prefix ^ DEAD, 1)

    above = key > thresh
    tied = (key == thresh) & (key != DEAD)
    need = gl.expand_dims(TOPK - gl.sum(above.to(gl.int32), axis=1), 1)
    picked = above | (tied & (_rank_in_order(tied.to(gl.int32)) <= need))
    slot = _rank_in_order(picked.to(gl.int32)) - 1
    out_row = out_ptr + t.to(gl.int64) * stride_ot + h.to(gl.int64) * stride_oh
    in_range = gl.expand_dims(rows < num_rows, 1)
    gl.store(gl.expand_dims(out_row, 1) + slot * stride_ok, b + gl.zeros_like(slot),
             mask=picked & in_range)
    # -1 after the picks, up to K
    pad_l: gl.constexpr = gl.BlockedLayout([1, (KP + TPR - 1) // TPR], [32 // TPR, TPR],
                                           [num_warps, 1], [1, 0])
    count = gl.convert_layout(gl.sum(picked.to(gl.int32), axis=1), gl.SliceLayout(1, pad_l))
    k = gl.expand_dims(gl.arange(0, KP, layout=gl.SliceLayout(0, pad_l)), 0)
    rows_p = gl.convert_layout(rows, gl.SliceLayout(1, pad_l))
    out_p = gl.expand_dims(gl.convert_layout(out_row, gl.SliceLayout(1, pad_l)), 1)
    gl.store(out_p + k * stride_ok, gl.full([ROWS, KP], -1, gl.int32, pad_l),
             mask=(k >= gl.expand_dims(count, 1)) & (k < TOPK)
             & gl.expand_dims(rows_p < num_rows, 1))
