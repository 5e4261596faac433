# SPDX-License-Identifier: Apache-2.0
"""Context-parallel selection across GPUs (issue 43): one process per GPU over NCCL, per rank:

* today: the replicated per-rank selection (select_blocks without a group: the whole cache, this
  rank's H / W index heads, one head at TP4);
* cp-local: this rank's share without the collective (its scan of the blocks b % W == rank for
  every head, its top-k candidates, the merge of W candidate lists stacked locally);
* cp: select_blocks(cp_group=...) itself (scan + candidates + NCCL all-gather + merge);
* coll: the collective alone (all_gather_into_tensor of T * H * topk int64 keys per rank).

Each is timed as device time (profiler: the union of the call's kernels, L2 flushed before each
call, median) and as call time from CUDA events around back-to-back calls, eager and as a CUDA
graph replay (the NCCL all-gather captured in the graph), median of 5 batches, every batch
started after a barrier. Rank 0 gathers every rank's rows, writes --out/cp_multigpu.json and
prints a table with the collective's measured share of the CP step (the slowest rank's
figures). Every CP selection is checked bit-identical to select_blocks over the whole cache.

    python3 benchmarks/cp_multigpu.py --world 4 [--quick] [--iters 20] [--out DIR]
    torchrun --nproc-per-node 4 benchmarks/cp_multigpu.py [--out DIR]
    python3 benchmarks/cp_multigpu.py --world 2 --cpu   # smoke run: gloo, tiny shapes, CPU

--world W spawns W processes of this script (rank r on cuda:r, a free localhost port); under
torchrun (RANK set) the script is one rank. Shapes: B = 32 requests at 128K and 1M tokens
(B * L >= 4M), fp8 and bf16 index keys, M3's 4 index heads of 128, 128-token blocks, top-16.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import openmsa  # noqa: E402
from openmsa.ops.indexer.api import merge_candidates_kernel, rank_candidates  # noqa: E402
from openmsa.ops.indexer.cp import (exchange_candidates, merge_candidates,  # noqa: E402
                                    owned_table)

K = 1024
HEADS, DIM, BLOCK = 4, 128, 128
RULE = dict(topk=16, init_blocks=0, local_blocks=1, block_size=BLOCK)
DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, argv: list[str]) -> int:
    """world copies of this script as ranks 0..world-1 (env:// rendezvous on a free port)."""
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world)]
    failed_at = None
    while any(p.poll() is None for p in procs):
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 60:
            for p in procs:  # a rank died: the others would wait in a collective forever
                if p.poll() is None:
                    p.kill()
        time.sleep(0.5)
    return max((p.returncode for p in procs), key=abs)


def index_step(batch, context, dtype, device, seed=0):
    """A decode step: batch requests of `context` tokens, pages scattered; the same on every
    rank (seeded generator); the cache filled in slices (no full-size fp32 temporary)."""
    nb = -(-context // BLOCK)
    pages = batch * nb
    g = torch.Generator(device=device).manual_seed(seed)
    cache = torch.empty(pages, BLOCK, DIM, dtype=dtype, device=device)
    flat = cache.view(pages, -1)
    for i in range(0, pages, 4096):
        flat[i:i + 4096] = torch.randn(flat[i:i + 4096].shape, device=device,
                                       generator=g).to(dtype)
    table = torch.randperm(pages, device=device, generator=g).int().view(batch, nb)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seq = torch.full((batch,), context, dtype=torch.int32, device=device)
    seq[0] = context - 777  # one shorter request
    q = torch.randn(batch, HEADS, DIM, device=device, generator=g).to(dtype)
    return q, cache, cu, seq, table


class Timer:
    def __init__(self, gpu: bool, iters: int, group):
        self.gpu, self.iters, self.group = gpu, iters, group
        self._graphs = []
        if gpu:
            import run as bench  # benchmarks/run.py: profiler timing with L2 flushes
            self.bench = bench

    def device_us(self, fn) -> float:
        """Median device time of a call (CPU: median wall time)."""
        dist.barrier(group=self.group)
        if self.gpu:
            return statistics.median(self.bench.device_times_us(fn, self.iters))
        ts = []
        for _ in range(self.iters):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e6)
        return statistics.median(ts)

    def _batches(self, run) -> float:
        """Per-call time of `iters` back-to-back calls, median of 5 batches, each after a
        barrier (so the ranks start together, as in a serving step)."""
        out = []
        for _ in range(6):
            dist.barrier(group=self.group)
            if self.gpu:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(self.iters):
                    run()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) * 1e3 / self.iters)
            else:
                t = time.perf_counter()
                for _ in range(self.iters):
                    run()
                out.append((time.perf_counter() - t) * 1e6 / self.iters)
        return statistics.median(out[1:])  # the first batch warms up

    def eager_call_us(self, fn) -> float:
        return self._batches(fn)

    def graph_call_us(self, fn) -> float | None:
        """Per-replay time of fn captured in a CUDA graph (None on CPU)."""
        if not self.gpu:
            return None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        dist.barrier(group=self.group)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
        self._graphs.append(graph)
        return self._batches(graph.replay)


def safe(f, *args):
    """A measurement, or the error's text (one failing measurement must not lose the rest)."""
    try:
        return f(*args)
    except Exception as e:  # noqa: BLE001
        return f"error: {type(e).__name__}: {e}"[:300]


def measure(args, timer, group, rank, world, device, dname, batch, context):
    gpu = device.type == "cuda"
    q, cache, cu, seq, table = index_step(batch, context, DTYPES[dname], device)
    heads_per_rank = HEADS // world if HEADS % world == 0 and world <= HEADS else 1
    lo = (rank * heads_per_rank) % HEADS
    q_rank = q[:, lo:lo + heads_per_rank].contiguous()
    out_rank = torch.empty(batch, heads_per_rank, RULE["topk"], dtype=torch.int32,
                           device=device)
    out = torch.empty(batch, HEADS, RULE["topk"], dtype=torch.int32, device=device)
    mine = owned_table(table, world, rank)  # a sharded cache's table: only this rank's blocks

    def today():
        openmsa.select_blocks(q_rank, cache, cu, seq, table, **RULE, out=out_rank)

    def cp():
        openmsa.select_blocks(q, cache, cu, seq, mine, **RULE, out=out, cp_group=group)

    keys, position = rank_candidates(q, cache, cu, seq, mine, cp_size=world, cp_rank=rank,
                                     **RULE)
    stacked = torch.stack([keys] * world, 2)  # the all-gather's [T, H, W, k] shape, locally
    merge_rule = dict(RULE, out=torch.empty_like(out))

    def cp_local():
        k, pos = rank_candidates(q, cache, cu, seq, mine, cp_size=world, cp_rank=rank, **RULE)
        if gpu:
            merge_candidates_kernel(stacked, pos, **merge_rule)
        else:
            merge_candidates(stacked.reshape(batch, HEADS, -1), pos, **merge_rule)

    def coll():
        exchange_candidates(keys, group)

    cp()
    want = openmsa.select_blocks(q, cache, cu, seq, table, **RULE)
    exact = bool(torch.equal(out, want))
    row = dict(dtype=dname, B=batch, L=context, W=world, rank=rank, H=HEADS,
               heads_today=heads_per_rank, exact=exact,
               collective_bytes_per_rank=keys.numel() * keys.element_size())
    for name, fn in (("today", today), ("cp_local", cp_local), ("cp", cp), ("coll", coll)):
        row[f"{name}_device_us"] = safe(timer.device_us, fn)
        row[f"{name}_eager_us"] = safe(timer.eager_call_us, fn)
        row[f"{name}_graph_us"] = safe(timer.graph_call_us, fn)
    return row


def cases(args, gpu):
    if not gpu:
        return [(d, 2, 4 * K) for d in ("bf16", "fp8")]
    sizes = [(32, 128 * K)] if args.quick else [(32, 128 * K), (32, 1024 * K)]
    return [(d, b, L) for d in ("fp8", "bf16") for b, L in sizes]


def _num(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def summarise(rows):
    """Per case: the slowest rank's figures, the collective's share of the CP step."""
    out = []
    keyset = sorted({(r["dtype"], r["B"], r["L"], r["W"]) for r in rows},
                    key=lambda k: (k[3], k[0], k[2]))
    for key in keyset:
        rs = [r for r in rows if (r["dtype"], r["B"], r["L"], r["W"]) == key]
        s = dict(zip(("dtype", "B", "L", "W"), key), exact=all(r["exact"] for r in rs))
        for field in [f for f in rs[0] if f.endswith("_us")]:
            vals = [_num(r[field]) for r in rs]
            s[field] = max(vals) if all(v is not None for v in vals) else None
        for mode in ("device", "eager", "graph"):
            c, t, cp = s.get(f"coll_{mode}_us"), s.get(f"today_{mode}_us"), s.get(f"cp_{mode}_us")
            s[f"coll_share_{mode}"] = c / cp if c is not None and cp else None
            s[f"ratio_{mode}"] = cp / t if cp is not None and t else None
        out.append(s)
    return out


def fmt(x, width=8, digits=1):
    return f"{x:{width}.{digits}f}" if isinstance(x, (int, float)) else f"{'-':>{width}}"


def print_table(summary):
    print("\nCP selection over W ranks (slowest rank, µs): today = replicated per-rank select "
          "(H/W heads, whole cache); cp = scan + candidates + all-gather + merge; coll = the "
          "all-gather alone; share = coll / cp; ratio = cp / today")
    print(f"{'dtype':5} {'B':>3} {'L':>8} {'W':>2} | {'today':>8} {'cp-local':>8} {'cp':>8} "
          f"{'coll':>8} {'share':>6} {'ratio':>6} | {'cp eager':>8} {'coll':>8} | "
          f"{'cp graph':>8} {'coll':>8} {'share':>6} {'ratio':>6} | exact")
    for s in summary:
        print(f"{s['dtype']:5} {s['B']:3d} {s['L']:8d} {s['W']:2d} | "
              f"{fmt(s.get('today_device_us'))} {fmt(s.get('cp_local_device_us'))} "
              f"{fmt(s.get('cp_device_us'))} {fmt(s.get('coll_device_us'))} "
              f"{fmt(s.get('coll_share_device'), 6, 3)} {fmt(s.get('ratio_device'), 6, 3)} | "
              f"{fmt(s.get('cp_eager_us'))} {fmt(s.get('coll_eager_us'))} | "
              f"{fmt(s.get('cp_graph_us'))} {fmt(s.get('coll_graph_us'))} "
              f"{fmt(s.get('coll_share_graph'), 6, 3)} {fmt(s.get('ratio_graph'), 6, 3)} | "
              f"{s['exact']}")


def worker(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpu = not args.cpu
    if gpu:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device(f"cuda:{local}")
        dist.init_process_group("nccl", device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    group = dist.new_group(list(range(world)))
    timer = Timer(gpu, args.iters, group)
    rows = []
    for dname, batch, context in cases(args, gpu):
        row = measure(args, timer, group, rank, world, device, dname, batch, context)
        rows.append(row)
        timer._graphs.clear()  # their pools, before the next case's cache
        if gpu:
            torch.cuda.empty_cache()
        if rank == 0:
            print(f"done: {dname} B={batch} L={context} W={world}", flush=True)
    everything = [None] * world
    dist.all_gather_object(everything, rows)
    if rank == 0:
        allrows = [r for rs in everything for r in rs]
        summary = summarise(allrows)
        os.makedirs(args.out, exist_ok=True)
        info = dict(world=world, backend="nccl" if gpu else "gloo", iters=args.iters,
                    torch=torch.__version__, revision=os.environ.get("OPENMSA_REVISION"),
                    device=torch.cuda.get_device_name(device) if gpu else "cpu")
        path = os.path.join(args.out, f"cp_multigpu-w{world}.json")
        with open(path, "w") as f:
            json.dump(dict(info=info, summary=summary, rows=allrows), f, indent=1)
        print_table(summary)
        print(f"wrote {path}")
    dist.barrier(group=group)
    dist.destroy_process_group()
    return 0 if all(r["exact"] for rs in everything for r in rs) else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=None,
                   help="spawn this many ranks (default: every visible GPU; 2 with --cpu); "
                        "ignored under torchrun")
    p.add_argument("--quick", action="store_true", help="128K only")
    p.add_argument("--cpu", action="store_true", help="smoke run over gloo on CPU, tiny shapes")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if "RANK" in os.environ:
        return worker(args)
    world = args.world or (2 if args.cpu else torch.cuda.device_count())
    if world < 1 or (not args.cpu and world > torch.cuda.device_count()):
        print(f"--world {world}: {torch.cuda.device_count()} CUDA GPUs visible", file=sys.stderr)
        return 2
    argv = [a for a in sys.argv[1:]]
    return launch(world, argv)


if __name__ == "__main__":
    sys.exit(main())
