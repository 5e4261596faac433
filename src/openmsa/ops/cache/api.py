# SPDX-License-Identifier: Apache-2.0
"""Public cache writes: validation, then the Triton kernels (CUDA, or CPU under
TRITON_INTERPRET=1) or the reference (CPU)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from ... import rope
from ..._checks import FP8, check_scale_arg
from ..._dispatch import next_pow2 as _next_pow2
from ..._dispatch import on_tensor_device, scale_args, use_kernels
from ..common.launch import (PlanCache, call_key, launch, launch_planned, plan_serials,
                             scale_key)
from . import reference
from .checks import check_index_write, check_kv_write

__all__ = ["write_index_cache", "write_kv_cache", "fused_prepare", "rope_table"]


@on_tensor_device
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
    launch(_write_index_cache_kernel, (num_tokens,),
           index_k, index_cache, slot_mapping, *index_k.stride(), *index_cache.stride(),
           BLOCK=index_cache.shape[1], DI=dim, DIP=_next_pow2(dim),
           SATURATE=index_cache.dtype == FP8)
    return None


@on_tensor_device
def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
    """k, v [T, Hkv, D] -> k_cache, v_cache viewed [P, B, Hkv, D] with any strides.

    A slot < 0 is skipped. fp8 caches store x / scale saturated at +-448 (scale 1 when None).
    """
    if not use_kernels(k):
        return reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale,
                                        v_scale=v_scale)
    from .write import _write_kv_cache_kernel

    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    check_scale_arg("k_scale", k_scale, k.device)
    check_scale_arg("v_scale", v_scale, k.device)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return None
    has_scale, ks, vs = scale_args(k_scale, v_scale, k.device, k)
    launch(_write_kv_cache_kernel, (num_tokens,),
           k, v, k_cache, v_cache, slot_mapping, ks, vs, *k.stride(), *v.stride(),
           *k_cache.stride(), *v_cache.stride(), BLOCK=k_cache.shape[1], HKV=num_kv_heads,
           HKVP=_next_pow2(num_kv_heads), D=head_dim, DP=_next_pow2(head_dim),
           SATURATE=k_cache.dtype == FP8, HAS_SCALE=has_scale)
    return None


# the coarse RoPE table covers positions below ROPE_MAX_POSITION (16M tokens, 4 MiB at 64 dims)
ROPE_MAX_POSITION = 1 << 24
PREPARE_HEAD_TILE = 16


@functools.lru_cache(maxsize=16)
def rope_table(rotary_dim: int, theta: float, device: str, rope_scaling=None,
               rope_angles: str = "exact") -> torch.Tensor:
    """fp32 [1024 + ROPE_MAX_POSITION / 1024, rotary_dim]: row r < 1024 holds (cos | sin) of
    r * inv_freq, row 1024 + h of h * 1024 * inv_freq; built in float64 once per device.
    `rope_angles="fp32"`: one row, (the fp32 inverse frequencies | 0), for the kernel's fp32
    product. inv_freq and YaRN (`rope_scaling`) as `openmsa.rope` computes them."""
    spec = SimpleNamespace(rotary_dim=max(rotary_dim, 2), rope_theta=theta,
                           rope_scaling=rope_scaling, rope_angles=rope_angles)
    if rope_angles == "fp32":
        f = rope.inv_freq(spec)
        return torch.cat([f, torch.zeros_like(f)])[None, :].to(device)
    inv_freq = rope.inv_freq(spec)[: max(rotary_dim // 2, 1)]
    steps = torch.cat([torch.arange(1024, dtype=torch.float64),
                       torch.arange(ROPE_MAX_POSITION // 1024, dtype=torch.float64) * 1024])
    ang = steps[:, None] * inv_freq[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).float().to(device)


@on_tensor_device
def fused_prepare(qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
                  index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
                  index_slot_mapping, *, k_scale=None, v_scale=None, q_out=None,
                  index_q_out=None):
    """One layer's preparation in one launch (README.md beside this has the math).

    Args:
        qkv: [T, (Hq + 2 Hkv) D + (H + 1) Di], the fused projection `[q | k | v | iq | ik]` of
            one rank (any strides). positions: int [T] (padding tokens may hold anything >= 0 or
            -1; positions >= 2^24 are not supported). config: the rank's MSAConfig.
        *_norm_weight: [D] or [Di] Gemma RMSNorm weights. k_cache, v_cache: [P, B, Hkv, D] any
            strides; index_cache [P, B, Di]; slot_mapping, index_slot_mapping: int [T], < 0 skips.
        k_scale, v_scale: optional per-tensor scales of an fp8 main cache (stores x / scale).
        q_out [T, Hq, D], index_q_out [T, H, Di]: optional outputs (any strides).

    Returns:
        (q, index_q): q in qkv's dtype (or q_out's), index_q in the index cache's (or
        index_q_out's) dtype.
    """
    if not use_kernels(qkv):
        return reference.fused_prepare(
            qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
            index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache, index_slot_mapping,
            k_scale=k_scale, v_scale=v_scale, q_out=q_out, index_q_out=index_q_out)
    from .checks import check_prepare
    from .prepare import _fused_prepare_kernel

    key = call_key((qkv, positions, q_norm_weight, k_norm_weight, index_q_norm_weight,
                    index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
                    index_slot_mapping, qkv if q_out is None else q_out,
                    qkv if index_q_out is None else index_q_out),
                   (config, q_out is None, index_q_out is None, scale_key(k_scale),
                    scale_key(v_scale)))
    plan = _PREPARE_PLANS.get(key)
    if plan is None:
        check_prepare(qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
                      index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
                      index_slot_mapping, q_out, index_q_out)
        check_scale_arg("k_scale", k_scale, qkv.device)
        check_scale_arg("v_scale", v_scale, qkv.device)
        plan = _prepare_plan(qkv, config, k_cache, index_cache, index_q_out)
        _PREPARE_PLANS.put(key, plan)
    num_tokens = qkv.shape[0]
    hq, hkv, h = config.num_heads, config.num_kv_heads, config.num_index_heads
    d, di = config.head_dim, config.index_head_dim
    if q_out is None:
        q_out = torch.empty(num_tokens, hq, d, dtype=qkv.dtype, device=qkv.device)
    if index_q_out is None:
        index_q_out = torch.empty(num_tokens, h, di, dtype=index_cache.dtype, device=qkv.device)
    if num_tokens == 0:
        return q_out, index_q_out
    serial, table, tiles, kwargs = plan
    has_scale, ks, vs = scale_args(k_scale, v_scale, qkv.device, qkv)
    launch_planned(
        _fused_prepare_kernel, serial, (num_tokens, tiles),
        qkv, positions, q_norm_weight, k_norm_weight, index_q_norm_weight, index_k_norm_weight,
        table, k_cache, v_cache, slot_mapping, index_cache, index_slot_mapping, ks, vs, q_out,
        index_q_out, float(config.rms_norm_eps), *qkv.stride(), *k_cache.stride(),
        *v_cache.stride(), *index_cache.stride(), *q_out.stride(), *index_q_out.stride(),
        HAS_SCALE=has_scale, **kwargs)
    return q_out, index_q_out


# launch plans by call key (as the attention and indexer ops: a repeated step shape skips the
# checks and the launch choices)
_PREPARE_PLANS = PlanCache()


def _prepare_plan(qkv, config, k_cache, index_cache, index_q_out) -> tuple:
    """(serial number, RoPE table, head tiles per token, the launch's keyword arguments but
    HAS_SCALE)."""
    hq, hkv, h = config.num_heads, config.num_kv_heads, config.num_index_heads
    d, di = config.head_dim, config.index_head_dim
    scaling, angles = getattr(config, "rope_scaling", None), getattr(config, "rope_angles", "exact")
    table = rope_table(config.rotary_dim, float(config.rope_theta), str(qkv.device), scaling,
                       angles)
    ht = min(PREPARE_HEAD_TILE, _next_pow2(max(hq, hkv, h)))
    tiles = -(-hq // ht) + -(-hkv // ht) + -(-h // ht) + 1
    iq_dtype = index_cache.dtype if index_q_out is None else index_q_out.dtype
    kwargs = dict(HQ=hq, HKV=hkv, H=h, D=d, DI=di, DP=_next_pow2(d), DIP=_next_pow2(di),
                  ROT=config.rotary_dim, NCOARSE=ROPE_MAX_POSITION // 1024,
                  FP32_ANGLES=angles == "fp32",
                  ROPE_SCALE=1.0 if scaling is None else float(scaling.mscale_factor),
                  BLOCK=k_cache.shape[1], IBLOCK=index_cache.shape[1], HT=ht,
                  KV_SATURATE=k_cache.dtype == FP8, INDEX_SATURATE=index_cache.dtype == FP8,
                  IQ_SATURATE=iq_dtype == FP8, num_warps=4)
    # (the serial number keys its launch, launch_planned in ops/common/launch.py)
    return next(plan_serials), table, tiles, kwargs
