# SPDX-License-Identifier: Apache-2.0
"""Public index-branch ops: check the arguments, get the step's launch plan (plan.py, cached by
call key), run it: the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1), or the reference
(CPU). The context-parallel selection's kernel path is here too (the rule and the exchange:
cp.py; its kernels: kernels/cp.py)."""

from __future__ import annotations

import torch

from ..._checks import check_cp_shape, check_process_group
from ..._dispatch import on_tensor_device, use_kernels
from ...nvfp4 import ALIGN as NVFP4_ALIGN
from ...nvfp4 import check_nvfp4_cache, is_nvfp4_cache
from ...support import indexer_unsupported_reason
from ..cache.api import fused_prepare, prepare_outputs, prepare_plan
from ..cache.geometry import projection_widths
from ..common.launch import (PlanCache, call_key, launch_planned, scale_args, scale_key,
                             tma_descriptor)
from ..common.plan import DeviceFacts, LaunchPlan, config_or_default
from . import reference
from .checks import check_indexer_args, check_select_args
from .cp import exchange_candidates
from .geometry import GLUON_WG_ROWS
from .kernels.cp import _local_keys_kernel, _merge_kernel
from .kernels.scores import _block_scores_kernel, _prepare_scores_kernel
from .kernels.select import (_group_bound_select_kernel, _group_max_kernel, _merge_topk_kernel,
                             _segment_topk_kernel)
from .plan import (DEFAULT, IndexerConfig, IndexerShape, cp_local_keys, cp_merge, cp_plan,
                   cp_share, plan, prepared_plan, selection_plan, stage_dtype)

__all__ = ["block_scores", "select_blocks", "prepare_and_select"]


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


class _ScoreStep:
    """The tensors a step's scoring launches read. The prefill launches read the `prefill_*`
    ones: the step's own, or, after a staging launch ("stage_nvfp4", the staged NVFP4 form),
    the query in the staging dtype, the 16-bit staging cache and its remapped table; the decode
    launch reads the NVFP4 pages as ever."""

    __slots__ = ("index_q", "index_cache", "cu_seqlens_q", "seq_lens", "block_table", "scores",
                 "width", "args", "prefill_q", "prefill_cache", "prefill_table", "prefill_args",
                 "staged_pages", "_aligned")

    def __init__(self, index_q, index_cache, cu_seqlens_q, seq_lens, block_table, scores, width,
                 staged_pages=0):
        self.index_q, self.index_cache, self.scores = index_q, index_cache, scores
        self.cu_seqlens_q, self.seq_lens, self.block_table = cu_seqlens_q, seq_lens, block_table
        self.width, self.staged_pages = width, staged_pages
        self.args = _triton_args(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                 scores, width)
        self.prefill_q, self.prefill_cache, self.prefill_table = index_q, index_cache, block_table
        self.prefill_args = self.args
        self._aligned = None

    @property
    def aligned(self) -> bool:
        """Whether the prefill launch's query and cache bases are 16-byte aligned (what TMA
        takes): the Gluon prefill launch runs, else its Triton form."""
        if self._aligned is None:
            self._aligned = (self.prefill_q.data_ptr() % 16 == 0
                             and self.prefill_cache.data_ptr() % 16 == 0)
        return self._aligned


def _run_scores(launches: LaunchPlan, index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                scores, cp: tuple[int, int] | None = None, width: int | None = None) -> None:
    """The plan's scoring launches (its selection launches are _run_selection's). The Gluon
    prefill launch ("scores_prefill_gluon") is planned with its Triton form
    ("scores_prefill_unaligned") beside it, and exactly one of them runs: the Gluon one when
    both index_q's and index_cache's base addresses are 16-byte aligned (what TMA takes), the
    Triton one otherwise. `width`: the whole block table's (a context-parallel rank's
    block_table is a strided view of it), which bounds a request's blocks (docs/spec.md,
    "Bounds"). cp: a context-parallel rank's (size, rank), whose plan (plan.cp_share) has the
    Triton launches only."""
    if is_nvfp4_cache(index_cache) and index_cache.data_ptr() % NVFP4_ALIGN:
        # the plan's key has no address: a misaligned cache of a cached shape is refused here,
        # by name, rather than faulting in the kernel's 32-bit code loads
        check_nvfp4_cache("index_cache", index_cache)
    width = block_table.shape[1] if width is None else width
    step = _ScoreStep(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, scores, width,
                      launches.sizes.get("staged_pages", 0))
    runners = _SCORE_RUNNERS if cp is None else _CP_SCORE_RUNNERS
    for launch in launches:
        if launch.kernel not in _SELECT_RUNNERS and launch.kernel not in _CP_LAUNCHES:
            _runner(runners, launch.kernel)(launch, step, cp)


def _runner(table: dict, kernel: str):
    """The runner of a planned launch; a launch name the table does not know is an error (a
    plan and its runners out of step), never skipped."""
    runner = table.get(kernel)
    if runner is None:
        raise ValueError(f"openmsa indexer: no runner for a launch named {kernel!r} here "
                         f"(runners: {sorted(table)})")
    return runner


def _triton_args(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, scores,
                 width) -> tuple:
    """kernels/scores.py's kernel arguments for these tensors (width: see _run_scores)."""
    return (index_q, index_cache, cu_seqlens_q, seq_lens, block_table, scores, seq_lens.shape[0],
            index_q.shape[0], index_cache.shape[0], width, *index_q.stride(),
            *index_cache.stride(), *block_table.stride(), *scores.stride())


def _run_decode(launch, step: _ScoreStep, cp) -> None:
    launch.run(_block_scores_kernel, *step.args)


def _run_decode_nvfp4(launch, step: _ScoreStep, cp) -> None:
    from .kernels.scores_nvfp4 import _nvfp4_decode_kernel
    index_q, index_cache, block_table, scores = (step.index_q, step.index_cache,
                                                 step.block_table, step.scores)
    launch.run(_nvfp4_decode_kernel, index_q, index_cache, step.cu_seqlens_q, step.seq_lens,
               block_table, scores, step.seq_lens.shape[0], index_q.shape[0],
               index_cache.shape[0], step.width, *index_q.stride(), index_cache.stride(0),
               *block_table.stride(), *scores.stride())


def _run_prefill(launch, step: _ScoreStep, cp) -> None:
    launch.run(_block_scores_kernel, *step.prefill_args)


def _run_prefill_gluon(launch, step: _ScoreStep, cp) -> None:
    """The Gluon prefill launch (kernels/scores_gluon.py), when TMA takes the bases."""
    if not step.aligned:
        return
    from .kernels.scores_gluon import _block_scores_gluon_kernel
    index_q, index_cache, block_table = step.prefill_q, step.prefill_cache, step.prefill_table
    launch.run(_block_scores_gluon_kernel, *_gluon_descriptors(index_q, index_cache),
               step.cu_seqlens_q, step.seq_lens, block_table, step.scores,
               step.seq_lens.shape[0], index_q.shape[0], index_cache.shape[0],
               block_table.shape[1], *block_table.stride(), *step.scores.stride())


def _run_prefill_unaligned(launch, step: _ScoreStep, cp) -> None:
    """The Gluon prefill launch's Triton form, when TMA cannot take a base."""
    if not step.aligned:
        launch.run(_block_scores_kernel, *step.prefill_args)


def _run_stage_nvfp4(launch, step: _ScoreStep, cp) -> None:
    """The staged NVFP4 form's staging launch (kernels/stage.py): the prefill launches then
    read (the query in the staging dtype, the staging cache [pages, 128, 128], the remapped
    table [R, max_blocks] int32). An fp8 query is converted to a contiguous fp16 copy (exact;
    the plan counted on its rows being TMA-describable); a 16-bit one is used as it is."""
    step.prefill_q, step.prefill_cache, step.prefill_table = _stage_nvfp4(
        launch, step.staged_pages, step.index_q, step.index_cache, step.cu_seqlens_q,
        step.seq_lens, step.block_table)
    step.prefill_args = _triton_args(step.prefill_q, step.prefill_cache, step.cu_seqlens_q,
                                     step.seq_lens, step.prefill_table, step.scores, step.width)


def _stage_nvfp4(launch, pages, index_q, index_cache, cu_seqlens_q, seq_lens, block_table):
    """The staging launch over `pages` staging pages: (the prefill launch's query, staging
    cache and remapped table; see _run_stage_nvfp4)."""
    from .kernels.stage import _stage_nvfp4_kernel
    dtype = stage_dtype(index_q.dtype)
    prefill_q = index_q if index_q.dtype == dtype else index_q.to(
        dtype, memory_format=torch.contiguous_format)
    num_requests, width = block_table.shape
    staged = torch.empty((pages, index_cache.shape[1], index_q.shape[2]), dtype=dtype,
                         device=index_q.device)
    table = torch.empty((num_requests, width), dtype=torch.int32, device=index_q.device)
    launch.run(_stage_nvfp4_kernel, index_cache, cu_seqlens_q, seq_lens, block_table, staged,
               table, num_requests, width, index_cache.shape[0], index_cache.stride(0),
               *block_table.stride())
    return prefill_q, staged, table


def _run_cp_scores(launch, step: _ScoreStep, cp) -> None:
    """A context-parallel rank's scoring launch (kernels/scores.py with CP: positions mapped
    into the rank's local key space)."""
    launch_planned(_block_scores_kernel, (launch.key, "cp", *cp), launch.grid, *step.args,
                   **launch.params, cp_size=cp[0], cp_rank=cp[1], CP=True)


_SCORE_RUNNERS = {"scores_decode": _run_decode, "scores_decode_nvfp4": _run_decode_nvfp4,
                  "scores_prefill": _run_prefill, "scores_prefill_gluon": _run_prefill_gluon,
                  "scores_prefill_unaligned": _run_prefill_unaligned,
                  "stage_nvfp4": _run_stage_nvfp4}
_CP_SCORE_RUNNERS = {"scores_decode": _run_cp_scores, "scores_prefill": _run_cp_scores}
# a context-parallel plan's packing and merge, which _select_blocks_cp runs around the exchange
_CP_LAUNCHES = frozenset(("cp_local_keys", "cp_merge"))


def _gluon_descriptors(index_q, index_cache) -> tuple:
    """The Gluon prefill launch's TMA descriptors: q as [T * H, DI] rows in 64-row boxes, the
    cache as [pages * BLOCK, DI] rows in one-block boxes."""
    num_tokens, num_heads, head_dim = index_q.shape
    rows_q, rows_k = num_tokens * num_heads, index_cache.shape[0] * index_cache.shape[1]
    return (tma_descriptor(index_q, (rows_q, head_dim), (head_dim, 1),
                           (GLUON_WG_ROWS, head_dim)),
            tma_descriptor(index_cache, (rows_k, head_dim), (head_dim, 1),
                           (index_cache.shape[1], head_dim)))


class _SelectStep:
    """The tensors a step's selection launches read, and the temporary buffers they share
    (the plan's sizes name them)."""

    __slots__ = ("scores", "cu_seqlens_q", "seq_lens", "out", "sizes", "gmax", "cand")

    def __init__(self, scores, cu_seqlens_q, seq_lens, out, sizes):
        self.scores, self.cu_seqlens_q, self.seq_lens = scores, cu_seqlens_q, seq_lens
        self.out = out
        self.sizes = sizes
        self.gmax = self.cand = None


def _run_selection(launches: LaunchPlan, scores, cu_seqlens_q, seq_lens, out) -> None:
    """The plan's selection launches (its scoring launches are _run_scores'), with the
    temporary buffers its sizes name."""
    step = _SelectStep(scores, cu_seqlens_q, seq_lens, out, launches.sizes)
    for launch in launches:
        if launch.kernel not in _SCORE_RUNNERS and launch.kernel not in _CP_LAUNCHES:
            _runner(_SELECT_RUNNERS, launch.kernel)(launch, step)


def _run_short_rows(launch, s: _SelectStep) -> None:
    from .kernels.select_rows import _short_rows_topk_kernel
    num_tokens, num_heads, max_blocks = s.scores.shape
    launch.run(_short_rows_topk_kernel, s.scores, s.cu_seqlens_q, s.seq_lens, s.out,
               s.seq_lens.shape[0], num_tokens * num_heads, max_blocks, *s.scores.stride(),
               *s.out.stride())


def _run_group_max(launch, s: _SelectStep) -> None:
    num_tokens, num_heads, max_blocks = s.scores.shape
    s.gmax = torch.empty((num_tokens, num_heads, s.sizes["groups"]), dtype=torch.int32,
                         device=s.scores.device)
    launch.run(_group_max_kernel, s.scores, s.cu_seqlens_q, s.seq_lens, s.gmax,
               s.seq_lens.shape[0], max_blocks, *s.scores.stride(), *s.gmax.stride()[:2])


def _run_group_bound(launch, s: _SelectStep) -> None:
    num_tokens, num_heads, max_blocks = s.scores.shape
    scratch = torch.empty((num_tokens * num_heads, s.sizes["group_scratch"]), dtype=torch.int64,
                          device=s.scores.device)
    launch.run(_group_bound_select_kernel, s.scores, s.cu_seqlens_q, s.seq_lens, s.gmax, s.out,
               scratch, s.seq_lens.shape[0], max_blocks, *s.scores.stride(),
               *s.gmax.stride()[:2], *s.out.stride())


def _run_segments(launch, s: _SelectStep) -> None:
    num_tokens, num_heads, max_blocks = s.scores.shape
    segments, device = s.sizes["segments"], s.scores.device
    s.cand = s.out if segments == 1 else torch.empty(
        (num_tokens, num_heads, segments, s.sizes["candidates"]), dtype=torch.int64,
        device=device)
    # (without scratch slots the kernel never touches the pointer: the candidates stand in,
    # and the call saves an allocation, ~3 µs of host time)
    scratch = s.cand if not s.sizes["scratch"] else torch.empty(
        (num_tokens, num_heads, segments, s.sizes["scratch"]), dtype=torch.int64, device=device)
    launch.run(_segment_topk_kernel, s.scores, s.cu_seqlens_q, s.seq_lens, s.out, s.cand,
               scratch, s.seq_lens.shape[0], max_blocks, segments, *s.scores.stride(),
               *s.out.stride())


def _run_select_merge(launch, s: _SelectStep) -> None:
    launch.run(_merge_topk_kernel, s.cand, s.cu_seqlens_q, s.seq_lens, s.out,
               s.seq_lens.shape[0], s.scores.shape[2], s.sizes["segments"], *s.out.stride())


_SELECT_RUNNERS = {"select_short_rows": _run_short_rows, "select_group_max": _run_group_max,
                   "select_group_bound": _run_group_bound, "select_segments": _run_segments,
                   "select_merge": _run_select_merge}


def launch_select(scores, cu_seqlens_q, seq_lens, out, *, topk, init_blocks, local_blocks,
                  block_size, config: IndexerConfig | None = None) -> None:
    """The selection alone: top-k per (token, head) row of `scores` ([T, H, max_blocks] fp32,
    as block_scores writes them) into `out` (tests and benchmarks; no argument checks)."""
    config = _check_config(config)
    num_tokens, num_heads, max_blocks = scores.shape
    key = _call_key("select_only", scores, scores, cu_seqlens_q, seq_lens, scores, out,
                    block_size, topk, init_blocks, local_blocks, config)

    def make():
        shape = IndexerShape(num_tokens=num_tokens, num_heads=num_heads, head_dim=0,
                             num_requests=seq_lens.shape[0], max_blocks=max_blocks,
                             block_size=block_size, q_dtype=scores.dtype,
                             cache_dtype=scores.dtype, topk=topk, init_blocks=init_blocks,
                             local_blocks=local_blocks)
        return selection_plan(shape, DeviceFacts.of(scores.device), config)
    _run_selection(_PLANS.get_or_plan(key, make), scores, cu_seqlens_q, seq_lens, out)


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
            Without it, a step of one request and more than 16 tokens runs the prefill
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

    def make():
        check_indexer_args(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                           block_size=block_size, out=out, out_width=None,
                           out_dtype=torch.float32, max_q_len=max_q_len)
        _raise_if_unsupported(index_q, index_cache, block_size, None)
        return plan(_shape(index_q, index_cache, seq_lens, block_table, block_size, max_q_len),
                    DeviceFacts.of(index_q.device), config)
    launches = _PLANS.get_or_plan(key, make)
    if out is None:
        out = torch.empty((*index_q.shape[:2], block_table.shape[1]), dtype=torch.float32,
                          device=index_q.device)
    out.fill_(float("-inf"))
    _run_scores(launches, index_q, index_cache, cu_seqlens_q, seq_lens, block_table, out)
    return out


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
        return _select_blocks_cp(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
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

    def make():
        shape = _checked_selection_shape(index_q, index_cache, cu_seqlens_q, seq_lens,
                                         block_table, topk, init_blocks, local_blocks,
                                         block_size, out, max_q_len)
        return plan(shape, DeviceFacts.of(index_q.device), config)
    launches = _PLANS.get_or_plan(key, make)
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


@on_tensor_device
def prepare_and_select(qkv, positions, config, q_norm_weight, k_norm_weight,
                       index_q_norm_weight, index_k_norm_weight, k_cache, v_cache, slot_mapping,
                       index_cache, index_slot_mapping, cu_seqlens_q, seq_lens, block_table, *,
                       max_q_len=None, k_scale=None, v_scale=None, q_out=None, index_q_out=None,
                       out=None, cache_config=None, indexer_config: IndexerConfig | None = None):
    """`fused_prepare` then `select_blocks` over the index query it prepared, with the selection
    rule of `config` (the rank's MSAConfig: topk_blocks, init_blocks, local_blocks, block_size):
    a sparse layer's step up to its attention, as MSAAttention runs it.

    Args: fused_prepare's (qkv ... index_slot_mapping, k_scale, v_scale, q_out, index_q_out,
        cache_config), then select_blocks' (cu_seqlens_q, seq_lens, block_table: the index
        cache's table, max_q_len, out; indexer_config is its `config`).

    Returns:
        (q, index_q, indices), each as the two ops return them, bit for bit (the one exception:
        the scores the selection reads are computed from an index query and index keys
        prepared inside the scoring launch, in the same fp32 arithmetic as the preparation's).

    On the kernel path a decode step (no more tokens than requests, or max_q_len 1; not into
    NVFP4 pages) of a short table (IndexerConfig.decode.prepare_max_blocks columns) runs the
    preparation inside the scoring launch: one dependent launch fewer (docs/performance.md).
    Those scoring programs prepare their request's index query from the projection row
    themselves, and a block into whose page the step writes an index key is scored again over
    the key as written, unless no row's selection reads its score (forced, as a decode token's
    own block is), so the scores are those of the preparation running first whatever the slots.
    Any other step runs the two ops one after the other.
    """
    if not use_kernels(qkv):
        return reference.prepare_and_select(
            qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
            index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache, index_slot_mapping,
            cu_seqlens_q, seq_lens, block_table, max_q_len=max_q_len, k_scale=k_scale,
            v_scale=v_scale, q_out=q_out, index_q_out=index_q_out, out=out,
            cache_config=cache_config, indexer_config=indexer_config)
    indexer_config = _check_config(indexer_config)
    tensors = (qkv, positions, q_norm_weight, k_norm_weight, index_q_norm_weight,
               index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
               index_slot_mapping, cu_seqlens_q, seq_lens, block_table)
    given = tuple(t for t in (q_out, index_q_out, out) if t is not None)
    key = call_key(tensors + given, ("prepare_select", config, q_out is None,
                                     index_q_out is None, out is None, scale_key(k_scale),
                                     scale_key(v_scale), cache_config, indexer_config,
                                     max_q_len))

    def make():
        prepared = prepare_plan(qkv, positions, config, q_norm_weight, k_norm_weight,
                                index_q_norm_weight, index_k_norm_weight, k_cache, v_cache,
                                slot_mapping, index_cache, index_slot_mapping, k_scale, v_scale,
                                q_out, index_q_out, cache_config)
        # (the index query as the preparation would return it, for the selection's checks)
        _, index_q = prepare_outputs(qkv, config, index_cache, q_out, index_q_out)
        shape = _checked_selection_shape(index_q, index_cache, cu_seqlens_q, seq_lens,
                                         block_table, config.topk_blocks, config.init_blocks,
                                         config.local_blocks, config.block_size, out, max_q_len)
        steps = plan(shape, DeviceFacts.of(qkv.device), indexer_config)
        fused = prepared_plan(steps, prepared.launches[0], shape, indexer_config) \
            if len(prepared.launches) == 1 else None
        return fused, prepared.table

    fused, table = _PLANS.get_or_plan(key, make)
    q, index_q = prepare_outputs(qkv, config, index_cache, q_out, index_q_out)
    if fused is None:
        fused_prepare(qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
                      index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
                      index_slot_mapping, k_scale=k_scale, v_scale=v_scale, q_out=q,
                      index_q_out=index_q, cache_config=cache_config)
        indices = select_blocks(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                topk=config.topk_blocks, init_blocks=config.init_blocks,
                                local_blocks=config.local_blocks, block_size=config.block_size,
                                out=out, max_q_len=max_q_len, config=indexer_config)
        return q, index_q, indices
    num_tokens, num_heads, _ = index_q.shape
    if out is None:
        out = torch.empty((num_tokens, num_heads, config.topk_blocks), dtype=torch.int32,
                          device=qkv.device)
    scores = torch.empty((num_tokens, num_heads, block_table.shape[1]), dtype=torch.float32,
                         device=qkv.device)
    _, ks, vs = scale_args(k_scale, v_scale, qkv.device, qkv)
    widths = projection_widths(config)
    launch = fused.launches[0]
    launch.run(_prepare_scores_kernel, index_cache, cu_seqlens_q, seq_lens, block_table, scores,
               seq_lens.shape[0], num_tokens, index_cache.shape[0], block_table.shape[1],
               block_table.shape[1], *index_cache.stride(), *block_table.stride(),
               *scores.stride(), config.init_blocks, config.local_blocks, config.topk_blocks,
               sum(widths[:3]), sum(widths[:4]),  # the index query's and key's first columns
               qkv, positions, q_norm_weight, k_norm_weight, index_q_norm_weight,
               index_k_norm_weight, table, k_cache, v_cache, slot_mapping, index_slot_mapping,
               ks, vs, q, index_q, float(config.rms_norm_eps), k_cache.shape[0] * k_cache.shape[1],
               index_cache.shape[0] * index_cache.shape[1], *qkv.stride(), *k_cache.stride(),
               *v_cache.stride(), *q.stride(), *index_q.stride())
    _run_selection(LaunchPlan(fused.launches[1:], fused.sizes), scores, cu_seqlens_q, seq_lens,
                   out)
    return q, index_q, out


def _checked_selection_shape(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, topk,
                             init_blocks, local_blocks, block_size, out, max_q_len):
    """A selection call's argument checks (once per call key), then the step's shape."""
    check_select_args(topk, init_blocks, local_blocks)
    check_indexer_args(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                       block_size=block_size, out=out, out_width=topk, out_dtype=torch.int32,
                       max_q_len=max_q_len)
    _raise_if_unsupported(index_q, index_cache, block_size, topk)
    return _shape(index_q, index_cache, seq_lens, block_table, block_size, max_q_len, topk,
                  init_blocks, local_blocks)


def _select_blocks_cp(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, cp_group,
                      topk, init_blocks, local_blocks, block_size, out, max_q_len, config):
    """select_blocks over a context-parallel group: this rank's share scored and packed into
    candidates, every rank's by the exchange (cp.exchange_candidates), merged; the three as
    one cached plan (plan.cp_plan) per call key and (W, rank)."""
    check_process_group("cp_group", cp_group)
    if not use_kernels(index_q):
        return reference.select_blocks(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                       topk=topk, init_blocks=init_blocks,
                                       local_blocks=local_blocks, block_size=block_size, out=out,
                                       max_q_len=max_q_len, cp_group=cp_group)
    import torch.distributed as dist
    world, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    key = _call_key("select_cp", index_q, index_cache, cu_seqlens_q, seq_lens, block_table, out,
                    block_size, max_q_len, topk, init_blocks, local_blocks, config, world, rank)

    def make():
        # (the merge sorts W * topk candidates in one program: the kernels' topk bound holds)
        shape = _checked_selection_shape(index_q, index_cache, cu_seqlens_q, seq_lens,
                                         block_table, topk, init_blocks, local_blocks,
                                         block_size, out, max_q_len)
        return cp_plan(shape, DeviceFacts.of(index_q.device), config, world, rank)
    launches = _PLANS.get_or_plan(key, make)
    sizes = launches.sizes
    scores = _share_scores(launches, index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                           cp_size=world, cp_rank=rank, width=sizes["width"])
    keys, position = _local_keys(launches.find("cp_local_keys"), scores, cu_seqlens_q, seq_lens,
                                 cp_size=world, cp_rank=rank, max_blocks=block_table.shape[1],
                                 topk=topk, init_blocks=init_blocks, local_blocks=local_blocks)
    candidates = exchange_candidates(keys, cp_group) if world > 1 else keys.unsqueeze(2)
    return _merge(launches.find("cp_merge"), candidates, position, topk=topk,
                  init_blocks=init_blocks, local_blocks=local_blocks, out=out)


def _share_scores(launches: LaunchPlan, index_q, index_cache, cu_seqlens_q, seq_lens,
                  block_table, *, cp_size, cp_rank, width) -> torch.Tensor:
    """A context-parallel rank's local scores, fp32 [T, H, width]: the plan's scoring launches
    over the strided view block_table[:, cp_rank::cp_size] (zero-copy), positions mapped into
    the rank's local key space in the kernel (kernels/scores.py, CP)."""
    view = block_table[:, cp_rank::cp_size]
    scores = torch.empty((*index_q.shape[:2], width), dtype=torch.float32, device=index_q.device)
    if view.shape[1] == 0:
        return scores
    _run_scores(launches, index_q, index_cache, cu_seqlens_q, seq_lens, view, scores,
                cp=(cp_size, cp_rank), width=block_table.shape[1])
    return scores


def _local_keys(launch, local_scores, cu_seqlens_q, seq_lens, *, cp_size, cp_rank, max_blocks,
                topk, init_blocks, local_blocks):
    """The "cp_local_keys" launch (None: no tokens), then the best min(topk, width) keys:
    (keys [T, H, min(topk, width)], position [T])."""
    num_tokens, num_heads, width = local_scores.shape
    device = local_scores.device
    keys = torch.empty((num_tokens, num_heads, width), dtype=torch.int64, device=device)
    position = torch.empty(num_tokens, dtype=torch.int32, device=device)
    if launch is not None:
        launch.run(_local_keys_kernel, local_scores, cu_seqlens_q, seq_lens, keys, position,
                   seq_lens.shape[0], num_tokens, width, max_blocks, cp_size, cp_rank,
                   init_blocks, local_blocks, *local_scores.stride(), *keys.stride())
    k = min(topk, width)
    if k < width:
        keys = torch.topk(keys, k, dim=-1, sorted=False).values
    return keys, position


def _merge(launch, candidates, position, *, topk, init_blocks, local_blocks, out=None):
    """The "cp_merge" launch over candidates [T, H, W, k] (any strides) into out [T, H, topk];
    None: no rows, or a table of no columns (no request has a block: the argument checks hold
    the table wide enough for every seq_len), whose rows are all empty."""
    num_tokens, num_heads, _, per_rank = candidates.shape
    if out is None:
        out = torch.empty((num_tokens, num_heads, topk), dtype=torch.int32,
                          device=candidates.device)
    if per_rank == 0:
        out.fill_(-1)
    elif launch is not None:
        launch.run(_merge_kernel, candidates, position, out, candidates.shape[2], per_rank, topk,
                   init_blocks, local_blocks, *candidates.stride(), *out.stride())
    return out


def local_block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, cp_size,
                       cp_rank, block_size=128, max_q_len=None,
                       config: IndexerConfig | None = None) -> torch.Tensor:
    """reference.local_block_scores on the kernel path (tests and benchmarks; the argument
    checks are the caller's): entries past a token's causal blocks are unspecified here."""
    check_cp_shape(cp_size, cp_rank)
    if not use_kernels(index_q):
        return reference.local_block_scores(index_q, index_cache, cu_seqlens_q, seq_lens,
                                            block_table, cp_size=cp_size, cp_rank=cp_rank,
                                            block_size=block_size, max_q_len=max_q_len)
    config = _check_config(config)
    width = -(-block_table.shape[1] // cp_size)
    view = block_table[:, cp_rank::cp_size]
    if view.shape[1] == 0:
        return torch.empty((*index_q.shape[:2], width), dtype=torch.float32,
                           device=index_q.device)
    # the view's width does not fix the scores' width (two tables of widths 2w - 1 + r and
    # 2w + r, r >= 1, give views of one width): both are in the key
    key = _call_key("scores_cp", index_q, index_cache, cu_seqlens_q, seq_lens, view, None,
                    block_size, max_q_len, config, width, block_table.shape[1])

    def make():
        _raise_if_unsupported(index_q, index_cache, block_size, None)
        shape = _shape(index_q, index_cache, seq_lens, block_table, block_size, max_q_len)
        return plan(cp_share(shape, cp_size, cp_rank), DeviceFacts.of(index_q.device), config)
    return _share_scores(_PLANS.get_or_plan(key, make), index_q, index_cache, cu_seqlens_q,
                         seq_lens, block_table, cp_size=cp_size, cp_rank=cp_rank, width=width)


def local_candidates_kernel(local_scores, cu_seqlens_q, seq_lens, *, cp_size, cp_rank,
                            max_blocks, topk, init_blocks, local_blocks, block_size,
                            config: IndexerConfig | None = None):
    """cp.local_candidates on the kernel path: (keys [T, H, min(topk, width)], position [T])."""
    config = _check_config(config)
    num_tokens, num_heads, width = local_scores.shape
    # (the launch follows from the scores' shape, the block size and the config: the other
    # values are the kernel's run-time ints)
    key = call_key((local_scores, cu_seqlens_q, seq_lens),
                   ("cp_local_keys", max_blocks, cp_size, cp_rank, init_blocks, local_blocks,
                    block_size, config))
    launches = _PLANS.get_or_plan(key, lambda: _plan_of(cp_local_keys(
        num_tokens, num_heads, width, block_size, config)))
    return _local_keys(launches.find("cp_local_keys"), local_scores, cu_seqlens_q, seq_lens,
                       cp_size=cp_size, cp_rank=cp_rank, max_blocks=max_blocks, topk=topk,
                       init_blocks=init_blocks, local_blocks=local_blocks)


def merge_candidates_kernel(candidates, position, *, topk, init_blocks, local_blocks,
                            block_size, out=None):
    """cp.merge_candidates on the kernel path, from candidates [T, H, W, k] (any strides)."""
    num_tokens, num_heads, num_ranks, per_rank = candidates.shape
    key = call_key((candidates, position) if out is None else (candidates, position, out),
                   ("cp_merge", topk, init_blocks, local_blocks, block_size))
    launches = _PLANS.get_or_plan(key, lambda: _plan_of(cp_merge(
        num_tokens, num_heads, num_ranks, per_rank, topk, block_size)))
    return _merge(launches.find("cp_merge"), candidates, position, topk=topk,
                  init_blocks=init_blocks, local_blocks=local_blocks, out=out)


def _plan_of(launch) -> LaunchPlan:
    """The plan of one launch, or of none (nothing to launch)."""
    return LaunchPlan(() if launch is None else (launch,))


def rank_candidates(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, cp_size,
                    cp_rank, topk, init_blocks, local_blocks, block_size=128, max_q_len=None,
                    config: IndexerConfig | None = None):
    """reference.rank_candidates on the kernel path (the reference's off it): one rank's
    candidate keys [T, H, min(topk, width)] and the tokens' positions [T] (for the merge)."""
    if not use_kernels(index_q):
        return reference.rank_candidates(index_q, index_cache, cu_seqlens_q, seq_lens,
                                         block_table, cp_size=cp_size, cp_rank=cp_rank,
                                         topk=topk, init_blocks=init_blocks,
                                         local_blocks=local_blocks, block_size=block_size,
                                         max_q_len=max_q_len)
    scores = local_block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                cp_size=cp_size, cp_rank=cp_rank, block_size=block_size,
                                max_q_len=max_q_len, config=config)
    return local_candidates_kernel(scores, cu_seqlens_q, seq_lens, cp_size=cp_size,
                                   cp_rank=cp_rank, max_blocks=block_table.shape[1], topk=topk,
                                   init_blocks=init_blocks, local_blocks=local_blocks,
                                   block_size=block_size, config=config)


# launch plans by call key (_call_key)
_PLANS = PlanCache("indexer")


def _call_key(op, index_q, index_cache, cu_seqlens_q, seq_lens, block_table, out, *values):
    """Everything the checks and the plan read: the tensors' shapes, strides, dtypes and devices
    (the device's facts follow from it), and the other arguments, the config among them."""
    return call_key((index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                     index_q if out is None else out), (op, out is None, *values))
