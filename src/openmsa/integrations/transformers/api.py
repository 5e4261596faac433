# SPDX-License-Identifier: Apache-2.0
"""`use_openmsa`: the options checked, then the swap, the step hooks and the guards installed."""

from __future__ import annotations

import torch

from ... import nvfp4
from ...config import MSAConfig
from ...rope import ROPE_ANGLES
from .attention import msa_config, swap_sparse_layers, text_model
from .guards import guard_generate, refuse_save
from .steps import _OpenMSAState, install_step_hooks

__all__ = ["use_openmsa"]

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32,
           "float8_e4m3fn": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn}
_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
# the index cache may also hold NVFP4 pages (openmsa.nvfp4): uint8, 72 bytes a token
_INDEX_DTYPES = {**_DTYPES, "nvfp4": nvfp4.DTYPE, "uint8": nvfp4.DTYPE}


def _cache_dtype(name: str, value, default: torch.dtype, *, index: bool = False
                 ) -> torch.dtype:
    """A cache dtype by name or dtype; `index`: the index cache's, which may be NVFP4."""
    names = _INDEX_DTYPES if index else _DTYPES
    if value is None:
        return default
    if isinstance(value, str):
        if value not in names:
            raise ValueError(f"{name} must be one of {sorted(names)} or a torch.dtype, got "
                             f"{value!r}")
        value = names[value]
    allowed = _CACHE_DTYPES + ((nvfp4.DTYPE,) if index else ())
    if not isinstance(value, torch.dtype) or value not in allowed:
        also = ", float8_e4m3fn or uint8 (NVFP4)" if index else " or float8_e4m3fn"
        raise TypeError(f"{name} must be bfloat16, float16, float32{also}, got {value!r}")
    return value


def _positive_int(name: str, value, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, got "
                         f"{value!r}")


def _check_options(model, *, ops, rope_angles, max_chunk_tokens, prefill_chunk_size,
                   num_pages) -> None:
    if getattr(model, "_openmsa_state", None) is not None:
        raise ValueError("use_openmsa was already applied to this model")
    if ops not in ("kernels", "reference"):
        raise ValueError(f"ops must be 'kernels' or 'reference', got {ops!r}")
    if rope_angles not in ROPE_ANGLES:
        raise ValueError(f"rope_angles must be one of {ROPE_ANGLES}, got {rope_angles!r}")
    _positive_int("max_chunk_tokens", max_chunk_tokens)
    _positive_int("prefill_chunk_size", prefill_chunk_size, optional=True)
    _positive_int("num_pages", num_pages, optional=True)


def _cache_dtypes(model_dtype: torch.dtype, kv_cache_dtype, index_cache_dtype,
                  index_query_dtype) -> tuple:
    """(K/V cache, index cache, index query) dtypes; None: the model's (the query's: None)."""
    kv = _cache_dtype("kv_cache_dtype", kv_cache_dtype, model_dtype)
    index = _cache_dtype("index_cache_dtype", index_cache_dtype, model_dtype, index=True)
    query = None if index_query_dtype is None else _cache_dtype("index_query_dtype",
                                                                index_query_dtype, model_dtype)
    return kv, index, query


def _check_index_pages(config: MSAConfig, index_dtype: torch.dtype) -> None:
    if index_dtype == nvfp4.DTYPE:
        reason = nvfp4.requirement_reason(config.index_head_dim, config.block_size)
        if reason is not None:
            raise ValueError(f"index_cache_dtype: {reason}")


def use_openmsa(model, *, kv_cache_dtype=None, index_cache_dtype=None, ops: str = "kernels",
                rope_angles: str = "fp32", max_chunk_tokens: int = 8192,
                prefill_chunk_size: int | None = 8192, num_pages: int | None = None,
                index_query_dtype=None):
    """Run the sparse layers of a transformers MiniMax-M3 model on openmsa; returns the model.

    Args:
        model: `MiniMaxM3VLForCausalLM`, `MiniMaxM3SparseForConditionalGeneration` (its
            language model) or one of their base models, changed in place.
        kv_cache_dtype, index_cache_dtype: the paged caches' dtypes (bfloat16, float16,
            float32 or float8_e4m3fn, or "bf16" / "fp8" / ...); None: the model's dtype. The
            index cache may also be "nvfp4" (torch.uint8): NVFP4 pages of 72 bytes a token
            (docs/spec.md), for index_head_dim == block_size == 128.
        ops: "kernels" (openmsa's public ops: Triton on CUDA, the reference on CPU) or
            "reference" (the pure-PyTorch reference everywhere).
        rope_angles: "fp32" (default: angles as transformers forms them, so the sparse layers
            rotate as the model's full-attention layers do) or "exact" (float64 angles).
        max_chunk_tokens: the most tokens one openmsa step takes; longer inputs run in chunks.
        prefill_chunk_size: `generate` prefills a longer prompt through the whole model in
            chunks of this many tokens (transformers' own `prefill_chunk_size`, so that the
            full-attention layers and MLPs hold one chunk at a time too), unless the call or the
            generation config sets one; None: no chunking unless asked for.
        num_pages: pages of `block_size` tokens to allocate up front (the caches grow by
            doubling past that).
        index_query_dtype: the index query's dtype (None: the index cache's; fp8 e4m3 with
            an NVFP4 index cache).

    Refused with ValueError: beam search, assisted or prompt-lookup decoding, contrastive
    search, static / offloaded / quantized caches, 4-D attention masks, output_attentions,
    saving the model afterwards.
    """
    _check_options(model, ops=ops, rope_angles=rope_angles, max_chunk_tokens=max_chunk_tokens,
                   prefill_chunk_size=prefill_chunk_size, num_pages=num_pages)
    text = text_model(model)
    kv_dtype, index_dtype, iq_dtype = _cache_dtypes(text.embed_tokens.weight.dtype,
                                                    kv_cache_dtype, index_cache_dtype,
                                                    index_query_dtype)
    config = msa_config(text, rope_angles)
    _check_index_pages(config, index_dtype)
    state = _OpenMSAState(config, kv_dtype, index_dtype, max_chunk_tokens, num_pages)
    swap_sparse_layers(text, state, ops=ops, index_query_dtype=iq_dtype)
    if num_pages:
        state.grow(num_pages)
    install_step_hooks(text, state)
    if hasattr(model, "generate"):
        guard_generate(model, prefill_chunk_size)
    model.save_pretrained = refuse_save
    model._openmsa_state = state
    return model
