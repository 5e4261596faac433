# SPDX-License-Identifier: Apache-2.0
"""Gluon kernel of the decode launch (decode, speculative verify) on NVFP4 index pages.

The same scores as scores.py's decode launch, S[t, h, b] = max over block b's causal keys of
q[t, h] . key, for requests of q_len <= SMALL_Q against an NVFP4 cache (openmsa/nvfp4.py), with
an fp8 e4m3 or fp16 index query. A decode scan reads every page once, so at the HBM roof a
72-byte token arrives every ~16 ps and leaves ~3.7 thread instructions per key value for
everything (docs/design.md). The Triton form spends them on a trip of the dequantized tile
through shared memory to the MMA and on a maximum across warps each block; this kernel has
neither:

* a program is one warp. It walks the blocks of one split of one request and keeps its own
  maxima, so no tile is shared and no maximum crosses warps. Its pages arrive by cp.async in a
  ring of half-block stages in shared memory (bytes in flight cost no registers), and 15 such
  warps share an SM (14 KB of ring each, plus the 1 KB an sm_90 block reserves; plan.py:
  IndexerConfig.decode_nvfp4: stages, maxnreg_8_rows).
* A thread reads 16 contiguous code bytes (4 words, 32 values of two scale groups) per token
  row and turns them into fp16 values straight in the registers the MMA (m16n8k16) reads as
  its key operand. The head-dim order in those registers is whatever the bit moves leave
  (_dims below): the query operand, loaded once a row pass, is gathered in the same order.
* The bit moves (_DEQUANT_ASM): an E2M1 code's exponent and mantissa bits placed at bits 9-11
  of an fp16 and its sign at bit 15 are the fp16 value e2m1 * 2^-14, subnormal range included
  (both formats give the subnormal step the same weight). Four such high bytes are built per
  code word at once (shift and mask), and a byte permute puts two of them, with zero low bytes,
  in one fp16x2 register. One fp16x2 multiply by the group's scale * 128 then gives
  e2m1 * scale * 2^-7, exact (at most 6 significant bits, |k| in [2^-17, 21]); the score is the
  fp32 accumulator times 128.

Keys as the MMA's M (tokens), the (token, head) rows as its N: 8 or 16 rows a pass (a decode
step at TP1 has 4, a verify step of 4 tokens 16); a request with more rows takes several passes
over its split, each reading the keys again.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ...common.gluon_utils import launch_dependents, request_ok, step_well_formed

# code words (32-bit, 8 values) of a token (Di = 128), and the words of a thread's 16-byte load
WORDS = gl.constexpr(16)
VEC = gl.constexpr(4)

# Per call (pack=4): one thread's 4 code words of a token row (w0-w3, 32 values; w0, w1 in
# scale group 2c, w2, w3 in 2c + 1) and its two E4M3 scale bytes (low byte group 2c) ->
# 8 outputs of 2 fp16x2 registers: output i, register h is word x = 2h + (i >> 2)'s byte pair
# p = i & 3 (p 0, 1: the low codes of bytes 0-1, 2-3; p 2, 3: the high codes), times its
# group's scale * 128. (pack=4 hands the asm a thread's 4 consecutive register elements, in the
# load layout one token row's 4 words; the outputs keep those slots, so a value may come from
# another slot's word: the GPU test of one-hot queries pins every dim's place.)
_DEQUANT_ASM = gl.constexpr("""{
.reg .b32 t, u, z, c, sf, s0, s1, l<4>, h<4>;
.reg .b16 sa, sb;
mov.b32 z, 0;
mov.b32 c, 0x58005800;
mov.b32 {sa, sb}, $20;
cvt.rn.f16x2.e4m3x2 sf, sa;
mul.rn.f16x2 sf, sf, c;
mov.b32 {sa, sb}, sf;
mov.b32 s0, {sa, sa};
mov.b32 s1, {sb, sb};
shl.b32 t, $16, 1;
and.b32 t, t, 0x0E0E0E0E;
shl.b32 u, $16, 4;
and.b32 u, u, 0x80808080;
or.b32 l0, t, u;
shr.b32 t, $16, 3;
and.b32 t, t, 0x0E0E0E0E;
and.b32 u, $16, 0x80808080;
or.b32 h0, t, u;
shl.b32 t, $17, 1;
and.b32 t, t, 0x0E0E0E0E;
shl.b32 u, $17, 4;
and.b32 u, u, 0x80808080;
or.b32 l1, t, u;
shr.b32 t, $17, 3;
and.b32 t, t, 0x0E0E0E0E;
and.b32 u, $17, 0x80808080;
or.b32 h1, t, u;
shl.b32 t, $18, 1;
and.b32 t, t, 0x0E0E0E0E;
shl.b32 u, $18, 4;
and.b32 u, u, 0x80808080;
or.b32 l2, t, u;
shr.b32 t, $18, 3;
and.b32 t, t, 0x0E0E0E0E;
and.b32 u, $18, 0x80808080;
or.b32 h2, t, u;
shl.b32 t, $19, 1;
and.b32 t, t, 0x0E0E0E0E;
shl.b32 u, $19, 4;
and.b32 u, u, 0x80808080;
or.b32 l3, t, u;
shr.b32 t, $19, 3;
and.b32 t, t, 0x0E0E0E0E;
and.b32 u, $19, 0x80808080;
or.b32 h3, t, u;
prmt.b32 $0, l0, z, 0x1404;
prmt.b32 $2, l0, z, 0x3424;
prmt.b32 $4, h0, z, 0x1404;
prmt.b32 $6, h0, z, 0x3424;
prmt.b32 $8, l1, z, 0x1404;
prmt.b32 $10, l1, z, 0x3424;
prmt.b32 $12, h1, z, 0x1404;
prmt.b32 $14, h1, z, 0x3424;
prmt.b32 $1, l2, z, 0x1404;
prmt.b32 $3, l2, z, 0x3424;
prmt.b32 $5, h2, z, 0x1404;
prmt.b32 $7, h2, z, 0x3424;
prmt.b32 $9, l3, z, 0x1404;
prmt.b32 $11, l3, z, 0x3424;
prmt.b32 $13, h3, z, 0x1404;
prmt.b32 $15, h3, z, 0x3424;
mul.rn.f16x2 $0, $0, s0;
mul.rn.f16x2 $2, $2, s0;
mul.rn.f16x2 $4, $4, s0;
mul.rn.f16x2 $6, $6, s0;
mul.rn.f16x2 $8, $8, s0;
mul.rn.f16x2 $10, $10, s0;
mul.rn.f16x2 $12, $12, s0;
mul.rn.f16x2 $14, $14, s0;
mul.rn.f16x2 $1, $1, s1;
mul.rn.f16x2 $3, $3, s1;
mul.rn.f16x2 $5, $5, s1;
mul.rn.f16x2 $7, $7, s1;
mul.rn.f16x2 $9, $9, s1;
mul.rn.f16x2 $11, $11, s1;
mul.rn.f16x2 $13, $13, s1;
mul.rn.f16x2 $15, $15, s1;
}""")


@gluon.jit
def _dims(i: gl.constexpr, k):
    """The head dim at MMA k index k (0..15) of chunk i (0..7): thread c = (k >> 1) & 3 of a
    row holds its token's code words 4c..4c+3 (dims 32c..32c+31), h = k >> 3 picks word 2h +
    (i >> 2) (scale group 2c + h), and byte pair i & 3 of it the code (low codes of bytes 0-1
    and 2-3: codes 0, 2 and 4, 6; high codes: 1, 3 and 5, 7), k & 1 the pair's second byte."""
    p: gl.constexpr = i & 3
    return 32 * ((k >> 1) & 3) + 16 * (k >> 3) + 8 * (i >> 2) + 4 * (p & 1) + (p >> 1) \
        + 2 * (k & 1)


@gluon.jit
def _relabel(x, TOKS: gl.constexpr):
    """[TOKS, 16] in the load's layout (thread c: elements 4c + e of a row) -> the same
    registers indexed as the MMA's k: element 4c + 2h + e0 is k = 8h + 2c + e0."""
    return x.reshape([TOKS, 4, 2, 2]).permute([0, 2, 1, 3]).reshape([TOKS, WORDS])


@gluon.jit
def _query_chunk(q_ptr, tok, head, row_ok, stride_qt, stride_qh, stride_qd, i: gl.constexpr,
                 NP: gl.constexpr, layout: gl.constexpr):
    """The MMA's second operand for chunk i: [16, NP], element (k, n) = q[tok_n, head_n,
    _dims(i, k)], fp16 (an fp8 query converts exactly)."""
    k = gl.arange(0, WORDS, layout=gl.SliceLayout(1, layout))
    d = _dims(i, k)
    q = gl.load(q_ptr + tok.to(gl.int64)[None, :] * stride_qt + head[None, :] * stride_qh
                + d[:, None] * stride_qd, mask=row_ok[None, :], other=0.0)
    return q.to(gl.float16)


@gluon.jit
def _nvfp4_decode_kernel(q_ptr, cache_ptr, cu_ptr, seq_lens_ptr, bt_ptr, out_ptr, num_requests,
                          num_tokens, num_pages, table_width, stride_qt, stride_qh, stride_qd,
                          stride_cp, stride_btr, stride_btb, stride_ot, stride_oh, stride_ob,
                          H: gl.constexpr, NP: gl.constexpr, BPS: gl.constexpr,
                          BLOCK: gl.constexpr, SMALL_Q: gl.constexpr, PDL: gl.constexpr,
                          STAGES: gl.constexpr):
    """Program (r, s): request r's blocks [s * BPS, (s + 1) * BPS) for all its (token, head)
    rows, NP at a time."""
    if PDL:
        launch_dependents()
    r = gl.program_id(0)
    b_lo = gl.program_id(1) * BPS
    t_req = gl.load(cu_ptr + r)
    cu_next = gl.load(cu_ptr + r + 1)
    # q_len decides positions and which launch takes the request, as in scores.py
    q_len = cu_next - t_req
    n_tok = gl.minimum(cu_next, num_tokens) - t_req
    seq_len = gl.load(seq_lens_ptr + r)
    # (ceil(seq_len / BLOCK) without the int32 overflow of seq_len + BLOCK - 1)
    b_hi = gl.minimum(b_lo + BPS, gl.where(seq_len > 0, (seq_len - 1) // BLOCK + 1, 0))
    # (request_ok bounds b_hi by the table's width; a malformed step is padding: docs/spec.md,
    # "Bounds")
    if ((q_len > 0) & (q_len <= SMALL_Q) & request_ok(q_len, seq_len, table_width, BLOCK)
            & (b_lo < b_hi) & step_well_formed(cu_ptr, num_requests, num_tokens)):
        # a ring of STAGES half-blocks of code words and scales, filled by cp.async ahead of
        # the loop that reads them: the bytes in flight cost shared memory, not registers
        words_s = gl.allocate_shared_memory(gl.int32, [STAGES, UNIT, WORDS], _FLAT2)
        scales_s = gl.allocate_shared_memory(gl.int32, [STAGES, UNIT // 2, 4], _FLAT2)
        for row0 in range(0, n_tok * H, NP):
            _score_rows(q_ptr, cache_ptr, bt_ptr + r.to(gl.int64) * stride_btr, out_ptr,
                        words_s, scales_s, t_req, q_len, n_tok, seq_len, row0, b_lo, b_hi,
                        num_pages, stride_qt, stride_qh, stride_qd, stride_cp, stride_btb,
                        stride_ot, stride_oh, stride_ob, H, NP, BLOCK, STAGES)


# tokens per stage of the ring (half a block), and unswizzled shared layouts (a warp's 16-byte
# reads of 8 consecutive 64-byte token rows are conflict-free as is)
UNIT = gl.constexpr(64)
_FLAT2 = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
# the MMA (mma.sync m16n8k16) of a one-warp program: keys as M, the (token, head) rows as N
_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                              instr_shape=[16, 8]))


@gluon.jit
def _unit_page(row_bt, unit, n_units, b_lo, stride_btb, num_pages):
    """The page id of unit `unit`'s block: -1 past the split and for a stale id past the cache;
    a negative entry stays negative (docs/spec.md, "Bounds": any id < 0 or >= num_pages reads
    nothing, and `_issue` and the block's maxima test the sign)."""
    page = gl.load(row_bt + (b_lo + unit // 2) * stride_btb, mask=unit < n_units, other=-1)
    return gl.where(page < num_pages, page, -1)


@gluon.jit
def _issue(words_s, scales_s, page, cache_ptr, unit, stride_cp, BLOCK: gl.constexpr,
           STAGES: gl.constexpr):
    """cp.async copies of unit `unit` (page `page`, its half unit % 2: 64 tokens' code words
    and scales) into ring slot unit % STAGES, as one commit group (empty for a page id < 0:
    past the split, or a block the table leaves out)."""
    cw_l: gl.constexpr = gl.BlockedLayout([1, VEC], [8, 4], [1, 1], [1, 0])
    cs_l: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [1, 1], [1, 0])
    ok = page >= 0
    base = cache_ptr + page.to(gl.int64) * stride_cp
    half = unit % 2
    tok = gl.arange(0, UNIT, layout=gl.SliceLayout(1, cw_l))
    j = gl.arange(0, WORDS, layout=gl.SliceLayout(0, cw_l))
    wbase = (base + half * (UNIT * 64)).to(gl.pointer_type(gl.int32))
    wp = wbase + (tok[:, None] * WORDS + j[None, :])
    slot = unit % STAGES
    async_copy.async_copy_global_to_shared(words_s.index(slot), wp, mask=ok)
    e = gl.arange(0, UNIT // 2, layout=gl.SliceLayout(1, cs_l))
    f = gl.arange(0, 4, layout=gl.SliceLayout(0, cs_l))
    sp = (base + BLOCK * 64 + half * (UNIT * 8)).to(gl.pointer_type(gl.int32)) \
        + (e[:, None] * 4 + f[None, :])
    async_copy.async_copy_global_to_shared(scales_s.index(slot), sp, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _unit(cache_ptr, row_bt, out_row, words_s, scales_s, qs, best, held, page_next, u, n_units,
          b_lo, b_full, pos, keys, store_ok, num_pages, stride_cp, stride_btb, stride_ob,
          NP: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr):
    """Ring unit u (half of block b = b_lo + u // 2): its copies awaited, unit u + STAGES - 1's
    issued, its 64 keys scored against the rows' queries qs into the running maxima `best`
    (with MASKED, keys past a row's position masked where b >= b_full), the block's maxima
    stored after its second unit. Returns (best, held, page_next) for the next unit."""
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=2)
    # an MMA tile's token rows: 4 contiguous code words (16 bytes) a thread, 4 threads a row,
    # and the thread's two scale bytes (groups 2c, 2c + 1) as one int16
    w_l: gl.constexpr = gl.BlockedLayout([1, VEC], [8, 4], [1, 1], [1, 0])
    s_l: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [1, 1], [1, 0])
    # unit u's copies done (this thread's), then everyone's: and every read of the slot the
    # next copies overwrite (unit u - 1's) is behind the barrier
    async_copy.wait_group(STAGES - 2)
    gl.thread_barrier()
    _issue(words_s, scales_s, page_next, cache_ptr, u + STAGES - 1, stride_cp, BLOCK, STAGES)
    page_next = _unit_page(row_bt, u + STAGES, n_units, b_lo, stride_btb, num_pages)
    b = b_lo + u // 2
    if u % 2 == 0:
        held = _unit_page(row_bt, u, n_units, b_lo, stride_btb, num_pages)
    ws = words_s.index(u % STAGES)
    ss = scales_s.index(u % STAGES)._reinterpret(gl.int16, [UNIT, 4], _FLAT2)
    for mt in gl.static_range(UNIT // 16):
        w = _relabel(ws.slice(mt * 16, 16, dim=0).load(w_l), 16)
        s4 = ss.slice(mt * 16, 16, dim=0).load(s_l).to(gl.int32)
        s = gl.join(gl.join(s4, s4), gl.join(s4, s4)).reshape([16, WORDS])
        s = _relabel(gl.convert_layout(s, w_l), 16)
        chunks = gl.inline_asm_elementwise(
            _DEQUANT_ASM, "=r," * 16 + "r,r,r,r,r,r,r,r", [w, s],
            dtype=(gl.float16,) * 8, is_pure=True, pack=4)
        acc = gl.zeros([16, NP], gl.float32, layout=_MMA)
        for i in gl.static_range(8):
            acc = mma_v2(gl.convert_layout(chunks[i], a_l, assert_trivial=True), qs[i], acc)
        if MASKED and b >= b_full:
            kpos = b * BLOCK + (u % 2) * UNIT + mt * 16 + keys
            acc = gl.where(kpos[:, None] <= pos[None, :], acc, float("-inf"))
        best = gl.maximum(best, acc)
    if u % 2 == 1:
        # the block's maxima; the max skips NaN (PTX max.f32): only an all-NaN block is left
        # to clean, and a page id < 0 (no page: its copies were skipped) scores -inf. (held:
        # the id the block's first unit loaded, so no load's latency stalls the store)
        m = gl.max(best, axis=0) * 128.0
        m = gl.where((held >= 0) & (m == m), m, float("-inf"))
        gl.store(out_row + b.to(gl.int64) * stride_ob, m, mask=store_ok)
        best = gl.full([16, NP], float("-inf"), gl.float32, layout=_MMA)
    return best, held, page_next


@gluon.jit
def _score_rows(q_ptr, cache_ptr, row_bt, out_ptr, words_s, scales_s, t_req, q_len, n_tok,
                seq_len, row0, b_lo, b_hi, num_pages, stride_qt, stride_qh, stride_qd, stride_cp,
                stride_btb, stride_ot, stride_oh, stride_ob, H: gl.constexpr,
                NP: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr):
    """Rows [row0, row0 + NP) of a request's first n_tok tokens (row n: its token n // H, head
    n % H) against blocks [b_lo, b_hi), each block's maxima stored as it completes."""
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=2)
    # the ring's first units are in flight while the query loads (a short split's program
    # would otherwise wait out both latencies in turn), and each unit's page id is loaded an
    # iteration before its copies are issued (so no unit waits on a load of its own page id)
    n_units = 2 * (b_hi - b_lo)
    for v in gl.static_range(STAGES - 1):
        _issue(words_s, scales_s, _unit_page(row_bt, v, n_units, b_lo, stride_btb, num_pages),
               cache_ptr, v, stride_cp, BLOCK, STAGES)
    page_next = _unit_page(row_bt, STAGES - 1, n_units, b_lo, stride_btb, num_pages)
    rows = n_tok * H
    n_q = row0 + gl.arange(0, NP, layout=gl.SliceLayout(0, b_l))
    tok_q = t_req + n_q // H
    head_q = n_q % H
    ok_q = n_q < rows
    # the MMA's second operand of each of the 8 key chunks, loaded once a row pass
    qs = ()
    for i in gl.static_range(8):
        qs = qs + (_query_chunk(q_ptr, tok_q, head_q, ok_q, stride_qt, stride_qh, stride_qd, i,
                                NP, b_l),)
    # the rows along the accumulator's N: positions (right-aligned tokens) and score rows
    n_a = row0 + gl.arange(0, NP, layout=gl.SliceLayout(0, _MMA))
    pos = seq_len - q_len + n_a // H
    out_row = out_ptr + (t_req + n_a // H).to(gl.int64) * stride_ot + (n_a % H) * stride_oh
    store_ok = n_a < rows
    keys = gl.arange(0, 16, layout=gl.SliceLayout(1, _MMA))
    # blocks wholly at or before the earliest row's position need no causal mask
    b_full = (seq_len - q_len + row0 // H + 1) // BLOCK
    best = gl.full([16, NP], float("-inf"), gl.float32, layout=_MMA)
    # the page id of the block being scored, loaded at its first unit (see the block's end)
    held = b_lo * 0
    # with 8 rows a pass, the units of blocks wholly at or before the earliest row's position
    # first, with no causal mask: that loop's body has no branch between its MMA tiles, so
    # ptxas interleaves the tiles' dequantization and MMA chains; then the rest, masked.
    # 16-row passes, whose registers leave ptxas less room for that, keep one loop that masks
    # the tiles of blocks at or past b_full (docs/performance.md, "NVFP4 index pages")
    u_mask = b_lo * 0
    if NP == 8:
        u_mask = gl.minimum(gl.maximum(2 * (b_full - b_lo), 0), n_units)
        for blk in range(u_mask // 2):
            # (a block's two units unrolled: each unit's parity, so whether it loads the
            # block's page id or stores its maxima, folds to a constant)
            for half in gl.static_range(2):
                best, held, page_next = _unit(cache_ptr, row_bt, out_row, words_s, scales_s, qs,
                                              best, held, page_next, 2 * blk + half, n_units,
                                              b_lo, b_full, pos, keys, store_ok, num_pages,
                                              stride_cp, stride_btb, stride_ob, NP, BLOCK,
                                              STAGES, False)
    for u in range(u_mask, n_units):
        best, held, page_next = _unit(cache_ptr, row_bt, out_row, words_s, scales_s, qs, best,
                                      held, page_next, u, n_units, b_lo, b_full, pos, keys,
                                      store_ok, num_pages, stride_cp, stride_btb, stride_ob, NP,
                                      BLOCK, STAGES, True)
    # every copy landed and every read done before the next row pass refills the ring
    async_copy.wait_group(0)
    gl.thread_barrier()
