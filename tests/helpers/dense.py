# SPDX-License-Identifier: Apache-2.0
"""Dense causal attention over each request's whole paged context: what sparsity is compared
against. `DENSE_OPS` plugs it into MSAAttention (`ops=DENSE_OPS`): the reference preparation,
no selection, and dense attention in place of the sparse one."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from openmsa import reference

__all__ = ["dense_paged_attention", "DENSE_OPS"]


def _scale_value(s) -> float:
    if s is None:
        return 1.0
    return float(s) if not isinstance(s, torch.Tensor) else float(s.reshape(()))


def dense_paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *,
                          block_size, scale=None, k_scale=None, v_scale=None) -> torch.Tensor:
    """Dense causal GQA attention over each request's whole paged context, through
    scaled_dot_product_attention (one launch per request; it reads the metadata on the host, so
    it synchronises). Padding tokens give 0."""
    from torch.nn.attention.bias import causal_lower_right

    out = torch.zeros_like(q)
    cu, sl = cu_seqlens_q.tolist(), seq_lens.tolist()
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    ks, vs = _scale_value(k_scale), _scale_value(v_scale)
    for r in range(len(sl)):
        ql, n = cu[r + 1] - cu[r], sl[r]
        if ql == 0 or n == 0 or ql > n:
            continue
        nb = -(-n // block_size)
        pages = block_table[r, :nb].long()
        k = (k_cache[pages].float() * ks).reshape(nb * block_size, hkv, d)[:n]
        v = (v_cache[pages].float() * vs).reshape(nb * block_size, hkv, d)[:n]
        k = k.to(q.dtype).transpose(0, 1).repeat_interleave(hq // hkv, 0)
        v = v.to(q.dtype).transpose(0, 1).repeat_interleave(hq // hkv, 0)
        qq = q[cu[r]:cu[r + 1]].transpose(0, 1)
        o = F.scaled_dot_product_attention(qq, k, v, attn_mask=causal_lower_right(ql, n),
                                           scale=scale)
        out[cu[r]:cu[r + 1]] = o.transpose(0, 1)
    return out


def _no_selection(*args, **kwargs):
    return None


def _dense_attention(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table, *,
                     block_size, k_scale=None, v_scale=None):
    del indices  # every causal key is attended
    return dense_paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table,
                                 block_size=block_size, k_scale=k_scale, v_scale=v_scale)


DENSE_OPS = SimpleNamespace(fused_prepare=reference.fused_prepare, select_blocks=_no_selection,
                            sparse_attention=_dense_attention)
