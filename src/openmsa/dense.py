# SPDX-License-Identifier: Apache-2.0
"""Dense causal attention over each request's whole paged context: what MSA is compared against
(the demo, the tests), and what sparse attention equals when every causal block is selected.
`DENSE_OPS` plugs it into MSAAttention (`ops=DENSE_OPS`): the reference preparation, no
selection, and dense attention in place of the sparse one.

It runs through `scaled_dot_product_attention`, one call per request, independent of every
openmsa op, so that a comparison against it checks something."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from . import reference

__all__ = ["dense_paged_attention", "DENSE_OPS"]


def _dequantized(x: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return x.to(dtype)
    if isinstance(scale, torch.Tensor):
        scale = float(scale.reshape(()))
    return (x.float() * float(scale)).to(dtype)


def dense_paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *,
                          block_size, scale=None, k_scale=None, v_scale=None,
                          dtype=None) -> torch.Tensor:
    """Dense causal GQA attention of each request's queries over its whole paged context.

    Args:
        q: [T, Hq, D], any float dtype.
        k_cache, v_cache: [P, B, Hkv, D] paged caches (B = block_size), any float dtype.
        cu_seqlens_q: [R + 1] query offsets; seq_lens: [R] context lengths (the queries are the
            last tokens of the context). Tensors are read on the host (a sync on the GPU); host
            lists are taken as they are.
        block_table: [R, W] page ids; the first ceil(seq_len / B) of a row are read.
        block_size: tokens a page.
        scale: softmax scale, D ** -0.5 by default.
        k_scale, v_scale: optional per-tensor dequantisation scales (fp8 caches), applied in
            fp32.
        dtype: the dtype of the attention math and of the output; q's by default.

    Returns:
        [T, Hq, D] in `dtype`. Padding tokens, and the tokens of a request whose q_len exceeds
        its seq_len, give 0.
    """
    from torch.nn.attention.bias import causal_lower_right

    dtype = dtype or q.dtype
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // hkv
    out = torch.zeros_like(q, dtype=dtype)
    cu, sl = (x.tolist() if isinstance(x, torch.Tensor) else x for x in (cu_seqlens_q, seq_lens))
    for r in range(len(sl)):
        ql, n = cu[r + 1] - cu[r], sl[r]
        if ql == 0 or ql > n:
            continue
        nb = -(-n // block_size)
        pages = block_table[r, :nb].long()
        k = k_cache[pages].reshape(nb * block_size, hkv, d)[:n]
        v = v_cache[pages].reshape(nb * block_size, hkv, d)[:n]
        k = _dequantized(k, k_scale, dtype).transpose(0, 1)
        v = _dequantized(v, v_scale, dtype).transpose(0, 1)
        qq = q[cu[r]:cu[r + 1]].transpose(0, 1).to(dtype)
        o = F.scaled_dot_product_attention(qq, k.repeat_interleave(group, 0),
                                           v.repeat_interleave(group, 0),
                                           attn_mask=causal_lower_right(ql, n), scale=scale)
        out[cu[r]:cu[r + 1]] = o.transpose(0, 1)
    return out


def _no_selection(*args, **kwargs):
    return None


def _dense_attention(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table, *,
                     block_size, scale=None, k_scale=None, v_scale=None):
    del indices  # every causal key is attended
    return dense_paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table,
                                 block_size=block_size, scale=scale, k_scale=k_scale,
                                 v_scale=v_scale)


DENSE_OPS = SimpleNamespace(fused_prepare=reference.fused_prepare, select_blocks=_no_selection,
                            sparse_attention=_dense_attention)
