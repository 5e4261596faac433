# SPDX-License-Identifier: Apache-2.0
"""The decode step as one launch (openmsa.ops.step's decode_step) against the separate launches
that MSAAttention runs (prepare_and_select, then sparse_attention), in one process, on the same
caches and step: M3 at TP1 (or --model), q_len 1 (or --q-lens), B and context from the grid,
the caches of run.py's layer rows of the same dtype (fp8: fp8 K/V and index keys). Per row:
both sides' outputs compared (the selections bit for bit, the attention output's largest
difference), the graph-replayed call (run.graph_call_us, L2 flushed) and the device time (the
profiler, the two sides' calls interleaved), medians; and the one launch's trace: per phase,
when its first program started and its last ended, its programs' median wait and work
(trace_phases).

    python3 benchmarks/step_ab.py --out step.json              # the grid below
    python3 benchmarks/step_ab.py --batches 1 --contexts 32768 --kv bf16

Writes one JSON row per case (see --out) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402
import shapes  # noqa: E402

import openmsa  # noqa: E402
from openmsa.ops.step import api as step_api  # noqa: E402
from openmsa.ops.step.api import StepConfig, decode_step  # noqa: E402


PHASES = ("prepare", "score", "segments", "select merge", "attend", "attend merge")


def trace_phases(model, k_cache, v_cache, index_cache, meta, qkv, w, config, q_len, runs=20):
    """Where the one launch's time goes: its per-program trace (decode_step's trace=) over
    `runs` eager calls, L2 flushed before each; per phase, medians over the runs of the first
    program's start, the last program's end (µs from the launch's first start), and of the
    programs' median wait and work (µs)."""
    one = _one_launch(model, k_cache, v_cache, index_cache, meta, qkv, w, config, q_len)
    trace = torch.full((1 << 14, 4), -1, dtype=torch.int64, device="cuda")
    phase_ends = _phase_ends(one)
    per_run = []
    for _ in range(runs):
        trace.fill_(-1)
        run.flush_l2()
        one(trace=trace)
        torch.cuda.synchronize()
        rows = trace[(trace[:, 0] >= 0)].cpu().double()
        t0, t1, t2 = rows[:, 0], rows[:, 1], rows[:, 2]
        origin = float(t0.min())
        ends = (0,) + phase_ends + (rows.shape[0],)
        phases = {}
        for name, a, b in zip(PHASES, ends, ends[1:]):
            if b > a:
                phases[name] = dict(programs=b - a,
                                    first_start=(float(t0[a:b].min()) - origin) / 1e3,
                                    last_end=(float(t2[a:b].max()) - origin) / 1e3,
                                    wait=float((t1[a:b] - t0[a:b]).median()) / 1e3,
                                    work=float((t2[a:b] - t1[a:b]).median()) / 1e3)
        phases["launch"] = dict(programs=rows.shape[0], last_end=(float(t2.max()) - origin) / 1e3,
                                sms=int(rows[:, 3].unique().numel()))
        per_run.append(phases)
    return {name: {k: (v if k in ("programs", "sms") else
                       statistics.median(r[name][k] for r in per_run))
                   for k, v in per_run[0][name].items()} for name in per_run[0]}


def _one_launch(model, k_cache, v_cache, index_cache, meta, qkv, w, config, q_len=1):
    t = qkv.shape[0]
    iq = torch.empty(t, model.num_index_heads, model.index_head_dim, dtype=index_cache.dtype,
                     device="cuda")
    out = torch.empty(t, model.num_heads, model.head_dim, dtype=torch.bfloat16, device="cuda")
    result = {}

    def step(trace=None):
        result["r"] = decode_step(qkv, meta.positions, model, *w, k_cache, v_cache,
                                  meta.slot_mapping, index_cache, meta.index_slot_mapping,
                                  meta.cu_seqlens_q, meta.seq_lens, meta.index_block_table,
                                  meta.block_table, max_q_len=q_len, index_q_out=iq, out=out,
                                  step_config=config, trace=trace)
    step.result = result
    return step


def _phase_ends(fn):
    """The phases' ends in ticket order of the one launch that fn runs (its plan's)."""
    seen, plain = [], step_api._run

    def recording(launch, sizes, *args):
        seen.append(sizes["ends"])
        return plain(launch, sizes, *args)
    step_api._run = recording
    try:
        fn()
    finally:
        step_api._run = plain
    return seen[-1]


def case(model_name, model, batch, context, q_len, kv, iters, config, trace=True):
    k_cache, v_cache, index_cache, meta, qkv, w = run._layer_case(model, batch, context, q_len,
                                                                  kv)
    apart, _ = run._layer_fns(model, k_cache, v_cache, index_cache, meta, qkv, w, batch,
                              context, q_len)
    one = _one_launch(model, k_cache, v_cache, index_cache, meta, qkv, w, config, q_len)
    run.warm_capture(apart)
    run.warm_capture(one)
    # (eager calls last: a capture leaves one.result holding the captured call's tensors)
    apart()
    one()
    torch.cuda.synchronize()
    idx_a, out_a = apart.buffers
    _, _, idx_b, out_b = one.result["r"]
    same_idx = torch.equal(idx_a, idx_b)
    # (bit for bit where the attention's own launch runs the one launch's warps; its small-batch
    # form runs 8, so there the output may differ in rounding: the difference is recorded)
    same_out = torch.equal(out_a, out_b)
    out_diff = float((out_a.float() - out_b.float()).abs().max())
    dev = run.interleaved_device_times_us([apart, one], iters)
    row = dict(section="step-ab", model=model_name, batch=batch, context=context,
               q_len=q_len, dtype=kv,
               same_selection=same_idx, same_output=same_out, output_max_diff=out_diff,
               apart_device_us=statistics.median(dev[0]), one_device_us=statistics.median(dev[1]),
               apart_graph_us=run.graph_call_us(apart, iters),
               one_graph_us=run.graph_call_us(one, iters),
               step_config=dataclasses.asdict(config))
    row["one_over_apart_graph"] = row["one_graph_us"] / row["apart_graph_us"]
    row["one_over_apart_device"] = row["one_device_us"] / row["apart_device_us"]
    if trace:
        # (a traced launch is its own build, with the timer reads and the trace's stores)
        row["trace"] = trace_phases(model, k_cache, v_cache, index_cache, meta, qkv, w, config,
                                    q_len)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="m3-tp1", help="a model of benchmarks/shapes.py")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--contexts", default="32768,131072,1048576")
    p.add_argument("--q-lens", default="1", help="tokens a request (4: a verify step)")
    p.add_argument("--kv", default="fp8", choices=("fp8", "bf16"),
                   help="the caches' dtype (run.py's layer rows: K/V and index keys)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warps", type=int, default=StepConfig().num_warps)
    p.add_argument("--stages", type=int, default=StepConfig().num_stages)
    p.add_argument("--sleep-ns", type=int, default=StepConfig().sleep_ns,
                   help="a waiting program's pause between polls (StepConfig.sleep_ns)")
    p.add_argument("--no-trace", action="store_true",
                   help="leave out the one launch's per-phase trace (trace_phases)")
    p.add_argument("--out", default=None, help="JSON file of the rows")
    args = p.parse_args()
    model = shapes.MODELS[args.model]
    q_lens = [int(q) for q in args.q_lens.split(",")]
    config = StepConfig(max_tokens=max(int(b) for b in args.batches.split(",")) * max(q_lens),
                        num_warps=args.warps, num_stages=args.stages,
                        sleep_ns=args.sleep_ns)
    rows = []
    print(f"{'B':>3} {'q':>2} {'context':>8} {'apart graph':>11} {'one graph':>9} {'ratio':>6} "
          f"{'apart dev':>9} {'one dev':>8} same-selection out-diff")
    for b, q in itertools.product((int(x) for x in args.batches.split(",")), q_lens):
        for c in (int(x) for x in args.contexts.split(",")):
            r = case(args.model, model, b, c, q, args.kv, args.iters, config,
                     not args.no_trace)
            rows.append(r)
            print(f"{b:>3} {q:>2} {c:>8} {r['apart_graph_us']:>11.1f} {r['one_graph_us']:>9.1f} "
                  f"{r['one_over_apart_graph']:>6.3f} {r['apart_device_us']:>9.1f} "
                  f"{r['one_device_us']:>8.1f} {r['same_selection']} {r['output_max_diff']:.2e}",
                  flush=True)
            for name, ph in r.get("trace", {}).items():
                print(f"    {name:>12}: {ph['programs']:>4} programs"
                      + (f", start {ph['first_start']:6.2f}" if "first_start" in ph else "")
                      + f", end {ph['last_end']:6.2f} us"
                      + (f", wait {ph['wait']:5.2f}, work {ph['work']:5.2f} (medians)"
                         if "wait" in ph else f", {ph['sms']} SMs"), flush=True)
            torch.cuda.empty_cache()
            # (after every row: a call cut short by its time limit keeps the rows it measured)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"provenance": run.provenance(), "command": " ".join(sys.argv),
                               "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
