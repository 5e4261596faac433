# SPDX-License-Identifier: Apache-2.0
"""decode_step: a sparse layer's step after its projection (preparation, index branch, main
branch) in one launch at small batch (kernels/step.py), or the ops one after the other."""

from __future__ import annotations

import torch

from ..._dispatch import on_tensor_device, use_kernels
from ...support import attention_unsupported_reason
from ..attention.api import _aligned, sparse_attention, step_shape
from ..attention.checks import check_attention_args
from ..attention.plan import DEFAULT as ATTENTION_DEFAULT
from ..attention.plan import plan as attention_plan
from ..cache.api import prepare_outputs, prepare_plan
from ..common.counters import arrival_counters
from ..common.launch import PlanCache, call_key, scale_args, scale_key
from ..common.plan import DeviceFacts, LaunchPlan, config_or_default
from ..indexer.api import checked_selection_shape, prepare_and_select
from ..indexer.plan import DEFAULT as INDEXER_DEFAULT
from ..indexer.plan import plan as indexer_plan
from . import reference
from .kernels.step import _decode_step_kernel
from .plan import DEFAULT, ERROR_SLOT, StepConfig
from .plan import plan as step_plan

__all__ = ["decode_step", "StepConfig"]

_PLANS = PlanCache("decode_step")


@on_tensor_device
def decode_step(qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
                index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
                index_slot_mapping, cu_seqlens_q, seq_lens, index_block_table, block_table, *,
                max_q_len=None, k_scale=None, v_scale=None, index_q_out=None, out=None,
                cache_config=None, indexer_config=None, attention_config=None,
                step_config: StepConfig | None = None, trace=None):
    """`prepare_and_select`, then `sparse_attention` over the blocks it selected: a sparse
    layer's step between its two projections.

    Args: prepare_and_select's (qkv ... cu_seqlens_q, seq_lens, then the index cache's table
        `index_block_table`, max_q_len, k_scale, v_scale, index_q_out, cache_config,
        indexer_config), then sparse_attention's (`block_table`: the K/V cache's table; `out`;
        `attention_config`, its config); the softmax scale is head_dim ** -0.5.
        step_config: `StepConfig` (None: the default).
        trace: None, or a contiguous int64 CUDA tensor of at least 4 * programs elements, for
            a step that runs as one launch: row p (p's ticket) gets the program's start, the
            end of its wait for the phase before and its end (the GPU's global timer, ns), and
            its SM; the rows past the launch's programs are left as they were. A diagnostic of
            where the launch's time goes (benchmarks/step_ab.py records it per phase).

    Returns:
        (q, index_q, indices, out), as the separate ops return them: bit for bit, except
        that the attention output may differ in rounding where the attention's own launch runs
        other warps than the one launch (StepConfig.num_warps).

    On the kernel path a decode or verify step of at most `step_config.max_tokens` tokens
    whose separate launches are of the kinds the one launch runs (step/plan.py: not into NVFP4
    pages, no prefill forms) runs as one launch (kernels/step.py); any other step runs the
    ops.
    """
    step_config = config_or_default(step_config, DEFAULT, "step_config")
    if not use_kernels(qkv):
        return reference.decode_step(
            qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
            index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache, index_slot_mapping,
            cu_seqlens_q, seq_lens, index_block_table, block_table, max_q_len=max_q_len,
            k_scale=k_scale, v_scale=v_scale, index_q_out=index_q_out, out=out,
            cache_config=cache_config, indexer_config=indexer_config,
            attention_config=attention_config, trace=trace)
    indexer_config = config_or_default(indexer_config, INDEXER_DEFAULT, "indexer_config")
    attention_config = config_or_default(attention_config, ATTENTION_DEFAULT,
                                         "attention_config")
    tensors = (qkv, positions, q_norm_weight, k_norm_weight, index_q_norm_weight,
               index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
               index_slot_mapping, cu_seqlens_q, seq_lens, index_block_table, block_table)
    given = tuple(t for t in (index_q_out, out) if t is not None)
    # (V's address parity and the caches' alignment: the attention's plan reads them, as
    # sparse_attention's key says)
    key = call_key(tensors + given, ("decode_step", config, index_q_out is None, out is None,
                                     v_cache.data_ptr() & 1 if isinstance(v_cache, torch.Tensor)
                                     else None,
                                     _aligned(k_cache, v_cache)
                                     if isinstance(k_cache, torch.Tensor)
                                     and isinstance(v_cache, torch.Tensor) else None,
                                     scale_key(k_scale), scale_key(v_scale), cache_config,
                                     indexer_config, attention_config, step_config, max_q_len,
                                     trace is None))

    def make():
        prepared = prepare_plan(qkv, positions, config, q_norm_weight, k_norm_weight,
                                index_q_norm_weight, index_k_norm_weight, k_cache, v_cache,
                                slot_mapping, index_cache, index_slot_mapping, k_scale, v_scale,
                                None, index_q_out, cache_config)
        # (the outputs as the ops would make them, for their checks)
        q, index_q = prepare_outputs(qkv, config, index_cache, None, index_q_out)
        shape = checked_selection_shape(index_q, index_cache, cu_seqlens_q, seq_lens,
                                        index_block_table, config.topk_blocks,
                                        config.init_blocks, config.local_blocks,
                                        config.block_size, None, max_q_len,
                                        table_name="index_block_table")
        indices = torch.empty(index_q.shape[:2] + (config.topk_blocks,), dtype=torch.int32,
                              device=qkv.device)
        check_attention_args(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table,
                             scale=None, block_size=config.block_size, out=out, k_scale=k_scale,
                             v_scale=v_scale)
        reason = attention_unsupported_reason(
            head_dim=q.shape[2], block_size=config.block_size,
            group_size=q.shape[1] // k_cache.shape[2], query_dtype=q.dtype,
            kv_dtype=k_cache.dtype, topk=config.topk_blocks, device=q.device)
        if reason is not None:
            raise ValueError(reason)
        device = DeviceFacts.of(qkv.device)
        attention = attention_plan(step_shape(q, k_cache, v_cache, indices,
                                              block_size=config.block_size,
                                              has_scale=k_scale is not None
                                              or v_scale is not None),
                                   device, attention_config)
        fused = step_plan(qkv.shape[0], seq_lens.shape[0],
                          LaunchPlan(prepared.launches), indexer_plan(shape, device,
                                                                      indexer_config),
                          attention, device, step_config)
        return fused, prepared.table

    fused, table = _PLANS.get_or_plan(key, make)
    if trace is not None:
        _check_trace(trace, fused, qkv.device)
    if fused is None:
        q, index_q, indices = prepare_and_select(
            qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
            index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache, index_slot_mapping,
            cu_seqlens_q, seq_lens, index_block_table, max_q_len=max_q_len, k_scale=k_scale,
            v_scale=v_scale, index_q_out=index_q_out, cache_config=cache_config,
            indexer_config=indexer_config)
        out = sparse_attention(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens,
                               block_table, block_size=config.block_size, out=out,
                               k_scale=k_scale, v_scale=v_scale, config=attention_config)
        return q, index_q, indices, out
    launch, sizes = fused
    return _run(launch, sizes, table, qkv, positions, config, q_norm_weight, k_norm_weight,
                index_q_norm_weight, index_k_norm_weight, k_cache, v_cache, slot_mapping,
                index_cache, index_slot_mapping, cu_seqlens_q, seq_lens, index_block_table,
                block_table, k_scale, v_scale, index_q_out, out, trace)


def _check_trace(trace, fused, device):
    if not isinstance(trace, torch.Tensor):
        raise TypeError(f"trace must be a torch.Tensor or None, got {type(trace).__name__}")
    if device.type != "cuda" or trace.device != device:
        raise ValueError(f"trace must be on the step's GPU ({device}), got {trace.device}: the "
                         "timer it records is the GPU's")
    if trace.dtype != torch.int64 or not trace.is_contiguous():
        raise ValueError(f"trace must be a contiguous int64 tensor, got {trace.dtype}"
                         f"{'' if trace.is_contiguous() else ', not contiguous'}")
    if fused is None:
        raise ValueError("trace: this step runs the ops apart, not as one launch")
    programs = fused[0].grid[0]
    if trace.numel() < 4 * programs:
        raise ValueError(f"trace must have at least {4 * programs} elements (4 for each of the "
                         f"launch's {programs} programs), got {trace.numel()}")


def _run(launch, sizes, table, qkv, positions, config, q_norm_weight, k_norm_weight,
         index_q_norm_weight, index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
         index_slot_mapping, cu_seqlens_q, seq_lens, index_block_table, block_table, k_scale,
         v_scale, index_q_out, out, trace):
    """The one launch with the call's tensors and its workspaces."""
    device = qkv.device
    q, index_q = prepare_outputs(qkv, config, index_cache, None, index_q_out)
    num_tokens, num_heads, head_dim = q.shape
    index_heads, width = index_q.shape[1], index_block_table.shape[1]
    topk, segments = config.topk_blocks, sizes["segments"]
    indices = torch.empty((num_tokens, index_heads, topk), dtype=torch.int32, device=device)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    scores = torch.empty((num_tokens, index_heads, width), dtype=torch.float32, device=device)
    # as the selection's runner makes them (indexer/api.py, _run_segments)
    cand = indices if segments == 1 else torch.empty(
        (num_tokens, index_heads, segments, sizes["candidates"]), dtype=torch.int64,
        device=device)
    scratch = cand if not sizes["scratch"] else torch.empty(
        (num_tokens, index_heads, segments, sizes["scratch"]), dtype=torch.int64, device=device)
    splits = sizes["splits"]
    part = out if not splits else torch.empty(num_tokens * num_heads * splits * (head_dim + 1),
                                              dtype=torch.float32, device=device)
    counters = arrival_counters(device, sizes["counters"], "decode_step")
    _, ks, vs = scale_args(k_scale, v_scale, device, qkv)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    num_index_slots = index_cache.shape[0] * index_cache.shape[1]
    e_prep, e_score, e_seg, e_smerge, e_att = sizes["ends"]
    launch.run(_decode_step_kernel, qkv, positions, q_norm_weight, k_norm_weight,
               index_q_norm_weight, index_k_norm_weight, table, k_cache, v_cache, slot_mapping,
               index_cache, index_slot_mapping, ks, vs, q, index_q, float(config.rms_norm_eps),
               num_slots, num_index_slots, *qkv.stride(), *k_cache.stride(), *v_cache.stride(),
               *index_cache.stride(), *q.stride(), *index_q.stride(),
               cu_seqlens_q, seq_lens, index_block_table, block_table, seq_lens.shape[0],
               num_tokens, *index_block_table.stride(), *block_table.stride(),
               index_cache.shape[0], k_cache.shape[0],
               scores, indices, cand, scratch, width, segments, *scores.stride(),
               *indices.stride(),
               out, part, head_dim ** -0.5, block_table.shape[1], *out.stride(),
               e_prep, e_score, e_seg, e_smerge, e_att, counters, trace)
    if device.type != "cuda" and int(counters[ERROR_SLOT]):
        raise RuntimeError("decode_step: a phase of the one launch ran before the phase it "
                           "reads had finished (kernels/step.py's program order)")
    return q, index_q, indices, out

