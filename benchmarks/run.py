# SPDX-License-Identifier: Apache-2.0
"""The one benchmark driver: openmsa against two peers, FlashInfer 0.7.4's msa_ops and vLLM
0.34's own MiniMax-M3 Hopper kernels (.peers-vllm), and dense attention, with the H200's
measured ceilings, in one run.

    python benchmarks/run.py [--sections ceilings,indexer-decode,indexer-prefill,
                              attention-decode,attention-prefill,layer-decode,layer-prefill]
                             [--quick] [--out DIR] [--no-peers | --no-vllm] [--dry-run]
                             [--models m3-tp1,...] [--budget-s S]

Times are medians. "device" is the kernels' own time per call (profiler, L2 flushed before each
call; ours and the peers' calls alternate in one profiled loop). "call" is what an engine pays
per call: `call_us` is openmsa's call as a CUDA-graph replay; for each peer, `<peer>_graph_us`
is its call as a graph replay too (captured after one warm-up call, replayed with the same
buffers; FlashInfer's and vLLM's calls capture) and `<peer>_call_us` its eager call (host
launch included), for engines that do not capture. A peer's inputs are laid out in its own
layout once, outside the timed calls. Each section checks correctness before timing: the
peers' selections are compared with ours as sets of blocks per row (`<peer>_rows_differ`, and
`<peer>_rows_beyond_ties`: rows not explained by near-tied scores), their outputs by max |diff|
(`max_diff_vs_<peer>`); a peer that disagrees is still timed, with `<peer>_agrees` false. A
case that cannot run records its row with `note` "not run: <reason>" instead of stopping the
run. bench.json (in --out) is rewritten after every row; benchmarks/plot.py and
benchmarks/perf_doc.py read it.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shapes  # noqa: E402

import openmsa  # noqa: E402
from openmsa.ops.cache.geometry import projection_widths  # noqa: E402

FP8 = torch.float8_e4m3fn
DTYPES = {"bf16": torch.bfloat16, "fp8": FP8}


def attention_config(changes: dict | None = None):
    """sparse_attention's AttentionConfig with `changes` (JSON-friendly: a form field, e.g.
    decode_fp8, takes a dict of that form's fields, or None) over the default."""
    import dataclasses

    from openmsa.ops.attention.plan import DEFAULT
    fields = {}
    for name, value in (changes or {}).items():
        if isinstance(value, dict):
            value = dataclasses.replace(getattr(DEFAULT, name), **value)
        fields[name] = value
    return dataclasses.replace(DEFAULT, **fields)
ROWS: list[dict] = []
OUT_DIR: str | None = None  # main() sets it: where record() keeps bench.json current
CEIL = {"copy_tbs": None, "bf16_tflops": None, "fp8_tflops": None}


@triton.jit
def _bench_l2_flush_kernel(ptr, n, WRITE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if WRITE:
        tl.store(ptr + offs, tl.zeros([BLOCK], tl.int32), mask=offs < n)
    else:
        x = tl.load(ptr + offs, mask=offs < n, other=0)
        # never true (the buffer holds zeros): the store keeps the loads alive
        if tl.sum(x, axis=0) == 12345:
            tl.store(ptr + offs, x + 1, mask=offs < n)


_FLUSH = None
# How the L2 is emptied before each timed call. "read" (the default) streams a 256 MB buffer
# through it and leaves only clean lines. "write" (how every table before the eighth session was
# measured; also what the usual zero_() of a buffer does) leaves it full of dirty lines, so the
# timed kernels also pay for writing them back to HBM as they evict them (docs/performance.md,
# "How it was measured", has the A/B). Set by --flush or OPENMSA_BENCH_FLUSH.
FLUSH_MODE = os.environ.get("OPENMSA_BENCH_FLUSH", "read")


def flush_l2():
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.zeros(256 << 20 >> 2, dtype=torch.int32, device="cuda")  # 256 MB > L2
    if FLUSH_MODE not in ("read", "write"):
        raise ValueError(f"flush mode must be 'read' or 'write', got {FLUSH_MODE!r}")
    n = _FLUSH.numel()
    _bench_l2_flush_kernel[(triton.cdiv(n, 4096),)](_FLUSH, n, WRITE=FLUSH_MODE == "write",
                                                     BLOCK=4096)


def device_times_us(fn, iters: int) -> list[float]:
    """Per-call device time (profiler), L2 flushed before each call: the length of the union of
    the call's kernel intervals. A programmatic dependent launch (openmsa's selection and merge
    launches) starts while its predecessor runs, so summing durations would count the overlap
    twice (the indexer's fp8 1M B = 8 step: a 264 µs call summed to 344-399 µs)."""
    return interleaved_device_times_us([fn], iters)[0]


def interleaved_device_times_us(fns, iters: int) -> list[list[float]]:
    """device_times_us of several functions whose calls alternate in one profiled loop (flush,
    fns[0], flush, fns[1], ...), so each comparison's sides run in the same GPU state: the H200
    was seen to switch, between measurements seconds apart, from a state where the 256 MB flush
    takes 60.5 µs to one where it takes 68.7 µs with every kernel about 10% slower."""
    for fn in fns:
        fn()
    flush_l2()  # allocates the flush buffer outside the profiled loop
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            for fn in fns:
                flush_l2()
                fn()
        torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    return split_calls(kernels, len(fns))


def split_calls(kernels, n: int) -> list[list[float]]:
    """(start, end, name) device events -> per function (calls alternate over n functions, each
    after a flush kernel) the union length of each call's events (the sum of the parts
    added_by_kernel gives them)."""
    calls = [sum(parts.values()) for parts in added_by_kernel(kernels)]
    return [calls[i::n] for i in range(n)]


def _union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by intervals sorted by start (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def warm_capture(fn):
    """Capture fn once and drop the graph: the arrival counters an op makes for the capture
    stream (ops/common/counters.py) then exist before a timed capture, which would otherwise
    make them inside its graph and replay their zero fill with every call."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    del g


def graph_call_us(fn, iters: int) -> float:
    """What one call costs inside a captured step: graphs of (flush, fn) and of (flush) alone are
    each replayed `iters` times back to back between two events (the host queues replays ahead,
    so the GPU never idles between them, as inside an engine's step graph); the per-replay
    difference, median of 5 such batches. (Timing each replay alone, synchronised, measured a
    GPU that idled before every replay: medians moved by 10-18 µs between identical configs.)"""
    warm_capture(fn)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g_both, g_flush = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_both):
        flush_l2()
        fn()
    with torch.cuda.graph(g_flush):
        flush_l2()

    def per_replay(g):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            g.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3 / iters

    per_replay(g_both)
    per_replay(g_flush)
    diffs = [per_replay(g_both) - per_replay(g_flush) for _ in range(5)]
    return max(0.0, statistics.median(diffs))


def eager_call_us(fn, iters: int) -> float:
    """Median wall time of an eager call (host launch included), L2 flushed before each."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        flush_l2()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e6)
    return statistics.median(ts)


STARTED = time.monotonic()


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def record(**row):
    ROWS.append(row)
    keys = [k for k in row if k not in ("section",)]
    # progress: rows so far and the run's elapsed time, so a long run shows where it is
    print(f"[{len(ROWS)} {time.monotonic() - STARTED:.0f}s] "
          + " | ".join(f"{k}={_fmt(row[k])}" for k in keys), flush=True)
    if OUT_DIR is not None:
        save()


def save():
    """bench.json after every row, so a call that runs out of time brings back what finished."""
    with open(os.path.join(OUT_DIR, "bench.json"), "w") as f:
        json.dump({"provenance": provenance(), "rows": ROWS}, f, indent=1)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def load_flashinfer():
    try:
        import flashinfer.msa_ops as fi  # noqa: F401
        return fi
    except Exception as e:  # noqa: BLE001
        print(f"# FlashInfer not available: {type(e).__name__}: {e}")
        return None


def failure_reason(e: BaseException, limit: int = 400) -> str:
    """An exception in one line: its first line, then the lines of its text that name an error
    (a JIT build's compiler errors come after a first line that says only that the build
    failed), cut to `limit` characters."""
    lines = [ln.strip() for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
    errors = [ln for ln in lines[1:] if "error" in ln.lower()][:3]
    return " | ".join(lines[:1] + errors)[:limit]


def try_peer(fn, reasons: dict | None = None, key: str | None = None):
    """A peer call (or a dense timing) that returns its result; None, with the reason printed
    (and, given `reasons`, kept there under `key`), when it cannot run this shape."""
    try:
        out = fn()
        torch.cuda.synchronize()
        return out
    except Exception as e:  # noqa: BLE001
        why = failure_reason(e)
        print(f"#   not run: {why}"[:400])
        if reasons is not None:
            reasons[key] = why
        return None


def peer_failure(fn) -> str | None:
    """Run a peer call once: None when it ran, else why it cannot run this shape (printed too).
    (Peers that write into an out= buffer return None, so the result itself says nothing.)"""
    try:
        fn()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        print(f"#   peer not run: {msg}")
        return msg


def load_vllm():
    """vLLM 0.34's own MiniMax-M3 kernels for Hopper (the indexer, the split-K sparse decode and
    the query-tiled sparse prefill), from .peers-vllm (the shared tool prepare-vllm-peer.sh
    writes it; on the GPU machine carry it and put it first on PYTHONPATH). None when absent."""
    try:
        from vllm.models.minimax_m3.common.ops import index_topk, sparse_attn
        from vllm.models.minimax_m3.nvidia.ops import sparse_prefill
    except Exception as e:  # noqa: BLE001
        print(f"# vLLM kernels not available: {type(e).__name__}: {e}")
        return None
    import types
    return types.SimpleNamespace(
        index_decode=index_topk.minimax_m3_index_decode,
        index_score=index_topk.minimax_m3_index_score,
        index_topk=index_topk.minimax_m3_index_topk,
        attn_decode=sparse_attn.minimax_m3_sparse_attn_decode,
        attn_prefill=sparse_prefill.minimax_m3_sparse_attn)


VLLM = None  # main() loads it unless --no-peers (or --no-vllm)
DEADLINE = None  # time.monotonic() after which no new case starts (--budget-s)
MODELS = None  # --models: the model names the sections run (None: every one their grids name)


def check_budget():
    """Raises when --budget-s is spent: the case is recorded as not run, the run goes on to
    save what it has (a device call is cut at 600 s, and JSON written by then comes back)."""
    if DEADLINE is not None and time.monotonic() > DEADLINE:
        raise TimeoutError("the run's --budget-s was spent before this case")


def _keep(model_name) -> bool:
    return MODELS is None or model_name in MODELS
# an output differing from ours by more than this (max |diff|, bf16 outputs of unit-scale
# random inputs) marks a peer as disagreeing; its row still gets its times, flagged
ATOL = 0.05
# two selections of one row whose chosen blocks' scores, sorted, differ by at most this
# (relative to the row's largest chosen |score|, at least 1) differ only where scores tie or
# nearly tie (rounding of different accumulation orders)
TIE_RTOL = 2e-3


def _not_run(e: BaseException) -> str:
    return "not run: " + f"{type(e).__name__}: {e}".splitlines()[0][:200]


def _as_sets(idx: torch.Tensor) -> torch.Tensor:
    """[T, H, K] block ids -> each row's ids ascending, -1 padding as a sentinel at the end:
    two rows hold the same set of blocks iff these rows are equal (ids are distinct)."""
    x = idx.long()
    x = torch.where(x < 0, torch.full_like(x, 1 << 40), x)
    return x.sort(-1).values


def compare_selections(ours: torch.Tensor, theirs: torch.Tensor, scores=None) -> dict:
    """Selections compared as sets per (token, index head) row, both [T, H, K]. `scores`, a
    callable giving openmsa's fp32 block scores [T, H, max_blocks], lets the rows that differ
    be split into near-ties and real disagreements: a differing row whose two sets' scores,
    each sorted, match within TIE_RTOL chose different blocks of (nearly) equal scores, which
    the spec's tie rule (lower block id) and a peer's sort may order differently."""
    a, b = _as_sets(ours), _as_sets(theirs)
    differ = (a != b).any(-1)
    n = int(differ.sum())
    res = dict(rows=differ.numel(), rows_differ=n)
    if n == 0:
        res["rows_beyond_ties"] = 0
        return res
    if scores is None:
        return res
    s = scores()
    t, h = differ.nonzero(as_tuple=True)
    rows = s[t, h].float()

    def chosen_scores(sel):
        valid = sel < (1 << 40)
        got = rows.gather(-1, torch.where(valid, sel, 0))
        got = torch.where(valid, got, torch.full_like(got, float("-inf")))
        return got.sort(-1, descending=True).values
    sa, sb = chosen_scores(a[t, h]), chosen_scores(b[t, h])
    same_count = ((a[t, h] < (1 << 40)).sum(-1) == (b[t, h] < (1 << 40)).sum(-1))
    fin = torch.isfinite(sa) & torch.isfinite(sb)
    scale = torch.where(fin, sa.abs(), torch.zeros_like(sa)).amax(-1).clamp(min=1.0)
    close = torch.where(fin, (sa - sb).abs() <= TIE_RTOL * scale[:, None], sa == sb).all(-1)
    res["rows_beyond_ties"] = int((~(close & same_count)).sum())
    return res


def selection_fields(name: str, ours, theirs, scores) -> dict:
    """A peer's selection check as row fields: {name}_rows_differ (rows whose block sets
    differ), {name}_rows_beyond_ties (of those, rows not explained by near-tied scores) and
    {name}_agrees (no row beyond ties)."""
    try:
        c = compare_selections(ours, theirs, scores)
    except Exception as e:  # noqa: BLE001
        return {f"{name}_check": _not_run(e)}
    out = {f"{name}_rows_differ": c["rows_differ"]}
    if "rows_beyond_ties" in c:
        out[f"{name}_rows_beyond_ties"] = c["rows_beyond_ties"]
        out[f"{name}_agrees"] = c["rows_beyond_ties"] == 0
    if c["rows_differ"]:
        print(f"#   {name}: {c['rows_differ']} of {c['rows']} rows select other blocks, "
              f"{c.get('rows_beyond_ties', '?')} beyond near-ties")
    return out


def output_fields(name: str, ours, theirs) -> dict:
    diff = float((ours.float() - theirs.float()).abs().max())
    if not diff <= ATOL:
        print(f"#   {name}: output differs from ours by {diff:.3g} (> {ATOL})")
    return {f"max_diff_vs_{name}": diff, f"{name}_agrees": diff <= ATOL}


def peer_graph_us(fn, iters, out=None) -> tuple[float | None, str | None]:
    """A peer's call as a graph replay (graph_call_us: one warm-up call outside the capture,
    then graphs replayed with the same buffers), or (None, why) when capture fails. With `out`
    (the buffer the call writes), the replays' result is checked against the eager one."""
    want = out.clone() if out is not None else None
    try:
        us = graph_call_us(fn, iters)
    except Exception as e:  # noqa: BLE001
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        why = "not captured: " + f"{type(e).__name__}: {e}".splitlines()[0][:200]
        print(f"#   {why}")
        return None, why
    if want is not None and not torch.equal(out, want):
        return us, "replay differs from the eager call"
    return us, None


def time_peers(ours, peers: dict, iters: int, graph: bool = True) -> tuple[float, dict]:
    """Device time of ours and of each checked peer call (name -> fn, or (fn, out buffer)),
    alternating in one profiled loop; per peer also its eager call and (graph=True) its call
    as a graph replay. Returns (our device µs, row fields {name}_us, {name}_call_us (eager),
    {name}_graph_us, {name}_graph (why not, when not), {name}_ratio = ours / theirs)."""
    fns = {k: (v if callable(v) else v[0]) for k, v in peers.items()}
    times = interleaved_device_times_us([ours, *fns.values()], iters)
    dev = med(times[0])
    row = {}
    for (name, fn), ts in zip(fns.items(), times[1:]):
        row[f"{name}_us"] = med(ts)
        row[f"{name}_ratio"] = dev / med(ts) if med(ts) else None
        row[f"{name}_call_us"] = eager_call_us(fn, max(5, iters // 2))
        if graph:
            out = None if callable(peers[name]) else peers[name][1]
            row[f"{name}_graph_us"], why = peer_graph_us(fn, iters, out)
            if why:
                row[f"{name}_graph"] = why
    if "fi_ratio" in row:
        row["ratio"] = row["fi_ratio"]  # the name the earlier tables (report.py) read
    return dev, row


def ceilings(args, fi=None):
    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = med(device_times_us(lambda: dst.copy_(src), 20))
    CEIL["copy_tbs"] = 2 * n / t / 1e6
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    t = med(device_times_us(lambda: a @ b, 20))
    CEIL["bf16_tflops"] = 2 * m ** 3 / t / 1e6
    a8, b8 = a.to(FP8), b.to(FP8).t().contiguous().t()
    one = torch.ones((), device="cuda")
    try:
        t = med(device_times_us(lambda: torch._scaled_mm(a8, b8, one, one,
                                                          out_dtype=torch.bfloat16), 20))
        CEIL["fp8_tflops"] = 2 * m ** 3 / t / 1e6
    except Exception as e:  # noqa: BLE001
        print(f"# fp8 matmul ceiling not measured: {e}")
    record(section="ceilings", **{k: v for k, v in CEIL.items() if v is not None})


def _index_step(batch, context, q_len, heads, dtype, seed=0):
    """A step's index query and paged one-head index cache. dtype "nvfp4": the cache in
    openmsa.nvfp4's page layout (uint8 [P, 128, 72]) quantized from random keys, the query fp8."""
    bs = 128
    nb = context // bs
    pages = batch * nb
    g = torch.Generator(device="cuda").manual_seed(seed)
    if dtype == "nvfp4":
        cache = _nvfp4_cache(pages, g)
        dtype = FP8
    else:
        cache = torch.randn(pages, bs, 128, device="cuda", generator=g, dtype=torch.bfloat16)
        cache = cache.to(dtype)
    table = torch.randperm(pages, device="cuda", generator=g).int().view(batch, nb)
    cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device="cuda")
    seq = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * q_len, heads, 128, device="cuda", generator=g).to(dtype)
    return q, cache, cu, seq, table


def _nvfp4_cache(pages, g, step=1024):
    """An NVFP4 index cache (openmsa.nvfp4: 72 bytes a token) of random keys, quantized in
    slices of `step` pages (no full-size fp32 temporary)."""
    from openmsa import nvfp4
    cache = torch.empty(pages, 128, nvfp4.TOKEN_BYTES, dtype=torch.uint8, device="cuda")
    codes, scales = nvfp4.page_parts(cache)
    for i in range(0, pages, step):
        n = min(step, pages - i)
        keys = torch.randn(n * 128, nvfp4.HEAD_DIM, device="cuda", generator=g)
        c, sc = nvfp4.quantize_index_keys(keys)
        codes[i:i + n] = c.view(n, 128, -1)
        scales[i:i + n] = sc.view(n, 128, -1)
    return cache


def _fi_select(fi, q, cache, cu, seq, table, q_len):
    """FlashInfer's indexer: proxy score over the paged one-head index cache, then top-16."""
    ctx = seq.repeat_interleave(torch.diff(cu))
    off = torch.arange(q.shape[0], device="cuda", dtype=torch.int32) - \
        cu[:-1].repeat_interleave(torch.diff(cu))
    nvp = ((ctx - torch.diff(cu).repeat_interleave(torch.diff(cu)) + off) // 128 + 1).int()
    k4 = cache.unsqueeze(1)  # [P, 1, B, Di]
    width = table.shape[1]

    def run():
        s = fi.msa_proxy_score(q, k4, cu, page_table=table, seqused_k=seq, max_seqlen_q=q_len,
                               max_k_tiles=width)
        return fi.msa_topk_select(s, 16, num_valid_pages=nvp, force_end_blocks=1)
    return run


def _vllm_decode_select(vl, q, cache, seq, table, q_len, heads, out_t):
    """vLLM's decode indexer (split-K score + split-K top-k, init 0 / local 1 blocks as M3)
    into out_t [H, T, 16] (their layout; logical block ids, -1 padded, in score order)."""
    context = table.shape[1] * 128
    return lambda: vl.index_decode(q, cache, table, seq, context, 16, 0, 1, heads, q_len, q_len,
                                   out=out_t)


def _vllm_prefill_select(vl, q, cache, cu, seq, table, chunk, heads, out_t):
    """vLLM's prefill indexer: block scores of the chunk ([H, T, blocks] fp32), then top-k."""
    prefix = seq - chunk
    max_seq = table.shape[1] * 128

    def run():
        s = vl.index_score(q, cache, table, cu, seq, prefix, chunk, max_seq, heads)
        return vl.index_topk(s, cu, prefix, chunk, 16, 0, 1, out=out_t)
    return run


def indexer_decode_grid(args) -> dict:
    return shapes.INDEXER_DECODE_QUICK if args.quick else shapes.INDEXER_DECODE


def indexer_decode_steps(grid):
    """(model, dtype, L, B) of the indexer-decode section in run order (each at every q_len);
    an index cache of over 40 GB is left out."""
    dtypes = tuple(grid["dtypes"]) + tuple(grid.get("openmsa_only_dtypes", ()))
    for model_name in filter(_keep, ("m3-tp1", "m3-tp4")):
        for dname in dtypes:
            for context in grid["contexts"]:
                for batch in grid["batches"]:
                    if batch * context * 128 * (2 if dname == "bf16" else 1) <= 40e9:
                        yield model_name, dname, context, batch


def indexer_decode(args, fi):
    grid = indexer_decode_grid(args)
    for model_name, dname, context, batch in indexer_decode_steps(grid):
        heads = shapes.MODELS[model_name].num_index_heads
        for q_len in grid["q_lens"]:
            try:
                _indexer_decode_case(fi, model_name, heads, dname, context, batch, q_len, args)
            except Exception as e:  # noqa: BLE001
                record(section="indexer-decode", model=model_name, dtype=dname, L=context,
                       B=batch, q_len=q_len, note=_not_run(e))
        torch.cuda.empty_cache()


# the largest dense K + V (bf16) the indexer section allocates for its dense-attention time
DENSE_BYTES = 70e9
# bytes of one index-cache token (Di = 128) per cache dtype: NVFP4 is 64 code bytes and 8
# scale bytes (openmsa.nvfp4)
TOKEN_BYTES = {"bf16": 256, "fp8": 128, "nvfp4": 72}


def _indexer_decode_case(fi, model_name, heads, dname, context, batch, q_len, args):
    check_budget()
    nvfp4 = dname == "nvfp4"
    q, cache, cu, seq, table = _index_step(batch, context, q_len, heads,
                                           "nvfp4" if nvfp4 else DTYPES[dname])
    out = torch.empty(q.shape[0], heads, 16, dtype=torch.int32, device="cuda")
    # max_q_len as FlashInfer's max_seqlen_q: the engine's bound on q_len (a speed hint)
    ours = lambda: openmsa.select_blocks(q, cache, cu, seq, table, out=out,  # noqa: E731
                                         max_q_len=q_len)
    ours()
    torch.cuda.synchronize()
    nbytes = batch * context * TOKEN_BYTES[dname]
    scores = functools.partial(openmsa.block_scores, q, cache, cu, seq, table, max_q_len=q_len)
    peers, check = {}, {}
    if fi is not None and not nvfp4:
        run = _fi_select(fi, q, cache, cu, seq, table, q_len)
        theirs = try_peer(run)
        if theirs is not None:
            # the earlier tables' column: rows equal as ordered lists
            check["same_rows"] = float((theirs == out).all(-1).float().mean())
            check.update(selection_fields("fi", out, theirs, scores))
            peers["fi"] = run
        else:
            check["fi"] = "not run"
    if VLLM is not None and not nvfp4:
        out_t = torch.empty(heads, q.shape[0], 16, dtype=torch.int32, device="cuda")
        run = _vllm_decode_select(VLLM, q, cache, seq, table, q_len, heads, out_t)
        failure = peer_failure(run)
        if failure is None:
            check.update(selection_fields("vllm", out, out_t.transpose(0, 1), scores))
            peers["vllm"] = (run, out_t)
        else:
            check["vllm"] = f"not run: {failure}"
    if peers:
        # ours and the peers' calls alternate in one profiled loop: all in one GPU state
        dev, timed = time_peers(ours, peers, args.iters)
    else:
        dev, timed = med(device_times_us(ours, args.iters)), {}
    call = graph_call_us(ours, args.iters)
    row = dict(section="indexer-decode", model=model_name, dtype=dname, L=context, B=batch,
               q_len=q_len, us=dev, call_us=call, tbs=nbytes / dev / 1e6,
               pct_copy=100 * nbytes / dev / 1e6 / CEIL["copy_tbs"] if CEIL["copy_tbs"] else None,
               **timed, **check)
    if nvfp4:
        row["query"] = "fp8"
    if dname == "fp8" and q_len == 1:
        # what the selection saves: dense bf16 attention over the whole context, once per
        # (model, L, B) (benchmarks/plot.py draws it beside the indexers)
        model = shapes.MODELS[model_name]
        if batch * context * model.num_kv_heads * model.head_dim * 4 < DENSE_BYTES:
            row["dense_us"] = try_peer(lambda: _dense_decode_us(model, batch, context, 1, args))
    record(**row)


def indexer_prefill(args, fi):
    """One prefill chunk per row: TP1's four index heads at long contexts, and TP4's one index
    head (shapes.INDEXER_PREFILL_SHORT) at short ones, where the fixed costs of a call show."""
    grids = [shapes.INDEXER_PREFILL]
    if hasattr(shapes, "INDEXER_PREFILL_SHORT"):
        grids.append(shapes.INDEXER_PREFILL_SHORT)
    for grid in grids:
        chunk = grid["chunk"]
        dtypes = tuple(grid["dtypes"]) + tuple(grid.get("openmsa_only_dtypes", ()))
        for model_name in filter(_keep, grid.get("models", ("m3-tp1",))):
            heads = shapes.MODELS[model_name].num_index_heads
            for dname in dtypes:
                for context in grid["contexts"]:
                    try:
                        _indexer_prefill_case(fi, model_name, heads, dname, context, chunk, args)
                    except Exception as e:  # noqa: BLE001
                        record(section="indexer-prefill", model=model_name, dtype=dname,
                               context=context, T=chunk, note=_not_run(e))
                    torch.cuda.empty_cache()


# the indexer-prefill rows of an NVFP4 index cache (fp8 query): dtype name -> the prefill form
# (IndexerConfig.nvfp4_prefill) they time, openmsa alone
NVFP4_PREFILL_FORMS = {"nvfp4": "inkernel", "nvfp4-staged": "staged"}


def _indexer_prefill_case(fi, model_name, heads, dname, context, chunk, args):
    check_budget()
    form = NVFP4_PREFILL_FORMS.get(dname)
    q, cache, cu, seq, table = _index_step(1, context + chunk, chunk, heads,
                                           "nvfp4" if form else DTYPES[dname])
    config = openmsa.IndexerConfig(nvfp4_prefill=form or "auto")
    out = torch.empty(chunk, heads, 16, dtype=torch.int32, device="cuda")
    ours = lambda: openmsa.select_blocks(q, cache, cu, seq, table, out=out,  # noqa: E731
                                         max_q_len=chunk, config=config)
    ours()
    torch.cuda.synchronize()
    flops = 2 * heads * 128 * chunk * (context + chunk / 2)
    iters = max(5, args.iters // 4)
    scores = functools.partial(openmsa.block_scores, q, cache, cu, seq, table, max_q_len=chunk,
                               config=config)
    peers, check = {}, {}
    if fi is not None and not form:
        run = _fi_select(fi, q, cache, cu, seq, table, chunk)
        theirs = try_peer(run)
        if theirs is not None:
            check["same_rows"] = float((theirs == out).all(-1).float().mean())
            check.update(selection_fields("fi", out, theirs, scores))
            peers["fi"] = run
        else:
            check["fi"] = "not run"
    if VLLM is not None and not form:
        out_t = torch.empty(heads, chunk, 16, dtype=torch.int32, device="cuda")
        run = _vllm_prefill_select(VLLM, q, cache, cu, seq, table, chunk, heads, out_t)
        failure = peer_failure(run)
        if failure is None:
            check.update(selection_fields("vllm", out, out_t.transpose(0, 1), scores))
            peers["vllm"] = (run, out_t)
        else:
            check["vllm"] = f"not run: {failure}"
    if peers:
        # interleaved, as in the decode sections: all sides in one GPU state
        dev, timed = time_peers(ours, peers, iters)
    else:
        dev, timed = med(device_times_us(ours, iters)), {}
    # (both NVFP4 forms run 16-bit MMAs: fp16 keys against the fp8 query as fp16)
    ceil = CEIL["fp8_tflops" if dname == "fp8" else "bf16_tflops"]
    row = dict(section="indexer-prefill", model=model_name, dtype=dname, context=context,
               T=chunk, us=dev, call_us=graph_call_us(ours, iters), tflops=flops / dev / 1e6,
               pct_mm=100 * flops / dev / 1e6 / ceil if ceil else None, **timed, **check)
    if form:
        row.update(query="fp8", form=form)
    for name in ("fi", "vllm"):
        if row.get(f"{name}_us"):
            row[f"{name}_tflops"] = flops / row[f"{name}_us"] / 1e6
    record(**row)


def _attention_step(model, batch, context, q_len, dname, seed=0, shared=1, jitter=0.0):
    """Packed vLLM-style cache [P, Hkv, B, 2D] (K first), random selections with the own block.
    With shared > 1, runs of `shared` consecutive tokens pick the same 15 earlier blocks (the
    locality neighbouring prefill tokens have in practice); 1 makes every token independent.
    jitter > 0 adds per-token noise of that size to the shared block scores (uniform in [0, 1)),
    so neighbours share most but not all of their blocks."""
    bs, d = 128, model.head_dim
    hkv = model.num_kv_heads
    nb = -(-context // bs)
    pages = batch * nb
    g = torch.Generator(device="cuda").manual_seed(seed)
    packed = torch.randn(pages, hkv, bs, 2 * d, device="cuda", generator=g,
                         dtype=torch.bfloat16).to(DTYPES[dname])
    table = torch.randperm(pages, device="cuda", generator=g).int().view(batch, nb)
    cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device="cuda")
    seq = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    t = batch * q_len
    q = torch.randn(t, model.num_heads, d, device="cuda", generator=g, dtype=torch.bfloat16)
    pos = context - q_len + torch.arange(q_len, device="cuda").repeat(batch)
    n = pos // bs + 1
    # 15 distinct earlier blocks + the own block, ascending
    r = torch.rand(-(-t // shared), model.num_index_heads, nb, device="cuda", generator=g)
    r = r.repeat_interleave(shared, 0)[:t]
    if jitter:
        r = r + jitter * torch.rand(r.shape, device="cuda", generator=g)
    r = torch.where(torch.arange(nb, device="cuda")[None, None, :] < (n - 1)[:, None, None], r,
                    -1.0)
    idx = torch.cat([r.topk(15, dim=-1).indices.int(),
                     (n - 1).int()[:, None, None].expand(-1, model.num_index_heads, 1)], -1)
    idx = idx.sort(-1).values.contiguous()
    return q, packed, idx, cu, seq, table


def _restrict_grids(key: str, values: set) -> None:
    """Every shapes grid's `key` (contexts, batches) restricted to `values`, where that leaves
    any (a section's grid is a dict of shapes; the restriction is for one run)."""
    for grid in vars(shapes).values():
        if isinstance(grid, dict) and isinstance(grid.get(key), tuple):
            kept = tuple(v for v in grid[key] if v in values)
            if kept:
                grid[key] = kept


def _restrict_dtypes(values: set) -> None:
    """Every shapes grid's key dtypes (peers' and openmsa-only ones together) restricted to
    `values`, where that leaves any (for one run, as _restrict_grids)."""
    for grid in vars(shapes).values():
        if isinstance(grid, dict) and isinstance(grid.get("dtypes"), tuple):
            names = ("dtypes", "openmsa_only_dtypes")
            if any(v in values for name in names for v in grid.get(name, ())):
                for name in names:
                    if name in grid:
                        grid[name] = tuple(v for v in grid[name] if v in values)


def _models(grid):
    """(name, config) of the models a section's grid names."""
    return [(name, shapes.MODELS[name]) for name in grid["models"] if _keep(name)]


def attention_decode(args, fi):
    grid = shapes.ATTENTION_DECODE
    context = grid["context"]
    for model_name, model in _models(grid):
        for dname in grid["dtypes"]:
            for batch in grid["batches"]:
                for q_len in grid["q_lens"]:
                    try:
                        _attention_decode_case(fi, model_name, model, dname, batch, context,
                                               q_len, args)
                    except Exception as e:  # noqa: BLE001
                        record(section="attention-decode", model=model_name, dtype=dname,
                               B=batch, q_len=q_len, L=context, note=_not_run(e))
                torch.cuda.empty_cache()


def _attention_decode_case(fi, model_name, model, dname, batch, context, q_len, args):
    check_budget()
    q, packed, idx, cu, seq, table = _attention_step(model, batch, context, q_len, dname)
    d = model.head_dim
    k = packed[..., :d].permute(0, 2, 1, 3)
    v = packed[..., d:].permute(0, 2, 1, 3)
    out = torch.empty_like(q)
    ours = lambda: openmsa.sparse_attention(q, k, v, idx, cu, seq, table, out=out)  # noqa
    ours()
    torch.cuda.synchronize()
    t = q.shape[0]
    nbytes = t * model.num_kv_heads * 16 * 128 * 2 * d * packed.element_size()
    # the peers' selection layout: [Hkv(=H), T, K], laid out once outside the timed calls
    idx_t = idx.permute(1, 0, 2).contiguous()
    peers, check = {}, {}
    if fi is not None and dname == "fp8":
        kf, vf = packed[..., :d], packed[..., d:]
        fo = torch.empty_like(q)
        run = lambda: fi.msa_sparse_decode_attention(  # noqa: E731
            q, kf, vf, idx_t, page_table=table, seqused_k=seq, seqlen_q=q_len, out=fo)
        failure = peer_failure(run)
        if failure is None:
            check.update(output_fields("fi", out, fo))
            peers["fi"] = (run, fo)
        else:
            check["fi"] = f"not run: {failure}"
    if VLLM is not None:
        vo = torch.empty_like(q)
        run = lambda: VLLM.attn_decode(  # noqa: E731
            q, packed, idx_t, table, seq, model.num_kv_heads, d ** -0.5, vo, q_len)
        failure = peer_failure(run)
        if failure is None:
            check.update(output_fields("vllm", out, vo))
            peers["vllm"] = (run, vo)
        else:
            check["vllm"] = f"not run: {failure}"
    if peers:
        # ours and the peers' calls alternate in one profiled loop: all in one GPU state
        dev, timed = time_peers(ours, peers, args.iters)
    else:
        dev, timed = med(device_times_us(ours, args.iters)), {}
    call = graph_call_us(ours, args.iters)
    row = dict(section="attention-decode", model=model_name, dtype=dname, B=batch, q_len=q_len,
               L=context, us=dev, call_us=call, tbs=nbytes / dev / 1e6,
               pct_copy=100 * nbytes / dev / 1e6 / CEIL["copy_tbs"] if CEIL["copy_tbs"] else None,
               **timed, **check)
    if dname == "bf16" and batch * context * model.num_kv_heads * d * 4 < 24e9:
        row["dense_us"] = try_peer(lambda: _dense_decode_us(model, batch, context, q_len, args))
    record(**row)


def _dense_decode_us(model, batch, context, q_len, args):
    """Dense GQA attention over the whole context (SDPA, flash backend when it takes it)."""
    from torch.nn.attention.bias import causal_lower_right
    d = model.head_dim
    kk = torch.randn(batch, model.num_kv_heads, context, d, device="cuda", dtype=torch.bfloat16)
    vv = torch.randn_like(kk)
    qq = torch.randn(batch, model.num_heads, q_len, d, device="cuda", dtype=torch.bfloat16)
    mask = causal_lower_right(q_len, context) if q_len > 1 else None
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        qq, kk, vv, attn_mask=mask, enable_gqa=True)
    return med(device_times_us(fn, max(5, args.iters // 2)))


# prefill selections: (label, runs of tokens sharing one selection, per-token jitter)
PREFILL_SELECTIONS = (("shared by 16", 16, 0.0), ("shared by 16, jitter 0.2", 16, 0.2),
                      ("independent", 1, 0.0))


def sm_clock_mhz():
    """The GPU's SM clock now, from nvidia-smi (None without it). Sampled right after a row's
    timing loop, while the GPU still runs at that loop's clock: whether a slow row ran slower
    clocks (the prefill table's rows after long ones, docs/performance.md). The device index
    is torch's, which is nvidia-smi's unless CUDA_VISIBLE_DEVICES reorders them."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm",
                              "--format=csv,noheader,nounits",
                              "-i", str(torch.cuda.current_device())], capture_output=True,
                             text=True, timeout=10)
        return int(out.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def attention_prefill(args, fi):
    """Per chunk: the default path (union tiles where the device takes them, per-token for the
    rest) and the per-token kernel alone (AttentionConfig tiles=False), on three kinds of
    selections."""
    per_token_config = attention_config(dict(tiles=False))
    grid = shapes.ATTENTION_PREFILL
    chunk = grid["chunk"]
    for model_name, model in _models(grid):
        for dname in grid["dtypes"]:
            for context, (label, shared, jitter) in itertools.product(grid["contexts"],
                                                                       PREFILL_SELECTIONS):
                if DEADLINE is not None and time.monotonic() > DEADLINE:
                    record(section="attention-prefill", model=model_name, dtype=dname,
                           context=context, T=chunk, selections=label,
                           note="not run: the run's --budget-s was spent before this case")
                    continue
                q, packed, idx, cu, seq, table = _attention_step(model, 1, context + chunk, chunk,
                                                                 dname, shared=shared,
                                                                 jitter=jitter)
                d = model.head_dim
                k = packed[..., :d].permute(0, 2, 1, 3)
                v = packed[..., d:].permute(0, 2, 1, 3)
                out = torch.empty_like(q)
                ours = lambda: openmsa.sparse_attention(q, k, v, idx, cu, seq, table,  # noqa
                                                        out=out)
                ours()
                flops = 4 * model.num_heads * d * 16 * 128 * chunk
                # (a call is 0.3-5 ms: --iters calls, at least 10, cost little; 5 left the
                # median of the TP1 fp8 row after 8K 1274-1444 µs across three runs)
                iters = max(10, args.iters)
                peer = _vllm_prefill_attention(model, q, packed, idx, cu, seq, table, chunk,
                                               out, ours, iters)
                dev = peer.pop("us", None)
                if dev is None:
                    dev = med(device_times_us(ours, iters))
                mhz = sm_clock_mhz()
                parts = breakdown_by_part_us(ours, iters)
                want = out.clone()
                alone = lambda: openmsa.sparse_attention(  # noqa: E731
                    q, k, v, idx, cu, seq, table, out=out, config=per_token_config)
                alone()
                per_token = med(device_times_us(alone, iters))
                same = float((out.float() - want.float()).abs().max())
                # the per-token form's memory roof on the same selections (rows the tiles
                # cannot take: docs/history/2026-12-02-attention-prefill-41bc87e.md)
                gather = gather_roof_us(k, v, idx, table, iters) if shared == 1 or jitter \
                    else None
                gather_bytes = chunk * model.num_kv_heads * idx.shape[2] * 128 * 2 * d \
                    * packed.element_size()
                row = dict(section="attention-prefill", model=model_name, dtype=dname,
                           context=context, T=chunk, selections=label,
                           union4=_mean_union(idx, 4), us=dev, tflops=flops / dev / 1e6,
                           pct_bf16_mm=100 * flops / dev / 1e6 / CEIL["bf16_tflops"]
                           if CEIL["bf16_tflops"] else None, per_token_us=per_token,
                           max_diff_vs_per_token=same, sm_mhz=mhz, gather_us=gather,
                           gather_tbs=gather_bytes / gather / 1e6 if gather else None,
                           **{f"{k}_us": v for k, v in parts.items()}, **peer)
                if dname == "bf16" and shared == 16 and jitter == 0.0:
                    row["dense_us"] = try_peer(lambda: _dense_prefill_us(model, context, chunk,
                                                                          args))
                record(**row)
                q = packed = idx = None  # (the lambdas above hold them; freed before the next case)
                torch.cuda.empty_cache()


def _vllm_prefill_attention(model, q, packed, idx, cu, seq, table, chunk, out, ours, iters):
    """vLLM's Hopper query-tiled sparse prefill (bf16 and fp8 K/V; FlashInfer 0.7.4 has no
    sparse prefill) on the same chunk: its output checked against ours (`out`, already
    written), then both timed alternating in one profiled loop. Row fields, and "us" (our
    device time from that loop) when it ran."""
    if VLLM is None:
        return {}
    try:
        idx_t = idx.permute(1, 0, 2).contiguous()  # their [Hkv(=H), T, K], once
        vo = torch.empty_like(q)
        prefix = seq - chunk
        run = lambda: VLLM.attn_prefill(  # noqa: E731
            q, packed, idx_t, table, cu, seq, prefix, chunk, model.num_kv_heads,
            model.head_dim ** -0.5, vo)
        failure = peer_failure(run)
        if failure is not None:
            return {"vllm": f"not run: {failure}"}
        fields = output_fields("vllm", out, vo)
        dev, timed = time_peers(ours, {"vllm": (run, vo)}, iters, graph=False)
        return dict(us=dev, **timed, **fields)
    except Exception as e:  # noqa: BLE001
        return {"vllm": _not_run(e)}


@triton.jit
def _bench_gather_kernel(k_ptr, v_ptr, idx_ptr, table_ptr, out_ptr, stride_kp, stride_kb,
                         stride_kh, stride_vp, stride_vb, stride_vh, stride_it, stride_ih,
                         HKV: tl.constexpr, HIDX: tl.constexpr, K: tl.constexpr,
                         BLOCK: tl.constexpr, D: tl.constexpr):
    """One program per (token, KV head): the K and V tiles of its K selected blocks, summed.
    The reads of the per-token attention kernel without its math: that form's memory roof."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, BLOCK)[:, None].to(tl.int64)
    cols = tl.arange(0, D)[None, :]
    acc = tl.zeros((BLOCK, D), tl.float32)
    for j in range(K):
        blk = tl.load(idx_ptr + t * stride_it + (h * HIDX // HKV) * stride_ih + j)
        page = tl.load(table_ptr + blk).to(tl.int64)
        acc += tl.load(k_ptr + page * stride_kp + h * stride_kh + rows * stride_kb
                       + cols).to(tl.float32)
        acc += tl.load(v_ptr + page * stride_vp + h * stride_vh + rows * stride_vb
                       + cols).to(tl.float32)
    tl.store(out_ptr + (t * HKV + h) * D + tl.arange(0, D), tl.sum(acc, 0))


def gather_roof_us(k, v, idx, table, iters):
    """Device µs of reading every (token, KV head)'s selected K/V blocks once (one request,
    page table row 0, every entry valid): what the per-token kernel reads, at the rate a plain
    gather gets. Its bytes: T * Hkv * K * 128 * 2 * D * bytes(kv)."""
    t, hidx, kk = idx.shape
    hkv, d = k.shape[2], k.shape[3]
    assert k.stride(3) == 1 and v.stride(3) == 1 and table.stride(1) == 1
    out = torch.empty(t, hkv, d, device=k.device, dtype=torch.float32)
    fn = lambda: _bench_gather_kernel[(t, hkv)](  # noqa: E731
        k, v, idx, table, out, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), idx.stride(0), idx.stride(1), HKV=hkv, HIDX=hidx, K=kk, BLOCK=k.shape[1],
        D=d, num_warps=8, num_stages=3)
    fn()
    return med(device_times_us(fn, iters))


def _mean_union(idx, qt):
    """Mean count of distinct blocks the selections of qt consecutive tokens hold (index head 0):
    what a tile of qt tokens reads."""
    t = idx.shape[0] // qt * qt
    tiles = idx[:t, 0].reshape(-1, qt * idx.shape[2]).sort(-1).values
    return float((1 + (tiles[:, 1:] != tiles[:, :-1]).sum(-1)).float().mean())


def _dense_prefill_us(model, context, chunk, args):
    from torch.nn.attention.bias import causal_lower_right
    d = model.head_dim
    total = context + chunk
    kk = torch.randn(1, model.num_heads, total, d, device="cuda", dtype=torch.bfloat16)
    vv = torch.randn_like(kk)
    qq = torch.randn(1, model.num_heads, chunk, d, device="cuda", dtype=torch.bfloat16)
    mask = causal_lower_right(chunk, total)
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv,  # noqa: E731
                                                                  attn_mask=mask)
    return med(device_times_us(fn, max(5, args.iters // 4)))


# the sparse layer: preparation + indexer + sparse attention, against the same layer with dense
# attention over the whole context

def kernel_breakdown_us(fn, iters: int) -> dict[str, float]:
    """Median time each kernel (by name) adds to a call's device time over `iters` calls, L2
    flushed before each (added_by_kernel: a programmatic dependent's wait for the launch before
    it counts as that launch's time, and the parts add up to the call's device time)."""
    fn()
    flush_l2()  # allocates the flush buffer outside the profiled loop
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush_l2()
            fn()
        torch.cuda.synchronize()
    calls = added_by_kernel([(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                             if e.device_type == torch.autograd.DeviceType.CUDA
                             and e.device_time_total > 0])
    names = {name for call in calls for name in call}
    return {name: med([call.get(name, 0.0) for call in calls]) for name in sorted(names)}


def added_by_kernel(kernels) -> list[dict[str, float]]:
    """(start, end, name) device events -> per call (each after a flush kernel) the time each
    kernel name adds to the call's union of intervals: from its start, or from the latest end
    before it when that is later, to its end. A kernel launched early that waits for the one
    before it adds only what runs past that one's end; the parts of a call add up to its
    device time (split_calls' union)."""
    calls, parts, end = [], None, float("-inf")
    for a, b, name in sorted(kernels):
        if "_bench_l2_flush_kernel" in name:
            if parts is not None:
                calls.append(parts)
            parts, end = {}, float("-inf")
        elif parts is not None:
            parts[name] = parts.get(name, 0.0) + max(0.0, b - max(a, end))
            end = max(end, b)
    if parts is not None:
        calls.append(parts)
    return calls


def breakdown_by_part_us(fn, iters: int) -> dict[str, float]:
    """kernel_breakdown_us summed by part (`_short`: prep, score, topk, attn, ...)."""
    parts: dict[str, float] = {}
    for name, us in kernel_breakdown_us(fn, iters).items():
        parts[_short(name)] = parts.get(_short(name), 0.0) + us
    return parts


def _short(name: str) -> str:
    for key, short in (("tile_plan", "attn-plan"), ("attention_tile", "attn-tile"),
                       ("fused_prepare", "prep"), ("prepare_scores", "prep+score"),
                       ("block_scores", "score"),
                       ("nvfp4_decode", "score"), ("short_rows_topk", "topk"),
                       ("segment_topk", "topk"), ("merge_topk", "topk-merge"),
                       ("sparse_attention", "attn"), ("merge_splits", "attn-merge"),
                       ("flash", "dense-attn"), ("fmha", "dense-attn")):
        if key in name:
            return short
    return "other"


def _layer_case(model, batch, context, q_len, dname):
    """Caches for `batch` requests of `context` tokens (each request's pages consecutive, so the
    dense path can read the same K/V as one [B, Hkv, L, D] view), a planned step, and the
    layer's inputs (the fused projection output and norm weights)."""
    bs, d, di = model.block_size, model.head_dim, model.index_head_dim
    hkv = model.num_kv_heads
    nb = -(-context // bs)
    pages = batch * nb
    # "nvfp4": fp8 K/V and an NVFP4 index cache (openmsa.nvfp4, 72 bytes a token)
    dtype = FP8 if dname == "nvfp4" else DTYPES[dname]
    k_cache = torch.empty(pages, bs, hkv, d, dtype=dtype, device="cuda")
    v_cache = torch.empty_like(k_cache)
    if dname == "nvfp4":
        index_cache = _nvfp4_cache(pages, torch.Generator(device="cuda").manual_seed(0))
    else:
        index_cache = torch.empty(pages, bs, di, dtype=dtype, device="cuda")
    for c in (k_cache, v_cache) + ((index_cache,) if dname != "nvfp4" else ()):
        flat = c.view(pages, -1)
        for i in range(0, pages, 4096):  # fill in slices: no full-size fp32 temporary
            flat[i:i + 4096] = torch.randn(flat[i:i + 4096].shape, device="cuda").to(dtype)
    table = torch.arange(pages, dtype=torch.int32, device="cuda").view(batch, nb)
    planner = openmsa.MSAPlanner(model, max_requests=batch, max_tokens=batch * q_len,
                                 max_blocks=nb, device="cuda")
    meta = planner.plan([q_len] * batch, [context] * batch, table)
    qkv = torch.randn(batch * q_len, sum(projection_widths(model)), device="cuda",
                      dtype=torch.bfloat16)
    w = [torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1 for n in (d, d, di, di)]
    return k_cache, v_cache, index_cache, meta, qkv, w


def _layer_fns(model, k_cache, v_cache, index_cache, meta, qkv, w, batch, context, q_len,
               m=openmsa):
    """(sparse, dense) step functions over a _layer_case; `m`: the openmsa tree to call
    (benchmarks/ab.py passes its base tree). sparse.buffers: (index selection, output);
    sparse.prep: the preparation alone, writing sparse.q_out and sparse.index_q_out
    (benchmarks/stack.py runs FlashInfer's calls after it)."""
    cfg = model
    t = qkv.shape[0]
    q_out = torch.empty(t, cfg.num_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
    iq_out = torch.empty(t, cfg.num_index_heads, cfg.index_head_dim, device="cuda",
                         dtype=FP8 if index_cache.dtype == torch.uint8 else index_cache.dtype)
    idx = torch.empty(t, cfg.num_index_heads, cfg.topk_blocks, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q_out)

    def prep():
        m.fused_prepare(qkv, meta.positions, cfg, *w, k_cache, v_cache, meta.slot_mapping,
                        index_cache, meta.index_slot_mapping, q_out=q_out, index_q_out=iq_out)

    if hasattr(m, "prepare_and_select"):
        def prepare_select():
            m.prepare_and_select(qkv, meta.positions, cfg, *w, k_cache, v_cache,
                                 meta.slot_mapping, index_cache, meta.index_slot_mapping,
                                 meta.cu_seqlens_q, meta.seq_lens, meta.index_block_table,
                                 q_out=q_out, index_q_out=iq_out, out=idx)
    else:
        # (a tree without the preparation inside the scoring launch: benchmarks/ab.py's base
        # tree may predate it)
        def prepare_select():
            prep()
            m.select_blocks(iq_out, index_cache, meta.cu_seqlens_q, meta.seq_lens,
                            meta.index_block_table, topk=cfg.topk_blocks,
                            block_size=cfg.block_size, out=idx)

    def sparse():
        prepare_select()
        m.sparse_attention(q_out, k_cache, v_cache, idx, meta.cu_seqlens_q, meta.seq_lens,
                           meta.block_table, block_size=cfg.block_size, out=out)
    sparse.buffers = (idx, out)
    sparse.prep, sparse.q_out, sparse.index_q_out = prep, q_out, iq_out

    if k_cache.dtype != torch.bfloat16:
        dense = None
    else:
        from torch.nn.attention.bias import causal_lower_right
        kk = k_cache.view(batch, -1, cfg.num_kv_heads, cfg.head_dim)[:, :context].transpose(1, 2)
        vv = v_cache.view(batch, -1, cfg.num_kv_heads, cfg.head_dim)[:, :context].transpose(1, 2)
        qq = q_out.view(batch, q_len, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        mask = causal_lower_right(q_len, context) if q_len > 1 else None

        def dense():
            prep()
            torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask,
                                                             enable_gqa=True)
    return sparse, dense


def _median_device_us(fn, iters):
    return med(device_times_us(fn, iters))


def _engine_dense_fn(model, k_cache, v_cache, q_out, table, batch, context, q_len,
                     backend="fa3"):
    """The dense attention an engine runs over the same paged caches, K/V in their own dtype
    (fp8 included, which SDPA cannot read): FlashInfer's paged decode wrapper for q_len 1
    (tensor cores: M3's 16 query heads per KV head), its prefill wrapper on `backend` (FA3, the
    Hopper one, or FA2) for a chunk; planned once, returning the call. FA3 multiplies in one
    dtype: over fp8 K/V it takes the queries in fp8 too, as an engine's fp8 attention does (the
    queries are cast here, outside the timed call; FA2 reads bf16 queries beside fp8 K/V)."""
    import flashinfer
    bs, nb = model.block_size, table.shape[1]
    dev = k_cache.device
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    indptr = torch.arange(0, (batch + 1) * nb, nb, dtype=torch.int32, device=dev)
    indices = table.reshape(-1).contiguous()
    last = torch.full((batch,), context - (nb - 1) * bs, dtype=torch.int32, device=dev)
    heads = (model.num_heads, model.num_kv_heads, model.head_dim, bs)
    if q_len == 1:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        wrapper.plan(indptr, indices, last, *heads, q_data_type=q_out.dtype,
                     kv_data_type=k_cache.dtype)
    else:
        qo = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=dev)
        if backend == "fa3" and k_cache.element_size() == 1:
            q_out = q_out.to(k_cache.dtype)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        wrapper.plan(qo, indptr, indices, last, *heads, causal=True, q_data_type=q_out.dtype,
                     kv_data_type=k_cache.dtype, o_data_type=torch.bfloat16)
    return lambda: wrapper.run(q_out, (k_cache, v_cache))


def _layer_row(section, model_name, model, dname, batch, context, q_len, args, dense_cache,
               fi=None):
    check_budget()
    case = _layer_case(model, batch, context, q_len, dname)
    sparse, dense = _layer_fns(model, *case, batch, context, q_len)
    iters = max(5, args.iters // 2)
    sparse()
    by = breakdown_by_part_us(sparse, iters)
    row = dict(section=section, model=model_name, dtype=dname, B=batch, L=context, q_len=q_len,
               us=med(device_times_us(sparse, iters)))
    if section == "layer-decode":
        row["call_us"] = graph_call_us(sparse, iters)
    row.update({f"{k}_us": v for k, v in sorted(by.items())})
    key = (model_name, batch, context, q_len)
    if dense is not None:
        dense_cache[key] = try_peer(functools.partial(_median_device_us, dense, iters))
    if dense_cache.get(key):
        row["dense_bf16_us"] = dense_cache[key]
        row["speedup"] = dense_cache[key] / row["us"]
    if fi is not None and dname in ("bf16", "fp8"):
        # the same layer with the dense attention an engine would run on these caches (fp8 K/V
        # read as fp8): the speed-up like for like, beside the one over bf16 SDPA
        k_cache, v_cache, _, meta, _, _ = case
        q_out = torch.randn(batch * q_len, model.num_heads, model.head_dim, device="cuda",
                            dtype=torch.bfloat16)
        # a chunk: FA3 where it builds and runs, else FA2 (the row says which, and why a
        # backend before it did not run: engine_dense_<backend>_failed)
        for backend in ("decode",) if q_len == 1 else ("fa3", "fa2"):
            failed = f"engine_dense_{backend}_failed"
            engine = try_peer(lambda: _engine_dense_fn(model, k_cache, v_cache, q_out,
                                                       meta.block_table, batch, context, q_len,
                                                       backend), row, failed)
            us = engine and try_peer(functools.partial(_median_device_us, engine, iters), row,
                                     failed)
            if us:
                # the engine's layer: the preparation, then its dense attention (where the
                # step's preparation runs inside the scoring launch, timed alone here)
                prep = row.get("prep_us") or _median_device_us(sparse.prep, iters)
                row["engine_dense_attn_us"] = us
                row["engine_dense_backend"] = backend
                row["speedup_engine"] = (us + prep) / row["us"]
                break
    record(**row)
    del case, sparse, dense
    torch.cuda.empty_cache()


def layer_decode(args, fi):
    grid = shapes.LAYER_DECODE
    dense_cache: dict = {}
    extra = grid.get("nvfp4_rows", ())  # (model, B, L): the NVFP4 index cache's rows
    for model_name, model in _models(grid):
        for context, batch in itertools.product(grid["contexts"], grid["batches"]):
            dtypes = tuple(grid["dtypes"])  # bf16 first: its dense time serves the later rows
            if (model_name, batch, context) in extra:
                dtypes += ("nvfp4",)
            for dname in dtypes:
                try:
                    _layer_row("layer-decode", model_name, model, dname, batch, context, 1,
                               args, dense_cache, fi)
                except Exception as e:  # noqa: BLE001
                    record(section="layer-decode", model=model_name, dtype=dname, B=batch,
                           L=context, q_len=1, note=_not_run(e))
                    torch.cuda.empty_cache()


def layer_prefill(args, fi):
    grid = shapes.LAYER_PREFILL
    dense_cache: dict = {}
    for model_name, model in _models(grid):
        for context in grid["contexts"]:
            for dname in grid["dtypes"]:
                try:
                    _layer_row("layer-prefill", model_name, model, dname, 1,
                               context + grid["chunk"], grid["chunk"], args, dense_cache, fi)
                except Exception as e:  # noqa: BLE001
                    record(section="layer-prefill", model=model_name, dtype=dname, B=1,
                           L=context + grid["chunk"], q_len=grid["chunk"], note=_not_run(e))
                    torch.cuda.empty_cache()


SECTIONS = {"ceilings": ceilings, "indexer-decode": indexer_decode,
            "indexer-prefill": indexer_prefill, "attention-decode": attention_decode,
            "attention-prefill": attention_prefill, "layer-decode": layer_decode,
            "layer-prefill": layer_prefill}


def _revision(root: str) -> str:
    """The commit the tree at `root` is: OPENMSA_REVISION, else the REVISION file carried beside
    the tree (scripts/gpu_check.sh), else git's HEAD, marked "+modified" where tracked files
    differ from it (the device's copy of a tree may carry a stale .git), else "unknown"."""
    sha = os.environ.get("OPENMSA_REVISION", "")
    rev_file = os.path.join(root, "REVISION")
    if not sha and os.path.isfile(rev_file):
        with open(rev_file) as f:
            sha = f.read().strip()
    if sha:
        return sha
    try:
        git = ["git", "-C", root]
        sha = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        if sha and subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                                  capture_output=True, text=True).stdout.strip():
            sha += "+modified"
    except OSError:
        sha = ""
    return sha or "unknown"


def provenance() -> str:
    sha = _revision(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = torch.cuda.get_device_properties(0)
    return (f"# {p.name} ({p.multi_processor_count} SMs), CUDA {torch.version.cuda}, torch "
            f"{torch.__version__}, triton {triton.__version__}, openmsa {openmsa.__version__} "
            f"@ {sha}, L2 flush: {FLUSH_MODE}")


def dry_run(args):
    """What a run with these arguments would do, without a GPU: the peers that import and each
    section's grid."""
    fi = None if args.no_peers else load_flashinfer()
    vl = None if args.no_peers or args.no_vllm else load_vllm()
    print(f"# dry run: FlashInfer {'importable' if fi else 'absent'}, vLLM kernels "
          f"{'importable' if vl else 'absent'}; out: {args.out}; sections: {args.sections}")
    grids = {"indexer-decode": [indexer_decode_grid(args)], "indexer-prefill":
             [shapes.INDEXER_PREFILL, shapes.INDEXER_PREFILL_SHORT],
             "attention-decode": [shapes.ATTENTION_DECODE],
             "attention-prefill": [shapes.ATTENTION_PREFILL],
             "layer-decode": [shapes.LAYER_DECODE], "layer-prefill": [shapes.LAYER_PREFILL]}
    for name in args.sections.split(","):
        for grid in grids.get(name, ()):
            print(f"## {name}: {grid}")
            if name == "indexer-decode":
                steps = len(list(indexer_decode_steps(grid)))
                print(f"#   {steps * len(grid['q_lens'])} cases ({steps} steps x "
                      f"{len(grid['q_lens'])} q_lens)")
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true",
                        help="a subset of the indexer-decode grid (shapes.INDEXER_DECODE_QUICK)")
    parser.add_argument("--no-peers", action="store_true", help="openmsa alone")
    parser.add_argument("--no-vllm", action="store_true", help="FlashInfer as the only peer")
    parser.add_argument("--models", default=None,
                        help="comma-separated model names (shapes.MODELS) the sections run; "
                             "default: every one their grids name")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new case after this many seconds (those left are "
                             "recorded as not run); keeps a device call under its limit")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU needed: check the arguments and which peers import, list "
                             "the sections' grids, time nothing")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--flush", choices=("read", "write"), default=FLUSH_MODE,
                        help="how the L2 is emptied before each timed call (see FLUSH_MODE)")
    parser.add_argument("--contexts", default=None,
                        help="comma-separated context lengths (tokens): the grids' contexts "
                             "restricted to these (a grid left with none keeps its own)")
    parser.add_argument("--batches", default=None,
                        help="comma-separated batch sizes, as --contexts for the grids' batches")
    parser.add_argument("--dtypes", default=None,
                        help="comma-separated key dtypes (bf16, fp8, nvfp4, nvfp4-staged), as "
                             "--contexts for the grids' dtypes")
    args = parser.parse_args()
    for option, key in ((args.contexts, "contexts"), (args.batches, "batches")):
        if option:
            _restrict_grids(key, {int(v) for v in option.split(",")})
    if args.dtypes:
        known = {v for grid in vars(shapes).values() if isinstance(grid, dict)
                 for name in ("dtypes", "openmsa_only_dtypes") for v in grid.get(name, ())}
        bad = set(args.dtypes.split(",")) - known
        if bad:
            parser.error(f"unknown dtypes {sorted(bad)}; known: {','.join(sorted(known))}")
        _restrict_dtypes(set(args.dtypes.split(",")))
    unknown = [n for n in args.sections.split(",") if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {','.join(SECTIONS)}")
    if args.models:
        bad = [m for m in args.models.split(",") if m not in shapes.MODELS]
        if bad:
            parser.error(f"unknown models {bad}; known: {','.join(shapes.MODELS)}")
        globals()["MODELS"] = tuple(args.models.split(","))
    if args.dry_run:
        return dry_run(args)
    if args.budget_s is not None:
        globals()["DEADLINE"] = time.monotonic() + args.budget_s
    globals()["FLUSH_MODE"] = args.flush
    globals()["OUT_DIR"] = args.out
    if args.out is not None:
        os.makedirs(args.out, exist_ok=True)  # (a new folder under $OUT, say)
    print(provenance(), flush=True)
    fi = None if args.no_peers else load_flashinfer()
    globals()["VLLM"] = None if args.no_peers or args.no_vllm else load_vllm()
    sections = args.sections.split(",")
    if "ceilings" not in sections:
        sections.insert(0, "ceilings")
    for name in sections:
        print(f"## {name} ({time.monotonic() - STARTED:.0f}s into the run)", flush=True)
        try:
            SECTIONS[name](args, fi)
        except Exception as e:  # noqa: BLE001
            print(f"# section {name} failed: {type(e).__name__}: {e}", flush=True)
            import traceback
            traceback.print_exc()
    save()


if __name__ == "__main__":
    main()
