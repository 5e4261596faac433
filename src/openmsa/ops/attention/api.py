# SPDX-License-Identifier: Apache-2.0
"""Public sparse_attention and sparse_page_table: check the arguments, get the step's launch plan
(plan.py; cached by call key), run it on the Triton/Gluon kernels (CUDA, or CPU under
TRITON_INTERPRET=1), or run the reference (CPU)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..._dispatch import on_tensor_device, use_kernels
from ...support import attention_unsupported_reason
from ..common.counters import arrival_counters
from ..common.launch import PlanCache, call_key, launch, scale_args, scale_key, tma_descriptor
from ..common.plan import DeviceFacts, LaunchPlan, config_or_default, next_pow2
from . import reference
from .checks import check_attention_args, check_page_table_args, page_bound
from .geometry import PAGE_TABLE_WARPS
from .plan import DEFAULT, AttentionConfig, AttentionShape, plan

__all__ = ["sparse_attention", "sparse_page_table"]

# launch plans by call key: the tensors' shapes, strides, dtypes and devices, the other
# arguments, V's address parity (fp8 V read in pairs), whether K's and V's addresses are 16-byte
# aligned (TMA copies), and the config
_PLANS = PlanCache("attention")


def _reads_as_pairs(v_cache: torch.Tensor) -> bool:
    """Whether an fp8 V cache can be read as uint16 pairs of columns (token.py's V_PAIRS): unit
    column stride, an even head dim, and every other stride and the base address even (a
    property of the view, fixed for a captured graph)."""
    return (v_cache.stride(3) == 1 and v_cache.shape[3] % 2 == 0
            and all(s % 2 == 0 for s in v_cache.stride()[:3]) and v_cache.data_ptr() % 2 == 0)


def _tma_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether TMA descriptors describe the K/V views as [pages, B, Hkv, D]: D contiguous and
    the other strides 16-byte multiples."""
    size = k_cache.dtype.itemsize
    return all(c.stride(3) == 1 and all(st * size % 16 == 0 for st in c.stride()[:3])
               for c in (k_cache, v_cache))


def _aligned(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0


def step_shape(q, k_cache, v_cache, indices, *, block_size=128, return_lse=False,
               has_scale=False) -> AttentionShape:
    """The AttentionShape of a call's (checked) tensors."""
    num_tokens, num_heads, head_dim = q.shape
    return AttentionShape(
        num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=k_cache.shape[2],
        head_dim=head_dim, num_index_heads=indices.shape[1], topk=indices.shape[2],
        block_size=block_size, q_dtype=q.dtype, kv_dtype=k_cache.dtype,
        v_pairs_view=_reads_as_pairs(v_cache), tma_views=_tma_views(k_cache, v_cache),
        tma_aligned=_aligned(k_cache, v_cache), return_lse=bool(return_lse),
        has_scale=has_scale)


def _check_config(config, name: str = "config"):
    return config_or_default(config, DEFAULT, name)


@on_tensor_device
def sparse_attention(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table, *,
                     scale=None, block_size=128, out=None, return_lse=False, k_scale=None,
                     v_scale=None, config: AttentionConfig | None = None):
    """Exact GQA softmax attention over the tokens of the selected blocks (MSA's main branch;
    docs/spec.md, "Sparse attention").

    Args:
        q: [T, Hq, D] bf16/fp16, any strides.
        k_cache, v_cache: [P, B, Hkv, D] views with any strides (vLLM's packed
            [P, Hkv, B, 2*D] permuted, or the flash layout), bf16/fp16/fp8 e4m3.
        indices: int32 [T, H, K] from select_blocks; KV head g reads index head g*H//Hkv.
            Entries < 0 or >= the token's causal blocks are skipped, never dereferenced; a
            repeated id counts once.
        cu_seqlens_q, seq_lens, block_table: the step (int32). Values are not checked (no host
            sync): a malformed step or request is padding, and a page id outside [0, P) reads
            nothing (docs/spec.md, "Bounds").
        scale: softmax scale (D ** -0.5 when None).
        out: optional [T, Hq, D] in q's dtype, any strides, written in place.
        return_lse: also return the fp32 [T, Hq] natural-log LSE.
        k_scale, v_scale: per-tensor dequantisation scales of fp8 caches (a finite nonzero
            float, or a one-element fp32 device tensor, so a graph can change them).
        config: the launch knobs (plan.py's AttentionConfig; DEFAULT when None).

    Returns:
        out, or (out, lse). An empty row gives 0 output and -inf LSE.
    """
    config = _check_config(config)
    if not use_kernels(q):
        return reference.sparse_attention(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens,
                                          block_table, scale=scale, block_size=block_size,
                                          out=out, return_lse=return_lse, k_scale=k_scale,
                                          v_scale=v_scale)
    tensors = (q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table,
               q if out is None else out)
    key = call_key(tensors, (out is None, bool(return_lse), v_cache.data_ptr() & 1
                             if isinstance(v_cache, torch.Tensor) else None,
                             _aligned(k_cache, v_cache) if isinstance(k_cache, torch.Tensor)
                             and isinstance(v_cache, torch.Tensor) else None,
                             scale, block_size, scale_key(k_scale), scale_key(v_scale), config))

    def make() -> LaunchPlan:
        check_attention_args(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table,
                             scale=scale, block_size=block_size, out=out, k_scale=k_scale,
                             v_scale=v_scale)
        reason = attention_unsupported_reason(
            head_dim=q.shape[2], block_size=block_size, group_size=q.shape[1] // k_cache.shape[2],
            query_dtype=q.dtype, kv_dtype=k_cache.dtype, topk=indices.shape[2], device=q.device)
        if reason is not None:
            raise ValueError(reason)
        shape = step_shape(q, k_cache, v_cache, indices, block_size=block_size,
                           return_lse=return_lse,
                           has_scale=k_scale is not None or v_scale is not None)
        return plan(shape, DeviceFacts.of(q.device), config)

    p = _PLANS.get_or_plan(key, make)
    sm_scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    return _run(p, q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table, out,
                bool(return_lse), sm_scale, k_scale, v_scale)


def _run(p: LaunchPlan, q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table, out,
         return_lse, sm_scale, k_scale, v_scale):
    """The plan's launches with the call's tensors and the workspaces they share."""
    num_tokens, num_heads, head_dim = q.shape
    device = q.device
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    # (each workspace allocation costs ~3 µs of host time per eager call: the LSE is made only
    # when returned or when the prefill tiles write it, and the split partials share one)
    store_lse = p.sizes["store_lse"]
    if store_lse:
        lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=device)
    else:
        lse = out  # never written (STORE_LSE off): any tensor stands in
    if num_tokens == 0:
        return (out, lse) if return_lse else out
    num_kv_heads = k_cache.shape[2]
    splits = p.sizes["splits"]
    if splits > 1:
        # [T, Hq, splits, D] partial outputs, then [T, Hq, splits] partial LSEs, in one
        # allocation (the kernels find the LSEs after the T * Hq * splits * D outputs)
        part = torch.empty(num_tokens * num_heads * splits * (head_dim + 1),
                           dtype=torch.float32, device=device)
        counters = (arrival_counters(device, num_tokens * num_kv_heads, "attention")
                    if p.sizes["fused"] else lse)
    else:
        part = counters = lse
    _, ks, vs = scale_args(k_scale, v_scale, device, lse)
    num_requests = seq_lens.shape[0]
    # what the kernels bound the step's values by (docs/spec.md, "Bounds"): a request needing
    # more blocks than the table has columns is padding, a page id outside [0, P) reads nothing
    table_width, num_pages = block_table.shape[1], k_cache.shape[0]
    blocks = union = lse
    tile_qt = p.sizes["tile_tokens"]
    if tile_qt:
        # per (tile, KV head): the union's size (-1: not taken), then its page ids, block ids
        # and token bits (tile.py)
        blocks = torch.empty((-(-num_tokens // tile_qt), num_kv_heads), dtype=torch.int32,
                             device=device)
        union = torch.empty((p.sizes["tile_items"], 3, p.sizes["union_width"]),
                            dtype=torch.int32, device=device)
    lse_strides = lse.stride() if store_lse else (0, 0)
    step = _Step(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table, out, lse,
                 lse_strides, part, counters, blocks, union, ks, vs, sm_scale, num_requests,
                 table_width, num_pages, p.sizes["tile_items"])
    for launch in p.launches:
        try:
            runner = _RUNNERS[launch.kernel]
        except KeyError:
            raise ValueError(f"sparse_attention: no kernel {launch.kernel!r} in this op") from None
        runner(launch, step)
    return (out, lse) if return_lse else out


class _Step(NamedTuple):
    """A call's tensors, workspaces and bounds, as the launch runners pass them on."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    indices: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    lse_strides: tuple
    part: torch.Tensor
    counters: torch.Tensor
    blocks: torch.Tensor
    union: torch.Tensor
    ks: object
    vs: object
    sm_scale: float
    num_requests: int
    table_width: int
    num_pages: int
    tile_items: int


def _run_token(launch, s: _Step) -> None:
    from .kernels.token import _sparse_attention_kernel
    q, k_cache, v_cache = s.q, s.k_cache, s.v_cache
    launch.run(_sparse_attention_kernel, q, k_cache, v_cache, s.indices, s.cu_seqlens_q,
               s.seq_lens, s.block_table, s.out, s.lse, s.part, s.counters, s.blocks, s.ks, s.vs,
               s.sm_scale, s.num_requests, s.table_width, s.num_pages, *q.stride(),
               *k_cache.stride(), *v_cache.stride(), *s.indices.stride(),
               *s.block_table.stride(), *s.out.stride(), *s.lse_strides)


def _run_merge(launch, s: _Step) -> None:
    from .kernels.token import _merge_splits_kernel
    launch.run(_merge_splits_kernel, s.part, s.out, s.lse, *s.out.stride(), *s.lse_strides)


def _run_tile_plan(launch, s: _Step) -> None:
    from .kernels.tile import _tile_plan_kernel
    launch.run(_tile_plan_kernel, s.indices, s.cu_seqlens_q, s.seq_lens, s.block_table, s.blocks,
               s.union, s.num_requests, s.q.shape[0], s.table_width, s.num_pages,
               *s.indices.stride(), *s.block_table.stride())


def _run_tiles_gluon(launch, s: _Step) -> None:
    from .kernels.tile_gluon import _sparse_attention_tile_gluon_kernel
    k_src, v_src = _tile_sources(launch, s.k_cache, s.v_cache)
    launch.run(_sparse_attention_tile_gluon_kernel, s.q, k_src, v_src, s.cu_seqlens_q,
               s.seq_lens, s.out, s.lse, s.blocks, s.union, s.ks, s.vs, s.sm_scale,
               s.num_requests, *s.q.stride(), *s.out.stride(), *s.lse.stride(),
               *s.k_cache.stride()[:3], *s.v_cache.stride()[:3])


def _run_tiles(launch, s: _Step) -> None:
    from .kernels.tile import _sparse_attention_tile_kernel
    launch.run(_sparse_attention_tile_kernel, s.q, s.k_cache, s.v_cache, s.cu_seqlens_q,
               s.seq_lens, s.out, s.lse, s.blocks, s.union, s.ks, s.vs, s.sm_scale,
               s.num_requests, s.q.shape[0], s.table_width, s.tile_items, *s.q.stride(),
               *s.k_cache.stride(), *s.v_cache.stride(), *s.out.stride(), *s.lse.stride())


# each launch name of plan.py's plans and what runs it; a name missing here raises
_RUNNERS = {"token": _run_token, "merge": _run_merge, "tile_plan": _run_tile_plan,
            "tiles_gluon": _run_tiles_gluon, "tiles": _run_tiles}


def _tile_sources(gluon, k_cache, v_cache):
    """What the Gluon tiles read K and V from: for fp8 the views themselves (the loader
    warpgroup reads them with their strides), else TMA descriptors of the caches' own
    [pages, B, Hkv, D] views copying one [SUB, D] tile of one page and KV head."""
    if gluon.params["FP8"]:
        return k_cache, v_cache
    box = (1, gluon.params["SUB"], 1, k_cache.shape[3])
    return tuple(tma_descriptor(c, c.shape, c.stride(), box) for c in (k_cache, v_cache))


@on_tensor_device
def sparse_page_table(indices, cu_seqlens_q, seq_lens, block_table, *, num_kv_heads,
                      block_size=128, sub_page_size=16, num_pages=None):
    """A selection as a page table for any paged kernel that runs one query row per table row.

    Args:
        indices: int32 [T, H, K] (select_blocks' output); KV head g reads index head g*H//Hkv.
        cu_seqlens_q, seq_lens, block_table: the step (int32).
        num_kv_heads: Hkv; rows are head-minor, row = t * Hkv + g.
        sub_page_size: S, a power of two dividing block_size: the K/V cache is then read as
            [P * B/S, S, Hkv, D] (a view of a flash-layout cache).
        num_pages: P, the cache's page count: a selected block whose table entry lies outside
            [0, P) is dropped like a repeated id (docs/spec.md, "Bounds"). None: only negative
            entries are dropped (the caller vouches for the rest), and in either case an entry
            whose sub-page ids would not fit int32 (page >= 2^31 / (B/S)).

    Returns:
        (pages int32 [T*Hkv, K*B/S], context_lens int32 [T*Hkv]): sub-page ids of the full
        selected blocks ascending, then the token's own block cut to its causal sub-pages, 0 in
        unused columns; context_len = full blocks' tokens + the own block's p % B + 1.
    """
    if not use_kernels(indices):
        return reference.sparse_page_table(indices, cu_seqlens_q, seq_lens, block_table,
                                           num_kv_heads=num_kv_heads, block_size=block_size,
                                           sub_page_size=sub_page_size, num_pages=num_pages)
    from .kernels.page_table import _sparse_page_table_kernel

    check_page_table_args(indices, cu_seqlens_q, seq_lens, block_table,
                          num_kv_heads=num_kv_heads, block_size=block_size,
                          sub_page_size=sub_page_size, num_pages=num_pages)
    num_tokens, num_index_heads, topk = indices.shape
    per_block = block_size // sub_page_size
    pages = torch.empty((num_tokens * num_kv_heads, topk * per_block), dtype=torch.int32,
                        device=indices.device)
    lens = torch.empty(num_tokens * num_kv_heads, dtype=torch.int32, device=indices.device)
    if num_tokens:
        launch(_sparse_page_table_kernel, (num_tokens, num_kv_heads),
               indices, cu_seqlens_q, seq_lens, block_table, pages, lens, seq_lens.shape[0],
               block_table.shape[1], page_bound(num_pages, per_block), *indices.stride(),
               *block_table.stride(), *pages.stride(),
               NUM_KV_HEADS=num_kv_heads, NUM_INDEX_HEADS=num_index_heads, TOPK=topk,
               KP=next_pow2(topk), BLOCK=block_size, SUB=sub_page_size,
               num_warps=PAGE_TABLE_WARPS)
    return pages, lens
