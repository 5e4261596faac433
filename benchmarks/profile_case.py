# SPDX-License-Identifier: Apache-2.0
"""Run one named benchmark case a few times, for a profiler to attach to (no timing here):

    ncu --clock-control none -k regex:_sparse_attention --launch-skip 2 --launch-count 1 \\
        python3 benchmarks/profile_case.py attn-fp8-tp4-b128

`scripts/ncu_cases.sh` runs the cases below under Nsight Compute in one device call.
`python3 benchmarks/profile_case.py --breakdown CASE...` prints each case's median device µs per
kernel (torch profiler, L2 flushed before each call).
`python3 benchmarks/profile_case.py --graph CASE...` splits run.graph_call_us' number: the same
graphs of (flush, call) and (flush) alone, replayed back to back under the profiler, each
replay's period (flush start to the next flush start), the flush kernel's own time, the call's
kernels (union) and the idle gaps, medians over the replays.
`python3 benchmarks/profile_case.py --offsets CASE...` prints, per kernel, when it starts after
the flush kernel ends and how long it runs (medians): launch gaps and overlaps.
`python3 benchmarks/profile_case.py --eager CASE...` prints the eager call's wall time and the
host functions it spends it in (cProfile over 200 calls)."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402
import shapes  # noqa: E402

import openmsa  # noqa: E402


def _attention(model_name, dname, batch, context, q_len, out=False, **selections):
    """out=True writes into one preallocated buffer, as run.py's attention tables do;
    selections: run._attention_step's (shared=16 gives the prefill tiles' shared selections)."""
    m = shapes.MODELS[model_name]
    q, packed, idx, cu, seq, table = run._attention_step(m, batch, context, q_len, dname,
                                                         **selections)
    k, v = packed[..., :128].permute(0, 2, 1, 3), packed[..., 128:].permute(0, 2, 1, 3)
    o = torch.empty_like(q) if out else None
    config = run.attention_config(json.loads(os.environ.get("OPENMSA_ATTENTION_CONFIG", "{}")))
    return lambda: openmsa.sparse_attention(q, k, v, idx, cu, seq, table, out=o, config=config)


def _fi_attention(model_name, batch, context, q_len):
    """FlashInfer's msa_sparse_decode_attention on the same step as _attention (fp8 K|V), for
    --offsets / --breakdown beside ours (needs `. .peers/env.sh`)."""
    m = shapes.MODELS[model_name]
    q, packed, idx, cu, seq, table = run._attention_step(m, batch, context, q_len, "fp8")
    fi = run.load_flashinfer()
    d = m.head_dim
    kf, vf = packed[..., :d], packed[..., d:]
    idx_fi = idx.permute(1, 0, 2).contiguous()
    fo = torch.empty_like(q)
    return lambda: fi.msa_sparse_decode_attention(q, kf, vf, idx_fi, page_table=table,
                                                  seqused_k=seq, seqlen_q=q_len, out=fo)


def graph_breakdown_us(fn, iters: int = 20) -> dict[str, float]:
    fn()
    run.flush_l2()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g_both, g_flush = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_both):
        run.flush_l2()
        fn()
    with torch.cuda.graph(g_flush):
        run.flush_l2()
    result = {}
    from torch.profiler import ProfilerActivity, profile
    for label, g in (("both", g_both), ("flush", g_flush)):
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                g.replay()
            torch.cuda.synchronize()
        kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA
                          and e.device_time_total > 0), key=lambda x: x[0])
        starts = [i for i, k in enumerate(kernels) if "_bench_l2_flush_kernel" in k[2]]
        period, flush, call = [], [], []
        for i, j in zip(starts, starts[1:]):
            period.append(kernels[j][0] - kernels[i][0])
            flush.append(kernels[i][1] - kernels[i][0])
            call.append(run._union_length([(a, b) for a, b, _ in kernels[i + 1:j]]))
        result[f"{label}: period"] = run.med(period)
        result[f"{label}: flush"] = run.med(flush)
        if label == "both":
            result["both: call kernels"] = run.med(call)
            result["both: idle"] = run.med([p - f - c for p, f, c in zip(period, flush, call)])
    return result


# the indexer's knobs for this run (OPENMSA_TUNING, below; None: its defaults)
INDEXER_CONFIG = None


def _indexer(dname, batch, context, q_len, heads):
    q, cache, cu, seq, table = run._index_step(batch, context, q_len, heads, run.DTYPES[dname])
    return lambda: openmsa.select_blocks(q, cache, cu, seq, table, max_q_len=q_len,
                                         config=INDEXER_CONFIG)


def _nvfp4_indexer(batch, context, q_len, heads):
    """_indexer on an NVFP4 cache (uint8 pages, openmsa.nvfp4) of the same step's keys, fp8
    index queries (vLLM's pairing)."""
    from openmsa import nvfp4
    q, cache, cu, seq, table = run._index_step(batch, context, q_len, heads, torch.bfloat16)
    pages = torch.empty(cache.shape[0], nvfp4.PAGE_TOKENS, nvfp4.TOKEN_BYTES, dtype=torch.uint8,
                        device=cache.device)
    codes, scales = nvfp4.quantize_index_keys(cache.reshape(-1, nvfp4.HEAD_DIM))
    c, s = nvfp4.page_parts(pages)
    c.copy_(codes.view(c.shape))
    s.copy_(scales.view(s.shape))
    del cache, codes, scales
    q = q.to(run.DTYPES["fp8"])
    return lambda: openmsa.select_blocks(q, pages, cu, seq, table, max_q_len=q_len,
                                         config=INDEXER_CONFIG)


def _index_step_case(dname, batch, context, q_len, heads):
    """_indexer on run._index_step's cache of `dname` ("nvfp4": quantized slice by slice, no
    full-size 16-bit temporary, so B=128 at 1M fits beside nothing else)."""
    q, cache, cu, seq, table = run._index_step(batch, context, q_len, heads, dname)
    return lambda: openmsa.select_blocks(q, cache, cu, seq, table, max_q_len=q_len,
                                         config=INDEXER_CONFIG)


def _fi_indexer(dname, batch, context, q_len, heads):
    """FlashInfer's indexer (msa_proxy_score + msa_topk_select) on _indexer's step, for
    --offsets / --breakdown beside ours (needs `. .peers/env.sh`)."""
    q, cache, cu, seq, table = run._index_step(batch, context, q_len, heads, run.DTYPES[dname])
    return run._fi_select(run.load_flashinfer(), q, cache, cu, seq, table, q_len)


def _layer(model_name, dname, batch, context):
    """One decode step of the sparse layer's attention part as an engine calls it: fused_prepare,
    select_blocks and sparse_attention (run.py's layer-decode rows)."""
    model = shapes.MODELS[model_name]
    case = run._layer_case(model, batch, context, 1, dname)
    return run._layer_fns(model, *case, batch, context, 1)[0]


CASES = {
    "attn-fp8-tp4-b128": lambda: _attention("m3-tp4", "fp8", 128, 65536, 1),
    "attn-bf16-tp4-b128": lambda: _attention("m3-tp4", "bf16", 128, 65536, 1),
    "attn-fp8-tp1-b128": lambda: _attention("m3-tp1", "fp8", 128, 65536, 1),
    "attn-fp8-tp1-b128-out": lambda: _attention("m3-tp1", "fp8", 128, 65536, 1, out=True),
    "attn-fp8-tp1-b64-out": lambda: _attention("m3-tp1", "fp8", 64, 65536, 1, out=True),
    "attn-fp8-tp1-b128-q4-out": lambda: _attention("m3-tp1", "fp8", 128, 65536, 4, out=True),
    "attn-bf16-tp1-b128-q4-out": lambda: _attention("m3-tp1", "bf16", 128, 65536, 4, out=True),
    "attn-fp8-tp1-b1": lambda: _attention("m3-tp1", "fp8", 1, 65536, 1),
    # the small decode steps where FlashInfer is ahead (docs/performance.md), and its calls
    "attn-fp8-tp1-b8-out": lambda: _attention("m3-tp1", "fp8", 8, 65536, 1, out=True),
    "attn-fp8-tp1-b1-q4-out": lambda: _attention("m3-tp1", "fp8", 1, 65536, 4, out=True),
    "attn-fp8-tp4-b8-q4-out": lambda: _attention("m3-tp4", "fp8", 8, 65536, 4, out=True),
    "attn-fp8-tp4-b64-out": lambda: _attention("m3-tp4", "fp8", 64, 65536, 1, out=True),
    "fi-attn-tp1-b8": lambda: _fi_attention("m3-tp1", 8, 65536, 1),
    "fi-attn-tp1-b1-q4": lambda: _fi_attention("m3-tp1", 1, 65536, 4),
    "fi-attn-tp4-b8-q4": lambda: _fi_attention("m3-tp4", 8, 65536, 4),
    "fi-attn-tp4-b64": lambda: _fi_attention("m3-tp4", 64, 65536, 1),
    "attn-bf16-tp1-prefill": lambda: _attention("m3-tp1", "bf16", 1, 16384, 8192),
    # an 8K chunk after 8K whose runs of 16 tokens share a selection: the tile launches
    # (scripts/ncu_cases.sh: attn-bf16-tp1-prefill-shared:_sparse_attention_tile_gluon:2)
    "attn-bf16-tp1-prefill-shared": lambda: _attention("m3-tp1", "bf16", 1, 16384, 8192,
                                                       shared=16),
    "attn-fp8-tp1-prefill-shared": lambda: _attention("m3-tp1", "fp8", 1, 16384, 8192,
                                                      shared=16),
    # the same after 128K, and with independent selections (the per-token launch's rows)
    "attn-fp8-tp1-prefill-shared-128k": lambda: _attention("m3-tp1", "fp8", 1, 139264, 8192,
                                                           shared=16),
    "attn-fp8-tp1-prefill-indep": lambda: _attention("m3-tp1", "fp8", 1, 16384, 8192),
    "idx-fp8-b32-128k": lambda: _indexer("fp8", 32, 131072, 1, 4),
    "idx-fp8-b1-32k": lambda: _indexer("fp8", 1, 32768, 1, 4),
    "idx-fp8-b32-32k": lambda: _indexer("fp8", 32, 32768, 1, 4),
    "layer-fp8-tp1-b8-32k": lambda: _layer("m3-tp1", "fp8", 8, 32768),
    # issue 57's rows: the B = 1 step's kernels one after another (--offsets)
    "layer-fp8-tp1-b1-32k": lambda: _layer("m3-tp1", "fp8", 1, 32768),
    "layer-fp8-tp1-b1-128k": lambda: _layer("m3-tp1", "fp8", 1, 131072),
    "layer-fp8-tp1-b1-512k": lambda: _layer("m3-tp1", "fp8", 1, 1 << 19),
    "layer-fp8-tp1-b1-1m": lambda: _layer("m3-tp1", "fp8", 1, 1 << 20),
    "layer-fp8-tp4-b1-1m": lambda: _layer("m3-tp4", "fp8", 1, 1 << 20),
    "layer-fp8-tp1-b8-128k": lambda: _layer("m3-tp1", "fp8", 8, 131072),
    "layer-fp8-tp4-b64-32k": lambda: _layer("m3-tp4", "fp8", 64, 32768),
    # with b32-32k and b32-128k: time against blocks per program (B = 32 launches 256 programs
    # at every L, so the per-program block count is L / 1K: 8 / 16 / 32 / 128); b8-128k and
    # b1-1m launch the same 256 x 32 blocks as b32-32k over 8 requests and one
    "idx-fp8-b128-32k-q4": lambda: _indexer("fp8", 128, 32768, 4, 4),
    "idx-fp8-b64-128k-tp4": lambda: _indexer("fp8", 64, 131072, 1, 1),
    "idx-fp8-b32-8k": lambda: _indexer("fp8", 32, 8192, 1, 4),
    "idx-fp8-b32-16k": lambda: _indexer("fp8", 32, 16384, 1, 4),
    "idx-fp8-b8-128k": lambda: _indexer("fp8", 8, 131072, 1, 4),
    "idx-fp8-b1-1m": lambda: _indexer("fp8", 1, 1 << 20, 1, 4),
    # rows the indexer decode table has at 1.03-1.09x FlashInfer's (619d50a), and FlashInfer's
    # calls on the same steps: where the gap sits (scoring, or the selection after it)
    "idx-fp8-b8-128k-tp4": lambda: _indexer("fp8", 8, 131072, 1, 1),
    "idx-fp8-b1-128k-tp4": lambda: _indexer("fp8", 1, 131072, 1, 1),
    "idx-fp8-b64-32k": lambda: _indexer("fp8", 64, 32768, 1, 4),
    "fi-idx-fp8-b8-128k-tp4": lambda: _fi_indexer("fp8", 8, 131072, 1, 1),
    "fi-idx-fp8-b1-128k-tp4": lambda: _fi_indexer("fp8", 1, 131072, 1, 1),
    "fi-idx-fp8-b64-32k": lambda: _fi_indexer("fp8", 64, 32768, 1, 4),
    "fi-idx-fp8-b128-32k-q4": lambda: _fi_indexer("fp8", 128, 32768, 4, 4),
    "fi-idx-fp8-b8-128k": lambda: _fi_indexer("fp8", 8, 131072, 1, 4),
    # an 8K prefill chunk after 120K: each call launches the decode scoring launch,
    # then the prefill launch, so a profiler wanting the prefill launch skips an odd count of
    # _block_scores launches (scripts/ncu_cases.sh: idx-fp8-prefill-120k:_block_scores:3)
    # NVFP4 index pages (72 bytes a token) beside the fp8 rows above
    "idx-nvfp4-b32-128k": lambda: _nvfp4_indexer(32, 131072, 1, 4),
    "idx-nvfp4-b1-1m": lambda: _nvfp4_indexer(1, 1 << 20, 1, 4),
    # the B=128 1M-context TP1 decode step in both caches, one GPU call compares them:
    # profile_case.py --breakdown idx-nvfp4-b128-1m idx-fp8-b128-1m
    "idx-nvfp4-b128-1m": lambda: _index_step_case("nvfp4", 128, 1 << 20, 1, 4),
    "idx-fp8-b128-1m": lambda: _indexer("fp8", 128, 1 << 20, 1, 4),
    "idx-nvfp4-b128-32k-q4": lambda: _nvfp4_indexer(128, 32768, 4, 4),
    "idx-nvfp4-b64-128k-tp4": lambda: _nvfp4_indexer(64, 131072, 1, 1),
    "idx-nvfp4-prefill-120k": lambda: _nvfp4_indexer(1, 120 * 1024 + 8192, 8192, 4),
    "idx-fp8-prefill-0k": lambda: _indexer("fp8", 1, 8192, 8192, 4),
    "idx-fp8-prefill-120k": lambda: _indexer("fp8", 1, 120 * 1024 + 8192, 8192, 4),
    "idx-bf16-prefill-120k": lambda: _indexer("bf16", 1, 120 * 1024 + 8192, 8192, 4),
    # the TP4 geometry's chunks (one index head) where FlashInfer was ahead (issue 40), and its
    # calls on the same steps
    "idx-fp8-prefill-0k-tp4": lambda: _indexer("fp8", 1, 8192, 8192, 1),
    "idx-fp8-prefill-8k-tp4": lambda: _indexer("fp8", 1, 16384, 8192, 1),
    "idx-fp8-prefill-32k-tp4": lambda: _indexer("fp8", 1, 40960, 8192, 1),
    "idx-bf16-prefill-0k-tp4": lambda: _indexer("bf16", 1, 8192, 8192, 1),
    "fi-idx-fp8-prefill-0k-tp4": lambda: _fi_indexer("fp8", 1, 8192, 8192, 1),
    "fi-idx-fp8-prefill-8k-tp4": lambda: _fi_indexer("fp8", 1, 16384, 8192, 1),
    "fi-idx-fp8-prefill-32k-tp4": lambda: _fi_indexer("fp8", 1, 40960, 8192, 1),
}

def kernel_offsets_us(fn, iters: int = 20) -> dict[str, tuple[float, float]]:
    """Per kernel of a call: (median start after the flush kernel's end, median duration), L2
    flushed before each call, so launch gaps and overlaps show beside the durations."""
    fn()
    run.flush_l2()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run.flush_l2()
            fn()
        torch.cuda.synchronize()
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA
                    and e.device_time_total > 0)
    per: dict[str, tuple[list[float], list[float]]] = {}
    flush_end = None
    for a, b, name in events:
        if "_bench_l2_flush_kernel" in name:
            flush_end = b
        elif flush_end is not None:
            starts, durs = per.setdefault(name, ([], []))
            starts.append(a - flush_end)
            durs.append(b - a)
    return {k: (run.med(v[0]), run.med(v[1])) for k, v in per.items()}


if __name__ == "__main__":
    # OPENMSA_TUNING='{"gluon": {"waves": 2}}': IndexerConfig changes for this run, a form's
    # as a dict of its fields (to profile a variant tune.py measured); the attention's as
    # OPENMSA_ATTENTION_CONFIG='{"tiles": false}' (AttentionConfig fields, read by _attention)
    if os.environ.get("OPENMSA_TUNING"):
        from openmsa.ops.indexer.plan import DEFAULT as INDEXER_DEFAULT
        INDEXER_CONFIG = INDEXER_DEFAULT.replace(**json.loads(os.environ["OPENMSA_TUNING"]))
    if sys.argv[1] == "--offsets":
        for name in sys.argv[2:]:
            parts = kernel_offsets_us(CASES[name]())
            print(f"{name}: " + ", ".join(f"{k} start +{a:.1f} for {d:.1f} (end +{a + d:.1f})"
                                          for k, (a, d) in parts.items()), flush=True)
        sys.exit(0)
    if sys.argv[1] == "--breakdown":
        for name in sys.argv[2:]:
            parts = run.kernel_breakdown_us(CASES[name](), 20)
            print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()), flush=True)
        sys.exit(0)
    if sys.argv[1] == "--eager":
        # an engine that does not capture graphs pays the host side of every call: the eager
        # call's wall time, and where the host spends it (cProfile over back-to-back calls)
        import cProfile
        import pstats
        for name in sys.argv[2:]:
            fn = CASES[name]()
            call = run.eager_call_us(fn, 20)
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            print(f"{name}: eager call {call:.1f} µs (device + host)", flush=True)
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        sys.exit(0)
    if sys.argv[1] == "--graph":
        for name in sys.argv[2:]:
            fn = CASES[name]()
            parts = {"device (union)": run.med(run.device_times_us(fn, 20))}
            parts.update(graph_breakdown_us(fn))
            parts["graph call (run.graph_call_us)"] = run.graph_call_us(fn, 10)
            print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()), flush=True)
        sys.exit(0)
    fn = CASES[sys.argv[1]]()
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
        fn()
    torch.cuda.synchronize()
