# SPDX-License-Identifier: Apache-2.0
"""M3's sparse attention part, all of its sparse layers, as one decode step captured in one CUDA
graph (issue 57's stack): per token, each layer's preparation, indexer and sparse attention
(run.py's layer-decode step), layer after layer. Each layer reads caches of its own where the
GPU holds them all; otherwise the layers cycle through as many cache sets as fit (each set's
index cache and K/V are then read by the other sets' layers' worth of traffic before their
reuse: several times the L2 at 128K and beyond). Beside it, the same stack on FlashInfer's calls
(its indexer, `msa_proxy_score` + `msa_topk_select`, the selection transposed to its layout,
and `msa_sparse_decode_attention`, after openmsa's preparation: FlashInfer has no fused
preparation), fp8 K/V only (FlashInfer's sparse attention's), and one layer's graph-replayed
call times the layer count.

    python benchmarks/stack.py [--contexts 131072,1048576] [--batch 1] [--layers 57]
        [--model m3-tp1] [--dtype fp8] [--no-peers] [--iters 20] [--out DIR]

Writes DIR/stack.json (provenance and one row per context) after every row. The graph-replayed
time is run.graph_call_us's: L2 flushed once per token, before the first layer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402
import shapes  # noqa: E402

# M3's sparse layers (its config's layer types: every layer but the few full-attention ones)
M3_SPARSE_LAYERS = 57


def cache_sets(layers: int, per_set_bytes: int, free_bytes: int, reserve: float = 0.85) -> int:
    """How many cache sets the stack allocates: one per layer where `reserve` of the free
    memory holds them all, else as many as it holds (at least 1)."""
    if per_set_bytes <= 0:
        raise ValueError(f"per_set_bytes must be positive, got {per_set_bytes}")
    return max(1, min(layers, int(free_bytes * reserve) // per_set_bytes))


def _fi_layer(fi, layer, case, kv_hnd):
    """One layer on FlashInfer's calls over the case's caches, after openmsa's preparation:
    (fn, attention output). kv_hnd: the case's K and V in FlashInfer's [P, Hkv, B, D] layout
    (views of one interleaved copy, laid out once as an engine storing its caches that way would)."""
    _, _, index_cache, meta, _, _ = case
    k_cache, v_cache = kv_hnd
    cu, seq = meta.cu_seqlens_q, meta.seq_lens
    q_len = 1
    nvp = ((seq - q_len) // 128 + 1).int().repeat_interleave(torch.diff(cu))
    k4 = index_cache.unsqueeze(1)  # [P, 1, B, Di]
    width = meta.index_block_table.shape[1]
    out = torch.empty_like(layer.q_out)

    def fn():
        layer.prep()
        s = fi.msa_proxy_score(layer.index_q_out, k4, cu, page_table=meta.index_block_table,
                               seqused_k=seq, max_seqlen_q=q_len, max_k_tiles=width)
        sel = fi.msa_topk_select(s, 16, num_valid_pages=nvp, force_end_blocks=1)
        # its attention takes the selection as [H, T, K]
        fi.msa_sparse_decode_attention(layer.q_out, k_cache, v_cache,
                                       sel.permute(1, 0, 2).contiguous(),
                                       page_table=meta.block_table, seqused_k=seq,
                                       seqlen_q=q_len, out=out)
    return fn, out


def stack_row(args, model_name, context, fi) -> dict:
    model = shapes.MODELS[model_name]
    batch, layers = args.batch, args.layers
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    first = run._layer_case(model, batch, context, 1, args.dtype)
    per_set = torch.cuda.memory_allocated() - before
    with_peer = fi is not None and args.dtype == "fp8"
    # FlashInfer reads its own copy of each set's K/V (its layout): room for both
    peer_bytes = first[0].nbytes + first[1].nbytes if with_peer else 0
    free, _ = torch.cuda.mem_get_info()
    n_sets = cache_sets(layers, per_set + peer_bytes, free + per_set)
    cases = [first] + [run._layer_case(model, batch, context, 1, args.dtype)
                       for _ in range(n_sets - 1)]
    ours = [run._layer_fns(model, *cases[i % n_sets], batch, context, 1)[0]
            for i in range(layers)]

    def step():
        for layer in ours:
            layer()
    row = dict(section="layer-stack", model=model_name, dtype=args.dtype, B=batch, L=context,
               layers=layers, cache_sets=n_sets, cache_set_gib=per_set / 2 ** 30)
    print(f"# {model_name} {args.dtype} B={batch} L={context}: {layers} layers over {n_sets} "
          f"cache sets of {per_set / 2 ** 30:.2f} GiB", flush=True)
    row["stack_us"] = run.graph_call_us(step, args.iters)
    row["per_layer_us"] = row["stack_us"] / layers
    row["one_layer_call_us"] = run.graph_call_us(ours[0], args.iters)
    if with_peer:
        # after the step above ran, so the copies hold this token's K/V too
        # (its sparse decode reads K and V interleaved in one [P, Hkv, B, 2D] cache)
        d = first[0].shape[-1]
        packed = [torch.cat([c.permute(0, 2, 1, 3) for c in case[:2]], -1) for case in cases]
        kv_hnd = [(p[..., :d], p[..., d:]) for p in packed]
        peer = run.try_peer(lambda: [_fi_layer(fi, ours[i], cases[i % n_sets],
                                               kv_hnd[i % n_sets]) for i in range(layers)])
        if peer is not None:
            fns = [fn for fn, _ in peer]
            ok = run.try_peer(lambda: [fn() for fn in fns])
            if ok is not None:
                ours[0]()
                row["max_diff_vs_fi"] = float(
                    (peer[0][1].float() - ours[0].buffers[1].float()).abs().max())

                def fi_step():
                    for fn in fns:
                        fn()
                row["fi_stack_us"] = run.try_peer(lambda: run.graph_call_us(fi_step,
                                                                            args.iters))
                if row["fi_stack_us"]:
                    row["speedup_vs_fi"] = row["fi_stack_us"] / row["stack_us"]
            else:
                row["fi"] = "not run"
        else:
            row["fi"] = "not run"
    ours = cases = first = None  # free this context's caches before the next one's
    torch.cuda.empty_cache()
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="131072,1048576")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=M3_SPARSE_LAYERS)
    p.add_argument("--model", default="m3-tp1", choices=sorted(shapes.MODELS))
    p.add_argument("--dtype", default="fp8", choices=("bf16", "fp8"))
    p.add_argument("--no-peers", action="store_true", help="openmsa alone")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if args.batch < 1 or args.layers < 1:
        p.error("--batch and --layers must be at least 1")
    os.makedirs(args.out, exist_ok=True)
    fi = None if args.no_peers else run.load_flashinfer()
    result = {"provenance": run.provenance(), "rows": []}
    print(result["provenance"], flush=True)
    for context in (int(c) for c in args.contexts.split(",")):
        row = stack_row(args, args.model, context, fi)
        result["rows"].append(row)
        print(" | ".join(f"{k}={run._fmt(v)}" for k, v in row.items()), flush=True)
        with open(os.path.join(args.out, "stack.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
