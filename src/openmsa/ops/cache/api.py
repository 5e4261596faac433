# SPDX-License-Identifier: Apache-2.0
"""Public cache writes: validation, then the Triton kernels (CUDA, or CPU under
TRITON_INTERPRET=1) or the reference (CPU)."""

from __future__ import annotations

import torch

from ..._checks import FP8
from ..._dispatch import next_pow2 as _next_pow2
from ..._dispatch import scale_tensor, use_kernels
from . import reference
from .checks import check_index_write, check_kv_write

__all__ = ["write_index_cache", "write_kv_cache"]


def write_index_cache(index_k, index_cache, slot_mapping) -> None:
    """index_k [T, Di] -> index_cache [P, B, Di] (any strides) at slot = page * B + offset.

    An fp8 cache gets a saturating cast (+-448, no scale); a slot < 0 is skipped. Slots are not
    range-checked (a device value); they must lie in [0, P * B) or be negative.
    """
    if not use_kernels(index_k):
        return reference.write_index_cache(index_k, index_cache, slot_mapping)
    from .write import _write_index_cache_kernel

    check_index_write(index_k, index_cache, slot_mapping)
    num_tokens, dim = index_k.shape
    if num_tokens == 0:
        return None
    _write_index_cache_kernel[(num_tokens,)](
        index_k, index_cache, slot_mapping, *index_k.stride(), *index_cache.stride(),
        BLOCK=index_cache.shape[1], DI=dim, DIP=_next_pow2(dim),
        SATURATE=index_cache.dtype == FP8)
    return None


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
    """k, v [T, Hkv, D] -> k_cache, v_cache viewed [P, B, Hkv, D] with any strides.

    A slot < 0 is skipped. fp8 caches store x / scale saturated at +-448 (scale 1 when None).
    """
    if not use_kernels(k):
        return reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale,
                                        v_scale=v_scale)
    from ..attention.checks import check_scale_arg
    from .write import _write_kv_cache_kernel

    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    check_scale_arg("k_scale", k_scale, k.device)
    check_scale_arg("v_scale", v_scale, k.device)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return None
    has_scale = k_scale is not None or v_scale is not None
    ks = scale_tensor(1.0 if k_scale is None else k_scale, k.device)
    vs = scale_tensor(1.0 if v_scale is None else v_scale, k.device)
    _write_kv_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, ks, vs, *k.stride(), *v.stride(),
        *k_cache.stride(), *v_cache.stride(), BLOCK=k_cache.shape[1], HKV=num_kv_heads,
        HKVP=_next_pow2(num_kv_heads), D=head_dim, DP=_next_pow2(head_dim),
        SATURATE=k_cache.dtype == FP8, HAS_SCALE=has_scale)
    return None
