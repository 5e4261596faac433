# SPDX-License-Identifier: Apache-2.0
"""Does launching the indexer's decode scoring launch as a programmatic dependent (the CUDA launch
attribute alone, no griddepcontrol.wait in the kernel) change its time? Issue 57's PDL attempt
(docs/history/tried.md, "Issue 57") found the scoring launch 2.6-3.2 µs slower from 128K even in
eager calls, where the host launches it after the kernel before it has finished. This times
select_blocks' launches as planned against the same plan with `launch_pdl` on the scoring launch,
interleaved in one profiled loop (device time, L2 flushed before each call), checking that the
two select the same blocks, and prints each variant's per-kernel times.

    python3 benchmarks/pdl_probe.py [--contexts 32768,131072,524288,1048576] [--batch 1]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

from openmsa.ops.common.plan import DeviceFacts, Launch, LaunchPlan  # noqa: E402
from openmsa.ops.indexer import api  # noqa: E402
from openmsa.ops.indexer.plan import plan as indexer_plan  # noqa: E402


def with_pdl(p: LaunchPlan) -> LaunchPlan:
    """The plan with its decode scoring launch launched as a programmatic dependent."""
    return LaunchPlan([Launch(x.kernel, x.grid, {**x.params, "launch_pdl": True})
                       if x.kernel == "scores_decode" else x for x in p], p.sizes)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="32768,131072,524288,1048576")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    print(run.provenance(), flush=True)
    for context in (int(c) for c in args.contexts.split(",")):
        q, cache, cu, seq, table = run._index_step(args.batch, context, 1, 4, run.FP8)
        shape = api._shape(q, cache, seq, table, 128, 1, 16, 0, 1)
        base = indexer_plan(shape, DeviceFacts.of(q.device))
        outs, fns = [], []
        for pl in (base, with_pdl(base)):
            out = torch.empty(q.shape[0], 4, 16, dtype=torch.int32, device="cuda")
            scores = torch.empty(q.shape[0], 4, table.shape[1], dtype=torch.float32,
                                 device="cuda")

            def fn(pl=pl, out=out, scores=scores):
                api._run_scores(pl, q, cache, cu, seq, table, scores)
                api._run_selection(pl, scores, cu, seq, out)
            fn()
            outs.append(out)
            fns.append(fn)
        torch.cuda.synchronize()
        same = bool(torch.equal(*outs))
        times = run.interleaved_device_times_us(fns, args.iters)
        parts = [run.kernel_breakdown_us(f, args.iters) for f in fns]
        calls = [run.graph_call_us(f, args.iters) for f in fns]
        print(f"L={context} B={args.batch} same={same} | device µs plain {run.med(times[0]):.2f} "
              f"pdl {run.med(times[1]):.2f} | graph µs plain {calls[0]:.2f} pdl {calls[1]:.2f}",
              flush=True)
        for name, part in zip(("plain", "pdl"), parts):
            print(f"  {name}: " + ", ".join(f"{run._short(k)} {v:.2f}" for k, v in part.items()),
                  flush=True)


if __name__ == "__main__":
    main()
