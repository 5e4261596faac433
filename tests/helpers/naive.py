# SPDX-License-Identifier: Apache-2.0
"""A naive implementation of docs/spec.md, written from the text alone for the property tests
(tests/test_properties.py): plain Python loops over tokens, heads, blocks and keys, float64 math.

It imports nothing from openmsa on purpose: it must not share a bug with `openmsa.reference` or
`openmsa.batch`. Clarity over speed; section names below are docs/spec.md's."""

from __future__ import annotations

import math

import torch

__all__ = ["naive_layout", "naive_block_scores", "naive_select", "naive_sparse_attention",
           "naive_page_table", "naive_write_index_cache", "naive_write_kv_cache",
           "naive_batch_is_valid", "FP8_MAX"]

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}


def _step_well_formed(cu: list[int], num_tokens: int) -> bool:
    # "Bounds": cu_seqlens_q starts at 0, never decreases and ends at most at T
    return cu[0] == 0 and cu[-1] <= num_tokens and all(b >= a for a, b in zip(cu, cu[1:]))


def naive_layout(cu_seqlens_q, seq_lens, num_tokens: int, block_size: int,
                 table_width: int) -> list[tuple[int, int]]:
    """(request, position) of every token; position -1 for padding ("Batch layout", "Padding",
    "Bounds"). `table_width`: the width of the block table of the branch asking."""
    cu = [int(x) for x in cu_seqlens_q]
    sl = [int(x) for x in seq_lens]
    num_requests = len(sl)
    well_formed = _step_well_formed(cu, num_tokens)
    out = []
    for t in range(num_tokens):
        # the request of row t: the number of offsets cu[1:] that are <= t
        r = sum(1 for c in cu[1:] if c <= t)
        if not well_formed or r >= num_requests:
            out.append((r, -1))
            continue
        q_len = cu[r + 1] - cu[r]
        blocks = -(-sl[r] // block_size) if sl[r] > 0 else 0
        if q_len > sl[r] or blocks > table_width:
            out.append((r, -1))
            continue
        out.append((r, sl[r] - q_len + (t - cu[r])))
    return out


def naive_block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                       block_size: int) -> torch.Tensor:
    """"Block score": fp32 [T, H, max_blocks], -inf past the causal blocks, for padding tokens
    and for blocks whose page is outside [0, P). Dot products in float64: exact for the small
    integer inputs of the selection tests."""
    num_tokens, num_heads, _ = index_q.shape
    num_pages = index_cache.shape[0]
    width = block_table.shape[1]
    out = torch.full((num_tokens, num_heads, width), float("-inf"), dtype=torch.float64)
    layout = naive_layout(cu_seqlens_q, seq_lens, num_tokens, block_size, width)
    for t, (r, p) in enumerate(layout):
        if p < 0:
            continue
        n = p // block_size + 1
        for b in range(n):
            page = int(block_table[r, b])
            if not 0 <= page < num_pages:
                continue  # reads nothing: scores -inf
            # the keys j <= p of block b, i.e. its first min(B, p - b * B + 1) rows
            keys = index_cache[page, :min(block_size, p - b * block_size + 1)].double()
            dots = keys @ index_q[t].double().T  # [keys, H]
            dots = torch.where(dots.isnan(), float("-inf"), dots)  # a NaN dot counts as -inf
            out[t, :, b] = dots.amax(dim=0)
    return out.float()


def naive_select(scores: torch.Tensor, positions: list[int], *, topk: int, init_blocks: int,
                 local_blocks: int, block_size: int, lower_id_first: bool = True
                 ) -> torch.Tensor:
    """"Selection: forced blocks and the tie rule": int32 [T, H, topk]. `lower_id_first=False`
    breaks the tie rule on purpose (the test that shows the suite can fail)."""
    num_tokens, num_heads, _ = scores.shape
    out = torch.full((num_tokens, num_heads, topk), -1, dtype=torch.int32)
    for t in range(num_tokens):
        p = positions[t]
        n = p // block_size + 1 if p >= 0 else 0
        for h in range(num_heads):
            if n <= topk:
                chosen = list(range(n))
            else:
                forced = [b for b in range(n) if b < init_blocks or b >= n - local_blocks]
                rest = []
                for b in range(n):
                    if b in forced:
                        continue
                    s = float(scores[t, h, b])
                    if math.isnan(s):
                        s = float("-inf")
                    # higher score first, then the lower block id (-0.0 == +0.0 in Python)
                    rest.append((-s, b if lower_id_first else -b))
                rest.sort()
                chosen = forced + [abs(b) for _, b in rest[:topk - len(forced)]]
            chosen.sort()
            out[t, h, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


def naive_sparse_attention(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table, *,
                           block_size: int, scale=None, k_scale: float = 1.0,
                           v_scale: float = 1.0):
    """"Sparse attention": (out [T, Hq, D] in q's dtype, lse fp32 [T, Hq])."""
    num_tokens, hq, d = q.shape
    num_pages, _, hkv, _ = k_cache.shape
    num_index_heads = indices.shape[1]
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros((num_tokens, hq, d), dtype=torch.float64)
    lse = torch.full((num_tokens, hq), float("-inf"), dtype=torch.float64)
    layout = naive_layout(cu_seqlens_q, seq_lens, num_tokens, block_size, block_table.shape[1])
    for t, (r, p) in enumerate(layout):
        if p < 0:
            continue
        n = p // block_size + 1
        for qh in range(hq):
            g = qh // group
            # J is a set of keys: a repeated id counts once
            sel = {int(b) for b in indices[t, g * num_index_heads // hkv]}
            keys, values = [], []
            for b in sorted(sel):
                if not 0 <= b < n:
                    continue  # ids outside [0, n) are ignored
                page = int(block_table[r, b])
                if not 0 <= page < num_pages:
                    continue  # a page outside [0, P) contributes no keys
                seen = min(block_size, p - b * block_size + 1)  # keys j <= p
                keys.append(k_cache[page, :seen, g].double() * k_scale)
                values.append(v_cache[page, :seen, g].double() * v_scale)
            if not keys:
                continue  # empty J: out 0, lse -inf
            logits = torch.cat(keys) @ q[t, qh].double() * scale  # [|J|]
            m = logits.amax()
            w = torch.exp(logits - m)
            out[t, qh] = (w[:, None] * torch.cat(values)).sum(0) / w.sum()
            lse[t, qh] = m + torch.log(w.sum())
    return out.to(q.dtype), lse.float()


def naive_page_table(indices, cu_seqlens_q, seq_lens, block_table, *, num_kv_heads: int,
                     block_size: int, sub_page_size: int, num_pages: int | None = None):
    """`sparse_page_table` ("Sparse attention", last paragraph): (pages int32
    [T * Hkv, K * B / S], context_lens int32 [T * Hkv]). A table entry outside [0, P) is
    dropped like a repeated id; the op sees no cache, so without `num_pages` only negative ids
    are known not to be pages, and (our reading, not in the spec's text) ids whose sub-page ids
    int32 cannot hold, which no cache of int32 sub-page ids has."""
    limit = 2 ** 31 // (block_size // sub_page_size) if num_pages is None else num_pages
    num_tokens, num_index_heads, topk = indices.shape
    per_block = block_size // sub_page_size
    pages = torch.zeros((num_tokens * num_kv_heads, topk * per_block), dtype=torch.int32)
    lens = torch.zeros(num_tokens * num_kv_heads, dtype=torch.int32)
    layout = naive_layout(cu_seqlens_q, seq_lens, num_tokens, block_size, block_table.shape[1])
    for t, (r, p) in enumerate(layout):
        if p < 0:
            continue
        n = p // block_size + 1
        for g in range(num_kv_heads):
            sel = sorted({int(b) for b in indices[t, g * num_index_heads // num_kv_heads]
                          if 0 <= int(b) < n and 0 <= int(block_table[r, int(b)]) < limit})
            row, ctx = [], 0
            for b in sel:
                if b < n - 1:
                    row += [int(block_table[r, b]) * per_block + j for j in range(per_block)]
                    ctx += block_size
            if n - 1 in sel:
                seen = p % block_size + 1
                row += [int(block_table[r, n - 1]) * per_block + j
                        for j in range(-(-seen // sub_page_size))]
                ctx += seen
            pages[t * num_kv_heads + g, :len(row)] = torch.tensor(row, dtype=torch.int32)
            lens[t * num_kv_heads + g] = ctx
    return pages, lens


def _store(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """"Caches and layouts", fp8 casts: x / scale, clamped by comparisons (NaN stays NaN), then
    rounded to nearest."""
    x = x.float() / scale
    if dtype in FP8_MAX:
        m = FP8_MAX[dtype]
        # (a comparison is false for NaN, so NaN passes through both)
        x = torch.where(x > m, m, torch.where(x < -m, -m, x))
    return x.to(dtype)


def naive_write_index_cache(index_k, index_cache, slot_mapping) -> torch.Tensor:
    """A copy of index_cache after the write: a slot outside [0, P * B) writes nothing."""
    cache = index_cache.clone()
    num_pages, block_size, _ = cache.shape
    for t, s in enumerate(int(x) for x in slot_mapping):
        if 0 <= s < num_pages * block_size:
            cache[s // block_size, s % block_size] = _store(index_k[t], cache.dtype)
    return cache


def naive_write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, k_scale: float = 1.0,
                         v_scale: float = 1.0):
    """Copies of (k_cache, v_cache) after the write."""
    kc, vc = k_cache.clone(), v_cache.clone()
    num_pages, block_size = kc.shape[:2]
    for t, s in enumerate(int(x) for x in slot_mapping):
        if 0 <= s < num_pages * block_size:
            kc[s // block_size, s % block_size] = _store(k[t], kc.dtype, k_scale)
            vc[s // block_size, s % block_size] = _store(v[t], vc.dtype, v_scale)
    return kc, vc


def naive_batch_is_valid(cu_seqlens_q, seq_lens, block_table, *, block_size: int,
                         num_pages: int | None) -> bool:
    """What `validate_batch` accepts ("Bounds", last paragraph, and its docstring): offsets from
    0, non-decreasing; seq_lens >= 0; q_len <= seq_len; a column per block; the pages a request
    uses in [0, num_pages) when given."""
    cu = [int(x) for x in cu_seqlens_q]
    sl = [int(x) for x in seq_lens]
    if cu[0] != 0:
        return False
    for r in range(len(sl)):
        q_len = cu[r + 1] - cu[r]
        if q_len < 0 or sl[r] < 0 or q_len > sl[r]:
            return False
        blocks = -(-sl[r] // block_size)
        if blocks > block_table.shape[1]:
            return False
        if num_pages is not None and any(not 0 <= int(block_table[r, b]) < num_pages
                                         for b in range(blocks)):
            return False
    return True
