# SPDX-License-Identifier: Apache-2.0
"""One rank of tests/test_multigpu.py (issue 43):

    python multigpu_worker.py RANK WORLD INIT_FILE BACKEND CHECKS

BACKEND "nccl": this process drives cuda:RANK, the public ops take the kernel path, a step's
selection is captured in a CUDA graph (the NCCL all-gather inside it). BACKEND "gloo": the same
logic on CPU tensors (the reference path, or the Triton interpreter under TRITON_INTERPRET=1),
small shapes, and the "graph" is the step function called again on the same buffers (CPU has no
graphs): that proves the test logic without GPUs. CHECKS is a comma list of
"select", "graph", "layer". Exits non-zero with a message naming every mismatch.

* select: select_blocks(cp_group=...) bit-identical to select_blocks(cp_group=None) in this
  process, on mixed decode/verify/prefill steps with padding tokens, contexts shorter than topk
  blocks, init and local blocks, fp8 and bf16 caches, replicated and sharded index caches
  (sharded: other ranks' pages NaN in this rank's copy, -1 in its table).
* graph: one CP selection captured (CUDA) with static buffers; new seq_lens, block tables,
  queries and cache contents copied into them before each replay; after each, equal to the eager
  select_blocks(cp_group=None) of those inputs. Replicated and sharded.
* layer: MSAAttention at TP W (each rank its heads, the partial o_proj outputs summed with
  torch.distributed.all_reduce, as an engine does) against the TP1 layer with the same weights in
  this process, over a prefill chunk, a decode step and a verify step (and a step mixing
  them); without and with cp_group (a sharded index cache, MSAPlanner(cp_size=W)).
  Weights and inputs are multiples of 1/16 and 1/8, so every projection is exact in fp32
  whatever the GEMM's shape: the index queries and selections are the same at TP1 and TP W and
  only the attention's and the all-reduce's summation order differ (bf16 tolerance on GPU).
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import openmsa  # noqa: E402
from openmsa.ops.indexer.cp import owned_table  # noqa: E402
from helpers.cp_cases import shard  # noqa: E402
from helpers.steps import make_step, random_index_inputs  # noqa: E402

FP8 = torch.float8_e4m3fn


class Setup:
    """Shapes by backend: GPU sizes are realistic (128-token blocks, contexts to 70K, a 600-token
    prefill chunk); CPU sizes are small (16-token blocks) so the reference path is fast."""

    def __init__(self, backend: str, rank: int, world: int):
        self.backend, self.rank, self.world = backend, rank, world
        self.gpu = backend == "nccl"
        self.device = torch.device(f"cuda:{rank}") if self.gpu else torch.device("cpu")
        if self.gpu:
            self.block = 128
            self.heads, self.dim = 4, 128
            # decode at 70K, verify (3), nothing, a prefill chunk (600) after 8400 tokens, a
            # decode shorter than one block, a request without context, verify (16) at 30K, a
            # decode at a block boundary; two padding tokens after them
            self.q_lens = [1, 3, 0, 600, 1, 0, 16, 1]
            self.seq_lens = [70000, 4500, 9, 9000, 100, 0, 30000, 129 * 128]
            self.rules = [(16, 1, 1), (4, 0, 1), (8, 2, 2), (16, 0, 0)]
            self.dtypes = [(torch.bfloat16, torch.bfloat16), (FP8, FP8),
                           (torch.bfloat16, FP8)]
            self.max_q_lens = (None, 600)
        else:
            self.block = 16
            self.heads, self.dim = 4, 32
            self.q_lens = [1, 3, 0, 20, 1, 0, 16]
            self.seq_lens = [70, 45, 9, 100, 5, 0, 200]
            self.rules = [(4, 0, 1), (5, 1, 2), (16, 2, 1)]
            self.dtypes = [(torch.bfloat16, torch.bfloat16), (torch.float16, FP8)]
            self.max_q_lens = (None,)

    def to(self, *xs):
        return tuple(x.to(self.device) for x in xs)


def step_inputs(s: Setup, q_dtype, c_dtype, seed: int):
    step = make_step(s.q_lens, s.seq_lens, block_size=s.block, extra_columns=2, pad_tokens=2,
                     generator=torch.Generator().manual_seed(seed))
    q, c = random_index_inputs(step, num_heads=s.heads, head_dim=s.dim, block_size=s.block,
                               q_dtype=q_dtype, cache_dtype=c_dtype, integer=not s.gpu,
                               generator=torch.Generator().manual_seed(seed + 1))
    return s.to(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table)


def check_select(s: Setup, group) -> list[str]:
    bad = []
    for i, (qd, cd) in enumerate(s.dtypes):
        q, c, cu, seq, table = step_inputs(s, qd, cd, seed=100 + i)
        for topk, init, local in s.rules:
            rule = dict(topk=topk, init_blocks=init, local_blocks=local, block_size=s.block)
            for max_q_len in s.max_q_lens:
                want = openmsa.select_blocks(q, c, cu, seq, table, **rule, max_q_len=max_q_len)
                for sharded in (False, True):
                    cache, tab = shard(c, table, s.world, s.rank) if sharded else (c, table)
                    out = torch.full_like(want, -7)
                    got = openmsa.select_blocks(q, cache, cu, seq, tab, **rule, out=out,
                                                max_q_len=max_q_len, cp_group=group)
                    if got is not out or not torch.equal(got, want):
                        n = int((got != want).any(-1).sum())
                        bad.append(f"select {qd}/{cd} rule={(topk, init, local)} "
                                   f"max_q_len={max_q_len} sharded={sharded}: {n} rows differ")
    return bad


def replay_inputs(s: Setup, q_dtype, c_dtype, seed: int, *, requests, width, pages, q_lens):
    """A decode/verify step of fixed shapes (requests, tokens, table width, pages) and random
    contents: lengths from 0 to the table's reach (shorter than topk blocks included), a fresh
    page permutation, queries and keys. Two padding tokens after the last request."""
    g = torch.Generator().manual_seed(seed)
    reach = width * s.block
    seq = torch.randint(0, reach + 1, (requests,), generator=g)
    seq[0] = reach  # one request at the table's end
    seq[1] = s.block // 2  # one inside its first block
    seq = torch.maximum(seq, torch.tensor(q_lens))  # every token has a causal position
    table = torch.randperm(pages, generator=g)[:requests * width].int().view(requests, width)
    blocks = -(-seq // s.block)
    table[torch.arange(width)[None, :] >= blocks[:, None]] = -1
    cu = torch.zeros(requests + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    tokens = int(cu[-1]) + 2
    if s.gpu:
        q, c = torch.randn(tokens, s.heads, s.dim, generator=g), \
            torch.randn(pages, s.block, s.dim, generator=g)
    else:
        q, c = torch.randint(-2, 3, (tokens, s.heads, s.dim), generator=g).float(), \
            torch.randint(-2, 3, (pages, s.block, s.dim), generator=g).float()
    return s.to(q.to(q_dtype), c.to(c_dtype), cu, seq.int(), table)


def capture(s: Setup, fn):
    """A callable that reruns fn on its buffers: a CUDA graph's replay on GPU (warmed up on a side
    stream, captured thread-locally so NCCL's watchdog may query events meanwhile), fn itself on
    CPU."""
    if not s.gpu:
        fn()
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles, plans and creates the NCCL communicator outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    s._graphs = getattr(s, "_graphs", []) + [graph]  # keep it (and its pool) alive
    return graph.replay


def check_graph(s: Setup, group) -> list[str]:
    bad = []
    requests = 8
    q_lens = [1, 4, 1, 1, 2, 1, 1, 3]
    width = 600 if s.gpu else 13  # 76.8K tokens (GPU) / 208 (CPU) per request at most
    pages = requests * width + 5
    topk, init, local = (16, 1, 1) if s.gpu else (5, 1, 1)
    rule = dict(topk=topk, init_blocks=init, local_blocks=local, block_size=s.block)
    for qd, cd in s.dtypes[:2]:
        for sharded in (False, True):
            kw = dict(requests=requests, width=width, pages=pages, q_lens=q_lens)
            bufs = replay_inputs(s, qd, cd, 7, **kw)  # q, cache, cu, seq, table: static
            q, c, cu, seq, table = bufs
            out = torch.empty(q.shape[0], q.shape[1], topk, dtype=torch.int32, device=s.device)

            def load(new):
                nq, nc, ncu, nseq, ntable = new
                if sharded:
                    nc, ntable = shard(nc, ntable, s.world, s.rank)
                for dst, src in zip(bufs, (nq, nc, ncu, nseq, ntable)):
                    dst.copy_(src)

            def step():
                openmsa.select_blocks(q, c, cu, seq, table, **rule, out=out,
                                      max_q_len=max(q_lens), cp_group=group)

            load(replay_inputs(s, qd, cd, 7, **kw))
            replay = capture(s, step)
            for seed in (11, 12, 13):
                new = replay_inputs(s, qd, cd, seed, **kw)
                want = openmsa.select_blocks(*new, **rule)  # eager, no group
                load(new)
                replay()
                if s.gpu:
                    torch.cuda.synchronize()
                if not torch.equal(out, want):
                    n = int((out != want).any(-1).sum())
                    bad.append(f"graph {qd}/{cd} sharded={sharded} seed={seed}: "
                               f"{n} rows differ")
    return bad


def layer_config(s: Setup):
    if s.gpu:  # M3's head geometry (64 / 4 / 4 heads of 128) with 4 blocks selected
        return openmsa.MSAConfig(topk_blocks=4, init_blocks=1, local_blocks=1)
    return openmsa.MSAConfig(num_heads=8, num_kv_heads=4, head_dim=16, num_index_heads=4,
                             index_head_dim=16, block_size=16, topk_blocks=3, init_blocks=1,
                             local_blocks=1, rotary_dim=16)


LAYER_STEPS_GPU = (([700, 300, 40], [700, 300, 40]),   # prefill chunks from empty caches
                   ([1, 1, 1], [701, 301, 41]),         # decode
                   ([4, 1, 3], [705, 302, 44]),          # verify
                   ([1, 250, 1], [706, 552, 45]))       # decode beside a second prefill chunk
LAYER_STEPS_CPU = (([60, 30, 7], [60, 30, 7]), ([1, 1, 1], [61, 31, 8]),
                   ([4, 1, 3], [65, 32, 11]), ([1, 25, 1], [66, 57, 12]))


def check_layer(s: Setup, group) -> list[str]:
    from openmsa import MSAAttention, MSAPlanner
    from openmsa.model import random_layer_checkpoint
    cfg = layer_config(s)
    hidden_size = 256 if s.gpu else 32
    steps = LAYER_STEPS_GPU if s.gpu else LAYER_STEPS_CPU
    dtype = torch.bfloat16 if s.gpu else torch.float32
    ops = "kernels" if s.gpu else "reference"
    # the all-reduce sums W partial outputs rounded to `dtype`: error relative to the output's
    # scale (bf16: a few ulps of the partials)
    tol = 2e-2 if s.gpu else 1e-5
    index_dtypes = (torch.bfloat16, FP8) if s.gpu else (torch.float32,)
    bs = cfg.block_size
    max_blocks = max(-(-x // bs) for x in steps[-1][1]) + 1
    pages = 3 * max_blocks + 4
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(pages, generator=g)[:3 * max_blocks].int().view(3, max_blocks)
    table = table.to(s.device)
    kw = dict(dtype=dtype, device=s.device, ops=ops)
    probe = MSAAttention(cfg, hidden_size, **kw)
    ckpt = {k: (v * 16).round() / 16 for k, v in random_layer_checkpoint(probe, g).items()}
    hiddens = [(torch.randint(-2, 3, (sum(q), hidden_size), generator=g).float() / 8)
               .to(dtype).to(s.device) for q, _ in steps]
    bad = []
    for idt in index_dtypes:
        for cp in (False, True):
            one = MSAAttention(cfg, hidden_size, **kw)
            tp = MSAAttention(cfg, hidden_size, tp_size=s.world, tp_rank=s.rank, **kw,
                              cp_group=group if cp else None)
            one.load_checkpoint(ckpt)
            tp.load_checkpoint(ckpt)
            plan_kw = dict(max_requests=4, max_tokens=1100, max_blocks=max_blocks,
                           device=s.device)
            p_one = MSAPlanner(cfg, **plan_kw)
            p_tp = MSAPlanner(cfg, **plan_kw, **(dict(cp_size=s.world,
                                                      cp_rank=s.rank) if cp else {}))
            hkv, d = cfg.num_kv_heads, cfg.head_dim
            kv_one = tuple(torch.zeros(pages, bs, hkv, d, dtype=dtype, device=s.device)
                           for _ in range(2))
            kv_tp = tuple(torch.zeros(pages, bs, hkv // s.world, d, dtype=dtype,
                                      device=s.device) for _ in range(2))
            ic_one = torch.zeros(pages, bs, cfg.index_head_dim, dtype=idt, device=s.device)
            ic_tp = ic_one.clone()
            if cp:  # other ranks' pages NaN: this rank never reads nor writes them
                ic_tp = shard(ic_tp, table, s.world, s.rank)[0]
            before = ic_tp.float()
            for i, ((q_lens, seq_lens), hidden) in enumerate(zip(steps, hiddens)):
                want = one(hidden, p_one.plan(q_lens, seq_lens, table), kv_one, ic_one)
                got = tp(hidden, p_tp.plan(q_lens, seq_lens, table), kv_tp, ic_tp)
                dist.all_reduce(got, group=group)  # the engine's all-reduce of o_proj
                err = (got.float() - want.float()).abs().max().item()
                scale = want.float().abs().max().item()
                if not err <= tol * scale or not bool(torch.isfinite(got).all()) \
                        or not scale > 0:
                    bad.append(f"layer index={idt} cp={cp} step={i} (q_lens {q_lens}): "
                               f"max abs error {err:.3g}, output scale {scale:.3g}")
            if cp:  # the sharded cache was written only at this rank's blocks' pages
                mine = torch.zeros(pages, dtype=torch.bool, device=s.device)
                owned = owned_table(table, s.world, s.rank)
                mine[owned[owned >= 0].long()] = True
                after = ic_tp.float()
                changed = (after != before) & ~before.isnan()
                if bool(changed[~mine].any()):
                    bad.append(f"layer index={idt}: a page of another rank was written")
    return bad


CHECKS = {"select": check_select, "graph": check_graph, "layer": check_layer}


def main():
    rank, world, init_file, backend, checks = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                               sys.argv[4], sys.argv[5].split(","))
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kw = dict(device_id=torch.device(f"cuda:{rank}"))
    else:
        torch.set_num_threads(1)
        kw = {}
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, **kw)
    group = dist.new_group(list(range(world)))
    s = Setup(backend, rank, world)
    bad = []
    for name in checks:
        try:
            bad += CHECKS[name](s, group)
        except Exception:  # noqa: BLE001 - reported, and the rank fails
            bad.append(f"{name} raised:\n{traceback.format_exc()}")
        print(f"rank {rank}/{world} {name}: done", flush=True)
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    if bad:
        print(f"rank {rank}/{world} ({backend}): " + "\n".join(bad), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
