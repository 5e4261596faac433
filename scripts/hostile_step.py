# SPDX-License-Identifier: Apache-2.0
"""Every kernel path of a step under hostile metadata (docs/spec.md, "Bounds"), for
compute-sanitizer on a GPU:

    python3 scripts/hostile_step.py                  # compile and check against the reference
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/hostile_step.py

The step is M3's TP1 geometry (64 query heads, 4 KV and index heads, D = Di = B = 128) with a
decode, a verify of 4 tokens and a prefill chunk of 300 tokens (the request, tile and, on
Hopper, Gluon launches of both branches), over bf16, fp8 and NVFP4 index caches and bf16 and
fp8 KV caches. Each hostile variant (page ids past the cache and negative ones, a request wider
than its table, cu_seqlens_q decreasing or past the tokens, slots past the caches) runs
select_blocks, block_scores, sparse_attention, sparse_page_table, the cache writers and
fused_prepare, and each result is compared with the reference on the CPU: a path that read
something else would differ. Exit status 1 on a mismatch.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

import openmsa
from openmsa import reference as ref
from openmsa.ops.attention.plan import AttentionConfig

B = 128
HQ, HKV, H, D = 64, 4, 4, 128
Q_LENS = [1, 4, 300]
SEQ_LENS = [3000, 2000, 1500]
RULE = dict(topk=16, init_blocks=0, local_blocks=1)
# an attention plan that tiles every prefill chunk, however short the step
TILES = dataclasses.replace(AttentionConfig(), prefill_min_tokens=1)
FAILURES: list[str] = []


def _step(seed: int):
    """(cu_seqlens_q, seq_lens, block_table, num_pages, num_tokens): scattered pages, one spare
    column, 3 padding tokens."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-s // B) for s in SEQ_LENS]
    width = max(blocks) + 1
    pages = sum(blocks) + 4
    perm = torch.randperm(pages, generator=g)
    table = torch.full((len(SEQ_LENS), width), -1, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(blocks):
        table[r, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    cu = torch.tensor([0] + torch.tensor(Q_LENS).cumsum(0).tolist(), dtype=torch.int32)
    return cu, torch.tensor(SEQ_LENS, dtype=torch.int32), table, pages, int(cu[-1]) + 3


def _hostile(name, cu, sl, bt, pages, num_tokens):
    cu, sl, bt = cu.clone(), sl.clone(), bt.clone()
    if name == "pages":
        bt[0, 3], bt[0, 20], bt[1, 0], bt[2, 5] = pages, 2 ** 30, -(2 ** 31), -9
    elif name == "narrow":
        sl[1] = bt.shape[1] * B + 5
    elif name == "cu_decreasing":
        cu[2] = cu[1] - 1
    elif name == "cu_past_tokens":
        cu[-1] = num_tokens + 50
    return cu, sl, bt


def _check(what, ok):
    if not ok:
        FAILURES.append(what)
        print(f"MISMATCH {what}", flush=True)


def _written(cache):
    """[P, B] bool: which token rows of a zero-initialised cache hold a nonzero byte."""
    c = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    if cache.shape[-1] == 72:
        return c[:, :, :64].ne(0).any(-1)
    return c.reshape(cache.shape[0], cache.shape[1], -1).ne(0).any(-1)


def _ints(shape, g, lo=-2, hi=3):
    return torch.randint(lo, hi, shape, generator=g).float()


def run(name: str) -> None:
    dev = "cuda"
    cu0, sl0, bt0, pages, num_tokens = _step(1)
    cu, sl, bt = _hostile(name, cu0, sl0, bt0, pages, num_tokens)
    g = torch.Generator().manual_seed(2)
    meta = (cu, sl, bt)
    meta_d = tuple(x.to(dev) for x in meta)
    iq = _ints((num_tokens, H, D), g)
    keys = _ints((pages, B, D), g)
    nvfp4_keys = torch.randn(pages * B, D, generator=g)
    nvfp4 = torch.zeros(pages, B, 72, dtype=torch.uint8)
    ref.write_index_cache(nvfp4_keys, nvfp4, torch.arange(pages * B))
    for label, qd, cache in (("bf16", torch.bfloat16, keys.to(torch.bfloat16)),
                             ("fp8", torch.float8_e4m3fn, keys.to(torch.float8_e4m3fn)),
                             ("nvfp4", torch.float8_e4m3fn, nvfp4)):
        q = iq.to(qd)
        for max_q_len in (None, 300):
            got = openmsa.select_blocks(q.to(dev), cache.to(dev), *meta_d, block_size=B,
                                        max_q_len=max_q_len, **RULE)
            want = ref.select_blocks(q, cache, *meta, block_size=B, **RULE)
            # NVFP4 scores are random-valued (not integers): compare where no near-tie decides
            if label == "nvfp4":
                s = ref.block_scores(q, cache, *meta, block_size=B)
                top = s.sort(-1, descending=True).values
                clear = ((top[..., 14] - top[..., 15]).abs() > 1e-3) \
                    & ((top[..., 15] - top[..., 16]).abs() > 1e-3)
                _check(f"{name} select {label} {max_q_len}",
                       torch.equal(got.cpu()[clear], want[clear]))
            else:
                _check(f"{name} select {label} {max_q_len}", torch.equal(got.cpu(), want))
            scores = openmsa.block_scores(q.to(dev), cache.to(dev), *meta_d, block_size=B,
                                          max_q_len=max_q_len)
            want_s = ref.block_scores(q, cache, *meta, block_size=B)
            _check(f"{name} scores {label} {max_q_len}",
                   torch.equal(scores.cpu().isfinite(), want_s.isfinite()))
    indices = ref.select_blocks(iq, keys, *meta, block_size=B, **RULE)
    # a few entries that name no block: ignored by every path
    indices[0, 0, 3] = 10 ** 6
    indices[5, 1, 0] = -4
    q = torch.randn(num_tokens, HQ, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(pages, HKV, B, 2 * D, generator=g)
    for label, kv_dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        packed = kv.to(kv_dtype)
        k = packed[..., :D].permute(0, 2, 1, 3)
        v = packed[..., D:].permute(0, 2, 1, 3)
        pd = packed.to(dev)
        kd, vd = pd[..., :D].permute(0, 2, 1, 3), pd[..., D:].permute(0, 2, 1, 3)
        want, want_lse = ref.sparse_attention(q, k, v, indices, *meta, block_size=B,
                                              return_lse=True)
        # the default plan (per-token programs at this size) and one that takes the prefill
        # chunk's tiles (the Gluon tile kernel on Hopper)
        for form, config in (("token", None), ("tiles", TILES)):
            out, lse = openmsa.sparse_attention(q.to(dev), kd, vd, indices.to(dev), *meta_d,
                                                block_size=B, return_lse=True, config=config)
            _check(f"{name} attention {label} {form} lse",
                   torch.equal(lse.cpu().isfinite(), want_lse.isfinite()))
            _check(f"{name} attention {label} {form} out",
                   torch.allclose(out.cpu().float(), want.float(), atol=3e-2, rtol=3e-2))
    pt = openmsa.sparse_page_table(indices.to(dev), *meta_d, num_kv_heads=HKV, block_size=B,
                                   num_pages=pages)
    want_pt = ref.sparse_page_table(indices, *meta, num_kv_heads=HKV, block_size=B,
                                    num_pages=pages)
    _check(f"{name} page table", all(torch.equal(a.cpu(), b) for a, b in zip(pt, want_pt)))
    # writes: slots past the caches and negative ones write nothing
    slots = torch.arange(num_tokens, dtype=torch.int64) * 7
    slots[0], slots[1], slots[2] = pages * B, pages * B + 10 ** 6, -3
    for label, cache in (("fp8", torch.zeros(pages, B, D, dtype=torch.float8_e4m3fn)),
                         ("nvfp4", torch.zeros(pages, B, 72, dtype=torch.uint8))):
        got_c, want_c = cache.to(dev), cache.clone()
        xk = torch.randn(num_tokens, D, generator=g).to(torch.bfloat16)
        openmsa.write_index_cache(xk.to(dev), got_c, slots.to(dev))
        ref.write_index_cache(xk, want_c, slots)
        _check(f"{name} write_index_cache {label}",
               torch.equal(got_c.cpu().view(torch.uint8), want_c.view(torch.uint8)))
    kc = torch.zeros(pages, B, HKV, D, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    kd_, vd_ = kc.to(dev), vc.to(dev)
    xk = torch.randn(num_tokens, HKV, D, generator=g).to(torch.bfloat16)
    xv = torch.randn(num_tokens, HKV, D, generator=g).to(torch.bfloat16)
    openmsa.write_kv_cache(xk.to(dev), xv.to(dev), kd_, vd_, slots.to(dev))
    ref.write_kv_cache(xk, xv, kc, vc, slots)
    _check(f"{name} write_kv_cache", torch.equal(kd_.cpu(), kc) and torch.equal(vd_.cpu(), vc))
    cfg = openmsa.MSAConfig()
    width = (HQ + 2 * HKV) * D + (H + 1) * D
    qkv = torch.randn(num_tokens, width, generator=g).to(torch.bfloat16)
    positions = torch.arange(num_tokens, dtype=torch.int64)
    w = [torch.randn(D, generator=g) * 0.1 for _ in range(4)]
    for label, icache in (("fp8", torch.zeros(pages, B, D, dtype=torch.float8_e4m3fn)),
                          ("nvfp4", torch.zeros(pages, B, 72, dtype=torch.uint8))):
        caches = [kc.clone(), vc.clone(), icache]
        dcaches = [c.to(dev) for c in caches]
        openmsa.fused_prepare(qkv.to(dev), positions.to(dev), cfg, *[x.to(dev) for x in w],
                              dcaches[0], dcaches[1], slots.to(dev), dcaches[2], slots.to(dev))
        ref.fused_prepare(qkv, positions, cfg, *w, caches[0], caches[1], slots, caches[2],
                          slots)
        # the rows written (the kernel's and the reference's values differ in rounding only)
        same = all(torch.equal(_written(a.cpu()), _written(b)) for a, b in zip(dcaches, caches))
        _check(f"{name} fused_prepare {label}", same)


def main() -> int:
    if not torch.cuda.is_available():
        print("hostile_step.py needs a CUDA GPU", file=sys.stderr)
        return 2
    for name in ("pages", "narrow", "cu_decreasing", "cu_past_tokens"):
        print(f"== {name}", flush=True)
        run(name)
    torch.cuda.synchronize()
    print("mismatches:", FAILURES or "none", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
