# SPDX-License-Identifier: Apache-2.0
"""Public index-branch ops: check the arguments, get the step's launch plan (plan.py, cached by
call key), run it: the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1), or the reference
(CPU)."""

from __future__ import annotations

import torch

from ..._dispatch import on_tensor_device, use_kernels
from ..._checks import check_process_group
from ...nvfp4 import ALIGN as NVFP4_ALIGN
from ...nvfp4 import check_nvfp4_cache, is_nvfp4_cache
from ...support import indexer_unsupported_reason
import dataclasses

from ..common.launch import PlanCache, call_key, launch_planned, tma_descriptor
from ..common.plan import DeviceFacts, LaunchPlan, config_or_default
from . import reference
from .checks import check_indexer_args, check_select_args
from .plan import DEFAULT, IndexerConfig, IndexerShape, plan, selection_plan, stage_dtype
from .scores import _block_scores_kernel
from .select import (_group_bound_select_kernel, _group_max_kernel, _merge_topk_kernel,
                     _segment_topk_kernel)

__all__ = ["block_scores", "select_blocks"]


def _check_config(config, name: str = "config"):
    return config_or_default(config, DEFAULT, name)


def _raise_if_unsupported(index_q, index_cache, block_size, topk) -> None:
    reason = indexer_unsupported_reason(
        num_index_heads=index_q.shape[1], index_head_dim=index_q.shape[2], block_size=block_size,
        topk=topk, query_dtype=index_q.dtype, cache_dtype=index_cache.dtype,
        device=index_q.device)
    if reason is not None:
        raise ValueError(reason)


def _shape(index_q, index_cache, seq_lens, block_table, block_size, max_q_len, topk=None,
           init_blocks=0, local_blocks=1) -> IndexerShape:
    num_tokens, num_heads, head_dim = index_q.shape
    # what a TMA descriptor describes: q as [T * H, DI] rows, the cache as [pages * BLOCK, DI]
    # rows, each one strided 2-D array with int32 row counts (base alignment: at launch)
    tma_q = (index_q.stride(2) == 1 and index_q.stride(1) == head_dim
             and index_q.stride(0) == num_heads * head_dim and num_tokens * num_heads < 2 ** 31)
    tma_rows = (tma_q and index_cache.stride(2) == 1 and index_cache.stride(1) == head_dim
                and index_cache.stride(0) == block_size * head_dim
                and index_cache.shape[0] * block_size < 2 ** 31)
    return IndexerShape(num_tokens=num_tokens, num_heads=num_heads, head_dim=head_dim,
                        num_requests=seq_lens.shape[0], max_blocks=block_table.shape[1],
                        block_size=block_size, q_dtype=index_q.dtype,
                        cache_dtype=index_cache.dtype, max_q_len=max_q_len, tma_rows=tma_rows,
                        topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
                        tma_q=tma_q)


def _run_scores(launches: LaunchPlan, index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                scores, cp: tuple[int, int] | None = None, width: int | None = None) -> None:
    """The plan's scoring launches. The Gluon tile launch ("scores_tile_ws") is planned with its
    Triton form ("scores_tile_unaligned") beside it, and exactly one of them runs: the Gluon one
    when both index_q's and index_cache's base addresses are 16-byte aligned (what TMA takes),
    the Triton one otherwise. With a staging launch ("stage_nvfp4", the staged NVFP4 form), the
    tile launches score the 16-bit staging cache through the remapped table, with the query
    in the staging dtype; the request launch reads the NVFP4 pages as ever. `width`: the whole
    block table's (a context-parallel rank's block_table is a strided view of it), which bounds
    a request's blocks (docs/spec.md, "Bounds")."""
    if is_nvfp4_cache(index_cache) and index_cache.data_ptr() % NVFP4_ALIGN:
        # the plan's key has no address: a misaligned cache of a cached shape is refused here,
        # by name, rather than faulting in the kernel's 32-bit code loads
        check_nvfp4_cache("index_cache", index_cache)
    width = block_table.shape[1] if width is None else width
    args = _triton_args(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, scores, width)
    if cp is not None:
        # a context-parallel rank's share (cp.py): the Triton launches with its (size, rank);
        # its plan has no Gluon launch (_local_scores_kernels)
        for launch in launches:
            if launch.kernel in ("scores_request", "scores_tile"):
                launch_planned(_block_scores_kernel, (launch.key, "cp", *cp), launch.grid, *args,
                               **launch.params, cp_size=cp[0], cp_rank=cp[1], CP=True)
        return
    tile_q, tile_cache, tile_table, tile_args = index_q, index_cache, block_table, args
    stage = launches.find("stage_nvfp4")
    if stage is not None:
        tile_q, tile_cache, tile_table = _stage_nvfp4(stage, launches.sizes["staged_pages"],
                                                      index_q, index_cache, cu_seqlens_q,
                                                      seq_lens, block_table)
        tile_args = _triton_args(tile_q, tile_cache, cu_seqlens_q, seq_lens, tile_table, scores,
                                 width)
    aligned = tile_q.data_ptr() % 16 == 0 and tile_cache.data_ptr() % 16 == 0
    for launch in launches:
        if launch.kernel == "scores_request":
            launch.run(_block_scores_kernel, *args)
        elif launch.kernel == "scores_request_nvfp4":
            from .scores_nvfp4 import _nvfp4_request_kernel
            launch.run(_nvfp4_request_kernel, index_q, index_cache, cu_seqlens_q, seq_lens,
                       block_table, scores, seq_lens.shape[0], index_q.shape[0],
                       index_cache.shape[0], width, *index_q.stride(), index_cache.stride(0),
                       *block_table.stride(), *scores.stride())
        elif launch.kernel == "scores_tile":
            launch.run(_block_scores_kernel, *tile_args)
        elif launch.kernel == "scores_tile_ws" and aligned:
            _run_ws(launch, tile_q, tile_cache, cu_seqlens_q, seq_lens, tile_table, scores)
        elif launch.kernel == "scores_tile_unaligned" and not aligned:
            launch.run(_block_scores_kernel, *tile_args)


def _triton_args(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, scores,
                 width) -> tuple:
    """scores.py's kernel arguments for these tensors (width: see _run_scores)."""
    return (index_q, index_cache, cu_seqlens_q, seq_lens, block_table, scores, seq_lens.shape[0],
            index_q.shape[0], index_cache.shape[0], width, *index_q.stride(),
            *index_cache.stride(), *block_table.stride(), *scores.stride())


def _stage_nvfp4(launch, pages, index_q, index_cache, cu_seqlens_q, seq_lens, block_table):
    """The staged NVFP4 form's inputs of the tile launch (stage.py): (the query in the staging
    dtype, the staging cache [pages, 128, 128], the remapped table [R, max_blocks] int32).
    An fp8 query is converted to a contiguous fp16 copy (exact; the plan counted on its
    rows being TMA-describable); a 16-bit one is used as it is."""
    from .stage import _stage_nvfp4_kernel
    dtype = stage_dtype(index_q.dtype)
    tile_q = index_q if index_q.dtype == dtype else index_q.to(
        dtype, memory_format=torch.contiguous_format)
    num_requests, width = block_table.shape
    staged = torch.empty((pages, index_cache.shape[1], index_q.shape[2]), dtype=dtype,
                         device=index_q.device)
    table = torch.empty((num_requests, width), dtype=torch.int32, device=index_q.device)
    launch.run(_stage_nvfp4_kernel, index_cache, cu_seqlens_q, seq_lens, block_table, staged,
               table, num_requests, width, index_cache.shape[0], index_cache.stride(0),
               *block_table.stride())
    return tile_q, staged, table


def _ws_descriptors(index_q, index_cache) -> tuple:
    """The Gluon tile launch's TMA descriptors: q as [T * H, DI] rows in 64-row boxes, the
    cache as [pages * BLOCK, DI] rows in one-block boxes."""
    from .scores_ws import WG_ROWS
    num_tokens, num_heads, head_dim = index_q.shape
    rows_q, rows_k = num_tokens * num_heads, index_cache.shape[0] * index_cache.shape[1]
    return (tma_descriptor(index_q, (rows_q, head_dim), (head_dim, 1),
                           (WG_ROWS.value, head_dim)),
            tma_descriptor(index_cache, (rows_k, head_dim), (head_dim, 1),
                           (index_cache.shape[1], head_dim)))


def _run_ws(launch, index_q, index_cache, cu_seqlens_q, seq_lens, block_table, scores) -> None:
    """The Gluon tile launch (scores_ws.py)."""
    from .scores_ws import _block_scores_ws_kernel
    launch.run(_block_scores_ws_kernel, *_ws_descriptors(index_q, index_cache), cu_seqlens_q,
               seq_lens, block_table, scores, seq_lens.shape[0], index_q.shape[0],
               index_cache.shape[0], block_table.shape[1], *block_table.stride(),
               *scores.stride())


def _run_selection(launches: LaunchPlan, scores, cu_seqlens_q, seq_lens, out) -> None:
    """The plan's selection launches, with the temporary buffers its sizes name."""
    num_tokens, num_heads, max_blocks = scores.shape
    sizes = launches.sizes
    device = scores.device
    num_requests = seq_lens.shape[0]
    gmax = cand = scratch = None
    for launch in launches:
        if launch.kernel == "select_short_rows":
            from .select_rows import _short_rows_topk_kernel
            launch.run(_short_rows_topk_kernel, scores, cu_seqlens_q, seq_lens, out,
                       num_requests, num_tokens * num_heads, max_blocks, *scores.stride(),
                       *out.stride())
        elif launch.kernel == "select_group_max":
            gmax = torch.empty((num_tokens, num_heads, sizes["groups"]), dtype=torch.int32,
                               device=device)
            launch.run(_group_max_kernel, scores, cu_seqlens_q, seq_lens, gmax, num_requests,
                       max_blocks,
                       *scores.stride(), *gmax.stride()[:2])
        elif launch.kernel == "select_group_bound":
            scratch = torch.empty((num_tokens * num_heads, sizes["group_scratch"]),
                                  dtype=torch.int64, device=device)
            launch.run(_group_bound_select_kernel, scores, cu_seqlens_q, seq_lens, gmax, out,
                       scratch, num_requests, max_blocks, *scores.stride(), *gmax.stride()[:2],
                       *out.stride())
        elif launch.kernel == "select_segments":
            segments = sizes["segments"]
            cand = out if segments == 1 else torch.empty(
                (num_tokens, num_heads, segments, sizes["candidates"]), dtype=torch.int64,
                device=device)
            # (without scratch slots the kernel never touches the pointer: the candidates stand
            # in, and the call saves an allocation, ~3 µs of host time)
            scratch = cand if not sizes["scratch"] else torch.empty(
                (num_tokens, num_heads, segments, sizes["scratch"]), dtype=torch.int64,
                device=device)
            launch.run(_segment_topk_kernel, scores, cu_seqlens_q, seq_lens, out, cand, scratch,
                       num_requests, max_blocks, segments, *scores.stride(), *out.stride())
        elif launch.kernel == "select_merge":
            launch.run(_merge_topk_kernel, cand, cu_seqlens_q, seq_lens, out, num_requests,
                       max_blocks, sizes["segments"], *out.stride())


def launch_select(scores, cu_seqlens_q, seq_lens, out, *, topk, init_blocks, local_blocks,
                  block_size, config: IndexerConfig | None = None) -> None:
    """The selection alone: top-k per (token, head) row of `scores` ([T, H, max_blocks] fp32,
    as block_scores writes them) into `out` (tests and benchmarks; no argument checks)."""
    config = _check_config(config)
    num_tokens, num_heads, max_blocks = scores.shape
    key = _call_key("select_only", scores, scores, cu_seqlens_q, seq_lens, scores, out,
                    block_size, topk, init_blocks, local_blocks, config)
    launches = _PLANS.get(key)
    if launches is None:
        shape = IndexerShape(num_tokens=num_tokens, num_heads=num_heads, head_dim=0,
                             num_requests=seq_lens.shape[0], max_blocks=max_blocks,
                             block_size=block_size, q_dtype=scores.dtype,
                             cache_dtype=scores.dtype, topk=topk, init_blocks=init_blocks,
                             local_blocks=local_blocks)
        launches = selection_plan(shape, DeviceFacts.of(scores.device), config)
        _PLANS.put(key, launches)
    _run_selection(launches, scores, cu_seqlens_q, seq_lens, out)


@on_tensor_device
def block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, block_size=128,
                 out=None, max_q_len=None, config: IndexerConfig | None = None):
    """S[t, h, b] = max over keys j <= p of block b of dot(index_q[t, h], key[j]), fp32
    (docs/spec.md, "Block score").

    Args:
        index_q: [T, H, Di] bf16/fp16/fp8 e4m3 (fp32 too), any strides.
        index_cache: [P, B, Di] of the same dtype, or fp8 e4m3 under a 16-bit query.
        cu_seqlens_q: int32 [R+1]; seq_lens: int32 [R]; block_table: int32 [R, max_blocks].
        out: optional fp32 [T, H, max_blocks], any strides, written in place.
        max_q_len: optional host int, the engine's bound on every request's q_len (as
            FlashInfer's max_seqlen_q). At most 16 (decode, speculative verify), a step of more
            than 16 tokens runs one launch instead of two. A speed hint only: were a request
            longer, its scores would still be exact (computed on the decode path, slowly).
            Without it, a step of one request and more than 16 tokens runs the prefill (tile)
            launch alone, right for a prefill chunk and slower for one decode or verify
            request padded past 16 tokens, which the hint keeps on the decode path.
        config: the launch knobs (plan.py's IndexerConfig; None: DEFAULT).

    Returns:
        fp32 [T, H, max_blocks], -inf past each token's causal blocks and for padding tokens.
        Metadata values are not checked (that would synchronise): an entry of block_table
        outside [0, P) reads nothing, and a malformed step or request is padding (docs/spec.md,
        "Bounds"; `openmsa.validate_batch` reports them when debugging).
    """
    config = _check_config(config)
    if not use_kernels(index_q):
        return reference.block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                      block_size=block_size, out=out, max_q_len=max_q_len)
    key = _call_key("scores", index_q, index_cache, cu_seqlens_q, seq_lens, block_table, out,
                    block_size, max_q_len, config)
    launches = _PLANS.get(key)
    if launches is None:
        check_indexer_args(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                           block_size=block_size, out=out, out_width=None,
                           out_dtype=torch.float32, max_q_len=max_q_len)
        _raise_if_unsupported(index_q, index_cache, block_size, None)
        launches = plan(_shape(index_q, index_cache, seq_lens, block_table, block_size,
                               max_q_len), DeviceFacts.of(index_q.device), config)
        _PLANS.put(key, launches)
    if out is None:
        out = torch.empty((*index_q.shape[:2], block_table.shape[1]), dtype=torch.float32,
                          device=index_q.device)
    out.fill_(float("-inf"))
    _run_scores(launches, index_q, index_cache, cu_seqlens_q, seq_lens, block_table, out)
    return out


def _local_scores_kernels(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, cp_size,
                          cp_rank, block_size, width, max_q_len, config):
    """cp.local_block_scores on the kernel path: the scoring launches over the strided view
    block_table[:, cp_rank::cp_size] (zero-copy), positions mapped into the rank's local key
    space in the kernel (scores.py, CP)."""
    config = _check_config(config)
    view = block_table[:, cp_rank::cp_size]
    scores = torch.empty((*index_q.shape[:2], width), dtype=torch.float32, device=index_q.device)
    if view.shape[1] == 0:
        return scores
    # the view's width does not fix the scores' width (two tables of widths 2w - 1 + r and
    # 2w + r, r >= 1, give views of one width): both are in the key
    key = _call_key("scores_cp", index_q, index_cache, cu_seqlens_q, seq_lens, view, None,
                    block_size, max_q_len, config, width, block_table.shape[1])
    launches = _PLANS.get(key)
    if launches is None:
        _raise_if_unsupported(index_q, index_cache, block_size, None)
        # the Gluon launches and the staged NVFP4 form do not map positions: a CP shape's plan
        # takes the Triton forms (plan.py)
        shape = dataclasses.replace(_shape(index_q, index_cache, seq_lens, view, block_size,
                                           max_q_len), tma_rows=False, cp=True)
        launches = plan(shape, DeviceFacts.of(index_q.device), config)
        _PLANS.put(key, launches)
    _run_scores(launches, index_q, index_cache, cu_seqlens_q, seq_lens, view, scores,
                cp=(cp_size, cp_rank), width=block_table.shape[1])
    return scores


@on_tensor_device
def select_blocks(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, topk=16,
                  init_blocks=0, local_blocks=1, block_size=128, out=None, max_q_len=None,
                  config: IndexerConfig | None = None, cp_group=None):
    """The `topk` best blocks per (token, index head), forced init/local blocks included
    (docs/spec.md, "Selection: forced blocks and the tie rule").

    Args: as `block_scores` (max_q_len and config included), plus the selection rule (topk,
        init_blocks, local_blocks) and out: optional int32 [T, H, topk], any strides (e.g. a
        transposed [H, T, K] buffer).

    Returns:
        int32 [T, H, topk]: ascending block ids, -1 padded; ties go to the lower block, NaN
        scores rank as -inf; padding tokens get a row of -1. No host synchronisation on the
        kernel path (CUDA-graph safe for a fixed T, R and block-table width).

    Temporary device memory on the kernel path: the fp32 scores, T * H * max_blocks * 4 bytes
    (an 8K chunk after 1M tokens at 4 heads: 1 GB), plus, for launches of many long rows, a
    scratch row of 64 int64 per (token, head, 1024-block segment) (134 MB there) and, for rows
    of several segments, K int64 candidates per segment.

    Context parallelism: with `cp_group` (a torch.distributed process group of W ranks, NCCL on
    GPUs, gloo on CPU), rank r scores only the logical blocks b % W == r of every request, for
    every head of the index_q it is given (each rank passes the same index_q, metadata and
    selection arguments), reading block_table only at those blocks: a sharded index cache may
    leave -1 (and no page) at the others. The ranks exchange their best topk (score, block)
    candidates per (token, head) in one all_gather_into_tensor of T * H * topk int64, and every
    rank returns the whole selection, bit-identical to cp_group=None on one device (ops/indexer/
    cp.py, docs/spec.md "Context-parallel selection"). No host sync; with NCCL the collective is
    captured by CUDA graphs. Temporary memory: the local scores, T * H * ceil(max_blocks / W) * 4
    bytes, their int64 keys (twice that) and W * T * H * topk int64 candidates.
    """
    config = _check_config(config)
    if cp_group is not None:
        # the checks once per call key, as on the one-device path (the plans are cp.py's own)
        key = _call_key("select_cp", index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                        out, block_size, max_q_len, topk, init_blocks, local_blocks, config,
                        id(cp_group))
        if _PLANS.get(key) is None:
            check_process_group("cp_group", cp_group)
            check_select_args(topk, init_blocks, local_blocks)
            check_indexer_args(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                               block_size=block_size, out=out, out_width=topk,
                               out_dtype=torch.int32, max_q_len=max_q_len)
            if use_kernels(index_q):
                # the merge sorts W * topk candidates in one program: the kernels' topk bound
                _raise_if_unsupported(index_q, index_cache, block_size, topk)
            _PLANS.put(key, LaunchPlan())
        from .cp import select_blocks_cp
        return select_blocks_cp(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                cp_group=cp_group, topk=topk, init_blocks=init_blocks,
                                local_blocks=local_blocks, block_size=block_size, out=out,
                                max_q_len=max_q_len, config=config)
    if not use_kernels(index_q):
        return reference.select_blocks(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                       topk=topk, init_blocks=init_blocks,
                                       local_blocks=local_blocks, block_size=block_size, out=out,
                                       max_q_len=max_q_len)
    key = _call_key("select", index_q, index_cache, cu_seqlens_q, seq_lens, block_table, out,
                    block_size, max_q_len, topk, init_blocks, local_blocks, config)
    launches = _PLANS.get(key)
    if launches is None:
        check_select_args(topk, init_blocks, local_blocks)
        check_indexer_args(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                           block_size=block_size, out=out, out_width=topk,
                           out_dtype=torch.int32, max_q_len=max_q_len)
        _raise_if_unsupported(index_q, index_cache, block_size, topk)
        launches = plan(_shape(index_q, index_cache, seq_lens, block_table, block_size,
                               max_q_len, topk, init_blocks, local_blocks),
                        DeviceFacts.of(index_q.device), config)
        _PLANS.put(key, launches)
    num_tokens, num_heads, _ = index_q.shape
    if out is None:
        out = torch.empty((num_tokens, num_heads, topk), dtype=torch.int32,
                          device=index_q.device)
    # only blocks below each token's causal count are read back, so no -inf fill is needed
    scores = torch.empty((num_tokens, num_heads, block_table.shape[1]), dtype=torch.float32,
                         device=index_q.device)
    _run_scores(launches, index_q, index_cache, cu_seqlens_q, seq_lens, block_table, scores)
    _run_selection(launches, scores, cu_seqlens_q, seq_lens, out)
    return out


# launch plans by call key (_call_key)
_PLANS = PlanCache()


def _call_key(op, index_q, index_cache, cu_seqlens_q, seq_lens, block_table, out, *values):
    """Everything the checks and the plan read: the tensors' shapes, strides, dtypes and devices
    (the device's facts follow from it), and the other arguments, the config among them."""
    return call_key((index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                     index_q if out is None else out), (op, out is None, *values))
