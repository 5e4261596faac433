# SPDX-License-Identifier: Apache-2.0
"""The launch plan of sparse_attention: which kernels run a step, on which grids, with which
constexprs, as a pure function of the step's shape, the device's facts and an AttentionConfig.

A step takes up to four launches (docs/performance.md has the measurements behind each rule):
* prefill steps (at least `prefill_min_tokens` tokens) with tiles: `tile_plan` (kernels/tile.py:
  the union of each tile's selections, taken where it wastes little), then the tile kernel over
  the taken tiles, Gluon `tiles_gluon` (kernels/tile_gluon.py, Hopper, TMA-describable K/V at
  16-byte aligned addresses) or Triton `tiles` (kernels/tile.py) otherwise;
* `token` (kernels/token.py), grid (T, Hkv, splits): every token the tiles left, split over its
  steps;
* `merge` (kernels/token.py) when more splits than the last program merges itself.
Every knob is a field of AttentionConfig (its forms); geometry.py holds what the kernels are
written for.
The route between the two tile kernels depends on K's and V's base addresses (TMA needs 16-byte
aligned bases), a property of the call, not of the shape: it is a field of the step shape, so
each alignment gets its own cached plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..._checks import FP8, FP8_TYPES, HALF
from ..common.plan import (DeviceFacts, Launch, LaunchPlan, cached_hash, check_form,
                           next_pow2, state_without_hash)
from .geometry import GLUON_WARPS, MIN_ROWS, TILE_MAX_TOKENS, TILE_ROWS

__all__ = ["AttentionConfig", "AttentionShape", "DEFAULT", "GluonForm", "SplitForm", "TileForm",
           "TokenForm", "num_splits", "plan"]


@dataclass(frozen=True)
class SplitForm:
    """How the per-token kernel splits a (token, KV head)'s steps over programs, and how the
    partials merge: `num_splits`'s cost model and its bounds.

    The model's constants (µs, TB/s) were fitted on an H200 (docs/history/tried.md: the
    split count priced in µs); what decides is the order of split counts at one
    shape, which other GPUs of the kind share more closely than the absolute times."""

    # a split takes at least this many steps: a split's fixed cost (prologue, partial writes)
    # needs work to amortise
    min_steps: int = 2
    # with at most this many splits the last split program of a (token, KV head) merges them
    # (no second launch); with more, a merge launch is cheaper than that program's serial merge
    fused_max: int = 4
    # warps per merge program
    merge_warps: int = 4
    # a program's fixed cost per round of resident programs
    fixed_us: float = 5.6
    # one 128-key step's latency, a program alone on its SM
    step_us: float = 1.1
    # the fused merge (the last split program merges)
    fused_us: float = 2.4
    # the merge launch
    launch_us: float = 3.4
    # each partial to merge
    per_split_us: float = 0.1
    # the device's copy bandwidth, which an SM's programs share
    copy_tbs: float = 4.28

    def __post_init__(self):
        check_form(self, positive=("min_steps", "fused_max", "merge_warps", "copy_tbs"))


@dataclass(frozen=True)
class TokenForm:
    """A form of the per-token kernel (kernels/token.py's _sparse_attention_kernel)."""

    sub: int  # keys per loop step (capped at the block size): the K/V tile a step holds
    warps: int = 4  # warps per program
    stages: int = 3  # software pipeline stages of the K/V loads
    # programs per SM the split count packs the grid for; None: the decode form's of the step's
    # K/V dtype (decode_fp8 / decode_16)
    resident: int | None = None
    # register cap (ptxas maxnreg) for 128-key, 4-warp programs with fp8 V read in pairs and at
    # most 16 rows; None: none
    maxnreg: int | None = None

    def __post_init__(self):
        check_form(self, positive=("sub", "warps", "stages", "resident", "maxnreg"))


@dataclass(frozen=True)
class TileForm:
    """The Triton tile kernel's form (kernels/tile.py's _sparse_attention_tile_kernel), and the
    warps of the tile plan launch before either tile kernel."""

    # query rows per tile, QT tokens x GP padded heads (QT = rows // GP, at most
    # TILE_MAX_TOKENS); the Gluon tiles take the tokens of TILE_ROWS rows (PAIR: twice)
    rows: int
    sub: int  # keys per loop step (capped at the block size)
    stages: int  # software pipeline stages
    persistent: bool  # `resident` programs per SM walking the items, else one per item
    waste: float  # tile_plan takes a tile when union blocks x tokens <= waste x selected blocks
    warps: int = 4  # warps per tile program
    resident: int = 2  # persistent programs per SM
    # persistent programs under the interpreter: fewer than the items, so that each walks
    # several
    interpret_programs: int = 3
    # warps per tile_plan program (the plan launch of either tile kernel): one, since more
    # warps would repeat the tile's compares rather than share them
    plan_warps: int = 1

    def __post_init__(self):
        check_form(self, positive=("rows", "sub", "stages", "warps", "resident",
                   "interpret_programs", "plan_warps"))


@dataclass(frozen=True)
class GluonForm:
    """A form of the Gluon tile kernel (kernels/tile_gluon.py, Hopper)."""

    sub: int  # keys per step (a divisor of the block size, a multiple of 16)
    stages_k: int  # key buffers in the ring
    stages_v: int  # value buffers in the ring
    maxnreg: int  # registers per thread at launch (sets programs per SM)
    producer_regs: int  # registers of the producer partition (setmaxnreg)
    consumer_regs: int  # registers of the second consumer (pairs only; 0 otherwise)
    waste: float  # tile_plan's threshold when these tiles run (cheaper per union block)

    def __post_init__(self):
        check_form(self, positive=("sub", "stages_k", "stages_v", "maxnreg", "producer_regs"))


@dataclass(frozen=True)
class AttentionConfig:
    """Every launch knob of sparse_attention. A field changes the kernels' speed only, never
    their results beyond rounding (the forms' key order within a row is fixed)."""

    # steps of at least this many tokens are prefill chunks: prefill forms, tiles, no decode
    # splitting rules (the prefill forms' pipeline depth would slow decode steps)
    prefill_min_tokens: int = 2048
    # decode steps of at most this many (token, KV head) pairs (B = 1-8) take the `small` form
    small_pairs: int = 8
    # decode/verify steps with fp8 K/V (fp8 read as byte pairs holds 168 registers: 2 per SM)
    decode_fp8: TokenForm = TokenForm(sub=128, resident=2)
    # decode/verify steps with 16- or 32-bit K/V (128-key steps hold 136 KB: 1 program per SM)
    decode_16: TokenForm = TokenForm(sub=128, resident=1)
    # decode steps of at most small_pairs pairs: finer splits; fp8 K/V on 4 warps, 16-bit on 8
    # (the other count ran these few, latency-bound programs slower)
    small_fp8: TokenForm = TokenForm(sub=64)
    small_16: TokenForm = TokenForm(sub=64, warps=8)
    # fp8 (V read in pairs) decode grids of more than one round of decode_fp8 programs: a finer
    # grain (107 registers, 4 per SM) that leaves a shorter last round
    rounds_fp8: TokenForm = TokenForm(sub=64, resident=4)
    # pipeline stages of 16-bit decode grids of more than one round (one program per SM)
    rounds_stages_16: int = 2
    # prefill steps' per-token kernel (tokens the tiles left, or every token without tiles)
    prefill_fp8: TokenForm = TokenForm(sub=128, maxnreg=168)
    prefill_16: TokenForm = TokenForm(sub=64, stages=2)
    # prefill steps run tiles of tokens over the union of their selections
    tiles: bool = True
    # the Triton tile kernel per K/V dtype (also the fallback of the Gluon one)
    tile_fp8: TileForm = TileForm(rows=64, sub=128, stages=2, persistent=True, waste=2.0)
    tile_16: TileForm = TileForm(rows=64, sub=64, stages=2, persistent=False, waste=2.0)
    # the Gluon tile kernel on Hopper (None: the Triton one): 16-bit K/V through TMA copies,
    # fp8 K/V through a loader warpgroup that converts to fp16, and fp8 tiles of twice the
    # tokens in two consumer warpgroups over one loader (where G allows 2 x 64 rows)
    gluon_16: GluonForm | None = GluonForm(sub=128, stages_k=1, stages_v=1, maxnreg=128,
                                           producer_regs=24, consumer_regs=0, waste=3.5)
    gluon_fp8: GluonForm | None = GluonForm(sub=128, stages_k=2, stages_v=1, maxnreg=128,
                                            producer_regs=80, consumer_regs=0, waste=2.0)
    gluon_pair_fp8: GluonForm | None = GluonForm(sub=128, stages_k=3, stages_v=2, maxnreg=168,
                                                 producer_regs=120, consumer_regs=192,
                                                 waste=2.0)
    # the split count's cost model and the merge
    split: SplitForm = SplitForm()

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value, default = getattr(self, f.name), f.default
            if isinstance(default, bool):
                kind = bool
            elif isinstance(default, int):
                kind = int
                if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
                    raise ValueError(f"AttentionConfig.{f.name} must be positive, got {value}")
            else:  # a form; a Gluon form may be None (the Triton tiles run instead)
                kind = type(default) if default is not None else GluonForm
                if value is None and kind is GluonForm:
                    continue
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise TypeError(f"AttentionConfig.{f.name} must be a {kind.__name__}, got "
                                f"{value!r}")

    __hash__ = cached_hash
    __getstate__ = state_without_hash


DEFAULT = AttentionConfig()


@dataclass(frozen=True)
class AttentionShape:
    """What the plan reads of a step: shapes, dtypes, and properties of the K/V views."""

    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_index_heads: int
    topk: int
    block_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    # V can be read as 16-bit pairs of fp8 columns (unit column stride, even strides and base)
    v_pairs_view: bool = True
    # K and V views a TMA descriptor describes (unit head-dim stride, 16-byte multiple strides)
    tma_views: bool = True
    # K's and V's base addresses 16-byte aligned (TMA copies need it)
    tma_aligned: bool = True
    return_lse: bool = False
    has_scale: bool = False

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def num_splits(pairs: int, steps: int, sub: int, key_bytes: int, resident: int,
               device: DeviceFacts, form: SplitForm = SplitForm()) -> int:
    """How many programs share one (token, KV head)'s `steps` steps of `sub` keys (key_bytes of
    K and V per key): the count whose modelled launch time is least (the smaller on ties: fewer
    partials to merge), at least `form.min_steps` steps per program.

    The model (µs, `form`'s constants): a program runs its e = steps / s steps at `step_us` per
    128 keys when alone, but an SM's programs share its bandwidth (`copy_tbs` / SMs), so the
    busiest SM takes max(rounds x e steps' latency, its programs' bytes at that bandwidth), plus
    `fixed_us` per round of `resident` programs per SM, and the merge: `fused_us` when the last
    program merges, `launch_us` for a merge launch, `per_split_us` per partial. Once
    co-resident programs are bandwidth-bound, splitting only adds the merge. Off CUDA (the
    interpreter) 2 splits whenever there are 4 steps, so that the merge is always exercised."""
    if not device.cuda:
        return 2 if steps >= 4 else 1
    pairs = max(1, pairs)
    sms = device.num_sms
    slots = resident * sms
    step_bw = sub * key_bytes / (form.copy_tbs * 1e6 / sms)  # µs per step per SM
    step_lat = form.step_us * sub / 128

    def cost(s):
        programs = pairs * s
        per_sm, rounds, e = -(-programs // sms), -(-programs // slots), -(-steps // s)
        t = rounds * form.fixed_us + max(rounds * e * step_lat, per_sm * e * step_bw)
        if s > 1:
            t += form.fused_us if s <= form.fused_max else form.launch_us
            t += form.per_split_us * s
        return t

    return min(range(1, max(1, steps // form.min_steps) + 1), key=lambda s: (cost(s), s))


def _gluon_sub(shape: AttentionShape, device: DeviceFacts, form: GluonForm | None,
               rows: int) -> int:
    """The Gluon tiles' keys per step, or 0 when they cannot run: Hopper, a 16-bit q with K/V of
    its dtype or fp8 e4m3, 64 rows per consumer, head dim and block size 128 (what the GPU tests
    cover), TMA-describable views and a step size that divides the block."""
    if form is None or not device.hopper or rows != TILE_ROWS:
        return 0
    if shape.q_dtype not in HALF or shape.kv_dtype not in (shape.q_dtype, FP8):
        return 0
    if shape.head_dim != 128 or shape.block_size != 128 or not shape.tma_views:
        return 0
    sub = min(shape.block_size, form.sub)
    return sub if shape.block_size % sub == 0 and sub % 16 == 0 else 0


def plan(shape: AttentionShape, device: DeviceFacts, config: AttentionConfig) -> LaunchPlan:
    """The step's launches (see the module's docstring). Sizes: `splits` (partials per (token,
    KV head)), `fused` (the last split program merges), `store_lse` (the LSE is written),
    `tile_tokens` (tokens per tile, 0 without tiles), `tile_items` ((tile, KV head) items) and
    `union_width` (slots of a tile's union row)."""
    s, c = shape, config
    t, hkv, group = s.num_tokens, s.num_kv_heads, s.group
    fp8 = s.kv_dtype in FP8_TYPES
    prefill = t >= c.prefill_min_tokens
    small = t * hkv <= c.small_pairs
    decode = c.decode_fp8 if fp8 else c.decode_16
    form = ((c.prefill_fp8 if fp8 else c.prefill_16) if prefill
            else (c.small_fp8 if fp8 else c.small_16) if small else decode)
    resident = form.resident or decode.resident
    sub = min(s.block_size, form.sub)
    steps = s.topk * (s.block_size // sub)
    gp = max(1, next_pow2(group))
    kp = next_pow2(s.topk)

    tile = c.tile_fp8 if fp8 else c.tile_16
    tile_qt = min(tile.rows // gp, TILE_MAX_TOKENS) if prefill and c.tiles else 0
    pair = (fp8 and tile_qt > 1 and 2 * tile_qt <= TILE_MAX_TOKENS and tile_qt * gp == TILE_ROWS
            and _gluon_sub(s, device, c.gluon_pair_fp8, TILE_ROWS) > 0)
    if pair:
        tile_qt *= 2  # two consumers' tokens per tile (tile_gluon.py's PAIR)
    tiles = tile_qt > 1

    ieee = s.q_dtype == torch.float32
    f16_compute = fp8 and not ieee  # fp8 K/V run the matrix unit in fp16 (token.py)
    # (the byte-pair conversion is OCP e4m3's: fnuz V is read a column at a time)
    v_pairs = f16_compute and s.v_pairs_view and s.kv_dtype == FP8
    key_bytes = 2 * s.head_dim * s.kv_dtype.itemsize
    # a tile step takes no splits: a token the tiles did is skipped by every split program, so
    # nothing would merge its partials
    splits = 1 if tiles else num_splits(t * hkv, steps, sub, key_bytes, resident, device,
                                        c.split)
    if (v_pairs and not prefill and not small and device.cuda
            and t * hkv * splits > decode.resident * device.num_sms):
        form = c.rounds_fp8
        sub = min(s.block_size, form.sub)
        steps = s.topk * (s.block_size // sub)
        splits = num_splits(t * hkv, steps, sub, key_bytes, form.resident or decode.resident,
                            device, c.split)
    steps_per_split = -(-steps // splits)
    splits = -(-steps // steps_per_split)
    fused = splits <= c.split.fused_max
    pdl = device.nvidia and splits > 1 and not fused  # the merge launch starts early
    stages = form.stages
    if (not prefill and not fp8 and device.cuda
            and t * hkv * splits > decode.resident * device.num_sms):
        stages = c.rounds_stages_16
    store_lse = s.return_lse or tiles  # the tile kernels always write the LSE

    launches = []
    route_gluon = False
    items = -(-t // tile_qt) * hkv if tiles else 0
    if tiles:
        gluon = c.gluon_pair_fp8 if pair else c.gluon_fp8 if fp8 else c.gluon_16
        gluon_sub = _gluon_sub(s, device, gluon, TILE_ROWS if pair else tile_qt * gp)
        # TMA copies need aligned bases: a misaligned view takes the Triton tiles
        route_gluon = gluon_sub > 0 and s.tma_aligned
        launches.append(Launch("tile_plan", (-(-t // tile_qt), hkv), dict(
            waste=float(gluon.waste if route_gluon else tile.waste), NUM_KV_HEADS=hkv,
            NUM_INDEX_HEADS=s.num_index_heads, QT=tile_qt, BLOCK=s.block_size, TOPK=s.topk,
            KP=kp, num_warps=tile.plan_warps)))
        if route_gluon:
            launches.append(Launch("tiles_gluon", (items,), dict(
                HAS_SCALE=s.has_scale, SUB=gluon_sub, D=s.head_dim, NUM_KV_HEADS=hkv, G=group,
                GP=gp, QT=tile_qt, KP=kp, BLOCK=s.block_size, STAGES_K=gluon.stages_k,
                STAGES_V=gluon.stages_v, FP8=fp8, PRODUCER_REGS=gluon.producer_regs,
                PAIR=pair, CONSUMER_REGS=gluon.consumer_regs, num_warps=GLUON_WARPS,
                maxnreg=gluon.maxnreg)))
        else:
            programs = items if not tile.persistent else min(
                items, tile.resident * device.num_sms if device.cuda else tile.interpret_programs)
            launches.append(Launch("tiles", (programs,), dict(
                HAS_SCALE=s.has_scale, NUM_KV_HEADS=hkv, G=group, GP=gp, QT=tile_qt,
                D=s.head_dim, BLOCK=s.block_size, KP=kp, SUB=min(s.block_size, tile.sub),
                IEEE=ieee, F16_COMPUTE=f16_compute, PERSISTENT=tile.persistent,
                num_warps=tile.warps, num_stages=tile.stages)))

    token = dict(
        HAS_SCALE=s.has_scale, NUM_HEADS=s.num_heads, NUM_KV_HEADS=hkv,
        NUM_INDEX_HEADS=s.num_index_heads, G=group, M=max(MIN_ROWS, next_pow2(group)),
        D=s.head_dim, BLOCK=s.block_size, TOPK=s.topk, KP=kp, SUB=sub, STEPS=steps_per_split,
        SPLITS=splits,
        IEEE=ieee, F16_COMPUTE=f16_compute, FUSED_MERGE=fused,
        TILE_QT=tile_qt if tiles else 0, V_PAIRS=v_pairs, PTX=device.nvidia,
        SP=next_pow2(splits), PDL=pdl, STORE_LSE=store_lse, LAZY_SUM=f16_compute,
        num_warps=form.warps, num_stages=stages)
    if device.nvidia and not tiles:
        # the call's first launch: a programmatic dependent of the kernel before it on the
        # stream, so its launch latency hides behind that kernel's last programs
        token.update(WAIT_PRIOR=True, launch_pdl=True)
    if (form.maxnreg is not None and prefill and v_pairs and device.nvidia and gp <= 16
            and sub == 128 and form.warps == 4):
        # the elementwise row sum's [16, SUB] tile would take the 128-key, 4-warp program past
        # the registers of 3 programs per SM, which a prefill step's many rounds need; under
        # the cap ptxas fits it without spills. Not on 64-key steps, which need no cap and
        # which ptxas gives more registers under one
        token["maxnreg"] = form.maxnreg
    if route_gluon:
        # a programmatic dependent of the Gluon tiles: they write disjoint tokens, so the
        # per-token programs fill the SMs the tiles' tail leaves idle (token.py's WAIT_TILES)
        token.update(WAIT_TILES=True, launch_pdl=True)
    launches.append(Launch("token", (t, hkv, splits), token))
    if splits > 1 and not fused:
        launches.append(Launch("merge", (t, s.num_heads), dict(
            NUM_HEADS=s.num_heads, D=s.head_dim, SPLITS=splits, SP=next_pow2(splits), PDL=pdl,
            STORE_LSE=store_lse, num_warps=c.split.merge_warps, launch_pdl=pdl)))
    return LaunchPlan(launches, dict(splits=splits, fused=int(fused), store_lse=int(store_lse),
                                     tile_tokens=tile_qt if tiles else 0, tile_items=items,
                                     union_width=tile_qt * kp if tiles else 0))
