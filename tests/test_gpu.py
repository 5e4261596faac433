# SPDX-License-Identifier: Apache-2.0
"""Tier 2 (an H200): M3 shapes, 1M-token contexts, caches past 2^31 bytes/elements (int64
offsets), bf16 and kernel-side fp8, determinism and CUDA-graph replay."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

import openmsa
from openmsa import reference as ref
from openmsa.ops.common.counters import COUNTERS
from helpers import (RecordingKernel, assert_close, make_step, random_index_inputs,
                     random_kv_cache)

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
B = 128


def _cuda(step):
    """A copy of the step with its tensors on the GPU (the CPU original feeds the reference)."""
    return dataclasses.replace(step, **{name: getattr(step, name).cuda() for name in (
        "cu_seqlens_q", "seq_lens", "block_table", "slot_mapping")})


def _compact(cache, step):
    """The pages a step uses, copied to a small CPU cache with a renumbered table: the
    reference then runs on CPU against a cache of any size on the GPU."""
    used = step.block_table[step.block_table >= 0].unique()
    remap = torch.full((cache.shape[0],), -1, dtype=torch.int32)
    remap[used.long().cpu()] = torch.arange(len(used), dtype=torch.int32)
    table = torch.where(step.block_table.cpu() >= 0,
                        remap[step.block_table.cpu().clamp(min=0).long()],
                        -1)
    return cache[used.long()].cpu(), table


def _m3_attention_case(kv_dtype, num_heads=64, num_kv_heads=4, context=65536, q_lens=(1, 4, 1)):
    seq_lens = [context, context - 1000, 20_000]
    step = make_step(list(q_lens), seq_lens, block_size=B, extra_columns=1)
    pages = step.num_pages
    g = torch.Generator().manual_seed(0)
    k = torch.randn(pages, B, num_kv_heads, 128, generator=g).to(kv_dtype)
    v = torch.randn(pages, B, num_kv_heads, 128, generator=g).to(kv_dtype)
    qi, ci = random_index_inputs(step, num_heads=num_kv_heads, head_dim=128, block_size=B,
                                 q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    idx = ref.select_blocks(qi, ci, step.cu_seqlens_q, step.seq_lens, step.block_table,
                            block_size=B)
    q = torch.randn(step.num_tokens, num_heads, 128, generator=g).bfloat16()
    return step, q, k, v, idx


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
# (q heads, KV heads) of an M3 rank at TP1, TP4 and TP8 (a KV head replicated on 2 ranks)
@pytest.mark.parametrize("heads", [(64, 4), (16, 1), (8, 1)])
def test_attention_m3_shapes(kv_dtype, heads):
    step, q, k, v, idx = _m3_attention_case(kv_dtype, *heads)
    want, want_lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                          step.block_table, return_lse=True)
    d = _cuda(step)
    got, lse = openmsa.sparse_attention(q.cuda(), k.cuda(), v.cuda(), idx.cuda(), d.cu_seqlens_q,
                                        d.seq_lens, d.block_table, return_lse=True)
    assert_close(got, want)
    assert_close(lse, want_lse, torch.bfloat16)
    again = openmsa.sparse_attention(q.cuda(), k.cuda(), v.cuda(), idx.cuda(), d.cu_seqlens_q,
                                     d.seq_lens, d.block_table)
    assert torch.equal(again, got)


def _tile_tokens(kv_dtype, group):
    """Tokens per prefill tile: tile_rows // G, twice that for tiles of two consumers (api.py's
    ws_pair for fp8, ws_pair_16 for 16-bit K/V; up to 16 tokens)."""
    from openmsa.ops.attention import api
    qt = api.TUNING["tile_rows"] // group
    return 2 * qt if 2 * qt <= 16 and api._ws_pair(kv_dtype == FP8) else qt


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("heads", [(64, 4), (16, 1), (8, 1)])
def test_attention_prefill_tiles_m3(kv_dtype, heads, monkeypatch):
    """A 2100-token chunk next to decode rows: every other run of a tile's length shares one
    selection (tiles the union kernel takes), the others keep their own (left to the per-token
    kernel). A tile holds tile_rows // G tokens: 4 at G = 16, 8 at G = 8 (fp8: twice)."""
    from openmsa.ops.attention import api, prefill
    step, q, k, v, idx = _m3_attention_case(kv_dtype, *heads, context=11_000,
                                            q_lens=(3, 2100, 1))
    run = _tile_tokens(kv_dtype, heads[0] // heads[1])
    # runs aligned with the tiles (packed tokens [i * run, (i + 1) * run)); the chunk's tokens
    # are 3 .. 2102
    first = -(-3 // run) * run
    shared = idx[first:first + (2103 - first) // run * run].view(-1, run, *idx.shape[1:])
    shared[::2] = shared[::2, :1].clone()
    flags = []
    monkeypatch.setattr(prefill, "_tile_plan_kernel",
                        RecordingKernel(prefill._tile_plan_kernel, flags, arg=4))
    want, want_lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                          step.block_table, return_lse=True)
    d = _cuda(step)
    got, lse = openmsa.sparse_attention(q.cuda(), k.cuda(), v.cuda(), idx.cuda(), d.cu_seqlens_q,
                                        d.seq_lens, d.block_table, return_lse=True)
    assert_close(got, want)
    assert_close(lse, want_lse, torch.bfloat16)
    taken = flags[0].cpu() >= 0
    assert taken.any() and not taken.all()
    again = openmsa.sparse_attention(q.cuda(), k.cuda(), v.cuda(), idx.cuda(), d.cu_seqlens_q,
                                     d.seq_lens, d.block_table)
    assert torch.equal(again, got)


def _mixed_tiles_chunk(heads, dtype):
    """A prefill step for the tile paths: chunks with and without context beside decode rows,
    partial own blocks whose unwritten K/V tail is NaN, and every other run of a tile's tokens
    sharing one selection (the plan takes those tiles and leaves the rest). Returns the CPU
    step, q (16-bit; heads of different magnitudes), K, V [P, B, Hkv, 128] and the selection."""
    from openmsa.ops.attention import api
    num_heads, num_kv = heads
    q_lens, seq_lens = [3, 1030, 1, 1500], [5000, 1030 + 3000, 900, 1500 + 77]
    step = make_step(q_lens, seq_lens, block_size=B, extra_columns=1)
    g = torch.Generator().manual_seed(3)
    shape = (step.num_pages, B, num_kv, 128)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    for r, length in enumerate(seq_lens):  # the unwritten tail of each request's last page
        if length % B:
            k[int(step.block_table[r, (length - 1) // B]), length % B:] = float("nan")
            v[int(step.block_table[r, (length - 1) // B]), length % B:] = float("nan")
    qi, ci = random_index_inputs(step, num_heads=num_kv, head_dim=128, block_size=B,
                                 q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    idx = ref.select_blocks(qi, ci, step.cu_seqlens_q, step.seq_lens, step.block_table,
                            block_size=B)
    run = _tile_tokens(dtype, num_heads // num_kv)
    shared = idx[:idx.shape[0] // run * run].view(-1, run, *idx.shape[1:])
    shared[::2] = shared[::2, :1].clone()
    q_dtype = torch.bfloat16 if dtype == FP8 else dtype
    # (ws_fp8_qk scales each row of q on its own)
    head_scale = torch.tensor([0.25, 1.0, 3.0]).repeat(num_heads)[:num_heads, None]
    q = (torch.randn(step.num_tokens, num_heads, 128, generator=g) * head_scale).to(q_dtype)
    return step, q, k, v, idx


@pytest.mark.parametrize("heads, dtype, layout, knobs", [
    ((64, 4), torch.bfloat16, "flash", {}), ((64, 4), torch.bfloat16, "packed", {}),
    ((8, 1), torch.float16, "packed", {}), ((16, 1), torch.bfloat16, "flash", {}),
    ((64, 4), FP8, "packed", {}), ((16, 1), FP8, "flash", {}),
    ((64, 4), torch.bfloat16, "packed", dict(ws_keys_early=False)),
    ((16, 1), FP8, "flash", dict(ws_keys_early=False)),
    ((64, 4), FP8, "packed", dict(ws_fp8_qk=True)), ((16, 1), FP8, "flash", dict(ws_fp8_qk=True)),
    ((8, 1), FP8, "packed", dict(ws_fp8_qk=True, ws_keys_early=False)),
    ((64, 4), FP8, "packed", dict(ws_stages_k_fp8=1)),
    ((16, 1), FP8, "flash", dict(ws_fp8_loader=False)),
    ((64, 4), FP8, "packed", dict(ws_fp8_loader=False, ws_stages_k_fp8=1)),
    ((64, 4), FP8, "packed", dict(ws_loader_roll=False, ws_keys_early=False)),
    ((64, 4), FP8, "packed", dict(ws_sub_fp8=64, ws_stages_k_fp8=3, ws_stages_fp8=2)),
    ((16, 1), FP8, "flash", dict(ws_sub_fp8=64)),
    ((16, 1), FP8, "flash", dict(ws_loader_roll=False)),
    ((8, 1), FP8, "flash", dict(ws_loader_roll=False, ws_stages_k_fp8=1, ws_keys_early=False)),
    ((16, 1), FP8, "packed", dict(ws_stages_k_fp8=1, ws_stages_fp8=2)),
    ((16, 1), FP8, "flash", dict(ws_pair=False)), ((64, 4), FP8, "packed", dict(ws_pair=False)),
    ((64, 4), FP8, "packed", dict(ws_pair_stages_k=2, ws_pair_stages_v=1, ws_pair_eager=True)),
    ((8, 1), FP8, "packed", dict(ws_keys_early=False)),
    ((64, 4), torch.bfloat16, "packed", dict(ws_pair_16=True)),
    ((8, 1), torch.float16, "flash", dict(ws_pair_16=True, ws_keys_early=False))], ids=str)
def test_attention_prefill_gluon_tiles(heads, dtype, layout, knobs, monkeypatch):
    """The warp-specialised tile kernel (prefill_ws.py) against the reference and the Triton
    tile kernel: chunks with and without context, partial own blocks whose unwritten tail is NaN
    in K and V (copied by TMA, never reaching the output), tiles the plan takes and leaves,
    the flash and vLLM packed layouts, per-tensor scales (one negative), a strided out=, and the
    Triton fallback for a base address TMA cannot take."""
    from openmsa.ops.attention import api
    # ws_keys_early=False: keys handed back together with the values after P V, not after S;
    # ws_fp8_qk: fp8 K/V with S = Q K^T as fp8 MMAs (q as e4m3 hi + lo); fp8 K/V by default
    # loaded and converted to fp16 rings by a producer warpgroup (NaN tails included),
    # ws_fp8_loader=False: TMA copies of fp8 tiles that the consumer converts;
    # ws_loader_roll=False: the loader's V loads after its K stores, not under them;
    # ws_sub_fp8=64: the loader's fp8 tiles in 64-key steps
    for name, value in knobs.items():
        monkeypatch.setitem(api.TUNING, name, value)
    calls = []  # the launches' per-tile union sizes (-1: a tile left to the per-token kernel)
    real = api._launch_tile_ws
    monkeypatch.setattr(api, "_launch_tile_ws", lambda *a: calls.append(a[7]) or real(*a))
    num_heads, num_kv = heads
    step, q, k, v, idx = _mixed_tiles_chunk(heads, dtype)
    shape, q_dtype = k.shape, q.dtype
    d = _cuda(step)
    if layout == "packed":  # vLLM's [P, Hkv, B, 2 * D]
        buf = torch.empty(step.num_pages, num_kv, B, 256, dtype=dtype, device="cuda")
        kd, vd = buf[..., :128].transpose(1, 2), buf[..., 128:].transpose(1, 2)
        kd.copy_(k)
        vd.copy_(v)
    else:
        kd, vd = k.cuda(), v.cuda()
    args = (idx, step.cu_seqlens_q, step.seq_lens, step.block_table)
    dargs = (idx.cuda(), d.cu_seqlens_q, d.seq_lens, d.block_table)
    for scales in (dict(), dict(k_scale=-0.5, v_scale=2.0)):
        calls.clear()
        want, want_lse = ref.sparse_attention(q, k, v, *args, return_lse=True, **scales)
        assert not want.isnan().any()
        out = torch.full((num_heads, q.shape[0], 128), 7.0, device="cuda").to(q_dtype)
        got, lse = openmsa.sparse_attention(q.cuda(), kd, vd, *dargs, return_lse=True,
                                            out=out.transpose(0, 1), **scales)
        assert calls and all((blocks >= 0).any() for blocks in calls)  # tiles were taken
        if knobs.get("ws_fp8_qk"):
            # S from fp8 MMAs: Hopper's fp8 accumulation keeps ~6e-4 of a row's largest |S|
            # (benchmarks/probe_fp8_accum.py), past bf16 rounding on sharp rows: its own bound
            torch.testing.assert_close(got.float().cpu(), want.float(), atol=4e-2, rtol=4e-2)
            torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-2, rtol=1e-3)
            continue
        assert_close(got, want)
        assert_close(lse, want_lse, torch.bfloat16)
        monkeypatch.setitem(api.TUNING, "tile_ws", False)
        triton_out = openmsa.sparse_attention(q.cuda(), kd, vd, *dargs, **scales)
        monkeypatch.setitem(api.TUNING, "tile_ws", True)
        assert_close(got, triton_out)
    # K and V one element past a 16-byte boundary: the Triton tile kernel takes them
    calls.clear()
    kbuf = torch.empty(kd.numel() + 8, dtype=dtype, device="cuda")[1:1 + kd.numel()]
    vbuf = torch.empty(vd.numel() + 8, dtype=dtype, device="cuda")[1:1 + vd.numel()]
    ks, vs = kbuf.view(shape).copy_(kd), vbuf.view(shape).copy_(vd)
    assert_close(openmsa.sparse_attention(q.cuda(), ks, vs, *dargs),
                 ref.sparse_attention(q, k, v, *args))
    assert not calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_attention_prefill_tiles_overlap_graph_replay(dtype, monkeypatch):
    """The per-token launch as a programmatic dependent of the Gluon tiles (ws_pdl): the
    same bits as launched after them, eagerly and replayed from a CUDA graph with new queries
    (both kernels are deterministic; overlapping changes only when they run)."""
    from openmsa.ops.attention import api
    step, q, k, v, idx = _mixed_tiles_chunk((64, 4), dtype)
    d = _cuda(step)
    kd, vd = k.cuda(), v.cuda()
    args = (kd, vd, idx.cuda(), d.cu_seqlens_q, d.seq_lens, d.block_table)
    qd = q.cuda()
    monkeypatch.setitem(api.TUNING, "ws_pdl", False)
    want = [openmsa.sparse_attention(qd * s, *args) for s in (1.0, 0.5, 2.0)]
    monkeypatch.setitem(api.TUNING, "ws_pdl", True)
    plan_launches = []
    real = api._launch_tile_ws
    monkeypatch.setattr(api, "_launch_tile_ws",
                        lambda *a: plan_launches.append(a[-2].ws_pdl) or real(*a))
    out = torch.full_like(qd, float("nan"))
    openmsa.sparse_attention(qd, *args, out=out)  # eager, on the capturing stream's device
    assert plan_launches == [True]
    assert torch.equal(out, want[0])
    q_in = qd.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        openmsa.sparse_attention(q_in, *args, out=out)
    for s, expected in zip((0.5, 2.0, 1.0), (want[1], want[2], want[0])):
        out.fill_(float("nan"))
        q_in.copy_(qd * s)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


def test_attention_prefill_waste_follows_the_kernel_that_runs(monkeypatch):
    """The plan's union-size threshold is the Gluon tiles' (ws_waste) when they run and the
    Triton tiles' (tile_waste) when a base address TMA cannot take sends the tiles there: with
    tile_waste 0 and ws_waste 1e9, the aligned call takes the tiles whose tokens share a
    selection and the misaligned one takes none; both match the reference."""
    from openmsa.ops.attention import api, prefill
    for key, value in dict(tile_waste=0.0, ws_waste=1e9, ws_waste_fp8=1e9).items():
        monkeypatch.setitem(api.TUNING, key, value)
    step, q, k, v, idx = _mixed_tiles_chunk((64, 4), torch.bfloat16)
    d = _cuda(step)
    dargs = (idx.cuda(), d.cu_seqlens_q, d.seq_lens, d.block_table)
    want = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens, step.block_table)
    flags = []
    monkeypatch.setattr(prefill, "_tile_plan_kernel",
                        RecordingKernel(prefill._tile_plan_kernel, flags, arg=4))
    assert_close(openmsa.sparse_attention(q.cuda(), k.cuda(), v.cuda(), *dargs), want)
    assert (flags[-1] >= 0).any()
    # K and V one element past a 16-byte boundary: the Triton tiles' threshold
    kbuf = torch.empty(k.numel() + 8, dtype=k.dtype, device="cuda")[1:1 + k.numel()]
    vbuf = torch.empty(v.numel() + 8, dtype=v.dtype, device="cuda")[1:1 + v.numel()]
    ks, vs = kbuf.view(k.shape).copy_(k), vbuf.view(v.shape).copy_(v)
    assert_close(openmsa.sparse_attention(q.cuda(), ks, vs, *dargs), want)
    assert not (flags[-1] >= 0).any()


def test_attention_prefill_equals_dense_sdpa():
    """topk covering every block: sparse attention is dense causal attention."""
    ctx, chunk = 1500, 500
    step = make_step([chunk], [ctx + chunk], block_size=B)
    d = _cuda(step)
    g = torch.Generator(device="cuda").manual_seed(1)
    k = torch.randn(step.num_pages, B, 2, 128, generator=g, device="cuda").bfloat16()
    v = torch.randn(step.num_pages, B, 2, 128, generator=g, device="cuda").bfloat16()
    q = torch.randn(chunk, 32, 128, generator=g, device="cuda").bfloat16()
    qi = torch.randn(chunk, 2, 128, device="cuda").bfloat16()
    ci = torch.randn(step.num_pages, B, 128, device="cuda").bfloat16()
    idx = openmsa.select_blocks(qi, ci, d.cu_seqlens_q, d.seq_lens, d.block_table, topk=32,
                                block_size=B)
    got = openmsa.sparse_attention(q, k, v, idx, d.cu_seqlens_q, d.seq_lens, d.block_table)
    nb = -(-(ctx + chunk) // B)
    pages = d.block_table[0, :nb].long()
    kk = k[pages].reshape(nb * B, 2, 128)[:ctx + chunk].transpose(0, 1)
    vv = v[pages].reshape(nb * B, 2, 128)[:ctx + chunk].transpose(0, 1)
    mask = torch.arange(ctx + chunk, device="cuda")[None, :] <= \
        (ctx + torch.arange(chunk, device="cuda"))[:, None]
    want = F.scaled_dot_product_attention(q.transpose(0, 1).float(),
                                          kk.repeat_interleave(16, 0).float(),
                                          vv.repeat_interleave(16, 0).float(), attn_mask=mask)
    assert_close(got, want.transpose(0, 1))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
def test_attention_cache_over_2_31_elements_and_graph_replay(kv_dtype):
    """fp8: V read in byte pairs, whose offsets are halved byte offsets past 2^31."""
    pages = (1 << 31) // (B * 128) + 64  # one KV head: past 2^31 elements per cache
    packed = torch.empty(pages, 1, B, 256, dtype=kv_dtype, device="cuda")
    k, v = packed[..., :128].permute(0, 2, 1, 3), packed[..., 128:].permute(0, 2, 1, 3)
    num_req = 4
    step = make_step([1] * num_req, [5000, 3000, 129, 2000], block_size=B)
    step.block_table = torch.where(step.block_table >= 0, step.block_table + pages - 150, -1)
    packed[-150:] = torch.randn(150, 1, B, 256, device="cuda").to(kv_dtype)
    d = _cuda(step)
    q = torch.randn(num_req, 16, 128, device="cuda").bfloat16()
    idx = torch.randint(0, 40, (num_req, 1, 16), device="cuda").int()
    out = torch.empty_like(q)
    run = lambda: openmsa.sparse_attention(q, k, v, idx, d.cu_seqlens_q, d.seq_lens,  # noqa
                                           d.block_table, out=out)
    run()
    small_k, table = _compact(k, step)
    small_v, _ = _compact(v, step)
    want = ref.sparse_attention(q.cpu(), small_k, small_v, idx.cpu(), step.cu_seqlens_q,
                                step.seq_lens, table)
    assert_close(out, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    q.copy_(torch.randn_like(q))
    d.seq_lens.copy_(torch.tensor([4000, 100, 200, 700], dtype=torch.int32))
    graph.replay()
    eager = openmsa.sparse_attention(q, k, v, idx, d.cu_seqlens_q, d.seq_lens, d.block_table)
    assert torch.equal(out, eager)


def test_attention_fused_merge_graph_replay_and_two_streams():
    """A step whose splits the last program merges (arrival counters): eager against the
    reference, a captured graph replayed with new queries and lengths, and two launches running
    at once on two streams (each stream has its own counters) equal to their eager results."""
    from openmsa.ops.attention import api as attention_api
    num_req = 64
    step = make_step([1] * num_req, [3000 + 37 * i for i in range(num_req)], block_size=B)
    splits = attention_api._num_splits(num_req, 1, 16, torch.device("cuda"),
                                       attention_api.TUNING["resident_16"])  # bf16
    assert 1 < splits <= attention_api.TUNING["fused_max_splits"]  # the path under test
    g = torch.Generator().manual_seed(3)
    k = torch.randn(step.num_pages, B, 1, 128, generator=g).bfloat16()
    v = torch.randn(step.num_pages, B, 1, 128, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(24, generator=g)[:16] for _ in range(num_req)])[:, None]
    idx = idx.int().sort(-1).values
    q = torch.randn(num_req, 16, 128, generator=g).bfloat16()
    want = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens, step.block_table)
    d = _cuda(step)
    qc, kc, vc, ic = q.cuda(), k.cuda(), v.cuda(), idx.cuda()
    out = torch.empty_like(qc)
    run = lambda: openmsa.sparse_attention(qc, kc, vc, ic, d.cu_seqlens_q, d.seq_lens,  # noqa
                                           d.block_table, out=out)
    run()
    assert_close(out, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for trial in range(3):
        qc.copy_(torch.randn_like(qc))
        d.seq_lens.copy_(torch.randint(2000, 3000, (num_req,), dtype=torch.int32))
        graph.replay()
        eager = openmsa.sparse_attention(qc, kc, vc, ic, d.cu_seqlens_q, d.seq_lens,
                                         d.block_table)
        assert torch.equal(out, eager), trial
    # two streams at once: no shared counter between them
    q2 = torch.randn_like(qc)
    want1 = openmsa.sparse_attention(qc, kc, vc, ic, d.cu_seqlens_q, d.seq_lens, d.block_table)
    want2 = openmsa.sparse_attention(q2, kc, vc, ic, d.cu_seqlens_q, d.seq_lens, d.block_table)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(20):
        with torch.cuda.stream(s1):
            a = openmsa.sparse_attention(qc, kc, vc, ic, d.cu_seqlens_q, d.seq_lens,
                                         d.block_table)
        with torch.cuda.stream(s2):
            b = openmsa.sparse_attention(q2, kc, vc, ic, d.cu_seqlens_q, d.seq_lens,
                                         d.block_table)
        outs.append((a, b))
    torch.cuda.synchronize()
    for a, b in outs:
        assert torch.equal(a, want1) and torch.equal(b, want2)
    assert all(int(c.count_nonzero()) == 0 for c in COUNTERS.values())


# ------------------------------------------------------------------------------ launches
@triton.jit
def _gather_kernel(x_ptr, out_ptr, n, stride, OFFSET: tl.constexpr, NP: tl.constexpr):
    i = tl.arange(0, NP)
    tl.store(out_ptr + i, tl.load(x_ptr + i * stride + OFFSET, mask=i < n, other=-1), mask=i < n)


def test_launcher_cache_keys_on_what_triton_specialises(monkeypatch):
    """Launcher's cached path runs a kernel only on arguments it was compiled for: a stride of
    1 (a constexpr to Triton), multiples of 16 and not, a 16-byte-aligned address and a
    misaligned view, each against torch; a repeated call skips JITFunction.run."""
    import triton.runtime.jit as tjit

    from openmsa.ops.common.launch import Launcher
    calls = []
    orig = tjit.JITFunction.run

    def counted(self, *args, **kwargs):
        calls.append(self)
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(tjit.JITFunction, "run", counted)
    launch = Launcher(_gather_kernel)
    base = torch.arange(4096, dtype=torch.int32, device="cuda")
    cases = [(base, 16, 5), (base, 1, 5), (base, 17, 9), (base[3:], 16, 5), (base[3:], 1, 1),
             (base, 16, 5), (base[3:], 17, 9), (base, 1, 16)]
    for trial in range(2):
        for x, stride, n in cases:
            out = torch.full((n,), -7, dtype=torch.int32, device="cuda")
            launch((1,), x, out, n, stride, OFFSET=2, NP=16, num_warps=1)
            want = x[2::stride][:n]
            assert torch.equal(out, want), (trial, x.data_ptr() % 16, stride, n)
        if trial == 0:
            first = len(calls)
    assert first <= len(cases) and len(calls) == first  # the second round: cached launches only


@pytest.mark.parametrize("verify", [True, False])
def test_attention_and_selection_repeated_with_misaligned_views(verify, monkeypatch):
    """The ops through their launchers: the same shapes called again with q, out and the index
    query at a 2-byte offset (not 16-byte aligned), against the reference each time; with the
    planned launches checked against Triton's key (as the rest of the suite) and as engines run
    them (unchecked)."""
    from openmsa.ops.common import launch as launch_mod
    monkeypatch.setattr(launch_mod, "VERIFY_PLAN_KEYS", verify)
    step = make_step([1, 1, 4], [3000, 700, 5000], block_size=B)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(step.num_pages, B, 1, 128, generator=g).bfloat16()
    v = torch.randn(step.num_pages, B, 1, 128, generator=g).bfloat16()
    iq, ic = random_index_inputs(step, num_heads=1, head_dim=128, block_size=B,
                                 q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16,
                                 integer=True)
    d = _cuda(step)
    kc, vc, icc = k.cuda(), v.cuda(), ic.cuda()
    for offset in (0, 1, 0, 1):
        q = torch.randn(6, 16, 128, generator=g).bfloat16()
        qbuf = torch.empty(q.numel() + 8, dtype=torch.bfloat16, device="cuda")
        qc = qbuf[offset:offset + q.numel()].view(q.shape).copy_(q)
        ibuf = torch.empty(iq.numel() + 8, dtype=torch.bfloat16, device="cuda")
        iqc = ibuf[offset:offset + iq.numel()].view(iq.shape).copy_(iq)
        idx = openmsa.select_blocks(iqc, icc, d.cu_seqlens_q, d.seq_lens, d.block_table,
                                    block_size=B)
        want_idx = ref.select_blocks(iq, ic, step.cu_seqlens_q, step.seq_lens,
                                     step.block_table, block_size=B)
        assert torch.equal(idx.cpu(), want_idx), offset
        obuf = torch.empty(q.numel() + 8, dtype=torch.bfloat16, device="cuda")
        out = obuf[offset:offset + q.numel()].view(q.shape)
        openmsa.sparse_attention(qc, kc, vc, idx, d.cu_seqlens_q, d.seq_lens, d.block_table,
                                 out=out)
        want = ref.sparse_attention(q, k, v, want_idx, step.cu_seqlens_q, step.seq_lens,
                                    step.block_table)
        assert_close(out, want)


@triton.jit
def _late_copy_kernel(src_ptr, dst_ptr, n, spin, BLOCK: tl.constexpr):
    """dst = src, written only after a long spin, by a kernel that lets its programmatic
    dependents start at once: a dependent that read dst before its gdc_wait would see the old
    values."""
    gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n, other=0)
    acc = tl.program_id(0).to(tl.float32)
    for _ in range(spin):
        acc = acc * 0.5 + 1.0  # stays in [0, 2]: the select below never fires
    x = tl.where(acc < -1.0, 0, x)
    tl.store(dst_ptr + offs, x, mask=offs < n)


def _late_copy(src, dst, spin=200000):
    """Copy src into dst (same dtype and shape, contiguous) with _late_copy_kernel: ~0.1-0.5 ms
    of spinning before the store."""
    s, d = src.view(torch.int16).view(-1), dst.view(torch.int16).view(-1)
    _late_copy_kernel[(triton.cdiv(s.numel(), 1024),)](s, d, s.numel(), spin, BLOCK=1024)


def test_first_pdl_waits_for_the_kernel_before(monkeypatch):
    """first_pdl: the attention's first launch is a programmatic dependent of whatever kernel
    precedes it. Here that kernel lets dependents start at once and writes the op's queries
    only after a long spin, so a launch that read them before its gdc_wait would use the old
    queries: eager and replayed in a CUDA graph (new queries each time), the outputs equal the
    reference's for the new queries. The plan is checked to take the path under test."""
    from openmsa.ops.attention import api as attention_api
    monkeypatch.setitem(attention_api.TUNING, "first_pdl", True)
    num_req = 8
    step = make_step([1, 2, 1, 4, 1, 3, 1, 1], [3000 + 517 * i for i in range(num_req)],
                     block_size=B)
    d = _cuda(step)
    args = (d.cu_seqlens_q, d.seq_lens, d.block_table)
    g = torch.Generator().manual_seed(11)
    k, v = random_kv_cache(step.num_pages, B, 4, 128, dtype=torch.bfloat16, generator=g)
    kc, vc = k.cuda(), v.cuda()
    idx = torch.stack([torch.randperm(20, generator=g)[:16] for _ in range(4)])
    idx = idx.int().sort(-1).values[None].expand(step.num_tokens, 4, 16).contiguous()
    ic = idx.cuda()
    out = torch.empty(step.num_tokens, 64, 128, dtype=torch.bfloat16, device="cuda")
    plan = attention_api._plan(out, kc, vc, ic, None, B, False)
    assert plan.kwargs.get("WAIT_PRIOR") and plan.kwargs.get("launch_pdl")

    def new_q():
        return torch.randn(step.num_tokens, 64, 128, generator=g).bfloat16()

    def call(qd):
        openmsa.sparse_attention(qd, kc, vc, ic, *args, out=out)

    def check(qq):
        want = ref.sparse_attention(qq, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                    step.block_table)
        assert_close(out.cpu(), want)
    qd = new_q().cuda()
    src = torch.empty_like(qd)
    call(qd)  # compile outside the timed chain
    for trial in range(2):
        qq = new_q()
        src.copy_(qq)
        _late_copy(src, qd)
        call(qd)
        check(qq)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _late_copy(src, qd)
        call(qd)
    for trial in range(3):
        qq = new_q()
        src.copy_(qq)
        graph.replay()
        check(qq)

