# SPDX-License-Identifier: Apache-2.0
"""Public cache writes and the fused preparation: check the arguments, get the launch plan
(plan.py, cached by call key) and run it; the Triton kernels run on CUDA, or on CPU under
TRITON_INTERPRET=1, and the reference runs on CPU otherwise."""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace
from typing import NamedTuple

import torch

from ... import nvfp4, rope
from ..._checks import check_scale_arg
from ..._dispatch import on_tensor_device, use_kernels
from ..common.launch import PlanCache, call_key, scale_args, scale_key
from ..common.plan import DeviceFacts, LaunchPlan, config_or_default
from . import reference
from .checks import check_index_write, check_kv_write, check_prepare
from .geometry import ROPE_FINE, ROPE_MAX_POSITION
from .plan import DEFAULT, CacheConfig, IndexWriteShape, KVWriteShape, PrepareShape, plan

__all__ = ["write_index_cache", "write_kv_cache", "fused_prepare", "rope_table", "CacheConfig"]

# launch plans by call key: a repeated step shape (every decode step of an engine) skips the
# checks and the plan
_PLANS = PlanCache("cache")


def _check_config(config, name: str = "config"):
    return config_or_default(config, DEFAULT, name)


# each launch name of plan.py's plans: its kernel's module (kernels/) and function; a name
# missing here raises
_KERNELS = {"write_index_cache": ("write", "_write_index_cache_kernel"),
            "write_kv_cache": ("write", "_write_kv_cache_kernel"),
            "fused_prepare": ("prepare", "_fused_prepare_kernel")}


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    """The Triton kernel of a launch (imported on first use: the reference path needs none)."""
    try:
        module, function = _KERNELS[name]
    except KeyError:
        raise ValueError(f"cache: no kernel {name!r} in this op") from None
    return getattr(importlib.import_module(f".kernels.{module}", __package__), function)


class _Prepared(NamedTuple):
    """fused_prepare's cached plan: its launches and the RoPE table they read."""

    launches: tuple
    table: torch.Tensor


def _num_slots(cache) -> int:
    """P * B: the slots a [P, B, ...] cache holds (an NVFP4 index cache, uint8 [P, 128, 72],
    too); the kernels write nothing for a slot outside [0, P * B)."""
    return cache.shape[0] * cache.shape[1]


@on_tensor_device
def write_index_cache(index_k, index_cache, slot_mapping, *, config: CacheConfig | None = None
                      ) -> None:
    """index_k [T, Di] -> index_cache [P, B, Di] (any strides) at slot = page * B + offset.

    An fp8 cache gets a saturating cast (+-448, no scale); an NVFP4 cache (uint8 [P, 128, 72],
    Di = 128) gets each key quantized exactly as `openmsa.nvfp4` does. A slot outside
    [0, P * B) (negative for padding, or past the cache) writes nothing (docs/spec.md, "Bounds").
    """
    if not use_kernels(index_k):
        _check_config(config)
        return reference.write_index_cache(index_k, index_cache, slot_mapping)
    key = call_key((index_k, index_cache, slot_mapping), (config,))

    def make() -> LaunchPlan:
        checked = _check_config(config)
        check_index_write(index_k, index_cache, slot_mapping)
        shape = IndexWriteShape(index_k.shape[0], index_k.shape[1], index_cache.shape[1],
                                index_cache.dtype)
        return plan(shape, DeviceFacts.of(index_k.device), checked)

    launches = _PLANS.get_or_plan(key, make)
    for launch in launches:
        launch.run(_kernel(launch.kernel), index_k, index_cache, slot_mapping,
                   _num_slots(index_cache), *index_k.stride(), *index_cache.stride())
    return None


@on_tensor_device
def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None,
                   config: CacheConfig | None = None) -> None:
    """k, v [T, Hkv, D] -> k_cache, v_cache viewed [P, B, Hkv, D] with any strides.

    A slot outside [0, P * B) (negative for padding, or past the cache) writes nothing. fp8
    caches store x / scale saturated at +-448 (scale 1 when None).
    """
    if not use_kernels(k):
        _check_config(config)
        return reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale,
                                        v_scale=v_scale)
    key = call_key((k, v, k_cache, v_cache, slot_mapping),
                   (config, scale_key(k_scale), scale_key(v_scale)))

    def make() -> LaunchPlan:
        checked = _check_config(config)
        check_kv_write(k, v, k_cache, v_cache, slot_mapping)
        check_scale_arg("k_scale", k_scale, k.device)
        check_scale_arg("v_scale", v_scale, k.device)
        num_tokens, num_kv_heads, head_dim = k.shape
        shape = KVWriteShape(num_tokens, num_kv_heads, head_dim, k_cache.shape[1],
                             k_cache.dtype, k_scale is not None or v_scale is not None)
        return plan(shape, DeviceFacts.of(k.device), checked)

    launches = _PLANS.get_or_plan(key, make)
    if not launches:
        return None
    _, ks, vs = scale_args(k_scale, v_scale, k.device, k)
    for launch in launches:
        launch.run(_kernel(launch.kernel), k, v, k_cache, v_cache, slot_mapping, ks, vs,
                   _num_slots(k_cache), *k.stride(), *v.stride(), *k_cache.stride(),
                   *v_cache.stride())
    return None


@functools.lru_cache(maxsize=16)
def rope_table(rotary_dim: int, theta: float, device: str, rope_scaling=None,
               rope_angles: str = "exact") -> torch.Tensor:
    """fp32 [ROPE_FINE + ROPE_MAX_POSITION / ROPE_FINE, rotary_dim]: row r < ROPE_FINE holds
    (cos | sin) of r * inv_freq, row ROPE_FINE + h of h * ROPE_FINE * inv_freq; built in float64
    once per device (prepare.py combines a fine and a coarse row).
    `rope_angles="fp32"`: one row, (the fp32 inverse frequencies | 0), for the kernel's fp32
    product. inv_freq and YaRN (`rope_scaling`) as `openmsa.rope` computes them."""
    spec = SimpleNamespace(rotary_dim=max(rotary_dim, 2), rope_theta=theta,
                           rope_scaling=rope_scaling, rope_angles=rope_angles)
    if rope_angles == "fp32":
        f = rope.inv_freq(spec)
        return torch.cat([f, torch.zeros_like(f)])[None, :].to(device)
    inv_freq = rope.inv_freq(spec)[: max(rotary_dim // 2, 1)]
    steps = torch.cat([torch.arange(ROPE_FINE, dtype=torch.float64),
                       torch.arange(ROPE_MAX_POSITION // ROPE_FINE, dtype=torch.float64)
                       * ROPE_FINE])
    ang = steps[:, None] * inv_freq[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).float().to(device)


@on_tensor_device
def fused_prepare(qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
                  index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
                  index_slot_mapping, *, k_scale=None, v_scale=None, q_out=None,
                  index_q_out=None, cache_config: CacheConfig | None = None):
    """One layer's preparation in one launch (README.md beside this has the math).

    Args:
        qkv: [T, (Hq + 2 Hkv) D + (H + 1) Di], the fused projection `[q | k | v | iq | ik]` of
            one rank (any strides). positions: int [T] (padding tokens may hold anything >= 0 or
            -1; positions >= 2^24 are not supported). config: the rank's MSAConfig.
        *_norm_weight: [D] or [Di] Gemma RMSNorm weights. k_cache, v_cache: [P, B, Hkv, D] any
            strides; index_cache [P, B, Di], or NVFP4 pages (uint8 [P, 128, 72]);
            slot_mapping, index_slot_mapping: int [T]; a slot outside its cache's [0, P * B)
            (negative for padding, or past the cache) writes nothing.
        k_scale, v_scale: optional per-tensor scales of an fp8 main cache (stores x / scale).
        q_out [T, Hq, D], index_q_out [T, H, Di]: optional outputs (any strides).
        cache_config: the launch knobs (`CacheConfig`; None: the defaults). Named apart from
            `config`, which is the layer's geometry.

    Returns:
        (q, index_q): q in qkv's dtype (or q_out's), index_q in the index cache's (fp8 e4m3 for
        an NVFP4 cache) or index_q_out's dtype.
    """
    if not use_kernels(qkv):
        _check_config(cache_config, "cache_config")
        return reference.fused_prepare(
            qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
            index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache, index_slot_mapping,
            k_scale=k_scale, v_scale=v_scale, q_out=q_out, index_q_out=index_q_out)
    key = call_key((qkv, positions, q_norm_weight, k_norm_weight, index_q_norm_weight,
                    index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
                    index_slot_mapping, qkv if q_out is None else q_out,
                    qkv if index_q_out is None else index_q_out),
                   (config, q_out is None, index_q_out is None, scale_key(k_scale),
                    scale_key(v_scale), cache_config))

    launches, table = _PLANS.get_or_plan(key, lambda: prepare_plan(
        qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
        index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache, index_slot_mapping,
        k_scale, v_scale, q_out, index_q_out, cache_config))
    q_out, index_q_out = prepare_outputs(qkv, config, index_cache, q_out, index_q_out)
    if not launches:
        return q_out, index_q_out
    _, ks, vs = scale_args(k_scale, v_scale, qkv.device, qkv)
    for launch in launches:
        launch.run(_kernel(launch.kernel), qkv, positions, q_norm_weight, k_norm_weight,
                   index_q_norm_weight, index_k_norm_weight, table, k_cache, v_cache,
                   slot_mapping, index_cache, index_slot_mapping, ks, vs, q_out, index_q_out,
                   float(config.rms_norm_eps), _num_slots(k_cache), _num_slots(index_cache),
                   *qkv.stride(), *k_cache.stride(),
                   *v_cache.stride(), *index_cache.stride(), *q_out.stride(),
                   *index_q_out.stride())
    return q_out, index_q_out


def prepare_plan(qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
                 index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
                 index_slot_mapping, k_scale, v_scale, q_out, index_q_out,
                 cache_config) -> _Prepared:
    """fused_prepare's argument checks (`q_out`, `index_q_out`: the caller's or None) and its
    plan, with the RoPE table its launch reads (prepare_and_select in ops/indexer plans the
    same preparation into its scoring launch)."""
    checked = _check_config(cache_config, "cache_config")
    check_prepare(qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
                  index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
                  index_slot_mapping, q_out, index_q_out)
    check_scale_arg("k_scale", k_scale, qkv.device)
    check_scale_arg("v_scale", v_scale, qkv.device)
    shape = PrepareShape(
        qkv.shape[0], config.num_heads, config.num_kv_heads, config.num_index_heads,
        config.head_dim, config.index_head_dim, config.rotary_dim, k_cache.shape[1],
        index_cache.shape[1], k_cache.dtype, index_cache.dtype,
        nvfp4.index_query_dtype(index_cache.dtype) if index_q_out is None
        else index_q_out.dtype,
        k_scale is not None or v_scale is not None, config.rope_angles == "fp32",
        rope.attention_factor(config))
    table = rope_table(config.rotary_dim, float(config.rope_theta), str(qkv.device),
                       config.rope_scaling, config.rope_angles)
    return _Prepared(plan(shape, DeviceFacts.of(qkv.device), checked).launches, table)


def prepare_outputs(qkv, config, index_cache, q_out, index_q_out):
    """fused_prepare's (q_out, index_q_out): the caller's, or new ones (q in qkv's dtype, the
    index query in the index cache's, fp8 e4m3 for NVFP4 pages)."""
    num_tokens = qkv.shape[0]
    if q_out is None:
        q_out = torch.empty(num_tokens, config.num_heads, config.head_dim, dtype=qkv.dtype,
                            device=qkv.device)
    if index_q_out is None:
        index_q_out = torch.empty(num_tokens, config.num_index_heads, config.index_head_dim,
                                  dtype=nvfp4.index_query_dtype(index_cache.dtype),
                                  device=qkv.device)
    return q_out, index_q_out
