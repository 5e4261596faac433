# SPDX-License-Identifier: Apache-2.0
"""The index branch's launch plan: which kernels score a step's blocks and select its top-k,
with which grids and constexprs, as a pure function of the step's shape, the device's facts and
an `IndexerConfig`.

Scoring (scores.py, scores_ws.py) is one Triton kernel launched in two forms, so that no host
synchronisation splits the batch:

* "scores_request", grid (R, splits): the requests of q_len <= SMALL_Q (decode, speculative
  verify), each split's keys read once for all of a request's tokens. Memory-bound.
* "scores_tile", grid (token tiles, splits): the long requests (prefill chunks), a tile of
  packed tokens against each block of a split. Compute-bound. On Hopper, where the layouts
  allow TMA, it is the warp-specialised Gluon kernel instead ("scores_tile_ws"), planned with
  its Triton form beside it ("scores_tile_unaligned"): exactly one of the two runs, the Gluon
  one unless a base address is not 16-byte aligned (TMA cannot take it; api.py checks).

Selection (select.py, select_rows.py) then takes one of three forms by the shape of its rows:

* "select_short_rows" (Hopper): many rows of at most `select_short_max` blocks, a row in a few
  threads' registers.
* "select_group_max" + "select_group_bound": many rows of at least `select_group_min_blocks`
  blocks (prefill after a long context): 16-block group maxima bound the search.
* "select_segments" (+ "select_merge" when a row has several segments): rows cut into segments
  of one program each, sorted (few programs: decode at small batch) or searched by threshold.

The measurements behind each rule are in docs/performance.md ("What was tried").
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass

import torch

from ..._checks import FP8, FP8_TYPES, HALF
from ..._dispatch import next_pow2
from ...nvfp4 import DTYPE as NVFP4_DTYPE
from ..common.plan import DeviceFacts, Launch, LaunchPlan

__all__ = ["IndexerConfig", "DEFAULT", "IndexerShape", "plan", "selection_plan", "selection_layout",
           "ws_eligible", "nvfp4_request_eligible", "SMALL_Q", "NVFP4_PREFILL_FORMS",
           "stage_dtype"]

# requests with q_len <= SMALL_Q (decode, speculative verify) take the request launch
SMALL_Q = 16
# the request launch's q_len bound when the caller's max_q_len says no request is long
ANY_Q = 2 ** 30
# (token, head) rows of the request launch's tensor-core tile (the MMA's smallest M)
DECODE_ROWS = 16
# the request launch's warps and pipeline stages (a sweep of 4/8 warps and 2-4 stages found
# nothing faster: docs/performance.md)
DECODE_WARPS = 4
DECODE_STAGES = 3
# an NVFP4 cache's Triton request launch (off Hopper): at most 128 registers a thread (ptxas
# alone takes ~155, no spill at 128), so that 4 programs fit an SM (16 warps, not 12) to hide
# the dequantization's and the block's barrier chain's latency (docs/design.md)
DECODE_MAXNREG_NVFP4 = 128
# the Gluon NVFP4 request launch (scores_nvfp4.py): one-warp programs per SM its splits aim for,
# its ring's half-block stages and, with 8 rows a pass, its threads' register cap. At 3 stages
# (14 KB of shared memory a warp) and 112 registers 15 warps share an SM; 4 or 6 stages and 96
# or 128 registers were no faster, and 16-row passes were faster uncapped (they spill at 112).
# 64 programs an SM, over four waves of 15: more and shorter programs than whole waves, so
# that SMs whose programs end early take more work and the last wave is short
# (docs/performance.md, "NVFP4 index pages")
NVFP4_PROGRAMS = 64
NVFP4_STAGES = 3
# ... and its most blocks per split: 32 (64 and 128 were 1.3% and 2.8% slower at B = 128, 1M),
# and its least: 2 (a program gathers its rows' query values byte by byte, about a block's work
# at 16 rows, which 1-block splits would double)
NVFP4_MAX_BPS = 32
NVFP4_MIN_BPS = 2
NVFP4_MAXNREG_8_ROWS = 112
# the Triton tile launch's warps, and its stages for a 16-bit and an fp8 cache: a 16-bit key
# tile is twice the bytes, and 2 stages on 4 warps fit 2 programs per SM (docs/performance.md)
PREFILL_WARPS = 4
PREFILL_STAGES = 2
# fp32 scores of 8 blocks: one 32-byte sector of a score row (the Gluon tile launch's least split)
SECTOR_BLOCKS = 8
# the Gluon tile launch's program start (three dependent round trips and the queries' load,
# scores_ws.py) and a program that finds no block, in block steps of its loop: the costs
# _short_tile_bps weighs splits with (a start of 4 steps orders the measured splits of the TP4
# and TP1 chunks with little context as they ran: docs/performance.md)
WS_START_BLOCKS = 4
WS_EMPTY_BLOCKS = 1
PREFILL_STAGES_FP8 = 3
# an NVFP4 cache's (72-byte keys, smaller still than fp8's): fp8's stages (not measured yet)
PREFILL_STAGES_NVFP4 = PREFILL_STAGES_FP8
# the tile launch's most (token, head) rows with an NVFP4 cache: at 128 rows its dequantized key
# tile, the dot's result and the score tile spill on 4 warps (sm_90 compile: 232 bytes); 64 fit
NVFP4_MAX_ROWS = 64
# the forms of an NVFP4 cache's prefill scoring (IndexerConfig.nvfp4_prefill)
NVFP4_PREFILL_FORMS = ("auto", "inkernel", "staged")
# the staging launch (stage.py): most blocks per program, and programs per SM its splits of a
# request's blocks aim for (its programs each dequantize whole pages: memory-bound)
STAGE_MAX_BPP = 16
STAGE_WAVES = 4
STAGE_WARPS = 4
# the sort path's warps (few programs, each one's latency is the step's)
SORT_WARPS = 4
# scratch slots of a threshold-path program on long segments (at least 4 * KP)
SCRATCH_SLOTS = 64
# the group-bound path: blocks per group, groups per group-maxima program, and its search's
# chunk (blocks)
GROUP_SIZE = 16
GROUPS_PER_PROGRAM = 64
GROUP_CHUNK = 128
# select_rows.py's warps per program. Launches whose width (a power of 2) is at most
# SHORT_SORT_MAX blocks sort their rows instead of searching them (a bitonic network of
# log2(width) (log2(width) + 1) / 2 stages: at 128 blocks it beat the search, at 512 it lost)
SHORT_WARPS = 1
SHORT_SORT_MAX = 128


@dataclass(frozen=True)
class IndexerConfig:
    """Every launch knob of the index branch (benchmarks/tune.py varies them with
    dataclasses.replace(DEFAULT, ...)). Defaults are the measured best on the H200."""

    # request launch: programs per SM its splits aim for (decode/verify at small batch)
    decode_waves: int = 2
    # request launch: most blocks per split (long contexts, where splits would exceed the waves)
    decode_max_bps: int = 64
    # Triton tile launch: (token, head) rows per tile and blocks per split (prefill chunks off
    # Hopper, or where TMA cannot take the layouts)
    prefill_rows: int = 128
    prefill_bps: int = 32
    # Gluon tile launch (Hopper prefill): programs per SM the grid is sized to, and key buffers
    # for an fp8 and a 16-bit cache
    ws_waves: int = 4
    ws_stages: int = 6
    ws_stages_16: int = 3
    # selection: blocks of a score row per program (rows longer than this are merged by a
    # second launch: contexts past 128K)
    select_segment: int = 1024
    # selection: below this many programs per SM the launch sorts (decode at small batch),
    # at or above it searches by threshold (prefill, large batches)
    select_sort_waves: int = 2
    # selection: the threshold path reads a segment in chunks of this many blocks (0: at
    # once), fewer registers per program ...
    select_chunk: int = 128
    # ... only in launches of at least this many programs per SM (prefill chunks after a long
    # context; a decode step's programs fit at once, and there the chunks' serial loads cost)
    select_chunk_min_waves: int = 16
    # selection: rows of at least this many blocks on the threshold path take the group-bound
    # path (prefill after a long context)
    select_group_min_blocks: int = 2048
    # selection on Hopper: rows of at most this many blocks take select_rows.py's kernel
    # (prefill chunks with up to ~120K of context, large decode steps at short context; 0: only
    # a block table of width 0), a row in at least select_short_tpr threads (16 blocks per
    # thread, up to a warp, on wider rows)
    select_short_max: int = 1024
    select_short_tpr: int = 4
    # NVFP4 prefill scoring (the tile launch): "inkernel", the Triton tile launch dequantizing
    # in registers (at most 64 rows a tile), or "staged", stage.py dequantizing the long
    # requests' pages into a 16-bit staging cache first (32 KB a page: plan._staging), which
    # the 16-bit tile launch then scores (on Hopper the Gluon kernel): 2.7x faster after 120K,
    # but its cache is sized for every request that could be long. "auto": staged when the
    # tile launch takes one request (a prefill chunk alone: max_blocks pages), else in-kernel
    # (docs/performance.md, "NVFP4 index pages"). Like the tile launch itself, it takes a lone
    # decode or verify request padded past 16 tokens for a chunk unless max_q_len says
    # otherwise: then it stages the whole context for a few tokens
    nvfp4_prefill: str = "auto"

    def __post_init__(self):
        if self.nvfp4_prefill not in NVFP4_PREFILL_FORMS:
            raise ValueError(f"IndexerConfig.nvfp4_prefill must be one of "
                             f"{NVFP4_PREFILL_FORMS}, got {self.nvfp4_prefill!r}")
        # tile sizes are tl.arange extents (powers of two; select_chunk 0: unchunked); the
        # waves and block thresholds may be 0 (0 waves: one split, never sort, always chunk)
        for name, value in vars(self).items():
            if name == "nvfp4_prefill":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"IndexerConfig.{name} must be an int, got {value!r}")
            if name in _POW2_FIELDS:
                if (value <= 0 or value & (value - 1)) and not (name == "select_chunk" and
                                                                value == 0):
                    raise ValueError(f"IndexerConfig.{name} must be a power of two, got {value}")
            elif value < (1 if name in _POSITIVE_FIELDS else 0):
                raise ValueError(f"IndexerConfig.{name} must be at least "
                                 f"{1 if name in _POSITIVE_FIELDS else 0}, got {value}")


_POW2_FIELDS = ("decode_max_bps", "prefill_rows", "prefill_bps", "select_segment", "select_chunk",
                "select_short_tpr")
_POSITIVE_FIELDS = ("decode_waves", "ws_stages", "ws_stages_16")
DEFAULT = IndexerConfig()


@dataclass(frozen=True)
class IndexerShape:
    """What the plan reads of a step. tma_rows: index_q is [T * H, DI] rows and index_cache is
    [pages * BLOCK, DI] rows, each one strided 2-D array that TMA can describe (api.py); tma_q:
    index_q alone is (what the staged NVFP4 form needs: its staging cache always is).
    topk None: scoring only (block_scores). cache_dtype torch.uint8: NVFP4 pages (nvfp4). cp: a
    context-parallel rank's share (cp.py), which only scores.py's Triton launches score."""

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


def nvfp4_request_eligible(shape: IndexerShape, device: DeviceFacts) -> bool:
    """Whether the request launch is scores_nvfp4.py's Gluon kernel: NVFP4 pages on Hopper, an
    fp8 e4m3fn or fp16 query (fp16 keys meet it in one MMA; a bf16 query keeps the Triton
    launch), not a context-parallel share (whose positions only scores.py maps)."""
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


def ws_eligible(shape: IndexerShape, device: DeviceFacts) -> bool:
    """Whether the tile launch is scores_ws.py's Gluon kernel: Hopper, q and cache of one dtype
    (fp8 or 16-bit; never NVFP4 pages, which the Gluon kernel cannot dequantize), 128-key
    blocks, index head dim 128, a power-of-two number of heads, and layouts TMA can describe
    (shape.tma_rows)."""
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
    """The request launch (unless the step is one request of more than SMALL_Q tokens) and,
    unless every request is known to be short, the tile launch; with the staged NVFP4 form,
    the staging launch first (its sizes: "staged_pages", the staging cache's pages)."""
    num_tokens, num_heads = shape.num_tokens, shape.num_heads
    if num_tokens == 0 or shape.num_requests == 0 or shape.max_blocks == 0:
        return [], {}
    # a decode/verify step: one launch (the tile launch of a step of > SMALL_Q tokens costs a
    # launch even when its programs find no long request)
    only_requests = num_tokens <= SMALL_Q or (shape.max_q_len is not None
                                              and shape.max_q_len <= SMALL_Q)
    # skipped by the hint alone, the tile launch's requests go to the request launch, which then
    # takes any q_len (ANY_Q); with T <= SMALL_Q no request can be longer, and the bound stays
    any_q = only_requests and num_tokens > SMALL_Q
    # one request in a step of more than SMALL_Q tokens: a prefill chunk (or a step of mostly
    # padding tokens), so the tile launch takes it whatever its q_len, and the request launch,
    # which would find nothing to do (~1 µs of device time), is not made
    one_request = shape.num_requests == 1 and not only_requests
    launches = []
    if not one_request and nvfp4_request_eligible(shape, device):
        launches.append(_nvfp4_request(shape, device, config, any_q))
    elif not one_request:
        # enough splits of each request's blocks to fill the GPU
        bps = _request_bps(shape, device.num_sms * (config.decode_waves if device.cuda else 1),
                           config.decode_max_bps)
        # keys as the MMA's rows (see scores.py); the fp32 reference-precision path keeps the
        # IEEE dot
        launches.append(Launch("scores_request", (shape.num_requests, -(-shape.max_blocks // bps)),
                               dict(BPS=bps, TILE_MODE=False,
                                    ROWS_T=max(1, DECODE_ROWS // _hp(shape)),
                                    **_common(shape, device), SMALL_Q=ANY_Q if any_q else SMALL_Q,
                                    KEYS_AS_ROWS=shape.q_dtype != torch.float32,
                                    num_warps=DECODE_WARPS, num_stages=DECODE_STAGES,
                                    table_width=shape.max_blocks,
                                    **(dict(maxnreg=DECODE_MAXNREG_NVFP4)
                                       if shape.nvfp4 and device.nvidia
                                       else {}))))
    if only_requests:
        return launches, {}
    tile_small_q = 0 if one_request else SMALL_Q
    # (a context-parallel share never stages: its positions are mapped in scores.py alone)
    staged = config.nvfp4_prefill == "staged" or (config.nvfp4_prefill == "auto"
                                                  and one_request)
    if shape.nvfp4 and staged and not shape.cp:
        stage, staged_shape, pages = _staging(shape, device, tile_small_q, one_request)
        # first, so that the tile launch, a programmatic dependent of the request launch (which
        # reads from its start), reads a staging cache that is complete
        return [stage, *launches, *_tile(staged_shape, device, config, one_request,
                                         tile_small_q)], dict(staged_pages=pages)
    return [*launches, *_tile(shape, device, config, one_request, tile_small_q)], {}


def _request_bps(shape: IndexerShape, programs: int, max_bps: int) -> int:
    """Blocks per split of a request launch: enough splits of each request's blocks for about
    `programs` programs (a power of two), at most max_bps."""
    splits = -(-programs // shape.num_requests)
    return min(max_bps, next_pow2(-(-shape.max_blocks // splits)))


def _hp(shape: IndexerShape) -> int:
    """The heads padded to a tl.arange extent."""
    return next_pow2(shape.num_heads)


def _common(shape: IndexerShape, device: DeviceFacts) -> dict:
    """The Triton scoring kernel's constexprs that both its launches share."""
    # the GPU's max skips NaN by itself; the interpreter's does not (see scores.py). PDL: the
    # selection launch after this one starts early (programmatic dependent launch, NVIDIA only;
    # on ROCm neither is assumed)
    return dict(H=shape.num_heads, HP=_hp(shape), DI=shape.head_dim,
                DIP=max(16, next_pow2(shape.head_dim)), BLOCK=shape.block_size,
                CAST_K=shape.q_dtype in HALF and shape.cache_dtype in FP8_TYPES,
                IEEE=shape.q_dtype == torch.float32, MAX_SKIPS_NAN=device.nvidia,
                PDL=device.nvidia, NVFP4=shape.nvfp4)


def _staging(shape: IndexerShape, device: DeviceFacts, small_q: int,
             one_request: bool) -> tuple[Launch, IndexerShape, int]:
    """The staged NVFP4 form: the staging launch (stage.py), the shape the tile launch then
    scores (a 16-bit query against a 16-bit cache of 128-key pages, TMA-describable when the
    query is: a converted fp8 query is a contiguous copy), and the staging cache's pages.

    Its size comes from shapes alone (no host sync): a slot of max_blocks pages per request
    the tile launch can take, of which there are at most min(R, T // (SMALL_Q + 1)) (each has
    more than SMALL_Q of the T tokens), or the one request of a one-request step. That is
    32 KB x max_blocks per slot: an 8K chunk after 1M tokens stages 8192 pages, 256 MB; a step
    mixing it with 64 decode requests has 65 slots (17 GB), as many as the bound allows."""
    slots = 1 if one_request else min(shape.num_requests,
                                      shape.num_tokens // (SMALL_Q + 1))
    pages = slots * shape.max_blocks
    dtype = stage_dtype(shape.q_dtype)
    q_rows = shape.tma_q or shape.q_dtype != dtype
    staged = dataclasses.replace(shape, q_dtype=dtype, cache_dtype=dtype,
                                 tma_rows=q_rows and pages * shape.block_size < 2 ** 31,
                                 tma_q=q_rows)
    programs = max(1, device.num_sms * STAGE_WAVES)
    bpp = min(STAGE_MAX_BPP, next_pow2(-(-shape.max_blocks // programs)))
    from .stage import RANK_CHUNK
    stage = Launch("stage_nvfp4", (shape.num_requests, -(-shape.max_blocks // bpp)),
                   dict(slots=slots, SMALL_Q=small_q, BPP=bpp, BLOCK=shape.block_size,
                        DI=shape.head_dim, RCH=RANK_CHUNK, PTX=device.nvidia,
                        num_warps=STAGE_WARPS))
    return stage, staged, pages


def _tile(shape: IndexerShape, device: DeviceFacts, config: IndexerConfig, one_request: bool,
          tile_small_q: int) -> list[Launch]:
    """The tile launch: scores_ws.py's Gluon kernel on Hopper where ws_eligible (with its
    Triton form beside it for unaligned bases), scores.py's Triton tile otherwise."""
    num_tokens, num_heads = shape.num_tokens, shape.num_heads
    fp8 = shape.cache_dtype in FP8_TYPES
    rows = min(config.prefill_rows, NVFP4_MAX_ROWS) if shape.nvfp4 else config.prefill_rows
    rows_t = max(1, rows // _hp(shape))
    tile = dict(BPS=config.prefill_bps, TILE_MODE=True, ROWS_T=rows_t, **_common(shape, device),
                SMALL_Q=tile_small_q, KEYS_AS_ROWS=False, num_warps=PREFILL_WARPS,
                num_stages=PREFILL_STAGES_NVFP4 if shape.nvfp4 else
                PREFILL_STAGES_FP8 if fp8 else PREFILL_STAGES)
    tile_grid = (-(-num_tokens // rows_t), -(-shape.max_blocks // config.prefill_bps))
    if not ws_eligible(shape, device):
        return [Launch("scores_tile", tile_grid, tile)]
    from .scores_ws import CH, CONSUMERS, WG_ROWS
    rows_t = CONSUMERS.value * WG_ROWS.value // num_heads
    tiles = -(-num_tokens // rows_t)
    # splits for ws_waves programs per SM (one program fits on an SM), whole chunks of CH
    # blocks; where that makes splits shorter than a chunk (short contexts), whole 32-byte
    # sectors of scores, as many as _short_tile_bps finds fastest
    splits = max(1, round(config.ws_waves * device.num_sms / tiles))
    per_split = max(1, -(-shape.max_blocks // splits))
    if per_split >= CH.value:
        bps = -(-per_split // CH.value) * CH.value
    elif splits == 1:
        bps = -(-per_split // SECTOR_BLOCKS) * SECTOR_BLOCKS  # one split whatever its size
    else:
        bps = _short_tile_bps(shape, device.num_sms, rows_t, tiles, CH.value)
    # a programmatic dependent of the request launch, waiting for it only at its end; alone,
    # it is no dependent, but still lets the selection after it start early
    return [Launch("scores_tile_ws", (tiles, -(-shape.max_blocks // bps)),
                   dict(bps=bps, H=num_heads, SMALL_Q=tile_small_q,
                        STAGES=config.ws_stages if fp8 else config.ws_stages_16,
                        num_warps=4, launch_pdl=not one_request)),
            Launch("scores_tile_unaligned", tile_grid, tile)]


def _short_tile_bps(shape: IndexerShape, num_sms: int, rows_t: int, tiles: int,
                    chunk: int) -> int:
    """Blocks per split of the Gluon tile launch at short contexts: the count from SECTOR_BLOCKS
    up to a chunk whose programs end first, placed in launch order (each split's tiles last
    first, scores_ws.py) on whichever SM frees first. A program holds its SM alone
    (its registers), so each start (WS_START_BLOCKS) is paid in full: shorter splits balance
    the causal triangle but pay more starts. The step is taken as one request whose last
    num_tokens tokens are the chunk and which spans max_blocks blocks, on SMs all free at the
    start (a request launch before it may still hold some). With at least two splits of under a
    chunk, the ws_waves rule made ~ws_waves programs an SM: at 8 blocks a few thousand
    placements, a few of the sizes placed (the others' bounds lose), ~1 ms of host time once
    per planned shape."""
    num_tokens, block = shape.num_tokens, shape.block_size
    context = max(shape.max_blocks * block - num_tokens, 0)
    # blocks each tile's last token sees (at most the table's), longest first (launch order)
    seen = [min((context + min((t + 1) * rows_t, num_tokens) - 1) // block + 1,
                shape.max_blocks) for t in reversed(range(tiles))]

    def costs(bps: int) -> list[int]:
        return [WS_START_BLOCKS + min(bps, n - first) if n > first else WS_EMPTY_BLOCKS
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


def _nvfp4_request(shape: IndexerShape, device: DeviceFacts, config: IndexerConfig,
                   any_q: bool) -> Launch:
    """The Gluon NVFP4 request launch: grid (R, splits) of one-warp programs, each a split's
    blocks for all of its request's (token, head) rows, 8 or 16 at a time (NP: the MMA's N; 8
    when the step's rows per request are known to fit)."""
    q_bound = min(shape.num_tokens, shape.max_q_len or SMALL_Q, SMALL_Q)
    np_rows = 8 if q_bound * shape.num_heads <= 8 else 16
    cap = min(config.decode_max_bps, NVFP4_MAX_BPS)
    bps = max(min(NVFP4_MIN_BPS, cap), _request_bps(shape, device.num_sms * NVFP4_PROGRAMS, cap))
    return Launch("scores_request_nvfp4", (shape.num_requests, -(-shape.max_blocks // bps)),
                  dict(H=shape.num_heads, NP=np_rows, BPS=bps, BLOCK=shape.block_size,
                       SMALL_Q=ANY_Q if any_q else SMALL_Q, PDL=True, STAGES=NVFP4_STAGES,
                       num_warps=1,
                       **(dict(maxnreg=NVFP4_MAXNREG_8_ROWS) if np_rows == 8 else {})))


def selection_layout(rows: int, max_blocks: int, kp: int, per_wave: int,
                     config: IndexerConfig = DEFAULT) -> tuple[int, bool]:
    """(blocks per selection program, whether the launch takes the sort path) for `rows` score
    rows of max_blocks blocks."""

    def segment(width):
        return max(2 * kp, min(width, next_pow2(max(max_blocks, 1))))

    def programs(width):
        return rows * -(-max(max_blocks, 1) // segment(width))

    # few programs (decode at small batch): a bitonic top-k on 4 warps has the shortest latency;
    # many (prefill, large batches): the threshold search on one warp per row has the most
    # throughput (select.py; docs/performance.md)
    sort_limit = config.select_sort_waves * per_wave
    if programs(config.select_segment) >= sort_limit:
        return segment(config.select_segment), False
    # few rows of many blocks (TP4 decode, B = 1 at 1M): shorter segments, as many programs as
    # the sort path takes; each sort is shorter, a merge launch joins them
    for width in (256, 512):
        if width < segment(config.select_segment) and programs(width) < sort_limit:
            return segment(width), True
    return segment(config.select_segment), True


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
        # select_rows.py: G >= K groups of W blocks (they bound the search of widths past
        # SHORT_SORT_MAX); rows wider than 64 blocks lie 16 blocks per thread, up to a warp
        width = max(next_pow2(max_blocks), 4)
        g = min(kp, width)
        tpr = min(max(config.select_short_tpr, width // 16), 32, width)
        return [Launch("select_short_rows", (-(-rows // (32 // tpr * SHORT_WARPS)),),
                       dict(H=num_heads, TOPK=topk, KP=kp, INIT=init, LOCAL=local, BLOCK=block,
                            G=g, W=width // g, VEC=4 if max_blocks % 4 == 0 else 1, TPR=tpr,
                            SORT=width <= SHORT_SORT_MAX, num_warps=SHORT_WARPS,
                            launch_pdl=True))], {}
    if not by_sort and kp <= 32 and max_blocks >= config.select_group_min_blocks:
        # select.py's group-bound path: at most 2 * KP reaching groups on the fast path
        groups = -(-max_blocks // GROUP_SIZE)
        common = dict(TOPK=topk, INIT=init, LOCAL=local, BLOCK=block, GS=GROUP_SIZE)
        cap = max(64, 2 * kp)
        # (its fallback reads the NGP groups' blocks in chunks of at most all of them)
        ngp = max(next_pow2(groups), 2 * kp)
        return [Launch("select_group_max",
                       (num_tokens, num_heads, -(-groups // GROUPS_PER_PROGRAM)),
                       dict(**common, GB=GROUPS_PER_PROGRAM, num_warps=4)),
                Launch("select_group_bound", (num_tokens, num_heads),
                       dict(**common, KP=kp, NGP=ngp, CG=2 * kp, CAP=cap,
                            CH=min(GROUP_CHUNK, ngp * GROUP_SIZE), num_warps=1))], \
            dict(groups=groups, group_scratch=cap)
    # programmatic dependent launch only for the few programs of the sort path: it hides a
    # launch latency there (small decode steps), while a many-program selection launched early
    # cost a prefill chunk more than it hid (docs/performance.md)
    pdl = device.nvidia and by_sort
    # the threshold path on long segments first packs the keys that can be picked into a
    # scratch row of cap slots (select.py)
    cap = 0 if by_sort or seg < 4 * next_pow2(max(SCRATCH_SLOTS, 4 * kp)) \
        else next_pow2(max(SCRATCH_SLOTS, 4 * kp))
    groups = max(64, 2 * kp)
    # the scratch path read in chunks; a chunk holds whole groups, and a chunk of the NG
    # groups at least one
    wide = rows * num_segments >= config.select_chunk_min_waves * device.num_sms
    chunk = config.select_chunk if cap and wide else 0
    if chunk and (seg % chunk or chunk % (seg // groups) or seg // chunk > groups
                  or chunk >= seg):
        chunk = 0
    launches = [Launch("select_segments", (num_tokens, num_heads, num_segments),
                       dict(TOPK=topk, KP=kp, INIT=init, LOCAL=local, BLOCK=block, SEG=seg,
                            SINGLE=num_segments == 1, BY_SORT=by_sort, CAP=cap, NG=groups,
                            PDL=pdl, CH=chunk, num_warps=SORT_WARPS if by_sort else 1,
                            launch_pdl=pdl))]
    if num_segments > 1:
        launches.append(Launch("select_merge", (num_tokens, num_heads),
                               dict(TOPK=topk, KP=kp, BLOCK=block, SEG=seg,
                                    CANDP=next_pow2(num_segments * kp), BY_SORT=by_sort, PDL=pdl,
                                    num_warps=SORT_WARPS if by_sort else 1, launch_pdl=pdl)))
    return launches, dict(segments=num_segments, candidates=kp, scratch=cap)


def _short_rows(device: DeviceFacts, max_blocks: int, kp: int, by_sort: bool,
                config: IndexerConfig) -> bool:
    """Whether the selection runs select_rows.py's Gluon kernel: a launch of many rows (the
    threshold path, not the few programs of the sort path) of at most select_short_max blocks,
    on Hopper with the Gluon the Hopper kernels are tested on."""
    return (device.hopper and not by_sort and max_blocks <= config.select_short_max
            and kp <= 64)
