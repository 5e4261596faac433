# SPDX-License-Identifier: Apache-2.0
"""Cache writes and the per-layer preparation (Gemma RMSNorm, partial NeoX RoPE, cast) in pure
PyTorch with fp32 math: the spec in code (see README.md beside this)."""

from __future__ import annotations

from types import SimpleNamespace

from typing import TYPE_CHECKING

import torch

from ... import nvfp4, rope
from ..._checks import FP8_TYPES, check_scale_arg, fp8_max
from .checks import check_index_write, check_kv_write
from .geometry import projection_widths

if TYPE_CHECKING:
    from .plan import CacheConfig

__all__ = ["write_index_cache", "write_kv_cache", "to_cache_dtype", "rms_norm", "apply_rope",
           "rotate", "prepare_index_qk", "prepare_qkv", "split_projection", "fused_prepare"]

FP8_MAX = 448.0


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast for a cache: fp8 e4m3 saturates at +-448 (no scale), e4m3fnuz (AMD gfx942) at
    +-240 (-0.0 becomes 0, its one zero); NaN stays NaN."""
    if dtype in FP8_TYPES:
        bound = fp8_max(dtype)
        return x.float().clamp(-bound, bound).to(dtype)
    return x.to(dtype)


def _scatter_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    block = cache.shape[1]
    slots = slot_mapping.long()
    # a slot outside [0, P * B) (negative for padding, or past the cache) writes nothing
    keep = (slots >= 0) & (slots < cache.shape[0] * block)
    slots, rows = slots[keep], rows[keep]
    # index through (page, offset) so any strided cache view is written in place
    cache[torch.div(slots, block, rounding_mode="floor"), slots % block] = rows


def write_index_cache(index_k, index_cache, slot_mapping, *, config: CacheConfig | None = None
                      ) -> None:
    """index_k [T, Di] -> index_cache [P, B, Di] at slot = page * B + offset; a slot outside
    [0, P * B) writes nothing.
    An NVFP4 cache (uint8 [P, 128, 72]) gets each key quantized by `openmsa.nvfp4`: its codes
    and scales land in their halves of the page (docs/spec.md, NVFP4 index pages).
    (config: the kernels' launch config, accepted for the public signature and unused.)"""
    check_index_write(index_k, index_cache, slot_mapping)
    if nvfp4.is_nvfp4_cache(index_cache):
        codes, scales = nvfp4.quantize_index_keys(index_k)
        code_pages, scale_pages = nvfp4.page_parts(index_cache)
        _scatter_rows(code_pages, codes, slot_mapping)
        _scatter_rows(scale_pages, scales, slot_mapping)
        return
    _scatter_rows(index_cache, to_cache_dtype(index_k, index_cache.dtype), slot_mapping)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None,
                   config: CacheConfig | None = None) -> None:
    """k, v [T, Hkv, D] -> caches viewed [P, B, Hkv, D] (any strides); a slot outside
    [0, P * B) writes nothing (config: the kernels' launch config, unused here).

    For fp8 caches with a per-tensor scale the stored value is x / scale, saturated.
    """
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    check_scale_arg("k_scale", k_scale, k.device)
    check_scale_arg("v_scale", v_scale, k.device)
    for x, cache, s in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = x.float() if s is None else x.float() / (s if not isinstance(s, torch.Tensor)
                                                      else s.float().reshape(()))
        _scatter_rows(cache, to_cache_dtype(x, cache.dtype), slot_mapping)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * (1 + w), fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float, *,
               rope_scaling=None, rope_angles: str = "exact") -> torch.Tensor:
    """NeoX-style RoPE on the first `rotary_dim` dims of x [T, heads, dim], fp32.

    Halves (x1, x2) of the rotary part turn by angle pos * inv_freq[i], inv_freq[i] =
    theta^(-2i/rotary_dim) or its YaRN blend (`rope_scaling`, a YarnScaling), and cos / sin carry
    YaRN's attention factor. `rope_angles`: "exact" (float64 angles) or "fp32" (transformers').
    """
    x = x.float()
    if rotary_dim == 0:
        return x
    spec = SimpleNamespace(rotary_dim=rotary_dim, rope_theta=theta, rope_scaling=rope_scaling,
                           rope_angles=rope_angles)
    cos, sin = rope.cos_sin(positions, spec)
    return rotate(x, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotation of x [T, heads, dim] (fp32) by given cos, sin [T, rotary_dim / 2]:
    the first rotary_dim dims turn, the rest pass (an engine's own cos/sin table plugs in here)."""
    x = x.float()
    half = cos.shape[-1]
    cos, sin = cos.float()[:, None, :], sin.float()[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def prepare_index_qk(index_q, index_k, q_norm_weight, k_norm_weight, positions, *, rotary_dim,
                     rope_theta, eps, cache_dtype, rope_scaling=None, rope_angles="exact"):
    """Index branch: per-head RMSNorm (own weights), partial RoPE, cast to the index cache dtype.

    Args:
        index_q: [T, H, Di]; index_k: [T, Di] (one head); weights [Di]; positions int [T].

    Returns:
        (index_q [T, H, Di], index_k [T, Di]) in cache_dtype (fp8 saturating).
    """
    kw = dict(rope_scaling=rope_scaling, rope_angles=rope_angles)
    q = apply_rope(rms_norm(index_q, q_norm_weight, eps), positions, rotary_dim, rope_theta, **kw)
    k = apply_rope(rms_norm(index_k[:, None, :], k_norm_weight, eps), positions, rotary_dim,
                   rope_theta, **kw)[:, 0]
    return to_cache_dtype(q, cache_dtype), to_cache_dtype(k, cache_dtype)


def prepare_qkv(q, k, v, q_norm_weight, k_norm_weight, positions, *, rotary_dim, rope_theta, eps,
                dtype, rope_scaling=None, rope_angles="exact"):
    """Main branch: per-head RMSNorm of q and k, partial RoPE, v untouched; all cast to dtype.

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D]; weights [D]; positions int [T].
    """
    kw = dict(rope_scaling=rope_scaling, rope_angles=rope_angles)
    qq = apply_rope(rms_norm(q, q_norm_weight, eps), positions, rotary_dim, rope_theta, **kw)
    kk = apply_rope(rms_norm(k, k_norm_weight, eps), positions, rotary_dim, rope_theta, **kw)
    return qq.to(dtype), kk.to(dtype), v.to(dtype)


def split_projection(qkv: torch.Tensor, config) -> tuple[torch.Tensor, ...]:
    """Views of a fused projection row `[q | k | v | index_q | index_k]` for one rank's config:
    q [T, Hq, D], k and v [T, Hkv, D], index_q [T, H, Di], index_k [T, Di]."""
    t = qkv.shape[0]
    d, di = config.head_dim, config.index_head_dim
    q, k, v, iq, ik = torch.split(qkv, list(projection_widths(config)), dim=-1)
    return (q.reshape(t, config.num_heads, d), k.reshape(t, config.num_kv_heads, d),
            v.reshape(t, config.num_kv_heads, d), iq.reshape(t, config.num_index_heads, di), ik)


def fused_prepare(qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
                  index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
                  index_slot_mapping, *, k_scale=None, v_scale=None, q_out=None,
                  index_q_out=None, cache_config: CacheConfig | None = None):
    """One layer's preparation (see README.md beside this): split the fused projection, Gemma
    RMSNorm per head (own weights for q, k, index_q, index_k), partial NeoX RoPE at `positions`,
    k and v into the main cache through `slot_mapping`, index_k (cast to the index cache dtype)
    into the index cache through `index_slot_mapping`; a slot outside its cache's [0, P * B)
    writes nothing.

    Returns (q [T, Hq, D] in qkv's dtype, index_q [T, H, Di] in the index cache's dtype, fp8
    e4m3 for an NVFP4 cache), or written into q_out / index_q_out (whose dtypes then rule).
    """
    from .checks import check_prepare

    check_prepare(qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
                  index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
                  index_slot_mapping, q_out, index_q_out)
    check_scale_arg("k_scale", k_scale, qkv.device)
    check_scale_arg("v_scale", v_scale, qkv.device)
    q, k, v, iq, ik = split_projection(qkv, config)
    pos = positions.long().clamp(min=0)
    rkw = dict(rope_scaling=getattr(config, "rope_scaling", None),
               rope_angles=getattr(config, "rope_angles", "exact"))
    kw = dict(rotary_dim=config.rotary_dim, rope_theta=config.rope_theta, eps=config.rms_norm_eps,
              **rkw)
    qq = apply_rope(rms_norm(q, q_norm_weight, config.rms_norm_eps), pos, config.rotary_dim,
                    config.rope_theta, **rkw)
    kk = apply_rope(rms_norm(k, k_norm_weight, config.rms_norm_eps), pos, config.rotary_dim,
                    config.rope_theta, **rkw)
    iqq, ikk = prepare_index_qk(iq, ik, index_q_norm_weight, index_k_norm_weight, pos,
                                cache_dtype=torch.float32, **kw)
    write_kv_cache(kk, v.float(), k_cache, v_cache, slot_mapping, k_scale=k_scale,
                   v_scale=v_scale)
    write_index_cache(ikk, index_cache, index_slot_mapping)
    q_dtype = q_out.dtype if q_out is not None else qkv.dtype
    iq_dtype = index_q_out.dtype if index_q_out is not None else \
        nvfp4.index_query_dtype(index_cache.dtype)
    qq, iqq = to_cache_dtype(qq, q_dtype), to_cache_dtype(iqq, iq_dtype)
    if q_out is not None:
        q_out.copy_(qq)
        qq = q_out
    if index_q_out is not None:
        index_q_out.copy_(iqq)
        iqq = index_q_out
    return qq, iqq
