# SPDX-License-Identifier: Apache-2.0
"""Public sparse_attention: validation, then the Triton kernels (CUDA, or CPU under
TRITON_INTERPRET=1) or the reference (CPU)."""

from __future__ import annotations

import torch

from ..._checks import FP8
from ..._dispatch import next_pow2 as _next_pow2
from ..._dispatch import (capability, gluon_hopper_available, num_sms, on_tensor_device,
                           scale_args, use_kernels)
from ...support import attention_unsupported_reason
from ..common.counters import arrival_counters
from ..common.launch import (PlanCache, call_key, launch, launch_planned, plan_serials, scale_key,
                             tma_descriptor)
from . import reference
from .checks import check_attention_args, check_page_table_args

__all__ = ["sparse_attention", "sparse_page_table"]


# launch knobs, read at each call so that benchmarks/tune.py can sweep them. A step of at least
# prefill_min_tokens tokens (a prefill chunk: its grid fills the GPU many times without splits)
# takes the prefill knobs; measured: 2 stages cut an 8K chunk from 6.2 to 4.5 ms but cost fp8
# decode 6% (docs/performance.md), so the choice follows the step's token count (a shape, not
# a device value: graph-safe).
# sub: keys per loop step (a divisor of the block size; the K/V tile a step holds). resident,
# resident_16: programs per SM the split count packs the grid for (fp8; bf16/fp16). bf16 with
# 128-key steps holds 136 KB of shared memory, one program per SM: packing for 2 left a mostly
# idle last round (TP4 B=64 34.7 -> 29.2 µs, B=128 53.7 -> 45.7 with 1). fp8 read in byte pairs
# holds 168 registers and 72 KB with 3 stages, so 3 programs fit, yet packing for 3 (more splits)
# lost on most shapes (TP1 B=64 48 -> 55 µs, B=128 q_len 4 266 -> 340: each split repeats the
# program's prologue and writes partials). Packing for 2 with 3 resident turns two full planned
# rounds into 1.3 (a long tail: Nsight Compute on TP1 B=128, 512 programs), so a grid of more
# than one round takes rounds_sub-key steps packed for rounds_resident programs per SM (64 keys:
# 107 registers, 4 per SM): TP1 B=128 101.8 -> 79.1 µs, TP4 B=128 q_len 4 98.7 -> 78.3 (4 stages
# with 128 keys, exactly 2 per SM: 88.2 and 84.1). One-round grids keep 128-key steps (64: TP4
# B=64 21.0 -> 23.0 µs, TP1 B=64 48.2 -> 49.9). fp8_v_pairs: fp8 V read in byte pairs
# (decode.py, V_PAIRS; where the view allows it). Steps with at most small_pairs (token, KV head)
# pairs (B = 1-8 decode) take small_sub / small_warps: finer splits, more warps (-1 µs there;
# slower above).
# request_guess: a program looks its token's request up by checking t * R // T first (right for
# equal q_len per request) before the binary search over cu_seqlens (see find_request): fewer
# dependent loads before the first K/V load: 1-4% at B >= 64 (TP4 fp8 B = 128 31.8 -> 30.4 µs,
# B = 64 21.1 -> 20.2; TP1 B = 128 80.7 -> 79.6), equal on small steps.
# pdl: the merge launch (more than fused_max_splits splits) is a programmatic dependent launch
# (CUDA only): it starts while the split programs run and waits for them before reading. Graph
# call time about 1 µs lower at B = 1 (TP1 9.9 -> 8.9 µs, TP4 9.3 -> 8.1), equal at B = 8.
# first_pdl: the split launch of a step without tiles (the call's first launch) is a
# programmatic dependent of whatever kernel precedes the call on the stream, and waits
# (griddepcontrol.wait) before anything else: its launch latency hides behind that kernel's
# last programs (the indexer's first_pdl too). Measured (tune.py --only attention-fp8 --metric
# both, 0ed466c, one call, off / on / off / on): graph call of the 16 rows under 20 µs 2.2%
# lower, -0.24 µs on average; device time equal.
# rounds_stages_16: 16-bit K/V decode grids of more than one round (1 program per SM) on 2
# stages instead of 3: TP1 bf16 B = 128 145.7 -> 137.1 µs, B = 64 79.6 -> 75.6; single-round
# grids lose with 2 (TP4 B = 64 28.6 -> 30.1), so they keep `stages`.
# fused_merge: with at most fused_max_splits splits the last split program merges (no second
# launch: TP4 B=64 24.7 -> 22.7 µs); with more, that program's serial merge costs more than a
# merge launch (16 splits at B=1: 8.5 -> 10.0 µs), so a second launch merges.
# merge_launch_keys, merge_launch_min_fill: the split count charges that launch (see
# _num_splits): B = 8 decode (32 (token, KV head) pairs) takes 4 fused splits of 4 blocks
# instead of 8 and a merge launch: TP1 fp8 q_len 1 13.1 -> 12.4 µs, TP4 q_len 4 13.1 -> 12.4
# (graph call 15.0 -> 13.2). The fused merge loads every split's LSE at once (one [M, SP]
# load); measured alone it did not move the 8/16-split choice (fused_max_splits 8 or 16).
# split_cost: "rounds" (the split count's cost in rounds of programs, _num_splits) or "model" (a
# time in µs with bandwidth shared by an SM's programs, _modelled_time_us; split_* its constants).
# Measured (tune.py --only attention-fp8 --metric both --cases 'B128 q1|B8 q4|B10|B64', e04c7d5,
# one call, rounds / model / rounds / model, device µs): TP1 B = 10 14.8 / 14.7 -> 13.4 / 13.4
# (graph call 17.0 -> 14.2), TP4 B = 128 q_len 1 23.7 / 24.0 -> 23.1 / 23.4, TP8 B = 128 q_len 1
# 23.2 / 23.1 -> 22.8 / 22.9, TP1 B = 8 q_len 4 22.9 / 22.9 -> 23.1 / 23.0 (call 24.7 / 24.0 ->
# 23.4 / 23.6); the rows whose split count it leaves alone within 0.5 µs. So "model".
# lazy_row_sum: fp8 K/V sum the softmax denominator elementwise over a [M, SUB] tile and reduce
# it once after the loop (decode.py, LAZY_SUM): a step's keys lie across the warps, so each
# step's row sum was a shared-memory round trip with barriers (8 -> 5 barriers and 753 -> 723
# instructions per warp per 128-key step, `resources.py --sass`). lazy_sum_maxnreg: the
# register cap that keeps prefill steps' 128-key programs at 3 per SM (see _plan). Measured
# (tune.py --only attention-fp8, one call, lazy sum off -> on without the cap): TP1 B = 8
# 12.2 -> 11.6 µs, B = 128 q_len 4 257.0 -> 253.3, TP4 B = 8 q_len 4 12.3 -> 11.8, TP8 B = 64
# 15.9 -> 15.2; an 8K chunk on the per-token kernel (independent selections) 3474 -> 3418,
# and 3033 with the cap.
TUNING = dict(sub=128, resident=2, resident_16=1, rounds_sub=64, rounds_resident=4,
              rounds_stages_16=2,
              min_steps_per_split=2, warps=4, stages=3, small_pairs=8, small_sub=64,
              small_warps=8, fused_merge=True, fused_max_splits=4, merge_launch_keys=384,
              merge_launch_min_fill=0.75, split_cost="model", split_fixed_us=5.6,
              split_step_us=1.1, split_fused_us=2.4, split_launch_us=3.4,
              split_per_split_us=0.1, split_copy_tbs=4.28,
              prefill_min_tokens=2048, prefill_sub=64, prefill_sub_fp8=128, prefill_warps=4,
              prefill_stages=2, prefill_stages_fp8=3, fp8_f16_compute=True, fp8_v_pairs=True,
              request_guess=True, pdl=True, first_pdl=True, lazy_row_sum=True,
              lazy_sum_maxnreg=168,
              tile=True, tile_rows=64, tile_waste=2.0, tile_sub=64, tile_stages=2,
              tile_sub_fp8=128, tile_stages_fp8=2, tile_warps=4, tile_lazy_mask=True,
              tile_persistent=False, tile_persistent_fp8=True, tile_resident=2,
              tile_plan_warps=1, tile_ws=True, ws_sub=128, ws_stages=1, ws_lazy_mask=True,
              ws_maxnreg=128, ws_producer_regs=24, tile_ws_fp8=True,
              ws_stages_fp8=1, ws_keys_early=True, ws_stages_k=None, ws_stages_k_fp8=2,
              ws_fp8_qk=False, ws_waste=3.5, ws_waste_fp8=2.0, ws_pdl=True,
              ws_fp8_loader=True, ws_loader_regs=80,
              ws_loader_roll=True, ws_sub_fp8=128, ws_pair=True, ws_pair_maxnreg=168,
              ws_pair_consumer_regs=192, ws_pair_loader_regs=120, ws_pair_stages_k=3,
              ws_pair_stages_v=2, ws_pair_eager=False, tile_plan_sort_min=1, ws_pair_16=False)
# prefill_stages_fp8: the per-token kernel's pipeline stages on prefill steps with fp8 K/V (72 KB
# of shared memory per program against 40 at 2 stages, `resources.py`: still 3 programs per SM,
# which the 168-register cap sets). Measured (tune.py --only attention-prefill, 8186176, one
# call, 2 -> 3 stages, the 2-stage runs before and after): TP1 8K chunk of independent selections
# after 8K 2876.2 / 2874.6 -> 2848.5 µs, jittered after 128K (no tiles taken) 2924.7 / 2924.6 ->
# 2875.7; 8 warps 3693.9 and 3807.6 (slower). Again with the knob (1405ef0, one call, 2 / 3 / 2 /
# 3 stages): 2892.4 / 2871.3 / 2891.5 / 2872.4 µs and 2927.5 / 2875.8 / 2927.7 / 2879.0 (-0.7%,
# -1.7%). Nsight Compute (8186176) has that kernel issue-bound rather than memory-bound: issue
# slots 56% busy, the ALU pipe the busiest (50.8%), 0.92 eligible of 2.98 warps per scheduler, L2
# 56%.
# tile_ws: on Hopper, 16-bit K/V tiles run prefill_ws.py's warp-specialised Gluon kernel where
# the views allow TMA (_ws_eligible): ws_sub keys per step, ws_stages K/V buffers; ws_maxnreg
# registers per thread at launch (128: two programs of 8 warps per SM), which the consumer
# warpgroup raises and the producer warp lowers to ws_producer_regs (setmaxnreg). Measured
# (tune.py --only attention-prefill, 5ff8a96, one call, 8K chunks after 8K, Triton tiles ->
# Gluon 64-key steps on 2 stages -> 128-key steps on 1): TP1 bf16 shared by 16 1619 -> 1269 ->
# 1271 µs, with jitter 2175 -> 1736 -> 1681, TP4 395 -> 333 -> 323; 3 stages of 64 keys and
# the mask on every step were slower. ws_keys_early: the consumer hands each step's keys back
# right after S = Q K^T (separate key and value rings), so the next keys load during the
# softmax and P V; False: keys and values go back together after P V (as before).
# ws_stages_k(_fp8): key buffers if not ws_stages(_fp8) (values keep ws_stages(_fp8))
# ws_pdl: the per-token launch after the Gluon tiles is a programmatic dependent launch of
# theirs, started once every tile program has started (prefill_ws.py's PDL): the two write
# disjoint tokens, so the per-token programs fill the SMs that the tiles' tail leaves idle
# (the tile launch is one program per item: when the plan takes few tiles, a few long
# programs), and one of its programs waits for the tiles before the launch may end
# (decode.py's WAIT_TILES). The plan launch came before the tiles started, so its output is
# complete when the per-token launch reads it. Measured (tune.py --only attention-prefill,
# 10f76c2, one call per context, on / off): TP4 bf16 independent 788 / 838 µs after 8K, 1134 /
# 1224 after 128K; TP1 bf16 independent 3041 / 3085 and 5069 / 5162; shared rows 1-2% faster.
# ws_fp8_qk: fp8 K/V tiles compute S = Q K^T as two fp8 MMAs from the key ring (q as e4m3 hi + lo
# per row, prefill_ws.py's _split_q_rows) and convert only V to fp16
# ws_fp8_loader: fp8 K/V tiles loaded from global memory by a producer warpgroup that converts
# them to fp16 on the way into the rings (prefill_ws.py's _fp8_loader; ws_loader_regs its
# registers, which leaves the consumer 176: 64 spill the loader, 88 the consumer), instead of
# TMA copies of fp8 tiles that the consumer converts itself; exact, as the consumer's own
# conversion. Measured (tune.py --only attention-prefill, e51c538, one call, 8K chunks after
# 8K, off / on / on with 2 key buffers, ws_stages_k_fp8=2): TP1 fp8 shared by 16 1540.9 /
# 1376.4 / 1367.1 µs, with jitter 2085.7 / 1950.9 / 1903.6, TP4 with jitter 546.7 / 513.4 /
# 509.2 (a second off / on pair in the same loop: 1540.9 / 1377.1); bf16 rows unchanged.
# ws_loader_roll: the loader issues V's loads a quarter at a time while it converts and stores
# K (prefill_ws.py's _store_tile_load), instead of after. Measured (tune.py --only
# attention-prefill --cases fp8, a4cc152, one call, 8K chunks after 8K, off / on, twice): TP1
# shared by 16 1365.5 / 1358.2 and 1367.3 / 1358.0 µs, with jitter 1903.2 / 1879.8 and
# 1902.3 / 1881.9, TP4 with jitter 509.7 / 501.9 and 509.7 / 505.2. K's loads under V's
# stores as well (carried through the loop as 32-bit words, since fp8 tensors carried there
# take a register per element) spilled ~130 bytes of the loader's invariants: 1603 µs.
# ws_sub_fp8: keys per step of fp8 tiles through the loader (others take whole blocks). 64
# is correct on the GPU (its test cases, 055e2fa) and slower (tune.py --only attention-prefill,
# c6ed071, one call, TP1 shared by 16 after 8K: 1364.0 -> 1596.8 µs, with jitter 1891.9 ->
# 2132.7, TP4 with jitter 503.8 -> 557.0)
# ws_pair: fp8 tiles through the loader (with ws_loader_roll) of twice the tokens, 128 rows in
# two consumer warpgroups over one loader (prefill_ws.py's PAIR): the loader's loads,
# conversions and fp16 stores per step serve twice the rows, for the union of twice the
# tokens' selections. One program of 384 threads per SM at ws_pair_maxnreg registers: the
# loader at ws_pair_loader_regs, the second consumer at ws_pair_consumer_regs, the first at
# what is left (192); ws_pair_stages_k / _v key and value buffers (96 + 64 KB). Measured
# (profile_case.py --breakdown, b2d05c8, one call, TP1 8K chunk, selections shared by 16, tile
# kernel alone, off -> on): 1299.7 -> 1119.9 µs after 8K, 1365.5 -> 1283.7 after 128K. The
# loader at 80 registers (consumers 216 / 208) and 2 + 1 buffers: 1335 µs after 8K, and
# slower than off after 128K (1481 against 1428, tune.py, 7735b1b): one loader per SM keeps
# half the loads in flight of two programs' loaders, which DRAM's latency after 128K exposes;
# 120 registers let it overlap more. ws_pair_eager (V_i's loads issued with K_i's, two tiles
# in flight) was no faster (1291 against 1280 µs, tune.py, 4f09a4f).
# ws_pair_16 (off: correct on the GPU, slower): 16-bit K/V tiles in pairs too, the TMA
# producer warp feeding both consumers, which zero V's unwritten tail themselves with the
# tile's cut (equal writes). The lead was Nsight Compute's bf16 tiles' L2 at 77.7% busy
# (c6ed071), the TMA copies of 64 KB per step per 64 rows, which a pair halves per row.
# Measured (tune.py --only attention-prefill --cases bf16, 225ba77, one call, off / on twice):
# TP1 shared by 16 after 8K 1069.7 / 1151.9 and 1069.7 / 1149.7 µs (+7.6%), after 128K
# 1134.2 / 1159.2; TP4 278.2 / 298.8 and 299.8 / 319.7; every bf16 row slower. So the L2's
# busy share was not what bounds the bf16 tiles: two programs of 64 rows per SM, each with
# its own producer and barriers, overlap better than one program of 128 rows.
# tile_plan_sort_min: plans of at least this many entries (tokens x KP per tile) find their
# union by sorting the entries (prefill.py's _plan_union_sorted) instead of comparing all
# pairs (_plan_union_pairs, kept as the test's cross-check): measured (profile_case.py
# --breakdown, b2d05c8, TP1 8K chunk) 39.9 -> 10.3 µs for 64-entry plans, and 108-145 -> 10.7
# for ws_pair's 128-entry ones (N^2 work on 1-4 warps).
# tile*: prefill steps first launch prefill.py's kernel over tiles of tile_rows // G tokens (the
# union of their selections, taken on the device when union blocks x tokens <= tile_waste x the
# tokens' selected blocks); the per-token kernel then does the tiles it left. Measured on 8K
# chunks (benchmarks/tune.py --only attention-prefill): a tile taken at 48 union blocks of 4
# tokens (waste 3) cost 20% more than per-token, at 22 it saved 33%: 2.0 stays on the safe side.
# ws_waste(_fp8): the same threshold for the Gluon tiles, cheaper per union block than the Triton
# ones. Measured (tune.py --only attention-prefill, TP1 8K chunks, one call per context, bf16
# 2.0 -> 3.0 -> 4.0): after 8K, independent selections 4182 -> 3518 -> 3057 µs; after 128K,
# jitter 4646 -> 3307 -> 3256 but independent 5020 -> 5023 -> 5898 (their mean union is 3.7x
# the tokens' blocks). a23df89, 2.5 / 3.0 / 3.5: 8K independent 4279 / 3579 / 3187, 128K
# jitter 4806 / 3478 / 3412, 128K independent 4866 / 4867 / 4959 (+2%): 3.5. fp8 keeps 2.0:
# 1.5 took jitter 2109 -> 2172, TP4 557 -> 574; 3.0 took 8K independent 2904 -> 3602, 128K
# jitter 2964 -> 3953.
# bf16 prefers 64-key steps (2 stages since the plan hands each step its page, block id and
# tokens as scalars: 1923 -> 1842 µs; 3 before), fp8 whole blocks with 2 (64-key steps on 2
# stages fit 3 programs per SM but took 1850 -> 2135 µs); masking only the steps that
# need it (lazy mask) took 2145 -> 2061 µs (bf16), 2479 -> 2384 (fp8). tile_persistent: the
# tile kernel as tile_resident programs per SM walking the items, else one program per item
# (bf16 1997 µs one per item, 2213 persistent; fp8 2407 and 2277). The plan launch is ~1300
# instructions of 64 x 64 compares per tile: one warp each (4 warps cost 115 µs per 8K chunk at
# TP1, 3% of a chunk whose tiles all fall back, as they replicate the work).


def _num_splits(num_tokens: int, num_kv_heads: int, steps: int, device: torch.device,
                resident: int, sub: int = 128, key_bytes: int = 0) -> int:
    """How many programs share one (token, KV head)'s steps; a function of shapes only, so a
    CUDA graph sees one grid.

    The time of a launch is about (rounds of programs) x (steps per program + one step's worth
    of fixed cost), a round being `resident` x SMs programs at once. The count minimising
    that (the smaller on ties: fewer partials to merge) avoids a last, mostly idle round, e.g.
    128 (token, head) pairs on 132 SMs x 2 take 2 splits of 8 blocks (one round), not 3 of 6
    (two rounds). At least min_steps_per_split steps per program.

    A count above fused_max_splits needs a merge launch, charged as merge_launch_keys keys'
    worth of steps of `sub` keys, but only where the fused alternative (fused_max_splits
    splits) fills the GPU about once: between merge_launch_min_fill x SMs and SMs programs.
    With fewer, its longer programs leave SMs idle and more splits with a merge launch win (16
    (token, KV head) pairs: 9.4 -> 11.3 µs with 4 fused splits); with more, 2 programs share
    an SM and the split-wide grid hides more latency (40 pairs: 15.2 -> 15.6 µs)."""
    if device.type != "cuda":
        return 2 if steps >= 4 else 1  # the interpreter tier always exercises the merge
    pairs = max(1, num_tokens * num_kv_heads)
    slots = resident * num_sms(device)

    fused_max = TUNING["fused_max_splits"] if TUNING["fused_merge"] else 1
    fused_fills = (TUNING["merge_launch_min_fill"] * num_sms(device) <= pairs * fused_max
                   <= num_sms(device))
    merge_launch = TUNING["merge_launch_keys"] / sub if fused_fills else 0.0

    def cost(s):
        return (-(-pairs * s // slots) * (-(-steps // s) + 1)
                + (merge_launch if s > fused_max else 0.0))

    if TUNING["split_cost"] == "model" and key_bytes:
        cost = _modelled_time_us(pairs, steps, sub, key_bytes, slots, num_sms(device), fused_max)

    return min(range(1, max(1, steps // TUNING["min_steps_per_split"]) + 1),
               key=lambda s: (cost(s), s))


def _modelled_time_us(pairs: int, steps: int, sub: int, key_bytes: int, slots: int, sms: int,
                      fused_max: int):
    """split_cost "model" (the default; TUNING split_*): a decode launch's time with s
    splits, in µs. A program runs its e = steps / s steps of `sub` keys (key_bytes of K and V per
    key) at split_step_us per 128 keys when alone, but an SM's programs share its bandwidth
    (split_copy_tbs / SMs), so the busiest SM takes max(rounds x e steps' latency, its programs'
    bytes at that bandwidth), plus split_fixed_us per round (launch, prologue, epilogue) and the
    merge: split_fused_us when the last program merges, split_launch_us for a merge launch, and
    split_per_split_us per partial. The `rounds` cost counts two co-resident programs as two
    parallel slots; this one does not once they are bandwidth-bound, which is where splitting
    only adds the merge (docs/performance.md, "What was tried": 128 pairs of fp8 K/V took 24.2
    µs in 2 fused splits and 23.2 in one). Constants fitted to that call: the modelled times are
    within 0.7 µs of 7 of 12 measured rows (bf16 ones included) and 1-2.7 µs high on small
    steps (their fixed cost is smaller); what decides is the order of split counts at one shape,
    right on the three shapes measured both ways (128, 64 and 40 pairs)."""
    step_bw = sub * key_bytes / (TUNING["split_copy_tbs"] * 1e6 / sms)  # µs per step per SM
    step_lat = TUNING["split_step_us"] * sub / 128

    def cost(s):
        programs = pairs * s
        per_sm, rounds, e = -(-programs // sms), -(-programs // slots), -(-steps // s)
        t = rounds * TUNING["split_fixed_us"] + max(rounds * e * step_lat, per_sm * e * step_bw)
        if s > 1:
            t += (TUNING["split_fused_us"] if s <= fused_max else TUNING["split_launch_us"])
            t += TUNING["split_per_split_us"] * s
        return t
    return cost


def _reads_as_pairs(v_cache: torch.Tensor) -> bool:
    """Whether an fp8 V cache can be read as uint16 pairs of columns (decode.py's V_PAIRS): unit
    column stride, an even head dim, and every other stride and the base address even (a
    property of the view, fixed for a captured graph)."""
    return (v_cache.stride(3) == 1 and v_cache.shape[3] % 2 == 0
            and all(s % 2 == 0 for s in v_cache.stride()[:3]) and v_cache.data_ptr() % 2 == 0)


@on_tensor_device
def sparse_attention(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table, *,
                     scale=None, block_size=128, out=None, return_lse=False, k_scale=None,
                     v_scale=None):
    """Exact GQA softmax attention over the tokens of the selected blocks (MSA's main branch).

    Args:
        q: [T, Hq, D] bf16/fp16, any strides.
        k_cache, v_cache: [P, B, Hkv, D] views with any strides (vLLM's packed
            [P, Hkv, B, 2*D] permuted, or the flash layout), bf16/fp16/fp8 e4m3.
        indices: int32 [T, H, K] from select_blocks; KV head g reads index head g*H//Hkv.
            Entries < 0 or >= the token's causal blocks are skipped, never dereferenced; a
            repeated id counts once.
        cu_seqlens_q, seq_lens, block_table: the step (int32); page ids are not range-checked.
        scale: softmax scale (D ** -0.5 when None).
        out: optional [T, Hq, D] in q's dtype, any strides, written in place.
        return_lse: also return the fp32 [T, Hq] natural-log LSE.
        k_scale, v_scale: per-tensor dequantisation scales of fp8 caches (a finite nonzero
            float, or a one-element fp32 device tensor, so a graph can change them).

    Returns:
        out, or (out, lse). An empty row gives 0 output and -inf LSE.
    """
    if not use_kernels(q):
        return reference.sparse_attention(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens,
                                          block_table, scale=scale, block_size=block_size,
                                          out=out, return_lse=return_lse, k_scale=k_scale,
                                          v_scale=v_scale)
    from .decode import _merge_splits_kernel, _sparse_attention_kernel
    from .prefill import _sparse_attention_tile_kernel, _tile_plan_kernel

    key = call_key((q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table,
                    q if out is None else out),
                   (out is None, bool(return_lse), v_cache.data_ptr() & 1
                    if isinstance(v_cache, torch.Tensor) else None, scale, block_size,
                    scale_key(k_scale), scale_key(v_scale), tuple(TUNING.values()), _num_splits,
                    num_sms))
    plan = _PLANS.get(key)
    if plan is None:
        check_attention_args(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table,
                             scale=scale, block_size=block_size, out=out, k_scale=k_scale,
                             v_scale=v_scale)
        plan = _plan(q, k_cache, v_cache, indices, scale, block_size, bool(return_lse))
        _PLANS.put(key, plan)
    p = plan
    num_tokens, num_heads, head_dim = q.shape
    device = q.device
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    # (each workspace allocation costs ~3 µs of host time per eager call: the LSE is made only
    # when returned or when the prefill tiles write it, and the split partials share one)
    if p.store_lse:
        lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=device)
    else:
        lse = out  # never written (STORE_LSE off): any tensor stands in
    if num_tokens == 0:
        return (out, lse) if return_lse else out
    num_kv_heads = k_cache.shape[2]
    splits = p.splits
    if splits > 1:
        # [T, Hq, splits, D] partial outputs, then [T, Hq, splits] partial LSEs, in one
        # allocation (the kernels find the LSEs after the T * Hq * splits * D outputs)
        part = torch.empty(num_tokens * num_heads * splits * (head_dim + 1),
                           dtype=torch.float32, device=device)
        counters = (arrival_counters(device, num_tokens * num_kv_heads, "attention") if p.fused
                    else lse)
    else:
        part = counters = lse
    has_scale, ks, vs = scale_args(k_scale, v_scale, device, lse)
    tile_qt = p.tile_qt
    if tile_qt > 1:
        num_tiles = -(-num_tokens // tile_qt)
        blocks = torch.empty((num_tiles, num_kv_heads), dtype=torch.int32, device=device)
        # per (tile, KV head): the union's page ids, block ids and token bits (prefill.py)
        union = torch.empty((num_tiles * num_kv_heads, 3, tile_qt * p.kp), dtype=torch.int32,
                            device=device)
        ws, waste, pdl = _tile_route(p, k_cache.data_ptr(), v_cache.data_ptr())
        launch_planned(
            _tile_plan_kernel, (p.serial, 0), (num_tiles, num_kv_heads),
            indices, cu_seqlens_q, seq_lens, block_table, blocks, union, waste,
            seq_lens.shape[0], *indices.stride(), *block_table.stride(), **p.plan_kwargs)
        if ws:
            _launch_tile_ws(q, k_cache, v_cache, cu_seqlens_q, seq_lens, out, lse, blocks, union,
                            ks, vs, p, has_scale)
        else:
            launch_planned(
                _sparse_attention_tile_kernel, (p.serial, 1), (p.tile_programs,),
                q, k_cache, v_cache, cu_seqlens_q, seq_lens, out, lse, blocks, union, ks, vs,
                p.sm_scale, seq_lens.shape[0], p.tile_items, *q.stride(), *k_cache.stride(),
                *v_cache.stride(), *out.stride(), *lse.stride(), HAS_SCALE=has_scale,
                **p.tile_kwargs)
    else:
        blocks, pdl = lse, False
    lse_strides = lse.stride() if p.store_lse else (0, 0)
    launch_planned(
        _sparse_attention_kernel, (p.serial, 5 if pdl else 2),
        (num_tokens, num_kv_heads, splits),
        q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table, out, lse, part,
        counters, blocks, ks, vs, p.sm_scale, seq_lens.shape[0], *q.stride(),
        *k_cache.stride(), *v_cache.stride(), *indices.stride(), *block_table.stride(),
        *out.stride(), *lse_strides, HAS_SCALE=has_scale,
        **(p.kwargs_overlap if pdl else p.kwargs))
    if splits > 1 and not p.fused:
        launch_planned(
            _merge_splits_kernel, (p.serial, 3), (num_tokens, num_heads),
            part, out, lse, *out.stride(), *lse_strides, **p.merge_kwargs)
    return (out, lse) if return_lse else out


def _tile_route(plan, k_address: int, v_address: int) -> tuple[bool, float, bool]:
    """A prefill step's taken tiles: whether the Gluon kernel runs them (planned, and K and V at
    16-byte aligned addresses, which TMA needs; else the Triton tile kernel), the plan launch's
    union-size threshold for that kernel (ws_waste or tile_waste), and whether the per-token
    launch is a programmatic dependent of the Gluon tiles (ws_pdl)."""
    ws = plan.tile_ws is not None and k_address % 16 == 0 and v_address % 16 == 0
    waste = plan.ws_waste if ws else float(TUNING["tile_waste"])
    return ws, waste, ws and plan.ws_pdl


def _ws_eligible(q, k_cache, v_cache, block_size: int, rows: int) -> bool:
    """Whether the prefill tiles can run prefill_ws.py's Gluon kernel (a shape and stride
    question, answered once per plan; base addresses are checked at launch): Hopper, a 16-bit
    q with K/V of its dtype or fp8 e4m3 (tile_ws_fp8), 64 rows per tile, head dim and block
    size 128 (the only ones the GPU tests cover), and K/V views a TMA descriptor describes
    ([pages, B, Hkv, D] with D contiguous and the other strides 16-byte multiples)."""
    if not TUNING["tile_ws"] or q.device.type != "cuda" or rows != 64:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if k_cache.dtype != q.dtype and not (k_cache.dtype == FP8 and TUNING["tile_ws_fp8"]):
        return False
    if capability(q.device) != (9, 0) or q.shape[2] != 128 or block_size != 128:
        return False
    if not gluon_hopper_available():
        return False
    sub = _ws_sub(k_cache.dtype == FP8, block_size)
    if block_size % sub or sub % 16:
        return False
    size = k_cache.dtype.itemsize
    return all(c.stride(3) == 1 and all(st * size % 16 == 0 for st in c.stride()[:3])
               for c in (k_cache, v_cache))


def _fp8_loader_on() -> bool:
    return bool(TUNING["ws_fp8_loader"]) and not TUNING["ws_fp8_qk"]


def _ws_sub(fp8: bool, block_size: int) -> int:
    """Keys per step of the Gluon tiles: ws_sub, or for fp8 K/V ws_sub_fp8 through the loader
    (its rings are 16-bit) and whole blocks otherwise: the fp8 forms that convert in the
    consumer gave wrong outputs on 64-key steps (exp/attn-ws-pipeline, exp/fp8-overlap, the
    same ones both; cause not found)."""
    if fp8:
        return block_size if not _fp8_loader_on() else min(block_size, TUNING["ws_sub_fp8"])
    return min(block_size, TUNING["ws_sub"])


def _ws_pair(fp8: bool) -> bool:
    """Whether the Gluon tiles take two consumers per program (PAIR): fp8 through the loader
    (ws_pair), 16-bit K/V (ws_pair_16)."""
    if not fp8:
        return bool(TUNING["ws_pair_16"])
    return bool(TUNING["ws_pair"]) and _fp8_loader_on() and bool(TUNING["ws_loader_roll"])


def _launch_tile_ws(q, k_cache, v_cache, cu_seqlens_q, seq_lens, out, lse, blocks, union, ks,
                    vs, plan, has_scale) -> None:
    """The Gluon tile launch (prefill_ws.py) with its TMA descriptors: K and V as their own
    [pages, B, Hkv, D] views, one [SUB, D] tile of one page and KV head per copy. Through the
    plan's cached launch like the Triton kernels (launch_planned): Triton's own launch path
    specialises every argument again per call."""
    from .prefill_ws import _sparse_attention_tile_ws_kernel
    if plan.tile_ws["kwargs"]["FP8_LOADER"]:
        k_src, v_src = k_cache, v_cache  # (the loader warpgroup reads them itself)
    else:
        box = (1, plan.tile_ws["sub"], 1, k_cache.shape[3])
        k_src, v_src = (tma_descriptor(c, c.shape, c.stride(), box) for c in (k_cache, v_cache))
    launch_planned(
        _sparse_attention_tile_ws_kernel, (plan.serial, 4), (plan.tile_items,),
        q, k_src, v_src, cu_seqlens_q, seq_lens, out, lse, blocks, union, ks, vs,
        plan.sm_scale, seq_lens.shape[0], *q.stride(), *out.stride(), *lse.stride(),
        *k_cache.stride()[:3], *v_cache.stride()[:3], HAS_SCALE=has_scale,
        **plan.tile_ws["kwargs"])


# launch plans by call key: the tensors' shapes, strides, dtypes and devices, the other
# arguments, V's address parity (the paired fp8 reads), the launch knobs and the functions that
# choose with them (so that tune.py's and tests' changes take effect)
_PLANS = PlanCache()


class _Plan:
    """A step shape's launch choices (a function of the call key only)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _plan(q, k_cache, v_cache, indices, scale, block_size, return_lse=True) -> _Plan:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    reason = attention_unsupported_reason(head_dim=head_dim, block_size=block_size,
                                          group_size=group, query_dtype=q.dtype,
                                          kv_dtype=k_cache.dtype, topk=indices.shape[2],
                                          device=q.device)
    if reason is not None:
        raise ValueError(reason)
    device = q.device
    topk = indices.shape[2]
    prefill = num_tokens >= TUNING["prefill_min_tokens"]
    small = num_tokens * num_kv_heads <= TUNING["small_pairs"]
    if prefill:
        # 64-key steps: bf16 8K chunk 4548 -> 4173 µs (5 programs per SM instead of 2); fp8
        # prefers whole blocks (4854 -> 5026 µs with 64)
        sub = TUNING["prefill_sub_fp8" if k_cache.dtype == FP8 else "prefill_sub"]
    else:
        sub = TUNING["small_sub" if small else "sub"]
    sub = min(block_size, sub)
    steps = topk * (block_size // sub)
    group_pad = max(1, _next_pow2(group))
    # (at most 16 tokens per tile: the plan keeps a bit per token beside 8 flag bits in an int32)
    tile_qt = min(TUNING["tile_rows"] // group_pad, 16) if prefill and TUNING["tile"] else 0
    pair = (tile_qt > 1 and _ws_pair(k_cache.dtype == FP8) and 2 * tile_qt <= 16
            and tile_qt * group_pad == 64 and _ws_eligible(q, k_cache, v_cache, block_size, 64))
    if pair:
        tile_qt *= 2  # two consumers' tokens per tile (prefill_ws.py's PAIR)
    ieee = q.dtype == torch.float32
    f16_compute = k_cache.dtype == FP8 and not ieee and TUNING["fp8_f16_compute"]
    v_pairs = f16_compute and TUNING["fp8_v_pairs"] and _reads_as_pairs(v_cache)
    # (fp8 only: with 16-bit K/V, decode B = 64-128 measured 0.2-1.2 µs slower in two calls,
    # an 8K chunk on the per-token kernel 1.5% faster)
    lazy_sum = f16_compute and TUNING["lazy_row_sum"]
    # a prefill step's grid fills the GPU without splits; with tiles it takes none (a token the
    # tile kernel did is skipped by every split program, so nothing would merge its partials)
    key_bytes = 2 * head_dim * k_cache.dtype.itemsize  # K and V per key (split_cost "model")
    splits = 1 if tile_qt > 1 else _num_splits(
        num_tokens, num_kv_heads, steps, device,
        TUNING["resident" if k_cache.dtype == FP8 else "resident_16"], sub, key_bytes)
    if (v_pairs and not prefill and not small and device.type == "cuda"
            and num_tokens * num_kv_heads * splits > TUNING["resident"] * num_sms(device)):
        # more than one round of programs: 64-key steps, packed for 4 programs per SM (107
        # registers, 38 KB), a finer grain that leaves a shorter last round
        sub = min(block_size, TUNING["rounds_sub"])
        steps = topk * (block_size // sub)
        splits = _num_splits(num_tokens, num_kv_heads, steps, device, TUNING["rounds_resident"],
                             sub, key_bytes)
    steps_per_split = -(-steps // splits)
    splits = -(-steps // steps_per_split)
    fused = TUNING["fused_merge"] and splits <= TUNING["fused_max_splits"]
    # the merge launch, if any, starts early (the decode launch triggers it)
    pdl = TUNING["pdl"] and device.type == "cuda" and splits > 1 and not fused
    warps = TUNING["prefill_warps" if prefill else "small_warps" if small else "warps"]
    stages = TUNING[("prefill_stages_fp8" if k_cache.dtype == FP8 else "prefill_stages")
                    if prefill else "stages"]
    if (not prefill and k_cache.dtype != FP8 and device.type == "cuda"
            and num_tokens * num_kv_heads * splits > TUNING["resident_16"] * num_sms(device)):
        # 16-bit K/V, more than one round of programs: fewer stages (see TUNING)
        stages = TUNING["rounds_stages_16"]
    # (serial: the plan's launches are keyed on it, ops/common/launch.py's launch_planned; the
    # call key fixes every int and dtype those launches pass)
    plan = _Plan(serial=next(plan_serials), splits=splits, fused=fused,
                 tile_qt=tile_qt if tile_qt > 1 else 0,
                 # the tile kernel always writes the LSE (the per-token kernel then too)
                 store_lse=return_lse or tile_qt > 1,
                 sm_scale=head_dim ** -0.5 if scale is None else float(scale),
                 kp=_next_pow2(topk))
    if tile_qt > 1:
        fp8 = k_cache.dtype == FP8
        items = -(-num_tokens // tile_qt) * num_kv_heads
        persistent = TUNING["tile_persistent_fp8" if fp8 else "tile_persistent"]
        # (persistent under the interpreter: 3 programs, each walking several items)
        plan.tile_items = items
        plan.tile_programs = items if not persistent else min(
            items, TUNING["tile_resident"] * num_sms(device) if device.type == "cuda" else 3)
        plan.plan_kwargs = dict(NUM_KV_HEADS=num_kv_heads, NUM_INDEX_HEADS=indices.shape[1],
                                QT=tile_qt, BLOCK=block_size, TOPK=topk, KP=plan.kp,
                                SORTED=tile_qt * plan.kp >= TUNING["tile_plan_sort_min"],
                                num_warps=TUNING["tile_plan_warps"])
        plan.tile_kwargs = dict(
            NUM_KV_HEADS=num_kv_heads, G=group, GP=group_pad, QT=tile_qt, D=head_dim,
            BLOCK=block_size, KP=plan.kp,
            SUB=min(block_size, TUNING["tile_sub_fp8" if fp8 else "tile_sub"]),
            IEEE=ieee, F16_COMPUTE=f16_compute, LAZY_MASK=TUNING["tile_lazy_mask"],
            PERSISTENT=persistent, num_warps=TUNING["tile_warps"],
            num_stages=TUNING["tile_stages_fp8" if fp8 else "tile_stages"])
        plan.tile_ws = None
        if pair or _ws_eligible(q, k_cache, v_cache, block_size, tile_qt * group_pad):
            loader = fp8 and _fp8_loader_on()
            ws_sub = _ws_sub(fp8, block_size)
            stages_k = (TUNING["ws_pair_stages_k"] if pair else
                        TUNING["ws_stages_k_fp8" if fp8 else "ws_stages_k"]
                        or TUNING["ws_stages_fp8" if fp8 else "ws_stages"])
            plan.tile_ws = dict(
                sub=ws_sub,
                kwargs=dict(SUB=ws_sub, D=head_dim,
                            NUM_KV_HEADS=num_kv_heads, G=group, GP=group_pad, QT=tile_qt,
                            KP=plan.kp, BLOCK=block_size,
                            STAGES_K=stages_k,
                            STAGES_V=TUNING["ws_pair_stages_v" if pair else
                                            "ws_stages_fp8" if fp8 else "ws_stages"],
                            LAZY_MASK=TUNING["ws_lazy_mask"], FP8=fp8,
                            FP8_QK=fp8 and TUNING["ws_fp8_qk"],
                            KEYS_EARLY=TUNING["ws_keys_early"],
                            PRODUCER_REGS=TUNING["ws_pair_loader_regs" if pair and loader
                                                 else "ws_loader_regs" if loader else
                                                 "ws_producer_regs"],
                            FP8_LOADER=loader,
                            LOADER_ROLL=loader and TUNING["ws_loader_roll"],
                            PAIR=pair, LOADER_EAGER=pair and TUNING["ws_pair_eager"],
                            CONSUMER_REGS=TUNING["ws_pair_consumer_regs"] if pair else 0,
                            num_warps=4,
                            maxnreg=TUNING["ws_pair_maxnreg" if pair else "ws_maxnreg"]))
        # the Gluon tiles' own union-size threshold (tile_waste's, per dtype: ws_waste)
        plan.ws_waste = float(TUNING["ws_waste_fp8" if fp8 else "ws_waste"])
        plan.ws_pdl = plan.tile_ws is not None and TUNING["ws_pdl"]
        if plan.ws_pdl:
            plan.tile_ws["kwargs"]["PDL"] = True
    plan.kwargs = dict(
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, NUM_INDEX_HEADS=indices.shape[1],
        G=group, M=max(16, _next_pow2(group)), D=head_dim, BLOCK=block_size, TOPK=topk,
        KP=plan.kp, SUB=sub, STEPS=steps_per_split, SPLITS=splits, IEEE=ieee,
        F16_COMPUTE=f16_compute, FUSED_MERGE=fused, TILE_QT=plan.tile_qt, V_PAIRS=v_pairs,
        PTX=device.type == "cuda", GUESS=TUNING["request_guess"], SP=_next_pow2(splits),
        PDL=pdl, STORE_LSE=plan.store_lse, LAZY_SUM=lazy_sum, num_warps=warps,
        num_stages=stages)
    if TUNING["first_pdl"] and device.type == "cuda" and tile_qt <= 1:
        # no tile launch before it: the split launch is the call's first (see TUNING)
        plan.kwargs.update(WAIT_PRIOR=True, launch_pdl=True)
    if (lazy_sum and prefill and TUNING["lazy_sum_maxnreg"] and device.type == "cuda"
            and v_pairs and group_pad <= 16 and sub == 128 and warps == 4):
        # the elementwise sum's [16, SUB] tile took fp8's 128-key, 4-warp program from 168 to
        # 178 registers (3 -> 2 programs per SM); under a cap of 168 ptxas fits it without
        # spills, which a prefill step's many rounds of programs need (180 uncapped at
        # 07bb7bb, 168 and no spills under the cap: resources.py with LAZY_SUM=1 and
        # MAXNREG=168). Not on decode steps (one round, packed for 2 per SM: with the cap
        # B = 8 measured 1.2-1.4 µs slower), nor on 64-key steps, where the cap makes ptxas
        # take more (107 -> 128 registers on 4 warps, 75 -> 118 on 8: 3 -> 2 programs per SM;
        # `resources.py` with MAXNREG)
        plan.kwargs["maxnreg"] = TUNING["lazy_sum_maxnreg"]
    # the per-token launch after the Gluon tiles: a programmatic dependent (ws_pdl)
    plan.kwargs_overlap = dict(plan.kwargs, WAIT_TILES=True, launch_pdl=True)
    plan.merge_kwargs = dict(NUM_HEADS=num_heads, D=head_dim, SPLITS=splits,
                             SP=_next_pow2(splits), PDL=pdl, STORE_LSE=plan.store_lse,
                             num_warps=4, launch_pdl=pdl)
    return plan


@on_tensor_device
def sparse_page_table(indices, cu_seqlens_q, seq_lens, block_table, *, num_kv_heads,
                      block_size=128, sub_page_size=16):
    """A selection as a page table for any paged kernel that runs one query row per table row.

    Args:
        indices: int32 [T, H, K] (select_blocks' output); KV head g reads index head g*H//Hkv.
        cu_seqlens_q, seq_lens, block_table: the step (int32).
        num_kv_heads: Hkv; rows are head-minor, row = t * Hkv + g.
        sub_page_size: S, a power of two dividing block_size: the K/V cache is then read as
            [P * B/S, S, Hkv, D] (a view of a flash-layout cache).

    Returns:
        (pages int32 [T*Hkv, K*B/S], context_lens int32 [T*Hkv]): sub-page ids of the full
        selected blocks ascending, then the token's own block cut to its causal sub-pages, 0 in
        unused columns; context_len = full blocks' tokens + the own block's p % B + 1.
    """
    if not use_kernels(indices):
        return reference.sparse_page_table(indices, cu_seqlens_q, seq_lens, block_table,
                                           num_kv_heads=num_kv_heads, block_size=block_size,
                                           sub_page_size=sub_page_size)
    from .page_table import _sparse_page_table_kernel

    check_page_table_args(indices, cu_seqlens_q, seq_lens, block_table,
                          num_kv_heads=num_kv_heads, block_size=block_size,
                          sub_page_size=sub_page_size)
    num_tokens, num_index_heads, topk = indices.shape
    per_block = block_size // sub_page_size
    pages = torch.empty((num_tokens * num_kv_heads, topk * per_block), dtype=torch.int32,
                        device=indices.device)
    lens = torch.empty(num_tokens * num_kv_heads, dtype=torch.int32, device=indices.device)
    if num_tokens:
        launch(_sparse_page_table_kernel, (num_tokens, num_kv_heads),
               indices, cu_seqlens_q, seq_lens, block_table, pages, lens, seq_lens.shape[0],
               *indices.stride(), *block_table.stride(), *pages.stride(),
               NUM_KV_HEADS=num_kv_heads, NUM_INDEX_HEADS=num_index_heads, TOPK=topk,
               KP=_next_pow2(topk), BLOCK=block_size, SUB=sub_page_size, num_warps=1)
    return pages, lens
