# SPDX-License-Identifier: Apache-2.0
"""Context-parallel selection (ops/indexer/cp.py, select_blocks(cp_group=...)): the sort keys,
the merge, rank-by-rank runs in one process, multi-process runs over gloo (world sizes 2-4,
replicated and sharded index caches) and, on a GPU, realistic sizes and a CUDA-graph replay.
Every CP result must be bit-identical to select_blocks without a group."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import openmsa
from openmsa.batch import token_layout
from openmsa.ops.indexer import reference as indexer_ref
from openmsa.ops.indexer.api import merge_candidates_kernel, rank_candidates
from openmsa.ops.indexer.cp import (INT64_MIN, key_block_ids, local_candidates,
                                    merge_candidates, owned_table, pack_keys)
from helpers.cp_cases import B, cases, make_case, simulate
from helpers.sm90 import INTERPRET

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.reference
def test_key_order_is_the_tie_rule():
    """Larger key = higher score, NaN as -inf, -0.0 equal to +0.0, ties to the lower block."""
    nan, inf = float("nan"), float("inf")
    scores = torch.tensor([inf, 1.0, 0.0, -0.0, -0.0, 0.0, -1e-45, -1.0, -inf, nan, nan, -inf,
                           3.0, 1.0, 1e-45, -3e38, 3e38])
    ids = torch.tensor([5, 3, 9, 2, 7, 1, 4, 6, 8, 0, 10, 11, 12, 13, 14, 15, 16])
    keys = pack_keys(scores, ids, torch.ones_like(ids, dtype=torch.bool))
    assert keys.unique().numel() == keys.numel()
    assert torch.equal(key_block_ids(keys), ids)
    clean = [(-math.inf if s != s else s) for s in scores.tolist()]
    want = sorted(range(len(ids)), key=lambda i: (-clean[i] + 0.0, int(ids[i])))
    got = torch.argsort(keys, descending=True).tolist()
    assert got == want
    # -inf (and NaN) candidates still beat "no candidate"
    assert bool((keys > INT64_MIN).all())
    none = pack_keys(scores, ids, torch.zeros_like(ids, dtype=torch.bool))
    assert bool((none == INT64_MIN).all())


@pytest.mark.reference
@pytest.mark.parametrize("seed", range(4))
def test_merge_of_rank_candidates_equals_selection_from_scores(seed):
    """Random score rows with many ties, NaN, +-0.0 and -inf: each rank's local candidates of its
    columns, merged, equal the one-device selection rule on the whole row."""
    g = torch.Generator().manual_seed(seed)
    num_tokens, heads, max_blocks = 40, 3, 23
    values = torch.tensor([float("nan"), float("-inf"), -0.0, 0.0, 1.0, 2.0, -1.0, float("inf")])
    scores = values[torch.randint(0, len(values), (num_tokens, heads, max_blocks), generator=g)]
    position = torch.randint(-1, max_blocks * B, (num_tokens,), generator=g).to(torch.int32)
    for topk, init, local in [(4, 0, 1), (3, 1, 1), (6, 2, 2), (5, 0, 0), (30, 1, 1), (1, 0, 1)]:
        want = indexer_ref.select_from_scores(scores, position, topk=topk, init_blocks=init,
                                              local_blocks=local, block_size=B)
        for world in (1, 2, 3, 4, 5, 24):
            width = -(-max_blocks // world)
            keys = []
            for r in range(world):
                local_scores = torch.full((num_tokens, heads, width), 7.0)  # garbage past the end
                own = scores[:, :, r::world]
                local_scores[:, :, :own.shape[2]] = own
                keys.append(local_candidates(local_scores, position, cp_size=world, cp_rank=r,
                                             max_blocks=max_blocks, topk=topk, init_blocks=init,
                                             local_blocks=local, block_size=B))
            cand = torch.stack(keys, 2).reshape(num_tokens, heads, -1)
            got = merge_candidates(cand, position, topk=topk, init_blocks=init,
                                   local_blocks=local, block_size=B)
            assert torch.equal(got, want), (topk, init, local, world)


@pytest.mark.interpret
def test_candidate_and_merge_kernels_equal_torch(kernel_device):
    """The Triton forms of the local candidates and the merge against the PyTorch ones on
    random score rows (ties, NaN, +-0.0, -inf), a step with padding tokens and short contexts."""
    from openmsa.ops.indexer.api import local_candidates_kernel
    from helpers.steps import make_step
    g = torch.Generator().manual_seed(5)
    step = make_step([1, 3, 0, 20, 1, 0, 16], [70, 45, 9, 100, 5, 0, 200], block_size=B,
                     extra_columns=2, pad_tokens=2, generator=g)
    cu, seq = step.cu_seqlens_q, step.seq_lens
    num_tokens, heads, max_blocks = step.num_tokens, 2, step.block_table.shape[1]
    values = torch.tensor([float("nan"), float("-inf"), -0.0, 0.0, 1.0, 2.0, -1.0, float("inf")])
    scores = values[torch.randint(0, len(values), (num_tokens, heads, max_blocks), generator=g)]
    _, position = token_layout(cu, seq, num_tokens)
    dev = kernel_device
    for topk, init, local, world in [(6, 2, 2, 3), (16, 0, 1, 1), (1, 0, 1, 2), (1, 0, 0, 3)]:
        want = indexer_ref.select_from_scores(scores, position, topk=topk, init_blocks=init,
                                              local_blocks=local, block_size=B)
        width = -(-max_blocks // world)
        got_keys = []
        for r in range(world):
            local_scores = torch.full((num_tokens, heads, width), 7.0)
            own = scores[:, :, r::world]
            local_scores[:, :, :own.shape[2]] = own
            rule = dict(cp_size=world, cp_rank=r, max_blocks=max_blocks, topk=topk,
                        init_blocks=init, local_blocks=local, block_size=B)
            keys = local_candidates(local_scores, position, **rule)
            k_keys, k_pos = local_candidates_kernel(local_scores.to(dev), cu.to(dev),
                                                    seq.to(dev), **rule)
            assert torch.equal(k_pos.cpu(), position)
            assert torch.equal(torch.sort(k_keys.cpu(), -1).values,
                               torch.sort(keys, -1).values)
            got_keys.append(k_keys)
        cand = torch.stack(got_keys, 2)
        got = merge_candidates_kernel(cand, k_pos, topk=topk, init_blocks=init,
                                      local_blocks=local, block_size=B)
        assert torch.equal(got.cpu(), want), (topk, init, local, world)
        # strided out, written in place
        out = torch.full((heads, num_tokens, topk), -7, dtype=torch.int32,
                         device=dev).transpose(0, 1)
        merge_candidates_kernel(cand, k_pos, topk=topk, init_blocks=init,
                                local_blocks=local, block_size=B, out=out)
        assert torch.equal(out.cpu(), want)


@pytest.mark.reference
def test_cp_group_is_checked():
    q, c, cu, seq, table = make_case(0)
    with pytest.raises(TypeError, match="cp_group"):
        openmsa.select_blocks(q, c, cu, seq, table, topk=4, block_size=B, cp_group=2)


@pytest.mark.reference
@pytest.mark.dispatch
def test_ranks_one_after_another_reference():
    """The reference path: every case, group sizes 1-5, replicated and sharded."""
    for name, args, (topk, init, local) in cases():
        want = openmsa.reference.select_blocks(*args, topk=topk, init_blocks=init,
                                               local_blocks=local, block_size=B)
        for world in (1, 2, 3, 4, 5):
            for sharded in (False, True):
                got = simulate(args, (topk, init, local), world, sharded=sharded)
                assert torch.equal(got, want), (name, world, sharded)


@pytest.mark.interpret
@pytest.mark.parametrize("world, max_q_len", [(2, None), (3, 20)])
def test_ranks_one_after_another_kernels(kernel_device, world, max_q_len):
    """The Triton scoring kernel (decode and prefill launches, positions mapped per rank), the
    candidate and merge kernels, run rank by rank: bit-identical to select_blocks on the kernel
    path, ties (integer inputs) and NaN keys included, replicated and sharded."""
    name, args, rule = cases(quick=True)[0]
    nan_case = make_case(7, integer=False, nan_keys=True)
    for args, rule, sharded in ((args, rule, False), (nan_case, (5, 1, 2), True)):
        args = tuple(x.to(kernel_device) for x in args)
        topk, init, local = rule
        want = openmsa.select_blocks(*args, topk=topk, init_blocks=init, local_blocks=local,
                                     block_size=B, max_q_len=max_q_len)
        got = simulate(args, rule, world, sharded=sharded, max_q_len=max_q_len)
        assert torch.equal(got, want), (rule, sharded)


def _run_group(world: int, mode: str):
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(HERE), "src")
    env["PYTHONPATH"] = os.pathsep.join([src, HERE, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "init")
        procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "helpers", "cp_worker.py"),
                                   str(r), str(world), init, mode], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]
        outs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            outs.append(out)
    failed = [(r, o[-3000:]) for r, (p, o) in enumerate(zip(procs, outs)) if p.returncode != 0]
    assert not failed, failed


@pytest.mark.reference
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_group_reference(world):
    """W processes over gloo, select_blocks(cp_group=...) on the reference path, replicated and
    sharded caches (other ranks' pages NaN in each rank's copy, -1 in its table)."""
    if INTERPRET:
        pytest.skip("the interpreter tier runs test_gloo_group_kernels")
    _run_group(world, "reference")


@pytest.mark.interpret
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_group_kernels(world):
    """The same over the Triton kernels (TRITON_INTERPRET=1 on CPU)."""
    if not INTERPRET:
        pytest.skip("multi-process kernel runs need the interpreter (CPU tensors)")
    _run_group(world, "quick")


@pytest.mark.reference
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_group_layer(world):
    """MSAAttention(cp_group=...) at TP W over a sharded index cache (MSAPlanner's
    cp_size): the same output as the layer without CP over a replicated cache, and a rank
    writes index keys only into its own blocks' pages (cp_worker.layer_check)."""
    if INTERPRET:
        pytest.skip("reference ops")
    _run_group(world, "layer")


@pytest.mark.reference
def test_planner_shards_index_slots_and_table():
    from openmsa import MSAPlanner
    cfg = _tiny_config()
    q_lens, seq_lens = [1, 5, 40], [33, 20, 40]
    bs = cfg.block_size
    table = torch.arange(3 * 8, dtype=torch.int32).view(3, 8)
    full = MSAPlanner(cfg, max_requests=4, max_tokens=64, max_blocks=8, device="cpu").plan(
        q_lens, seq_lens, table)
    world = 3
    written = torch.zeros(64 * bs, dtype=torch.int32)
    for r in range(world):
        planner = MSAPlanner(cfg, max_requests=4, max_tokens=64, max_blocks=8, device="cpu",
                             cp_size=world, cp_rank=r)
        meta = planner.plan(q_lens, seq_lens, table)
        assert torch.equal(meta.index_block_table, owned_table(full.index_block_table, world, r))
        assert torch.equal(meta.slot_mapping, full.slot_mapping)
        slots = meta.index_slot_mapping
        pos = meta.positions.long()
        own = (pos >= 0) & (torch.div(pos, bs, rounding_mode="floor") % world == r)
        assert torch.equal(slots, torch.where(own, full.index_slot_mapping,
                                              torch.full_like(slots, -1)))
        written[slots[slots >= 0]] += 1
    # every token's index key is written exactly once across the group
    want = torch.zeros_like(written)
    want[full.index_slot_mapping[full.index_slot_mapping >= 0]] = 1
    assert torch.equal(written, want)


@pytest.mark.reference
def test_layer_refuses_a_table_sharded_for_another_rank():
    """A step planned for a sharded index cache is refused by a layer whose group (here: none)
    differs, by name, instead of selecting from -1 entries; a whole table runs."""
    from openmsa import MSAAttention, MSAPlanner
    cfg = _tiny_config()
    layer = MSAAttention(cfg, 32, dtype=torch.float32, ops="reference")
    table = torch.arange(8, dtype=torch.int32).view(1, 8)
    kv = (torch.zeros(8, B, cfg.num_kv_heads, cfg.head_dim),
          torch.zeros(8, B, cfg.num_kv_heads, cfg.head_dim))
    index_cache = torch.zeros(8, B, cfg.index_head_dim)
    hidden = torch.randn(3, 32)
    sharded = MSAPlanner(cfg, max_requests=1, max_tokens=8, max_blocks=8, device="cpu",
                         cp_size=2, cp_rank=1).plan([3], [3], table)
    with pytest.raises(ValueError, match="cp_size"):
        layer(hidden, sharded, kv, index_cache)
    whole = MSAPlanner(cfg, max_requests=1, max_tokens=8, max_blocks=8, device="cpu").plan(
        [3], [3], table)
    # (the layer's weights are uninitialised: only that the step runs is checked)
    assert layer(hidden, whole, kv, index_cache).shape == hidden.shape


@pytest.mark.reference
@pytest.mark.parametrize("kwargs, kind, name", [
    (dict(cp_size=0), ValueError, "cp_size"),
    (dict(cp_size=True), ValueError, "cp_size"),
    (dict(cp_size=2, cp_rank=2), ValueError, "cp_rank"),
    (dict(cp_size=2, cp_rank=-1), ValueError, "cp_rank"),
])
def test_planner_and_op_cp_arguments_are_checked(kwargs, kind, name):
    """MSAPlanner's cp_size / cp_rank, and the same check (_checks.check_cp_shape)
    of cp.py's cp_size / cp_rank, each error naming its own argument."""
    from openmsa import MSAPlanner
    from openmsa.ops.indexer.reference import local_block_scores
    from helpers.steps import make_step
    with pytest.raises(kind, match=f"^{name} must"):
        MSAPlanner(_tiny_config(), max_requests=1, max_tokens=8, max_blocks=8, device="cpu",
                   **kwargs)
    cp = {k.replace("index_", ""): v for k, v in kwargs.items()}
    step = make_step([1], [5], block_size=B)
    with pytest.raises(kind, match=f"^{name.replace('index_', '')} must"):
        local_block_scores(torch.zeros(1, 1, 16), torch.zeros(step.num_pages, B, 16),
                           step.cu_seqlens_q, step.seq_lens, step.block_table,
                           **{"cp_rank": 0, **cp}, block_size=B)


@pytest.mark.reference
def test_layer_cp_group_is_checked():
    from openmsa import MSAAttention
    with pytest.raises(TypeError, match="cp_group"):
        MSAAttention(_tiny_config(), 32, dtype=torch.float32, ops="reference",
                     cp_group=2)


def _tiny_config():
    from openmsa import MSAConfig
    return MSAConfig(num_heads=4, num_kv_heads=4, head_dim=16, num_index_heads=4,
                     index_head_dim=16, block_size=B, topk_blocks=4, init_blocks=1,
                     local_blocks=1, rotary_dim=16)


@pytest.mark.reference
@pytest.mark.skipif(INTERPRET, reason="compilation needs the real compiler")
@pytest.mark.parametrize("tile_mode", [False, True])
def test_cp_scoring_kernel_compiles(tile_mode):
    from helpers.sm90 import F32, STEP, compile_sm90
    from openmsa.ops.indexer.kernels.scores import _block_scores_kernel
    compile_sm90(_block_scores_kernel, dict(q_ptr="*fp8e4nv", cache_ptr="*fp8e4nv", out_ptr=F32,
                                            **STEP), {},
                 dict(H=4, HP=4, DI=128, DIP=128, BLOCK=128, BPS=32 if tile_mode else 16,
                      SMALL_Q=16, TILE_MODE=tile_mode, ROWS_T=32 if tile_mode else 4,
                      CAST_K=False, IEEE=False, KEYS_AS_ROWS=not tile_mode, MAX_SKIPS_NAN=True,
                      PDL=True, CP=True))


@pytest.mark.reference
@pytest.mark.skipif(INTERPRET, reason="compilation needs the real compiler")
def test_cp_candidate_and_merge_kernels_compile():
    from helpers.sm90 import F32, I32, I64, compile_sm90
    from openmsa.ops.indexer.kernels.cp import _local_keys_kernel, _merge_kernel
    compile_sm90(_local_keys_kernel, dict(scores_ptr=F32, cu_ptr=I32, seq_lens_ptr=I32,
                                          keys_ptr=I64, pos_ptr=I32), {},
                 dict(H=4, BLOCK=128, CHUNK=1024))
    compile_sm90(_merge_kernel, dict(cand_ptr=I64, pos_ptr=I32, out_ptr=I32), {},
                 dict(H=4, BLOCK=128, CP2=128, KP2=16))


def _gpu_case(dtype, num_requests, context, q_len=1, heads=4, dim=128, seed=0):
    """A decode (or verify) step of num_requests requests of `context` tokens on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    bs = 128
    nb = -(-context // bs)
    pages = num_requests * nb
    table = torch.randperm(pages, device="cuda", generator=g).to(torch.int32).view(
        num_requests, nb)
    cu = torch.arange(num_requests + 1, device="cuda", dtype=torch.int32) * q_len
    seq = torch.full((num_requests,), context, device="cuda", dtype=torch.int32)
    seq[0] = context - 777  # one shorter request
    q = torch.randn(num_requests * q_len, heads, dim, device="cuda", generator=g).to(dtype)
    c = torch.randn(pages, bs, dim, device="cuda", generator=g).to(dtype)
    return q, c, cu, seq, table


GPU_DTYPES = [torch.bfloat16, torch.float8_e4m3fn]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_ranks_one_after_another(dtype, q_len):
    """4 requests x 64K tokens: ranks 0..W-1 scored one after another on one GPU, candidates
    stacked by hand and merged: bit-identical to select_blocks (W = 2, 4, 8)."""
    args = _gpu_case(dtype, 4, 65536, q_len=q_len)
    rule = dict(topk=16, init_blocks=1, local_blocks=1, block_size=128)
    want = openmsa.select_blocks(*args, **rule)
    for world in (2, 4, 8):
        for sharded in (False, True):
            keys = []
            for r in range(world):
                tab = owned_table(args[4], world, r) if sharded else args[4]
                k, position = rank_candidates(*args[:4], tab, cp_size=world, cp_rank=r,
                                              **{**rule, "block_size": 128})
                keys.append(k)
            got = merge_candidates_kernel(torch.stack(keys, 2), position, topk=16,
                                          init_blocks=1, local_blocks=1, block_size=128)
            assert torch.equal(got, want), (world, sharded)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_prefill_chunk_ranks(dtype):
    """A prefill chunk (the prefill launch, Triton form under CP) beside decode requests."""
    q, c, cu, seq, table = _gpu_case(dtype, 3, 8192, q_len=1, seed=3)
    # make request 1 a prefill chunk of 600 tokens
    g = torch.Generator(device="cuda").manual_seed(4)
    q_lens = torch.tensor([1, 600, 1], device="cuda", dtype=torch.int32)
    cu = torch.zeros(4, device="cuda", dtype=torch.int32)
    cu[1:] = torch.cumsum(q_lens, 0)
    q = torch.randn(602, q.shape[1], q.shape[2], device="cuda", generator=g).to(dtype)
    rule = dict(topk=16, init_blocks=1, local_blocks=1, block_size=128)
    for max_q_len in (None, 600):
        want = openmsa.select_blocks(q, c, cu, seq, table, **rule, max_q_len=max_q_len)
        for world in (2, 4):
            keys = []
            for r in range(world):
                k, position = rank_candidates(q, c, cu, seq, owned_table(table, world, r),
                                              cp_size=world, cp_rank=r, max_q_len=max_q_len,
                                              **rule)
                keys.append(k)
            got = merge_candidates_kernel(torch.stack(keys, 2), position, topk=16,
                                          init_blocks=1, local_blocks=1, block_size=128)
            # the one-device plan may take the Gluon tile kernel for the prefill rows, the CP
            # ranks the Triton form: the two score bit for bit alike, so every row must match
            assert torch.equal(got[0], want[0]) and torch.equal(got[-1], want[-1])
            mismatch = (got != want).any(-1).sum().item()
            assert mismatch == 0, f"{mismatch} (token, head) rows differ (world {world})"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_graph_replay_of_a_cp_step(dtype):
    """Rank 0..3's scoring + candidates + the merge (the collective replaced by a local stack)
    captured in one CUDA graph, replayed with new lengths: equal to select_blocks."""
    world = 4
    q, c, cu, seq, table = _gpu_case(dtype, 8, 32768, q_len=2)
    rule = dict(topk=16, init_blocks=1, local_blocks=1, block_size=128)
    out = torch.empty(q.shape[0], q.shape[1], 16, dtype=torch.int32, device="cuda")

    def step():
        keys = []
        for r in range(world):
            k, position = rank_candidates(q, c, cu, seq, table, cp_size=world, cp_rank=r,
                                          **rule)
            keys.append(k)
        merge_candidates_kernel(torch.stack(keys, 2), position, topk=16, init_blocks=1,
                                local_blocks=1, block_size=128, out=out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile and plan outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lengths in ([32768] * 8, [100, 5000, 32768, 129, 128, 2, 20000, 7]):
        seq.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = openmsa.select_blocks(q, c, cu, seq, table, **rule)
        assert torch.equal(out, want), lengths
