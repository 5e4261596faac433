# SPDX-License-Identifier: Apache-2.0
"""A/B of two trees of openmsa in one process: the benchmark's indexer decode, indexer prefill,
attention decode, attention prefill and layer decode grids, each row timed with the two trees' calls
alternating in one profiled loop (run.interleaved_device_times_us), so both sides see the same
GPU state. Before timing, each row checks that the two trees agree: selections bit-identical,
attention outputs equal (the same kernels must give the same bits).

    python benchmarks/prepare_ab.py BASE_REV      # here: writes .ab/openmsa_base (git-ignored)
    python benchmarks/ab.py --base .ab [--sections ...] [--iters N] [--out DIR]   # on the GPU
    python benchmarks/ab.py --base .ab --sections indexer-decode --dtypes nvfp4 \
        --contexts 131072,1048576 --batches 32,128      # a part of indexer-decode's grid
    python benchmarks/ab.py --base .ab --sections layer-decode --models m3-tp1 --dtypes fp8 \
        --batches 1,8          # the layer step at small batch, with both trees' kernels

The base tree is the package as it was at BASE_REV, renamed `openmsa_base` (its imports are
relative, so both trees load side by side); the tree under test is the `openmsa` on the path.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402
import shapes  # noqa: E402

import openmsa  # noqa: E402

SECTIONS = ("indexer-decode", "indexer-prefill", "attention-decode", "attention-prefill",
            "layer-decode")
ROWS: list[dict] = []


def _row(out_dir, **row):
    ROWS.append(row)
    print(" | ".join(f"{k}={run._fmt(v)}" for k, v in row.items()), flush=True)
    with open(os.path.join(out_dir, "ab.json"), "w") as f:
        json.dump({"provenance": run.provenance(), "rows": ROWS}, f, indent=1)


def _time(base_fn, new_fn, iters, graph: bool) -> dict:
    b, n = run.interleaved_device_times_us([base_fn, new_fn], iters)
    row = dict(base_us=run.med(b), new_us=run.med(n))
    row["ratio"] = row["new_us"] / row["base_us"]
    if graph:
        # graph-replayed call: alternate trees twice so a drift hits both alike
        calls = [run.graph_call_us(f, iters) for f in (base_fn, new_fn, base_fn, new_fn)]
        row.update(base_call_us=(calls[0] + calls[2]) / 2, new_call_us=(calls[1] + calls[3]) / 2)
    return row


def indexer_decode(base, args):
    grid = shapes.INDEXER_DECODE
    # the openmsa-only dtypes (nvfp4) only when --dtypes names them (main restricts the grid)
    dtypes = grid["dtypes"] + (grid.get("openmsa_only_dtypes", ()) if args.dtypes else ())
    for model_name in ("m3-tp1", "m3-tp4"):
        if not run._keep(model_name):
            continue
        heads = shapes.MODELS[model_name].num_index_heads
        for dname in dtypes:
            for context in grid["contexts"]:
                for batch in grid["batches"]:
                    if batch * context * run.TOKEN_BYTES[dname] > 40e9:
                        continue
                    for q_len in grid["q_lens"]:
                        q, cache, cu, seq, table = run._index_step(
                            batch, context, q_len, heads,
                            "nvfp4" if dname == "nvfp4" else run.DTYPES[dname])
                        outs = [torch.empty(q.shape[0], heads, 16, dtype=torch.int32,
                                            device="cuda") for _ in range(2)]
                        fns = [lambda m=m, o=o: m.select_blocks(q, cache, cu, seq, table, out=o,
                                                                max_q_len=q_len)
                               for m, o in ((base, outs[0]), (openmsa, outs[1]))]
                        for f in fns:
                            f()
                        same = bool((outs[0] == outs[1]).all())
                        _row(args.out, section="indexer-decode", model=model_name, dtype=dname,
                             L=context, B=batch, q_len=q_len, identical=same,
                             **_time(*fns, args.iters, graph=True))
                    q = cache = table = None  # free before the next case
                    torch.cuda.empty_cache()


def indexer_prefill(base, args):
    grid = shapes.INDEXER_PREFILL
    chunk = grid["chunk"]
    for model_name in ("m3-tp1", "m3-tp4"):
        heads = shapes.MODELS[model_name].num_index_heads
        # TP4 at short contexts too (shapes.INDEXER_PREFILL_SHORT)
        contexts = sorted({*grid["contexts"], *(shapes.INDEXER_PREFILL_SHORT["contexts"]
                                                if model_name == "m3-tp4" else ())})
        for dname in grid["dtypes"]:
            for context in contexts:
                q, cache, cu, seq, table = run._index_step(1, context + chunk, chunk, heads,
                                                           run.DTYPES[dname])
                outs = [torch.empty(chunk, heads, 16, dtype=torch.int32, device="cuda")
                        for _ in range(2)]
                fns = [lambda m=m, o=o: m.select_blocks(q, cache, cu, seq, table, out=o,
                                                        max_q_len=chunk)
                       for m, o in ((base, outs[0]), (openmsa, outs[1]))]
                for f in fns:
                    f()
                same = bool((outs[0] == outs[1]).all())
                _row(args.out, section="indexer-prefill", model=model_name, dtype=dname,
                     context=context, T=chunk, identical=same,
                     **_time(*fns, max(5, args.iters // 2), graph=False))
                q = cache = table = None  # free before the next case
                torch.cuda.empty_cache()


def _attention_fns(base, model, batch, context, q_len, dname, **sel):
    q, packed, idx, cu, seq, table = run._attention_step(model, batch, context, q_len, dname,
                                                         **sel)
    d = model.head_dim
    k = packed[..., :d].permute(0, 2, 1, 3)
    v = packed[..., d:].permute(0, 2, 1, 3)
    outs = [torch.empty_like(q) for _ in range(2)]
    fns = [lambda m=m, o=o: m.sparse_attention(q, k, v, idx, cu, seq, table, out=o)
           for m, o in ((base, outs[0]), (openmsa, outs[1]))]
    for f in fns:
        f()
    diff = float((outs[0].float() - outs[1].float()).abs().max())
    return fns, diff


def attention_decode(base, args):
    grid = shapes.ATTENTION_DECODE
    for model_name, model in run._models(grid):
        for dname in grid["dtypes"]:
            for batch in grid["batches"]:
                for q_len in grid["q_lens"]:
                    fns, diff = _attention_fns(base, model, batch, grid["context"], q_len, dname)
                    _row(args.out, section="attention-decode", model=model_name, dtype=dname,
                         B=batch, q_len=q_len, max_diff=diff,
                         **_time(*fns, args.iters, graph=True))
                torch.cuda.empty_cache()


def attention_prefill(base, args):
    grid = shapes.ATTENTION_PREFILL
    for model_name, model in run._models(grid):
        for dname in grid["dtypes"]:
            for context in grid["contexts"]:
                for label, shared, jitter in run.PREFILL_SELECTIONS:
                    fns, diff = _attention_fns(base, model, 1, context + grid["chunk"],
                                               grid["chunk"], dname, shared=shared,
                                               jitter=jitter)
                    _row(args.out, section="attention-prefill", model=model_name, dtype=dname,
                         context=context, selections=label, max_diff=diff,
                         **_time(*fns, max(10, args.iters), graph=False))
                    torch.cuda.empty_cache()


def layer_decode(base, args):
    """The sparse layer's decode step (preparation, indexer, attention: run.py's layer rows) of
    both trees over the same caches; q_len 4 (a verify step) at B = 1 too. Each row also holds
    each tree's device time per kernel (base_<kernel>_us, new_<kernel>_us; a programmatic
    dependent's includes its wait for the launch before it)."""
    grid = shapes.LAYER_DECODE
    for model_name, model in run._models(grid):
        for dname in grid["dtypes"]:
            for context in grid["contexts"]:
                for batch in grid["batches"]:
                    for q_len in (1, 4) if batch == 1 else (1,):
                        if args.q_lens and str(q_len) not in args.q_lens.split(","):
                            continue
                        case = run._layer_case(model, batch, context, q_len, dname)
                        # (each tree checks the model config is its own MSAConfig)
                        base_model = base.MSAConfig(**{f.name: getattr(model, f.name)
                                                       for f in dataclasses.fields(model)})
                        fns = [run._layer_fns(c, *case, batch, context, q_len, m=m)[0]
                               for c, m in ((base_model, base), (model, openmsa))]
                        for f in fns:
                            f()
                        (idx_b, out_b), (idx_n, out_n) = (f.buffers for f in fns)
                        by = {f"{side}_{part}_us": us
                              for side, f in (("base", fns[0]), ("new", fns[1]))
                              for part, us in run.breakdown_by_part_us(f, args.iters).items()}
                        _row(args.out, section="layer-decode", model=model_name, dtype=dname,
                             L=context, B=batch, q_len=q_len,
                             identical=bool(torch.equal(idx_b, idx_n)),
                             max_diff=float((out_b.float() - out_n.float()).abs().max()),
                             **_time(*fns, args.iters, graph=True),
                             **dict(sorted(by.items())))
                        del case, fns
                        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="folder holding openmsa_base/")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    # the grids restricted as run.py's options restrict them (indexer-decode: dtypes also
    # "nvfp4"); comma-separated
    parser.add_argument("--models", default="")
    parser.add_argument("--dtypes", default="")
    parser.add_argument("--contexts", default="")
    parser.add_argument("--batches", default="")
    parser.add_argument("--q-lens", default="")
    args = parser.parse_args()
    for option, key in ((args.contexts, "contexts"), (args.batches, "batches"),
                        (args.q_lens, "q_lens")):
        if option:
            run._restrict_grids(key, {int(v) for v in option.split(",")})
    if args.dtypes:
        run._restrict_dtypes(set(args.dtypes.split(",")))
    if args.models:
        run.MODELS = tuple(args.models.split(","))
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, os.path.abspath(args.base))
    base = importlib.import_module("openmsa_base")
    print(run.provenance(), flush=True)
    for name in args.sections.split(","):
        print(f"## {name}", flush=True)
        globals()[name.replace("-", "_")](base, args)
    ratios = {}
    for r in ROWS:
        ratios.setdefault(r["section"], []).append(r["ratio"])
    for section, rs in ratios.items():
        geo = torch.tensor(rs).log().mean().exp().item()
        print(f"# {section}: {len(rs)} rows, geomean new/base {geo:.4f}, "
              f"min {min(rs):.3f}, max {max(rs):.3f}", flush=True)


if __name__ == "__main__":
    main()
