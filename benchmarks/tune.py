# SPDX-License-Identifier: Apache-2.0
"""Sweep an op's launch knobs on a few representative shapes, printing the median device time of
each variant; the winners go back into the op's config defaults (ops/<op>/plan.py) by hand, with
the numbers in docs/performance.md.   python benchmarks/tune.py [--iters N]

A variant is a dict of config fields, a form's field (the indexer's `decode`, `gluon`, ...; the
attention's `decode_fp8`, ...) given as a dict of that form's fields, so that every knob can be
varied (--variants): it runs as the op's DEFAULT with those changes, passed to the op as its
`config` (nothing global changes)."""

import argparse
import dataclasses
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402
import shapes  # noqa: E402

import openmsa  # noqa: E402
from openmsa.ops.cache.geometry import projection_widths  # noqa: E402
from openmsa.ops.indexer import api as indexer_api  # noqa: E402
from openmsa.ops.indexer.plan import DEFAULT as INDEXER_DEFAULT  # noqa: E402


def pick(args, variants):
    """The section's own variant list, unless --variants or --quick says otherwise. (Compare
    `pdl` on and off with --metric call: see timing.)"""
    if args.variants is not None:
        return args.variants
    return variants[:2] if args.quick else variants


METRIC = "device"  # --metric: what each cell shows
TIME_WRONG = False  # --time-wrong: time variants whose output differs too (marked "!")


def _cell(dev, call) -> str:
    """One cell: median device µs, graph-replayed call µs (run.graph_call_us: what pdl and
    other launch-overlap knobs change), or both as device/call."""
    if METRIC == "both":
        return f"{dev:6.1f}/{call:<6.1f}"
    return f"{dev if call is None else call:8.1f}"


def wanted(args, name: str) -> bool:
    """Whether --cases takes the case called `name` (every case without --cases)."""
    return any(part in name for part in args.cases.split("|"))


def sweep(name, default, variants, cases, iters):
    """Median time (see _cell) of each case under each variant; a variant whose output differs
    from the first variant's by more than bf16 rounding of the output prints "wrong" instead.
    `default` is the op's default config (a frozen dataclass) and each case's function takes the
    config to run with. The device times of a case's variants come from one profiled loop in
    which their calls alternate (run.interleaved_device_times_us), so a change of the GPU's
    state (docs/performance.md, "How it was measured", Interleaving) hits every variant alike."""
    if dataclasses.is_dataclass(default):
        def under(v, fn):
            return functools.partial(fn, dataclasses.replace(default, **v))
    else:
        # (a section's own dict of knobs, which its case functions turn into the op's config at
        # each call: sweep() fills it with each variant; nothing of the library changes)
        base = dict(default)

        def under(v, fn):
            def call():  # the knobs are read on the host at launch time
                default.clear()
                default.update(base, **v)
                return fn()
            return call

    for case_name, fn in cases:
        cells, ok, first, wrong = {}, [], None, set()
        for i, v in enumerate(variants):
            try:
                f = under(v, fn)
                got = f()
            except Exception as e:  # noqa: BLE001
                cells[i] = f"  fail({type(e).__name__})"
                continue
            if first is None:
                first = got.float()
            elif not torch.allclose(got.float(), first, rtol=2e-2, atol=2e-2):
                cells[i] = "   wrong"
                if not TIME_WRONG:
                    continue
                wrong.add(i)
            ok.append((i, f))
        try:
            devs = (run.interleaved_device_times_us([f for _, f in ok], iters)
                    if METRIC in ("device", "both") else None)
            for k, (i, f) in enumerate(ok):
                call = run.graph_call_us(f, iters) if METRIC in ("call", "both") else None
                cells[i] = _cell(run.med(devs[k]) if devs is not None else None, call)
                if i in wrong:  # (a probe: what the time is without some of the work)
                    cells[i] = "!" + cells[i].strip().rjust(7)
        except Exception as e:  # noqa: BLE001
            for i, _ in ok:
                cells.setdefault(i, f"  fail({type(e).__name__})")
        print(f"{name:10s} {case_name:28s} " + " ".join(cells[i] for i in range(len(variants))),
              flush=True)
    if not dataclasses.is_dataclass(default):
        default.clear()
        default.update(base)


def _cache_prepare(args):
    """fused_prepare (CacheConfig): a decode step of 64 tokens and an 8K prefill chunk at M3's
    TP1, TP4 and TP8 head counts, bf16 and fp8 caches."""
    from openmsa.ops.cache import plan as cache_plan

    variants = pick(args, [{}, dict(prepare_head_tile=8), dict(prepare_warps=8),
                           dict(prepare_warps=2)])
    print("cache prepare variants:", variants)
    cases = []
    for model_name in ("m3-tp1", "m3-tp4", "m3-tp8"):
        cfg = shapes.MODELS[model_name]
        for dname in ("bf16", "fp8"):
            for tokens in (64, 8192):
                case = f"prep {model_name} {dname} T{tokens}"
                if not wanted(args, case):
                    continue
                cases.append((case, _prepare_case(cfg, run.DTYPES[dname], tokens)))
    sweep("cache", cache_plan.DEFAULT, variants, cases, args.iters)


def _prepare_case(cfg, dtype, tokens):
    """A function of a CacheConfig running one fused_prepare of `tokens` tokens into caches of
    `dtype` (one page per token block, slots in order); returns q."""
    hkv = cfg.num_kv_heads
    d, di, bs = cfg.head_dim, cfg.index_head_dim, cfg.block_size
    pages = -(-tokens // bs)
    qkv = torch.randn(tokens, sum(projection_widths(cfg)), device="cuda", dtype=torch.bfloat16)
    w = [torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1 for n in (d, d, di, di)]
    k_cache = torch.empty(pages, bs, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    index_cache = torch.empty(pages, bs, di, device="cuda", dtype=dtype)
    positions = torch.arange(tokens, device="cuda", dtype=torch.int32) + 100000
    slots = torch.arange(tokens, device="cuda", dtype=torch.int64)

    def call(config):
        q, _ = openmsa.fused_prepare(qkv, positions, cfg, *w, k_cache, v_cache, slots,
                                     index_cache, slots, cache_config=config)
        return q
    return call


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="the first two variants only")
    p.add_argument("--only", default="attention-decode,indexer-decode,indexer-prefill",
                   help="sections, of: attention-decode, attention-fp8, attention-prefill, "
                        "indexer-decode, indexer-prefill, cache-prepare")
    p.add_argument("--variants", type=json.loads, default=None,
                   help='a JSON list of config overrides replacing every section\'s own list, '
                        'a form\'s as a dict of its fields, e.g. \'[{}, {"gluon": {"waves": '
                        '2}}]\' for indexer-prefill')
    p.add_argument("--time-wrong", action="store_true",
                   help="time the variants whose output differs too (marked !): probes that "
                        "leave work out to see what it costs")
    p.add_argument("--metric", choices=("device", "call", "both"), default="device",
                   help="device µs (profiler), graph-replayed call µs, or both")
    p.add_argument("--context", type=int, default=8192,
                   help="attention-prefill: tokens of context before the 8192-token chunk")
    p.add_argument("--cases", default="",
                   help="only the cases whose name (as printed: 'm3-tp1 fp8 s16 j0.2' in "
                        "attention-prefill, 'm3-tp4 fp8 B64 q1' in attention-fp8, 'dec fp8 B8 "
                        "L128K q1 H1' in indexer-decode, 'prefill fp8 8K@120K' in "
                        "indexer-prefill) contains one of these '|'-separated strings, e.g. "
                        "'fp8', 'tp1 fp8 s1 j' (independent selections; 'fp8 s1' matches s16 "
                        "too) or 'B8 L128K|B1 L128K'")
    args = p.parse_args()
    global METRIC, TIME_WRONG
    METRIC = args.metric
    TIME_WRONG = args.time_wrong
    only = args.only.split(",")
    print(run.provenance(), flush=True)
    for name, fn in (("attention-prefill", _attention_prefill), ("attention-fp8", _attention_fp8),
                     ("cache-prepare", _cache_prepare)):
        if name in only:
            fn(args)
            only.remove(name)
    if not only:
        return None
    if "attention-decode" not in only:
        return _indexer(args, only)

    # (attention variants: AttentionConfig changes, a form field as a dict of its fields)
    variants = pick(args, [{}, dict(decode_16={"resident": 2}),
                           dict(decode_fp8={"stages": 4}, decode_16={"stages": 4}),
                           dict(decode_fp8={"sub": 32, "stages": 4, "resident": 4}),
                           dict(decode_fp8={"warps": 8}, decode_16={"warps": 8})])
    print("attention variants:", variants)
    knobs, config = _config_knobs()
    cases = []
    m = shapes.MODELS["m3-tp1"]
    for dname, batch, q_len in (("fp8", 1, 1), ("fp8", 128, 1), ("bf16", 128, 1),
                                ("fp8", 128, 4)):
        if not wanted(args, f"dec {dname} B{batch} q{q_len}"):
            continue
        q, packed, idx, cu, seq, table = run._attention_step(m, batch, 65536, q_len, dname)
        k, v = packed[..., :128].permute(0, 2, 1, 3), packed[..., 128:].permute(0, 2, 1, 3)
        cases.append((f"dec {dname} B{batch} q{q_len}",
                      (lambda q=q, k=k, v=v, idx=idx, cu=cu, seq=seq, table=table:
                       openmsa.sparse_attention(q, k, v, idx, cu, seq, table,
                                                config=config()))))
    if wanted(args, "prefill bf16 8K@8K"):
        q, packed, idx, cu, seq, table = run._attention_step(m, 1, 8192 + 8192, 8192, "bf16")
        k, v = packed[..., :128].permute(0, 2, 1, 3), packed[..., 128:].permute(0, 2, 1, 3)
        cases.append(("prefill bf16 8K@8K", lambda: openmsa.sparse_attention(
            q, k, v, idx, cu, seq, table, config=config())))
    sweep("attention", knobs, variants, cases, args.iters)
    del cases
    torch.cuda.empty_cache()
    _indexer(args, only)


def _config_knobs():
    """(knobs, config): sweep() sets `knobs` (a local dict) to each variant's changes; config()
    is the AttentionConfig they make (benchmarks/run.py's attention_config), passed per call."""
    knobs = {}
    return knobs, lambda: run.attention_config(knobs)


def _attention_fp8(args):
    """fp8 K/V decode knobs (and the split count, on a few bf16 shapes too)."""
    # (split: the split count's cost model and bounds, and the merge launch's warps)
    variants = pick(args, [{}, dict(rounds_fp8={"sub": 128}), dict(rounds_fp8={"resident": 3}),
                           dict(decode_16={"resident": 2}), dict(decode_fp8={"stages": 4}),
                           dict(decode_fp8={"warps": 8}), dict(small_pairs=0),
                           dict(split={"fused_max": 8}), dict(split={"merge_warps": 8}),
                           dict(split={"min_steps": 4}), dict(split={"copy_tbs": 3.35})])
    print("attention fp8 variants:", variants)
    knobs, config = _config_knobs()
    cases = []
    for model_name in ("m3-tp1", "m3-tp4", "m3-tp8"):
        m = shapes.MODELS[model_name]
        for dname, batch, q_len, ctx in (
                ("fp8", 1, 1, 65536), ("fp8", 8, 1, 65536), ("fp8", 1, 4, 65536),
                ("fp8", 8, 4, 65536), ("fp8", 10, 1, 65536), ("fp8", 64, 1, 65536),
                ("fp8", 64, 4, 65536), ("fp8", 128, 1, 65536), ("fp8", 128, 4, 65536),
                ("fp8", 1, 8192, 16384), ("bf16", 64, 1, 65536), ("bf16", 128, 1, 65536)):
            if not wanted(args, f"{model_name} {dname} B{batch} q{q_len}"):
                continue
            q, packed, idx, cu, seq, table = run._attention_step(m, batch, ctx, q_len, dname)
            k, v = packed[..., :128].permute(0, 2, 1, 3), packed[..., 128:].permute(0, 2, 1, 3)
            cases.append((f"{model_name} {dname} B{batch} q{q_len}",
                          (lambda q=q, k=k, v=v, idx=idx, cu=cu, seq=seq, table=table:
                           openmsa.sparse_attention(q, k, v, idx, cu, seq, table,
                                                    config=config()))))
    sweep("attn-fp8", knobs, variants, cases, args.iters)


def _attention_prefill(args):
    """The prefill knobs (chunks of >= prefill_min_tokens tokens) on 8K chunks after --context
    tokens (8K unless told), with selections shared by runs of 16 tokens, shared with per-token
    jitter, and independent."""
    # (the tile_* forms apply where the Triton tiles run: off Hopper, or with the Gluon forms
    # None)
    no_gluon = dict(gluon_16=None, gluon_fp8=None, gluon_pair_fp8=None)
    variants = pick(args, [dict(tiles=False), {}, no_gluon,
                           dict(gluon_fp8=None, gluon_pair_fp8=None),
                           dict(gluon_pair_fp8={"sub": 64},
                                gluon_fp8={"sub": 64, "stages_k": 3, "stages_v": 2}),
                           dict(gluon_pair_fp8=None),
                           dict(gluon_16={"sub": 64, "stages_k": 2, "stages_v": 2}),
                           dict(no_gluon, tile_16={"persistent": True},
                                tile_fp8={"persistent": False}),
                           dict(no_gluon, tile_16={"sub": 128}),
                           dict(no_gluon, tile_fp8={"sub": 64, "stages": 3}),
                           dict(no_gluon, tile_16={"rows": 128}, tile_fp8={"rows": 128}),
                           dict(no_gluon, tile_16={"waste": 3.0}, tile_fp8={"waste": 3.0}),
                           dict(no_gluon, tile_16={"warps": 8}, tile_fp8={"warps": 8}),
                           dict(no_gluon, tile_fp8={"resident": 3}),
                           dict(tile_16={"plan_warps": 2}, tile_fp8={"plan_warps": 2})])
    print("attention prefill variants:", variants)
    knobs, config = _config_knobs()
    cases = []
    for model_name, dname, shared, jitter in (
            ("m3-tp1", "bf16", 16, 0.0), ("m3-tp1", "bf16", 16, 0.2), ("m3-tp1", "bf16", 1, 0.0),
            ("m3-tp1", "fp8", 16, 0.0), ("m3-tp1", "fp8", 16, 0.2), ("m3-tp1", "fp8", 1, 0.0),
            ("m3-tp4", "bf16", 16, 0.0), ("m3-tp4", "bf16", 16, 0.2), ("m3-tp4", "bf16", 1, 0.0),
            ("m3-tp4", "fp8", 16, 0.2)):
        if not wanted(args, f"{model_name} {dname} s{shared} j{jitter}"):
            continue
        m = shapes.MODELS[model_name]
        q, packed, idx, cu, seq, table = run._attention_step(m, 1, args.context + 8192, 8192,
                                                             dname, shared=shared, jitter=jitter)
        k, v = packed[..., :128].permute(0, 2, 1, 3), packed[..., 128:].permute(0, 2, 1, 3)
        cases.append((f"{model_name} {dname} s{shared} j{jitter} U{run._mean_union(idx, 4):.1f}",
                      (lambda q=q, k=k, v=v, idx=idx, cu=cu, seq=seq, table=table:
                       openmsa.sparse_attention(q, k, v, idx, cu, seq, table,
                                                config=config()))))
    sweep("attn-pre", knobs, variants, cases, max(3, args.iters // 2))


def _indexer_config(knobs: dict):
    """The indexer's config under the variant sweep() is timing: sweep() puts each variant's
    knobs into `knobs` before the variant's calls, which pass this config (no module global
    of the library changes)."""
    return INDEXER_DEFAULT.replace(**knobs)


def _indexer(args, only):
    if "indexer-decode" not in only:
        if "indexer-prefill" in only:
            _indexer_prefill(args)
        return
    variants = pick(args, [{}, dict(decode={"waves": 8}), dict(decode={"waves": 4}),
                           dict(decode={"max_bps": 32}), dict(decode={"stages": 4}),
                           dict(select={"sort_waves": 4}), dict(select={"chunk_min_waves": 4})])
    print("indexer decode variants:", variants)
    knobs = {}
    cases = []
    for dname, batch, ctx, q_len, heads in (
            ("fp8", 1, 32768, 1, 4), ("fp8", 1, 131072, 1, 4), ("fp8", 1, 1 << 20, 1, 4),
            ("fp8", 32, 131072, 1, 4), ("fp8", 32, 32768, 1, 4), ("fp8", 128, 32768, 4, 4),
            ("fp8", 32, 1 << 20, 1, 4),
            ("fp8", 32, 131072, 1, 1), ("fp8", 64, 131072, 1, 1), ("bf16", 1, 131072, 1, 4),
            ("bf16", 128, 131072, 1, 4),
            ("bf16", 1, 32768, 1, 4), ("fp8", 1, 32768, 4, 4), ("fp8", 8, 32768, 1, 4),
            ("fp8", 8, 131072, 1, 4), ("bf16", 8, 131072, 4, 4), ("bf16", 1, 1 << 20, 1, 4),
            # rows on the selection's search path (>= 2 waves of selection programs)
            ("fp8", 64, 131072, 4, 4), ("fp8", 8, 1 << 20, 4, 4), ("fp8", 128, 131072, 1, 4),
            ("bf16", 32, 131072, 4, 4), ("fp8", 32, 1 << 20, 4, 4), ("fp8", 128, 1 << 20, 1, 4),
            ("fp8", 64, 1 << 20, 4, 4), ("fp8", 128, 1 << 20, 4, 4)):
        if not wanted(args, f"dec {dname} B{batch} L{ctx // 1024}K q{q_len} H{heads}"):
            continue
        q, cache, cu, seq, table = run._index_step(batch, ctx, q_len, heads, run.DTYPES[dname])
        cases.append((f"dec {dname} B{batch} L{ctx // 1024}K q{q_len} H{heads}",
                      (lambda q=q, cache=cache, cu=cu, seq=seq, table=table, q_len=q_len:
                       openmsa.select_blocks(q, cache, cu, seq, table, max_q_len=q_len,
                                             config=_indexer_config(knobs)))))
    sweep("indexer", knobs, variants, cases, args.iters)
    del cases
    torch.cuda.empty_cache()
    _indexer_nvfp4(args)
    if "indexer-prefill" in only:
        _indexer_prefill(args)


def _indexer_nvfp4(args):
    """The Gluon NVFP4 decode launch's knobs (IndexerConfig.decode_nvfp4; decode on NVFP4
    pages, fp8 index query), with the fp8 cache's step beside it for scale."""
    # (a decode.max_bps below its own max_bps caps it too)
    variants = pick(args, [{}, dict(decode={"max_bps": 16}), dict(decode_nvfp4={"programs": 32}),
                           dict(decode_nvfp4={"stages": 4}),
                           dict(decode_nvfp4={"max_bps": 16, "min_bps": 4})])
    print("indexer nvfp4 decode variants:", variants)
    knobs = {}
    cases = []
    for dname, batch, ctx, q_len, heads in (
            ("nvfp4", 128, 1 << 20, 1, 4), ("fp8", 128, 1 << 20, 1, 4),
            ("nvfp4", 1, 1 << 20, 1, 4), ("nvfp4", 1, 131072, 1, 4),
            ("nvfp4", 32, 131072, 1, 4), ("nvfp4", 32, 1 << 20, 4, 4),
            ("nvfp4", 64, 131072, 1, 1), ("nvfp4", 128, 131072, 4, 1),
            # a last wave of a few programs: B * L = 4M and 16M at 128K
            ("nvfp4", 32, 131072, 4, 4), ("nvfp4", 128, 131072, 1, 4),
            ("nvfp4", 128, 131072, 4, 4), ("nvfp4", 32, 131072, 1, 1)):
        name = f"dec {dname} B{batch} L{ctx // 1024}K q{q_len} H{heads}"
        if not wanted(args, name):
            continue
        q, cache, cu, seq, table = run._index_step(batch, ctx, q_len, heads,
                                                   run.DTYPES.get(dname, dname))
        cases.append((name, (lambda q=q, cache=cache, cu=cu, seq=seq, table=table, q_len=q_len:
                             openmsa.block_scores(q, cache, cu, seq, table, max_q_len=q_len,
                                                  config=_indexer_config(knobs)))))
    sweep("nvfp4", knobs, variants, cases, args.iters)
    del cases
    torch.cuda.empty_cache()


def _indexer_prefill(args):
    """The prefill launch's knobs on 8K chunks (no context, 120K, ~1M; max_q_len = 8192 as
    run.py passes it), and at TP4's one index head ("H1": no context, 8K, 32K): select_blocks,
    for fp8 at 120K block_scores alone (the scoring launch plus the score tensor's -inf fill)
    and for fp8 the selection launches alone."""
    # the Gluon prefill launch's knobs (Hopper); the Triton prefill launch's own (the prefill
    # form) apply where the Gluon one is not planned
    variants = pick(args, [{}, dict(gluon={"waves": 2}), dict(gluon={"waves": 8}),
                           dict(gluon={"stages_fp8": 4, "stages_16": 2}),
                           dict(short_rows={"max_blocks": 64}),
                           dict(group={"min_blocks": 1 << 30})])
    print("indexer prefill variants:", variants)
    knobs = {}
    cases = []
    for dname, ctx, heads in (("fp8", 0, 4), ("fp8", 120 * 1024, 4), ("fp8", 1016 * 1024, 4),
                              ("bf16", 0, 4), ("bf16", 120 * 1024, 4), ("bf16", 1016 * 1024, 4),
                              ("fp8", 0, 1), ("fp8", 8 * 1024, 1), ("fp8", 32 * 1024, 1)):
        chunk = f"{dname} 8K@{ctx // 1024}K" + (" H1" if heads == 1 else "")
        names = [f"prefill {chunk}"] + ([f"scores {chunk}"] if chunk == "fp8 8K@120K" else [])
        names += [f"select {chunk}"] if dname == "fp8" else []
        if not any(wanted(args, name) for name in names):
            continue
        q, cache, cu, seq, table = run._index_step(1, ctx + 8192, 8192, heads,
                                                   run.DTYPES[dname])
        if wanted(args, f"prefill {chunk}"):
            cases.append((f"prefill {chunk}",
                          (lambda q=q, cache=cache, cu=cu, seq=seq, table=table:
                           openmsa.select_blocks(q, cache, cu, seq, table, max_q_len=8192,
                                                 config=_indexer_config(knobs)))))
        if wanted(args, f"scores {chunk}") and chunk == "fp8 8K@120K":
            cases.append((f"scores {chunk}",
                          (lambda q=q, cache=cache, cu=cu, seq=seq, table=table:
                           openmsa.block_scores(q, cache, cu, seq, table, max_q_len=8192,
                                                config=_indexer_config(knobs)))))
        if wanted(args, f"select {chunk}") and dname == "fp8":
            scores = openmsa.block_scores(q, cache, cu, seq, table)
            out = torch.empty(q.shape[0], q.shape[1], 16, dtype=torch.int32, device="cuda")

            def select_only(scores=scores, cu=cu, seq=seq, out=out):
                indexer_api.launch_select(scores, cu, seq, out, topk=16, init_blocks=0,
                                          local_blocks=1, block_size=128,
                                          config=_indexer_config(knobs))
                return out
            cases.append((f"select {chunk}", select_only))
    sweep("indexer", knobs, variants, cases, max(3, args.iters // 2))


if __name__ == "__main__":
    main()
