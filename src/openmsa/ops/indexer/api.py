# SPDX-License-Identifier: Apache-2.0
"""Public index-branch ops: validation, then the Triton kernels (CUDA, or CPU under
TRITON_INTERPRET=1) or the reference (CPU)."""

from __future__ import annotations

import torch

from ..._checks import FP8, HALF
from ..._dispatch import next_pow2 as _next_pow2
from ..._dispatch import (capability, gluon_hopper_available, num_sms, on_tensor_device,
                           use_kernels)
from ...support import indexer_unsupported_reason
from ..common.counters import arrival_counters
from ..common.launch import (PlanCache, call_key, launch_planned, plan_serials,
                             tma_descriptor)
from . import reference
from .checks import check_indexer_args, check_select_args

__all__ = ["block_scores", "select_blocks"]

# requests with q_len <= SMALL_Q (decode, speculative verify) take the per-request launch
SMALL_Q = 16
# the request launch's q_len bound when the caller says the step has no long request (max_q_len)
ANY_Q = 2 ** 30
# rows (token, head pairs) of one tensor-core tile in the decode launch (the prefill launch's
# is TUNING["prefill_rows"])
DECODE_ROWS = 16
# launch knobs, read at each call so that benchmarks/tune.py can sweep them. The prefill tile
# launch has its own warps/stages per cache type: a 16-bit key tile is twice the bytes, and 2
# stages on 4 warps fit 2 programs per SM for bf16 (13% faster at 8K@120K than 3 stages on 8
# warps, 1 program), while fp8 is best with 3 stages (docs/performance.md)
TUNING = dict(decode_waves=2, decode_warps=4, decode_stages=3, decode_max_bps=64, decode_min_bps=1,
              decode_keys_as_rows=True, prefill_rows=128, prefill_bps=32, prefill_warps=4,
              prefill_stages=2, prefill_warps_fp8=4, prefill_stages_fp8=3, select_warps=4,
              select_sort_waves=2, select_search_scale=1, select_scratch=64, select_segment=1024,
              pdl=True, first_pdl=False, select_sort_fused=False, decode_pages_early=True, decode_one_loop=True,
              decode_split_major=False, tile_quick_exit=True, tile_overlap=False,
              prefill_reverse_tiles=True, prefill_reverse_splits=False,
              prefill_split_major=False, select_chunk=128,
              use_max_q_len=True, select_segment_fill=True, select_chunk_min_waves=16,
              prefill_ws=True, prefill_ws_16=True, ws_bps=0, ws_waves=4, ws_stages=6,
              ws_stages_16=3, ws_consumer_regs=112, ws_consumers=4, ws_q_in_regs=False,
              ws_maxima_convert=True, ws_skip_idle=True, ws_overlap=True,
              select_group_bound=True, select_group_min_blocks=2048, select_group_pack=True,
              select_short_rows=True, select_short_max=1024, select_short_warps=1,
              select_short_tpr=4, select_short_pdl=True, tile_one_request=True,
              select_short_reverse=True)
# select_short_rows: on Hopper, a selection launch of many rows of at most select_short_max
# blocks (a prefill chunk with little context, a large decode step at short context) runs
# select_rows.py's Gluon kernel, a row in select_short_tpr threads (select_short_warps warps per
# program), instead of one warp per row. Measured (tune.py --only indexer-prefill, 51983df, one
# call, interleaved): the selection of an 8K chunk with no context 22.5 -> 15.9 µs, the whole
# select_blocks 57.6 -> 51.1 (fp8), 75.4 -> 67.7 (bf16); tpr 1 / 2 / 8: 18.5 / 17.0 / 16.4.
# Rows wider than 64 blocks lie 16 blocks per thread, up to a warp per row (1024 blocks: 32
# per thread, 160 registers). select_short_max 64 -> 1024 (tune.py --only
# indexer-prefill,indexer-decode, f727c10, one call, interleaved, device µs): 8K@120K fp8
# 928.5 -> 900.6 (its selection 168.8 -> 138.0), bf16 1474.1 -> 1440.0; the 24 decode shapes
# within -1.1% / +1.8% (B = 64 128K q_len 4 259.1 -> 260.8, B = 128 32K q_len 4 134.3 ->
# 134.8, bf16 B = 32 128K q_len 4 255.0 -> 252.2).
# select_short_reverse: that kernel's programs take their rows from the last (a chunk's longest
# rows first, the shortest in the last partial wave). Measured with the kernel's float counts
# and lean masks (tune.py --only indexer-prefill, 08299b3, one call, interleaved, device µs):
# 8K@0 fp8 45.9 -> 45.2, its selection 12.4 -> 12.1; without them 47.6 -> 47.4.
# select_short_pdl: that launch is a programmatic dependent of the scoring launch before it
# (request lookups first, then griddepcontrol.wait before the first score is read)
# select_group_bound: rows of at least select_group_min_blocks blocks on the threshold path
# (prefill after a long context) take select.py's group-bound path: a memory-bound launch of
# 16-block group maxima, then one program per row reading only the groups that can hold a pick;
# select_group_pack: of those groups' blocks only the keys reaching the bound are searched
# (packed into the scratch row), not all of them
# prefill_ws, prefill_ws_16: on Hopper, the tile launch of an fp8 (16-bit) cache is scores_ws.py's
# warp-specialised Gluon kernel where the layouts allow TMA (_ws_eligible); ws_waves programs
# per SM in the grid (each split as long as that allows), or ws_bps blocks per split if set;
# ws_stages key buffers; ws_consumer_regs registers per consumer thread (setmaxnreg)
# ws_maxima_convert: a consumer reads its chunk of maxima back one block's 32 rows per warp
# instruction and converts the tile to the store's layout in registers (the compiler's scratch),
# instead of reading 8 blocks x 4 rows per instruction, which hit each bank 8 times (Nsight
# Compute's source view: 7.2M of 110M shared-memory wavefronts excess). Measured (tune.py
# --only indexer-prefill, 029d522 + this knob, one call, off / on twice): fp8 scoring after
# 120K 831.3 / 819.2 and 832.4 / 819.2 µs, the 8K chunk after 1M 7973 / 7918 and 8019 / 7927,
# bf16 after 1M 12595 / 12376 and 12590 / 12376; equal with no context (58 µs)
# ws_skip_idle: a Gluon tile program whose split lies past the causal edge of every request in
# its tile ends after its one look at the requests, before loading its queries (192 of the 512
# programs of an 8K chunk with no context). Measured (tune.py --only indexer-prefill, one call,
# on / off): 8K@0 fp8 51.6 / 51.4 µs, bf16 67.9 / 67.8: no difference (kept: those programs
# read nothing now). ws_overlap: the Gluon tile launch is a programmatic dependent of the
# request launch (which finds no short request in a prefill chunk and takes ~1 µs), waiting
# for it only at its end (tile_overlap is the same for the Triton tile launch). With
# select_short_pdl (above), 8K@0 fp8 graph-replayed call 53.7 -> 52.1-52.4 µs; device time
# equal (eagerly the host launches the Gluon kernel long after the request launch has run)
# decode_pages_early: the decode launch loads its split's page ids before (not after) cu_seqlens_q
# and seq_lens, one memory latency less before the first key load; decode_one_loop: one
# causal-masked loop over the split (the mask costs little on 16 rows) instead of an unmasked
# loop and a masked one, whose pipelines drain and refill in between. Together (tune.py, one
# call, fe52e65): fp8 B = 1 128K 12.0 -> 11.2 µs, B = 32 32K 44.1 -> 42.6, bf16 B = 1 128K
# 16.4 -> 15.0; the large shapes unchanged
# tile_quick_exit, tile_overlap: a decode or verify step of more than SMALL_Q tokens launches the
# prefill tile launch too (no host sync can tell that no request is long); its programs look at
# their requests in one vector load and end (quick exit), and the launch is a programmatic
# dependent of the request launch, so it runs beside it rather than after (overlap)
# tile_one_request: a step of one request and more than SMALL_Q tokens makes the tile launch
# only, taking the request whatever its q_len: no request launch (~1 µs of device time in a
# prefill chunk, where it finds no short request)
# prefill_reverse_tiles, prefill_reverse_splits: the tile launch's programs dispatched last tile
# first and/or last split first; in the causal triangle of a chunk with little context the
# longest programs (last tiles, last split) were dispatched last. prefill_split_major: a tile's
# splits consecutive. Measured (tune.py, 4b1998d and 1feac0c): both reversed and split-major,
# 8K@0 fp8 77.5 -> 65.1 µs, but 8K after 1M bf16 17.3 -> 21.7 ms (the programs running together
# read different keys instead of sharing them in L2); both reversed, tile-major: 8K@0 fp8
# 75.1 -> 62.3, bf16 108 -> 92, but fp8 after 120K 1119 -> 1166, after 1M 9.8 -> 10.3 ms; tiles
# alone (9322b1a, on): 8K@0 fp8 75.7 -> 65.0, bf16 109 -> 85, 120K and 1M equal (within 1%);
# splits alone cost the fp8 chunks after context 4% and gave 8K@0 nothing
# use_max_q_len: False ignores the caller's max_q_len hint (to measure what the hint buys)
# select_chunk: the search path reads its segment in chunks of this many blocks (0: at once):
# offline 157 -> 56 registers at 1024 blocks per one-warp program (12 -> 32 programs per SM);
# tune.py (4b1998d, 1feac0c): selection of an 8K chunk after 120K 184 -> 169 µs and
# 189 -> 172, after 1M 1520 -> 1442 and 1452 -> 1343 (less than the occupancy promised: the
# selection is not bound by the number of programs per SM alone). select_chunk_min_waves: only
# launches of at least this many programs per SM chunk; a decode step's 1024-2048 programs
# fit at once unchunked, and there the chunks' serial loads cost (tune.py, 41c760d: TP1 fp8
# B = 64 128K q_len 4 263.2 -> 259.2 µs without chunks, 1M B = 8 q_len 4 268.1 -> 264.9, bf16
# B = 32 128K q_len 4 259.1 -> 255.1, B = 128 32K q_len 4 135.2 -> 133.5)
# select_segment: blocks of a score row per selection program (a 1M-token row of 8192 blocks
# takes 8, merged by a second launch). select_segment_fill: on the sort path, 256- or 512-block
# segments while the program count stays under the sort path's limit (few long rows: TP4
# decode, B = 1 at 1M): tune.py (a569483) TP4 fp8 B = 64 128K 249.2 -> 245.7 µs, bf16 B = 8 128K
# q_len 4 71.6 -> 69.2, fp8 1M B = 1 40.1 -> 39.6; TP4 B = 32 128K 127.9 -> 128.8, the rest
# within 0.6 µs. (Launching the search path early after a decode step's one-wave scoring
# launch, tried beside it, cost B = 128 32K q_len 4 131.8 -> 135.2 and was removed.)
# pdl: the selection and merge launches are programmatic dependent launches (CUDA only): each
# starts while its predecessor runs and waits (griddepcontrol.wait) before reading its output,
# which hides a launch's latency on the small decode steps: graph-replayed call time at B = 1
# 9.6 -> 7.1 µs (32K fp8), 17.2 -> 13.5 (128K), 56.7 -> 50.2 (1M); device time unchanged.
# select_sort_fused: on the sort path (few selection programs: decode at small batch), a row
# cut into several segments is merged by its last segment program to finish (an arrival counter
# per row, ops/common/counters.py) instead of a merge launch. The tail after the scoring launch
# at TP4 B = 8 128K (profile_case.py --offsets, d09637e) was 2.4 µs of segment sorts and then
# 1.5 µs of merge launch. Measured (tune.py --only indexer-decode --metric both --cases 'B1 L|B8
# L', e04c7d5, one call, off / on / off / on): B = 1 128K fp8 11.2 / 11.3 -> 11.0 / 11.0 µs, the
# other 10 rows within 0.4 µs either way (B = 8 128K 38.6 / 38.4 -> 38.8 / 38.4): off.
# first_pdl: the request launch (a decode or verify step's first) is a programmatic dependent
# of whatever kernel precedes the call on the stream, and waits (griddepcontrol.wait) before
# anything else: its programs may start while that kernel's last ones finish, which hides the
# call's first launch latency (the 1.7-3.4 µs of idle a graph replay showed before it).
# Measured (tune.py --only indexer-decode --metric both, f6ba729, one call, off / on): every
# one of the 25 rows within 0.6 µs either way (this op's call was already within 2 µs of its
# device time): off.


def _programs_per_wave(device: torch.device) -> int:
    return num_sms(device) if device.type == "cuda" else 4


def _programs_wanted(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return TUNING["decode_waves"] * num_sms(device)


def _raise_if_unsupported(index_q, index_cache, block_size, topk) -> None:
    reason = indexer_unsupported_reason(
        num_index_heads=index_q.shape[1], index_head_dim=index_q.shape[2], block_size=block_size,
        topk=topk, query_dtype=index_q.dtype, cache_dtype=index_cache.dtype,
        device=index_q.device)
    if reason is not None:
        raise ValueError(reason)


def launch_block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, scores,
                        block_size: int, max_q_len: int | None = None, plan=None) -> None:
    """Write scores[t, h, b] for every block b < ceil(seq_len / B) of each token's request
    (entries past the token's own causal blocks get -inf; nothing else is written).

    max_q_len <= SMALL_Q (the caller's bound on every q_len): the request launch takes every
    request, whatever its q_len, and the tile launch is not made. A bound that is wrong leaves
    the scores exact: a long request then goes through the request launch's token loop, slowly.
    plan: _scores_plan's result for these shapes (computed here when None)."""
    from .scores import _block_scores_kernel

    if plan is None:
        plan = _scores_plan(index_q, index_cache, seq_lens.shape[0], block_table.shape[1],
                            block_size, max_q_len)
    if not plan:
        return
    args = (index_q, index_cache, cu_seqlens_q, seq_lens, block_table, scores, seq_lens.shape[0],
            index_q.shape[0], *index_q.stride(), *index_cache.stride(), *block_table.stride(),
            *scores.stride())
    for serial, grid, kwargs in plan:
        if "GLUON" in kwargs:
            if index_q.data_ptr() % 16 == 0 and index_cache.data_ptr() % 16 == 0:
                _launch_ws(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, scores,
                           grid, kwargs["GLUON"], serial)
                continue
            serial, grid, kwargs = kwargs["FALLBACK"]  # TMA needs 16-byte aligned bases
        launch_planned(_block_scores_kernel, serial, grid, *args, **kwargs)


def _scores_plan(index_q, index_cache, num_requests: int, max_blocks: int, block_size: int,
                 max_q_len: int | None) -> list:
    """The scoring launches (serial, grid, keyword arguments) for these shapes: the request
    launch (unless the step is one request of more than SMALL_Q tokens) and, unless every
    request is known to be short, the tile launch."""
    num_tokens, num_heads, head_dim = index_q.shape
    if num_tokens == 0 or num_requests == 0 or max_blocks == 0:
        return []
    # a decode/verify step: one launch (the tile launch of a step of > SMALL_Q tokens costs a
    # launch even when its programs find no long request)
    hinted = TUNING["use_max_q_len"] and max_q_len is not None and max_q_len <= SMALL_Q
    only_requests = num_tokens <= SMALL_Q or hinted
    hp = _next_pow2(num_heads)
    dip = max(16, _next_pow2(head_dim))
    cast_k = index_q.dtype in HALF and index_cache.dtype == FP8
    ieee = index_q.dtype == torch.float32
    # the GPU's max skips NaN by itself; the interpreter's does not (see scores.py)
    common = dict(H=num_heads, HP=hp, DI=head_dim, DIP=dip, BLOCK=block_size,
                  CAST_K=cast_k, IEEE=ieee, MAX_SKIPS_NAN=index_q.is_cuda,
                  PDL=_pdl(index_q.device))
    # decode/verify: enough splits of each request's blocks to fill the GPU
    splits_wanted = -(-_programs_wanted(index_q.device) // num_requests)
    bps = min(TUNING["decode_max_bps"],
              max(TUNING["decode_min_bps"], _next_pow2(-(-max_blocks // splits_wanted))))
    rows_t = max(1, DECODE_ROWS // hp)
    grid = (num_requests, -(-max_blocks // bps))
    split_major = TUNING["decode_split_major"]
    if split_major:
        grid = grid[::-1]
    # keys as the MMA's rows (see scores.py); the fp32 reference-precision path keeps the IEEE dot
    keys_as_rows = TUNING["decode_keys_as_rows"] and not ieee
    # skipped by the hint alone, the tile launch's requests go to the request launch, which then
    # takes any q_len (ANY_Q); with T <= SMALL_Q no request can be longer, and the bound stays
    any_q = only_requests and num_tokens > SMALL_Q
    # one request in a step of more than SMALL_Q tokens: it is a prefill chunk (or a step of
    # mostly padding tokens), so the tile launch takes it whatever its q_len and the request
    # launch, which would find nothing to do, is not made
    one_request = TUNING["tile_one_request"] and num_requests == 1 and not only_requests
    # (each launch with a serial number: launch_planned's key, see ops/common/launch.py; the
    # call key fixes every int and dtype the launches pass)
    # first_pdl: the request launch, the op's first, as a programmatic dependent of the
    # kernel before the call (see TUNING)
    first_pdl = TUNING["first_pdl"] and common["PDL"]
    launches = [] if one_request else [(next(plan_serials), grid, dict(
        BPS=bps, TILE_MODE=False, ROWS_T=rows_t, **common, SMALL_Q=ANY_Q if any_q else SMALL_Q,
        KEYS_AS_ROWS=keys_as_rows, num_warps=TUNING["decode_warps"],
        num_stages=TUNING["decode_stages"], table_width=max_blocks,
        PAGES_EARLY=TUNING["decode_pages_early"], ONE_LOOP=TUNING["decode_one_loop"],
        SPLIT_MAJOR=split_major,
        **(dict(WAIT_PRIOR=True, launch_pdl=True) if first_pdl else {})))]
    # prefill chunks: tiles of packed tokens; with T <= SMALL_Q no request can be long
    if only_requests:
        return launches
    rows_t = max(1, TUNING["prefill_rows"] // hp)
    fp8 = index_cache.dtype == FP8
    bps = TUNING["prefill_bps"]
    grid = (-(-num_tokens // rows_t), -(-max_blocks // bps))
    split_major = TUNING["prefill_split_major"]
    if split_major:
        grid = grid[::-1]
    # (overlap: a programmatic dependent of the request launch, when there is one)
    overlap = TUNING["tile_overlap"] and common["PDL"] and not one_request
    tile_small_q = 0 if one_request else SMALL_Q
    launches.append((next(plan_serials), grid, dict(
        BPS=bps, TILE_MODE=True, ROWS_T=rows_t, **common, SPLIT_MAJOR=split_major,
        REVERSE_TILES=TUNING["prefill_reverse_tiles"],
        REVERSE_SPLITS=TUNING["prefill_reverse_splits"], SMALL_Q=tile_small_q,
        KEYS_AS_ROWS=False,
        QUICK_EXIT=TUNING["tile_quick_exit"], WAIT_AT_END=overlap, launch_pdl=overlap,
        num_warps=TUNING["prefill_warps_fp8" if fp8 else "prefill_warps"],
        num_stages=TUNING["prefill_stages_fp8" if fp8 else "prefill_stages"])))
    if _ws_eligible(index_q, index_cache, block_size):
        # the Gluon kernel instead, the Triton launch kept for a base address TMA cannot take
        from .scores_ws import CH, WG_ROWS
        ws_overlap = TUNING["ws_overlap"] and common["PDL"]
        # (alone, it is no programmatic dependent, but its programs still let the selection
        # launch after it start early: WAIT_AT_END, whose wait then returns at once)
        wait_at_end = ws_overlap or (one_request and common["PDL"])
        rows_t = TUNING["ws_consumers"] * WG_ROWS.value // num_heads
        tiles = -(-num_tokens // rows_t)
        # splits for ws_waves programs per SM (one program fits on an SM), whole chunks of CH
        splits = max(1, round(TUNING["ws_waves"] * num_sms(index_q.device) / tiles))
        bps = TUNING["ws_bps"] or -(-max(1, -(-max_blocks // splits)) // CH.value) * CH.value
        gluon = dict(bps=bps, H=num_heads, SMALL_Q=tile_small_q,
                     STAGES=TUNING["ws_stages" if fp8 else "ws_stages_16"],
                     CONSUMER_REGS=TUNING["ws_consumer_regs"],
                     CONSUMERS=TUNING["ws_consumers"], Q_IN_REGS=TUNING["ws_q_in_regs"],
                     CONVERT=TUNING["ws_maxima_convert"], SKIP_IDLE=TUNING["ws_skip_idle"],
                     REVERSE_TILES=TUNING["prefill_reverse_tiles"], num_warps=4,
                     WAIT_AT_END=wait_at_end, launch_pdl=ws_overlap and not one_request)
        launches.append((next(plan_serials), (tiles, -(-max_blocks // bps)),
                         dict(GLUON=gluon, FALLBACK=launches.pop())))
    return launches


def _ws_eligible(index_q, index_cache, block_size: int) -> bool:
    """Whether the tile launch can be scores_ws.py's Gluon kernel (a shape and stride question,
    answered once per plan; base addresses are checked at launch): Hopper, q and cache of one
    dtype (fp8, or 16-bit with prefill_ws_16), 128-key blocks, index head dim 128, a power-of-two
    number of heads, q rows [T * H, DI] and cache rows [pages * BLOCK, DI] each one strided
    2-D array (what a TMA descriptor describes)."""
    if index_q.device.type != "cuda" or index_q.dtype != index_cache.dtype:
        return False
    if not TUNING["prefill_ws" if index_q.dtype == FP8 else "prefill_ws_16"]:
        return False
    if index_q.dtype not in (FP8, torch.bfloat16, torch.float16):
        return False
    if capability(index_q.device) != (9, 0) or not gluon_hopper_available():
        return False
    num_tokens, num_heads, head_dim = index_q.shape
    pages = index_cache.shape[0]
    return (block_size == 128 and head_dim == 128 and num_heads & (num_heads - 1) == 0
            and index_q.stride(2) == 1 and index_q.stride(1) == head_dim
            and index_q.stride(0) == num_heads * head_dim
            and index_cache.stride(2) == 1 and index_cache.stride(1) == head_dim
            and index_cache.stride(0) == block_size * head_dim
            and pages * block_size < 2 ** 31 and num_tokens * num_heads < 2 ** 31)


def _launch_ws(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, scores, grid, kw,
               serial=None):
    """The Gluon tile launch (scores_ws.py) with its TMA descriptors: q as [T * H, DI] rows in
    64-row boxes, the cache as [pages * BLOCK, DI] rows in one-block boxes; through the plan's
    cached launch (launch_planned, keyed on `serial`) when there is one."""
    from .scores_ws import WG_ROWS, _block_scores_ws_kernel
    num_tokens, num_heads, head_dim = index_q.shape
    rows_q, rows_k = num_tokens * num_heads, index_cache.shape[0] * index_cache.shape[1]
    q_desc = tma_descriptor(index_q, (rows_q, head_dim), (head_dim, 1),
                            (WG_ROWS.value, head_dim))
    k_desc = tma_descriptor(index_cache, (rows_k, head_dim), (head_dim, 1),
                            (index_cache.shape[1], head_dim))
    args = (q_desc, k_desc, cu_seqlens_q, seq_lens, block_table, scores, seq_lens.shape[0],
            num_tokens, *block_table.stride(), *scores.stride(), kw["bps"])
    kwargs = {k: v for k, v in kw.items() if k != "bps"}
    if serial is None:
        _block_scores_ws_kernel[grid](*args, **kwargs)
    else:
        launch_planned(_block_scores_ws_kernel, serial, grid, *args, **kwargs)


def _pdl(device: torch.device) -> bool:
    return TUNING["pdl"] and device.type == "cuda"


def _selection_layout(rows: int, max_blocks: int, kp: int, per_wave: int) -> tuple[int, bool]:
    """(blocks per selection program, whether the launch takes the sort path) for `rows` score
    rows of max_blocks blocks; a function of shapes only (graph-safe)."""

    def segment(width):
        return max(2 * kp, min(width, _next_pow2(max(max_blocks, 1))))

    def programs(width):
        return rows * -(-max(max_blocks, 1) // segment(width))

    # few programs (decode at small batch): a bitonic top-k on 4 warps has the shortest latency;
    # many (prefill, large batches): the threshold search on one warp per row has the most
    # throughput, on segments select_search_scale times longer (select.py; docs/performance.md)
    sort_limit = TUNING["select_sort_waves"] * per_wave
    if programs(TUNING["select_segment"]) >= sort_limit:
        return segment(int(TUNING["select_segment"] * TUNING["select_search_scale"])), False
    if TUNING["select_segment_fill"]:
        # few rows of many blocks (TP4 decode, B = 1 at 1M): shorter segments, as many
        # programs as the sort path takes; each sort is shorter, a merge launch joins them
        for width in (256, 512):
            if width < segment(TUNING["select_segment"]) and programs(width) < sort_limit:
                return segment(width), True
    return segment(TUNING["select_segment"]), True


def launch_select(scores, cu_seqlens_q, seq_lens, out, *, topk, init_blocks, local_blocks,
                  block_size, plan=None) -> None:
    """Top-k per (token, head) row of `scores` into `out`; rows are cut into segments of
    TUNING["select_segment"] blocks (one program each), merged by a second launch when there
    are several. plan: _select_plan's result for these shapes (computed here when None)."""
    from .select import _merge_topk_kernel, _segment_topk_kernel

    num_tokens, num_heads, max_blocks = scores.shape
    if num_tokens == 0:
        return
    if plan is None:
        plan = _select_plan(num_tokens, num_heads, max_blocks, topk, init_blocks, local_blocks,
                            block_size, scores.device)
    serial, segments, cap, kp, kwargs, merge_kwargs, group, short = plan
    if short is not None:
        from .select_rows import _short_rows_topk_kernel
        rows = num_tokens * num_heads
        grid = (-(-rows // (32 // short["TPR"] * short["num_warps"])),)
        launch_planned(_short_rows_topk_kernel, (serial, 4), grid, scores, cu_seqlens_q,
                       seq_lens, out, seq_lens.shape[0], rows, max_blocks, *scores.stride(),
                       *out.stride(), **short)
        return
    if group is not None:
        from .select import _group_bound_select_kernel, _group_max_kernel
        gmax = torch.empty((num_tokens, num_heads, group["groups"]), dtype=torch.int32,
                           device=scores.device)
        scratch = torch.empty((num_tokens * num_heads, group["s"]["CAP"]), dtype=torch.int64,
                              device=scores.device)
        launch_planned(_group_max_kernel, (serial, 2),
                       (num_tokens, num_heads, -(-group["groups"] // group["g"]["GB"])),
                       scores, cu_seqlens_q, seq_lens, gmax, seq_lens.shape[0],
                       *scores.stride(), *gmax.stride()[:2], **group["g"])
        launch_planned(_group_bound_select_kernel, (serial, 3), (num_tokens, num_heads),
                       scores, cu_seqlens_q, seq_lens, gmax, out, scratch, seq_lens.shape[0],
                       *scores.stride(), *gmax.stride()[:2], *out.stride(), **group["s"])
        return
    cand = out if segments == 1 else torch.empty((num_tokens, num_heads, segments, kp),
                                                 dtype=torch.int64, device=scores.device)
    # (without scratch slots the kernel never touches the pointer: the candidates stand in, and
    # the call saves an allocation, ~3 µs of host time)
    scratch = cand if not cap else torch.empty((num_tokens, num_heads, segments, cap),
                                               dtype=torch.int64, device=scores.device)
    fused = kwargs.get("FUSED", False)
    counters = (arrival_counters(scores.device, num_tokens * num_heads, "select") if fused
                else cand)  # (never touched without FUSED)
    launch_planned(_segment_topk_kernel, (serial, 0), (num_tokens, num_heads, segments),
                   scores, cu_seqlens_q, seq_lens, out, cand, scratch, counters,
                   seq_lens.shape[0], segments, *scores.stride(), *out.stride(), **kwargs)
    if segments > 1 and not fused:
        launch_planned(_merge_topk_kernel, (serial, 1), (num_tokens, num_heads),
                       cand, cu_seqlens_q, seq_lens, out, seq_lens.shape[0], segments,
                       *out.stride(), **merge_kwargs)


def _select_plan(num_tokens, num_heads, max_blocks, topk, init_blocks, local_blocks, block_size,
                 device) -> tuple:
    """(segments per row, scratch slots, KP, the selection launch's and the merge launch's
    keyword arguments) for these shapes."""
    kp = _next_pow2(topk)
    seg, by_sort = _selection_layout(num_tokens * num_heads, max_blocks, kp,
                                     _programs_per_wave(device))
    warps = TUNING["select_warps"] if by_sort else 1
    # programmatic dependent launch only for the few programs of the sort path: it hides a
    # launch latency there (small decode steps), while a many-program selection launched early
    # cost a prefill chunk more than it hid (8K chunk, no context: fp8 74 -> 93 µs, bf16 108 ->
    # 127; the selection kernel 22 -> 41 µs; tune.py and profile_case.py --breakdown, one call)
    pdl = _pdl(device) and by_sort
    num_segments = -(-max(max_blocks, 1) // seg)
    single = num_segments == 1
    # the threshold path on long segments first packs the keys that can be picked into a scratch
    # row of cap slots (select.py); cap = 0 turns that off
    cap = _next_pow2(max(TUNING["select_scratch"], 4 * kp)) if TUNING["select_scratch"] else 0
    if by_sort or seg < 4 * cap:
        cap = 0
    groups = max(64, 2 * kp)
    # the scratch path read in chunks of select_chunk blocks (0: the whole segment at once);
    # a chunk must hold whole groups, and at least a group per chunk of the NG
    programs = num_tokens * num_heads * num_segments
    wide = programs >= TUNING["select_chunk_min_waves"] * _programs_per_wave(device)
    chunk = TUNING["select_chunk"] if cap and wide else 0
    if chunk and (seg % chunk or chunk % (seg // groups) or seg // chunk > groups
                  or chunk >= seg):
        chunk = 0
    kwargs = dict(TOPK=topk, KP=kp, INIT=init_blocks, LOCAL=local_blocks, BLOCK=block_size,
                  SEG=seg, SINGLE=single, BY_SORT=by_sort, CAP=cap, NG=groups, PDL=pdl, CH=chunk,
                  num_warps=warps, launch_pdl=pdl)
    if by_sort and not single and TUNING["select_sort_fused"]:
        # the last segment program of a row merges it: no merge launch (see TUNING)
        kwargs.update(FUSED=True, CANDP=_next_pow2(num_segments * kp))
    merge_kwargs = dict(TOPK=topk, KP=kp, BLOCK=block_size, SEG=seg,
                        CANDP=_next_pow2(num_segments * kp), BY_SORT=by_sort, PDL=pdl,
                        num_warps=warps, launch_pdl=pdl)
    group = None
    if (TUNING["select_group_bound"] and not by_sort and kp <= 32
            and max_blocks >= TUNING["select_group_min_blocks"]):
        # (select.py: 16-block groups, 64 per group-maxima program; at most 32 reaching groups
        # on the fast path, 512 candidate blocks)
        gs, groups = 16, -(-max_blocks // 16)
        common = dict(TOPK=topk, INIT=init_blocks, LOCAL=local_blocks, BLOCK=block_size, GS=gs)
        group = dict(groups=groups, g=dict(**common, GB=64, num_warps=4),
                     s=dict(**common, KP=kp, NGP=max(_next_pow2(groups), 2 * kp), CG=2 * kp,
                            CAP=max(64, 2 * kp), CH=128, PACK=TUNING["select_group_pack"],
                            num_warps=1))
    short = None
    if _short_rows_eligible(device, max_blocks, kp, by_sort):
        # select_rows.py: a thread per row; G >= K groups of W blocks bound the search
        width = max(_next_pow2(max_blocks), 4)
        g = min(kp, width)
        short = dict(H=num_heads, TOPK=topk, KP=kp, INIT=init_blocks, LOCAL=local_blocks,
                     BLOCK=block_size, G=g, W=width // g, VEC=4 if max_blocks % 4 == 0 else 1,
                     # (rows wider than 64 blocks: 16 blocks per thread, up to a warp)
                     TPR=min(max(TUNING["select_short_tpr"], width // 16), 32, width),
                     num_warps=TUNING["select_short_warps"],
                     REVERSE=TUNING["select_short_reverse"])
        if TUNING["select_short_pdl"] and _pdl(device):
            short.update(PDL=True, launch_pdl=True)
    return next(plan_serials), num_segments, cap, kp, kwargs, merge_kwargs, group, short


def _short_rows_eligible(device: torch.device, max_blocks: int, kp: int, by_sort: bool) -> bool:
    """Whether the selection runs select_rows.py's Gluon kernel (a thread per row): a launch of
    many rows (the threshold path, not the few programs of the sort path) of at most
    select_short_max blocks, on Hopper with the Gluon the Hopper kernels are tested on."""
    return (TUNING["select_short_rows"] and not by_sort and device.type == "cuda"
            and max_blocks <= TUNING["select_short_max"] and kp <= 64
            and capability(device) == (9, 0) and gluon_hopper_available())


@on_tensor_device
def block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, block_size=128,
                 out=None, max_q_len=None):
    """S[t, h, b] = max over keys j <= p of block b of dot(index_q[t, h], key[j]), fp32.

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

    Returns:
        fp32 [T, H, max_blocks], -inf past each token's causal blocks and for padding tokens.
        Page ids in block_table are not range-checked here (see `openmsa.validate_batch`).
    """
    if not use_kernels(index_q):
        return reference.block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                      block_size=block_size, out=out, max_q_len=max_q_len)
    key = _call_key("scores", index_q, index_cache, cu_seqlens_q, seq_lens, block_table, out,
                    block_size, max_q_len)
    plan = _PLANS.get(key)
    if plan is None:
        check_indexer_args(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                           block_size=block_size, out=out, out_width=None,
                           out_dtype=torch.float32, max_q_len=max_q_len)
        _raise_if_unsupported(index_q, index_cache, block_size, None)
        plan = _scores_plan(index_q, index_cache, seq_lens.shape[0], block_table.shape[1],
                            block_size, max_q_len)
        _PLANS.put(key, plan)
    if out is None:
        out = torch.empty((*index_q.shape[:2], block_table.shape[1]), dtype=torch.float32,
                          device=index_q.device)
    out.fill_(float("-inf"))
    launch_block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, out,
                        block_size, max_q_len, plan)
    return out


@on_tensor_device
def select_blocks(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, topk=16,
                  init_blocks=0, local_blocks=1, block_size=128, out=None, max_q_len=None):
    """The `topk` best blocks per (token, index head), forced init/local blocks included.

    Args: as `block_scores` (max_q_len included), plus the selection rule (topk, init_blocks,
        local_blocks) and out: optional int32 [T, H, topk], any strides (e.g. a transposed
        [H, T, K] buffer).

    Returns:
        int32 [T, H, topk]: ascending block ids, -1 padded; ties go to the lower block, NaN
        scores rank as -inf; padding tokens get a row of -1. No host synchronisation on the
        kernel path (CUDA-graph safe for a fixed T, R and block-table width).

    Temporary device memory on the kernel path: the fp32 scores, T * H * max_blocks * 4 bytes
    (an 8K chunk after 1M tokens at 4 heads: 1 GB), plus, for launches of many long rows, a
    scratch row of 64 int64 per (token, head, 1024-block segment) (134 MB there) and, for rows
    of several segments, K int64 candidates per segment.
    """
    if not use_kernels(index_q):
        return reference.select_blocks(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                       topk=topk, init_blocks=init_blocks,
                                       local_blocks=local_blocks, block_size=block_size, out=out,
                                       max_q_len=max_q_len)
    key = _call_key("select", index_q, index_cache, cu_seqlens_q, seq_lens, block_table, out,
                    block_size, max_q_len, topk, init_blocks, local_blocks)
    plan = _PLANS.get(key)
    if plan is None:
        check_select_args(topk, init_blocks, local_blocks)
        check_indexer_args(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                           block_size=block_size, out=out, out_width=topk,
                           out_dtype=torch.int32, max_q_len=max_q_len)
        _raise_if_unsupported(index_q, index_cache, block_size, topk)
        num_tokens, num_heads, _ = index_q.shape
        plan = (_scores_plan(index_q, index_cache, seq_lens.shape[0], block_table.shape[1],
                             block_size, max_q_len),
                _select_plan(num_tokens, num_heads, block_table.shape[1], topk, init_blocks,
                             local_blocks, block_size, index_q.device) if num_tokens else None)
        _PLANS.put(key, plan)
    num_tokens, num_heads, _ = index_q.shape
    if out is None:
        out = torch.empty((num_tokens, num_heads, topk), dtype=torch.int32,
                          device=index_q.device)
    # only blocks below each token's causal count are read back, so no -inf fill is needed
    scores = torch.empty((num_tokens, num_heads, block_table.shape[1]), dtype=torch.float32,
                         device=index_q.device)
    launch_block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, scores,
                        block_size, max_q_len, plan[0])
    launch_select(scores, cu_seqlens_q, seq_lens, out, topk=topk, init_blocks=init_blocks,
                  local_blocks=local_blocks, block_size=block_size, plan=plan[1])
    return out


# launch plans by call key (_call_key)
_PLANS = PlanCache()


def _call_key(op, index_q, index_cache, cu_seqlens_q, seq_lens, block_table, out, *values):
    """Everything the checks and the launch plans read: the tensors' shapes, strides, dtypes
    and devices, the other arguments, the launch knobs and the functions that choose with them
    (so that tune.py's and tests' changes take effect)."""
    return call_key((index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                     index_q if out is None else out),
                    (op, out is None, *values, tuple(TUNING.values()), _selection_layout,
                     num_sms))

