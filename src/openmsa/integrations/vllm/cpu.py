# SPDX-License-Identifier: Apache-2.0
"""CPU stand-ins for the CUDA-only pieces of vLLM's MiniMax-M3 layer, so that the model runs end
to end on vLLM's CPU platform: the fused QK-norm / RoPE / cache-insert op
(`vllm._custom_ops.fused_minimax_m3_qknorm_rope_kv_insert`) and the FlashInfer Gemma RMSNorm of
`MiniMAXGemmaRMSNorm`. Each wrapper runs the original for tensors that are not on the CPU.

The insert follows the op's contract (vLLM's docstring): per-head Gemma RMSNorm of q, k and,
on sparse layers, index_q / index_k, partial NeoX RoPE from the layer's own `cos_sin_cache`
(the table vLLM's kernel reads), written back into `qkv` (or into `q_out` / `index_q_out`), then
k, v into the paged main cache and index_k into the index cache through openmsa's cache writers
(`write_kv_cache`, `write_index_cache`: fp8 saturating casts, NVFP4 pages, slot < 0 skipped).
"""

from __future__ import annotations

import functools

import torch

from ...ops.cache.api import write_index_cache, write_kv_cache
from ...ops.cache.reference import rms_norm, rotate, to_cache_dtype
from . import logger
from .impls import kv_views

__all__ = ["install", "qknorm_rope_kv_insert", "gemma_rms_norm"]

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None):
    """FlashInfer's `gemma_rmsnorm` (residual None: returns the normalised x) and
    `gemma_fused_add_rmsnorm` (residual += x, then x = norm(residual), both in place; returns
    (x, residual)), in fp32 math."""
    if residual is None:
        return rms_norm(x, weight, eps).to(x.dtype)
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps))
    return x, residual


def qknorm_rope_kv_insert(qkv, q_norm_weight, k_norm_weight, cos_sin_cache, positions,
                          num_heads, num_kv_heads, rotary_dim, eps, index_q_norm_weight=None,
                          index_k_norm_weight=None, num_index_heads=0, slot_mapping=None,
                          index_slot_mapping=None, kv_cache=None, index_cache=None,
                          block_size=0, q_out=None, index_q_out=None, kv_cache_dtype="auto",
                          skip_index_branch=False, q_fp8_out=None, q_fp8_scale=1.0,
                          kv_k_scale=None, kv_v_scale=None) -> None:
    """`fused_minimax_m3_qknorm_rope_kv_insert` on CPU tensors (same arguments; see the
    module's docstring). Head size and index head size: from the weights."""
    if q_fp8_out is not None:
        raise ValueError("q_fp8_out: the CPU stand-in has no fp8 query output (it serves "
                         "vLLM's CUTLASS decode, a GPU path)")
    if kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32", *_FP8):
        raise ValueError(f"kv_cache_dtype: the CPU stand-in writes bf16/fp16/fp32 or fp8 e4m3 "
                         f"caches, got {kv_cache_dtype!r}")
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [tokens, width], got {list(qkv.shape)}")
    d = q_norm_weight.shape[0]
    n = qkv.shape[0]
    sizes = [num_heads * d, num_kv_heads * d, num_kv_heads * d]
    if num_index_heads:
        di = index_q_norm_weight.shape[0]
        sizes += [num_index_heads * di, di]
    if sum(sizes) != qkv.shape[1]:
        raise ValueError(f"qkv: {num_heads} q + 2 x {num_kv_heads} kv heads of {d}"
                         f"{f' + {num_index_heads} + 1 index heads' if num_index_heads else ''}"
                         f" make {sum(sizes)} columns, qkv has {qkv.shape[1]}")
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    if cos.shape[-1] * 2 != rotary_dim:
        raise ValueError(f"cos_sin_cache rows hold {2 * cos.shape[-1]} values, rotary_dim is "
                         f"{rotary_dim}")
    parts = torch.split(qkv, sizes, dim=-1)

    def norm_rope(x, heads, weight):
        return rotate(rms_norm(x.reshape(n, heads, -1), weight, eps), cos, sin)

    q = norm_rope(parts[0], num_heads, q_norm_weight)
    k = norm_rope(parts[1], num_kv_heads, k_norm_weight)
    if q_out is not None:
        q_out.view(n, num_heads, d).copy_(q)
    else:
        parts[0].copy_(q.reshape(n, -1))
    parts[1].copy_(k.reshape(n, -1))
    if kv_cache is not None and kv_cache.numel():
        if slot_mapping is None:
            raise ValueError("slot_mapping is needed with kv_cache")
        k_cache, v_cache = kv_views(kv_cache, num_kv_heads, d, _FP8.get(kv_cache_dtype))
        # (vLLM's op quantises fp8 pages without a scale; the attend reads them with the
        # layer's k/v scales, 1.0 unless the checkpoint has others)
        write_kv_cache(k[:slot_mapping.shape[0]], parts[2].reshape(n, num_kv_heads, d)
                       [:slot_mapping.shape[0]].float(), k_cache, v_cache, slot_mapping)
    if not num_index_heads or skip_index_branch:
        return None
    iq = norm_rope(parts[3], num_index_heads, index_q_norm_weight)
    ik = norm_rope(parts[4], 1, index_k_norm_weight)[:, 0]
    if index_q_out is not None:
        index_q_out.view(n, num_index_heads, -1).copy_(to_cache_dtype(iq, index_q_out.dtype))
    else:
        parts[3].copy_(iq.reshape(n, -1))
    parts[4].copy_(ik)
    if index_cache is not None and index_cache.numel():
        slots = index_slot_mapping if index_slot_mapping is not None else slot_mapping
        if slots is None:
            raise ValueError("index_slot_mapping (or slot_mapping) is needed with index_cache")
        write_index_cache(ik[:slots.shape[0]], index_cache, slots)
    return None


def _on_cpu(*tensors) -> bool:
    return all(t.device.type == "cpu" for t in tensors if isinstance(t, torch.Tensor))


def install() -> None:
    """Put the stand-ins in place (idempotent): the wrappers call vLLM's originals for tensors
    that are not on the CPU."""
    from vllm import _custom_ops
    from vllm.models.minimax_m3.nvidia import model as vmodel

    original_op = getattr(_custom_ops, "fused_minimax_m3_qknorm_rope_kv_insert", None)
    if original_op is not None and not hasattr(original_op, "openmsa_original"):
        @functools.wraps(original_op)
        def op(qkv, *args, **kwargs):
            if _on_cpu(qkv):
                return qknorm_rope_kv_insert(qkv, *args, **kwargs)
            return original_op(qkv, *args, **kwargs)
        op.openmsa_original = original_op
        _custom_ops.fused_minimax_m3_qknorm_rope_kv_insert = op

    norm_cls = getattr(vmodel, "MiniMAXGemmaRMSNorm", None)
    if norm_cls is not None and not hasattr(norm_cls.forward, "openmsa_original"):
        original_forward = norm_cls.forward

        @functools.wraps(original_forward)
        def forward(self, x, residual=None, **kwargs):
            if not _on_cpu(x):
                return original_forward(self, x, residual, **kwargs)
            if kwargs.get("mxfp8"):
                # (vLLM 0.34's norm can emit MXFP8 activations for the next GEMM: a GPU path)
                raise ValueError("mxfp8: the CPU stand-in of MiniMax-M3's Gemma RMSNorm emits "
                                 "the input's dtype only")
            return gemma_rms_norm(x, self.weight, self.variance_epsilon, residual)
        forward.openmsa_original = original_forward
        norm_cls.forward = forward
    logger.info("openmsa: vLLM's CPU platform: MiniMax-M3's fused QK-norm/RoPE/cache-insert op "
                "and Gemma RMSNorm run openmsa's CPU stand-ins")
