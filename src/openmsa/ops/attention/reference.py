# SPDX-License-Identifier: Apache-2.0
"""The main branch in pure PyTorch, fp32 math: the spec in code (see README.md beside this)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...batch import num_causal_blocks, page_in_cache, request_spans, token_layout
from .checks import check_attention_args, check_page_table_args, page_bound

if TYPE_CHECKING:
    from .plan import AttentionConfig

__all__ = ["sparse_attention", "sparse_page_table", "kv_head_to_index_head"]

# fp32 elements of one gathered K (or V) chunk: bounds the reference's memory (128 MB each).
_CHUNK_ELEMENTS = 1 << 25
# a request of at most this many times topk blocks is attended densely under a selection mask
_DENSE_BLOCKS_PER_TOPK = 2


def kv_head_to_index_head(num_kv_heads: int, num_index_heads: int) -> torch.Tensor:
    """KV head g reads the selection of index head g * H // Hkv."""
    return torch.arange(num_kv_heads) * num_index_heads // num_kv_heads


def _masked_softmax(logits, visible):
    """Softmax over the last dim restricted to `visible`; an empty row gives zeros and -inf."""
    logits = torch.where(visible, logits, torch.full((), float("-inf"), device=logits.device))
    row_lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - row_lse[..., None])
    probs = torch.where(visible, probs, torch.zeros((), device=logits.device))
    return probs, row_lse


def _as_scale(value, device):
    if value is None:
        return 1.0
    return value.float().reshape(()) if isinstance(value, torch.Tensor) else float(value)


def sparse_attention(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table, *,
                     scale=None, block_size=128, out=None, return_lse=False, k_scale=None,
                     v_scale=None, config: AttentionConfig | None = None):
    """Exact GQA softmax attention over the tokens of the selected blocks (MSA's main branch;
    docs/spec.md, "Sparse attention").

    Args:
        q: [T, Hq, D] bf16/fp16 (fp32 accepted by the reference).
        k_cache, v_cache: [P, B, Hkv, D] views with any strides, bf16/fp16/fp8 e4m3.
        indices: int32 [T, H, K] block ids per (token, index head); entries < 0 or >= the token's
            causal blocks are ignored, a repeated id counts once (J is a set).
        scale: softmax scale, D ** -0.5 by default.
        out: optional [T, Hq, D] in q's dtype, written in place.
        return_lse: also return fp32 [T, Hq] natural-log LSE.
        k_scale, v_scale: optional per-tensor dequantisation scales (fp8 caches).
        config: the kernels' launch knobs, which the reference has none of (accepted so that
            the two signatures are one).

    Returns:
        out, or (out, lse). A row with no visible key gives out = 0 and lse = -inf.
    """
    check_attention_args(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table,
                         scale=scale, block_size=block_size, out=out, k_scale=k_scale,
                         v_scale=v_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    topk = indices.shape[2]
    device = q.device
    sm_scale = head_dim ** -0.5 if scale is None else float(scale)
    ks, vs = _as_scale(k_scale, device), _as_scale(v_scale, device)
    result = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=device)
    _, position = token_layout(cu_seqlens_q, seq_lens, num_tokens, block_size=block_size,
                               table_width=block_table.shape[1])
    head_map = kv_head_to_index_head(num_kv_heads, indices.shape[1]).to(device)
    kv_head = torch.arange(num_kv_heads, device=device)[None, :, None]
    offs = torch.arange(block_size, device=device)
    earlier = torch.ones(topk, topk, dtype=torch.bool, device=device).tril(-1)  # [i, j]: j < i
    for _, start, end, seq_len, req_pages in request_spans(cu_seqlens_q, seq_lens, num_tokens,
                                                           block_table, block_size):
        # the request's pages in fp32 once (dequantised), so chunks gather fp32 directly; V rows
        # at or past seq_len were never written (maybe NaN) and are zeroed here, once
        nb = req_pages.shape[0]
        # an entry naming no page of the cache (-1, or a stale id past it) reads nothing
        unfilled = ~page_in_cache(req_pages, k_cache.shape[0])
        req_pages = req_pages.masked_fill(unfilled, 0)
        kf = k_cache[req_pages].float().contiguous()  # [nb, B, Hkv, D], a copy
        vf = v_cache[req_pages].float().contiguous()
        if not isinstance(ks, float) or ks != 1.0:
            kf = kf * ks
        if not isinstance(vs, float) or vs != 1.0:
            vf = vf * vs
        vf.view(nb * block_size, num_kv_heads, head_dim)[seq_len:] = 0
        # short contexts: every key of the request against a selection mask (no per-token
        # gather); long ones: gather each token's selected blocks
        dense = nb <= _DENSE_BLOCKS_PER_TOPK * topk
        step = max(1, _CHUNK_ELEMENTS // (num_kv_heads * head_dim
                                          * (nb * block_size if dense else topk * block_size)))
        for s in range(start, end, step):
            e = min(end, s + step)
            c = e - s
            p = position[s:e].long()  # [c]
            n = num_causal_blocks(p, block_size)[:, None, None]  # [c, 1, 1]
            sel = indices[s:e].long()[:, head_map, :]  # [c, Hkv, K]
            valid = (sel >= 0) & (sel < n)
            blk = torch.where(valid, sel, torch.zeros_like(sel))
            valid &= ~unfilled[blk]
            qq = q[s:e].float().view(c, num_kv_heads, group, head_dim)
            if dense:
                # J as a mask over the request's keys; a repeated id sets the same bit (a set)
                chosen = torch.zeros(c, num_kv_heads, nb + 1, dtype=torch.bool, device=device)
                chosen.scatter_(-1, torch.where(valid, blk, nb), True)
                key_pos = torch.arange(nb * block_size, device=device)
                visible = chosen[..., :nb].repeat_interleave(block_size, -1) \
                    & (key_pos <= p[:, None, None])  # [c, Hkv, L]
                keys = kf.view(nb * block_size, num_kv_heads, head_dim)
                values = vf.view(nb * block_size, num_kv_heads, head_dim)
                logits = torch.einsum("cgqd,lgd->cgql", qq, keys) * sm_scale
                probs, row_lse = _masked_softmax(logits, visible[:, :, None])
                # a key the token does not see adds nothing, even a NaN value (0 * NaN is NaN)
                values = torch.where(visible[..., None], values.transpose(0, 1)[None], 0.0)
                o = torch.einsum("cgql,cgld->cgqd", probs, values)
            else:
                # J is a set: an id already listed earlier in the row adds nothing
                dup = ((sel[..., :, None] == sel[..., None, :]) & valid[..., None, :]
                       & earlier).any(-1)
                valid &= ~dup
                key_pos = blk[..., None] * block_size + offs  # [c, Hkv, K, B]
                visible = (valid[..., None] & (key_pos <= p[:, None, None, None])).flatten(-2)
                k = kf[blk, :, kv_head.expand_as(blk)].flatten(2, 3)  # [c, Hkv, K*B, D]
                v = vf[blk, :, kv_head.expand_as(blk)].flatten(2, 3)
                logits = torch.einsum("cgqd,cgjd->cgqj", qq, k) * sm_scale
                probs, row_lse = _masked_softmax(logits, visible[:, :, None])
                v = torch.where(visible[..., None], v, 0.0)
                o = torch.einsum("cgqj,cgjd->cgqd", probs, v)
            result[s:e] = o.reshape(c, num_heads, head_dim)
            lse[s:e] = row_lse.reshape(c, num_heads)
    if out is None:
        out = result.to(q.dtype)
    else:
        out.copy_(result)
    return (out, lse) if return_lse else out


def sparse_page_table(indices, cu_seqlens_q, seq_lens, block_table, *, num_kv_heads,
                      block_size=128, sub_page_size=16, num_pages=None):
    """A selection as a page table for any paged-attention kernel that runs one query row.

    Row t * Hkv + g (head-minor) lists the physical sub-pages (page * B/S + j, S = sub_page_size)
    of token t's selected blocks for KV head g: full blocks ascending, then the token's own block
    cut to its causal sub-pages. Entries < 0, >= n or repeated are dropped, and so are those whose
    table entry names no page: outside [0, num_pages), or negative when num_pages is None (the
    cache's page count is not known here), or too large for int32 sub-page ids; unused columns
    hold 0.

    Returns:
        (pages int32 [T * Hkv, K * B/S], context_lens int32 [T * Hkv]) where context_len is the
        full blocks' tokens plus the own block's p % B + 1 causal tokens (0 for padding rows).
    """
    check_page_table_args(indices, cu_seqlens_q, seq_lens, block_table,
                          num_kv_heads=num_kv_heads, block_size=block_size,
                          sub_page_size=sub_page_size, num_pages=num_pages)
    num_tokens, num_index_heads, topk = indices.shape
    per_block = block_size // sub_page_size
    pages = torch.zeros(num_tokens * num_kv_heads, topk * per_block, dtype=torch.int32)
    lens = torch.zeros(num_tokens * num_kv_heads, dtype=torch.int32)
    request, position = token_layout(cu_seqlens_q, seq_lens, num_tokens, block_size=block_size,
                                     table_width=block_table.shape[1])
    head_map = kv_head_to_index_head(num_kv_heads, num_index_heads).tolist()
    for t in range(num_tokens):
        p = int(position[t])
        if p < 0:
            continue
        n = p // block_size + 1
        # (int64: a bound of 2^31 would wrap against int32 ids)
        table = block_table[int(request[t])].long()
        in_cache = page_in_cache(table, page_bound(num_pages, per_block)).tolist()
        table = table.tolist()
        for g in range(num_kv_heads):
            ids = []
            for b in indices[t, head_map[g]].tolist():
                if 0 <= b < n and b not in ids and in_cache[b]:
                    ids.append(b)
            full = sorted(b for b in ids if b != n - 1)
            subs = [table[b] * per_block + j for b in full for j in range(per_block)]
            length = len(full) * block_size
            if n - 1 in ids:
                own = p - (n - 1) * block_size + 1
                subs += [table[n - 1] * per_block + j
                         for j in range(-(-own // sub_page_size))]
                length += own
            row = t * num_kv_heads + g
            pages[row, :len(subs)] = torch.tensor(subs, dtype=torch.int32)
            lens[row] = length
    return pages.to(indices.device), lens.to(indices.device)
