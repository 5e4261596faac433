# SPDX-License-Identifier: Apache-2.0
"""RoPE frequencies of MSA's partial NeoX rotation: plain (`rope_theta`) or YaRN-scaled, with the
angles formed exactly (float64) or the way transformers and vLLM form them (fp32).

    inv_freq(config)            -> [rotary_dim / 2] inverse frequencies (float64, or fp32)
    attention_factor(config)    -> the factor YaRN puts on cos and sin (1.0 without scaling)
    cos_sin(positions, config)  -> fp32 (cos, sin) [T, rotary_dim / 2], the factor applied

YaRN follows transformers' `_compute_yarn_parameters` step for step (blended inverse frequencies
over the rotary dims, the linear ramp between the correction dims, `truncate`, the attention
factor from `factor`, `mscale`, `mscale_all_dim` or given). `rope_angles="fp32"` reproduces its
numbers bit for bit on the CPU: the frequencies computed in fp32 by the same torch operations and
the angle as one fp32 product `position * inv_freq`. `rope_angles="exact"` computes the same
formulas in float64, so the angle at position 1M is as exact as at position 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

__all__ = ["ROPE_ANGLES", "YarnScaling", "rope_scaling_from_hf", "inv_freq", "attention_factor",
           "cos_sin"]

ROPE_ANGLES = ("exact", "fp32")

# keys of a rope dict that are not scaling parameters (read elsewhere, or naming the type)
_COMMON_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_YARN_KEYS = {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "truncate"}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (transformers' `rope_type="yarn"` parameters).

    `attention_factor` None: derived as transformers derives it (from `factor`, or from
    `mscale` / `mscale_all_dim` when both are set); read the resolved value from `mscale_factor`.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        for name in ("factor", "beta_fast", "beta_slow"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"rope_scaling.{name} must be a positive number, got {v!r}")
        o = self.original_max_position_embeddings
        if isinstance(o, bool) or not isinstance(o, int) or o <= 0:
            raise ValueError(f"rope_scaling.original_max_position_embeddings must be a positive "
                             f"int, got {o!r}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"rope_scaling.attention_factor must be > 0, got "
                             f"{self.attention_factor!r}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"rope_scaling.truncate must be a bool, got {self.truncate!r}")

    @property
    def mscale_factor(self) -> float:
        """The factor on cos and sin, resolved as transformers resolves it."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(_yarn_mscale(self.factor, self.mscale)
                         / _yarn_mscale(self.factor, self.mscale_all_dim))
        return float(_yarn_mscale(self.factor))

    def correction_range(self, rotary_dim: int, theta: float) -> tuple[float, float]:
        """(low, high) rotary-pair indices between which the ramp blends the frequencies."""
        def dim_of(rotations):
            return (rotary_dim * math.log(self.original_max_position_embeddings
                                          / (rotations * 2 * math.pi))) / (2 * math.log(theta))
        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, rotary_dim - 1)


def rope_scaling_from_hf(params: Mapping[str, Any] | None,
                         max_position_embeddings: int | None = None) -> YarnScaling | None:
    """A Hugging Face rope dict (transformers' `rope_parameters` or a checkpoint's
    `rope_scaling`) -> None (plain RoPE) or YarnScaling. Any other rope type, and any key openmsa
    does not implement, is refused by name."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise TypeError(f"rope_scaling must be a dict, got {type(params).__name__}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        extra = sorted(set(params) - _COMMON_KEYS)
        if extra:
            raise ValueError(f"rope_scaling: keys {extra} are not implemented by openmsa for "
                             f"rope_type 'default'")
        return None
    if rope_type != "yarn":
        raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not implemented by openmsa "
                         f"(only 'default' and 'yarn')")
    extra = sorted(set(params) - _COMMON_KEYS - _YARN_KEYS)
    if extra:
        raise ValueError(f"rope_scaling: keys {extra} are not implemented by openmsa for "
                         f"rope_type 'yarn'")
    if params.get("original_max_position_embeddings") is None:
        raise ValueError("rope_scaling: yarn needs 'original_max_position_embeddings'")
    orig = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError("rope_scaling: yarn without 'factor' needs max_position_embeddings")
        factor = max_position_embeddings / orig
    kw = {k: params[k] for k in ("attention_factor", "mscale", "mscale_all_dim")
          if params.get(k) is not None}
    # transformers: `get("beta_fast") or 32`
    return YarnScaling(factor=factor, original_max_position_embeddings=orig,
                       beta_fast=params.get("beta_fast") or 32.0,
                       beta_slow=params.get("beta_slow") or 1.0,
                       truncate=params.get("truncate", True), **kw)


def _rope_fields(config) -> tuple[int, float, YarnScaling | None, str]:
    return (config.rotary_dim, float(config.rope_theta), getattr(config, "rope_scaling", None),
            getattr(config, "rope_angles", "exact"))


def _inv_freq(rotary_dim: int, theta: float, yarn: YarnScaling | None,
              dtype: torch.dtype) -> torch.Tensor:
    # the operations of transformers' default and yarn initialisers, in `dtype`
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=dtype) / rotary_dim)
    extrapolation = 1.0 / pos_freqs
    if yarn is None:
        return extrapolation
    interpolation = 1.0 / (yarn.factor * pos_freqs)
    low, high = yarn.correction_range(rotary_dim, theta)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=dtype) - low) / (high - low)).clamp(0, 1)
    extrapolation_share = 1 - ramp
    return interpolation * (1 - extrapolation_share) + extrapolation * extrapolation_share


def inv_freq(config, *, angles: str | None = None) -> torch.Tensor:
    """[rotary_dim / 2] inverse frequencies on the CPU: float64 for `angles="exact"`, fp32 (as
    transformers computes them) for "fp32"; `angles` None takes the config's `rope_angles`."""
    rot, theta, yarn, mode = _rope_fields(config)
    mode = mode if angles is None else angles
    if mode not in ROPE_ANGLES:
        raise ValueError(f"angles must be one of {ROPE_ANGLES}, got {mode!r}")
    return _inv_freq(rot, theta, yarn, torch.float32 if mode == "fp32" else torch.float64)


def attention_factor(config) -> float:
    """The factor on cos and sin: YaRN's attention factor, or 1.0."""
    yarn = getattr(config, "rope_scaling", None)
    return 1.0 if yarn is None else yarn.mscale_factor


def cos_sin(positions: torch.Tensor, config, *, angles: str | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [T, rotary_dim / 2] of positions int [T], times the attention factor."""
    rot, _, _, mode = _rope_fields(config)
    mode = mode if angles is None else angles
    f = inv_freq(config, angles=mode).to(positions.device)
    scale = attention_factor(config)
    if mode == "fp32":
        ang = positions.float()[:, None] * f[None, :]
        return ang.cos() * scale, ang.sin() * scale
    # float64: at position 1M the angle is ~1e6 rad, where one fp32 ulp is 0.06 rad
    ang = positions.to(torch.float64)[:, None] * f[None, :]
    return (ang.cos() * scale).float(), (ang.sin() * scale).float()
