# SPDX-License-Identifier: Apache-2.0
"""Peak memory and prefill / decode time of transformers' MiniMax-M3 attention against the same
model on openmsa (`use_openmsa`), at long prompts, on one GPU.

The model is random and narrow (hidden 512, dense MLPs, a small vocabulary) but its sparse
layers have MiniMax-M3's attention geometry: 64 query / 4 KV / 4 index heads of 128, blocks of 128,
top-16, YaRN to 1M (the serving recipe). By default every layer is sparse, so the measurement is
the attention (add transformers' full-attention layers with --full-layers). Both paths prefill the
prompt in chunks of --prefill-chunk tokens through the cache (transformers' own chunked prefill
does the same), then decode --decode-steps tokens greedily. transformers' path runs until it runs
out of memory; longer prompts are then skipped for it.

    python benchmarks/transformers_memory.py --out /tmp/tm.json          # H200: 8K..1M
    python benchmarks/transformers_memory.py --out /tmp/tm.json --device cpu --dtype float32 \\
        --lengths 256,512 --heads 4 --kv-heads 2 --head-dim 32 --block 16 --topk 4 \\
        --hidden 64 --layers 2 --decode-steps 2 --prefill-chunk 128     # a CPU smoke run

Writes JSON (after every measurement, so a run cut short keeps what it measured):
{"meta": {...versions, device, arguments...}, "results": [{"path", "tokens", "status" ("ok",
"oom", "skipped", "error"), "prefill_s", "prefill_tokens_per_s", "decode_ms_per_token" (the steps
after the first), "decode_first_ms" (the first decode step, which may compile kernels),
"peak_prefill_gib", "peak_decode_gib", "held_after_prefill_gib", "error"}, ...]}.
Memory is CUDA's allocator (max_memory_allocated, relative to the model's weights: openmsa's
paged caches, allocated up front for the prompt, are counted); None on CPU.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import os
import platform
import sys
import time
import traceback

import torch

GIB = 1024 ** 3
OOM_ERRORS = tuple({getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),
                    torch.cuda.OutOfMemoryError})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--lengths", default="8192,32768,131072,1048576",
                   help="prompt lengths in tokens, comma-separated")
    p.add_argument("--paths", default="transformers,openmsa")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--full-layers", type=int, default=0,
                   help="how many of the layers (the first ones) are full attention")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--index-heads", type=int, default=None, help="default: --kv-heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--no-yarn", action="store_true",
                   help="plain RoPE (default: YaRN x2 over 512K, the 1M serving recipe)")
    p.add_argument("--prefill-chunk", type=int, default=8192,
                   help="prompt tokens per forward (0: the whole prompt in one forward)")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"],
                   help="transformers' attention implementation for its own path")
    p.add_argument("--kv-cache-dtype", default=None, help="openmsa's KV cache (default: model)")
    p.add_argument("--index-cache-dtype", default="fp8", help="openmsa's index cache")
    p.add_argument("--ops", default="kernels", choices=["kernels", "reference"])
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(args, path: str, tokens: int):
    import transformers
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    transformers.logging.set_verbosity_error()
    layers = args.layers
    full = min(args.full_layers, layers)
    native = 524288
    extra = {}
    if not args.no_yarn:
        extra = dict(rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                   "original_max_position_embeddings": native},
                     max_position_embeddings=2 * native)
    cfg = MiniMaxM3VLTextConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, rotary_dim=args.head_dim // 2, partial_rotary_factor=0.5,
        index_n_heads=args.index_heads or args.kv_heads, index_head_dim=args.head_dim,
        index_block_size=args.block, index_topk_blocks=args.topk, index_local_blocks=1,
        layer_types=["full_attention"] * full + ["minimax_m3_sparse"] * (layers - full),
        mlp_layer_types=["dense"] * layers, dense_intermediate_size=args.intermediate,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)
    cfg._attn_implementation = args.hf_attn
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    model = MiniMaxM3VLForCausalLM(cfg).eval()
    rot = model.model.rotary_emb
    freqs = rot.inv_freq.clone(), rot.original_inv_freq.clone()
    model.to(device=args.device, dtype=dtype)
    # keep the rotary frequencies fp32, as from_pretrained leaves them (.to(dtype) rounds them)
    rot.inv_freq, rot.original_inv_freq = (f.to(args.device) for f in freqs)
    # memory is counted from here (the weights alone): openmsa's caches, allocated up front by
    # use_openmsa below, count like transformers' cache, which grows during the run
    model._bench_base_memory = _mem(args.device)
    if path == "openmsa":
        from openmsa.integrations.transformers import use_openmsa
        pages = math.ceil((tokens + args.decode_steps + 1) / args.block) + 1
        use_openmsa(model, kv_cache_dtype=args.kv_cache_dtype,
                    index_cache_dtype=args.index_cache_dtype, ops=args.ops,
                    max_chunk_tokens=args.prefill_chunk or max(tokens, 1), num_pages=pages)
    return model


def _cache_keyword(model) -> str:
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters \
        else "past_key_values"


def _cache_of(output):
    c = getattr(output, "cache", None)
    return c if c is not None else output.past_key_values


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _mem(device):
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.memory_allocated(device)


def _peak(device):
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device)


def _reset_peak(device):
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _gib(x):
    return None if x is None else round(x / GIB, 4)


@torch.no_grad()
def run_once(model, args, tokens: int, decode_steps: int) -> dict:
    """Prefill `tokens` random tokens in chunks, then decode greedily; times and memory."""
    dev = args.device
    key = _cache_keyword(model)
    g = torch.Generator().manual_seed(args.seed + tokens)
    ids = torch.randint(3, args.vocab, (1, tokens), generator=g).to(dev)
    chunk = args.prefill_chunk or tokens
    base = model._bench_base_memory
    _reset_peak(dev)
    _sync(dev)
    t0 = time.perf_counter()
    cache, out = None, None
    for start in range(0, tokens, chunk):
        kw = {key: cache} if cache is not None else {}
        out = model(input_ids=ids[:, start:start + chunk], use_cache=True, logits_to_keep=1,
                    **kw)
        cache = _cache_of(out)
    _sync(dev)
    prefill = time.perf_counter() - t0
    peak_prefill = _peak(dev)
    held = _mem(dev)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    del out
    _reset_peak(dev)
    # the first decode step apart: a decode step at a new context length can take index-branch
    # kernels the warm-up never ran (their constexprs follow the block table's width), so it may
    # compile them (seconds, once per process); the steps after it are the per-token time
    first = None
    if decode_steps:
        _sync(dev)
        t0 = time.perf_counter()
        out = model(input_ids=nxt, use_cache=True, **{key: cache})
        cache = _cache_of(out)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(dev)
        first = time.perf_counter() - t0
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(decode_steps - 1):
        out = model(input_ids=nxt, use_cache=True, **{key: cache})
        cache = _cache_of(out)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(dev)
    decode = time.perf_counter() - t0
    peak_decode = _peak(dev)
    del cache
    rel = (lambda x: None if x is None or base is None else x - base)
    return {"prefill_s": round(prefill, 4),
            "prefill_tokens_per_s": round(tokens / prefill, 1),
            "decode_ms_per_token": round(1e3 * decode / (decode_steps - 1), 3)
            if decode_steps > 1 else None,
            "decode_first_ms": None if first is None else round(1e3 * first, 3),
            "peak_prefill_gib": _gib(rel(peak_prefill)),
            "peak_decode_gib": _gib(rel(peak_decode)),
            "held_after_prefill_gib": _gib(rel(held))}


def _free(device):
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, OOM_ERRORS) or (isinstance(e, RuntimeError)
                                         and "out of memory" in str(e).lower())


def meta(args) -> dict:
    import transformers
    import openmsa
    m = {"argv": sys.argv[1:], "args": vars(args), "python": platform.python_version(),
         "torch": torch.__version__, "transformers": transformers.__version__,
         "openmsa": openmsa.__version__, "device": args.device}
    try:
        import triton
        m["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.device(args.device).type == "cuda":
        m["gpu"] = torch.cuda.get_device_name(args.device)
        m["gpu_memory_gib"] = round(torch.cuda.get_device_properties(args.device).total_memory
                                    / GIB, 2)
    return m


def write(path, doc):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    paths = [x for x in args.paths.split(",") if x]
    for p in paths:
        if p not in ("transformers", "openmsa"):
            raise SystemExit(f"--paths: unknown path {p!r}")
    doc = {"meta": meta(args), "results": []}
    write(args.out, doc)
    for path in paths:
        # warm-up (kernel compilation, allocator): a short prompt and a few decode steps
        warm = min(min(lengths), 2 * (args.prefill_chunk or min(lengths)))
        try:
            model = build_model(args, path, warm)
            run_once(model, args, warm, min(args.decode_steps, 2))
        except Exception as e:  # noqa: BLE001 - reported, the timed runs may still work
            doc["results"].append({"path": path, "tokens": warm, "status": "warmup-error",
                                   "error": f"{type(e).__name__}: {e}"[:2000]})
        model = None
        _free(args.device)
        stopped = None
        for n in lengths:
            row = {"path": path, "tokens": n}
            if stopped is not None:
                row.update(status="skipped", error=f"out of memory at {stopped} tokens")
                doc["results"].append(row)
                write(args.out, doc)
                continue
            try:
                model = build_model(args, path, n)
                row.update(run_once(model, args, n, args.decode_steps), status="ok")
            except Exception as e:  # noqa: BLE001
                if _is_oom(e):
                    row.update(status="oom", error=f"{type(e).__name__}: {str(e)[:300]}")
                    stopped = n
                else:
                    row.update(status="error", error=traceback.format_exc()[-2000:])
            model = None
            _free(args.device)
            doc["results"].append(row)
            write(args.out, doc)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
