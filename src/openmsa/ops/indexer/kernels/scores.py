# SPDX-License-Identifier: Apache-2.0
"""Triton kernel of block scoring: S[t, h, b] = max_{j in block b, j <= p} q[t, h] . key[j].

One kernel, launched twice per step so that no host sync splits the batch (plan.py chooses
which of the two a step needs):

* the "request" launch, grid (R, splits): program (r, s) reads blocks of split s of request r once
  and scores them for all of r's tokens (decode and speculative verify, q_len <= SMALL_Q) and all
  index heads, in sub-tiles of ROWS_T tokens. This is the memory-bound decode path.
* the "tile" launch (TILE_MODE), grid (ceil(T / ROWS_T), splits): program (i, s) takes a tile of
  ROWS_T packed tokens (the last tile first) of every long request (q_len > SMALL_Q)
  overlapping it, a ROWS_T * H-row tensor-core tile against each block of split s. This is the
  compute-bound prefill path.

Each program writes its [rows, BPS] score tile once, so stores are coalesced along b.
Context parallelism (CP, cp.py): with CP set, the kernel scores rank cp_rank's share of a group
of cp_size ranks, the logical blocks b = j * cp_size + cp_rank, through the strided view
block_table[:, cp_rank::cp_size] (local block j). Every causal position is then mapped into that
local space (_cp_local_pos), so the same masks, loop bounds and tiles apply unchanged.

Bytes: the decode launch reads sum_r nb_r * B * Di * bytes(cache) plus the tiny query and score
traffic; that is the whole cost model of decode. An NVFP4 cache (NVFP4=True) is 72 bytes a token,
dequantized in registers by _nvfp4_keys.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from ...cache.geometry import ROPE_FINE, ROPE_MAX_POSITION
from ...cache.kernels.prepare import norm_rope_rows, prepare_tile
from ...cache.kernels.write import saturate_to
from ...common.triton_utils import find_request, request_ok, step_well_formed


@triton.jit
def _max_skip_nan(a, b):
    # maxnum: on the GPU, PTX max.f32 returns the other operand when one is NaN (spelled out so
    # that a change of tl.max's default cannot turn NaN keys into NaN scores)
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.NONE)


# one 32-bit word of codes (8 dims, 4 bytes) and its group's scale * 64 (fp16) to 8 fp16 keys:
# the E4M3 bytes of the low nibbles (l) and of the high nibbles (h) for 4 bytes at once, then
# interleaved into (dim 2j, 2j + 1) pairs, converted and scaled two at a time
_NVFP4_WORD_ASM = tl.constexpr("""{
.reg .b32 t, l, h, p, q, s2, a, b, c, d;
.reg .b16 pa, pb, pc, pd;
shl.b32 t, $8, 2;
and.b32 l, t, 0x1C1C1C1C;
shl.b32 t, $8, 4;
and.b32 t, t, 0x80808080;
or.b32 l, l, t;
shr.b32 t, $8, 2;
and.b32 h, t, 0x1C1C1C1C;
and.b32 t, $8, 0x80808080;
or.b32 h, h, t;
prmt.b32 p, l, h, 0x5140;
prmt.b32 q, l, h, 0x7362;
mov.b32 {pa, pb}, p;
mov.b32 {pc, pd}, q;
mov.b32 s2, {$9, $9};
cvt.rn.f16x2.e4m3x2 a, pa;
cvt.rn.f16x2.e4m3x2 b, pb;
cvt.rn.f16x2.e4m3x2 c, pc;
cvt.rn.f16x2.e4m3x2 d, pd;
mul.rn.f16x2 a, a, s2;
mul.rn.f16x2 b, b, s2;
mul.rn.f16x2 c, c, s2;
mul.rn.f16x2 d, d, s2;
mov.b32 {$0, $1}, a;
mov.b32 {$2, $3}, b;
mov.b32 {$4, $5}, c;
mov.b32 {$6, $7}, d;
}""")


@triton.jit
def _nvfp4_keys(cache_ptr, page, page_ok, stride_cp, BLOCK: tl.constexpr, DI: tl.constexpr,
                dtype: tl.constexpr, PTX: tl.constexpr):
    """[BLOCK, DI] keys of an NVFP4 page (openmsa/nvfp4.py) in `dtype` (fp16 or bf16), exact.

    Hopper has no FP4 MMA, and at the HBM roof a 72-byte token leaves a few instructions per
    key value (docs/design.md), so the codes become fp8 bytes by bit moves alone: the E2M1
    nibble's exponent and mantissa bits shifted two places up are an E4M3 byte whose value is
    exactly e2m1 * 2^-6 (E2M1's subnormal 0.5 lands on E4M3's subnormals), its sign bit moved to
    bit 7. The hardware converts the bytes to fp16 in pairs; one fp16 multiply by scale * 64
    per value (exact: products of 2 and 4 significant bits, 2^-10 <= |k| <= 2688) gives the
    key, and the caller runs one K = DI MMA on it."""
    GROUPS: tl.constexpr = DI // 16
    tok = tl.arange(0, BLOCK)
    base = cache_ptr + page * stride_cp
    g = tl.arange(0, GROUPS)
    scales = tl.load(base + BLOCK * (DI // 2) + tok[:, None] * GROUPS + g[None, :], mask=page_ok,
                     other=0)  # uint8 [BLOCK, GROUPS]
    s = scales.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 64.0
    if not PTX:
        # E4M3's NaN bytes (a group written from a NaN key) made NaN by a compare: Triton's
        # interpreter converts fp8 bit by bit and would read them as 480 (NVIDIA's cvt gives
        # NaN itself)
        s = tl.where((scales & 0x7F) == 0x7F, float("nan"), s)
    if PTX:
        # (NVIDIA GPUs: the bit moves on 4 code bytes at once, PTX's prmt and paired cvt; the
        # interpreter and ROCm take the tl form below, the same values)
        # a token's codes as 32-bit words (8 dims each; two words per scale group)
        w = tl.arange(0, DI // 8)
        words = tl.load(base.to(tl.pointer_type(tl.int32)) + tok[:, None] * (DI // 8) + w[None, :],
                        mask=page_ok, other=0)  # int32 [BLOCK, DI / 8]
        sw = tl.join(s, s).reshape(BLOCK, DI // 8)
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _NVFP4_WORD_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, sw],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        k = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)),
                    tl.join(tl.join(v1, v5), tl.join(v3, v7))).reshape(BLOCK, DI)
    else:
        j = tl.arange(0, DI // 2)
        codes = tl.load(base + tok[:, None] * (DI // 2) + j[None, :], mask=page_ok,
                        other=0)  # uint8 [BLOCK, DI / 2]: dim 2j low nibble, 2j + 1 high
        lo = ((codes & 0x07) << 2) | ((codes & 0x08) << 4)
        hi = ((codes >> 2) & 0x1C) | (codes & 0x80)
        k = tl.join(lo, hi).reshape(BLOCK, DI).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        k = (k.reshape(BLOCK, GROUPS, 16) * s[:, :, None]).reshape(BLOCK, DI)
    return k.to(dtype)


@triton.jit
def _cp_local_pos(p, cp_size, cp_rank, BLOCK: tl.constexpr):
    """Token position p (>= 0) in the local key space of a CP rank: key j * BLOCK + o of local
    block j (global block j * cp_size + cp_rank) is causal for p iff it is <= the result; -1
    when the rank owns no block at or before p's. Nondecreasing in p."""
    g = p // BLOCK
    j = (g - cp_rank) // cp_size
    own = j * cp_size + cp_rank == g
    lp = tl.where(own, j * BLOCK + p % BLOCK, j * BLOCK + BLOCK - 1)
    return tl.where(g < cp_rank, -1, lp)


@triton.jit
def _score_block(q, cache_ptr, split_pages, tile, b, b_lo, pos, stride_cp, stride_cb, stride_cd,
                 d, DI: tl.constexpr, BLOCK: tl.constexpr, BPS: tl.constexpr,
                 CAST_K: tl.constexpr, IEEE: tl.constexpr, CAUSAL: tl.constexpr,
                 KEYS_AS_ROWS: tl.constexpr, MAX_SKIPS_NAN: tl.constexpr, num_pages,
                 NVFP4: tl.constexpr = False, page_ptr=None, NEW_KEYS: tl.constexpr = False,
                 ROT: tl.constexpr = 0, FP32_ANGLES: tl.constexpr = False,
                 ROPE_SCALE: tl.constexpr = 1.0, prep=None):
    """Column b - b_lo of the [rows, BPS] score tile: each row's max over block b's keys.
    NVFP4: the cache is NVFP4 pages (stride_cp apart; q is 16-bit, see _nvfp4_query), and the
    page id is read from the table (page_ptr: block b's entry) as one scalar load instead of taken
    out of split_pages: that cross-thread sum (a warp reduction, two barriers and shared-memory
    round trips a block) sat on the chain to the next block's prefetch; the scalar load is an
    L1 hit (a split's ids share two lines) and the same id."""
    offs = tl.arange(0, BLOCK)
    cols = tl.arange(0, BPS)
    if NVFP4:
        page = tl.load(page_ptr).to(tl.int64)
    else:
        page = tl.sum(tl.where(cols == b - b_lo, split_pages, 0), axis=0).to(tl.int64)
    # an id naming no page of the cache (-1 for an unfilled entry, or a stale id past the
    # cache) reads nothing and scores -inf (docs/spec.md, "Bounds")
    page_ok = (page >= 0) & (page < num_pages)
    if NVFP4:
        # (MAX_SKIPS_NAN is the plan's "an NVIDIA GPU": the PTX form of the dequantization)
        k = _nvfp4_keys(cache_ptr, page, page_ok, stride_cp, BLOCK, DI, q.dtype, MAX_SKIPS_NAN)
    else:
        k = tl.load(cache_ptr + page * stride_cp + offs[:, None] * stride_cb
                    + d[None, :] * stride_cd, mask=page_ok & (d[None, :] < DI),
                    other=0.0)  # [BLOCK, DIP]
        if NEW_KEYS:
            k = _with_new_keys(k, page, cache_ptr.dtype.element_ty, d, BLOCK, DI, ROT,
                               FP32_ANGLES, ROPE_SCALE, prep)
        if CAST_K:
            k = k.to(q.dtype)
    if KEYS_AS_ROWS:
        # keys are the matrix unit's M dimension (128 >= the 64 rows of a Hopper warpgroup MMA),
        # so an fp8 key tile feeds the tensor cores from shared memory as is; with the query rows
        # as M (16 rows), Triton falls back to 16-row MMAs that first convert every key to fp16
        s = tl.dot(k, tl.trans(q))  # [BLOCK, M]
        if CAUSAL:
            s = tl.where((b * BLOCK + offs)[:, None] <= pos[None, :], s, float("-inf"))
        if not MAX_SKIPS_NAN:
            s = tl.where(s == s, s, float("-inf"))
        best = tl.reduce(s, 0, _max_skip_nan)  # [M]
    else:
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [M, BLOCK]
        else:
            s = tl.dot(q, tl.trans(k))  # [M, BLOCK]
        # with CAUSAL, keys after the row's token do not count
        if CAUSAL:
            s = tl.where((b * BLOCK + offs)[None, :] <= pos[:, None], s, float("-inf"))
        if not MAX_SKIPS_NAN:
            s = tl.where(s == s, s, float("-inf"))
        best = tl.reduce(s, 1, _max_skip_nan)  # [M]
    # NaN counts as -inf. On the GPU the max already skips NaN keys (PTX max.f32 returns the
    # other operand), so only an all-NaN block is left to fix, per row instead of per key: a
    # per-key compare and select would double the prefill loop's instructions. The
    # interpreter's numpy max propagates NaN, so there every key is cleaned first.
    best = tl.where(page_ok & (best == best), best, float("-inf"))
    return tl.where(cols[None, :] == b - b_lo, best[:, None], tile)


@triton.jit
def _nvfp4_query(q):
    """The query against NVFP4 keys: fp8 e4m3 as fp16 (exact), so that it meets the fp16 keys of
    _nvfp4_keys in one fp16 MMA; a 16-bit query as is (the keys take its type)."""
    if q.dtype.is_fp8():
        q = q.to(tl.float16)
    return q


# The scoring launch that also runs the step's preparation (_prepare_scores_kernel) passes the
# preparation's run-time inputs down as one tuple, `prep`, each function's last argument:
#   (qkv_ptr, pos_ptr, index_slot_ptr, iqw_ptr, ikw_ptr, table_ptr, eps, num_tokens,
#    num_index_slots, stride_xt, stride_xc, iq_col0, ik_col0, init_blocks, local_blocks, topk)
# and RoPE's constexprs (ROT, FP32_ANGLES, ROPE_SCALE) as parameters of their own (a
# constexpr inside a run-time tuple does not reach a callee's constexpr parameter through
# Triton's lowering); the casts saturate for the fp8 e4m3 types, as the preparation's plan sets.
_NCOARSE = tl.constexpr(ROPE_MAX_POSITION // ROPE_FINE)


@triton.jit
def _prepared_query(tok, head, row_ok, dtype: tl.constexpr, DI: tl.constexpr,
                    DIP: tl.constexpr, ROT: tl.constexpr, FP32_ANGLES: tl.constexpr,
                    ROPE_SCALE: tl.constexpr, prep):
    """The index query of rows (tok, head) [M], prepared from the projection row as the
    preparation's index-query tiles prepare it (norm_rope_rows, then the cast to `dtype`, the
    index query's): [M, DIP], zero on rows outside row_ok."""
    (qkv_ptr, pos_ptr, slot_ptr, iqw_ptr, ikw_ptr, table_ptr, eps, num_tokens, num_slots,
     stride_xt, stride_xc, iq_col0, ik_col0, init_blocks, local_blocks, topk) = prep
    d = tl.arange(0, DIP)[None, :]
    mask = row_ok[:, None] & (d < DI)
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=0).to(tl.int32)[:, None]
    base = qkv_ptr + tok.to(tl.int64)[:, None] * stride_xt \
        + (iq_col0 + head[:, None] * DI) * stride_xc
    y = norm_rope_rows(base, stride_xc, mask, iqw_ptr, pos, table_ptr, eps, DI, DIP, ROT,
                       _NCOARSE, FP32_ANGLES, ROPE_SCALE)
    return saturate_to(y, dtype, (dtype == tl.float8e4nv) | (dtype == tl.float8e4b8))


@triton.jit
def _with_new_keys(k, page, cache_dtype: tl.constexpr, dims, BLOCK: tl.constexpr,
                   DI: tl.constexpr, ROT: tl.constexpr, FP32_ANGLES: tl.constexpr,
                   ROPE_SCALE: tl.constexpr, prep):
    """k [BLOCK, DIP], page `page`'s keys as loaded, as they are once this launch's preparation
    has written the step's index keys: each key whose slot lies in the page replaces its row, in
    token order. The preparation's programs write concurrently with the scoring programs, so a
    row the load saw there may be the old key or the new one; this makes it the new one."""
    (qkv_ptr, pos_ptr, slot_ptr, iqw_ptr, ikw_ptr, table_ptr, eps, num_tokens, num_slots,
     stride_xt, stride_xc, iq_col0, ik_col0, init_blocks, local_blocks, topk) = prep
    offs = tl.arange(0, BLOCK)[:, None]
    d = dims[None, :]  # [1, DIP]
    for t in range(0, num_tokens):
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if (slot >= 0) & (slot < num_slots) & (slot // BLOCK == page):
            pos = tl.load(pos_ptr + t).to(tl.int32)
            base = qkv_ptr + (tl.cast(t, tl.int64) * stride_xt + ik_col0 * stride_xc) \
                + tl.zeros([1, 1], tl.int64)
            key = norm_rope_rows(base, stride_xc, d < DI, ikw_ptr, pos, table_ptr, eps, DI,
                                 dims.shape[0], ROT, _NCOARSE, FP32_ANGLES,
                                 ROPE_SCALE)  # [1, DIP]
            k = tl.where(offs == slot % BLOCK,
                         saturate_to(key, cache_dtype, (cache_dtype == tl.float8e4nv)
                                     | (cache_dtype == tl.float8e4b8)), k)
    return k


@triton.jit
def _rescore_written_blocks(q, cache_ptr, split_pages, tile, b_lo, b_hi, pos, row_ok,
                            stride_cp, stride_cb, stride_cd, d, DI: tl.constexpr,
                            BLOCK: tl.constexpr, BPS: tl.constexpr, CAST_K: tl.constexpr,
                            IEEE: tl.constexpr, KEYS_AS_ROWS: tl.constexpr,
                            MAX_SKIPS_NAN: tl.constexpr, num_pages, ROT: tl.constexpr,
                            FP32_ANGLES: tl.constexpr, ROPE_SCALE: tl.constexpr, prep):
    """The tile with the split's blocks whose page gets a key from this launch's preparation
    scored again over the keys as written (_with_new_keys), so that the scores are those of a
    preparation that ran first, whatever the slots. A block no row's selection reads the score
    of is left: forced (init or local) or in a row of at most topk blocks. In a well-formed
    decode step that is every such block (a token's key lands in its own, local block), so
    this costs one load of the step's slots per 32 tokens and a compare per page."""
    (qkv_ptr, pos_ptr, slot_ptr, iqw_ptr, ikw_ptr, table_ptr, eps, num_tokens, num_slots,
     stride_xt, stride_xc, iq_col0, ik_col0, init_blocks, local_blocks, topk) = prep
    cols = tl.arange(0, BPS)
    blk = b_lo + cols
    pages = split_pages.to(tl.int64)
    hit = tl.zeros([BPS], tl.int32)
    for t0 in range(0, num_tokens, 32):
        tt = t0 + tl.arange(0, 32)
        slot = tl.load(slot_ptr + tt, mask=tt < num_tokens, other=-1).to(tl.int64)
        written = (slot >= 0) & (slot < num_slots)
        same = (pages[:, None] == slot[None, :] // BLOCK) & written[None, :]
        hit = hit | tl.max(same.to(tl.int32), axis=1)
    n = pos // BLOCK + 1  # [M]: each row's causal blocks
    read = ((n[:, None] > topk) & (blk[None, :] >= init_blocks)
            & (blk[None, :] < n[:, None] - local_blocks) & row_ok[:, None])
    todo = (hit > 0) & (tl.max(read.to(tl.int32), axis=0) > 0) & (blk < b_hi)
    if tl.sum(todo.to(tl.int32), axis=0) > 0:
        for j in range(0, BPS):
            if tl.sum(tl.where(cols == j, todo.to(tl.int32), 0), axis=0) > 0:
                tile = _score_block(q, cache_ptr, split_pages, tile, b_lo + j, b_lo, pos,
                                    stride_cp, stride_cb, stride_cd, d, DI, BLOCK, BPS, CAST_K,
                                    IEEE, True, KEYS_AS_ROWS, MAX_SKIPS_NAN, num_pages,
                                    False, None, True, ROT, FP32_ANGLES, ROPE_SCALE, prep)
    return tile


@triton.jit
def _score_token_range(q_ptr, cache_ptr, bt_row_ptr, out_ptr, t_begin, t_end, seq_len, q_len,
                       t_req, b_lo, b_hi, num_pages, stride_qt, stride_qh, stride_qd, stride_cp,
                       stride_cb, stride_cd, stride_btb, stride_ot, stride_oh, stride_ob,
                       H: tl.constexpr, HP: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr,
                       BLOCK: tl.constexpr, ROWS_T: tl.constexpr, BPS: tl.constexpr,
                       CAST_K: tl.constexpr, IEEE: tl.constexpr, KEYS_AS_ROWS: tl.constexpr,
                       MAX_SKIPS_NAN: tl.constexpr, split_pages_given=0,
                       PAGES_GIVEN: tl.constexpr = False, ONE_LOOP: tl.constexpr = False,
                       NVFP4: tl.constexpr = False, cp_size=1, cp_rank=0,
                       CP: tl.constexpr = False, PREPARE: tl.constexpr = False,
                       ROT: tl.constexpr = 0, FP32_ANGLES: tl.constexpr = False,
                       ROPE_SCALE: tl.constexpr = 1.0, prep=None):
    """Score tokens [t_begin, t_end) (< ROWS_T of them, all of one request whose first token is
    t_req) against blocks [b_lo, b_hi) and store the tile; rows are (token, head) pairs.
    PAGES_GIVEN: the caller loaded the split's page ids (split_pages_given, [BPS]); ONE_LOOP: one
    causal-masked loop over the split instead of an unmasked loop and a masked one; NVFP4: the
    cache is NVFP4 pages; PREPARE: the step's preparation runs in this launch (prep: see
    _prepare_scores_kernel), so the index query is prepared here from the projection row, and
    blocks whose keys the preparation writes are scored again (_rescore_written_blocks)."""
    M: tl.constexpr = ROWS_T * HP
    rows = tl.arange(0, M)
    tok = t_begin + rows // HP  # [M]
    head = rows % HP
    row_ok = (tok < t_end) & (head < H)
    # right-aligned: token i of the request sits at seq_len - q_len + i
    pos = seq_len - q_len + (tok - t_req)  # [M]
    if CP:
        pos = _cp_local_pos(pos, cp_size, cp_rank, BLOCK)
    d = tl.arange(0, DIP)
    if PREPARE:
        q = _prepared_query(tok, head, row_ok, q_ptr.dtype.element_ty, DI, DIP, ROT,
                            FP32_ANGLES, ROPE_SCALE, prep)
    else:
        q = tl.load(q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
                    + d[None, :] * stride_qd, mask=row_ok[:, None] & (d[None, :] < DI),
                    other=0.0)  # [M, DIP]
    if NVFP4:
        q = _nvfp4_query(q)
    cols = tl.arange(0, BPS)
    # the split's page ids up front: the loop then issues only key loads with addresses from
    # registers, which the software pipeline prefetches (no block-table -> key load chain)
    if PAGES_GIVEN:
        split_pages = split_pages_given
    else:
        split_pages = tl.load(bt_row_ptr + (b_lo + cols) * stride_btb, mask=b_lo + cols < b_hi,
                              other=-1)  # [BPS]
    tile = tl.full([M, BPS], float("-inf"), tl.float32)
    # blocks wholly at or before the earliest row's position need no causal mask: only the
    # last one or two blocks of a tile pay for it
    if ONE_LOOP:
        b_full = b_lo
    else:
        pos_first = seq_len - q_len + (t_begin - t_req)
        if CP:
            pos_first = _cp_local_pos(pos_first, cp_size, cp_rank, BLOCK)
        b_full = tl.minimum(tl.maximum((pos_first + 1) // BLOCK, b_lo), b_hi)
    # (NVFP4: block b's table entry, a pointer carried through the loops: an address computed
    # from b made LLVM widen b to 64 bits, and with it every causal compare)
    page_ptr = bt_row_ptr + b_lo * stride_btb
    for b in range(b_lo, b_full):
        tile = _score_block(q, cache_ptr, split_pages, tile, b, b_lo, pos, stride_cp, stride_cb,
                            stride_cd, d, DI, BLOCK, BPS, CAST_K, IEEE, False, KEYS_AS_ROWS,
                            MAX_SKIPS_NAN, num_pages, NVFP4, page_ptr)
        page_ptr += stride_btb
    for b in range(b_full, b_hi):
        tile = _score_block(q, cache_ptr, split_pages, tile, b, b_lo, pos, stride_cp, stride_cb,
                            stride_cd, d, DI, BLOCK, BPS, CAST_K, IEEE, True, KEYS_AS_ROWS,
                            MAX_SKIPS_NAN, num_pages, NVFP4, page_ptr)
        page_ptr += stride_btb
    if PREPARE:
        tile = _rescore_written_blocks(q, cache_ptr, split_pages, tile, b_lo, b_hi, pos, row_ok,
                                       stride_cp, stride_cb, stride_cd, d, DI, BLOCK, BPS,
                                       CAST_K, IEEE, KEYS_AS_ROWS, MAX_SKIPS_NAN, num_pages,
                                       ROT, FP32_ANGLES, ROPE_SCALE, prep)
    blk = b_lo + cols
    out = out_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh \
        + blk.to(tl.int64)[None, :] * stride_ob
    tl.store(out, tile, mask=row_ok[:, None] & (blk[None, :] < b_hi))


@triton.jit
def _block_scores_kernel(q_ptr, cache_ptr, cu_ptr, seq_lens_ptr, bt_ptr, out_ptr, num_requests,
                         num_tokens, num_pages, full_width, stride_qt, stride_qh, stride_qd,
                         stride_cp, stride_cb, stride_cd, stride_btr,
                         stride_btb, stride_ot, stride_oh, stride_ob,
                         H: tl.constexpr, HP: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr,
                         BLOCK: tl.constexpr, BPS: tl.constexpr, SMALL_Q: tl.constexpr,
                         TILE_MODE: tl.constexpr, ROWS_T: tl.constexpr, CAST_K: tl.constexpr,
                         IEEE: tl.constexpr, KEYS_AS_ROWS: tl.constexpr,
                         MAX_SKIPS_NAN: tl.constexpr, PDL: tl.constexpr = False,
                         table_width=0, NVFP4: tl.constexpr = False, cp_size=1, cp_rank=0,
                         CP: tl.constexpr = False):
    if PDL:
        # the selection launch may start now (programmatic dependent launch): it takes effect
        # once every program of this launch has passed here, and the selection waits for this
        # launch to finish before it reads a score
        gdc_launch_dependents()
    pid = tl.program_id(0)
    b_first = tl.program_id(1) * BPS
    if TILE_MODE:
        # the last tile first: in a causal chunk later tokens see more blocks, so the longest
        # programs start first and the short ones fill in behind them, instead of the longest
        # starting last and running alone at the end
        tile_begin = (tl.num_programs(0) - 1 - pid) * ROWS_T
        tile_end = tl.minimum(tile_begin + ROWS_T, num_tokens)
        # a decode or verify step of more than SMALL_Q tokens launches this too: one look at
        # the next 2 * ROWS_T requests, loaded at once, usually shows that none of the tile's
        # requests is long, and the program ends there instead of walking them one by one
        # (each a dependent load)
        r = find_request(cu_ptr, num_requests, tile_begin,
                         (tile_begin.to(tl.int64) * num_requests // num_tokens).to(tl.int32))
        rr = r + tl.arange(0, 2 * ROWS_T)
        ok = rr < num_requests
        t0 = tl.load(cu_ptr + rr, mask=ok, other=0)
        t1 = tl.load(cu_ptr + rr + 1, mask=ok, other=0)
        before = ok & (t0 < tile_end)
        n_long = tl.sum((before & (t1 - t0 > SMALL_Q)).to(tl.int32), axis=0)
        # cu is nondecreasing, so the requests starting before tile_end are a prefix of the
        # window; if the prefix ends inside it, the window holds all of the tile's requests
        seen_all = tl.sum(before.to(tl.int32), axis=0) < 2 * ROWS_T
        # a malformed step is padding as a whole (docs/spec.md, "Bounds")
        if (seen_all & (n_long == 0)) | (step_well_formed(cu_ptr, num_requests, num_tokens) == 0):
            r = num_requests
        # every long request overlapping this tile of packed tokens
        while r < num_requests:
            t_req = tl.load(cu_ptr + r)
            t_next = tl.load(cu_ptr + r + 1)
            if t_req >= tile_end:
                r = num_requests
            else:
                q_len = t_next - t_req
                seq_len = tl.load(seq_lens_ptr + r)
                if (q_len > SMALL_Q) & request_ok(q_len, seq_len, full_width, BLOCK):
                    t_begin = tl.maximum(t_req, tile_begin)
                    t_end = tl.minimum(t_next, tile_end)
                    # causal: the tile's last token sees blocks < its position // B + 1
                    last_pos = seq_len - q_len + (t_end - 1 - t_req)
                    if CP:
                        last_pos = _cp_local_pos(last_pos, cp_size, cp_rank, BLOCK)
                        b_hi = tl.minimum(b_first + BPS, tl.where(last_pos < 0, 0,
                                                                  last_pos // BLOCK + 1))
                    else:
                        b_hi = tl.minimum(b_first + BPS, last_pos // BLOCK + 1)
                    if b_first < b_hi:
                        _score_token_range(q_ptr, cache_ptr, bt_ptr + r.to(tl.int64) * stride_btr,
                                           out_ptr, t_begin, t_end, seq_len, q_len, t_req,
                                           b_first, b_hi, num_pages, stride_qt, stride_qh,
                                           stride_qd, stride_cp, stride_cb, stride_cd, stride_btb,
                                           stride_ot, stride_oh, stride_ob, H, HP, DI, DIP,
                                           BLOCK, ROWS_T, BPS, CAST_K, IEEE, KEYS_AS_ROWS,
                                           MAX_SKIPS_NAN, NVFP4=NVFP4, cp_size=cp_size,
                                           cp_rank=cp_rank, CP=CP)
                r += 1
    else:
        _score_request(pid, b_first, q_ptr, cache_ptr, cu_ptr, seq_lens_ptr, bt_ptr, out_ptr,
                       num_requests, num_tokens, num_pages, full_width, table_width, stride_qt,
                       stride_qh, stride_qd, stride_cp, stride_cb, stride_cd, stride_btr,
                       stride_btb, stride_ot, stride_oh, stride_ob, H, HP, DI, DIP, BLOCK, BPS,
                       SMALL_Q, ROWS_T, CAST_K, IEEE, KEYS_AS_ROWS, MAX_SKIPS_NAN, NVFP4,
                       cp_size, cp_rank, CP)


@triton.jit
def _score_request(r, b_first, q_ptr, cache_ptr, cu_ptr, seq_lens_ptr, bt_ptr, out_ptr,
                   num_requests, num_tokens, num_pages, full_width, table_width, stride_qt,
                   stride_qh, stride_qd, stride_cp, stride_cb, stride_cd, stride_btr,
                   stride_btb, stride_ot, stride_oh, stride_ob, H: tl.constexpr,
                   HP: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, BLOCK: tl.constexpr,
                   BPS: tl.constexpr, SMALL_Q: tl.constexpr, ROWS_T: tl.constexpr,
                   CAST_K: tl.constexpr, IEEE: tl.constexpr, KEYS_AS_ROWS: tl.constexpr,
                   MAX_SKIPS_NAN: tl.constexpr, NVFP4: tl.constexpr, cp_size, cp_rank,
                   CP: tl.constexpr, PREPARE: tl.constexpr = False,
                   ROT: tl.constexpr = 0, FP32_ANGLES: tl.constexpr = False,
                   ROPE_SCALE: tl.constexpr = 1.0, prep=None):
    """The request launch's program (r, split starting at block b_first): every token of
    request r (q_len <= SMALL_Q) against the split's blocks."""
    # the split's page ids, masked by the table's width instead of the request's length, so
    # that their load does not wait for seq_lens: one memory latency less before the first
    # key load (entries past the request's blocks are read, never used)
    cols = tl.arange(0, BPS)
    pages = tl.load(bt_ptr + r.to(tl.int64) * stride_btr + (b_first + cols) * stride_btb,
                    mask=b_first + cols < table_width, other=-1)
    t_req = tl.load(cu_ptr + r)
    t_next = tl.minimum(tl.load(cu_ptr + r + 1), num_tokens)
    q_len = tl.load(cu_ptr + r + 1) - t_req
    seq_len = tl.load(seq_lens_ptr + r)
    if CP:
        last_local = _cp_local_pos(seq_len - 1, cp_size, cp_rank, BLOCK)
        b_hi = tl.minimum(b_first + BPS, tl.where(last_local < 0, 0, last_local // BLOCK + 1))
    else:
        b_hi = tl.minimum(b_first + BPS, tl.where(seq_len > 0, (seq_len - 1) // BLOCK + 1, 0))
    # (request_ok bounds b_hi by the table's width; a malformed step is padding)
    if ((q_len > 0) & (q_len <= SMALL_Q) & request_ok(q_len, seq_len, full_width, BLOCK)
            & (b_first < b_hi) & step_well_formed(cu_ptr, num_requests, num_tokens)):
        # NVFP4: an unmasked loop and a causal one (ONE_LOOP off): the per-key causal
        # compare and select (~24 instructions a block) leave the loop that scans the
        # context; only a request's last split runs the masked loop, for its last block
        for t_begin in range(t_req, t_next, ROWS_T):
            _score_token_range(q_ptr, cache_ptr, bt_ptr + r.to(tl.int64) * stride_btr,
                               out_ptr, t_begin, tl.minimum(t_begin + ROWS_T, t_next),
                               seq_len, q_len, t_req, b_first, b_hi, num_pages, stride_qt,
                               stride_qh, stride_qd, stride_cp, stride_cb, stride_cd,
                               stride_btb,
                               stride_ot, stride_oh, stride_ob, H, HP, DI, DIP, BLOCK,
                               ROWS_T, BPS, CAST_K, IEEE, KEYS_AS_ROWS, MAX_SKIPS_NAN,
                               pages, True, not NVFP4, NVFP4, cp_size, cp_rank, CP,
                               PREPARE, ROT, FP32_ANGLES, ROPE_SCALE, prep)


@triton.jit
def _prepare_scores_kernel(
        cache_ptr, cu_ptr, seq_lens_ptr, bt_ptr, out_ptr, num_requests, num_tokens, num_pages,
        full_width, table_width, stride_cp, stride_cb, stride_cd, stride_btr, stride_btb,
        stride_ot, stride_oh, stride_ob, init_blocks, local_blocks, topk, iq_col0, ik_col0,
        qkv_ptr, pos_ptr, qw_ptr, kw_ptr, iqw_ptr, ikw_ptr, table_ptr,
        k_cache_ptr, v_cache_ptr, slot_ptr, index_slot_ptr,
        k_scale_ptr, v_scale_ptr, q_out_ptr, iq_out_ptr, eps, num_slots, num_index_slots,
        stride_xt, stride_xc, stride_kcp, stride_kcb, stride_kch, stride_kcd,
        stride_vcp, stride_vcb, stride_vch, stride_vcd,
        stride_qt, stride_qh, stride_qd, stride_it, stride_ih, stride_id,
        H: tl.constexpr, HP: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr,
        BLOCK: tl.constexpr, BPS: tl.constexpr, SMALL_Q: tl.constexpr, ROWS_T: tl.constexpr,
        CAST_K: tl.constexpr, IEEE: tl.constexpr, KEYS_AS_ROWS: tl.constexpr,
        MAX_SKIPS_NAN: tl.constexpr, PDL: tl.constexpr,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        ROT: tl.constexpr, NCOARSE: tl.constexpr, FP32_ANGLES: tl.constexpr,
        ROPE_SCALE: tl.constexpr, KV_BLOCK: tl.constexpr, HT: tl.constexpr,
        KV_SATURATE: tl.constexpr, INDEX_SATURATE: tl.constexpr, IQ_SATURATE: tl.constexpr,
        HAS_SCALE: tl.constexpr, PREP_TILES: tl.constexpr):
    """A decode step's preparation and scoring in one launch (ops/indexer/api.py,
    prepare_and_select), grid (max(R, T), splits + PREP_TILES): programs (r, s < splits) are the
    request launch's (_score_request) with the index query prepared from the projection row
    (the index-query output iq_out gives its dtype); programs (i, splits + j) run tile j of the
    preparation (cache/kernels/prepare.py) for tokens i, i + max(R, T), ... The scores are those
    of the preparation running first: a block whose page gets a key here is scored again over
    the key as written unless the selection ignores its score (_rescore_written_blocks)."""
    if PDL:
        # the selection launch may start now; it waits for this launch to finish before it
        # reads a score (kernels/select.py)
        gdc_launch_dependents()
    pid = tl.program_id(0)
    splits = tl.num_programs(1) - PREP_TILES
    split = tl.program_id(1)
    if split >= splits:
        for t in range(pid, num_tokens, tl.num_programs(0)):
            prepare_tile(t, split - splits, qkv_ptr, pos_ptr, qw_ptr, kw_ptr, iqw_ptr, ikw_ptr,
                         table_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, cache_ptr,
                         index_slot_ptr, k_scale_ptr, v_scale_ptr, q_out_ptr, iq_out_ptr, eps,
                         num_slots, num_index_slots, stride_xt, stride_xc, stride_kcp,
                         stride_kcb, stride_kch, stride_kcd, stride_vcp, stride_vcb, stride_vch,
                         stride_vcd, stride_cp, stride_cb, stride_cd, stride_qt, stride_qh,
                         stride_qd, stride_it, stride_ih, stride_id, HQ, HKV, H, D, DI, DP, DIP,
                         ROT, NCOARSE, FP32_ANGLES, ROPE_SCALE, KV_BLOCK, BLOCK, HT,
                         KV_SATURATE, INDEX_SATURATE, IQ_SATURATE, HAS_SCALE, False)
    elif pid < num_requests:
        prep = (qkv_ptr, pos_ptr, index_slot_ptr, iqw_ptr, ikw_ptr, table_ptr, eps, num_tokens,
                num_index_slots, stride_xt, stride_xc, iq_col0, ik_col0, init_blocks,
                local_blocks, topk)
        _score_request(pid, split * BPS, iq_out_ptr, cache_ptr, cu_ptr, seq_lens_ptr, bt_ptr,
                       out_ptr, num_requests, num_tokens, num_pages, full_width, table_width,
                       stride_it, stride_ih, stride_id, stride_cp, stride_cb, stride_cd,
                       stride_btr, stride_btb, stride_ot, stride_oh, stride_ob, H, HP, DI, DIP,
                       BLOCK, BPS, SMALL_Q, ROWS_T, CAST_K, IEEE, KEYS_AS_ROWS, MAX_SKIPS_NAN,
                       False, 1, 0, False, True, ROT, FP32_ANGLES, ROPE_SCALE, prep)
