# SPDX-License-Identifier: Apache-2.0
"""A sparse layer's decode step as one launch: preparation, scoring, selection, attention.

The separate ops run the step as four to six dependent launches (cache/kernels/prepare.py,
indexer/kernels/scores.py and select.py, attention/kernels/token.py); at small batch each costs
a launch's latency and a tail around a microsecond or two of memory traffic. Here those
launches' programs are ranges of one grid's program ids, in step order:

    prepare (T * tiles) | score (R * splits) | segments (T * H * segs) | [select merge (T * H)]
        | attend (T * Hkv * splits) | [attend merge (T * Hq)]

and each program runs the same function its own launch would (prepare_tile, _score_request,
segment_topk, merge_topk, attend_split, merge_splits) with the same constexprs, so every output
is the separate ops' bit for bit where the launch runs the same warps as theirs (step/plan.py).
A program of a phase first waits until every program of the phase before has bumped that
phase's counter; programs bump it after their last store (a CTA barrier, then a release add at
GPU scope; the waiter's acquire makes those stores visible).

Program ids in the order the GPU starts programs, not the grid's: each program takes a ticket
(an atomic add) as its id. A program then waits only on programs with lower tickets, which have
already started, so the wait ends however many programs fit on the GPU at once (no deadlock
when the grid is larger than one wave). Triton's interpreter runs programs one after another in
grid order, so every counter is complete when read there; it records a phase found incomplete
in the error slot instead of spinning, and the caller raises.

The last program to finish puts every counter back to 0 (the graph replays the same buffer).
Counters (int32): [0] ticket, [1..5] the phases' arrivals, [6] finished programs, [7] the
interpreter's error flag, [8..] the attention's fused-merge counters (attend_split's).
"""

import triton
import triton.language as tl

from ...attention.kernels.token import attend_split, merge_splits
from ...cache.kernels.prepare import prepare_tile
from ...indexer.kernels.scores import _score_request
from ...indexer.kernels.select import merge_topk, segment_topk
from ..plan import ERROR_SLOT, HEAD_COUNTERS

TICKET: tl.constexpr = tl.constexpr(0)
FINISHED: tl.constexpr = tl.constexpr(6)
ERROR: tl.constexpr = tl.constexpr(ERROR_SLOT)
# the first fused-merge counter (attend_split's, one per (token, KV head))
MERGE_COUNTERS: tl.constexpr = tl.constexpr(HEAD_COUNTERS)


# the GPU's wait: thread 0 polls the counter with acquire loads (a nanosleep between polls, so
# that hundreds of waiting programs do not crowd the counter's cache line that the producers'
# adds go to); the CTA barrier after it passes the acquired stores on to every thread, as a
# grid-wide sync does. (Labels inside braces are local to the block: the asm may be inlined at
# every wait.)
_POLL = """{
.reg .pred msa_p;
.reg .b32 msa_t;
mov.u32 msa_t, %tid.x;
setp.ne.u32 msa_p, msa_t, 0;
@msa_p bra MSA_DONE;
MSA_POLL:
ld.acquire.gpu.global.b32 msa_t, [$1];
setp.ge.s32 msa_p, msa_t, $2;
@msa_p bra MSA_DONE;
SLEEP
bra MSA_POLL;
MSA_DONE:
mov.u32 $0, 0;
}"""
_SPIN: tl.constexpr = tl.constexpr(_POLL.replace("SLEEP", ""))
_SPIN_SLEEP: tl.constexpr = tl.constexpr(_POLL.replace("SLEEP", "nanosleep.u32 $3;"))


@triton.jit
def _wait(counters_ptr, phase: tl.constexpr, target, SPIN: tl.constexpr,
          SLEEP_NS: tl.constexpr, TRACE: tl.constexpr):
    """Until counter `phase` reaches target (SPIN: the GPU), or flag the error (interpreter);
    returns the time it ended (`_now`)."""
    if SPIN:
        # (target may be a launcher-specialised constant: the asm takes tensors)
        zero = tl.zeros([], dtype=tl.int32)
        if SLEEP_NS > 0:
            tl.inline_asm_elementwise(_SPIN_SLEEP, "=r,l,r,r",
                                      [counters_ptr + phase, zero + target, zero + SLEEP_NS],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_SPIN, "=r,l,r", [counters_ptr + phase, zero + target],
                                      dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
    else:
        short = tl.load(counters_ptr + phase) < target
        tl.atomic_or(counters_ptr + ERROR, short.to(tl.int32))
    return _now(TRACE)


@triton.jit
def _now(TRACE: tl.constexpr):
    """The GPU's global timer in nanoseconds (a trace's timestamps); 0 in an untraced build,
    which then reads no timer."""
    t = tl.zeros([], dtype=tl.int64)
    if TRACE:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r",
                                      [tl.zeros([], dtype=tl.int32)], dtype=tl.int64,
                                      is_pure=False, pack=1)
    return t


@triton.jit
def _sm_id():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r",
                                     [tl.zeros([], dtype=tl.int32)], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _arrive(counters_ptr, phase: tl.constexpr):
    """Counter `phase` += 1 after every thread's stores of this program."""
    tl.debug_barrier()
    tl.atomic_add(counters_ptr + phase, 1, sem="release", scope="gpu")


@triton.jit
def _decode_step_kernel(
        # the preparation's (cache/kernels/prepare.py, prepare_tile)
        qkv_ptr, pos_ptr, qw_ptr, kw_ptr, iqw_ptr, ikw_ptr, rope_ptr, k_cache_ptr, v_cache_ptr,
        slot_ptr, index_cache_ptr, index_slot_ptr, k_scale_ptr, v_scale_ptr, q_ptr, iq_ptr, eps,
        num_slots, num_index_slots, stride_xt, stride_xc, stride_kcp, stride_kcb, stride_kch,
        stride_kcd, stride_vcp, stride_vcb, stride_vch, stride_vcd, stride_icp, stride_icb,
        stride_icd, stride_qt, stride_qh, stride_qd, stride_it, stride_ih, stride_id,
        # the step's
        cu_ptr, seq_lens_ptr, ibt_ptr, bt_ptr, num_requests, num_tokens, stride_ibr, stride_ibb,
        stride_btr, stride_btb, num_index_pages, num_pages,
        # the selection's
        scores_ptr, idx_ptr, cand_ptr, scratch_ptr, width, num_segments, stride_st, stride_sh,
        stride_sb, stride_xit, stride_xih, stride_xik,
        # the attention's
        out_ptr, part_ptr, sm_scale, kv_width, stride_ot, stride_oh, stride_od,
        # the ends of the phases in ticket order (an absent phase ends where the one before it
        # does), and the counters (the module's docstring)
        e_prep, e_score, e_seg, e_smerge, e_att, counters_ptr,
        # None, or int64 (programs, 4): each program's start, end of its wait and end (the GPU's
        # global timer, ns) and SM, by ticket
        trace_ptr,
        P_HQ: tl.constexpr, P_HKV: tl.constexpr, P_H: tl.constexpr, P_D: tl.constexpr,
        P_DI: tl.constexpr, P_DP: tl.constexpr, P_DIP: tl.constexpr, P_ROT: tl.constexpr,
        P_NCOARSE: tl.constexpr, P_FP32_ANGLES: tl.constexpr, P_ROPE_SCALE: tl.constexpr,
        P_BLOCK: tl.constexpr, P_IBLOCK: tl.constexpr, P_HT: tl.constexpr,
        P_KV_SATURATE: tl.constexpr, P_INDEX_SATURATE: tl.constexpr,
        P_IQ_SATURATE: tl.constexpr, P_HAS_SCALE: tl.constexpr, P_TILES: tl.constexpr,
        S_H: tl.constexpr, S_HP: tl.constexpr, S_DI: tl.constexpr, S_DIP: tl.constexpr,
        S_BLOCK: tl.constexpr, S_BPS: tl.constexpr, S_SMALL_Q: tl.constexpr,
        S_ROWS_T: tl.constexpr, S_CAST_K: tl.constexpr, S_IEEE: tl.constexpr,
        S_KEYS_AS_ROWS: tl.constexpr, S_MAX_SKIPS_NAN: tl.constexpr, S_SPLITS: tl.constexpr,
        G_TOPK: tl.constexpr, G_KP: tl.constexpr, G_INIT: tl.constexpr, G_LOCAL: tl.constexpr,
        G_BLOCK: tl.constexpr, G_SEG: tl.constexpr, G_SINGLE: tl.constexpr,
        G_BY_SORT: tl.constexpr, G_CAP: tl.constexpr, G_NG: tl.constexpr, G_CH: tl.constexpr,
        M_CANDP: tl.constexpr, M_BY_SORT: tl.constexpr,
        A_NUM_HEADS: tl.constexpr, A_NUM_KV_HEADS: tl.constexpr,
        A_NUM_INDEX_HEADS: tl.constexpr, A_G: tl.constexpr, A_M: tl.constexpr,
        A_D: tl.constexpr, A_BLOCK: tl.constexpr, A_TOPK: tl.constexpr, A_KP: tl.constexpr,
        A_SUB: tl.constexpr, A_STEPS: tl.constexpr, A_SPLITS: tl.constexpr,
        A_HAS_SCALE: tl.constexpr, A_IEEE: tl.constexpr, A_F16_COMPUTE: tl.constexpr,
        A_FUSED_MERGE: tl.constexpr, A_V_PAIRS: tl.constexpr, A_PTX: tl.constexpr,
        A_SP: tl.constexpr, A_LAZY_SUM: tl.constexpr, SPIN: tl.constexpr,
        SLEEP_NS: tl.constexpr):
    """Grid (the phases' programs,): prepare, score, segments, select merge, attend, attend
    merge (its programs past e_att)."""
    TRACE: tl.constexpr = trace_ptr is not None
    t0 = _now(TRACE)
    vid = tl.atomic_add(counters_ptr + TICKET, 1, sem="relaxed", scope="gpu")
    t1 = t0
    if vid < e_prep:
        prepare_tile(vid // P_TILES, vid % P_TILES, qkv_ptr, pos_ptr, qw_ptr, kw_ptr, iqw_ptr,
                     ikw_ptr, rope_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, index_cache_ptr,
                     index_slot_ptr, k_scale_ptr, v_scale_ptr, q_ptr, iq_ptr, eps, num_slots,
                     num_index_slots, stride_xt, stride_xc, stride_kcp, stride_kcb, stride_kch,
                     stride_kcd, stride_vcp, stride_vcb, stride_vch, stride_vcd, stride_icp,
                     stride_icb, stride_icd, stride_qt, stride_qh, stride_qd, stride_it,
                     stride_ih, stride_id, P_HQ, P_HKV, P_H, P_D, P_DI, P_DP, P_DIP, P_ROT,
                     P_NCOARSE, P_FP32_ANGLES, P_ROPE_SCALE, P_BLOCK, P_IBLOCK, P_HT,
                     P_KV_SATURATE, P_INDEX_SATURATE, P_IQ_SATURATE, P_HAS_SCALE, False)
        _arrive(counters_ptr, 1)
    elif vid < e_score:
        t1 = _wait(counters_ptr, 1, e_prep, SPIN, SLEEP_NS, TRACE)
        i = vid - e_prep
        _score_request(i // S_SPLITS, (i % S_SPLITS) * S_BPS, iq_ptr, index_cache_ptr, cu_ptr,
                       seq_lens_ptr, ibt_ptr, scores_ptr, num_requests, num_tokens,
                       num_index_pages, width, width, stride_it, stride_ih, stride_id,
                       stride_icp, stride_icb, stride_icd, stride_ibr, stride_ibb, stride_st,
                       stride_sh, stride_sb, S_H, S_HP, S_DI, S_DIP, S_BLOCK, S_BPS, S_SMALL_Q,
                       S_ROWS_T, S_CAST_K, S_IEEE, S_KEYS_AS_ROWS, S_MAX_SKIPS_NAN, False, 1, 0,
                       False)
        _arrive(counters_ptr, 2)
    elif vid < e_seg:
        t1 = _wait(counters_ptr, 2, e_score - e_prep, SPIN, SLEEP_NS, TRACE)
        i = vid - e_score
        per_token = S_H * num_segments
        segment_topk(i // per_token, (i // num_segments) % S_H, i % num_segments, num_tokens,
                     S_H, scores_ptr, cu_ptr, seq_lens_ptr, idx_ptr, cand_ptr, scratch_ptr,
                     num_requests, width, num_segments, stride_st, stride_sh, stride_sb,
                     stride_xit, stride_xih, stride_xik, G_TOPK, G_KP, G_INIT, G_LOCAL, G_BLOCK,
                     G_SEG, G_SINGLE, G_BY_SORT, G_CAP, G_NG, False, G_CH)
        _arrive(counters_ptr, 3)
    elif vid < e_smerge:
        # (M_CANDP 0: no merge phase, whose program range is then empty)
        if M_CANDP > 0:
            t1 = _wait(counters_ptr, 3, e_seg - e_score, SPIN, SLEEP_NS, TRACE)
            i = vid - e_seg
            merge_topk(i // S_H, i % S_H, num_tokens, S_H, cand_ptr, cu_ptr, seq_lens_ptr,
                       idx_ptr, num_requests, width, num_segments, stride_xit, stride_xih,
                       stride_xik, G_TOPK, G_KP, G_BLOCK, G_SEG, M_CANDP, M_BY_SORT, False)
            _arrive(counters_ptr, 4)
    elif vid < e_att:
        # the selection's last phase: the merge where there is one, else the segments
        if e_smerge > e_seg:
            t1 = _wait(counters_ptr, 4, e_smerge - e_seg, SPIN, SLEEP_NS, TRACE)
        else:
            t1 = _wait(counters_ptr, 3, e_seg - e_score, SPIN, SLEEP_NS, TRACE)
        i = vid - e_smerge
        per_token = A_NUM_KV_HEADS * A_SPLITS
        attend_split(i // per_token, (i // A_SPLITS) % A_NUM_KV_HEADS, i % A_SPLITS,
                     num_tokens, q_ptr, k_cache_ptr, v_cache_ptr, idx_ptr, cu_ptr, seq_lens_ptr,
                     bt_ptr, out_ptr, out_ptr, part_ptr, counters_ptr + MERGE_COUNTERS,
                     k_scale_ptr, v_scale_ptr, sm_scale, num_requests, kv_width,
                     num_pages, stride_qt, stride_qh, stride_qd, stride_kcp, stride_kcb,
                     stride_kch, stride_kcd, stride_vcp, stride_vcb, stride_vch, stride_vcd,
                     stride_xit, stride_xih, stride_xik, stride_btr, stride_btb, stride_ot,
                     stride_oh, stride_od, 0, 0, A_NUM_HEADS, A_NUM_KV_HEADS,
                     A_NUM_INDEX_HEADS, A_G, A_M, A_D, A_BLOCK, A_TOPK, A_KP, A_SUB, A_STEPS,
                     A_SPLITS, A_HAS_SCALE, A_IEEE, A_F16_COMPUTE, A_FUSED_MERGE, A_V_PAIRS,
                     A_PTX, A_SP, False, A_LAZY_SUM)
        _arrive(counters_ptr, 5)
    else:
        t1 = _wait(counters_ptr, 5, e_att - e_smerge, SPIN, SLEEP_NS, TRACE)
        i = vid - e_att
        merge_splits(i // A_NUM_HEADS, i % A_NUM_HEADS, num_tokens, part_ptr, out_ptr, out_ptr,
                     stride_ot, stride_oh, stride_od, 0, 0, A_NUM_HEADS, A_D, A_SPLITS, A_SP,
                     False)
    if TRACE:
        t2 = _now(TRACE)
        tl.store(trace_ptr + vid * 4, t0)
        tl.store(trace_ptr + vid * 4 + 1, t1)
        tl.store(trace_ptr + vid * 4 + 2, t2)
        tl.store(trace_ptr + vid * 4 + 3, _sm_id().to(tl.int64))
    # the last program to finish resets the counters for the next launch or graph replay
    done = tl.atomic_add(counters_ptr + FINISHED, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.store(counters_ptr + tl.arange(0, 8), tl.zeros([8], tl.int32),
                 mask=tl.arange(0, 8) != ERROR)
