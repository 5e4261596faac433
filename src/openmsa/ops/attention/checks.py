# SPDX-License-Identifier: Apache-2.0
"""Argument checks of sparse_attention (shapes, dtypes, devices; no device values)."""

from __future__ import annotations

import math

import torch

from ..._checks import (FP8_TYPES, HALF, MAX_TOPK, check_block_size, check_int_tensor,
                        check_out, check_scale_arg, check_step, check_tensor)

KV_DTYPES = (*HALF, *FP8_TYPES, torch.float32)


def check_attention_args(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table, *,
                         scale, block_size, out, k_scale, v_scale) -> None:
    check_tensor("q", q, ndim=3, dtypes=(*HALF, torch.float32))
    device = q.device
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_DTYPES, device=device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=KV_DTYPES, device=device)
    check_block_size(block_size)
    num_tokens, num_heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must have one shape and dtype, got "
                         f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} "
                         f"{v_cache.dtype}")
    _, bs, num_kv_heads, d = k_cache.shape
    if bs != block_size or d != head_dim:
        raise ValueError(f"k_cache/v_cache must be [pages, block_size={block_size}, kv_heads, "
                         f"head_dim={head_dim}], got {tuple(k_cache.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        # the kernels add a page's key and column offsets in 32 bits to the page's address
        if (bs - 1) * cache.stride(1) + (d - 1) * cache.stride(3) >= 2 ** 31:
            raise ValueError(f"{name}'s block and head_dim strides must span fewer than 2^31 "
                             f"elements within a page, got strides {tuple(cache.stride())}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"q's heads ({num_heads}) must be a multiple of the caches' KV heads "
                         f"({num_kv_heads})")
    check_int_tensor("indices", indices, ndim=3, device=device)
    if indices.shape[0] != num_tokens:
        raise ValueError(f"indices must have a row per token ({num_tokens}), got "
                         f"{tuple(indices.shape)}")
    h = indices.shape[1]
    if h < 1 or (num_kv_heads % h and h % num_kv_heads):
        raise ValueError(f"indices' index heads ({h}) and the KV heads ({num_kv_heads}) must "
                         f"divide one another")
    if not 1 <= indices.shape[2] <= MAX_TOPK:
        raise ValueError(f"indices must hold 1 to {MAX_TOPK} blocks per row (the kernels' "
                         f"bound, on every device), got {indices.shape[2]}")
    check_step(cu_seqlens_q, seq_lens, block_table, device)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not (math.isfinite(scale) and scale > 0)):
        raise ValueError(f"scale must be a finite positive float or None, got {scale!r}")
    check_scale_arg("k_scale", k_scale, device)
    check_scale_arg("v_scale", v_scale, device)
    if out is not None:
        check_out("out", out, tuple(q.shape), q.dtype, device)


def page_bound(num_pages: int | None, per_block: int) -> int:
    """The page ids sparse_page_table keeps: those in [0, page_bound), i.e. in the cache (when
    num_pages is given) and with int32 sub-page ids (page * per_block + j < 2^31: a larger id,
    stale or not, would wrap in the kernel)."""
    bound = 2 ** 31 // per_block
    return bound if num_pages is None else min(num_pages, bound)


def check_page_table_args(indices, cu_seqlens_q, seq_lens, block_table, *, num_kv_heads,
                          block_size, sub_page_size, num_pages) -> None:
    check_int_tensor("indices", indices, ndim=3)
    device = indices.device
    check_step(cu_seqlens_q, seq_lens, block_table, device)
    check_block_size(block_size)
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be a positive int, got {num_kv_heads!r}")
    h = indices.shape[1]
    if h < 1 or (num_kv_heads % h and h % num_kv_heads):
        raise ValueError(f"indices' index heads ({h}) and num_kv_heads ({num_kv_heads}) must "
                         f"divide one another")
    if isinstance(sub_page_size, bool) or not isinstance(sub_page_size, int) \
            or sub_page_size < 1 or sub_page_size & (sub_page_size - 1) \
            or block_size % sub_page_size:
        raise ValueError(f"sub_page_size must be a power of two dividing block_size "
                         f"({block_size}), got {sub_page_size!r}")
    if num_pages is not None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int):
            raise TypeError(f"num_pages must be an int or None, got {type(num_pages).__name__}")
        if num_pages < 0:
            raise ValueError(f"num_pages must be at least 0, got {num_pages}")
