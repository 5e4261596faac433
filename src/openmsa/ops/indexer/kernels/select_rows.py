# SPDX-License-Identifier: Apache-2.0
"""Gluon kernel of the selection for short score rows: each row in a few threads' registers.

select.py gives each row one warp: the row's keys are spread over the 32 lanes, so each step of
its search is a warp-wide sum (a chain of shuffles), ~410 warp instructions per row on rows of
<= 64 blocks, and a launch of one-warp programs stops at 32 programs per SM. A prefill chunk
with little context is many such rows: an 8K chunk with no context at 4 index heads has 32768
rows of 1-64 blocks, whose one-warp selection costs a large share of the chunk's scoring time
(docs/history/tried.md). Here a row of SEG <= 64 blocks lies in TPR threads (SEG / TPR contiguous
blocks each: 16-byte loads where that is 4 or more), so a sort's stage within a thread is
register moves, one across threads a shuffle a value, a count a sum inside each thread and
log2(TPR) shuffles, and a warp selects 32 / TPR rows at once. Triton cannot be told to lay a
tile out that way (it spreads a 64-wide row over 16 lanes), hence Gluon. Wider rows (up to
plan.py's short_rows.max_blocks, 1024: a chunk after ~120K tokens) lie 16 blocks per thread up to a
warp per row (32 blocks per thread at 1024), in one pass where select.py reads a row twice and
searches it bit by bit with a warp-wide sum per step.

The same selection as select.py (docs/spec.md, "Selection: forced blocks and the tie rule":
forced init/local blocks, then the best by score, ties to the lower block, NaN as -inf,
ascending ids, -1 padded), found differently: the forced
blocks are known from n, so only the K2 = TOPK - INIT - LOCAL best of the other blocks are
looked for, on their float values with forced and absent blocks as NaN (which no comparison
counts): in launches whose width (the block table's, a power of 2) is at most 128 blocks
(plan.py's short_rows.sort_max) by sorting each row (a bitonic network in registers, its K2-th
largest read off), in wider ones by searching an interval of keys (floats as
order-preserving ints) between a lower bound and the largest value, first at the interval's
value midpoints, one candidate a step; then ties to the lower blocks.

Used on Hopper with the Gluon the other kernels are tested on (plan.py, `_short_rows`),
for launches of many rows (the threshold path) whose rows have at most 1024 blocks; the
interpreter and everything else keep select.py.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...common.gluon_utils import token_position, wait_prerequisites

@gluon.jit
def _key(x):
    """The int32 key of a (non-NaN) fp32 whose integer order is the float order
    (triton_utils.score_key without its NaN and -0.0 cases: -0.0 keys just below +0.0)."""
    bits = x.to(gl.int32, bitcast=True)
    return gl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@gluon.jit
def _value(key):
    """The fp32 of a key (_key's inverse)."""
    return gl.where(key < 0, key ^ 0x7FFFFFFF, key).to(gl.float32, bitcast=True)


@gluon.jit
def _midpoint(lo, hi, by_value):
    """The search's candidate in [lo, hi) (keys, hi >= lo + 2): the values' midpoint where
    by_value and it falls strictly inside, else the keys' midpoint."""
    # (floor of (lo + hi) / 2 without overflow)
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)
    if by_value:
        lo_v = _value(lo)
        hi_v = _value(hi)
        by_v = _key(lo_v * 0.5 + hi_v * 0.5)
        finite = (gl.abs(lo_v) < float("inf")) & (gl.abs(hi_v) < float("inf"))
        mid = gl.where(finite & (by_v > lo) & (by_v < hi), by_v, mid)
    return mid


@gluon.jit
def _count(v, c, OP: gl.constexpr):
    """Per row, how many of its values v compare OP ("ge" or "gt") to c (per row, [rows, 1]);
    NaN never does. Written as PTX `set` to 1.0 or 0.0 per value and a float sum (exact: at
    most 1024 ones): ptxas makes that an FSET (ALU pipe) and an FADD (FMA pipe) per value,
    where `set` to an integer became an FSETP and a SEL summed by IADD3s, all on the ALU pipe
    (half rate on Hopper, and the pipe this kernel is bound by).
    (A sum of the comparisons as booleans would let LLVM pack them into bit masks for a
    popcount, ~5 PTX instructions per value instead of 2.)"""
    hit = gl.inline_asm_elementwise(f"set.{OP}.f32.f32 $0, $1, $2;", "=f,f,f", [v, c],
                                    dtype=gl.float32, is_pure=True, pack=1)
    return gl.sum(hit, axis=1).to(gl.int32)


@gluon.jit
def _partner(x, J: gl.constexpr, VPT: gl.constexpr):
    """Per element i of a [rows, SEG] tile (VPT contiguous elements a thread, a row's threads
    adjacent lanes), element i ^ J of its row: another of the thread's registers (J < VPT), or
    the same register of lane ^ (J / VPT), one shuffle."""
    if J >= VPT:
        return gl.inline_asm_elementwise(f"shfl.sync.bfly.b32 $0, $1, {J // VPT}, 0x1f, -1;",
                                         "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)
    else:
        ROWS: gl.constexpr = x.shape[0]
        SEG: gl.constexpr = x.shape[1]
        pair = gl.permute(gl.reshape(x, [ROWS, SEG // (2 * J), 2, J]), [0, 1, 3, 2])
        low, high = gl.split(pair)
        swapped = gl.reshape(gl.permute(gl.join(high, low), [0, 1, 3, 2]), [ROWS, SEG])
        return gl.convert_layout(swapped, x.type.layout)


@gluon.jit
def _exchange(x, b, K: gl.constexpr, J: gl.constexpr, VPT: gl.constexpr):
    """A compare-exchange stage of _sorted: element i against i ^ J, in runs of K."""
    p = _partner(x, J, VPT)
    # the lower of a pair keeps the min in ascending runs ((i & K) == 0), the max in descending
    # ones
    take_min = ((b & J) == 0) == ((b & K) == 0)
    return gl.where(take_min, gl.minimum(x, p), gl.maximum(x, p))


@gluon.jit
def _sorted(x, b, VPT: gl.constexpr, SEG: gl.constexpr):
    """Each row of a [rows, SEG] tile (no NaN; SEG a power of 2 up to 1024, laid out as
    _partner's, b its [1, SEG] column index) in ascending order: a bitonic network, log2(SEG)
    (log2(SEG) + 1) / 2 compare-exchange stages (21 at 64), each a min, a max and a select per
    element, with a shuffle where it crosses threads."""
    for kk in gl.static_range(10):
        if (2 << kk) <= SEG:
            for jj in gl.static_range(kk + 1):
                x = _exchange(x, b, 2 << kk, (2 << kk) >> (jj + 1), VPT)
    return x


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
                            SORT: gl.constexpr, num_warps: gl.constexpr):
    # a row's SEG = G * W blocks in TPR threads' registers, SEG / TPR contiguous ones each
    SEG: gl.constexpr = G * W
    row_l: gl.constexpr = gl.BlockedLayout([1, SEG // TPR], [32 // TPR, TPR], [num_warps, 1],
                                           [1, 0])
    r_l: gl.constexpr = gl.SliceLayout(1, row_l)
    ROWS: gl.constexpr = 32 // TPR * num_warps
    # the last rows first: in a chunk's token order a row's causal blocks grow with its token,
    # so the programs of the longest rows start in the first wave and the last, partial wave
    # holds the shortest
    pid = gl.program_id(0)
    pid = gl.num_programs(0) - 1 - pid
    rows = pid * ROWS + gl.arange(0, ROWS, layout=r_l)
    t = rows // H
    h = rows % H
    b = gl.expand_dims(gl.arange(0, SEG, layout=gl.SliceLayout(0, row_l)), 0)
    row = gl.expand_dims(scores_ptr + t.to(gl.int64) * stride_st + h.to(gl.int64) * stride_sh, 1)
    real = rows < num_rows
    # (one lookup per lane: each row's token)
    _, pos = token_position(cu_ptr, seq_lens_ptr, num_requests, num_rows // H, max_blocks, t,
                            BLOCK)
    n = gl.where(real, gl.where(pos >= 0, pos // BLOCK + 1, 0), 0)
    n2 = gl.expand_dims(n, 1)
    live = b < n2
    # a programmatic dependent launch of the scoring launch: the request lookup above ran
    # beside it; its scores are read only once it has finished
    wait_prerequisites()
    # whole VEC-block pieces (one 16-byte load each for VEC = 4: the mask is constant over a
    # piece, the tail's extra blocks are inside the row when VEC divides its width, and the
    # blocks past n ignore them); a causal count past the width reads nothing beyond it
    piece = (b // VEC) * VEC
    s = gl.load(row + b * stride_sb, mask=(piece < max_blocks) & (piece < n2),
                other=float("-inf"))
    # the values searched: the scores of the causal blocks not forced, INIT <= b < n - LOCAL
    # (one unsigned compare), NaN as -inf (a max ignores NaN); forced and absent blocks as NaN,
    # which no comparison counts. (Each thread's values are separate registers in SASS, so an
    # instruction per value saved here is 16 per thread: this kernel is ALU-bound.)
    searched = ((b - INIT).to(gl.uint32, bitcast=True)
                < gl.maximum(n2 - (INIT + LOCAL), 0).to(gl.uint32, bitcast=True))
    v = gl.where(searched, gl.maximum(s, float("-inf")), float("nan"))

    # a row of n > TOPK blocks picks its INIT + LOCAL forced blocks (n > TOPK >= INIT + LOCAL:
    # they are distinct) and the K2 best of the others: the values above the K2-th largest,
    # and of the values equal to it the lowest blocks.
    K2: gl.constexpr = TOPK - INIT - LOCAL
    if SORT:
        # widths of <= 128 blocks: the K2-th largest read off the sorted row (a fixed network,
        # where a search's steps each wait on a count crossing the row's threads), forced and
        # absent blocks as -inf below the >= K2 + 1 searched values of a row of n > TOPK
        srt = _sorted(gl.where(v == v, v, float("-inf")), b, SEG // TPR, SEG)
        kth = gl.max(gl.where(b == SEG - K2, srt, float("-inf")), axis=1)
    else:
        # the K2-th largest found by bisection of a key interval [lo, hi) with count(v >= lo)
        # >= K2 > count(v >= hi), each candidate the midpoint of the interval's values (of its
        # keys while a bound is infinite, or where the values' midpoint does not split the
        # keys), stopping once exactly K2 values reach a candidate. Value midpoints (the first
        # 8 steps) take 5-6 steps on random rows of 17-64 normal or uniform scores
        # where the bisection of keys takes 6-9: keys are logarithmic in the value
        # (scripts/select_rows_model.py).
        high = gl.max(v, axis=1)  # (max and min skip NaN)
        # (-0.0 as +0.0: the key above -0.0's is +0.0, an equal value)
        hi = _key(gl.where(high == 0.0, 0.0, high)) + 1
        # lo: the smallest of G >= K2 group maxima (each such group holds a value at least that
        # large), over the groups holding a searched value when K2 of them do; else the
        # smallest value
        group_max = gl.max(gl.reshape(v, [ROWS, G, W]), axis=2)
        groups = gl.convert_layout(gl.sum((group_max == group_max).to(gl.int32), axis=1), r_l)
        low = gl.where(groups >= K2, gl.convert_layout(gl.min(group_max, axis=1), r_l),
                       gl.min(v, axis=1))
        lo = _key(low)
        searching = (n > TOPK) & (K2 > 0) & (lo + 1 < hi)
        # value midpoints only for the first steps: halving values toward a tie at 0.0 would
        # take ~150 steps down the subnormals, where halving keys ends in 32 (8 halvings
        # either way)
        step = 0
        while gl.max(searching.to(gl.int32), axis=0) > 0:
            mid = _midpoint(lo, hi, step < 8)
            step += 1
            count = _count(v, gl.expand_dims(_value(mid), 1), "ge")
            reach = count >= K2
            lo = gl.where(searching & reach, mid, lo)
            hi = gl.where(searching & (reach == 0), mid, hi)
            searching = searching & (count != K2) & (lo + 1 < hi)
        kth = _value(lo)
    thresh = gl.expand_dims(kth, 1)
    # the forced blocks are the live ones not searched (v NaN, which no comparison passes); a
    # row of n <= TOPK takes all its live blocks (a threshold of -inf, which every searched
    # value reaches)
    forced = live & (v != v)
    if K2 > 0:
        low_pick = gl.expand_dims(gl.where(n > TOPK, kth, float("-inf")), 1)
        picked = live & ((v < low_pick) == 0)
    else:
        picked = live & ((v != v) | (gl.expand_dims(n, 1) <= TOPK))
    # more values equal to the K2-th largest than fit (ties at the sorted row's K2-th value, or
    # a search that ended on adjacent keys, not on a count of exactly K2): of those the lowest
    # blocks. Rare on real scores, so the running count in block order runs only in programs
    # that hold such a row
    over = _count(v, thresh, "ge") > K2
    if gl.max((((n > TOPK) & (K2 > 0)) & over).to(gl.int32), axis=0) > 0:
        need = gl.expand_dims(K2 - _count(v, thresh, "gt"), 1)
        above = v > thresh
        tied = v == thresh
        search = gl.expand_dims((n > TOPK) & (K2 > 0), 1)
        picked = gl.where(gl.expand_dims(n > TOPK, 1), forced, live) | (search & (
            above | (tied & (_rank_in_order(tied.to(gl.int32)) <= need))))
    slot = _rank_in_order(picked.to(gl.int32)) - 1
    out_row = out_ptr + t.to(gl.int64) * stride_ot + h.to(gl.int64) * stride_oh
    # (rows past num_rows have n = 0: nothing live, nothing picked)
    gl.store(gl.expand_dims(out_row, 1) + slot * stride_ok, b + gl.zeros_like(slot),
             mask=picked)
    # -1 after the picks, up to K: only rows of fewer than TOPK blocks (n > TOPK picks INIT +
    # LOCAL + K2 = TOPK blocks), so only in programs that hold one
    if gl.max(((n < TOPK) & (rows < num_rows)).to(gl.int32), axis=0) > 0:
        pad_l: gl.constexpr = gl.BlockedLayout([1, (KP + TPR - 1) // TPR], [32 // TPR, TPR],
                                               [num_warps, 1], [1, 0])
        count = gl.convert_layout(gl.minimum(n, TOPK), gl.SliceLayout(1, pad_l))
        k = gl.expand_dims(gl.arange(0, KP, layout=gl.SliceLayout(0, pad_l)), 0)
        rows_p = gl.convert_layout(rows, gl.SliceLayout(1, pad_l))
        out_p = gl.expand_dims(gl.convert_layout(out_row, gl.SliceLayout(1, pad_l)), 1)
        gl.store(out_p + k * stride_ok, gl.full([ROWS, KP], -1, gl.int32, pad_l),
                 mask=(k >= gl.expand_dims(count, 1)) & (k < TOPK)
                 & gl.expand_dims(rows_p < num_rows, 1))
