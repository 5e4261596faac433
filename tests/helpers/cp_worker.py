# SPDX-License-Identifier: Apache-2.0
"""One rank of tests/test_cp.py's multi-process runs (gloo on CPU):

    python cp_worker.py RANK WORLD INIT_FILE MODE

joins the group, runs select_blocks(cp_group=...) on every case of cp_cases (MODE "reference"
or "quick": the interpreter's shorter list), replicated and sharded, and exits non-zero unless
each result is bit-identical to select_blocks without a group in this process."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import openmsa  # noqa: E402
from helpers.cp_cases import B, cases, shard  # noqa: E402


def layer_check(group, rank, world):
    """MSAAttention(tp_size=W, cp_group=group) with a sharded index cache planned by
    MSAPlanner(cp_size=W) against the same rank's layer without CP over a replicated
    cache, over three steps (prefill chunk + decode, then verify): equal outputs, and each
    token's index key written by exactly one rank. Values are multiples of 1/8 with small
    sums, so every projection is exact in fp32 whatever the GEMM's shape."""
    from openmsa import MSAAttention, MSAConfig, MSAPlanner
    from openmsa.model import random_layer_checkpoint
    cfg = MSAConfig(num_heads=4, num_kv_heads=4, head_dim=16, num_index_heads=4,
                    index_head_dim=16, block_size=B, topk_blocks=3, init_blocks=1,
                    local_blocks=1, rotary_dim=16)
    hidden_size, pages, max_blocks = 32, 40, 12
    kw = dict(tp_size=world, tp_rank=rank, dtype=torch.float32, ops="reference")
    plain = MSAAttention(cfg, hidden_size, **kw)
    cp = MSAAttention(cfg, hidden_size, **kw, cp_group=group)
    g = torch.Generator().manual_seed(0)
    ckpt = {k: (v * 8).round() / 8 for k, v in random_layer_checkpoint(plain, g).items()}
    plain.load_checkpoint(ckpt)
    cp.load_checkpoint(ckpt)
    planners = [MSAPlanner(cfg, max_requests=4, max_tokens=64, max_blocks=max_blocks,
                           device="cpu", **extra)
                for extra in ({}, dict(cp_size=world, cp_rank=rank))]
    k_cache = torch.randn(pages, B, cfg.num_kv_heads // world, 16, generator=g)
    kvs = [(k_cache.clone(), k_cache.clone() * 0.5) for _ in range(2)]
    index = torch.randn(pages, B, 16, generator=g)
    table = torch.randperm(pages, generator=g)[:3 * max_blocks].int().view(3, max_blocks)
    # the replicated cache, and this rank's sharded one: other ranks' blocks NaN (never read)
    caches = [index.clone(), shard(index, table, world, rank)[0]]
    before = [c.clone() for c in caches]
    ok = True
    for q_lens, seq_lens in (([20, 1, 1], [20, 100, 60]), ([1, 3, 1], [21, 103, 61]),
                             ([4, 1, 0], [25, 104, 61])):
        hidden = torch.randint(-2, 3, (sum(q_lens), hidden_size), generator=g).float() / 8
        outs = []
        for layer, planner, kv_, ic in zip((plain, cp), planners, kvs, caches):
            meta = planner.plan(q_lens, seq_lens, table)
            outs.append(layer(hidden, meta, kv_, ic))
        ok &= torch.equal(outs[0], outs[1])
    # the sharded cache changed only at this rank's blocks' pages
    changed = (caches[1] != before[1]) & ~before[1].isnan()
    owned = table[:, rank::world]
    other = torch.ones(pages, dtype=torch.bool)
    other[owned.flatten().long()] = False
    ok &= not bool(changed[other].any())
    return ok


def main():
    rank, world, init_file, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    group = dist.new_group(list(range(world)))
    bad = []
    if mode == "layer":
        if not layer_check(group, rank, world):
            bad.append("layer")
    for name, args, (topk, init, local) in ([] if mode == "layer" else
                                            cases(quick=mode == "quick")):
        q, c, cu, seq, table = args
        rule = dict(topk=topk, init_blocks=init, local_blocks=local, block_size=B)
        want = openmsa.select_blocks(*args, **rule)
        for sharded in (False, True):
            cache, tab = shard(c, table, world, rank) if sharded else (c, table)
            out = torch.full_like(want, -7)
            got = openmsa.select_blocks(q, cache, cu, seq, tab, **rule, cp_group=group, out=out)
            if got is not out or not torch.equal(got, want):
                bad.append(f"{name} sharded={sharded}")
    dist.barrier()
    dist.destroy_process_group()
    if bad:
        print(f"rank {rank}/{world}: mismatch in " + "; ".join(bad), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
