# SPDX-License-Identifier: Apache-2.0
"""A tiny random MiniMax-M3 checkpoint in the released checkpoint's layout (config.json with
`text_config.sparse_attention_config`, weights under their original names: `index_q_proj`,
`mlp.gate_proj` / `up_proj`, `block_sparse_moe.experts.N.w1/w2/w3`), which vLLM loads natively
and transformers loads through its own conversion mapping; and the transformers side of the
comparisons (tests/test_vllm.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re

import torch

from openmsa.ops.cache.reference import to_cache_dtype

# head and page sizes are vLLM's M3 backend's only ones (128); the rest is small. Dense MLPs on
# every layer: vLLM's CPU MoE backends do not take M3's SwiGLU-OAI experts.
TEXT = dict(vocab_size=256, hidden_size=128, intermediate_size=64, dense_intermediate_size=96,
            shared_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=128, max_position_embeddings=8192,
            rms_norm_eps=1e-6, rope_theta=5e6, rotary_dim=64, partial_rotary_factor=0.5,
            hidden_act="swigluoai", swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0,
            num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            scoring_func="sigmoid", use_routing_bias=True, routed_scaling_factor=2.0,
            moe_layer_freq=[0, 0, 0], tie_word_embeddings=False, use_gemma_norm=True,
            qk_norm_type="per_head", use_qk_norm=True, attention_output_gate=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
SPARSE = dict(use_sparse_attention=True, sparse_index_dim=128, sparse_num_index_heads=2,
              sparse_topk_blocks=4, sparse_block_size=128, sparse_disable_index_value=[0, 1, 1],
              sparse_score_type="max", sparse_init_block=0, sparse_local_block=1,
              sparse_attention_freq=[0, 1, 1])


def text_config(**sparse) -> dict:
    return {**TEXT, "sparse_attention_config": {**SPARSE, **sparse}}


def _original_names(state: dict, moe: list[int]) -> dict:
    """transformers' parameter names -> the released checkpoint's (the inverse of transformers'
    `minimax_m3_vl` conversion mapping, for a text-only model)."""
    out = {}
    for name, value in state.items():
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if not m:
            out[name] = value.contiguous()
            continue
        i, rest = int(m.group(1)), m.group(2).replace("self_attn.indexer.", "self_attn.index_")
        p = f"model.layers.{i}."
        if rest.startswith("mlp.") and moe[i]:
            rest, p = rest[4:], p + "block_sparse_moe."
            if rest == "gate.e_score_correction_bias":
                out[p + "e_score_correction_bias"] = value
            elif rest == "experts.gate_up_proj":
                half = value.shape[1] // 2
                for e in range(value.shape[0]):
                    out[p + f"experts.{e}.w1.weight"] = value[e, :half].contiguous()
                    out[p + f"experts.{e}.w3.weight"] = value[e, half:].contiguous()
            elif rest == "experts.down_proj":
                for e in range(value.shape[0]):
                    out[p + f"experts.{e}.w2.weight"] = value[e].contiguous()
            else:
                rest = rest.replace("shared_experts.gate_up_proj.", "shared_experts.gate_up.")
                if "gate_up." in rest:
                    half = value.shape[0] // 2
                    out[p + rest.replace("gate_up.", "gate_proj.")] = value[:half].contiguous()
                    out[p + rest.replace("gate_up.", "up_proj.")] = value[half:].contiguous()
                else:
                    out[p + rest] = value.contiguous()
            continue
        if rest == "mlp.gate_up_proj.weight":
            half = value.shape[0] // 2
            out[p + "mlp.gate_proj.weight"] = value[:half].contiguous()
            out[p + "mlp.up_proj.weight"] = value[half:].contiguous()
            continue
        out[p + rest] = value.contiguous()
    return out


def write_checkpoint(path: str, *, seed: int = 0, **sparse) -> dict:
    """A random fp32 MiniMax-M3 text model (Gemma norm weights drawn too, so they count) saved
    at `path` in the released layout; returns its text config."""
    from safetensors.torch import save_file
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    text = text_config(**sparse)
    torch.manual_seed(seed)
    model = MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**text)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.2)
    os.makedirs(path, exist_ok=True)
    save_file(_original_names(model.state_dict(), text["moe_layer_freq"]),
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m3_vl",
              "text_config": text, "torch_dtype": "float32"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return text


def load_transformers(path: str, **config_overrides):
    """transformers' own `MiniMaxM3VLForCausalLM` from the checkpoint at `path` (eager
    attention, fp32), its weights renamed by transformers' `minimax_m3_vl` conversion mapping."""
    from transformers import MiniMaxM3VLForCausalLM
    from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                 register_checkpoint_conversion_mapping)

    # the mapping is registered for the VL model type; the text-only class takes the same
    register_checkpoint_conversion_mapping(
        "MiniMaxM3VLForCausalLM", get_checkpoint_conversion_mapping("minimax_m3_vl"),
        overwrite=True)
    model, info = MiniMaxM3VLForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True,
        **config_overrides)
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
        raise AssertionError(f"checkpoint and transformers' model disagree: {info}")
    return model.eval()


@contextlib.contextmanager
def index_keys_in(dtype: torch.dtype | None):
    """transformers' lightning indexer with its index query and keys rounded to `dtype` after
    the RoPE (None: unchanged), as vLLM's M3 layer stores them: the fused insert op writes the
    roped index query into a buffer of the index cache's dtype and the keys into that cache,
    bf16 unless fp8 is asked for, whatever the model's dtype."""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as modeling

    if dtype is None:
        yield
        return
    original = modeling.MiniMaxM3VLIndexer.forward
    rope = modeling.apply_rotary_pos_emb

    def rounded_rope(q, k, cos, sin, unsqueeze_dim=1):
        q, k = rope(q, k, cos, sin, unsqueeze_dim)
        # (fp8: the saturating cast openmsa's cache writers and the index query share)
        return to_cache_dtype(q, dtype).to(q.dtype), to_cache_dtype(k, dtype).to(k.dtype)

    def forward(self, *args, **kwargs):
        modeling.apply_rotary_pos_emb = rounded_rope
        try:
            return original(self, *args, **kwargs)
        finally:
            modeling.apply_rotary_pos_emb = rope

    modeling.MiniMaxM3VLIndexer.forward = forward
    try:
        yield
    finally:
        modeling.MiniMaxM3VLIndexer.forward = original


@contextlib.contextmanager
def kv_in(dtype: torch.dtype | None):
    """transformers' attention with its roped keys and its values rounded to `dtype` (None:
    unchanged), as a paged cache of that dtype holds them (scale 1, saturating)."""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as modeling

    if dtype is None:
        yield
        return
    original = modeling.MiniMaxM3VLAttention.forward

    def forward(self, *args, **kwargs):
        rope = modeling.apply_rotary_pos_emb

        def rounded_rope(q, k, cos, sin, unsqueeze_dim=1):
            # the main branch's RoPE is the layer's first: the indexer's gets the original back
            modeling.apply_rotary_pos_emb = rope
            q, k = rope(q, k, cos, sin, unsqueeze_dim)
            return q, to_cache_dtype(k, dtype).to(k.dtype)

        modeling.apply_rotary_pos_emb = rounded_rope
        hook = self.v_proj.register_forward_hook(
            lambda module, args, out: to_cache_dtype(out, dtype).to(out.dtype))
        try:
            return original(self, *args, **kwargs)
        finally:
            modeling.apply_rotary_pos_emb = rope
            hook.remove()

    modeling.MiniMaxM3VLAttention.forward = forward
    try:
        yield
    finally:
        modeling.MiniMaxM3VLAttention.forward = original


def teacher_forced(model, prompt: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and the log-probabilities of `tokens` at each step after
    `prompt`, from one forward over prompt + tokens (exact math equals step-by-step decode)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)
    n = len(prompt)
    rows = logprobs[n - 1:n - 1 + len(tokens)]
    return rows.argmax(-1).tolist(), [rows[i, t].item() for i, t in enumerate(tokens)]
