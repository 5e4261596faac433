# SPDX-License-Identifier: Apache-2.0
"""Context-parallel selection on one GPU (issue 42): the per-rank device time of rank 0's share
of a group of W ranks (its scan of the blocks b % W == 0 for every index head, its local top-k
candidates, and the merge of W * topk candidates per (token, head)) against today's replicated
per-rank selection (select_blocks without a group: the whole scan, for the rank's index heads),
plus a cost model of the collective and the sparse layer's decode estimate at TP4.

    python benchmarks/cp.py [--quick] [--iters N] [--out DIR]

Times are medians of per-call device time (run.py's profiler timing, L2 flushed before each
call). The collective cannot run on one GPU: its cost is a model, stated in the output:
    t_collective = NCCL_LATENCY_US + W * bytes / NVLINK_GBPS, bytes = T * H * topk * 8 per rank
with NCCL_LATENCY_US = 25 (an assumption: NCCL's small-message all-gather latency over NVLink
within one H200 node is commonly 20-30 us, unmeasured here) and 150 GB/s of effective bus
bandwidth (irrelevant at these sizes: 16 KB per rank at B = 32).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as bench  # noqa: E402
import shapes  # noqa: E402

import openmsa  # noqa: E402
from openmsa.ops.indexer.api import merge_candidates_kernel, rank_candidates  # noqa: E402
from openmsa.ops.indexer.cp import owned_table  # noqa: E402

K = 1024
NCCL_LATENCY_US = 25.0
NVLINK_GBPS = 150.0
M3 = shapes.M3


def collective_us(tokens, heads, topk, world):
    per_rank = tokens * heads * topk * 8
    return NCCL_LATENCY_US + world * per_rank / (NVLINK_GBPS * 1e3), per_rank


def index_step(batch, context, heads, dtype, q_len=1, seed=0):
    """A decode step: batch requests of `context` tokens, pages scattered, the cache filled in
    slices (no full-size fp32 temporary)."""
    bs, di = M3.block_size, M3.index_head_dim
    nb = -(-context // bs)
    pages = batch * nb
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.empty(pages, bs, di, dtype=dtype, device="cuda")
    flat = cache.view(pages, -1)
    for i in range(0, pages, 4096):
        flat[i:i + 4096] = torch.randn(flat[i:i + 4096].shape, device="cuda",
                                       generator=g).to(dtype)
    table = torch.randperm(pages, device="cuda", generator=g).int().view(batch, nb)
    cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device="cuda")
    seq = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * q_len, heads, di, device="cuda", generator=g).to(dtype)
    return q, cache, cu, seq, table


def rule():
    return dict(topk=M3.topk_blocks, init_blocks=M3.init_blocks, local_blocks=M3.local_blocks,
                block_size=M3.block_size)


def cp_fns(q, cache, cu, seq, table, world):
    """(rank 0's scan + candidates, the merge, both) as callables, and a check that the merge
    of every rank's candidates equals select_blocks over the whole cache."""
    r = rule()
    tables = [owned_table(table, world, k) for k in range(world)]
    keys = [rank_candidates(q, cache, cu, seq, tables[k], cp_size=world, cp_rank=k, **r)
            for k in range(world)]
    position = keys[0][1]
    cand = torch.stack([k for k, _ in keys], 2)  # [T, H, W, k]: the all-gather's view
    out = torch.empty(q.shape[0], q.shape[1], r["topk"], dtype=torch.int32, device="cuda")
    merge_rule = dict(topk=r["topk"], init_blocks=r["init_blocks"],
                      local_blocks=r["local_blocks"], block_size=r["block_size"], out=out)
    merged = merge_candidates_kernel(cand, position, **merge_rule)
    want = openmsa.select_blocks(q, cache, cu, seq, table, **r)
    exact = bool(torch.equal(merged, want))

    def scan():
        rank_candidates(q, cache, cu, seq, tables[0], cp_size=world, cp_rank=0, **r)

    def merge():
        merge_candidates_kernel(cand, position, **merge_rule)

    def both():
        k, pos = rank_candidates(q, cache, cu, seq, tables[0], cp_size=world, cp_rank=0, **r)
        merge_candidates_kernel(cand, pos, **merge_rule)
    return scan, merge, both, exact


def scan_rows(args):
    rows = []
    cases = [(32, 128 * K), (32, 1024 * K)] if not args.quick else [(32, 128 * K)]
    for dname in ("fp8", "bf16"):
        dtype = bench.DTYPES[dname]
        for batch, context in cases:
            q, cache, cu, seq, table = index_step(batch, context, M3.num_index_heads, dtype)
            r = rule()
            out = torch.empty(q.shape[0], q.shape[1], r["topk"], dtype=torch.int32,
                              device="cuda")
            # today, per rank at TP4 and TP8: the whole scan for the rank's one index head
            q1 = q[:, :1].contiguous()
            out1 = out[:, :1].contiguous()
            today = bench.med(bench.device_times_us(
                lambda: openmsa.select_blocks(q1, cache, cu, seq, table, **r, out=out1),
                args.iters))
            # and at TP1: the whole scan for all four heads
            today_all = bench.med(bench.device_times_us(
                lambda: openmsa.select_blocks(q, cache, cu, seq, table, **r, out=out),
                args.iters))
            for world in (4, 8):
                scan, merge, both, exact = cp_fns(q, cache, cu, seq, table, world)
                times = bench.interleaved_device_times_us([scan, merge, both], args.iters)
                t_scan, t_merge, t_both = (bench.med(x) for x in times)
                t_coll, nbytes = collective_us(q.shape[0], q.shape[1], r["topk"], world)
                row = dict(section="cp-select", dtype=dname, B=batch, L=context, W=world,
                           H=q.shape[1], exact=exact, today_1head_us=today,
                           today_4heads_us=today_all, cp_scan_us=t_scan, cp_merge_us=t_merge,
                           cp_us=t_both, ratio=t_both / today,
                           target=0.3 if world == 4 else 0.17,
                           collective_bytes_per_rank=nbytes, collective_model_us=t_coll,
                           ratio_with_collective=(t_both + t_coll) / today)
                bench.record(**row)
                rows.append(row)
            q = cache = table = out = out1 = q1 = None  # free before the next case
            torch.cuda.empty_cache()
    return rows


def layer_estimate(args):
    """The sparse layer's decode at 1M tokens, B = 32, TP4 (one rank): today's layer time with
    its selection replaced by the CP share (scan + candidates + merge at W = 4, every head) and
    the collective's model, against dense bf16 attention at TP4. Not counted: fused_prepare's
    three more index-query heads per token (a few hundred bytes each) and their GEMM rows."""
    rows = []
    batch, context = (32, 1024 * K) if not args.quick else (8, 128 * K)
    model = M3.shard(4)
    dense_cache = {}
    for dname in ("bf16", "fp8"):
        case = bench._layer_case(model, batch, context, 1, dname)
        sparse, dense = bench._layer_fns(model, *case, batch, context, 1)
        layer_us = bench.med(bench.device_times_us(sparse, args.iters))
        if dense is not None:
            dense_cache["dense"] = bench.med(bench.device_times_us(dense, args.iters))
        index_cache, meta = case[2], case[3]
        r = rule()
        iq = torch.randn(batch, 1, M3.index_head_dim, device="cuda").to(index_cache.dtype)
        out1 = torch.empty(batch, 1, r["topk"], dtype=torch.int32, device="cuda")
        select_us = bench.med(bench.device_times_us(
            lambda: openmsa.select_blocks(iq, index_cache, meta.cu_seqlens_q, meta.seq_lens,
                                          meta.index_block_table, **r, out=out1), args.iters))
        sparse = dense = case = index_cache = meta = None
        torch.cuda.empty_cache()
        q, cache, cu, seq, table = index_step(batch, context, M3.num_index_heads,
                                              bench.DTYPES[dname])
        _, _, both, exact = cp_fns(q, cache, cu, seq, table, 4)
        cp_us = bench.med(bench.device_times_us(both, args.iters))
        t_coll, _ = collective_us(batch, M3.num_index_heads, r["topk"], 4)
        estimate = layer_us - select_us + cp_us + t_coll
        row = dict(section="cp-layer-estimate", dtype=dname, B=batch, L=context, tp=4,
                   exact=exact, layer_today_us=layer_us, select_today_us=select_us,
                   cp_us=cp_us, collective_model_us=t_coll, layer_cp_us=estimate,
                   dense_bf16_us=dense_cache.get("dense"))
        if dense_cache.get("dense"):
            row["speedup_today"] = dense_cache["dense"] / layer_us
            row["speedup_cp"] = dense_cache["dense"] / estimate
        bench.record(**row)
        rows.append(row)
        q = cache = table = both = None
        torch.cuda.empty_cache()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one small case per section")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--no-layer", action="store_true", help="skip the layer estimate")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = scan_rows(args)
    if not args.no_layer:
        rows += layer_estimate(args)
    with open(os.path.join(args.out, "cp.json"), "w") as f:
        json.dump({"provenance": bench.provenance(),
                   "assumptions": dict(nccl_latency_us=NCCL_LATENCY_US,
                                       nvlink_gbps=NVLINK_GBPS),
                   "rows": rows}, f, indent=1)
    print("\nper-rank device time, rank 0 of W (scan + candidates + merge) vs today's per-rank "
          "select (1 head, whole cache)")
    print(f"{'dtype':5} {'B':>3} {'L':>8} {'W':>2} {'today':>9} {'cp':>9} {'ratio':>6} "
          f"{'target':>6} {'+coll':>6} exact")
    for r in rows:
        if r["section"] == "cp-select":
            print(f"{r['dtype']:5} {r['B']:3d} {r['L']:8d} {r['W']:2d} {r['today_1head_us']:9.1f} "
                  f"{r['cp_us']:9.1f} {r['ratio']:6.3f} {r['target']:6.2f} "
                  f"{r['ratio_with_collective']:6.3f} {r['exact']}")
    for r in rows:
        if r["section"] == "cp-layer-estimate":
            print(f"layer TP4 {r['dtype']} B={r['B']} L={r['L']}: today {r['layer_today_us']:.1f} "
                  f"us, with CP {r['layer_cp_us']:.1f} us (collective model "
                  f"{r['collective_model_us']:.1f} us); dense bf16 {r.get('dense_bf16_us')} us; "
                  f"speedup today {r.get('speedup_today')}, with CP {r.get('speedup_cp')}")


if __name__ == "__main__":
    main()
