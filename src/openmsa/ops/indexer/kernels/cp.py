# SPDX-License-Identifier: Apache-2.0
"""The context-parallel selection's two kernels (cp.py has the rule they implement, in PyTorch:
pack_keys, local_candidates, merge_candidates): a rank's local scores packed into int64 sort keys
of its candidates, and every rank's candidates merged with the forced blocks into the selection,
each one Triton launch instead of a dozen PyTorch ops (plan.py's cp_local_keys and cp_merge
choose the launches; api.py runs them)."""

import triton
import triton.language as tl

from ...common.triton_utils import token_position


@triton.jit
def _int64_min():
    return -9223372036854775807 - 1


@triton.jit
def _local_keys_kernel(scores_ptr, cu_ptr, seq_lens_ptr, keys_ptr, pos_ptr, num_requests,
                       num_tokens, width, max_blocks, cp_size, cp_rank, init_blocks, local_blocks,
                       stride_st, stride_sh, stride_sb, stride_kt, stride_kh, stride_kb,
                       H: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Program (t, c): token t's keys of local blocks [c * CHUNK, (c + 1) * CHUNK) for every
    head (pack_keys of the causal, non-forced owned blocks, INT64_MIN elsewhere); program
    (t, 0) also writes the token's position (-1: padding), which the merge reads."""
    t = tl.program_id(0)
    j = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    _, p = token_position(cu_ptr, seq_lens_ptr, num_requests, num_tokens, max_blocks, t,
                          (t.to(tl.int64) * num_requests // tl.maximum(num_tokens, 1)).to(tl.int32),
                          BLOCK)
    if tl.program_id(1) == 0:
        tl.store(pos_ptr + t, p)
    n = tl.where(p >= 0, p // BLOCK + 1, 0)
    g = j.to(tl.int64) * cp_size + cp_rank
    valid = (j < width) & (g < n) & (g < max_blocks) & (g >= init_blocks) \
        & (g < n - local_blocks)
    for h in tl.static_range(H):
        s = tl.load(scores_ptr + t.to(tl.int64) * stride_st + h * stride_sh + j * stride_sb,
                    mask=valid, other=0.0)
        s = tl.where(s == s, s, float("-inf"))
        s = tl.where(s == 0.0, 0.0, s)  # -0.0 -> +0.0
        bits = s.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        key = ordered * 4294967296 + (4294967295 - g)
        key = tl.where(valid, key, _int64_min())
        tl.store(keys_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + j * stride_kb, key,
                 mask=j < width)


@triton.jit
def _merge_kernel(cand_ptr, pos_ptr, out_ptr, num_ranks, per_rank, topk, init_blocks,
                  local_blocks, stride_ct, stride_ch, stride_cw, stride_ck, stride_ot, stride_oh,
                  stride_ok, H: tl.constexpr, BLOCK: tl.constexpr, CP2: tl.constexpr,
                  KP2: tl.constexpr):
    """Program (t * H + h): the selection of row (t, h) from candidates [T, H, W, k] (any
    strides): init blocks, then the best topk - |forced| non-forced candidates ascending, then
    the local blocks, then -1 (ascending overall: init < scored < local)."""
    pid = tl.program_id(0)
    t = pid // H
    h = pid % H
    p = tl.load(pos_ptr + t)
    n = tl.where(p >= 0, p // BLOCK + 1, 0)
    c = tl.arange(0, CP2)
    w = c // per_rank
    i = c % per_rank
    ok = c < num_ranks * per_rank
    keys = tl.load(cand_ptr + t.to(tl.int64) * stride_ct + h * stride_ch + w * stride_cw
                   + i * stride_ck, mask=ok, other=_int64_min())
    ids = 4294967295 - (keys & 4294967295)
    forced = (ids < init_blocks) | (ids >= n - local_blocks)
    keys = tl.where(forced, _int64_min(), keys)
    n_init = tl.minimum(init_blocks, n)
    lo = tl.maximum(n - local_blocks, init_blocks)
    n_local = tl.maximum(n - lo, 0)
    room = topk - n_init - n_local
    best = tl.sort(keys, descending=True)
    best_ids = 4294967295 - (best & 4294967295)
    chosen = (c < room) & (best != _int64_min())
    n_chosen = tl.sum(chosen.to(tl.int32), axis=0)
    ascending = tl.sort(tl.where(chosen, best_ids, 4611686018427387904), descending=False)
    row = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh
    tl.store(row + (n_init + c) * stride_ok, ascending.to(tl.int32), mask=c < n_chosen)
    k = tl.arange(0, KP2)
    tl.store(row + k * stride_ok, k, mask=k < n_init)
    tl.store(row + (n_init + n_chosen + k) * stride_ok, (lo + k).to(tl.int32), mask=k < n_local)
    tl.store(row + k * stride_ok, tl.full([KP2], -1, tl.int32),
             mask=(k >= n_init + n_chosen + n_local) & (k < topk))
