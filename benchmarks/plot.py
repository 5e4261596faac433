# SPDX-License-Identifier: Apache-2.0
"""Figures from benchmarks/run.py's bench.json: PNGs under docs/figures/.

    python benchmarks/plot.py RESULTS/bench-*/bench.json [--out docs/figures]
                              [--batches 1,32] [--layer-batch 32] [--layer-dtypes bf16,fp8]

Several JSON files (the parts of one run, scripts/gpu_check.sh bench-part) are read as one. It
writes:

* indexer_decode.png: the decode indexer's device time per call against context length, one
  panel per batch size (TP1, q_len 1): openmsa fp8 (and NVFP4 keys when the run has them),
  FlashInfer fp8, vLLM fp8, and dense bf16 attention over the same context (what selecting
  blocks replaces). A peer's point is drawn only where its selections agreed with ours.
* layer_speedup.png: one sparse layer's decode step (preparation + indexer + sparse attention)
  against the same layer with dense bf16 attention: speed-up against context length, TP1 and
  TP4, per KV dtype, at one batch size (--layer-dtypes: only those rows, e.g. to leave out a
  row that a newer results file supersedes).

A figure with nothing to draw is not written (the files on disk stay), so figures can be drawn
from different results files one command each.

Needs matplotlib (pip install -e '.[bench]'); nothing else of openmsa.
"""

from __future__ import annotations

import argparse
import json
import os

FIGURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                       "figures")
# the indexer figure's panels: batch sizes that run.py's full and --quick indexer-decode grids
# both have (shapes.INDEXER_DECODE, INDEXER_DECODE_QUICK; tests/tools/test_plot.py checks)
DEFAULT_BATCHES = "1,32"


# what identifies a row across results files: a later file's row with the same values replaces
# an earlier one's (a newer run of part of a grid beside an older whole one)
ROW_KEY = ("section", "model", "dtype", "L", "B", "q_len", "context", "T", "selections")


def load(paths) -> tuple[list[str], list[dict]]:
    """(provenance lines, rows) of one or several bench.json files, in order. A later file's row
    replaces the earlier row of the same case (ROW_KEY), in its place, unless it did not run (a
    `note`) where the earlier one did; every file's ceilings row stays. Each row carries `_run`
    (its file's index in the provenance list) and `_file`."""
    prov, rows = [], {}
    for i, path in enumerate(paths):
        with open(path) as f:
            data = json.load(f)
        prov.append(data.get("provenance", ""))
        for r in data.get("rows", []):
            key = tuple(r.get(k) for k in ROW_KEY)
            if r.get("section") == "ceilings":
                key += (i,)
            if "note" in r and key in rows and "note" not in rows[key]:
                continue  # a case a later call ran out of time for keeps its measurement
            rows[key] = dict(r, _run=i, _file=path)
    return prov, list(rows.values())


def _ok(row, peer):
    """A peer's time, when it ran and agreed with ours (absent `agrees`: not checked)."""
    us = row.get(f"{peer}_us")
    if not us or row.get(f"{peer}_agrees") is False:
        return None
    return us


def _k(n):
    return f"{n // 1024}K" if n < 1 << 20 else f"{n >> 20}M"


def indexer_series(rows, batch, model="m3-tp1", q_len=1):
    """{label: [(L, µs)]} for one panel of indexer_decode.png."""
    sel = [r for r in rows if r.get("section") == "indexer-decode" and r.get("model") == model
           and r.get("B") == batch and r.get("q_len") == q_len and r.get("us")]
    out: dict[str, list] = {}

    def add(label, x, y):
        if y:
            out.setdefault(label, []).append((x, y))
    for r in sorted(sel, key=lambda r: r["L"]):
        if r["dtype"] == "fp8":
            add("openmsa fp8", r["L"], r["us"])
            add("FlashInfer fp8", r["L"], _ok(r, "fi"))
            add("vLLM 0.34 fp8", r["L"], _ok(r, "vllm"))
            add("dense attention (bf16 SDPA)", r["L"], r.get("dense_us"))
        elif r["dtype"] == "nvfp4":
            add("openmsa NVFP4 keys", r["L"], r["us"])
    return out


def layer_series(rows, batch, dtypes=None):
    """{label: [(L, speed-up)]} for layer_speedup.png (rows of `dtypes` only, when given): over
    dense bf16 SDPA, and where the row has it over FlashInfer's dense attention reading the same
    caches in their own dtype ("over FlashInfer's dense")."""
    out: dict[str, list] = {}
    sel = [r for r in rows if r.get("section") == "layer-decode" and r.get("B") == batch
           and r.get("speedup") and (dtypes is None or r.get("dtype") in dtypes)]
    for r in sorted(sel, key=lambda r: r["L"]):
        tp = {"m3-tp1": "TP1", "m3-tp4": "TP4", "m3-tp8": "TP8"}.get(r["model"], r["model"])
        kv = {"nvfp4": "fp8 K/V, NVFP4 keys"}.get(r["dtype"], f"{r['dtype']} K/V")
        out.setdefault(f"{tp}, {kv}", []).append((r["L"], r["speedup"]))
        if r.get("speedup_engine"):
            out.setdefault(f"{tp}, {kv}, over FlashInfer's dense", []).append(
                (r["L"], r["speedup_engine"]))
    return out


def _axes_log_context(ax, xs):
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([_k(x) for x in xs])
    ax.set_xlabel("context length (tokens)")
    ax.grid(True, which="both", alpha=0.3)


def plot_indexer(rows, batches, path, note=""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    drawn = 0
    for ax, b in zip(axes[0], batches):
        series = indexer_series(rows, b)
        if not series:
            print(f"indexer_decode.png: no indexer-decode rows at B = {b} (TP1, q_len 1): an "
                  f"empty panel (--batches names others)")
        xs = sorted({x for pts in series.values() for x, _ in pts})
        for label, pts in series.items():
            style = "--" if label.startswith("dense") else "-"
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", label=label)
            drawn += 1
        if xs:
            _axes_log_context(ax, xs)
        ax.set_yscale("log")
        ax.set_ylabel("device time per call (µs)")
        ax.set_title(f"decode indexer, TP1, B = {b}, q_len 1")
        if series:
            ax.legend(fontsize=8)
    if note:
        fig.text(0.01, 0.005, note, fontsize=6, alpha=0.7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    # nothing drawn: the file on disk (from a run that has these rows) stays as it is
    if drawn:
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def plot_layer(rows, batch, path, note="", dtypes=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    series = layer_series(rows, batch, dtypes)
    xs = sorted({x for pts in series.values() for x, _ in pts})
    for label, pts in series.items():
        style = "--" if label.endswith("dense") else "-"
        ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", label=label)
    if xs:
        _axes_log_context(ax, xs)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("speed-up over dense attention (x)\nsolid: bf16 SDPA; dashed: FlashInfer's")
    ax.set_title(f"one sparse layer, decode step, B = {batch}")
    if series:
        ax.legend(fontsize=8)
    if note:
        fig.text(0.01, 0.005, note, fontsize=6, alpha=0.7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    if series:
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return len(series)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", nargs="+", help="bench.json files of one run")
    p.add_argument("--out", default=FIGURES)
    p.add_argument("--batches", default=DEFAULT_BATCHES,
                   help="the indexer figure's batch sizes, one panel each")
    p.add_argument("--layer-batch", type=int, default=32)
    p.add_argument("--layer-dtypes", default=None,
                   help="the layer figure's KV / key dtypes, comma-separated (default: all)")
    args = p.parse_args(argv)
    prov, rows = load(args.bench)
    os.makedirs(args.out, exist_ok=True)
    note = " | ".join(x.lstrip("# ") for x in dict.fromkeys(prov) if x)
    batches = [int(b) for b in args.batches.split(",")]
    written = []
    path = os.path.join(args.out, "indexer_decode.png")
    if plot_indexer(rows, batches, path, note):
        written.append(path)
    path = os.path.join(args.out, "layer_speedup.png")
    layer_dtypes = None if args.layer_dtypes is None else args.layer_dtypes.split(",")
    if plot_layer(rows, args.layer_batch, path, note, layer_dtypes):
        written.append(path)
    for w in written:
        print(w)
    if not written:
        print("no rows to plot (sections indexer-decode and layer-decode)")
    return written


if __name__ == "__main__":
    main()
