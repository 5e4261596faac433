# SPDX-License-Identifier: Apache-2.0
"""MSAConfig: the geometry and selection rule of one MSA layer (MiniMax-M3's defaults)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ._checks import MAX_TOPK
from .rope import ROPE_ANGLES, YarnScaling, rope_scaling_from_hf

__all__ = ["MSAConfig"]

# Hugging Face `text_config.sparse_attention_config` key -> MSAConfig field.
_HF_SPARSE_KEYS = {
    "sparse_num_index_heads": "num_index_heads",
    "sparse_index_dim": "index_head_dim",
    "sparse_block_size": "block_size",
    "sparse_topk_blocks": "topk_blocks",
    "sparse_init_block": "init_blocks",
    "sparse_local_block": "local_blocks",
    "sparse_score_type": "score_type",
}
# transformers' flat text-config keys -> MSAConfig field (its config has no init blocks).
_HF_FLAT_KEYS = {
    "index_n_heads": "num_index_heads",
    "index_head_dim": "index_head_dim",
    "index_block_size": "block_size",
    "index_topk_blocks": "topk_blocks",
    "index_local_blocks": "local_blocks",
}
# transformers' `layer_types` entry of a sparse layer
_HF_SPARSE_TYPE = "minimax_m3_sparse"
# Top-level model keys -> MSAConfig field.
_HF_MODEL_KEYS = {
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "rotary_dim": "rotary_dim",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
}


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


@dataclass(frozen=True)
class MSAConfig:
    """One sparse layer's configuration; defaults are MiniMax-M3's (docs/spec.md, Symbols and
    M3's values).

    Head counts are per rank: a tensor-parallel rank holds `num_heads / tp` query heads, and
    `num_kv_heads` and `num_index_heads` shrink with it (index head h serves KV head h).
    """

    num_heads: int = 64
    num_kv_heads: int = 4
    head_dim: int = 128
    num_index_heads: int = 4
    index_head_dim: int = 128
    block_size: int = 128
    topk_blocks: int = 16
    init_blocks: int = 0
    local_blocks: int = 1
    score_type: str = "max"
    rotary_dim: int = 64
    rope_theta: float = 5e6
    rms_norm_eps: float = 1e-6
    # which layers are sparse (None: every layer); filled from `sparse_attention_freq`
    sparse_layers: tuple[int, ...] | None = None
    # RoPE scaling (None: plain RoPE at rope_theta); a dict is read as Hugging Face's rope dict
    rope_scaling: YarnScaling | None = None
    # "exact": angles in float64 (the default); "fp32": `position * inv_freq` in fp32, as
    # transformers and vLLM form them (see rope.py and docs/design.md)
    rope_angles: str = "exact"

    def __post_init__(self) -> None:
        for f in ("num_heads", "num_kv_heads", "head_dim", "num_index_heads", "index_head_dim",
                  "block_size", "topk_blocks"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"MSAConfig.{f} must be a positive int, got {v!r}")
        for f in ("init_blocks", "local_blocks", "rotary_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"MSAConfig.{f} must be a non-negative int, got {v!r}")
        if self.topk_blocks > MAX_TOPK:
            raise ValueError(f"MSAConfig.topk_blocks must be <= {MAX_TOPK} (the kernels' bound, "
                             f"on every device), got {self.topk_blocks}")
        if self.score_type != "max":
            raise ValueError(f"MSAConfig.score_type must be 'max' (the only score MSA defines), "
                             f"got {self.score_type!r}")
        if self.init_blocks + self.local_blocks > self.topk_blocks:
            raise ValueError(f"MSAConfig: init_blocks + local_blocks ({self.init_blocks} + "
                             f"{self.local_blocks}) must be <= topk_blocks ({self.topk_blocks})")
        if not _is_pow2(self.block_size):
            raise ValueError(f"MSAConfig.block_size must be a power of two, got {self.block_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"MSAConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if (self.num_kv_heads % self.num_index_heads
                and self.num_index_heads % self.num_kv_heads):
            raise ValueError(f"MSAConfig.num_index_heads ({self.num_index_heads}) and num_kv_heads "
                             f"({self.num_kv_heads}) must divide one another")
        if self.rotary_dim > min(self.head_dim, self.index_head_dim) or self.rotary_dim % 2:
            raise ValueError(f"MSAConfig.rotary_dim must be even and <= head_dim and "
                             f"index_head_dim, got {self.rotary_dim}")
        # (a non-finite theta gives NaN angles, a non-finite eps zero or NaN norms, silently)
        for f, low in (("rope_theta", "> 0"), ("rms_norm_eps", ">= 0")):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or not (v > 0 if low == "> 0" else v >= 0):
                raise ValueError(f"MSAConfig.{f} must be a finite number {low}, got {v!r}")
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", rope_scaling_from_hf(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise TypeError(f"MSAConfig.rope_scaling must be None, a YarnScaling or a rope dict, "
                            f"got {type(self.rope_scaling).__name__}")
        if self.rope_angles not in ROPE_ANGLES:
            raise ValueError(f"MSAConfig.rope_angles must be one of {ROPE_ANGLES}, got "
                             f"{self.rope_angles!r}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def is_sparse_layer(self, layer: int) -> bool:
        return self.sparse_layers is None or layer in self.sparse_layers

    def shard(self, tp_size: int) -> "MSAConfig":
        """The configuration one of `tp_size` tensor-parallel ranks holds."""
        if tp_size <= 0 or self.num_heads % tp_size or self.num_kv_heads % tp_size \
                or self.num_index_heads % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide num_heads ({self.num_heads}), "
                             f"num_kv_heads ({self.num_kv_heads}) and num_index_heads "
                             f"({self.num_index_heads})")
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        kw.update(num_heads=self.num_heads // tp_size, num_kv_heads=self.num_kv_heads // tp_size,
                  num_index_heads=self.num_index_heads // tp_size)
        return MSAConfig(**kw)

    @classmethod
    def from_hf_config(cls, config: Any) -> "MSAConfig":
        """Build from a Hugging Face config: a dict or a config object, top level or with the
        model keys under `text_config`, in either layout:

        * the checkpoint's `config.json`: `sparse_attention_config` (docs/spec.md, "Symbols
          and M3's values"; `sparse_attention_freq`: a list with one entry per layer, 1 =
          sparse, or the int 1 for every layer; any other int is rejected rather than
          guessed), `rope_theta`,
          `rotary_dim` (or `partial_rotary_factor`), `rope_scaling`;
        * transformers' `MiniMaxM3VLConfig` / `MiniMaxM3VLTextConfig` and their `to_dict()`:
          flat `index_*` keys, `layer_types` ("minimax_m3_sparse" = sparse) and
          `rope_parameters`. The rotary width is the one transformers rotates,
          `head_dim * rope_parameters["partial_rotary_factor"]` (1.0 when absent); a
          `rotary_dim` that disagrees is warned about and not used.

        RoPE scaling (`rope_parameters` / `rope_scaling`): plain or YaRN; any other type or
        parameter is refused by name. Missing keys keep M3's defaults.
        """
        text = _get(config, "text_config", None)
        if text is None:
            text = config
        sparse = _get(text, "sparse_attention_config", None)
        if sparse is None:
            sparse = _get(config, "sparse_attention_config", None)
        flat = {hf: _get(text, hf, None) for hf in _HF_FLAT_KEYS}
        layer_types = _get(text, "layer_types", None)
        if sparse is None and all(v is None for v in flat.values()) and layer_types is None:
            raise ValueError("from_hf_config: found neither the checkpoint's "
                             "'sparse_attention_config' nor transformers' flat index_* keys / "
                             "'layer_types', at the top level or under 'text_config'")
        kw: dict[str, Any] = {}
        for hf, name in _HF_MODEL_KEYS.items():
            v = _get(text, hf, None)
            if v is not None:
                kw[name] = v
        if "head_dim" not in kw:
            hidden, heads = _get(text, "hidden_size", None), _get(text, "num_attention_heads", None)
            if hidden is not None and heads:
                kw["head_dim"] = hidden // heads
        rope_params = _get(text, "rope_parameters", None)
        if rope_params is not None and not isinstance(rope_params, Mapping):
            raise TypeError(f"from_hf_config: rope_parameters must be a dict, got "
                            f"{type(rope_params).__name__}")
        if "rope_theta" not in kw and rope_params is not None \
                and rope_params.get("rope_theta") is not None:
            kw["rope_theta"] = rope_params["rope_theta"]
        for hf, name in _HF_FLAT_KEYS.items():
            if flat[hf] is not None:
                kw[name] = flat[hf]
        if sparse is not None:
            for hf, name in _HF_SPARSE_KEYS.items():
                v = _get(sparse, hf, None)
                if v is not None:
                    kw[name] = v
            freq = _get(sparse, "sparse_attention_freq", None)
        else:
            freq = None
        if freq is not None:
            if isinstance(freq, (list, tuple)):
                kw["sparse_layers"] = tuple(i for i, f in enumerate(freq) if int(f) == 1)
            elif isinstance(freq, int) and freq == 1:
                kw["sparse_layers"] = None
            else:
                raise ValueError(f"from_hf_config: sparse_attention_freq must be a per-layer list "
                                 f"of 0/1 or the int 1, got {freq!r}")
        elif layer_types is not None:
            unknown = sorted({t for t in layer_types} - {_HF_SPARSE_TYPE, "full_attention"})
            if unknown:
                raise ValueError(f"from_hf_config: layer_types {unknown} are not known to openmsa "
                                 f"(only {_HF_SPARSE_TYPE!r} and 'full_attention')")
            kw["sparse_layers"] = tuple(i for i, t in enumerate(layer_types)
                                        if t == _HF_SPARSE_TYPE)
        head_dim = kw.get("head_dim", cls.head_dim)
        if rope_params is not None:
            # transformers' layout: the width transformers' rotary embedding really rotates
            width = int(head_dim * rope_params.get("partial_rotary_factor", 1.0))
            if "rotary_dim" in kw and kw["rotary_dim"] != width:
                warnings.warn(f"from_hf_config: rotary_dim={kw['rotary_dim']} but transformers "
                              f"rotates {width} dims (head_dim {head_dim} x "
                              f"rope_parameters['partial_rotary_factor']); openmsa follows "
                              f"transformers", stacklevel=2)
            kw["rotary_dim"] = width
        elif "rotary_dim" not in kw:
            prf = _get(text, "partial_rotary_factor", None)
            if prf is not None:
                kw["rotary_dim"] = int(head_dim * prf)
        scaling = rope_params if rope_params is not None else _get(text, "rope_scaling", None)
        if scaling is None:
            scaling = _get(config, "rope_scaling", None)
        kw["rope_scaling"] = rope_scaling_from_hf(
            scaling, _get(text, "max_position_embeddings", None))
        if "num_index_heads" not in kw and "num_kv_heads" in kw:
            kw["num_index_heads"] = kw["num_kv_heads"]
        return cls(**kw)
