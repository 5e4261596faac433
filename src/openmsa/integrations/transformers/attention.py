# SPDX-License-Identifier: Apache-2.0
"""The attention swap: each sparse layer's `MiniMaxM3VLAttention` becomes an
`OpenMSASparseAttention` (the same call, an `MSAAttention` on the same weights inside), with the
openmsa config read from the text model and checked against its rotary embedding."""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch
from torch import nn

from ...config import MSAConfig
from ...layer import MSAAttention
from ...rope import attention_factor, inv_freq
from .steps import _OpenMSAState


def _modeling():
    try:
        from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m
    except ImportError as e:  # pragma: no cover - exercised only without transformers
        raise ImportError("openmsa.integrations.transformers needs transformers with MiniMax-M3 "
                          "(pip install 'openmsa[transformers]')") from e
    return m


class OpenMSASparseAttention(nn.Module):
    """Stands in for a sparse layer's `MiniMaxM3VLAttention`: same call, openmsa inside."""

    def __init__(self, msa: MSAAttention, layer_idx: int, state: _OpenMSAState):
        super().__init__()
        self.msa = msa
        self.layer_idx = layer_idx
        self._state = [state]  # a list: not a submodule, not a parameter

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                cache=None, past_key_values=None, **kwargs):
        state = self._state[0]
        cache = cache if cache is not None else past_key_values
        b, s, hidden = hidden_states.shape
        index, chunks = state.plan(cache, hidden_states.device)
        flat = hidden_states.reshape(b * s, hidden)
        x = flat.index_select(0, index)
        out = torch.zeros_like(flat)
        if chunks:
            k_cache, v_cache, index_cache = state.caches[self.layer_idx]
            parts = [self.msa(x[a:e], meta, (k_cache, v_cache), index_cache)
                     for meta, a, e in chunks]
            out.index_copy_(0, index, torch.cat(parts).to(out.dtype))
        if cache is not None:
            # length bookkeeping only: one element per token, the keys live in openmsa's pages
            mark = hidden_states.new_zeros(b, 1, s, 1)
            cache.update(mark, mark, self.layer_idx)
        return out.reshape(b, s, hidden), None


def text_model(model):
    """The model's one MiniMax-M3 text model."""
    m = _modeling()
    found = [mod for mod in model.modules() if isinstance(mod, m.MiniMaxM3VLTextModel)]
    if not found:
        raise TypeError(f"model must be a transformers MiniMax-M3 model (MiniMaxM3VLForCausalLM, "
                        f"MiniMaxM3SparseForConditionalGeneration or their base models), got "
                        f"{type(model).__name__}")
    if len(found) != 1:
        raise ValueError(f"use_openmsa: expected one MiniMax-M3 text model, found {len(found)}")
    return found[0]


def _check_rope(config: MSAConfig, text) -> MSAConfig:
    """The rotary width and frequencies openmsa will use must be the model's own."""
    rot = getattr(text, "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        return config
    theirs = rot.inv_freq.detach().float().cpu()
    if 2 * theirs.numel() != config.rotary_dim:
        config = replace(config, rotary_dim=2 * theirs.numel())
    ours = inv_freq(config, angles="fp32")
    # `model.to(torch.bfloat16)` also casts the buffer: then it holds rounded frequencies
    # (transformers rotates its full-attention layers with those; openmsa keeps the config's)
    if not torch.allclose(ours, theirs, rtol=torch.finfo(rot.inv_freq.dtype).eps, atol=0) \
            or abs(attention_factor(config) - float(rot.attention_scaling)) > 1e-6:
        raise ValueError("use_openmsa: the model's rotary embedding (inverse frequencies or "
                         "attention factor) is not the one its config describes to openmsa")
    return config


def msa_config(text, rope_angles: str) -> MSAConfig:
    """The text model's sparse-attention config, rotating as its rotary embedding does."""
    with warnings.catch_warnings():
        # a `rotary_dim` that disagrees with transformers' rotation: the model's own rotary
        # embedding decides (checked in _check_rope)
        warnings.simplefilter("ignore")
        config = MSAConfig.from_hf_config(text.config)
    return _check_rope(replace(config, rope_angles=rope_angles), text)


def swap_sparse_layers(text, state: _OpenMSAState, *, ops: str,
                       index_query_dtype: torch.dtype | None) -> None:
    """Each sparse layer's attention for an OpenMSASparseAttention on its own weights (fused
    into `state.layers`)."""
    m = _modeling()
    config = state.config
    for i, layer in enumerate(text.layers):
        attn = layer.self_attn
        if not config.is_sparse_layer(i):
            continue
        if not isinstance(attn, m.MiniMaxM3VLAttention) or attn.indexer is None:
            raise ValueError(f"use_openmsa: layer {i} is sparse in the config but its attention "
                             f"is {type(attn).__name__} without an indexer")
        w = attn.q_proj.weight
        if type(w).__name__ == "DTensor":
            raise ValueError("use_openmsa: tensor-parallel models (transformers' tp_plan) are not "
                             "supported; openmsa's layer shards by itself (MSAAttention tp_size)")
        msa = MSAAttention(config, text.config.hidden_size, dtype=w.dtype, device=w.device,
                           ops=ops, index_query_dtype=index_query_dtype)
        msa.load_checkpoint(attn.state_dict())
        state.layers[i] = msa
        layer.self_attn = OpenMSASparseAttention(msa, i, state)
    if not state.layers:
        raise ValueError("use_openmsa: the model has no sparse layer (layer_types has no "
                         "'minimax_m3_sparse')")
