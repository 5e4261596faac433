# SPDX-License-Identifier: Apache-2.0
"""`python -m openmsa demo | env`: a self-contained demonstration, and what will run here."""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import time

import torch

import openmsa
from openmsa._dispatch import backend_name
from openmsa.batch import token_layout
from openmsa.dense import DENSE_OPS, dense_paged_attention


def _env() -> None:
    import numpy
    import triton

    print(f"openmsa {openmsa.__version__}  python {platform.python_version()}  torch "
          f"{torch.__version__}  triton {triton.__version__}  numpy {numpy.__version__}")
    print(f"CPU tensors run: {backend_name('cpu')}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            reason = openmsa.unsupported_reason(device=f"cuda:{i}")
            print(f"cuda:{i} {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                  f"{p.total_memory / 2**30:.0f} GiB): "
                  f"{'triton kernels' if reason is None else 'unsupported: ' + reason}")
    else:
        print("CUDA: not available (CUDA tensors would need a GPU)")


@contextlib.contextmanager
def _stage(what: str, device: str):
    """Say what runs now and, once it is done, how long it took: on the CPU the demo runs for a
    minute or two, most of it inside single calls."""
    print(f"  {what} ...", end="", flush=True)
    t0 = time.perf_counter()
    yield
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    print(f" {time.perf_counter() - t0:.1f} s", flush=True)


def _demo(context: int | None, device: str | None) -> None:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.startswith("cuda")
    cfg = openmsa.MSAConfig()  # MiniMax-M3's geometry at TP1
    bs, topk = cfg.block_size, cfg.topk_blocks
    context = context or (131072 if on_gpu else 4096)
    if context < 8 * bs:
        raise SystemExit(f"--context must be at least {8 * bs} tokens")
    g = torch.Generator(device="cpu").manual_seed(0)
    dt = torch.bfloat16
    # one step: a prefill chunk, a decode and a 4-token speculative verify
    q_lens = [bs, 1, 4]
    seq_lens = [context // 2, context, context - 777]
    blocks = [-(-s // bs) for s in seq_lens]
    num_pages = sum(blocks)
    table = torch.full((3, max(blocks)), -1, dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    start = 0
    for r, nb in enumerate(blocks):
        table[r, :nb] = perm[start:start + nb]
        start += nb
    cu = torch.tensor([0, q_lens[0], q_lens[0] + 1, sum(q_lens)], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    num_tokens = sum(q_lens)
    print(f"MiniMax-M3 sparse layer (64 q / 4 kv / 4 index heads, blocks of {bs}, top-{topk}) "
          f"on {device} ({backend_name(device)})")
    print(f"step: prefill chunk {q_lens[0]} tokens @ {seq_lens[0]}, decode @ {seq_lens[1]}, "
          f"4-token verify @ {seq_lens[2]}; fp8 index cache, bf16 K/V")

    with _stage(f"random caches for {sum(seq_lens)} tokens, written with write_index_cache and "
                f"write_kv_cache", device):
        slots = torch.cat([table[r].long().repeat_interleave(bs)[:s] * bs
                           + torch.arange(s) % bs for r, s in enumerate(seq_lens)])
        hkv, d, h, di = cfg.num_kv_heads, cfg.head_dim, cfg.num_index_heads, cfg.index_head_dim
        index_cache = torch.zeros(num_pages, bs, di, dtype=torch.float8_e4m3fn, device=device)
        k_cache = torch.zeros(num_pages, bs, hkv, d, dtype=dt, device=device)
        v_cache = torch.zeros_like(k_cache)
        index_k = torch.randn(len(slots), di, generator=g)
        k = torch.randn(len(slots), hkv, d, generator=g)
        v = torch.randn(len(slots), hkv, d, generator=g)
        index_q = torch.randn(num_tokens, h, di, generator=g)
        q = torch.randn(num_tokens, cfg.num_heads, d, generator=g)
        # the needle: block 3 of the decode request holds keys aligned with its queries
        needle = 3
        dec_t = q_lens[0]
        req1 = slice(seq_lens[0], seq_lens[0] + seq_lens[1])
        rows = torch.arange(needle * bs, needle * bs + 16)
        index_k[req1][rows] = 4.0 * index_q[dec_t].mean(0)
        # the decode token's query heads share one direction per KV group, and the needle's keys
        # point along it: in dense attention the needle takes nearly all the softmax mass. At 2x a
        # unit-variance direction its logits are ~45 against ~N(0, 4) for the random keys, so it
        # dominates even 1M random keys (at 1x, ~11 against N(0, 1), the random keys of a long
        # context still hold a fair share of the mass)
        u = 2.0 * torch.randn(hkv, 1, d, generator=g)
        q[dec_t] = (u + 0.1 * torch.randn(hkv, cfg.group_size, d, generator=g)).view(-1, d)
        k[req1][rows] = u[:, 0]
        v[req1][rows] = 5.0
        index_q_dev = index_q.to(torch.float8_e4m3fn).to(device)
        openmsa.write_index_cache(index_k.to(device), index_cache, slots.to(device))
        openmsa.write_kv_cache(k.to(dt).to(device), v.to(dt).to(device), k_cache, v_cache,
                               slots.to(device))
    cu, sl, table = cu.to(device), sl.to(device), table.to(device)
    qd = q.to(dt).to(device)

    def sparse():
        idx = openmsa.select_blocks(index_q_dev, index_cache, cu, sl, table, topk=topk,
                                    block_size=bs)
        return idx, openmsa.sparse_attention(qd, k_cache, v_cache, idx, cu, sl, table,
                                             block_size=bs)

    cu_host, sl_host = cu.tolist(), sl.tolist()

    def dense(dtype=dt):
        return dense_paged_attention(qd, k_cache, v_cache, cu_host, sl_host, table,
                                     block_size=bs, dtype=dtype)

    t0 = time.perf_counter()
    with _stage("select_blocks and sparse_attention", device):
        idx, out = sparse()
    # the error check against fp32 dense attention, so that only the sparse side rounds in bf16
    with _stage("dense attention in fp32, to compare with", device):
        ref_out = dense(torch.float32)
    elapsed = time.perf_counter() - t0
    found = bool((idx[dec_t] == needle).any(-1).all())
    # keys the main branch reads: the causal part of each selected block, averaged over heads
    _, pos = token_layout(cu, sl, num_tokens)
    p = pos.long()[:, None, None]
    sel = idx.long()
    per_block = (p - sel * bs + 1).clamp(min=0, max=bs) * (sel >= 0)
    read = float(per_block.sum()) / h / float((p + 1).sum())
    read_dec = float(per_block[dec_t].sum()) / h / seq_lens[1]
    err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
    dec_err = ((out[dec_t].float() - ref_out[dec_t].float()).norm()
               / ref_out[dec_t].float().norm()).item()
    print(f"needle block {needle} selected by every index head of the decode token: "
          f"{'yes' if found else 'NO'}  (its selection, head 0: {idx[dec_t, 0].tolist()})")
    print(f"sparse vs dense attention, relative error: decode token {dec_err:.4f} (the needle "
          f"holds its softmax mass), whole step {err:.3f} (MSA is not dense attention by design)")
    print(f"fraction of causal KV the main branch read: {read:.1%} of the step; decode token "
          f"{read_dec:.1%} of its {seq_lens[1]} keys")
    if on_gpu:
        for name, fn in (("sparse (select + attention)", sparse), ("dense attention", dense)):
            fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            print(f"{name}: {(time.perf_counter() - t) / 20 * 1e6:.0f} us per step (eager)")
    else:
        print(f"ran in {elapsed:.1f} s on the CPU reference")


def _demo_model(device: str | None, prompt_len: int | None) -> None:
    """The small M3-geometry model end to end: chunked prefill, then greedy decoding through the
    paged caches, with the public ops, with the reference ops, and (topk covering every block)
    against dense attention."""
    import dataclasses

    from openmsa.model import TinyMSAModel, ToyEngine

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.startswith("cuda")
    prompt_len = prompt_len or (16384 if on_gpu else 3000)
    cfg = openmsa.MSAConfig().shard(4)  # one TP4 rank of M3: 16 q / 1 kv / 1 index head
    chunk, new_tokens = 2048, 8
    pages = -(-(prompt_len + new_tokens) // cfg.block_size)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (prompt_len,), generator=g).tolist()
    # bf16 attention is refused under Triton's interpreter (docs/design.md): fp16 there
    interp = backend_name(device) == "triton-interpreter"
    dtype = torch.float16 if interp else torch.bfloat16
    idx_dtype = torch.float8_e4m3fn

    def generate(name, ops, config):
        model = TinyMSAModel(config, ops=ops, num_layers=2, hidden_size=256, device=device,
                             dtype=dtype)
        eng = ToyEngine(model, num_pages=pages, max_tokens=chunk, max_blocks=pages,
                        kv_dtype=model.dtype, index_dtype=idx_dtype, device=device)
        t0 = time.perf_counter()
        with _stage(f"{name}: prefill, {-(-prompt_len // chunk)} chunks", device):
            for s in range(0, prompt_len, chunk):
                logits = eng.step([(0, prompt[s:s + chunk])])
        with _stage(f"{name}: {new_tokens} decode steps", device):
            out = []
            for _ in range(new_tokens):
                out.append(int(logits[-1].argmax()))
                logits = eng.step([(0, out[-1:])])
        return out, logits[-1], time.perf_counter() - t0

    print(f"\nsmall model end to end: 2 sparse layers, M3 TP4 attention geometry, a {prompt_len}-"
          f"token prompt in chunks of {chunk}, then {new_tokens} greedy tokens "
          f"(fp8 index cache)")
    cases = [("openmsa ops", "kernels", cfg), ("reference ops", "reference", cfg)]
    full = dataclasses.replace(cfg, topk_blocks=min(64, pages))
    if pages <= 64:
        cases += [("all blocks selected", "kernels", full), ("dense attention", DENSE_OPS, full)]
    runs = {name: generate(name, ops, config) for name, ops, config in cases}
    against = {"openmsa ops": "reference ops", "all blocks selected": "dense attention"}
    for name, (toks, last, secs) in runs.items():
        note = ""
        if name in against:
            base = runs[against[name]][1]
            rel = float((last - base).norm() / base.norm())
            note = f"  last logits vs {against[name]}: {rel:.1e}"
        print(f"  {name:20s} ({secs:5.1f} s) tokens {toks}{note}")
    print(f"  (openmsa ops ran on {backend_name(device)}; sparse and dense differ by design: "
          f"MSA attends to {cfg.topk_blocks} blocks of {cfg.block_size})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openmsa")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="a mixed step with a planted needle, sparse vs dense")
    demo.add_argument("--context", type=int, default=None,
                      help="tokens of the longest request (default 4096 on CPU, 131072 on GPU)")
    demo.add_argument("--device", default=None)
    demo.add_argument("--prompt", type=int, default=None,
                      help="prompt tokens of the end-to-end model (default 3000 CPU, 16384 GPU)")
    sub.add_parser("env", help="versions, GPU and which implementation runs")
    args = parser.parse_args(argv)
    if args.cmd == "env":
        _env()
    else:
        _demo(args.context, args.device)
        _demo_model(args.device, args.prompt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
