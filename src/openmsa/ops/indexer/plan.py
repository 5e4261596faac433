# SPDX-License-Identifier: Apache-2.0
"""The index branch's launch plan: which kernels score a step's blocks and select its top-k,
with which grids and constexprs, as a pure function of the step's shape, the device's facts and
an `IndexerConfig`.

Scoring (kernels/scores.py, kernels/scores_gluon.py) is one Triton kernel launched in two forms,
so that no host synchronisation splits the batch:

* "scores_decode", grid (R, splits): the requests of q_len <= SMALL_Q (decode, speculative
  verify), each split's keys read once for all of a request's tokens. Memory-bound. On an NVFP4
  cache on Hopper it is the Gluon kernel of kernels/scores_nvfp4.py ("scores_decode_nvfp4").
* "scores_prefill", grid (token tiles, splits): the long requests (prefill chunks), a tile of
  packed tokens against each block of a split. Compute-bound. On Hopper, where the layouts
  allow TMA, it is the warp-specialised Gluon kernel instead ("scores_prefill_gluon"), planned
  with its Triton form beside it ("scores_prefill_unaligned"): exactly one of the two runs, the
  Gluon one unless a base address is not 16-byte aligned (TMA cannot take it; api.py checks).
  On an NVFP4 cache the staged form first dequantizes the long requests' pages
  ("stage_nvfp4", kernels/stage.py).

Selection (kernels/select.py, kernels/select_rows.py) then takes one of three forms by the shape
of its rows:

* "select_short_rows" (Hopper): many rows of at most `short_rows.max_blocks` blocks, a row in a
  few threads' registers.
* "select_group_max" + "select_group_bound": many rows of at least `group.min_blocks` blocks
  (prefill after a long context): group maxima bound the search.
* "select_segments" (+ "select_merge" when a row has several segments): rows cut into segments
  of one program each, sorted (few programs: decode at small batch) or searched by threshold.

A context-parallel rank's share (`cp_share`) is scored by the Triton launches alone; its
candidates are packed ("cp_local_keys") and, after the exchange, merged ("cp_merge") by
kernels/cp.py (`cp_plan`).

The measurements behind each rule and default are in docs/history/tried.md.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass

import torch

from ..._checks import FP8, FP8_TYPES, HALF
from ...nvfp4 import DTYPE as NVFP4_DTYPE
from ..common.plan import (DeviceFacts, Launch, LaunchPlan, cached_hash, check_form,
                           next_pow2, state_without_hash)
from .geometry import (ANY_Q, DECODE_ROWS, GLUON_CH, GLUON_CONSUMERS, GLUON_WARPS,
                       GLUON_WG_ROWS, GROUP_MAX_KP, MIN_ARANGE, NVFP4_DECODE_WARPS, NVFP4_ROWS,
                       MIN_DOT_K, MIN_DOT_K_FP8, SECTOR_BLOCKS, SHORT_ROWS_MAX_KP, SMALL_Q,
                       WARP)

__all__ = ["IndexerConfig", "DEFAULT", "DecodeForm", "Nvfp4DecodeForm", "PrefillForm",
           "GluonPrefillForm", "StageForm", "SelectForm", "GroupForm", "ShortRowsForm", "CpForm",
           "IndexerShape", "plan", "selection_plan", "selection_layout", "gluon_eligible",
           "nvfp4_decode_eligible", "prepared_plan", "SMALL_Q", "NVFP4_PREFILL_FORMS",
           "stage_dtype", "cp_share", "cp_local_keys", "cp_merge", "cp_plan"]

# the forms of an NVFP4 cache's prefill scoring (IndexerConfig.nvfp4_prefill)
NVFP4_PREFILL_FORMS = ("auto", "inkernel", "staged")


@dataclass(frozen=True)
class DecodeForm:
    """The Triton decode launch (kernels/scores.py, requests of q_len <= SMALL_Q)."""

    # programs per SM its splits aim for (decode/verify at small batch)
    waves: int = 2
    # most blocks per split (long contexts, where splits would exceed the waves); also caps the
    # Gluon NVFP4 decode launch's
    max_bps: int = 64
    warps: int = 4
    stages: int = 3
    # prepare_and_select's fused launch (the preparation inside this launch) runs on decode
    # steps of at most this many table columns: on short scans the saved launch is a large
    # share of the step; on long ones the scoring programs' longer prologue and the registers
    # of the preparation's code cost as much as it saves (docs/performance.md, "Where the time
    # goes")
    prepare_max_blocks: int = 256
    # an NVFP4 cache's (off Hopper, or a bf16 query): a register cap under which 4 programs fit
    # an SM (16 warps, not 12), to hide the dequantization's and the block's barrier chain's
    # latency; ptxas alone takes ~155 and does not spill at 128 (docs/design.md)
    maxnreg_nvfp4: int = 128

    def __post_init__(self):
        check_form(self, pow2=("max_bps",), positive=("waves", "warps", "stages",
                   "maxnreg_nvfp4"))


@dataclass(frozen=True)
class Nvfp4DecodeForm:
    """The Gluon NVFP4 decode launch (kernels/scores_nvfp4.py, Hopper): one-warp programs, each
    walking a split of a request's pages through a ring of half-block stages."""

    # one-warp programs per SM its splits aim for: more and shorter programs than whole waves
    # of the 15 an SM holds, so that SMs whose programs end early take more work and the last
    # wave is short
    programs: int = 64
    # half-block stages of its ring: 3 (14 KB of shared memory a warp) lets 15 warps share an SM
    stages: int = 3
    # most blocks per split; least: a program gathers its rows' query values byte by byte,
    # about a block's work at 16 rows, which 1-block splits would double
    max_bps: int = 32
    min_bps: int = 2
    # the register cap of a pass of 8 rows (15 programs an SM); 16-row passes run uncapped,
    # since they spill under it
    maxnreg_8_rows: int = 112

    def __post_init__(self):
        check_form(self, pow2=("max_bps", "min_bps"),
                   positive=("programs", "stages", "maxnreg_8_rows"))


@dataclass(frozen=True)
class PrefillForm:
    """The Triton prefill launch (kernels/scores.py; prefill chunks off Hopper, or where TMA
    cannot take the layouts)."""

    # (token, head) rows per tile and blocks per split
    rows: int = 128
    bps: int = 32
    # warps, and stages per cache dtype: a 16-bit key tile is twice an fp8 one's bytes, and 2
    # stages on 4 warps fit 2 programs an SM; an NVFP4 cache's (72-byte keys, smaller still)
    # take fp8's
    warps: int = 4
    stages_16: int = 2
    stages_fp8: int = 3
    stages_nvfp4: int = 3
    # most rows per tile with an NVFP4 cache: at 128 rows its dequantized key tile, the dot's
    # result and the score tile spill on 4 warps; 64 fit
    max_rows_nvfp4: int = 64

    def __post_init__(self):
        check_form(self, pow2=("rows", "bps", "max_rows_nvfp4"),
                   positive=("warps", "stages_16", "stages_fp8", "stages_nvfp4"))


@dataclass(frozen=True)
class GluonPrefillForm:
    """The Gluon prefill launch (kernels/scores_gluon.py, Hopper): a TMA producer warp and
    GLUON_CONSUMERS consumer warpgroups per program, one program per SM."""

    # programs per SM the grid is sized to: a program's start idles its SM, so splits are long
    waves: int = 4
    # key buffers of its ring for an fp8 and a 16-bit cache
    stages_fp8: int = 6
    stages_16: int = 3
    # registers per consumer thread and per producer thread (setmaxnreg)
    consumer_regs: int = 112
    producer_regs: int = 24
    # the costs _short_prefill_bps weighs splits with, in block steps of a program's loop: a
    # program's start (three dependent round trips and the queries' load) and a program that
    # finds no block
    start_blocks: int = 4
    empty_blocks: int = 1

    def __post_init__(self):
        check_form(self, positive=("stages_fp8", "stages_16", "consumer_regs",
                   "producer_regs"))


@dataclass(frozen=True)
class StageForm:
    """The staged NVFP4 form's staging launch (kernels/stage.py): programs dequantize whole
    pages (memory-bound)."""

    # most blocks per program, and programs per SM its splits of a request's blocks aim for
    max_bpp: int = 16
    waves: int = 4
    warps: int = 4
    # requests read per step of the long-request count (one vector load of their offsets)
    rank_chunk: int = 128

    def __post_init__(self):
        check_form(self, pow2=("max_bpp", "rank_chunk"), positive=("waves", "warps"))


@dataclass(frozen=True)
class SelectForm:
    """The segment selection (kernels/select.py's _segment_topk_kernel and its merge)."""

    # blocks of a score row per program (rows longer than this are merged by a second launch:
    # contexts past 128K)
    segment: int = 1024
    # below this many programs per SM the launch sorts (decode at small batch), at or above it
    # searches by threshold (prefill, large batches)
    sort_waves: int = 2
    # shorter segments the sort path tries, in order, when a row of many blocks would leave it
    # few programs (TP4 decode, B = 1 at 1M)
    sort_widths: tuple[int, ...] = (256, 512)
    # warps of a sort-path program (few programs: each one's latency is the step's) and of a
    # threshold-path one (one warp per row: the most throughput)
    sort_warps: int = 4
    search_warps: int = 1
    # the threshold path reads a segment in chunks of this many blocks (0: at once), fewer
    # registers per program ...
    chunk: int = 128
    # ... only in launches of at least this many programs per SM (prefill chunks after a long
    # context; a decode step's programs fit at once, and there the chunks' serial loads cost)
    chunk_min_waves: int = 16
    # the threshold path on long segments: its least scratch slots per program (at least
    # 4 * KP) and least groups of a segment (at least 2 * KP)
    scratch_slots: int = 64
    groups: int = 64

    def __post_init__(self):
        check_form(self, pow2=("segment", "sort_widths", "scratch_slots", "groups"),
                   pow2_or_zero=("chunk",), positive=("sort_warps", "search_warps"))


@dataclass(frozen=True)
class GroupForm:
    """The group-bound selection (kernels/select.py's _group_max_kernel and
    _group_bound_select_kernel): group maxima bound the search of long rows."""

    # rows of at least this many blocks on the threshold path take it (prefill after a long
    # context)
    min_blocks: int = 2048
    # blocks per group, groups per group-maxima program, and the search's chunk (blocks)
    size: int = 16
    per_program: int = 64
    chunk: int = 128
    # least scratch slots per row (at least 2 * KP)
    scratch: int = 64
    # warps of the group-maxima and of the bound-search programs
    max_warps: int = 4
    bound_warps: int = 1

    def __post_init__(self):
        check_form(self, pow2=("size", "per_program", "chunk", "scratch"),
                   positive=("max_warps", "bound_warps"))


@dataclass(frozen=True)
class ShortRowsForm:
    """The short-row selection on Hopper (kernels/select_rows.py): a row in a few threads'
    registers."""

    # rows of at most this many blocks take it (prefill chunks with up to ~120K of context,
    # large decode steps at short context; 0: only a block table of width 0) ...
    max_blocks: int = 1024
    # ... a row in at least `tpr` threads, and on wider rows `blocks_per_thread` blocks a
    # thread, up to a warp
    tpr: int = 4
    blocks_per_thread: int = 16
    # warps per program
    warps: int = 1
    # launches whose width (a power of 2) is at most this many blocks sort their rows instead
    # of searching them (a bitonic network of log2(width) (log2(width) + 1) / 2 stages, which
    # grows past the search's cost between 128 and 512 blocks)
    sort_max: int = 128

    def __post_init__(self):
        check_form(self, pow2=("tpr", "blocks_per_thread"), positive=("warps",))


@dataclass(frozen=True)
class CpForm:
    """The context-parallel kernels (kernels/cp.py)."""

    # most local blocks a packing program ("cp_local_keys") takes per token
    keys_chunk: int = 1024

    def __post_init__(self):
        check_form(self, pow2=("keys_chunk",))


_FORMS = dict(decode=DecodeForm, decode_nvfp4=Nvfp4DecodeForm, prefill=PrefillForm,
              gluon=GluonPrefillForm, stage=StageForm, select=SelectForm, group=GroupForm,
              short_rows=ShortRowsForm, cp=CpForm)


@dataclass(frozen=True)
class IndexerConfig:
    """Every launch knob of the index branch, as small frozen forms, one per launch (or family
    of launches). benchmarks/tune.py varies them with `replace` (a form's changes as a dict).
    Defaults are the measured best on the H200."""

    decode: DecodeForm = DecodeForm()
    decode_nvfp4: Nvfp4DecodeForm = Nvfp4DecodeForm()
    prefill: PrefillForm = PrefillForm()
    gluon: GluonPrefillForm = GluonPrefillForm()
    stage: StageForm = StageForm()
    select: SelectForm = SelectForm()
    group: GroupForm = GroupForm()
    short_rows: ShortRowsForm = ShortRowsForm()
    cp: CpForm = CpForm()
    # NVFP4 prefill scoring (the prefill launch): "inkernel", the Triton prefill launch
    # dequantizing in registers (at most prefill.max_rows_nvfp4 rows a tile), or "staged",
    # kernels/stage.py dequantizing the long requests' pages into a 16-bit staging cache first
    # (32 KB a page: plan._staging), which the 16-bit prefill launch then scores (on Hopper the
    # Gluon kernel): a page is dequantized once instead of once per tile that reads it, but
    # the staging cache is sized for every request that could be long. "auto": staged when the
    # prefill launch takes one request (a prefill chunk alone: max_blocks pages), else
    # in-kernel (docs/performance.md, "NVFP4 index pages"). Like the prefill launch itself, it
    # takes a lone decode or verify request padded past 16 tokens for a chunk unless max_q_len
    # says otherwise: then it stages the whole context for a few tokens
    nvfp4_prefill: str = "auto"

    def __post_init__(self):
        if self.nvfp4_prefill not in NVFP4_PREFILL_FORMS:
            raise ValueError(f"IndexerConfig.nvfp4_prefill must be one of "
                             f"{NVFP4_PREFILL_FORMS}, got {self.nvfp4_prefill!r}")
        for name, kind in _FORMS.items():
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"IndexerConfig.{name} must be a {kind.__name__}, got "
                                f"{getattr(self, name)!r}")

    def replace(self, **changes) -> "IndexerConfig":
        """dataclasses.replace, where a form's field may also take a dict of that form's
        changes (JSON-friendly: benchmarks/tune.py's variants), e.g.
        DEFAULT.replace(gluon={"waves": 2}, nvfp4_prefill="staged")."""
        return dataclasses.replace(self, **{
            name: dataclasses.replace(getattr(self, name), **value)
            if name in _FORMS and isinstance(value, dict) else value
            for name, value in changes.items()})

    __hash__ = cached_hash
    __getstate__ = state_without_hash


DEFAULT = IndexerConfig()


@dataclass(frozen=True)
class IndexerShape:
    """What the plan reads of a step. tma_rows: index_q is [T * H, DI] rows and index_cache is
    [pages * BLOCK, DI] rows, each one strided 2-D array that TMA can describe (api.py); tma_q:
    index_q alone is (what the staged NVFP4 form needs: its staging cache always is).
    topk None: scoring only (block_scores). cache_dtype torch.uint8: NVFP4 pages (nvfp4). cp: a
    context-parallel rank's share (cp_share), which only kernels/scores.py's Triton launches
    score."""

    num_tokens: int
    num_heads: int
    head_dim: int
    num_requests: int
    max_blocks: int
    block_size: int
    q_dtype: torch.dtype
    cache_dtype: torch.dtype
    max_q_len: int | None = None
    tma_rows: bool = False
    topk: int | None = None
    init_blocks: int = 0
    local_blocks: int = 1
    cp: bool = False
    tma_q: bool = False

    @property
    def nvfp4(self) -> bool:
        """Whether the index cache is NVFP4 pages (openmsa.nvfp4: a uint8 cache is nothing
        else), dequantized in registers by the kernels."""
        return self.cache_dtype == NVFP4_DTYPE


def nvfp4_decode_eligible(shape: IndexerShape, device: DeviceFacts) -> bool:
    """Whether the decode launch is kernels/scores_nvfp4.py's Gluon kernel: NVFP4 pages on
    Hopper, an fp8 e4m3fn or fp16 query (fp16 keys meet it in one MMA; a bf16 query keeps the
    Triton launch), not a context-parallel share (whose positions only kernels/scores.py
    maps)."""
    return (device.hopper and shape.nvfp4 and shape.q_dtype in (FP8, torch.float16)
            and not shape.cp)


def plan(shape: IndexerShape, device: DeviceFacts, config: IndexerConfig = DEFAULT) -> LaunchPlan:
    """The step's launches in order: scoring, then (with topk) the selection; sizes: the
    selection's temporary buffers (see _selection)."""
    selection = selection_plan(shape, device, config)
    scoring, sizes = _scoring(shape, device, config)
    return LaunchPlan((*scoring, *selection), {**selection.sizes, **sizes})


def selection_plan(shape: IndexerShape, device: DeviceFacts,
                   config: IndexerConfig = DEFAULT) -> LaunchPlan:
    """The selection's launches alone (none without topk or tokens), and its buffers' sizes."""
    if shape.topk is None or shape.num_tokens == 0:
        return LaunchPlan()
    return LaunchPlan(*_selection(shape, device, config))


def prepared_plan(steps: LaunchPlan, prepare: Launch, shape: IndexerShape,
                  config: IndexerConfig = DEFAULT) -> LaunchPlan | None:
    """The plan of prepare_and_select (api.py): a step of `shape` whose scoring is the Triton
    decode launch alone, of no more tokens than requests or max_q_len 1 (decode; padding tokens
    allowed), and at most decode.prepare_max_blocks table columns, followed by the
    preparation's launch (`prepare`, cache/plan.py's "fused_prepare"; not into NVFP4 pages),
    runs both as one "prepare_scores" launch of grid
    (max(R, T), splits + the preparation's tiles) (kernels/scores.py, _prepare_scores_kernel),
    then the selection as planned. None for any other step: the two ops run apart."""
    scoring = [launch for launch in steps if launch.kernel.startswith("scores")
               or launch.kernel == "stage_nvfp4"]
    if ([launch.kernel for launch in scoring] != ["scores_decode"] or prepare.kernel
            != "fused_prepare" or prepare.params["INDEX_NVFP4"] or scoring[0].params["NVFP4"]
            or (shape.num_tokens > shape.num_requests and shape.max_q_len != 1)
            or shape.max_blocks > config.decode.prepare_max_blocks):
        return None
    decode, p = scoring[0], prepare.params
    params = {k: v for k, v in decode.params.items()
              if k not in ("TILE_MODE", "NVFP4", "table_width", "maxnreg")}
    params.update(HQ=p["HQ"], HKV=p["HKV"], D=p["D"], DP=p["DP"], ROT=p["ROT"],
                  NCOARSE=p["NCOARSE"], FP32_ANGLES=p["FP32_ANGLES"],
                  ROPE_SCALE=p["ROPE_SCALE"], KV_BLOCK=p["BLOCK"], HT=p["HT"],
                  KV_SATURATE=p["KV_SATURATE"], INDEX_SATURATE=p["INDEX_SATURATE"],
                  IQ_SATURATE=p["IQ_SATURATE"], HAS_SCALE=p["HAS_SCALE"],
                  PREP_TILES=prepare.grid[1])
    requests, splits = decode.grid
    fused = Launch("prepare_scores", (max(requests, shape.num_tokens), splits + prepare.grid[1]),
                   params)
    return LaunchPlan((fused, *(launch for launch in steps if launch is not decode)),
                      steps.sizes)


def gluon_eligible(shape: IndexerShape, device: DeviceFacts) -> bool:
    """Whether the prefill launch is kernels/scores_gluon.py's Gluon kernel: Hopper, q and cache
    of one dtype (fp8 or 16-bit; never NVFP4 pages, which the Gluon kernel cannot dequantize),
    128-key blocks, index head dim 128, a power-of-two number of heads, and layouts TMA can
    describe (shape.tma_rows)."""
    return (device.hopper and not shape.nvfp4 and shape.q_dtype == shape.cache_dtype
            and shape.q_dtype in (FP8, *HALF) and shape.block_size == 128
            and shape.head_dim == 128 and shape.num_heads & (shape.num_heads - 1) == 0
            and shape.tma_rows)


def stage_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The staged NVFP4 form's key and query dtype for an index query of q_dtype: bf16 for a
    bf16 query (which fp16 cannot hold exactly), fp16 otherwise (an fp8 e4m3 query converts to
    fp16 exactly). Keys (code * scale) are exact in both."""
    return torch.bfloat16 if q_dtype == torch.bfloat16 else torch.float16


def _scoring(shape: IndexerShape, device: DeviceFacts,
             config: IndexerConfig) -> tuple[list[Launch], dict]:
    """The decode launch (unless the step is one request of more than SMALL_Q tokens) and,
    unless every request is known to be short, the prefill launch; with the staged NVFP4 form,
    the staging launch first (its sizes: "staged_pages", the staging cache's pages)."""
    num_tokens = shape.num_tokens
    if num_tokens == 0 or shape.num_requests == 0 or shape.max_blocks == 0:
        return [], {}
    # a decode/verify step: one launch (the prefill launch of a step of > SMALL_Q tokens costs
    # a launch even when its programs find no long request)
    only_requests = num_tokens <= SMALL_Q or (shape.max_q_len is not None
                                              and shape.max_q_len <= SMALL_Q)
    # skipped by the hint alone, the prefill launch's requests go to the decode launch, which
    # then takes any q_len (ANY_Q); with T <= SMALL_Q no request can be longer, and the bound
    # stays
    any_q = only_requests and num_tokens > SMALL_Q
    # one request in a step of more than SMALL_Q tokens: a prefill chunk (or a step of mostly
    # padding tokens), so the prefill launch takes it whatever its q_len, and the decode
    # launch, which would find nothing to do (~1 µs of device time), is not made
    one_request = shape.num_requests == 1 and not only_requests
    launches = []
    if not one_request and nvfp4_decode_eligible(shape, device):
        launches.append(_nvfp4_decode(shape, device, config, any_q))
    elif not one_request:
        launches.append(_decode(shape, device, config, any_q))
    if only_requests:
        return launches, {}
    prefill_small_q = 0 if one_request else SMALL_Q
    # (a context-parallel share never stages: its positions are mapped in kernels/scores.py
    # alone)
    staged = config.nvfp4_prefill == "staged" or (config.nvfp4_prefill == "auto"
                                                  and one_request)
    if shape.nvfp4 and staged and not shape.cp:
        stage, staged_shape, pages = _staging(shape, device, config, prefill_small_q,
                                              one_request)
        # first, so that the prefill launch, a programmatic dependent of the decode launch
        # (which reads from its start), reads a staging cache that is complete
        return [stage, *launches, *_prefill(staged_shape, device, config, one_request,
                                            prefill_small_q)], dict(staged_pages=pages)
    return [*launches, *_prefill(shape, device, config, one_request, prefill_small_q)], {}


def _decode(shape: IndexerShape, device: DeviceFacts, config: IndexerConfig,
            any_q: bool) -> Launch:
    """The Triton decode launch: grid (R, splits), enough splits of each request's blocks to
    fill the GPU; keys as the MMA's rows (see kernels/scores.py), except for the fp32
    reference-precision path, which keeps the IEEE dot."""
    form = config.decode
    bps = _decode_bps(shape, device.num_sms * (form.waves if device.cuda else 1), form.max_bps)
    return Launch("scores_decode", (shape.num_requests, -(-shape.max_blocks // bps)),
                  dict(BPS=bps, TILE_MODE=False, ROWS_T=max(1, DECODE_ROWS // _hp(shape)),
                       **_common(shape, device), SMALL_Q=ANY_Q if any_q else SMALL_Q,
                       KEYS_AS_ROWS=shape.q_dtype != torch.float32, num_warps=form.warps,
                       num_stages=form.stages, table_width=shape.max_blocks,
                       **(dict(maxnreg=form.maxnreg_nvfp4) if shape.nvfp4 and device.nvidia
                          else {})))


def _decode_bps(shape: IndexerShape, programs: int, max_bps: int) -> int:
    """Blocks per split of a decode launch: enough splits of each request's blocks for about
    `programs` programs (a power of two), at most max_bps."""
    splits = -(-programs // shape.num_requests)
    return min(max_bps, next_pow2(-(-shape.max_blocks // splits)))


def _hp(shape: IndexerShape) -> int:
    """The heads padded to a tl.arange extent."""
    return next_pow2(shape.num_heads)


def _common(shape: IndexerShape, device: DeviceFacts) -> dict:
    """The Triton scoring kernel's constexprs that both its launches share."""
    # the GPU's max skips NaN by itself; the interpreter's does not (see kernels/scores.py).
    # PDL: the selection launch after this one starts early (programmatic dependent launch,
    # NVIDIA only; on ROCm neither is assumed)
    # an fp8 query dots fp8 keys (a 16-bit one converts them first: CAST_K), whose tensor-core
    # dot needs a deeper K than 16-bit operands; the padding columns load as 0
    min_k = MIN_DOT_K_FP8 if shape.q_dtype in FP8_TYPES else MIN_DOT_K
    return dict(H=shape.num_heads, HP=_hp(shape), DI=shape.head_dim,
                DIP=max(min_k, next_pow2(shape.head_dim)), BLOCK=shape.block_size,
                CAST_K=shape.q_dtype in HALF and shape.cache_dtype in FP8_TYPES,
                IEEE=shape.q_dtype == torch.float32, MAX_SKIPS_NAN=device.nvidia,
                PDL=device.nvidia, NVFP4=shape.nvfp4)


def _staging(shape: IndexerShape, device: DeviceFacts, config: IndexerConfig, small_q: int,
             one_request: bool) -> tuple[Launch, IndexerShape, int]:
    """The staged NVFP4 form: the staging launch (kernels/stage.py), the shape the prefill
    launch then scores (a 16-bit query against a 16-bit cache of 128-key pages,
    TMA-describable when the query is: a converted fp8 query is a contiguous copy), and the
    staging cache's pages.

    Its size comes from shapes alone (no host sync): a slot of max_blocks pages per request
    the prefill launch can take, of which there are at most min(R, T // (SMALL_Q + 1)) (each
    has more than SMALL_Q of the T tokens), or the one request of a one-request step. That is
    32 KB x max_blocks per slot: an 8K chunk after 1M tokens stages 8192 pages, 256 MB; a step
    mixing it with 64 decode requests has 65 slots (17 GB), as many as the bound allows."""
    form = config.stage
    slots = 1 if one_request else min(shape.num_requests,
                                      shape.num_tokens // (SMALL_Q + 1))
    pages = slots * shape.max_blocks
    dtype = stage_dtype(shape.q_dtype)
    q_rows = shape.tma_q or shape.q_dtype != dtype
    staged = dataclasses.replace(shape, q_dtype=dtype, cache_dtype=dtype,
                                 tma_rows=q_rows and pages * shape.block_size < 2 ** 31,
                                 tma_q=q_rows)
    programs = max(1, device.num_sms * form.waves)
    bpp = min(form.max_bpp, next_pow2(-(-shape.max_blocks // programs)))
    stage = Launch("stage_nvfp4", (shape.num_requests, -(-shape.max_blocks // bpp)),
                   dict(slots=slots, SMALL_Q=small_q, BPP=bpp, BLOCK=shape.block_size,
                        DI=shape.head_dim, RCH=form.rank_chunk, PTX=device.nvidia,
                        num_warps=form.warps))
    return stage, staged, pages


def _prefill(shape: IndexerShape, device: DeviceFacts, config: IndexerConfig,
             one_request: bool, small_q: int) -> list[Launch]:
    """The prefill launch: kernels/scores_gluon.py's Gluon kernel on Hopper where
    gluon_eligible (with its Triton form beside it for unaligned bases), kernels/scores.py's
    Triton prefill launch otherwise."""
    num_tokens, num_heads = shape.num_tokens, shape.num_heads
    form = config.prefill
    fp8 = shape.cache_dtype in FP8_TYPES
    rows = min(form.rows, form.max_rows_nvfp4) if shape.nvfp4 else form.rows
    rows_t = max(1, rows // _hp(shape))
    triton_params = dict(BPS=form.bps, TILE_MODE=True, ROWS_T=rows_t, **_common(shape, device),
                         SMALL_Q=small_q, KEYS_AS_ROWS=False, num_warps=form.warps,
                         num_stages=form.stages_nvfp4 if shape.nvfp4 else
                         form.stages_fp8 if fp8 else form.stages_16)
    triton_grid = (-(-num_tokens // rows_t), -(-shape.max_blocks // form.bps))
    if not gluon_eligible(shape, device):
        return [Launch("scores_prefill", triton_grid, triton_params)]
    gluon = config.gluon
    rows_t = GLUON_CONSUMERS * GLUON_WG_ROWS // num_heads
    tiles = -(-num_tokens // rows_t)
    # splits for gluon.waves programs per SM (one program fits on an SM), whole chunks of CH
    # blocks; where that makes splits shorter than a chunk (short contexts), whole 32-byte
    # sectors of scores, as many as _short_prefill_bps finds fastest
    splits = max(1, round(gluon.waves * device.num_sms / tiles))
    per_split = max(1, -(-shape.max_blocks // splits))
    if per_split >= GLUON_CH:
        bps = -(-per_split // GLUON_CH) * GLUON_CH
    elif splits == 1:
        bps = -(-per_split // SECTOR_BLOCKS) * SECTOR_BLOCKS  # one split whatever its size
    else:
        bps = _short_prefill_bps(shape, device.num_sms, rows_t, tiles, GLUON_CH, gluon)
    # a programmatic dependent of the decode launch, waiting for it only at its end; alone,
    # it is no dependent, but still lets the selection after it start early
    return [Launch("scores_prefill_gluon", (tiles, -(-shape.max_blocks // bps)),
                   dict(bps=bps, H=num_heads, SMALL_Q=small_q,
                        STAGES=gluon.stages_fp8 if fp8 else gluon.stages_16,
                        CONSUMER_REGS=gluon.consumer_regs, PRODUCER_REGS=gluon.producer_regs,
                        num_warps=GLUON_WARPS, launch_pdl=not one_request)),
            Launch("scores_prefill_unaligned", triton_grid, triton_params)]


def _short_prefill_bps(shape: IndexerShape, num_sms: int, rows_t: int, tiles: int, chunk: int,
                       form: GluonPrefillForm = GluonPrefillForm()) -> int:
    """Blocks per split of the Gluon prefill launch at short contexts: the count from
    SECTOR_BLOCKS up to a chunk whose programs end first, placed in launch order (each split's
    tiles last first, kernels/scores_gluon.py) on whichever SM frees first. A program holds its
    SM alone (its registers), so each start (form.start_blocks) is paid in full: shorter
    splits balance the causal triangle but pay more starts. The step is taken as one request
    whose last num_tokens tokens are the chunk and which spans max_blocks blocks, on SMs all
    free at the start (a decode launch before it may still hold some). With at least two
    splits of under a chunk, the waves rule made ~form.waves programs an SM: at 8 blocks a few
    thousand placements, a few of the sizes placed (the others' bounds lose), ~1 ms of host
    time once per planned shape."""
    num_tokens, block = shape.num_tokens, shape.block_size
    context = max(shape.max_blocks * block - num_tokens, 0)
    # blocks each tile's last token sees (at most the table's), longest first (launch order)
    seen = [min((context + min((t + 1) * rows_t, num_tokens) - 1) // block + 1,
                shape.max_blocks) for t in reversed(range(tiles))]

    def costs(bps: int) -> list[int]:
        return [form.start_blocks + min(bps, n - first) if n > first else form.empty_blocks
                for first in range(0, shape.max_blocks, bps) for n in seen]

    def makespan(programs: list[int]) -> int:
        free = [0] * num_sms
        for cost in programs:
            heapq.heapreplace(free, free[0] + cost)
        return max(free)

    # placed in the order of a bound (the longest program, or the work spread evenly), and
    # only while the bound could beat the best found (ties to the shorter split): a few of the
    # 25 sizes are placed
    bounded = []
    for bps in range(SECTOR_BLOCKS, chunk + 1):
        programs = costs(bps)
        bounded.append((max(max(programs), -(-sum(programs) // num_sms)), bps, programs))
    best = None
    for bound, bps, programs in sorted(bounded, key=lambda b: b[:2]):
        if best is not None and (bound, bps) >= best:
            break
        span = (makespan(programs), bps)
        best = span if best is None else min(best, span)
    return best[1]


def _nvfp4_decode(shape: IndexerShape, device: DeviceFacts, config: IndexerConfig,
                  any_q: bool) -> Launch:
    """The Gluon NVFP4 decode launch: grid (R, splits) of one-warp programs, each a split's
    blocks for all of its request's (token, head) rows, 8 or 16 at a time (NP: the MMA's N; 8
    when the step's rows per request are known to fit)."""
    form = config.decode_nvfp4
    q_bound = min(shape.num_tokens, shape.max_q_len or SMALL_Q, SMALL_Q)
    np_rows = NVFP4_ROWS[0] if q_bound * shape.num_heads <= NVFP4_ROWS[0] else NVFP4_ROWS[1]
    cap = min(config.decode.max_bps, form.max_bps)
    bps = max(min(form.min_bps, cap), _decode_bps(shape, device.num_sms * form.programs, cap))
    return Launch("scores_decode_nvfp4", (shape.num_requests, -(-shape.max_blocks // bps)),
                  dict(H=shape.num_heads, NP=np_rows, BPS=bps, BLOCK=shape.block_size,
                       SMALL_Q=ANY_Q if any_q else SMALL_Q, PDL=True, STAGES=form.stages,
                       num_warps=NVFP4_DECODE_WARPS,
                       **(dict(maxnreg=form.maxnreg_8_rows) if np_rows == NVFP4_ROWS[0]
                          else {})))


def selection_layout(rows: int, max_blocks: int, kp: int, per_wave: int,
                     config: IndexerConfig = DEFAULT) -> tuple[int, bool]:
    """(blocks per selection program, whether the launch takes the sort path) for `rows` score
    rows of max_blocks blocks."""
    form = config.select

    def segment(width):
        return max(2 * kp, min(width, next_pow2(max(max_blocks, 1))))

    def programs(width):
        return rows * -(-max(max_blocks, 1) // segment(width))

    # few programs (decode at small batch): a bitonic top-k on several warps has the shortest
    # latency; many (prefill, large batches): the threshold search on one warp per row has the
    # most throughput (kernels/select.py; docs/performance.md)
    sort_limit = form.sort_waves * per_wave
    if programs(form.segment) >= sort_limit:
        return segment(form.segment), False
    # few rows of many blocks (TP4 decode, B = 1 at 1M): shorter segments, as many programs as
    # the sort path takes; each sort is shorter, a merge launch joins them
    for width in form.sort_widths:
        if width < segment(form.segment) and programs(width) < sort_limit:
            return segment(width), True
    return segment(form.segment), True


def _selection(shape: IndexerShape, device: DeviceFacts,
               config: IndexerConfig) -> tuple[list[Launch], dict]:
    """The selection's launches and its buffers' sizes: "segments" per row, "candidates" (KP
    packed keys per segment, with several segments), "scratch" (slots per segment program, 0:
    none), "groups" and "group_scratch" (the group-bound path's maxima per row and slots per
    row)."""
    num_tokens, num_heads, max_blocks = shape.num_tokens, shape.num_heads, shape.max_blocks
    topk, init, local, block = shape.topk, shape.init_blocks, shape.local_blocks, shape.block_size
    rows = num_tokens * num_heads
    # the kernels' power-of-two width for K (candidates, sort and pad widths), at least 2:
    # tl.topk and tl.sort take no width of 1, and a row's KP > TOPK slots are never picked
    kp = max(next_pow2(topk), 2)
    seg, by_sort = selection_layout(rows, max_blocks, kp, device.num_sms, config)
    num_segments = -(-max(max_blocks, 1) // seg)
    if _short_rows(device, max_blocks, kp, by_sort, config):
        # kernels/select_rows.py: G >= K groups of W blocks (they bound the search of widths
        # past short_rows.sort_max); wider rows lie blocks_per_thread blocks per thread, up to
        # a warp
        short = config.short_rows
        width = max(next_pow2(max_blocks), 4)
        g = min(kp, width)
        tpr = min(max(short.tpr, width // short.blocks_per_thread), WARP, width)
        return [Launch("select_short_rows", (-(-rows // (WARP // tpr * short.warps)),),
                       dict(H=num_heads, TOPK=topk, KP=kp, INIT=init, LOCAL=local, BLOCK=block,
                            G=g, W=width // g, VEC=4 if max_blocks % 4 == 0 else 1, TPR=tpr,
                            SORT=width <= short.sort_max, num_warps=short.warps,
                            launch_pdl=True))], {}
    group = config.group
    if not by_sort and kp <= GROUP_MAX_KP and max_blocks >= group.min_blocks:
        # kernels/select.py's group-bound path: at most 2 * KP reaching groups on the fast path
        groups = -(-max_blocks // group.size)
        common = dict(TOPK=topk, INIT=init, LOCAL=local, BLOCK=block, GS=group.size)
        cap = max(group.scratch, 2 * kp)
        # (its fallback reads the NGP groups' blocks in chunks of at most all of them)
        ngp = max(next_pow2(groups), 2 * kp)
        return [Launch("select_group_max",
                       (num_tokens, num_heads, -(-groups // group.per_program)),
                       dict(**common, GB=group.per_program, num_warps=group.max_warps)),
                Launch("select_group_bound", (num_tokens, num_heads),
                       dict(**common, KP=kp, NGP=ngp, CG=2 * kp, CAP=cap,
                            CH=min(group.chunk, ngp * group.size),
                            num_warps=group.bound_warps))], \
            dict(groups=groups, group_scratch=cap)
    form = config.select
    # programmatic dependent launch only for the few programs of the sort path: it hides a
    # launch latency there (small decode steps), while a many-program selection launched early
    # cost a prefill chunk more than it hid (docs/performance.md)
    pdl = device.nvidia and by_sort
    # the threshold path on long segments first packs the keys that can be picked into a
    # scratch row of cap slots (kernels/select.py)
    slots = next_pow2(max(form.scratch_slots, 4 * kp))
    cap = 0 if by_sort or seg < 4 * slots else slots
    groups = max(form.groups, 2 * kp)
    # the scratch path read in chunks; a chunk holds whole groups, and a chunk of the NG
    # groups at least one
    wide = rows * num_segments >= form.chunk_min_waves * device.num_sms
    chunk = form.chunk if cap and wide else 0
    if chunk and (seg % chunk or chunk % (seg // groups) or seg // chunk > groups
                  or chunk >= seg):
        chunk = 0
    warps = form.sort_warps if by_sort else form.search_warps
    launches = [Launch("select_segments", (num_tokens, num_heads, num_segments),
                       dict(TOPK=topk, KP=kp, INIT=init, LOCAL=local, BLOCK=block, SEG=seg,
                            SINGLE=num_segments == 1, BY_SORT=by_sort, CAP=cap, NG=groups,
                            PDL=pdl, CH=chunk, num_warps=warps, launch_pdl=pdl))]
    if num_segments > 1:
        launches.append(Launch("select_merge", (num_tokens, num_heads),
                               dict(TOPK=topk, KP=kp, BLOCK=block, SEG=seg,
                                    CANDP=next_pow2(num_segments * kp), BY_SORT=by_sort, PDL=pdl,
                                    num_warps=warps, launch_pdl=pdl)))
    return launches, dict(segments=num_segments, candidates=kp, scratch=cap)


def _short_rows(device: DeviceFacts, max_blocks: int, kp: int, by_sort: bool,
                config: IndexerConfig) -> bool:
    """Whether the selection runs kernels/select_rows.py's Gluon kernel: a launch of many rows
    (the threshold path, not the few programs of the sort path) of at most
    short_rows.max_blocks blocks, on Hopper with the Gluon the Hopper kernels are tested on."""
    return (device.hopper and not by_sort and max_blocks <= config.short_rows.max_blocks
            and kp <= SHORT_ROWS_MAX_KP)


def cp_share(shape: IndexerShape, cp_size: int, cp_rank: int) -> IndexerShape:
    """The shape a context-parallel rank scores: its blocks b % cp_size == cp_rank, read through
    the strided view block_table[:, cp_rank::cp_size] (its width is max_blocks here), by the
    Triton launches alone (the Gluon launches and the staged NVFP4 form do not map positions:
    cp=True, no TMA rows), scoring only (the selection is the exchange's merge)."""
    width = len(range(cp_rank, shape.max_blocks, cp_size))
    return dataclasses.replace(shape, max_blocks=width, tma_rows=False, cp=True, topk=None,
                               init_blocks=0, local_blocks=1)


def _arange(x: int) -> int:
    """A tl.arange length: a power of two, at least MIN_ARANGE."""
    return max(MIN_ARANGE, next_pow2(x))


def cp_local_keys(num_tokens: int, num_heads: int, width: int, block_size: int,
                  config: IndexerConfig = DEFAULT) -> Launch | None:
    """The launch packing a rank's local scores [T, H, width] into sort keys (kernels/cp.py's
    _local_keys_kernel): grid (T, chunks of local blocks); None without tokens."""
    if not num_tokens:
        return None
    chunk = min(config.cp.keys_chunk, _arange(width))
    return Launch("cp_local_keys", (num_tokens, -(-max(width, 1) // chunk)),
                  dict(H=num_heads, BLOCK=block_size, CHUNK=chunk))


def cp_merge(num_tokens: int, num_heads: int, num_ranks: int, per_rank: int, topk: int,
             block_size: int) -> Launch | None:
    """The launch merging every rank's candidates [T, H, W, per_rank] into the selection
    (kernels/cp.py's _merge_kernel): one program per (token, head) row; None without rows or
    candidates (a table of no columns: every row is empty, api.py fills it)."""
    if per_rank == 0 or not num_tokens * num_heads:
        return None
    return Launch("cp_merge", (num_tokens * num_heads,),
                  dict(H=num_heads, BLOCK=block_size, CP2=_arange(num_ranks * per_rank),
                       KP2=_arange(topk)))


def cp_plan(shape: IndexerShape, device: DeviceFacts, config: IndexerConfig, cp_size: int,
            cp_rank: int) -> LaunchPlan:
    """A context-parallel rank's select_blocks: its share's scoring (plan() of cp_share), the
    packing of its candidates and, after the exchange, the merge. Sizes: "width", its local
    scores' blocks (ceil(max_blocks / cp_size)), and "per_rank", the candidates each rank
    gives (min(topk, width))."""
    width = -(-shape.max_blocks // cp_size)
    per_rank = min(shape.topk, width)
    scoring = plan(cp_share(shape, cp_size, cp_rank), device, config)
    launches = [launch for launch in (
        cp_local_keys(shape.num_tokens, shape.num_heads, width, shape.block_size, config),
        cp_merge(shape.num_tokens, shape.num_heads, cp_size, per_rank, shape.topk,
                 shape.block_size)) if launch is not None]
    return LaunchPlan((*scoring, *launches), dict(scoring.sizes, width=width, per_rank=per_rank))
