# SPDX-License-Identifier: Apache-2.0
"""Argument checks of the index-branch ops (shapes, dtypes, devices; no device values)."""

from __future__ import annotations

from ..._checks import (check_block_size, check_index_dtypes, check_out, check_positive_int,
                        check_step, check_tensor, check_topk)
from ...nvfp4 import check_nvfp4_cache, is_nvfp4_cache


def check_indexer_args(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, block_size,
                       out, out_width, out_dtype, max_q_len=None) -> None:
    """out must be [T, H, out_width] of out_dtype (out_width None: the block table's width);
    max_q_len None or an int >= 0."""
    if max_q_len is not None:
        check_positive_int("max_q_len", max_q_len, minimum=0)
    check_tensor("index_q", index_q, ndim=3)
    device = index_q.device
    check_tensor("index_cache", index_cache, ndim=3, device=device)
    if is_nvfp4_cache(index_cache):
        check_block_size(block_size)
        _check_nvfp4_args(index_q, index_cache, block_size)
    else:
        check_index_dtypes(index_q, index_cache)
        check_block_size(block_size)
        if index_cache.shape[1] != block_size:
            raise ValueError(f"index_cache must be [pages, block_size={block_size}, "
                             f"index_head_dim], got shape {tuple(index_cache.shape)}")
        if index_cache.shape[2] != index_q.shape[2]:
            raise ValueError(f"index_cache's last dim ({index_cache.shape[2]}) must equal "
                             f"index_q's index_head_dim ({index_q.shape[2]})")
    if index_q.shape[1] < 1:
        raise ValueError("index_q must have at least one index head")
    check_step(cu_seqlens_q, seq_lens, block_table, device)
    if out is not None:
        width = block_table.shape[1] if out_width is None else out_width
        check_out("out", out, (*index_q.shape[:2], width), out_dtype, device)


def _check_nvfp4_args(index_q, index_cache, block_size) -> None:
    """A uint8 cache is NVFP4 pages and nothing else (never read as raw bytes): its layout
    (nvfp4.check_nvfp4_cache), 128-token blocks, index head dim 128 and a query it pairs with
    (_checks.check_index_dtypes: fp8 e4m3fn, 16-bit, or fp32 for the reference; the kernels
    refuse fp32, support.py)."""
    check_nvfp4_cache("index_cache", index_cache, block_size=block_size,
                      head_dim=("index_q", index_q.shape[2]))
    check_index_dtypes(index_q, index_cache)


def check_select_args(topk, init_blocks, local_blocks) -> None:
    check_topk("topk", topk)
    check_positive_int("init_blocks", init_blocks, minimum=0)
    check_positive_int("local_blocks", local_blocks, minimum=0)
    if init_blocks + local_blocks > topk:
        raise ValueError(f"init_blocks + local_blocks ({init_blocks} + {local_blocks}) must be "
                         f"<= topk ({topk})")
