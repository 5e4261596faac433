# SPDX-License-Identifier: Apache-2.0
"""The cache op's launch plans: write_index_cache, write_kv_cache and fused_prepare, each one
launch of one program per token (fused_prepare: per token and head tile).

`plan(shape, device, config)` is pure: the step shapes below hold everything it reads, and api.py
builds them from the tensors. The writes and the preparation are memory bound (each token's row
is read once and written once), so the plan has little to choose; the two knobs of the
preparation are in `CacheConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._checks import FP8_TYPES
from ...nvfp4 import DTYPE as NVFP4  # an index cache of this dtype holds NVFP4 pages
from ..common.plan import DeviceFacts, Launch, LaunchPlan, next_pow2
from .geometry import ROPE_FINE, ROPE_MAX_POSITION

__all__ = ["CacheConfig", "DEFAULT", "IndexWriteShape", "KVWriteShape", "PrepareShape", "plan"]


@dataclass(frozen=True)
class CacheConfig:
    """The cache op's launch knobs (benchmarks/tune.py varies them with dataclasses.replace)."""

    # query/KV/index heads per fused_prepare program, capped at the next power of two of the
    # widest head group: matters where a rank holds few heads (TP4/TP8 hold 1 KV/index head)
    prepare_head_tile: int = 16
    # warps per fused_prepare program; the program's tile is prepare_head_tile x head_dim
    prepare_warps: int = 4

    def __post_init__(self):
        for name in ("prepare_head_tile", "prepare_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v & (v - 1):
                raise ValueError(f"CacheConfig.{name} must be a positive power of two, got {v!r}")


DEFAULT = CacheConfig()


@dataclass(frozen=True)
class IndexWriteShape:
    """write_index_cache: T rows of `dim` into pages of `block_size` rows of `cache_dtype`
    (uint8: NVFP4 pages, 72 bytes a row)."""

    num_tokens: int
    dim: int
    block_size: int
    cache_dtype: torch.dtype


@dataclass(frozen=True)
class KVWriteShape:
    """write_kv_cache: T tokens of [num_kv_heads, head_dim] into K and V pages of `block_size`
    tokens of `cache_dtype`; `has_scale`: a k_scale or v_scale was given."""

    num_tokens: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    cache_dtype: torch.dtype
    has_scale: bool


@dataclass(frozen=True)
class PrepareShape:
    """fused_prepare: one rank's head counts and dims (MSAConfig after sharding), the two caches'
    page sizes and dtypes, the index query's output dtype, whether a KV scale was given, whether
    RoPE angles are formed in fp32 (`rope_angles="fp32"`) and YaRN's attention factor on cos/sin
    (1.0 without YaRN)."""

    num_tokens: int
    num_heads: int
    num_kv_heads: int
    num_index_heads: int
    head_dim: int
    index_head_dim: int
    rotary_dim: int
    block_size: int
    index_block_size: int
    kv_cache_dtype: torch.dtype
    index_cache_dtype: torch.dtype
    index_q_dtype: torch.dtype
    has_scale: bool
    fp32_angles: bool = False
    rope_scale: float = 1.0


def _prepare_tiles(shape: PrepareShape, config: CacheConfig) -> tuple[int, int]:
    """(heads per tile, tiles per token): the query, KV and index-query heads in tiles of
    `ht`, then one tile for the single index key."""
    hq, hkv, h = shape.num_heads, shape.num_kv_heads, shape.num_index_heads
    ht = min(config.prepare_head_tile, next_pow2(max(hq, hkv, h)))
    return ht, -(-hq // ht) + -(-hkv // ht) + -(-h // ht) + 1


def plan(shape, device: DeviceFacts, config: CacheConfig = DEFAULT) -> LaunchPlan:
    """The launches of one cache op call (none for an empty step). The kernels are the same on
    every device: `device` is taken for the shape every op's plan has."""
    del device
    if not isinstance(shape, (IndexWriteShape, KVWriteShape, PrepareShape)):
        raise TypeError(f"no cache plan for {type(shape).__name__}")
    if shape.num_tokens == 0:
        return LaunchPlan()
    if isinstance(shape, IndexWriteShape):
        return LaunchPlan([Launch("write_index_cache", (shape.num_tokens,), dict(
            BLOCK=shape.block_size, DI=shape.dim, DIP=next_pow2(shape.dim),
            SATURATE=shape.cache_dtype in FP8_TYPES, NVFP4=shape.cache_dtype == NVFP4))])
    if isinstance(shape, KVWriteShape):
        return LaunchPlan([Launch("write_kv_cache", (shape.num_tokens,), dict(
            BLOCK=shape.block_size, HKV=shape.num_kv_heads, HKVP=next_pow2(shape.num_kv_heads),
            D=shape.head_dim, DP=next_pow2(shape.head_dim),
            SATURATE=shape.cache_dtype in FP8_TYPES, HAS_SCALE=shape.has_scale))])
    ht, tiles = _prepare_tiles(shape, config)
    d, di = shape.head_dim, shape.index_head_dim
    return LaunchPlan([Launch("fused_prepare", (shape.num_tokens, tiles), dict(
        HAS_SCALE=shape.has_scale, HQ=shape.num_heads, HKV=shape.num_kv_heads,
        H=shape.num_index_heads, D=d, DI=di, DP=next_pow2(d), DIP=next_pow2(di),
        ROT=shape.rotary_dim, NCOARSE=ROPE_MAX_POSITION // ROPE_FINE,
        FP32_ANGLES=shape.fp32_angles, ROPE_SCALE=float(shape.rope_scale),
        BLOCK=shape.block_size, IBLOCK=shape.index_block_size, HT=ht,
        KV_SATURATE=shape.kv_cache_dtype in FP8_TYPES,
        INDEX_SATURATE=shape.index_cache_dtype in FP8_TYPES,
        INDEX_NVFP4=shape.index_cache_dtype == NVFP4,
        IQ_SATURATE=shape.index_q_dtype in FP8_TYPES, num_warps=config.prepare_warps))])
