# SPDX-License-Identifier: Apache-2.0
"""Argument checks of the cache writes (shapes, dtypes, devices; no device values)."""

from __future__ import annotations

import torch

from ... import nvfp4
from ..._checks import FP8_TYPES, HALF, check_tensor, check_unit_stride
from .geometry import projection_widths

CACHE_DTYPES = (*HALF, *FP8_TYPES, torch.float32)
# an index cache may also hold NVFP4 pages (uint8, openmsa.nvfp4)
INDEX_CACHE_DTYPES = (*CACHE_DTYPES, nvfp4.DTYPE)
SOURCE_DTYPES = (*HALF, torch.float32)
SLOT_DTYPES = (torch.int32, torch.int64)


def check_index_write(index_k, index_cache, slot_mapping) -> None:
    check_tensor("index_k", index_k, ndim=2, dtypes=SOURCE_DTYPES + FP8_TYPES)
    device = index_k.device
    check_tensor("index_cache", index_cache, ndim=3, dtypes=INDEX_CACHE_DTYPES, device=device)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=SLOT_DTYPES, device=device)
    check_unit_stride("slot_mapping", slot_mapping)
    if nvfp4.is_nvfp4_cache(index_cache):
        nvfp4.check_nvfp4_cache("index_cache", index_cache,
                                head_dim=("index_k", index_k.shape[1]))
    elif index_cache.shape[2] != index_k.shape[1]:
        raise ValueError(f"index_cache's last dim ({index_cache.shape[2]}) must equal index_k's "
                         f"({index_k.shape[1]})")
    if slot_mapping.shape[0] != index_k.shape[0]:
        raise ValueError(f"slot_mapping must have a slot per token ({index_k.shape[0]}), got "
                         f"{slot_mapping.shape[0]}")


def check_kv_write(k, v, k_cache, v_cache, slot_mapping) -> None:
    check_tensor("k", k, ndim=3, dtypes=SOURCE_DTYPES)
    device = k.device
    check_tensor("v", v, ndim=3, dtypes=SOURCE_DTYPES, device=device)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    check_tensor("k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES, device=device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=CACHE_DTYPES, device=device)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"k_cache must be [pages, block, {k.shape[1]}, {k.shape[2]}] to hold k "
                         f"{tuple(k.shape)}, got {tuple(k_cache.shape)}")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=SLOT_DTYPES, device=device)
    check_unit_stride("slot_mapping", slot_mapping)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must have a slot per token ({k.shape[0]}), got "
                         f"{slot_mapping.shape[0]}")


def check_prepare(qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
                  index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
                  index_slot_mapping, q_out, index_q_out) -> None:
    """fused_prepare's arguments against one rank's MSAConfig."""
    from ...config import MSAConfig
    from ..._checks import check_index_dtypes, check_out

    if not isinstance(config, MSAConfig):
        raise TypeError(f"config must be an openmsa.MSAConfig, got {type(config).__name__}")
    check_tensor("qkv", qkv, ndim=2, dtypes=SOURCE_DTYPES)
    device = qkv.device
    num_tokens = qkv.shape[0]
    hq, hkv, h = config.num_heads, config.num_kv_heads, config.num_index_heads
    d, di = config.head_dim, config.index_head_dim
    width = sum(projection_widths(config))
    if qkv.shape[1] != width:
        raise ValueError(f"qkv must be [T, {width}] = [q {hq}x{d} | k {hkv}x{d} | v {hkv}x{d} | "
                         f"index_q {h}x{di} | index_k {di}] for this config, got "
                         f"{tuple(qkv.shape)}")
    check_tensor("positions", positions, ndim=1, dtypes=SLOT_DTYPES, device=device)
    check_unit_stride("positions", positions)
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions must have one entry per token ({num_tokens}), got "
                         f"{positions.shape[0]}")
    for name, w, n in (("q_norm_weight", q_norm_weight, d), ("k_norm_weight", k_norm_weight, d),
                       ("index_q_norm_weight", index_q_norm_weight, di),
                       ("index_k_norm_weight", index_k_norm_weight, di)):
        check_tensor(name, w, ndim=1, dtypes=SOURCE_DTYPES, device=device)
        check_unit_stride(name, w)
        if w.shape[0] != n:
            raise ValueError(f"{name} must be [{n}], got {tuple(w.shape)}")
    check_tensor("k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES, device=device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=CACHE_DTYPES, device=device)
    if k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (hkv, d):
        raise ValueError(f"k_cache and v_cache must both be [pages, block, {hkv}, {d}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    check_tensor("index_cache", index_cache, ndim=3, dtypes=INDEX_CACHE_DTYPES, device=device)
    nvfp4_index = nvfp4.is_nvfp4_cache(index_cache)
    if nvfp4_index:
        nvfp4.check_nvfp4_cache("index_cache", index_cache, block_size=config.block_size,
                                head_dim=("config.index_head_dim", di))
    elif index_cache.shape[2] != di:
        raise ValueError(f"index_cache must be [pages, block, {di}], got "
                         f"{tuple(index_cache.shape)}")
    caches = (("k_cache", k_cache),) if nvfp4_index else (("k_cache", k_cache),
                                                           ("index_cache", index_cache))
    for name, c in caches:
        if c.shape[1] != config.block_size:
            raise ValueError(f"{name}'s pages must hold config.block_size = {config.block_size} "
                             f"tokens, got {c.shape[1]}")
    for name, s in (("slot_mapping", slot_mapping), ("index_slot_mapping", index_slot_mapping)):
        check_tensor(name, s, ndim=1, dtypes=SLOT_DTYPES, device=device)
        check_unit_stride(name, s)
        if s.shape[0] != num_tokens:
            raise ValueError(f"{name} must have a slot per token ({num_tokens}), got "
                             f"{s.shape[0]}")
    if q_out is not None:
        check_out("q_out", q_out, (num_tokens, hq, d), q_out.dtype if q_out.dtype in HALF
                  else torch.bfloat16, device)
    if index_q_out is not None:
        check_out("index_q_out", index_q_out, (num_tokens, h, di), index_q_out.dtype, device)
        check_index_dtypes(index_q_out, index_cache)
