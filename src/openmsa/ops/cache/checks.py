# SPDX-License-Identifier: Apache-2.0
"""Argument checks of the cache writes (shapes, dtypes, devices; no device values)."""

from __future__ import annotations

import torch

from ..._checks import FP8, HALF, check_tensor

CACHE_DTYPES = (*HALF, FP8, torch.float32)
SOURCE_DTYPES = (*HALF, torch.float32)
SLOT_DTYPES = (torch.int32, torch.int64)


def check_index_write(index_k, index_cache, slot_mapping) -> None:
    check_tensor("index_k", index_k, ndim=2, dtypes=SOURCE_DTYPES + (FP8,))
    device = index_k.device
    check_tensor("index_cache", index_cache, ndim=3, dtypes=CACHE_DTYPES, device=device)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=SLOT_DTYPES, device=device)
    if index_cache.shape[2] != index_k.shape[1]:
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
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must have a slot per token ({k.shape[0]}), got "
                         f"{slot_mapping.shape[0]}")
