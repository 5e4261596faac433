# SPDX-License-Identifier: Apache-2.0
"""Tiers 1 and 2: every kernel against the reference, on the kernel device (the CPU through
Triton's interpreter, or a GPU). Shapes stay tiny so the interpreter runs them in seconds."""

import pytest
import torch
import triton
import triton.language as tl

import openmsa
from openmsa import reference as ref
from openmsa.batch import token_layout
from openmsa.ops.common.counters import COUNTERS
from openmsa.ops.common.triton_utils import find_request, split_e4m3_pairs
from helpers import (RecordingKernel, assert_close, make_step, nan_poison, random_index_inputs,
                     random_kv_cache, to_device)

pytestmark = pytest.mark.interpret

B = 16
# decode, 3-token verify, q_len 0, a 20-token prefill chunk (the tile launch), decode in the
# first block, seq_len 0, and 2 padding tokens after cu_seqlens_q[R]
Q_LENS = [1, 3, 0, 20, 1, 0]
SEQ_LENS = [70, 45, 9, 100, 5, 0]
FP8 = torch.float8_e4m3fn
def _to(step, device):
    for name in ("cu_seqlens_q", "seq_lens", "block_table", "slot_mapping"):
        setattr(step, name, getattr(step, name).to(device))
    return step


def _attention_case(device, kv_dtype, layout, hq=8, hkv=2, h=2, d=64, seed=7, block=B):
    g = torch.Generator().manual_seed(seed)
    step = make_step(Q_LENS, SEQ_LENS, block_size=block, extra_columns=2, pad_tokens=2,
                     generator=g)
    qi, ci = random_index_inputs(step, num_heads=h, head_dim=16, block_size=block,
                                 q_dtype=torch.float32, cache_dtype=torch.float32,
                                 generator=torch.Generator().manual_seed(seed + 1))
    idx = ref.select_blocks(qi, ci, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=4,
                            block_size=block)
    k, v = random_kv_cache(step.num_pages, block, hkv, d, dtype=kv_dtype, layout=layout,
                           generator=torch.Generator().manual_seed(seed + 2))
    q = torch.randn(step.num_tokens, hq, d, generator=torch.Generator().manual_seed(seed + 3))
    dstep = _to(make_step(Q_LENS, SEQ_LENS, block_size=block, extra_columns=2, pad_tokens=2,
                          generator=torch.Generator().manual_seed(seed)), device)
    return step, dstep, q, k, v, idx


def _attention_dtype(device):
    # the interpreter's bf16 arithmetic is wrong (docs/design.md, Triton interpreter limits), so it runs fp16
    return torch.bfloat16 if device == "cuda" else torch.float16


@pytest.mark.parametrize("kv_dtype, layout", [("q", "flash"), ("q", "vllm"), (FP8, "vllm"),
                                              (FP8, "odd")])
@pytest.mark.parametrize("block, sub", [(B, B), (32, 16)])
def test_sparse_attention_matches_reference(kernel_device, kv_dtype, layout, block, sub,
                                            monkeypatch):
    """Whole blocks per loop step, and two 16-key steps per 32-token block (a block's causal cut
    then falls in either step). fp8 V in the packed layout is read in byte pairs (V_PAIRS); at
    odd strides and an odd offset, byte by byte."""
    from openmsa.ops.attention import api as attention_api
    monkeypatch.setitem(attention_api.TUNING, "sub", sub)
    dtype = _attention_dtype(kernel_device)
    kv_dtype = dtype if kv_dtype == "q" else kv_dtype
    step, dstep, q, k, v, idx = _attention_case(kernel_device, kv_dtype, layout, block=block)
    k_dev, v_dev = to_device(k, kernel_device), to_device(v, kernel_device)
    assert v_dev.stride() == v.stride()
    assert attention_api._reads_as_pairs(v_dev) == (layout != "odd")
    q = q.to(dtype)
    want, want_lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                          step.block_table, block_size=block, return_lse=True)
    out = nan_poison(q.shape, dtype, kernel_device)
    got, lse = openmsa.sparse_attention(
        q.to(kernel_device), k_dev, v_dev, idx.to(kernel_device),
        dstep.cu_seqlens_q, dstep.seq_lens, dstep.block_table, block_size=block, out=out,
        return_lse=True)
    assert got.data_ptr() == out.data_ptr()
    assert_close(got, want)
    assert_close(lse, want_lse, torch.float32 if dtype == torch.float16 else dtype)
    # without the LSE (not stored at all, STORE_LSE off): the same output bits
    alone = openmsa.sparse_attention(
        q.to(kernel_device), k_dev, v_dev, idx.to(kernel_device), dstep.cu_seqlens_q,
        dstep.seq_lens, dstep.block_table, block_size=block,
        out=nan_poison(q.shape, dtype, kernel_device))
    assert torch.equal(alone, got)
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    assert (got.cpu()[pos < 0] == 0).all() and torch.isneginf(lse.cpu()[pos < 0]).all()


@pytest.mark.parametrize("fused_merge, splits", [(True, None), (False, None), (True, 3)])
def test_sparse_attention_index_head_sharing_scales_and_noisy_rows(kernel_device, fused_merge,
                                                                    splits, monkeypatch):
    """One index head serving two KV heads, fp8 with per-tensor scales, and rows holding -1,
    out-of-range and repeated ids; splits merged by their last program or by a second launch,
    and 3 splits (the fused merge reads their LSEs as one row padded to 4)."""
    from openmsa.ops.attention import api as attention_api
    monkeypatch.setitem(attention_api.TUNING, "fused_merge", fused_merge)
    if splits is not None:
        monkeypatch.setattr(attention_api, "_num_splits", lambda *args: splits)
    dtype = _attention_dtype(kernel_device)
    step, dstep, q, k, v, idx = _attention_case(kernel_device, FP8, "flash", hq=4, hkv=2, h=1)
    idx = torch.cat([idx, torch.full_like(idx[..., :1], 99), idx[..., :1]], dim=-1)
    q = q.to(dtype)
    kw = dict(block_size=B, k_scale=0.75, v_scale=1.5, return_lse=True)
    want, want_lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                          step.block_table, **kw)
    ks = torch.tensor([0.75], device=kernel_device)
    got, lse = openmsa.sparse_attention(
        q.to(kernel_device), k.to(kernel_device), v.to(kernel_device), idx.to(kernel_device),
        dstep.cu_seqlens_q, dstep.seq_lens, dstep.block_table, block_size=B, k_scale=ks,
        v_scale=1.5, return_lse=True)
    assert_close(got, want)
    assert_close(lse, want_lse, torch.float32 if dtype == torch.float16 else dtype)
    # without the LSE (not stored at all, STORE_LSE off): the same output bits
    alone = openmsa.sparse_attention(
        q.to(kernel_device), k.to(kernel_device), v.to(kernel_device), idx.to(kernel_device),
        dstep.cu_seqlens_q, dstep.seq_lens, dstep.block_table, block_size=B, k_scale=ks,
        v_scale=1.5, out=nan_poison(q.shape, dtype, kernel_device))
    assert torch.equal(alone, got)
    if fused_merge and kernel_device == "cuda":
        # every merging program put its arrival counter back: the next launch starts at 0
        assert all(int(c.count_nonzero()) == 0 for c in COUNTERS.values())


@pytest.mark.parametrize("waste, alias", [(0.0, False), (1.5, False), (1e9, False), (1e9, True)])
@pytest.mark.parametrize("kv_dtype, block, sub, hq", [("q", B, B, 8), (FP8, 32, 16, 8),
                                                     ("q", B, B, 6)])
def test_sparse_attention_prefill_tiles_match_reference(kernel_device, kv_dtype, block, sub, hq,
                                                        waste, alias, monkeypatch):
    """The prefill path: tiles of 4 tokens over the union of their selections, taken by the tile
    kernel (waste 1e9: every tile inside one request), by neither (0: all left to the per-token
    kernel), or by the device's choice per tile (1.5); tiles straddling requests always go to the
    per-token kernel. Rows hold -1, out-of-range and repeated ids; one index head serves both KV
    heads. The mask-only-where-needed variant runs with waste 1e9, the persistent one with 1.5.
    6 query heads: 3 per KV head, padded to 4 row slots per token (dead rows) and a softmax
    scale of 0.2; fp8 with dequantisation scales, the K one negative. `alias`: a block table
    mapping two blocks of every request to one page (the 20-token request's last two); a tile
    whose tokens selected both goes to the per-token kernel (one page, two causal cuts)."""
    from openmsa.ops.attention import api as attention_api
    from openmsa.ops.attention import prefill
    for key, value in dict(prefill_min_tokens=1, tile_rows=16, tile_waste=waste,
                           ws_waste=waste, ws_waste_fp8=waste,
                           tile_sub=sub, tile_sub_fp8=sub,
                           tile_lazy_mask=waste == 1e9,
                           tile_persistent=waste == 1.5, tile_persistent_fp8=waste == 1.5).items():
        monkeypatch.setitem(attention_api.TUNING, key, value)
    dtype = _attention_dtype(kernel_device)
    kv_dtype = dtype if kv_dtype == "q" else kv_dtype
    step, dstep, q, k, v, idx = _attention_case(kernel_device, kv_dtype, "vllm", hq=hq, h=1,
                                                block=block)
    idx = torch.cat([idx, torch.full_like(idx[..., :1], 99), idx[..., :1]], dim=-1)
    q = q.to(dtype)
    if alias:
        for st in (step, dstep):
            last = -(-SEQ_LENS[3] // block) - 1  # the 20-token request's own last block
            st.block_table[:, last] = st.block_table[:, last - 1]
    # fp8: a negative K scale (the kernel moves the sign onto q: its row max is taken before
    # scaling) as a device tensor; 6 heads: a softmax scale other than D ** -0.5
    scales = dict(k_scale=-0.75, v_scale=1.5) if kv_dtype == FP8 else {}
    if hq == 6:
        scales["scale"] = 0.2
    want, want_lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                          step.block_table, block_size=block, return_lse=True,
                                          **scales)
    if kv_dtype == FP8:
        scales["k_scale"] = torch.tensor([-0.75], device=kernel_device)
    flags = []
    monkeypatch.setattr(prefill, "_tile_plan_kernel",
                        RecordingKernel(prefill._tile_plan_kernel, flags, arg=4))
    out = nan_poison(q.shape, dtype, kernel_device)
    k_dev, v_dev = to_device(k, kernel_device), to_device(v, kernel_device)  # the packed views
    got, lse = openmsa.sparse_attention(
        q.to(kernel_device), k_dev, v_dev, idx.to(kernel_device),
        dstep.cu_seqlens_q, dstep.seq_lens, dstep.block_table, block_size=block, out=out,
        return_lse=True, **scales)
    assert_close(got, want)
    assert_close(lse, want_lse, torch.float32 if dtype == torch.float16 else dtype)
    # the tiles the kernel took follow its rule, recomputed here; 27 packed tokens: tiles 1-5
    # lie inside the 20-token request, 0 and 6 straddle requests
    want_taken = _tiles_taken(idx, step, block, qt=4, num_kv_heads=2, waste=waste)
    assert torch.equal((flags[0] >= 0).int().cpu(), want_taken)
    if alias:  # the case shows the rule: some tiles of the 20-token request are left
        assert 0 < int(want_taken[1:6].sum()) < want_taken[1:6].numel()
    else:
        assert want_taken[1:6].all() if waste == 1e9 else not want_taken[[0, 6]].any()


def test_sparse_attention_prefill_tiles_cap_at_16_tokens(kernel_device, monkeypatch):
    """One query head per KV head (G = 1): tile_rows 64 would make tiles of 64 tokens; they are
    capped at 16 (the plan keeps a bit per token beside 8 flag bits in an int32), and a
    40-token request holds two whole tiles, which the tile kernel takes."""
    from openmsa.ops.attention import api as attention_api
    from openmsa.ops.attention import prefill
    for key, value in dict(prefill_min_tokens=1, tile_rows=64, tile_waste=1e9, ws_waste=1e9,
                           ws_waste_fp8=1e9).items():
        monkeypatch.setitem(attention_api.TUNING, key, value)
    dtype = _attention_dtype(kernel_device)
    q_lens, seq_lens = [40, 2], [150, 40]

    def step_of(seed):
        return make_step(q_lens, seq_lens, block_size=B,
                         generator=torch.Generator().manual_seed(seed))
    step, dstep = step_of(5), _to(step_of(5), kernel_device)
    qi, ci = random_index_inputs(step, num_heads=1, head_dim=16, block_size=B,
                                 q_dtype=torch.float32, cache_dtype=torch.float32,
                                 generator=torch.Generator().manual_seed(6))
    idx = ref.select_blocks(qi, ci, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=4,
                            block_size=B)
    k, v = random_kv_cache(step.num_pages, B, 2, 64, dtype=dtype, layout="flash",
                           generator=torch.Generator().manual_seed(7))
    q = torch.randn(step.num_tokens, 2, 64, generator=torch.Generator().manual_seed(8)).to(dtype)
    want = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens, step.block_table,
                                block_size=B)
    flags = []
    monkeypatch.setattr(prefill, "_tile_plan_kernel",
                        RecordingKernel(prefill._tile_plan_kernel, flags, arg=4))
    got = openmsa.sparse_attention(q.to(kernel_device), to_device(k, kernel_device),
                                   to_device(v, kernel_device), idx.to(kernel_device),
                                   dstep.cu_seqlens_q, dstep.seq_lens, dstep.block_table,
                                   block_size=B)
    assert_close(got, want)
    taken = (flags[0] >= 0).cpu()
    assert taken.shape == (3, 2) and taken[:2].all() and not taken[2].any()


@pytest.mark.parametrize("qt, topk, alias", [(4, 4, False), (8, 4, True), (16, 3, False),
                                              (8, 16, True)])
def test_tile_plan_sorted_form_equals_pairs_form(kernel_device, qt, topk, alias):
    """The prefill plan's two forms (prefill.py: _plan_union_pairs, N^2, and
    _plan_union_sorted, a sort of the tile's N = QT * KP entries) give the same tiles taken and
    the same unions (pages ascending, their block ids and token bits) on rows with -1,
    out-of-range and repeated ids, shared and scattered pages, tiles straddling requests and,
    with `alias`, a block table mapping two blocks to one page (those tiles are left)."""
    from openmsa.ops.attention import prefill
    g = torch.Generator().manual_seed(qt + topk)
    q_lens, seq_lens = [3, 40, 1, 29], [300, 40 + 1000, 17, 29 + 60]
    step = make_step(q_lens, seq_lens, block_size=B, generator=g)
    if alias:
        step.block_table[1, 3] = step.block_table[1, 2]
    request, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    idx = torch.randint(-2, 12, (step.num_tokens, 2, topk), generator=g, dtype=torch.int32)
    idx[::3, :, :2] = 1  # shared pages, and a repeated id within one token
    idx[5:9] = idx[5:6]  # a run of tokens with one selection
    idx[:, :, -1] = torch.where(idx[:, :, -1] > 5, 10 ** 6, idx[:, :, -1])  # out of range
    kp = triton.next_power_of_2(topk)
    num_tiles = -(-step.num_tokens // qt)
    d = _to(step, kernel_device)
    results = []
    # (waste 0.45 x qt: the union-size rule decides, over counts without repeated ids)
    for waste, sorted_form in ((1e9, False), (1e9, True), (0.45 * qt, False), (0.45 * qt, True)):
        blocks = torch.full((num_tiles, 2), -7, dtype=torch.int32, device=kernel_device)
        union = torch.full((num_tiles * 2, 3, qt * kp), -7, dtype=torch.int32,
                           device=kernel_device)
        idx_d = idx.to(kernel_device)
        prefill._tile_plan_kernel[(num_tiles, 2)](
            idx_d, d.cu_seqlens_q, d.seq_lens, d.block_table, blocks, union, waste,
            step.seq_lens.shape[0], *idx_d.stride(), *d.block_table.stride(), NUM_KV_HEADS=2,
            NUM_INDEX_HEADS=2, QT=qt, BLOCK=B, TOPK=topk, KP=kp, SORTED=sorted_form,
            num_warps=1 if qt * kp <= 64 else 2)
        results.append((blocks.cpu(), union.cpu()))
    (b0, u0), (b1, u1), (c0, _), (c1, _) = results
    assert torch.equal(b0, b1) and torch.equal(c0, c1)
    assert (b0 >= 0).any() and (b0 < 0).any() and (c0 >= 0).any()
    assert ((b0 >= 0) & (c0 < 0)).any() or qt * topk > 32
    for item, n in enumerate(b0.flatten().tolist()):
        if n >= 0:
            assert torch.equal(u0[item, :, :n], u1[item, :, :n]), item
            assert bool((u0[item, 0, 1:n] > u0[item, 0, :n - 1]).all())  # pages ascending


def _tiles_taken(idx, step, block, qt, num_kv_heads, waste):
    """[tiles, Hkv]: 1 where a tile of qt tokens lies in one request, no page of the union holds
    two of the tokens' selected blocks, and the union of their selected pages, times qt, is at
    most waste x the sum of each token's distinct pages."""
    request, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    num_tiles = -(-step.num_tokens // qt)
    taken = torch.zeros(num_tiles, num_kv_heads, dtype=torch.int32)
    for i in range(num_tiles):
        toks = range(i * qt, (i + 1) * qt)
        if toks[-1] >= step.num_tokens or len({int(request[t]) for t in toks}) > 1 \
                or any(int(pos[t]) < 0 for t in toks):
            continue
        for g in range(num_kv_heads):
            h = g * idx.shape[1] // num_kv_heads
            sets = [{int(step.block_table[request[t], b]) for b in idx[t, h].tolist()
                     if 0 <= b <= pos[t] // block and step.block_table[request[t], b] >= 0}
                    for t in toks]
            union = set().union(*sets)
            blocks_of = {}
            for t in toks:
                for b in idx[t, h].tolist():
                    if 0 <= b <= pos[t] // block and step.block_table[request[t], b] >= 0:
                        blocks_of.setdefault(int(step.block_table[request[t], b]), set()).add(b)
            aliased = any(len(x) > 1 for x in blocks_of.values())
            taken[i, g] = not aliased and len(union) * qt <= waste * sum(len(x) for x in sets)
    return taken


@pytest.mark.parametrize("sub_page_size", [16, 8])
def test_sparse_page_table_matches_reference(kernel_device, sub_page_size):
    step, dstep, _, _, _, idx = _attention_case(kernel_device, torch.float32, "flash", hq=4,
                                                hkv=4, h=2)
    idx = idx.clone()
    idx[::3, :, 0] = -1
    idx[1::4, :, 1] = idx[1::4, :, 2]
    want = ref.sparse_page_table(idx, step.cu_seqlens_q, step.seq_lens, step.block_table,
                                 num_kv_heads=4, block_size=B, sub_page_size=sub_page_size)
    got = openmsa.sparse_page_table(idx.to(kernel_device), dstep.cu_seqlens_q, dstep.seq_lens,
                                    dstep.block_table, num_kv_heads=4, block_size=B,
                                    sub_page_size=sub_page_size)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_sparse_attention_long_requests_share_tiles(kernel_device):
    """Several long requests (the tile kernel) whose tokens share tiles with each other and with
    a decode token, one of them starting at position 0."""
    q_lens, seq_lens = [18, 21, 1, 17], [40, 100, 50, 17]
    step = make_step(q_lens, seq_lens, block_size=B, pad_tokens=1)
    qi, ci = random_index_inputs(step, num_heads=1, head_dim=16, block_size=B,
                                 q_dtype=torch.float32, cache_dtype=torch.float32)
    idx = ref.select_blocks(qi, ci, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=3,
                            block_size=B)
    k, v = random_kv_cache(step.num_pages, B, 2, 64, dtype=torch.float16)
    q = torch.randn(step.num_tokens, 4, 64).half()
    want, want_lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                          step.block_table, block_size=B, return_lse=True)
    d = _to(make_step(q_lens, seq_lens, block_size=B, pad_tokens=1), kernel_device)
    got, lse = openmsa.sparse_attention(q.to(kernel_device), k.to(kernel_device),
                                        v.to(kernel_device), idx.to(kernel_device),
                                        d.cu_seqlens_q, d.seq_lens, d.block_table, block_size=B,
                                        return_lse=True)
    assert_close(got, want)
    assert_close(lse, want_lse, torch.float32)


@pytest.mark.parametrize("block, index_dim, head_dim", [(32, 64, 128), (64, 256, 256)])
def test_other_block_sizes_and_head_dims(kernel_device, block, index_dim, head_dim):
    """Block sizes and head dims besides the 16/32/64 of the cases above: exact selection on
    integer inputs, attention within tolerance, one step with a decode, a verify and a chunk."""
    q_lens, seq_lens = [1, 3, 18], [5 * block + 3, 2 * block, 4 * block - 1]
    step = make_step(q_lens, seq_lens, block_size=block, extra_columns=1)
    d = _to(make_step(q_lens, seq_lens, block_size=block, extra_columns=1), kernel_device)
    qi, ci = random_index_inputs(step, num_heads=2, head_dim=index_dim, block_size=block,
                                 q_dtype=torch.float16, cache_dtype=torch.float16, integer=True)
    want = ref.select_blocks(qi, ci, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=3,
                             block_size=block)
    got = openmsa.select_blocks(qi.to(kernel_device), ci.to(kernel_device), d.cu_seqlens_q,
                                d.seq_lens, d.block_table, topk=3, block_size=block)
    assert torch.equal(got.cpu(), want)
    k, v = random_kv_cache(step.num_pages, block, 1, head_dim, dtype=torch.float16)
    q = torch.randn(step.num_tokens, 2, head_dim).half()
    want = ref.sparse_attention(q, k, v, want, step.cu_seqlens_q, step.seq_lens,
                                step.block_table, block_size=block)
    out = openmsa.sparse_attention(q.to(kernel_device), k.to(kernel_device), v.to(kernel_device),
                                   got, d.cu_seqlens_q, d.seq_lens, d.block_table,
                                   block_size=block)
    assert_close(out, want)


@triton.jit
def _split_pairs_kernel(x_ptr, lo_ptr, hi_ptr, PTX: tl.constexpr, N: tl.constexpr):
    i = tl.program_id(0) * N + tl.arange(0, N)
    lo, hi = split_e4m3_pairs(tl.load(x_ptr.to(tl.pointer_type(tl.uint16)) + i), PTX)
    tl.store(lo_ptr + i, lo)
    tl.store(hi_ptr + i, hi)


def test_fp8_byte_pairs_split_exactly_on_every_pattern(kernel_device):
    """split_e4m3_pairs (the attention's fp8 V path) on all 65536 16-bit patterns: low and high
    bytes as fp16 bit for bit as torch converts them, signed zeros, subnormals, the extremes
    (+-448) and NaN included; the PTX path on the GPU, the casts under the interpreter."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    lo = torch.empty(65536, dtype=torch.float16, device=kernel_device)
    hi = torch.empty_like(lo)
    _split_pairs_kernel[(64,)](x.to(kernel_device), lo, hi, PTX=kernel_device == "cuda", N=1024)
    # little-endian: element bits 0-7 are its first byte
    raw = x.view(torch.uint8).view(-1, 2)
    for got, byte in ((lo, raw[:, 0]), (hi, raw[:, 1])):
        want = byte.contiguous().view(FP8).to(torch.float16)
        got = got.cpu()
        assert torch.equal(got.isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16))


@triton.jit
def _find_request_kernel(cu_ptr, guess_ptr, out_ptr, num_requests):
    t = tl.program_id(0)
    tl.store(out_ptr + t, find_request(cu_ptr, num_requests, t, tl.load(guess_ptr + t)))


def test_find_request_with_any_guess(kernel_device):
    """find_request's guess (one check of cu[g] <= t < cu[g+1] before the binary search) gives
    the search's answer for every guess: right ones, wrong ones, -1, out of range; on layouts
    with zero-length requests, padding tokens past cu[R] and equal q_len (where t * R // T is
    always right)."""
    g = torch.Generator().manual_seed(11)
    layouts = [[1] * 8, [4] * 5, [0, 3, 0, 0, 2, 5, 0], [1, 3, 0, 20, 1, 0], [7], [0, 0, 2]]
    for q_lens in layouts:
        cu = torch.tensor([0] + q_lens).cumsum(0).int()
        num_tokens = int(cu[-1]) + 3  # 3 padding tokens
        r = len(q_lens)
        t = torch.arange(num_tokens)
        want = torch.searchsorted(cu[1:], t, right=True).clamp(max=r).int()
        guesses = [t * r // num_tokens, want.long(), torch.full_like(t, -1),
                   torch.full_like(t, r + 2), torch.randint(0, r, (num_tokens,), generator=g)]
        for guess in guesses:
            out = torch.full((num_tokens,), -7, dtype=torch.int32, device=kernel_device)
            _find_request_kernel[(num_tokens,)](cu.to(kernel_device),
                                                guess.int().to(kernel_device), out, r)
            assert torch.equal(out.cpu(), want), (q_lens, guess)


def test_launch_plans_follow_knobs_and_layouts(kernel_device, monkeypatch):
    """The attention op's cached launch plans (ops/common/launch.py): a repeated call reuses its
    plan; a changed knob or output layout makes a new one, and every call matches the
    reference. (The indexer's: tests/ops/test_indexer.py.)"""
    from openmsa.ops.attention import api as attention_api
    from openmsa.ops.common.launch import PlanCache
    plans = []
    monkeypatch.setattr(attention_api, "_PLANS", PlanCache())
    orig = attention_api._plan
    monkeypatch.setattr(attention_api, "_plan",
                        lambda *a, **k: plans.append(1) or orig(*a, **k))
    dtype = _attention_dtype(kernel_device)
    step, dstep, q, k, v, idx = _attention_case(kernel_device, dtype, "vllm")
    q = q.to(dtype)
    want = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens, step.block_table,
                                block_size=B)
    dargs = (idx.to(kernel_device), dstep.cu_seqlens_q, dstep.seq_lens, dstep.block_table)
    qd, kd, vd = q.to(kernel_device), to_device(k, kernel_device), to_device(v, kernel_device)

    def attend(out=None):
        assert_close(openmsa.sparse_attention(qd, kd, vd, *dargs, block_size=B, out=out), want)

    attend()
    attend()
    assert len(plans) == 1
    monkeypatch.setitem(attention_api.TUNING, "min_steps_per_split", 1)
    attend()
    assert len(plans) == 2
    attend(out=torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=dtype,
                           device=kernel_device).transpose(0, 1))
    assert len(plans) == 3
    attend()  # back to the first layout and knobs: its plan is still there
    assert len(plans) == 3

