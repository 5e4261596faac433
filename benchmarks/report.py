# SPDX-License-Identifier: Apache-2.0
"""Turn benchmarks/run.py's bench.json into the markdown tables of docs/performance.md.

    python benchmarks/report.py path/to/bench.json [--ceilings copy_tbs,bf16,fp8]
"""

import argparse
import json
import math


def _gather(r):
    """The per-token form's memory roof (run.py's gather_roof_us) and its read rate."""
    if r.get("gather_us") is None:
        return "-"
    return f"{r['gather_us']:.0f} ({r['gather_tbs']:.2f})"


def _f(v, digits=1):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _k(n):
    return f"{n // 1024}K" if n < 1 << 20 else f"{n >> 20}M"


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _ratio_summary(rows):
    """Per model: geomean, worst and best of ours/FlashInfer, and how many shapes are <= 1."""
    for m in dict.fromkeys(r["model"] for r in rows):
        sub = [r["ratio"] for r in rows if r["model"] == m and r.get("ratio")]
        if sub:
            print(f"\ngeomean ours/FlashInfer device time, {m}: {geomean(sub):.3f} over "
                  f"{len(sub)} shapes; worst {max(sub):.2f}, best {min(sub):.2f}; "
                  f"<= 1.00 on {sum(x <= 1.0 for x in sub)}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("bench")
    p.add_argument("--ceilings", default=None, help="copy TB/s,bf16 TFLOP/s,fp8 TFLOP/s")
    args = p.parse_args()
    data = json.load(open(args.bench))
    rows = data["rows"]
    copy = bf16 = fp8 = None
    if args.ceilings:
        copy, bf16, fp8 = (float(x) for x in args.ceilings.split(","))
    print(data["provenance"])
    print()
    dec = [r for r in rows if r["section"] == "indexer-decode"]
    if dec:
        print("| model | dtype | L | B | q_len | ours µs | graph call µs | TB/s | % copy | "
              "FlashInfer µs | FI eager call µs | ours/FI | same rows |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in dec:
            pct = 100 * r["tbs"] / copy if copy else None
            print(f"| {r['model']} | {r['dtype']} | {_k(r['L'])} | {r['B']} | {r['q_len']} | "
                  f"{_f(r['us'])} | {_f(r['call_us'])} | {_f(r['tbs'], 2)} | {_f(pct, 0)} | "
                  f"{_f(r.get('fi_us'))} | {_f(r.get('fi_call_us'), 0)} | "
                  f"{_f(r.get('ratio'), 2)} | {_f(r.get('same_rows'), 3)} |")
        _ratio_summary(dec)
        print()
    pre = [r for r in rows if r["section"] == "indexer-prefill"]
    if pre:
        print("| dtype | context | T | ours µs | TFLOP/s | % matmul ceiling | FlashInfer µs | "
              "FI TFLOP/s | ours/FI TFLOP/s | same rows |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in pre:
            ceil = fp8 if r["dtype"] == "fp8" else bf16
            pct = 100 * r["tflops"] / ceil if ceil else None
            rel = r["tflops"] / r["fi_tflops"] if r.get("fi_tflops") else None
            print(f"| {r['dtype']} | {r['context']} | {r['T']} | {_f(r['us'])} | "
                  f"{_f(r['tflops'], 0)} | {_f(pct, 0)} | {_f(r.get('fi_us'))} | "
                  f"{_f(r.get('fi_tflops'), 0)} | {_f(rel, 2)} | {_f(r.get('same_rows'), 4)} |")
        print()
    att = [r for r in rows if r["section"] == "attention-decode"]
    if att:
        print("| model | KV | B | q_len | ours µs | graph call µs | TB/s (selected K/V) | "
              "% copy | FlashInfer µs | FI eager call µs | ours/FI | dense SDPA µs |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in att:
            pct = 100 * r["tbs"] / copy if copy else None
            print(f"| {r['model']} | {r['dtype']} | {r['B']} | {r['q_len']} | {_f(r['us'])} | "
                  f"{_f(r['call_us'])} | {_f(r['tbs'], 2)} | {_f(pct, 0)} | "
                  f"{_f(r.get('fi_us'))} | {_f(r.get('fi_call_us'), 0)} | "
                  f"{_f(r.get('ratio'), 2)} | {_f(r.get('dense_us'), 0)} |")
        _ratio_summary(att)
        print()
    ap = [r for r in rows if r["section"] == "attention-prefill"]
    if ap:
        print("| model | KV | context | selections | union of 4 tokens (blocks) | ours µs | "
              "TFLOP/s | % bf16 ceiling | plan / tile / per-token kernels µs | "
              "per-token kernel only µs | speed-up | dense SDPA µs | SM MHz after | "
              "gather roof µs (TB/s) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in ap:
            pct = 100 * r["tflops"] / bf16 if bf16 else None
            print(f"| {r['model']} | {r['dtype']} | {_k(r['context'])} | {r['selections']} | "
                  f"{_f(r['union4'], 1)} | {_f(r['us'], 0)} | {_f(r['tflops'], 0)} | "
                  f"{_f(pct, 0)} | {_f(r.get('attn-plan_us'), 0)} / "
                  f"{_f(r.get('attn-tile_us'), 0)} / {_f(r.get('attn_us'), 0)} | "
                  f"{_f(r['per_token_us'], 0)} | "
                  f"{_f(r['per_token_us'] / r['us'], 2)} | {_f(r.get('dense_us'), 0)} | "
                  f"{_f(r.get('sm_mhz'), 0)} | {_gather(r)} |")

    for section in ("layer-decode", "layer-prefill"):
        lay = [r for r in rows if r["section"] == section]
        if not lay:
            continue
        parts = ("prep", "score", "topk", "topk-merge", "attn-plan", "attn-tile", "attn",
                 "attn-merge")
        print(f"\n{section}: device µs per call, per kernel (medians), against dense\n")
        print("| model | cache | B | L | q_len | layer µs | " + " | ".join(parts)
              + " | graph call µs | dense (bf16) µs | dense / sparse |")
        print("|---|---|---|---|---|---|" + "---|" * len(parts) + "---|---|---|")
        for r in lay:
            cells = " | ".join(_f(r.get(f"{k}_us")) for k in parts)
            print(f"| {r['model']} | {r['dtype']} | {r['B']} | {_k(r['L'])} | {r['q_len']} | "
                  f"{_f(r['us'])} | {cells} | {_f(r.get('call_us'))} | "
                  f"{_f(r.get('dense_bf16_us'), 0)} | {_f(r.get('speedup'), 1)} |")


if __name__ == "__main__":
    main()
