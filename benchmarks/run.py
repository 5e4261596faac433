# SPDX-License-Identifier: Apache-2.0
"""The one benchmark driver: openmsa against FlashInfer 0.7.4's msa_ops and dense attention, with
the H200's measured ceilings, in one run.

    python benchmarks/run.py [--sections ceilings,indexer-decode,indexer-prefill,
                              attention-decode,attention-prefill,layer-decode,layer-prefill]
                             [--quick] [--out DIR]

Times are medians. "device" is the kernels' own time per call (profiler, L2 flushed before each
call); "call" is what an engine pays per call: CUDA-graph replay for openmsa, an eager call for
FlashInfer. Each section checks correctness before timing.
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


# ---------------------------------------------------------------------------------------------
# timing

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
    after a flush kernel) the union length of each call's events."""
    calls, spans = [], None
    for a, b, name in sorted(kernels):
        if "_bench_l2_flush_kernel" in name:
            if spans is not None:
                calls.append(_union_length(spans))
            spans = []
        elif spans is not None:
            spans.append((a, b))
    if spans is not None:
        calls.append(_union_length(spans))
    return [calls[i::n] for i in range(n)]


def _union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by intervals sorted by start (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def graph_call_us(fn, iters: int) -> float:
    """What one call costs inside a captured step: graphs of (flush, fn) and of (flush) alone are
    each replayed `iters` times back to back between two events (the host queues replays ahead,
    so the GPU never idles between them, as inside an engine's step graph); the per-replay
    difference, median of 5 such batches. (Timing each replay alone, synchronised, measured a
    GPU that idled before every replay: medians moved by 10-18 µs between identical configs.)"""
    fn()
    torch.cuda.synchronize()
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


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def record(**row):
    ROWS.append(row)
    keys = [k for k in row if k not in ("section",)]
    print(" | ".join(f"{k}={_fmt(row[k])}" for k in keys), flush=True)
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


# ---------------------------------------------------------------------------------------------
# peers

def load_flashinfer():
    try:
        import flashinfer.msa_ops as fi  # noqa: F401
        return fi
    except Exception as e:  # noqa: BLE001
        print(f"# FlashInfer not available: {type(e).__name__}: {e}")
        return None


def try_peer(fn):
    """Run a peer call; None with the reason printed when it cannot run this shape."""
    try:
        out = fn()
        torch.cuda.synchronize()
        return out
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        print(f"#   peer not run: {msg}")
        return None


# ---------------------------------------------------------------------------------------------
# sections

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
    bs = 128
    nb = context // bs
    pages = batch * nb
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.randn(pages, bs, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    cache = cache.to(dtype)
    table = torch.randperm(pages, device="cuda", generator=g).int().view(batch, nb)
    cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device="cuda")
    seq = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * q_len, heads, 128, device="cuda", generator=g).to(dtype)
    return q, cache, cu, seq, table


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


def indexer_decode(args, fi):
    grid = shapes.INDEXER_DECODE
    batches, contexts = grid["batches"], grid["contexts"]
    if args.quick:
        batches, contexts = (1, 128), (128 * 1024, 1024 * 1024)
    for model_name in ("m3-tp1", "m3-tp4"):
        heads = shapes.MODELS[model_name].num_index_heads
        for dname in grid["dtypes"]:
            dtype = DTYPES[dname]
            for context in contexts:
                for batch in batches:
                    if batch * context * 128 * (2 if dname == "bf16" else 1) > 40e9:
                        continue
                    for q_len in grid["q_lens"]:
                        _indexer_decode_case(fi, model_name, heads, dname, dtype, context,
                                             batch, q_len, args)
                    torch.cuda.empty_cache()


def _indexer_decode_case(fi, model_name, heads, dname, dtype, context, batch, q_len, args):
    q, cache, cu, seq, table = _index_step(batch, context, q_len, heads, dtype)
    out = torch.empty(q.shape[0], heads, 16, dtype=torch.int32, device="cuda")
    # max_q_len as FlashInfer's max_seqlen_q: the engine's bound on q_len (a speed hint)
    ours = lambda: openmsa.select_blocks(q, cache, cu, seq, table, out=out,  # noqa: E731
                                         max_q_len=q_len)
    ours()
    nbytes = batch * context * 128 * cache.element_size()
    run = _fi_select(fi, q, cache, cu, seq, table, q_len) if fi is not None else None
    theirs = try_peer(run) if run is not None else None
    peer = {}
    if theirs is not None:
        # ours and FlashInfer's calls alternate in one profiled loop: both in one GPU state
        mine, fi_times = interleaved_device_times_us([ours, run], args.iters)
        dev = med(mine)
        peer = dict(fi_us=med(fi_times), fi_call_us=eager_call_us(run, max(5, args.iters // 2)),
                    ratio=dev / med(fi_times),
                    # the selections agree except where near-tied scores round differently
                    same_rows=float((theirs == out).all(-1).float().mean()))
    else:
        dev = med(device_times_us(ours, args.iters))
    call = graph_call_us(ours, args.iters)
    row = dict(section="indexer-decode", model=model_name, dtype=dname, L=context, B=batch,
               q_len=q_len, us=dev, call_us=call, tbs=nbytes / dev / 1e6,
               pct_copy=100 * nbytes / dev / 1e6 / CEIL["copy_tbs"] if CEIL["copy_tbs"] else None,
               **peer)
    record(**row)


def indexer_prefill(args, fi):
    grid = shapes.INDEXER_PREFILL
    chunk = grid["chunk"]
    for model_name in ("m3-tp1",):
        heads = shapes.MODELS[model_name].num_index_heads
        for dname in grid["dtypes"]:
            dtype = DTYPES[dname]
            for context in grid["contexts"]:
                q, cache, cu, seq, table = _index_step(1, context + chunk, chunk, heads, dtype)
                out = torch.empty(chunk, heads, 16, dtype=torch.int32, device="cuda")
                ours = lambda: openmsa.select_blocks(q, cache, cu, seq, table, out=out,  # noqa
                                                     max_q_len=chunk)
                ours()
                flops = 2 * heads * 128 * chunk * (context + chunk / 2)
                iters = max(5, args.iters // 4)
                run = _fi_select(fi, q, cache, cu, seq, table, chunk) if fi is not None else None
                theirs = try_peer(run) if run is not None else None
                if theirs is not None:
                    # interleaved, as in the decode sections: both sides in one GPU state
                    mine, fi_times = interleaved_device_times_us([ours, run], iters)
                    dev = med(mine)
                else:
                    dev = med(device_times_us(ours, iters))
                ceil = CEIL["fp8_tflops" if dname == "fp8" else "bf16_tflops"]
                row = dict(section="indexer-prefill", model=model_name, dtype=dname,
                           context=context, T=chunk, us=dev, tflops=flops / dev / 1e6,
                           pct_mm=100 * flops / dev / 1e6 / ceil if ceil else None)
                if fi is not None:
                    if theirs is not None:
                        row["fi_us"] = med(fi_times)
                        row["fi_tflops"] = flops / row["fi_us"] / 1e6
                        row["same_rows"] = float((theirs == out).all(-1).float().mean())
                record(**row)
                del q, cache, table
                torch.cuda.empty_cache()


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


def _models(grid):
    """(name, config) of the models a section's grid names."""
    return [(name, shapes.MODELS[name]) for name in grid["models"]]


def attention_decode(args, fi):
    grid = shapes.ATTENTION_DECODE
    context = grid["context"]
    for model_name, model in _models(grid):
        for dname in grid["dtypes"]:
            for batch in grid["batches"]:
                for q_len in grid["q_lens"]:
                    _attention_decode_case(fi, model_name, model, dname, batch, context, q_len,
                                           args)
                torch.cuda.empty_cache()


def _attention_decode_case(fi, model_name, model, dname, batch, context, q_len, args):
    q, packed, idx, cu, seq, table = _attention_step(model, batch, context, q_len, dname)
    d = model.head_dim
    k = packed[..., :d].permute(0, 2, 1, 3)
    v = packed[..., d:].permute(0, 2, 1, 3)
    out = torch.empty_like(q)
    ours = lambda: openmsa.sparse_attention(q, k, v, idx, cu, seq, table, out=out)  # noqa
    ours()
    t = q.shape[0]
    nbytes = t * model.num_kv_heads * 16 * 128 * 2 * d * packed.element_size()
    peer, dev = {}, None
    if fi is not None and dname == "fp8":
        kf, vf = packed[..., :d], packed[..., d:]
        idx_fi = idx.permute(1, 0, 2).contiguous()  # [Hkv(=H), T, K]
        fo = torch.empty_like(q)
        run = lambda: fi.msa_sparse_decode_attention(  # noqa: E731
            q, kf, vf, idx_fi, page_table=table, seqused_k=seq, seqlen_q=q_len, out=fo)
        if try_peer(run) is not None:
            # ours and FlashInfer's calls alternate in one profiled loop: both in one GPU state
            mine, fi_times = interleaved_device_times_us([ours, run], args.iters)
            dev = med(mine)
            peer = dict(fi_us=med(fi_times),
                        fi_call_us=eager_call_us(run, max(5, args.iters // 2)),
                        ratio=dev / med(fi_times),
                        max_diff_vs_fi=float((fo.float() - out.float()).abs().max()))
    if dev is None:
        dev = med(device_times_us(ours, args.iters))
    call = graph_call_us(ours, args.iters)
    row = dict(section="attention-decode", model=model_name, dtype=dname, B=batch, q_len=q_len,
               L=context, us=dev, call_us=call, tbs=nbytes / dev / 1e6,
               pct_copy=100 * nbytes / dev / 1e6 / CEIL["copy_tbs"] if CEIL["copy_tbs"] else None,
               **peer)
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
                dev = med(device_times_us(ours, iters))
                mhz = sm_clock_mhz()
                parts = {}
                for name, us in kernel_breakdown_us(ours, iters).items():
                    parts[_short(name)] = parts.get(_short(name), 0.0) + us
                want = out.clone()
                alone = lambda: openmsa.sparse_attention(  # noqa: E731
                    q, k, v, idx, cu, seq, table, out=out, config=per_token_config)
                alone()
                per_token = med(device_times_us(alone, iters))
                same = float((out.float() - want.float()).abs().max())
                # the per-token form's memory roof on the same selections (rows the tiles
                # cannot take: "Why unshared selections stay far below" in performance.md)
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
                           **{f"{k}_us": v for k, v in parts.items()})
                if dname == "bf16" and shared == 16 and jitter == 0.0:
                    row["dense_us"] = try_peer(lambda: _dense_prefill_us(model, context, chunk,
                                                                          args))
                record(**row)
                del q, packed, idx
                torch.cuda.empty_cache()


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


# ---------------------------------------------------------------------------------------------
# the sparse layer: preparation + indexer + sparse attention, against the same layer with dense
# attention over the whole context

def kernel_breakdown_us(fn, iters: int) -> dict[str, float]:
    """Median device time of each kernel (by name) over `iters` calls, L2 flushed before each
    (a programmatic dependent launch's time includes its wait for the launch before it)."""
    fn()
    flush_l2()  # allocates the flush buffer outside the profiled loop
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush_l2()
            fn()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0 \
                and "_bench_l2_flush_kernel" not in e.name:
            per.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    # a kernel launched n times per call contributes n entries per call
    return {k: med(v) * len(v) / iters for k, v in per.items()}


def _short(name: str) -> str:
    for key, short in (("tile_plan", "attn-plan"), ("attention_tile", "attn-tile"),
                       ("fused_prepare", "prep"), ("block_scores", "score"),
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
    hkv, hq, h = model.num_kv_heads, model.num_heads, model.num_index_heads
    nb = -(-context // bs)
    pages = batch * nb
    dtype = DTYPES[dname]
    k_cache = torch.empty(pages, bs, hkv, d, dtype=dtype, device="cuda")
    v_cache = torch.empty_like(k_cache)
    index_cache = torch.empty(pages, bs, di, dtype=dtype, device="cuda")
    for c in (k_cache, v_cache, index_cache):
        flat = c.view(pages, -1)
        for i in range(0, pages, 4096):  # fill in slices: no full-size fp32 temporary
            flat[i:i + 4096] = torch.randn(flat[i:i + 4096].shape, device="cuda").to(dtype)
    table = torch.arange(pages, dtype=torch.int32, device="cuda").view(batch, nb)
    planner = openmsa.MSAPlanner(model, max_requests=batch, max_tokens=batch * q_len,
                                 max_blocks=nb, device="cuda")
    meta = planner.plan([q_len] * batch, [context] * batch, table)
    width = (hq + 2 * hkv) * d + (h + 1) * di
    qkv = torch.randn(batch * q_len, width, device="cuda", dtype=torch.bfloat16)
    w = [torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1 for n in (d, d, di, di)]
    return k_cache, v_cache, index_cache, meta, qkv, w


def _layer_fns(model, k_cache, v_cache, index_cache, meta, qkv, w, batch, context, q_len):
    cfg = model
    t = qkv.shape[0]
    q_out = torch.empty(t, cfg.num_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
    iq_out = torch.empty(t, cfg.num_index_heads, cfg.index_head_dim, dtype=index_cache.dtype,
                         device="cuda")
    idx = torch.empty(t, cfg.num_index_heads, cfg.topk_blocks, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q_out)

    def prep():
        openmsa.fused_prepare(qkv, meta.positions, cfg, *w, k_cache, v_cache, meta.slot_mapping,
                              index_cache, meta.index_slot_mapping, q_out=q_out,
                              index_q_out=iq_out)

    def sparse():
        prep()
        openmsa.select_blocks(iq_out, index_cache, meta.cu_seqlens_q, meta.seq_lens,
                              meta.index_block_table, topk=cfg.topk_blocks,
                              block_size=cfg.block_size, out=idx)
        openmsa.sparse_attention(q_out, k_cache, v_cache, idx, meta.cu_seqlens_q, meta.seq_lens,
                                 meta.block_table, block_size=cfg.block_size, out=out)

    dense = None
    if k_cache.dtype == torch.bfloat16:
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


def _layer_row(section, model_name, model, dname, batch, context, q_len, args, dense_cache):
    case = _layer_case(model, batch, context, q_len, dname)
    sparse, dense = _layer_fns(model, *case, batch, context, q_len)
    iters = max(5, args.iters // 2)
    sparse()
    parts = kernel_breakdown_us(sparse, iters)
    row = dict(section=section, model=model_name, dtype=dname, B=batch, L=context, q_len=q_len,
               us=med(device_times_us(sparse, iters)))
    if section == "layer-decode":
        row["call_us"] = graph_call_us(sparse, iters)
    by = {}
    for name, us in parts.items():
        by[_short(name)] = by.get(_short(name), 0.0) + us
    row.update({f"{k}_us": v for k, v in sorted(by.items())})
    key = (model_name, batch, context, q_len)
    if dense is not None:
        dense_cache[key] = try_peer(functools.partial(_median_device_us, dense, iters))
    if dense_cache.get(key):
        row["dense_bf16_us"] = dense_cache[key]
        row["speedup"] = dense_cache[key] / row["us"]
    record(**row)
    del case, sparse, dense
    torch.cuda.empty_cache()


def layer_decode(args, fi):
    grid = shapes.LAYER_DECODE
    dense_cache: dict = {}
    for model_name, model in _models(grid):
        for context, batch in itertools.product(grid["contexts"], grid["batches"]):
            for dname in grid["dtypes"]:  # bf16 first: its dense time serves the fp8 row
                _layer_row("layer-decode", model_name, model, dname, batch, context, 1, args,
                           dense_cache)


def layer_prefill(args, fi):
    grid = shapes.LAYER_PREFILL
    dense_cache: dict = {}
    for model_name, model in _models(grid):
        for context in grid["contexts"]:
            for dname in grid["dtypes"]:
                _layer_row("layer-prefill", model_name, model, dname, 1, context + grid["chunk"],
                           grid["chunk"], args, dense_cache)


SECTIONS = {"ceilings": ceilings, "indexer-decode": indexer_decode,
            "indexer-prefill": indexer_prefill, "attention-decode": attention_decode,
            "attention-prefill": attention_prefill, "layer-decode": layer_decode,
            "layer-prefill": layer_prefill}


def provenance() -> str:
    # the device's copy of the tree may carry a stale .git: a given revision wins
    # (OPENMSA_REVISION, or the REVISION file carried beside the tree, see scripts/gpu_check.sh)
    sha = os.environ.get("OPENMSA_REVISION", "")
    rev_file = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "REVISION")
    if not sha and os.path.isfile(rev_file):
        with open(rev_file) as f:
            sha = f.read().strip()
    if not sha:
        try:
            sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() or "unknown"
        except OSError:
            sha = "unknown"
    p = torch.cuda.get_device_properties(0)
    return (f"# {p.name} ({p.multi_processor_count} SMs), CUDA {torch.version.cuda}, torch "
            f"{torch.__version__}, triton {triton.__version__}, openmsa {openmsa.__version__} "
            f"@ {sha}, L2 flush: {FLUSH_MODE}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a subset of the decode grid")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--flush", choices=("read", "write"), default=FLUSH_MODE,
                        help="how the L2 is emptied before each timed call (see FLUSH_MODE)")
    args = parser.parse_args()
    globals()["FLUSH_MODE"] = args.flush
    globals()["OUT_DIR"] = args.out
    if args.out is not None:
        os.makedirs(args.out, exist_ok=True)  # (a new folder under $OUT, say)
    print(provenance(), flush=True)
    fi = None if args.no_peers else load_flashinfer()
    sections = args.sections.split(",")
    if "ceilings" not in sections:
        sections.insert(0, "ceilings")
    for name in sections:
        print(f"## {name}", flush=True)
        try:
            SECTIONS[name](args, fi)
        except Exception as e:  # noqa: BLE001
            print(f"# section {name} failed: {type(e).__name__}: {e}", flush=True)
            import traceback
            traceback.print_exc()
    save()


if __name__ == "__main__":
    main()
