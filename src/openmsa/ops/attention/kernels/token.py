# SPDX-License-Identifier: Apache-2.0
"""Triton kernels of sparse attention: split-K over the selected blocks, then a log-sum-exp merge.

Grid (T, Hkv, splits): the loop runs over steps of SUB keys, BLOCK // SUB steps per selected
block (SUB < BLOCK halves the K/V tile a step holds in registers and shared memory, so more
programs fit on an SM). Program (t, g, s) takes steps [s*E, (s+1)*E) of token t's selection for
KV head g (index head g*H//Hkv) and runs the G query heads of g's group as the rows of the matrix
unit against each step's keys, with an online softmax. With one split it writes the
normalised output and LSE directly; with more, partial (out, lse) go to a workspace and the last
program of a (token, KV head) to finish combines them (FUSED_MERGE: an arrival counter per
(token, KV head) that the merger puts back to 0, so every launch and graph replay finds zeros),
or `_merge_splits_kernel` does in a second launch. Every token is independent, so decode,
speculative verify (each draft token with its own causal cut) and prefill chunks share one launch.
In a prefill step (TILE_QT > 0) tile.py's tile kernel has already done the tokens of the tiles
its plan took; programs of those tokens return at once.

Bytes per (token, KV head): selected blocks * B * D * 2 * bytes(kv) read (L2 serves repeats
between tokens that picked the same blocks).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ...common.triton_utils import split_e4m3_pairs, token_position

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def scaled_q(q, sm_scale, k_scale_ptr, F16_COMPUTE: tl.constexpr, HAS_SCALE: tl.constexpr):
    """(q, the factor that takes q K^T to log2 units): with F16_COMPUTE (fp8 K/V) q pre-scaled
    by sm_scale and rounded to fp16 (see the kernel below), else q as it is; times K's
    dequantisation scale with HAS_SCALE."""
    if F16_COMPUTE:
        q = (q.to(tl.float32) * sm_scale).to(tl.float16)
        qk_scale = LOG2E
    else:
        qk_scale = sm_scale * LOG2E
    if HAS_SCALE:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    return q, qk_scale


@triton.jit
def _sparse_attention_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, cu_ptr, seq_lens_ptr, bt_ptr,
                             out_ptr, lse_ptr, part_out_ptr, counter_ptr,
                             tile_blocks_ptr, k_scale_ptr, v_scale_ptr, sm_scale, num_requests,
                             table_width, num_pages, stride_qt, stride_qh, stride_qd,
                             stride_kp, stride_kb, stride_kh, stride_kd,
                             stride_vp, stride_vb, stride_vh, stride_vd,
                             stride_it, stride_ih, stride_ik, stride_btr, stride_btb,
                             stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
                             NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                             NUM_INDEX_HEADS: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
                             D: tl.constexpr, BLOCK: tl.constexpr, TOPK: tl.constexpr,
                             KP: tl.constexpr, SUB: tl.constexpr, STEPS: tl.constexpr,
                             SPLITS: tl.constexpr, HAS_SCALE: tl.constexpr, IEEE: tl.constexpr,
                             F16_COMPUTE: tl.constexpr, FUSED_MERGE: tl.constexpr,
                             TILE_QT: tl.constexpr, V_PAIRS: tl.constexpr, PTX: tl.constexpr,
                             SP: tl.constexpr = 1,
                             PDL: tl.constexpr = False, STORE_LSE: tl.constexpr = True,
                             LAZY_SUM: tl.constexpr = False, WAIT_TILES: tl.constexpr = False,
                             WAIT_PRIOR: tl.constexpr = False):
    if WAIT_PRIOR:
        # a decode step's only (or first) launch, made a programmatic dependent of whatever
        # kernel precedes the call on the stream (plan.py): its programs may start
        # while that kernel's last ones finish, which hides this launch's own latency; nothing
        # is read or written before that kernel has finished and its writes are visible
        gdc_wait()
    if PDL:
        # the merge launch may start now (programmatic dependent launch); it waits for this
        # launch to finish before it reads a partial
        gdc_launch_dependents()
    t = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    if WAIT_TILES:
        # launched as a programmatic dependent of the Gluon tile launch (plan.py),
        # which may still run: the two write disjoint tokens and nothing here reads its
        # output, but this launch must not end before that one has (what follows on the stream
        # waits for this launch only). One program waiting is enough; the first holds one slot.
        if (t == 0) & (g == 0) & (split == 0):
            gdc_wait()
    if TILE_QT > 0:
        # tile.py's plan gave this token's tile to the tile kernel (a union size >= 0, not
        # -1): nothing to do here
        if tl.load(tile_blocks_ptr + (t // TILE_QT) * NUM_KV_HEADS + g) >= 0:
            return
    attend_split(t, g, split, tl.num_programs(0), q_ptr, k_ptr, v_ptr, idx_ptr, cu_ptr,
                 seq_lens_ptr, bt_ptr, out_ptr, lse_ptr, part_out_ptr, counter_ptr, k_scale_ptr,
                 v_scale_ptr, sm_scale, num_requests, table_width, num_pages, stride_qt,
                 stride_qh, stride_qd, stride_kp, stride_kb, stride_kh, stride_kd, stride_vp,
                 stride_vb, stride_vh, stride_vd, stride_it, stride_ih, stride_ik, stride_btr,
                 stride_btb, stride_ot, stride_oh, stride_od, stride_lt, stride_lh, NUM_HEADS,
                 NUM_KV_HEADS, NUM_INDEX_HEADS, G, M, D, BLOCK, TOPK, KP, SUB, STEPS, SPLITS,
                 HAS_SCALE, IEEE, F16_COMPUTE, FUSED_MERGE, V_PAIRS, PTX, SP, STORE_LSE, LAZY_SUM)


@triton.jit
def attend_split(t, g, split, num_tokens, q_ptr, k_ptr, v_ptr, idx_ptr, cu_ptr, seq_lens_ptr,
                 bt_ptr, out_ptr, lse_ptr, part_out_ptr, counter_ptr, k_scale_ptr, v_scale_ptr,
                 sm_scale, num_requests, table_width, num_pages, stride_qt, stride_qh,
                 stride_qd, stride_kp, stride_kb, stride_kh, stride_kd, stride_vp, stride_vb,
                 stride_vh, stride_vd, stride_it, stride_ih, stride_ik, stride_btr, stride_btb,
                 stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
                 NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                 NUM_INDEX_HEADS: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
                 D: tl.constexpr, BLOCK: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr,
                 SUB: tl.constexpr, STEPS: tl.constexpr, SPLITS: tl.constexpr,
                 HAS_SCALE: tl.constexpr, IEEE: tl.constexpr, F16_COMPUTE: tl.constexpr,
                 FUSED_MERGE: tl.constexpr, V_PAIRS: tl.constexpr, PTX: tl.constexpr,
                 SP: tl.constexpr, STORE_LSE: tl.constexpr, LAZY_SUM: tl.constexpr):
    """Program (t, g, split) of the split launch (the module's docstring) for a step of
    num_tokens tokens."""
    # (64-bit: a head-major cache view can put the head offset past 2^31 elements)
    g64 = g.to(tl.int64)
    rows = tl.arange(0, M)
    head_ok = rows < G
    head = g * G + rows
    d = tl.arange(0, D)
    offs = tl.arange(0, SUB)
    PARTS: tl.constexpr = BLOCK // SUB

    # the loads that need only t first (the selection row, q): they are in flight while the
    # request is looked up, so the prologue's dependent chain is cu_seqlens -> seq_lens ->
    # block table -> K/V
    ih = g * NUM_INDEX_HEADS // NUM_KV_HEADS
    idx_row = idx_ptr + t.to(tl.int64) * stride_it + ih * stride_ih
    kk = tl.arange(0, KP)
    row_ids = tl.load(idx_row + kk * stride_ik, mask=kk < TOPK, other=-1)  # [KP]
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + head[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=head_ok[:, None], other=0.0)  # [M, D]

    # the token's request, position and causal block count (0 for padding, which includes every
    # token of a malformed step or request: docs/spec.md, "Bounds"); requests of equal q_len
    # hold token t in request t * R // T, checked before the search (find_request).
    guess = (t.to(tl.int64) * num_requests // num_tokens).to(tl.int32)
    r, pos = token_position(cu_ptr, seq_lens_ptr, num_requests, num_tokens, table_width,
                            t, guess, BLOCK)
    n = tl.where(pos >= 0, pos // BLOCK + 1, 0)
    r_safe = tl.minimum(r, num_requests - 1).to(tl.int64)

    # the selection row, valid entries only; an id listed earlier in the row counts once
    in_range = (row_ids >= 0) & (row_ids < n)
    earlier = kk[None, :] < kk[:, None]  # [KP, KP]: column j before row i
    dup = tl.sum((earlier & (row_ids[None, :] == row_ids[:, None]) & in_range[None, :])
                 .to(tl.int32), axis=1) > 0
    # every page up front: the loop below then issues only K/V loads, whose addresses come from
    # registers, so the software pipeline can prefetch the next blocks (a load chain of index ->
    # block table -> K per iteration would serialise three memory latencies)
    row_pages = tl.load(bt_ptr + r_safe * stride_btr + tl.where(in_range, row_ids, 0) * stride_btb,
                        mask=in_range & ~dup, other=-1)
    # a page id naming no page of the cache (-1 for an entry the engine left unfilled, or a
    # stale id past the cache) reads nothing; n <= the table's width, so in_range entries lie
    # inside the table row
    row_ok = in_range & ~dup & (row_pages >= 0) & (row_pages < num_pages)
    # a step reads its block id and page out of these rows (a sum over a one-hot pick: a
    # shuffle tree each); a skipped entry's page becomes -1, so the page's sign is its flag and
    # a third sum is saved (fewer instructions per step, benchmarks/resources.py)
    row_pages = tl.where(row_ok, row_pages, -1)

    # fp8 K/V: the matrix unit runs in fp16. e4m3 -> fp16 is one hardware conversion per pair
    # (e4m3 -> bf16 is not: it goes through more instructions, and this loop is bound by
    # converting 2 * BLOCK * D values per block, not by the bytes). q is pre-scaled by sm_scale so
    # that only |q| > 65504 / sm_scale (7e5 at D = 128) could overflow fp16; fp16 keeps 3 more
    # mantissa bits of q and of P than bf16.
    q, qk_scale = scaled_q(q, sm_scale, k_scale_ptr, F16_COMPUTE, HAS_SCALE)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    if LAZY_SUM:
        # the softmax denominator summed elementwise, reduced over the keys once after the
        # loop: a step's keys are spread over the warps, so a per-step row sum is a round
        # trip through shared memory with two barriers (the row max still needs one)
        l_acc = tl.zeros([M, SUB], tl.float32)
    # fp8 V is the second operand of P @ V with keys as the reduction axis: the matrix unit
    # wants two consecutive keys of one column per register, Hopper's ldmatrix only transposes
    # 16-bit elements, so a plain fp8 tile is gathered byte by byte (128 one-byte shared loads
    # per thread per step). V_PAIRS reads V as 16-bit pairs of columns (2j, 2j+1) instead, which
    # ldmatrix transposes, then splits each pair into an even and an odd column tile, and
    # accumulates P @ V[:, 0::2] and P @ V[:, 1::2] apart (the same MMA count), interleaved once
    # at the end. Needs an even-aligned V with unit column stride (api.py checks).
    if V_PAIRS:
        acc_e = tl.zeros([M, D // 2], tl.float32)
        acc_o = tl.zeros([M, D // 2], tl.float32)
        dh = tl.arange(0, D // 2)
        v16_ptr = v_ptr.to(tl.pointer_type(tl.uint16))
    else:
        acc = tl.zeros([M, D], tl.float32)
    s_lo = split * STEPS
    s_hi = tl.minimum(s_lo + STEPS, TOPK * PARTS)
    for step in range(s_lo, s_hi):
        pick = kk == step // PARTS
        blk = tl.sum(tl.where(pick, row_ids, 0), axis=0)
        page = tl.sum(tl.where(pick, row_pages, 0), axis=0).to(tl.int64)
        ok = page >= 0
        key_off = (step % PARTS) * SUB + offs  # [SUB], inside the block
        key_pos = blk * BLOCK + key_off
        # keys after the token (its own block's tail, possibly never written) are masked, and
        # their V rows zeroed so an unwritten NaN cannot reach the sum
        vis = ok & (key_pos <= pos)  # [SUB]
        # the page's address as one scalar, then 32-bit offsets inside it: one 64-bit add per
        # address instead of 64-bit products and sums per term (checks.py bounds the offsets)
        k = tl.load(k_ptr + (page * stride_kp + g64 * stride_kh)
                    + (key_off[:, None] * stride_kb + d[None, :] * stride_kd),
                    mask=vis[:, None], other=0.0)  # [SUB, D]
        if V_PAIRS:
            # (every stride even: api.py's _reads_as_pairs)
            v2 = tl.load(v16_ptr + (page * stride_vp + g64 * stride_vh) // 2
                         + (key_off[:, None] * (stride_vb // 2) + dh[None, :]),
                         mask=vis[:, None], other=0)  # [SUB, D/2]: bytes d = 2j, 2j+1
            v_e, v_o = split_e4m3_pairs(v2, PTX)  # [SUB, D/2] each: V[:, 0::2], V[:, 1::2]
        else:
            v = tl.load(v_ptr + (page * stride_vp + g64 * stride_vh)
                        + (key_off[:, None] * stride_vb + d[None, :] * stride_vd),
                        mask=vis[:, None], other=0.0)  # [SUB, D]
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))  # [M, SUB]
        s = tl.where(vis[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # rows that have seen nothing yet keep m = -inf; shift by 0 there (no inf - inf)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - shift[:, None])
        alpha = tl.exp2(m_i - shift)
        if LAZY_SUM:
            l_acc = l_acc * alpha[:, None] + p
        else:
            l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_PAIRS:
            p16 = p.to(tl.float16)
            acc_e = acc_e * alpha[:, None] + tl.dot(p16, v_e)
            acc_o = acc_o * alpha[:, None] + tl.dot(p16, v_o)
        else:
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
            acc = acc * alpha[:, None] + pv
        m_i = m_new
    if LAZY_SUM:
        l_i = tl.sum(l_acc, axis=1)
    if V_PAIRS:
        acc = tl.join(acc_e, acc_o).reshape(M, D)
    if HAS_SCALE:
        acc = acc * tl.load(v_scale_ptr)
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    out = out_ptr + t.to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
    if SPLITS == 1:
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
        if STORE_LSE:
            tl.store(lse_ptr + t.to(tl.int64) * stride_lt + head * stride_lh, lse, mask=head_ok)
    else:
        # workspace [T, Hq, SPLITS, D] then [T, Hq, SPLITS], contiguous, in one allocation
        part_lse_ptr = part_out_ptr + tl.cast(num_tokens, tl.int64) * NUM_HEADS * SPLITS * D
        row = t.to(tl.int64) * NUM_HEADS + head  # [M]
        tl.store(part_out_ptr + (row * SPLITS + split)[:, None] * D + d[None, :], o,
                 mask=head_ok[:, None])
        tl.store(part_lse_ptr + row * SPLITS + split, lse, mask=head_ok)
        if FUSED_MERGE:
            # the last of the SPLITS programs of (t, g) to arrive merges (no second launch).
            # The barrier orders every thread's partial stores before the counter's release;
            # the acquire and the .cg loads (L2, not this SM's possibly stale L1) see the other
            # programs' partials. The merger puts the counter back to 0 for the next launch.
            tl.debug_barrier()
            counter = counter_ptr + t.to(tl.int64) * NUM_KV_HEADS + g
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLITS - 1:
                # every split's LSE in one [M, SP] load, then the partial outputs, which depend
                # on nothing loaded here, so the unrolled loop can issue them all at once: two
                # L2 round trips after the counter, not one per split
                jj = tl.arange(0, SP)
                lse_all = tl.load(part_lse_ptr + row[:, None] * SPLITS + jj[None, :],
                                  mask=head_ok[:, None] & (jj[None, :] < SPLITS),
                                  other=float("-inf"), cache_modifier=".cg")  # [M, SP]
                m_all = tl.max(lse_all, axis=1)
                shift_all = tl.where(m_all == float("-inf"), 0.0, m_all)
                w_all = tl.exp(lse_all - shift_all[:, None])  # [M, SP]
                total = tl.sum(w_all, axis=1)
                o_all = tl.zeros([M, D], tl.float32)
                for j in tl.static_range(SPLITS):
                    w = tl.sum(tl.where(jj[None, :] == j, w_all, 0.0), axis=1)  # [M]
                    o_j = tl.load(part_out_ptr + (row * SPLITS + j)[:, None] * D + d[None, :],
                                  mask=head_ok[:, None], other=0.0, cache_modifier=".cg")
                    o_all += w[:, None] * o_j
                none = total == 0.0
                o_all = o_all / tl.where(none, 1.0, total)[:, None]
                lse_all = tl.where(none, float("-inf"),
                                   shift_all + tl.log(tl.where(none, 1.0, total)))
                tl.store(out, o_all.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
                if STORE_LSE:
                    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + head * stride_lh, lse_all,
                             mask=head_ok)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_splits_kernel(part_out_ptr, out_ptr, lse_ptr, stride_ot, stride_oh,
                         stride_od, stride_lt, stride_lh, NUM_HEADS: tl.constexpr,
                         D: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr,
                         PDL: tl.constexpr = False, STORE_LSE: tl.constexpr = True):
    if PDL:
        gdc_wait()  # launched before the split programs finished: wait for their partials
    merge_splits(tl.program_id(0), tl.program_id(1), tl.num_programs(0), part_out_ptr, out_ptr,
                 lse_ptr, stride_ot, stride_oh, stride_od, stride_lt, stride_lh, NUM_HEADS, D,
                 SPLITS, SP, STORE_LSE)


@triton.jit
def merge_splits(t, h, num_tokens, part_out_ptr, out_ptr, lse_ptr, stride_ot, stride_oh,
                 stride_od, stride_lt, stride_lh, NUM_HEADS: tl.constexpr, D: tl.constexpr,
                 SPLITS: tl.constexpr, SP: tl.constexpr, STORE_LSE: tl.constexpr):
    """Head h of token t: out = sum_s exp(lse_s - lse) * out_s with lse = logsumexp_s lse_s;
    all -inf gives 0."""
    # the partial LSEs follow the T * Hq * SPLITS * D partial outputs (one allocation)
    part_lse_ptr = part_out_ptr + tl.cast(num_tokens, tl.int64) * NUM_HEADS * SPLITS * D
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    base = (t.to(tl.int64) * NUM_HEADS + h) * SPLITS
    lse_s = tl.load(part_lse_ptr + base + s, mask=s < SPLITS, other=float("-inf"))  # [SP]
    m = tl.max(lse_s, axis=0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - shift)  # [SP]
    total = tl.sum(w, axis=0)
    o_s = tl.load(part_out_ptr + (base + s)[:, None] * D + d[None, :], mask=(s < SPLITS)[:, None],
                  other=0.0)  # [SP, D]
    o = tl.sum(o_s * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    lse = tl.where(total == 0.0, float("-inf"), shift + tl.log(tl.where(total == 0.0, 1.0, total)))
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d * stride_od,
             o.to(out_ptr.dtype.element_ty))
    if STORE_LSE:
        tl.store(lse_ptr + t.to(tl.int64) * stride_lt + h * stride_lh, lse)
