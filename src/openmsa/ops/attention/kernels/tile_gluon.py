# SPDX-License-Identifier: Apache-2.0
"""Gluon kernel of the prefill tile launch on Hopper, warp-specialised (16-bit or fp8 K/V).

The same tiles as tile.py's `_sparse_attention_tile_kernel` (the plan launch and its union of
each tile's selections are shared; read that file first): one program per (tile, KV head) item,
QT tokens x G heads = 64 rows against the union's blocks, online softmax, the causal cut at token
granularity. What changes is who does what inside a program:

* a producer fills rings of STAGES_K key and STAGES_V value buffers with each step's [SUB, D]
  tiles (one page, one KV head), ahead of the consumer, reading the page ids from the plan's
  union: for 16-bit K/V one warp issuing TMA copies (4-D descriptors over the caches' own
  [P, B, Hkv, D] views); for fp8 K/V a loader warpgroup that reads each tile from global memory,
  converts it to fp16 in registers and stores it (`_fp8_loader`), so that the consumer runs the
  16-bit path unchanged, with the MMAs in fp16 (as tile.py's F16_COMPUTE);
* a consumer warpgroup runs S = Q K^T (`wgmma`, both operands in shared memory), hands the keys
  back (so the next step's keys load during this step's softmax), runs the mask and the online
  softmax in registers and O += P V (`wgmma` with P as the register operand), then hands the
  values back.

Why: the Triton tile kernel's warps compute every K/V element's address and issue its loads
themselves, and its loads, MMAs and softmax run in series; here the copies cost the consumer
nothing and two programs per SM overlap one's softmax with the other's MMAs
(docs/performance.md). PAIR (fp8, where G allows it): tiles of twice the tokens, two consumer
warpgroups of 64 rows over one loader's rings, one program per SM: the loader's loads and
conversions per step serve twice the rows.

Keys past every row's causal cut (the tail of the tile's own block, maybe never written) are
copied like the rest, since a box has one size: their scores are masked to -inf, and on the
(rare) steps that hold such keys their V rows are zeroed in shared memory before P @ V, where
0 * NaN would otherwise give NaN (docs/spec.md, "Padding"): by the consumer, or under PAIR by the
loader (the consumers share the buffer). Page ids come from the plan, which keeps only ids in
[0, P), so every copy lands inside the cache; it takes only tiles of valid tokens (no padding, no
malformed step or request: docs/spec.md, "Bounds"), so every token read and written here is
inside q and out.

Used where plan.py's `_gluon_sub` allows: sm_90, a 16-bit q with K/V of its dtype or fp8 e4m3,
head dim and block size 128, QT * GP = 64 rows per consumer, TMA-describable K/V views at
16-byte aligned addresses (else the Triton tile kernel runs).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ...common.gluon_utils import launch_dependents, tile_position
from ..geometry import TILE_ROWS

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
# rows of the program's tile (Hopper's MMA M for one warpgroup)
ROWS = gl.constexpr(TILE_ROWS)


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v, union_row,
              num_steps, g, PARTS: gl.constexpr):
    """One warp: each step's K and V tiles into their rings, in the consumer's order (K_i,
    then V_i); K_{i+1} waits only for S_i = Q K_i^T, so it loads during step i's softmax."""
    SUB: gl.constexpr = k_desc.block_type.shape[1]
    SK: gl.constexpr = k_smem.shape[0]
    SV: gl.constexpr = v_smem.shape[0]
    for i in range(num_steps):
        page = gl.load(union_row + i // PARTS)
        key0 = (i % PARTS) * SUB
        s = i % SK
        # the buffer's previous keys released by the consumer
        mbarrier.wait(empty_k.index(s), ((i // SK) & 1) ^ 1, pred=i >= SK)
        mbarrier.expect(ready_k.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [page, key0, g, 0], ready_k.index(s),
                                        k_smem.index(s))
        s = i % SV
        mbarrier.wait(empty_v.index(s), ((i // SV) & 1) ^ 1, pred=i >= SV)
        mbarrier.expect(ready_v.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [page, key0, g, 0], ready_v.index(s),
                                        v_smem.index(s))


@gluon.jit
def _load_tile(base, off, stride_b, R: gl.constexpr):
    """A [4 * R, D] fp8 tile from `base` (its first key) as its four row quarters, every load
    issued before any is used; `off` the quarter's element offsets (one set of registers for
    the four)."""
    step = R * stride_b
    return (gl.load(base + off), gl.load(base + step + off), gl.load(base + 2 * step + off),
            gl.load(base + 3 * step + off))


@gluon.jit
def _store_tile(parts, ring, ready, SUB: gl.constexpr, D: gl.constexpr, R: gl.constexpr):
    """The four fp8 quarters as fp16 into a ring buffer (one quarter's fp16 live at a time),
    then its ready barrier once every warp's stores are visible to the MMAs."""
    dst = ring.reshape([SUB, D])
    dst.slice(0, R).store(parts[0].to(gl.float16))
    dst.slice(R, R).store(parts[1].to(gl.float16))
    dst.slice(2 * R, R).store(parts[2].to(gl.float16))
    dst.slice(3 * R, R).store(parts[3].to(gl.float16))
    fence_async_shared()
    gl.thread_barrier()  # every warp's part written before the consumer's MMA reads it
    mbarrier.arrive(ready, count=1)


@gluon.jit
def _tile_keep(union_row, j, first_pos, N: gl.constexpr, BLOCK: gl.constexpr,
               QT: gl.constexpr):
    """The last key offset in union slot j's block that any of the tile's QT tokens sees (its
    last token that selected the block sees the most); first_pos: the tile's first token's."""
    bits = gl.load(union_row + 2 * N + j)
    last = 0
    for k in gl.static_range(1, QT):
        last += (bits >= (1 << k)).to(gl.int32)
    return first_pos + last - gl.load(union_row + N + j) * BLOCK


@gluon.jit
def _store_tile_tail(parts, ring, ready, key0, keep, SUB: gl.constexpr, D: gl.constexpr,
                     R: gl.constexpr):
    """_store_tile with the keys past `keep` (the last key any row of the tile sees, offsets in
    the block) stored as 0: V's rows there may never have been written (NaN), and 0 * NaN in
    P V would be NaN."""
    c_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [4, 1], [1, 0])
    keys = key0 + gl.arange(0, R, layout=gl.SliceLayout(1, c_l))[:, None]
    dst = ring.reshape([SUB, D])
    for i in gl.static_range(4):
        dst.slice(i * R, R).store(gl.where(keys + i * R <= keep, parts[i].to(gl.float16), 0.0))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ready, count=1)


@gluon.jit
def _store_tile_load(parts, ring, ready, nxt, off, stride_b, SUB: gl.constexpr, D: gl.constexpr,
                     R: gl.constexpr):
    """_store_tile with the next tile's loads (from `nxt`, its first key) interleaved: each
    quarter's load issued once the registers of the quarter stored before it are free, so
    at most one tile's fp8 is live; returns the next tile's quarters."""
    dst = ring.reshape([SUB, D])
    step = R * stride_b
    dst.slice(0, R).store(parts[0].to(gl.float16))
    n0 = gl.load(nxt + off)
    dst.slice(R, R).store(parts[1].to(gl.float16))
    n1 = gl.load(nxt + step + off)
    dst.slice(2 * R, R).store(parts[2].to(gl.float16))
    n2 = gl.load(nxt + 2 * step + off)
    dst.slice(3 * R, R).store(parts[3].to(gl.float16))
    n3 = gl.load(nxt + 3 * step + off)
    fence_async_shared()
    gl.thread_barrier()  # every warp's part written before the consumer's MMA reads it
    mbarrier.arrive(ready, count=1)
    return (n0, n1, n2, n3)


@gluon.jit
def _fp8_loader(k_ptr, v_ptr, stride_kp, stride_kb, stride_kh, stride_vp, stride_vb,
                stride_vh, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v, union_row,
                num_steps, g, PARTS: gl.constexpr, first_pos=0, N: gl.constexpr = 0,
                BLOCK: gl.constexpr = 0, QT: gl.constexpr = 0,
                ZERO_V_TAIL: gl.constexpr = False):
    """fp8 K/V's producer (one warpgroup): each step's fp8 K and V read from global memory into
    registers, converted to fp16 and stored into the rings the consumer reads as if K/V were
    16-bit. This keeps the fp8 tile's trip through shared memory and the conversion off the
    consumer's serial path. K_i's loads are issued before waiting for its buffer, V_i's a
    quarter at a time while K_i is stored, K_{i+1}'s once V_i is stored: one tile in registers
    at a time (the consumer's accumulator, S and P leave this warpgroup few registers).
    ZERO_V_TAIL (PAIR): V's keys past every one of the tile's QT tokens' cuts are stored as 0
    here, not by the consumers, which share the buffer."""
    SUB: gl.constexpr = k_smem.shape[2]
    D: gl.constexpr = k_smem.shape[4]
    R: gl.constexpr = SUB // 4
    # 8 fp8 per thread: 16-byte fp16 stores; the 8 lanes served together (a quarter warp) then
    # write one 128-byte row of a 64-column swizzle atom, free of bank conflicts
    c_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [4, 1], [1, 0])
    keys = gl.arange(0, R, layout=gl.SliceLayout(1, c_l))[:, None]
    d = gl.arange(0, D, layout=gl.SliceLayout(0, c_l))[None, :]
    k_off = keys * stride_kb + d
    v_off = keys * stride_vb + d
    # (K_{i+1}'s loads are not issued under V_i's stores: carried through the loop, an fp8
    # tensor takes a register per element, and the loader would spill its invariants)
    for i in range(num_steps):
        page = gl.load(union_row + i // PARTS).to(gl.int64)
        key0 = (i % PARTS) * SUB
        parts = _load_tile(k_ptr + page * stride_kp + key0 * stride_kb + g * stride_kh,
                           k_off, stride_kb, R)
        s = i % k_smem.shape[0]
        mbarrier.wait(empty_k.index(s), ((i // k_smem.shape[0]) & 1) ^ 1,
                      pred=i >= k_smem.shape[0])
        parts = _store_tile_load(parts, k_smem.index(s), ready_k.index(s),
                                 v_ptr + page * stride_vp + key0 * stride_vb
                                 + g * stride_vh, v_off, stride_vb, SUB, D, R)
        s = i % v_smem.shape[0]
        mbarrier.wait(empty_v.index(s), ((i // v_smem.shape[0]) & 1) ^ 1,
                      pred=i >= v_smem.shape[0])
        if ZERO_V_TAIL:
            keep = _tile_keep(union_row, i // PARTS, first_pos, N, BLOCK, QT)
            if keep < key0 + SUB - 1:
                _store_tile_tail(parts, v_smem.index(s), ready_v.index(s), key0, keep, SUB,
                                 D, R)
            else:
                _store_tile(parts, v_smem.index(s), ready_v.index(s), SUB, D, R)
        else:
            _store_tile(parts, v_smem.index(s), ready_v.index(s), SUB, D, R)


@gluon.jit
def _step_cuts(union_row, step, rows, pos, first_pos, N: gl.constexpr, BLOCK: gl.constexpr,
               PARTS: gl.constexpr, SUB: gl.constexpr, GP: gl.constexpr, QT: gl.constexpr,
               TOK0: gl.constexpr = 0, TILE_QT: gl.constexpr = 0):
    """A step's first key offset in its block and the causal cuts: per row the last visible
    offset in the block (-1: its token did not select the block), the largest cut of any row
    and the smallest (-1 unless every token selected the block). The rows are QT tokens from
    the tile's TOK0-th (TILE_QT > QT: a tile of TILE_QT tokens shared by two consumers, PAIR);
    first_pos is the position of the first of them."""
    # the plan's slot of this step's block: block id and which tokens selected it
    j = step // PARTS
    base = gl.load(union_row + N + j) * BLOCK
    bits = gl.load(union_row + 2 * N + j)
    if TILE_QT > QT:
        bits = (bits >> TOK0) & ((1 << QT) - 1)
    cut_row = gl.where(((bits >> (rows // GP)) & 1) != 0, pos - base, -1)
    # tokens are consecutive positions, so the largest cut is the highest bit's token's
    last = 0
    for k in gl.static_range(1, QT):
        last += (bits >= (1 << k)).to(gl.int32)
    max_cut = first_pos + last - base
    min_cut = gl.where(bits == (1 << QT) - 1, first_pos - base, -1)
    return (step % PARTS) * SUB, cut_row, max_cut, min_cut


@gluon.jit
def _masked(sc, keys, key0, cut_row, min_cut, SUB: gl.constexpr):
    """S with the keys past each row's cut at -inf, on a step some row does not see whole (most
    of a shared selection's steps are not masked)."""
    if min_cut < key0 + SUB - 1:
        sc = gl.where((key0 + keys)[None, :] <= cut_row[:, None], sc, float("-inf"))
    return sc


@gluon.jit
def _softmax_step(sc, m_i, l_i, qk_scale):
    """Online softmax over one step: (p, the rescale of the rows' earlier terms, m, l)."""
    m_new = gl.maximum(m_i, gl.max(sc, axis=1) * qk_scale)
    shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(sc * qk_scale - shift[:, None])
    alpha = gl.exp2(m_i - shift)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _zero_v_tail(v_t, key0, max_cut, v_l: gl.constexpr):
    """Keys past every row's cut: their V rows (maybe never written) must not reach P @ V,
    where a zero p times a NaN gives NaN."""
    SUB: gl.constexpr = v_t.shape[0]
    keys_v = gl.arange(0, SUB, layout=gl.SliceLayout(1, v_l))
    tail = v_t.load(v_l)
    v_t.store(gl.where((key0 + keys_v)[:, None] <= max_cut, tail, 0.0).to(v_t.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _epilogue(acc, m_i, l_i, rows, v_scale_ptr, out_ptr, lse_ptr, t0, g, stride_ot, stride_oh,
              stride_od, stride_lt, stride_lh, G: gl.constexpr, GP: gl.constexpr,
              HAS_SCALE: gl.constexpr, o_l: gl.constexpr):
    """The rows' output (acc / l, in out's dtype) and natural-log LSE; an empty row gives 0
    and -inf."""
    ROWS_: gl.constexpr = acc.shape[0]
    D: gl.constexpr = acc.shape[1]
    if HAS_SCALE:
        acc = acc * gl.load(v_scale_ptr)
    empty_row = l_i == 0.0
    lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(gl.where(empty_row, 1.0, l_i))) * LN2)
    head_ok = rows % GP < G
    tok = t0 + rows // GP
    head = g * G + rows % GP
    gl.store(lse_ptr + tok.to(gl.int64) * stride_lt + head * stride_lh, lse, mask=head_ok)
    l_o = gl.convert_layout(gl.where(empty_row, 1.0, l_i), gl.SliceLayout(1, o_l))
    o = (acc / l_o[:, None]).to(out_ptr.dtype.element_ty)
    rows_o = gl.arange(0, ROWS_, layout=gl.SliceLayout(1, o_l))
    d_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))
    tok_o = t0 + rows_o // GP
    head_o = g * G + rows_o % GP
    gl.store(out_ptr + tok_o.to(gl.int64)[:, None] * stride_ot + head_o[:, None] * stride_oh
             + d_o[None, :] * stride_od, o, mask=(rows_o % GP < G)[:, None])


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v, union_row, num_steps,
              first_pos, qk_scale, v_scale_ptr, out_ptr, lse_ptr, t0, g, stride_ot, stride_oh,
              stride_od, stride_lt, stride_lh, G: gl.constexpr, GP: gl.constexpr,
              QT: gl.constexpr, N: gl.constexpr, BLOCK: gl.constexpr, PARTS: gl.constexpr,
              HAS_SCALE: gl.constexpr, TOK0: gl.constexpr = 0, TILE_QT: gl.constexpr = 0):
    """One warpgroup, one step at a time: the tile's 64 rows over every step, then their
    output and LSE. A step's keys go back to the producer once S = Q K^T has read them, so the
    next step's keys load during this step's softmax and P V; its values after P V.
    TILE_QT > QT (PAIR): this consumer's QT tokens are the tile's from the TOK0-th (t0 and
    first_pos are theirs), beside another consumer's, both reading one V buffer, whose rows
    past every row of the tile's cut the fp8 loader has zeroed."""
    SK: gl.constexpr = k_smem.shape[0]
    SV: gl.constexpr = v_smem.shape[0]
    SUB: gl.constexpr = k_smem.shape[2]
    D: gl.constexpr = k_smem.shape[4]
    # P's dtype: V's in the MMA (fp16 rings for fp8 K/V, whose q is then fp16 too)
    dtype: gl.constexpr = q_smem.dtype
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, SUB, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, D, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    v_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [4, 1], [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_l))
    keys = gl.arange(0, SUB, layout=gl.SliceLayout(0, s_l))
    pos = first_pos + rows // GP
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_l))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_l))
    acc = gl.zeros([ROWS, D], gl.float32, layout=o_l)
    zero = gl.zeros([ROWS, SUB], gl.float32, layout=s_l)
    for step in range(num_steps):
        key0, cut_row, max_cut, min_cut = _step_cuts(union_row, step, rows, pos, first_pos, N,
                                                     BLOCK, PARTS, SUB, GP, QT, TOK0,
                                                     TILE_QT)
        sk = step % SK
        mbarrier.wait(ready_k.index(sk), (step // SK) & 1)
        k_t = k_smem.index(sk).reshape([SUB, D]).permute((1, 0))
        sc = warpgroup_mma(q_smem, k_t, zero, use_acc=False, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))
        mbarrier.arrive(empty_k.index(sk), count=1)
        sc = _masked(sc, keys, key0, cut_row, min_cut, SUB)
        p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i, qk_scale)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_l)
        sv = step % SV
        mbarrier.wait(ready_v.index(sv), (step // SV) & 1)
        v_t = v_smem.index(sv).reshape([SUB, D])
        if TILE_QT <= QT:
            if max_cut < key0 + SUB - 1:
                _zero_v_tail(v_t, key0, max_cut, v_l)
        acc = warpgroup_mma(p_op, v_t, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_v.index(sv), count=1)
    _epilogue(acc, m_i, l_i, rows, v_scale_ptr, out_ptr, lse_ptr, t0, g, stride_ot, stride_oh,
              stride_od, stride_lt, stride_lh, G, GP, HAS_SCALE, o_l)


@gluon.jit
def _sparse_attention_tile_gluon_kernel(q_ptr, k_src, v_src, cu_ptr, seq_lens_ptr, out_ptr,
                                     lse_ptr, blocks_ptr, union_ptr, k_scale_ptr, v_scale_ptr,
                                     sm_scale, num_requests, stride_qt, stride_qh, stride_qd,
                                     stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
                                     stride_kp, stride_kb, stride_kh, stride_vp, stride_vb,
                                     stride_vh, SUB: gl.constexpr, D: gl.constexpr,
                                     NUM_KV_HEADS: gl.constexpr, G: gl.constexpr,
                                     GP: gl.constexpr, QT: gl.constexpr, KP: gl.constexpr,
                                     BLOCK: gl.constexpr, STAGES_K: gl.constexpr,
                                     STAGES_V: gl.constexpr, HAS_SCALE: gl.constexpr,
                                     FP8: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                     num_warps: gl.constexpr, PAIR: gl.constexpr = False,
                                     CONSUMER_REGS: gl.constexpr = 0):
    """k_src / v_src: 16-bit K/V, TMA descriptors of [SUB, D] boxes over the caches' [P, B,
    Hkv, D] views; fp8 K/V, the views themselves (the loader warpgroup reads them with their
    strides). PAIR (fp8): a tile of QT tokens, 128 rows, in two consumer warpgroups of QT / 2
    tokens each (the second a worker partition with CONSUMER_REGS registers) over one loader's
    rings. One program per SM then."""
    # the per-token launch, a programmatic dependent launch of this one, may start once every
    # program has passed here: the two write disjoint tokens, so the per-token kernel fills the
    # SMs this launch's tail leaves idle
    launch_dependents()
    PARTS: gl.constexpr = BLOCK // SUB
    N: gl.constexpr = QT * KP
    gl.static_assert(not PAIR or (QT % 2 == 0 and FP8),
                     "PAIR: fp8 K/V (the loader zeroes V's tail for both consumers), an even "
                     "number of tokens")
    CONS: gl.constexpr = 2 if PAIR else 1
    QC: gl.constexpr = QT // CONS  # tokens per consumer
    item = gl.program_id(0)
    num_blocks = gl.load(blocks_ptr + item)
    # a tile the plan left (-1) is the per-token kernel's
    if num_blocks >= 0:
        tile = item // NUM_KV_HEADS
        g = item % NUM_KV_HEADS
        t0 = tile * QT
        # the plan takes a tile only inside one request with valid positions
        first_pos = tile_position(cu_ptr, seq_lens_ptr, num_requests, t0)
        union_row = union_ptr + item.to(gl.int64) * (3 * N)
        if FP8:
            # fp8 K/V: the MMAs in fp16 with the softmax scale folded into q (tile.py's
            # F16_COMPUTE, same rounding)
            qk_scale = LOG2E
        else:
            qk_scale = sm_scale * LOG2E
        if HAS_SCALE:
            qk_scale = qk_scale * gl.load(k_scale_ptr)
        q_dtype: gl.constexpr = gl.float16 if FP8 else q_ptr.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, D], q_dtype)
        q_smem = gl.allocate_shared_memory(q_dtype, [CONS * ROWS, D], q_layout)
        # the tile's query rows (token-major, GP head slots per token; the padding slots read
        # zeros) into shared memory, where both MMAs of every step read them; in two halves,
        # so fewer registers are live before the partitions start
        HALF: gl.constexpr = ROWS // 2
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [num_warps, 1],
                                             [1, 0])
        d = gl.arange(0, D, layout=gl.SliceLayout(0, q_l))
        for h in gl.static_range(2 * CONS):
            rows = h * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, q_l))
            tok = t0 + rows // GP
            head = g * G + rows % GP
            q = gl.load(q_ptr + tok.to(gl.int64)[:, None] * stride_qt
                        + head[:, None] * stride_qh + d[None, :] * stride_qd,
                        mask=(rows % GP < G)[:, None], other=0.0)
            if FP8:
                q = (q.to(gl.float32) * sm_scale).to(gl.float16)
            # the loop applies the scale inside the exponent after taking row maxima of the
            # raw scores, which needs a positive scale: a negative one moves its sign onto q
            # (exact)
            q = gl.where(qk_scale < 0, -q, q)
            q_smem.slice(h * HALF, HALF).store(q)
        qk_scale = gl.abs(qk_scale)
        fence_async_shared()
        if FP8:
            # the rings in fp16, in the layout TMA would give a 16-bit box
            ring_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, SUB, 1, D],
                                                                        gl.float16)
            k_smem = gl.allocate_shared_memory(gl.float16, [STAGES_K, 1, SUB, 1, D], ring_l)
            v_smem = gl.allocate_shared_memory(gl.float16, [STAGES_V, 1, SUB, 1, D], ring_l)
        else:
            k_smem = gl.allocate_shared_memory(k_src.dtype, [STAGES_K, 1, SUB, 1, D],
                                               k_src.layout)
            v_smem = gl.allocate_shared_memory(v_src.dtype, [STAGES_V, 1, SUB, 1, D],
                                               v_src.layout)
        ready_k = gl.allocate_shared_memory(gl.int64, [STAGES_K, 1], mbarrier.MBarrierLayout())
        empty_k = gl.allocate_shared_memory(gl.int64, [STAGES_K, 1], mbarrier.MBarrierLayout())
        ready_v = gl.allocate_shared_memory(gl.int64, [STAGES_V, 1], mbarrier.MBarrierLayout())
        empty_v = gl.allocate_shared_memory(gl.int64, [STAGES_V, 1], mbarrier.MBarrierLayout())
        # (a buffer is free once every consumer has released it)
        for i in gl.static_range(STAGES_K):
            mbarrier.init(ready_k.index(i), count=1)
            mbarrier.init(empty_k.index(i), count=CONS)
        for i in gl.static_range(STAGES_V):
            mbarrier.init(ready_v.index(i), count=1)
            mbarrier.init(empty_v.index(i), count=CONS)
        gl.thread_barrier()  # q's tile and the barriers visible to every warp
        num_steps = num_blocks * PARTS
        # (the consumer's arguments written out in every call: a tuple held in a variable
        # loses its constexprs)
        if PAIR:
            q_hi = q_smem.slice(ROWS, ROWS)
            gl.warp_specialize([
                (_consumer, (q_smem.slice(0, ROWS), k_smem, v_smem, ready_k, ready_v, empty_k,
                             empty_v, union_row, num_steps, first_pos, qk_scale, v_scale_ptr,
                             out_ptr, lse_ptr, t0, g, stride_ot, stride_oh, stride_od,
                             stride_lt, stride_lh, G, GP, QC, N, BLOCK, PARTS, HAS_SCALE, 0,
                             QT)),
                (_consumer, (q_hi, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v,
                             union_row, num_steps, first_pos + QC, qk_scale, v_scale_ptr,
                             out_ptr, lse_ptr, t0 + QC, g, stride_ot, stride_oh, stride_od,
                             stride_lt, stride_lh, G, GP, QC, N, BLOCK, PARTS, HAS_SCALE, QC,
                             QT)),
                (_fp8_loader, (k_src, v_src, stride_kp, stride_kb, stride_kh, stride_vp,
                               stride_vb, stride_vh, k_smem, v_smem, ready_k, ready_v, empty_k,
                               empty_v, union_row, num_steps, g, PARTS, first_pos, N, BLOCK,
                               QT, True)),
            ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
        elif FP8:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v,
                             union_row, num_steps, first_pos, qk_scale, v_scale_ptr, out_ptr,
                             lse_ptr, t0, g, stride_ot, stride_oh, stride_od, stride_lt,
                             stride_lh, G, GP, QT, N, BLOCK, PARTS, HAS_SCALE)),
                (_fp8_loader, (k_src, v_src, stride_kp, stride_kb, stride_kh, stride_vp,
                               stride_vb, stride_vh, k_smem, v_smem, ready_k, ready_v, empty_k,
                               empty_v, union_row, num_steps, g, PARTS)),
            ], [4], [PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v,
                             union_row, num_steps, first_pos, qk_scale, v_scale_ptr, out_ptr,
                             lse_ptr, t0, g, stride_ot, stride_oh, stride_od, stride_lt,
                             stride_lh, G, GP, QT, N, BLOCK, PARTS, HAS_SCALE)),
                (_producer, (k_src, v_src, k_smem, v_smem, ready_k, ready_v, empty_k, empty_v,
                             union_row, num_steps, g, PARTS)),
            ], [1], [PRODUCER_REGS])
