# SPDX-License-Identifier: Apache-2.0
"""Context-parallel selection (docs/spec.md, "Context-parallel selection"; docs/design.md).

A group of W ranks splits the index scan by context: rank r scores only the logical blocks
b = j * W + r of every request (for every index head), keeps per (token, head) its best `topk`
non-forced causal blocks as int64 sort keys, the group all-gathers the keys (one collective),
and every rank merges the W * topk candidates with the forced blocks into the same [T, H, topk]
selection as one device scoring the whole cache.

The sort key of a candidate (block g, fp32 score s) is

    key = ordered(s) * 2**32 + (2**32 - 1 - g)

where ordered() maps fp32 to int32 preserving order (NaN first made -inf, -0.0 made +0.0, so
that -0.0 and +0.0 tie as they compare equal). Keys are distinct (distinct blocks), a larger
key is a better block under the tie rule (higher score, then lower block), and INT64_MIN marks
"no candidate" (every real key is larger). torch.topk over distinct keys is exact and
deterministic. Everything here is device ops: no host sync, CUDA-graph capturable (the
collective included, with NCCL).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._checks import check_cp_shape
from ..._dispatch import next_pow2
from ...batch import num_causal_blocks, token_layout
from ..common.launch import PlanCache, call_key
from ..common.plan import Launch
from ..common.triton_utils import token_position

__all__ = ["pack_keys", "key_block_ids", "local_candidates", "merge_candidates",
           "exchange_candidates", "local_block_scores", "select_blocks_cp", "owned_table"]

INT64_MIN = -(2 ** 63)
INT64_MAX = 2 ** 63 - 1
_LOW = 2 ** 32 - 1


def pack_keys(scores: torch.Tensor, block_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """int64 sort keys of (fp32 score, block id) pairs (broadcast together); INT64_MIN where not
    valid. Larger key = better: score descending (NaN as -inf, -0.0 as +0.0), then block id
    ascending."""
    s = scores.float()
    s = torch.where(s == s, s, torch.full_like(s, float("-inf"))) + 0.0  # -0.0 + 0.0 = +0.0
    bits = s.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    key = ordered * (2 ** 32) + (_LOW - block_ids.to(torch.int64))
    return torch.where(valid, key, torch.full_like(key, INT64_MIN))


def key_block_ids(keys: torch.Tensor) -> torch.Tensor:
    """The block id inside each key (meaningless for INT64_MIN)."""
    return _LOW - (keys & _LOW)


def _forced(g: torch.Tensor, n: torch.Tensor, init_blocks: int, local_blocks: int):
    return (g < init_blocks) | (g >= n - local_blocks)


def local_candidates(local_scores: torch.Tensor, position: torch.Tensor, *, cp_size: int,
                     cp_rank: int, max_blocks: int, topk: int, init_blocks: int,
                     local_blocks: int, block_size: int) -> torch.Tensor:
    """Rank cp_rank's best min(topk, width) candidates per (token, head) as sort keys.

    Args:
        local_scores: fp32 [T, H, width], width = ceil(max_blocks / cp_size); column j is the
            score of global block j * cp_size + cp_rank (entries past a token's causal blocks
            may hold anything: they are never read).
        position: int32 [T], -1 for padding tokens.
        max_blocks: the whole block table's width.

    Returns:
        int64 [T, H, min(topk, width)]: keys of causal, non-forced owned blocks (forced ones
        are added by the merge), INT64_MIN where there are fewer.
    """
    num_tokens, num_heads, width = local_scores.shape
    device = local_scores.device
    n = num_causal_blocks(position.long(), block_size)[:, None, None]  # [T, 1, 1]
    g = (torch.arange(width, device=device, dtype=torch.int64) * cp_size + cp_rank)[None, None]
    valid = (g < n) & (g < max_blocks) & ~_forced(g, n, init_blocks, local_blocks)
    keys = pack_keys(local_scores, g, valid)
    k = min(topk, width)
    if k == width:
        return keys
    return torch.topk(keys, k, dim=-1, sorted=False).values


def merge_candidates(candidates: torch.Tensor, position: torch.Tensor, *, topk: int,
                     init_blocks: int, local_blocks: int, block_size: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The selection from every rank's candidates (docs/spec.md, "Selection: forced blocks and
    the tie rule"): forced blocks positionally, then the best candidate keys.

    Args:
        candidates: int64 [T, H, C] sort keys (any ranks' candidates side by side; INT64_MIN
            for none). Keys of forced blocks are ignored.
        position: int32 [T], -1 for padding tokens.

    Returns:
        int32 [T, H, topk]: ascending block ids, -1 padded (written into `out` when given).
    """
    num_tokens, num_heads, _ = candidates.shape
    device = candidates.device
    n = num_causal_blocks(position.long(), block_size)[:, None, None]  # [T, 1, 1]
    ids = key_block_ids(candidates)
    keep = (candidates != INT64_MIN) & ~_forced(ids, n, init_blocks, local_blocks)
    keys = torch.where(keep, candidates, torch.full_like(candidates, INT64_MIN))
    # the forced blocks: init blocks 0..init-1 and local blocks n-local..n-1, each once, < n
    f_init = torch.arange(init_blocks, device=device, dtype=torch.int64)[None, None]
    f_local = n - local_blocks + torch.arange(local_blocks, device=device,
                                              dtype=torch.int64)[None, None]
    f_ids = torch.cat([f_init.expand(num_tokens, 1, init_blocks), f_local], dim=-1)
    f_ok = torch.cat([f_init < n, (f_local >= 0) & (f_local >= init_blocks)], dim=-1)
    f_keys = torch.where(f_ok, torch.full_like(f_ids, INT64_MAX), torch.full_like(f_ids, INT64_MIN))
    all_keys = torch.cat([f_keys.expand(num_tokens, num_heads, -1), keys], dim=-1)
    all_ids = torch.cat([f_ids.expand(num_tokens, num_heads, -1), ids], dim=-1)
    k = min(topk, all_keys.shape[-1])
    best, where = torch.topk(all_keys, k, dim=-1, sorted=False)
    big = torch.iinfo(torch.int64).max
    chosen = torch.where(best != INT64_MIN, torch.gather(all_ids, -1, where),
                         torch.full_like(best, big))
    chosen = torch.sort(chosen, dim=-1).values
    chosen = torch.where(chosen == big, torch.full_like(chosen, -1), chosen).to(torch.int32)
    if out is None:
        out = torch.full((num_tokens, num_heads, topk), -1, dtype=torch.int32, device=device)
    else:
        out[..., k:].fill_(-1)
    out[..., :k].copy_(chosen)
    return out


def exchange_candidates(keys: torch.Tensor, group) -> torch.Tensor:
    """Every rank's [T, H, k] candidate keys, as a [T, H, W, k] view: one all-gather into a
    [W * T, H, k] tensor on `group` (all_gather_single, named all_gather_into_tensor before torch
    2.13: one NCCL allgather, which CUDA graphs capture; gloo runs it on CPU)."""
    import torch.distributed as dist
    world = dist.get_world_size(group)
    keys = keys.contiguous()
    num_tokens, num_heads, k = keys.shape
    gathered = torch.empty((world * num_tokens, num_heads, k), dtype=keys.dtype,
                           device=keys.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered, keys, group=group)
    return gathered.view(world, num_tokens, num_heads, k).permute(1, 2, 0, 3)


# ---------------------------------------------------------------------------- kernel path
# The same two steps as local_candidates / merge_candidates, each one Triton launch instead of
# a dozen PyTorch ops (those remain the CPU reference path and the tests' oracle).

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


def _pow2(x: int, least: int = 16) -> int:
    """A tl.arange length: a power of two, at least `least` (16: a tile Triton lays out)."""
    return max(least, next_pow2(x))


# the two kernels' launches by call key, run through the cached launcher (Launch.run) like the
# ops' plans: a key holds the shapes, strides, dtypes and devices of the tensors given and the
# ints, from which every int, constexpr and grid the launch passes follows (the tensors made
# here are contiguous, of fixed dtypes)
_LAUNCHES = PlanCache()


def _launch(kernel: str, key, grid_and_params) -> Launch:
    """The cached Launch under `key`, made on a miss from grid_and_params() -> (grid, params)."""
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = Launch(kernel, *grid_and_params())
        _LAUNCHES.put(key, launch)
    return launch


def local_candidates_kernel(local_scores, cu_seqlens_q, seq_lens, *, cp_size, cp_rank,
                            max_blocks, topk, init_blocks, local_blocks, block_size):
    """local_candidates on the kernel path: (keys [T, H, min(topk, width)], position [T])."""
    num_tokens, num_heads, width = local_scores.shape
    device = local_scores.device
    keys = torch.empty((num_tokens, num_heads, width), dtype=torch.int64, device=device)
    position = torch.empty(num_tokens, dtype=torch.int32, device=device)
    if num_tokens:
        def grid_and_params():
            chunk = min(1024, _pow2(width))
            return ((num_tokens, triton.cdiv(max(width, 1), chunk)),
                    dict(H=num_heads, BLOCK=block_size, CHUNK=chunk))
        key = call_key((local_scores, cu_seqlens_q, seq_lens),
                       ("local_keys", max_blocks, cp_size, cp_rank, init_blocks, local_blocks,
                        block_size))
        _launch("local_keys", key, grid_and_params).run(
            _local_keys_kernel, local_scores, cu_seqlens_q, seq_lens, keys, position,
            seq_lens.shape[0], num_tokens, width, max_blocks, cp_size, cp_rank, init_blocks,
            local_blocks, *local_scores.stride(), *keys.stride())
    k = min(topk, width)
    if k < width:
        keys = torch.topk(keys, k, dim=-1, sorted=False).values
    return keys, position


def merge_candidates_kernel(candidates, position, *, topk, init_blocks, local_blocks,
                            block_size, out=None):
    """merge_candidates on the kernel path, from candidates [T, H, W, k] (any strides)."""
    num_tokens, num_heads, num_ranks, per_rank = candidates.shape
    if out is None:
        out = torch.empty((num_tokens, num_heads, topk), dtype=torch.int32,
                          device=candidates.device)
    if per_rank == 0:
        # a table of no columns: no request has a block (the argument checks hold the table
        # wide enough for every seq_len), so every row is empty
        out.fill_(-1)
    elif num_tokens * num_heads:
        def grid_and_params():
            return ((num_tokens * num_heads,),
                    dict(H=num_heads, BLOCK=block_size, CP2=_pow2(num_ranks * per_rank),
                         KP2=_pow2(topk)))
        key = call_key((candidates, position, out),
                       ("merge", topk, init_blocks, local_blocks, block_size))
        _launch("merge", key, grid_and_params).run(
            _merge_kernel, candidates, position, out, num_ranks, per_rank, topk, init_blocks,
            local_blocks, *candidates.stride(), *out.stride())
    return out


def owned_table(block_table: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The block table with -1 at the blocks rank cp_rank does not own (b % cp_size != r)."""
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    return torch.where((cols % cp_size == cp_rank)[None, :], block_table,
                       torch.full_like(block_table, -1))


def local_block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, cp_size,
                       cp_rank, block_size=128, max_q_len=None, config=None,
                       reference: bool = False) -> torch.Tensor:
    """fp32 [T, H, ceil(max_blocks / cp_size)]: column j scores global block j * cp_size +
    cp_rank, read through block_table[:, cp_rank::cp_size] only (other entries may be -1).
    Entries past a token's causal blocks are unspecified on the kernel path (-inf on the
    reference path). Bit-identical, entry by entry, to block_scores over the whole table.
    reference: the reference path whatever the device (openmsa.reference.select_blocks)."""
    from ..._dispatch import use_kernels
    check_cp_shape(cp_size, cp_rank)
    max_blocks = block_table.shape[1]
    width = -(-max_blocks // cp_size)
    if reference or not use_kernels(index_q):
        from . import reference as ref
        # the same shapes as the whole scan (so the same arithmetic per score), with pages of
        # other ranks' blocks as -1: their entries are masked out, never used
        full = ref.block_scores(index_q, index_cache, cu_seqlens_q, seq_lens,
                                      owned_table(block_table, cp_size, cp_rank),
                                      block_size=block_size, max_q_len=max_q_len)
        local = torch.full((*index_q.shape[:2], width), float("-inf"), dtype=torch.float32,
                           device=index_q.device)
        own = full[:, :, cp_rank::cp_size]
        local[:, :, :own.shape[2]] = own
        return local
    from .api import _local_scores_kernels
    return _local_scores_kernels(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                 cp_size=cp_size, cp_rank=cp_rank, block_size=block_size,
                                 width=width, max_q_len=max_q_len, config=config)


def rank_candidates(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, cp_size,
                    cp_rank, topk, init_blocks, local_blocks, block_size=128, max_q_len=None,
                    config=None, reference: bool = False):
    """One rank's share: its local scores, then its int64 candidate keys [T, H, k] and the
    tokens' positions (for the merge)."""
    from ..._dispatch import use_kernels
    scores = local_block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                cp_size=cp_size, cp_rank=cp_rank, block_size=block_size,
                                max_q_len=max_q_len, config=config, reference=reference)
    if not reference and use_kernels(index_q):
        return local_candidates_kernel(scores, cu_seqlens_q, seq_lens, cp_size=cp_size,
                                       cp_rank=cp_rank, max_blocks=block_table.shape[1],
                                       topk=topk, init_blocks=init_blocks,
                                       local_blocks=local_blocks, block_size=block_size)
    _, position = token_layout(cu_seqlens_q, seq_lens, index_q.shape[0], block_size=block_size,
                               table_width=block_table.shape[1])
    keys = local_candidates(scores, position, cp_size=cp_size, cp_rank=cp_rank,
                            max_blocks=block_table.shape[1], topk=topk, init_blocks=init_blocks,
                            local_blocks=local_blocks, block_size=block_size)
    return keys, position


def select_blocks_cp(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, cp_group,
                     topk, init_blocks, local_blocks, block_size=128, out=None, max_q_len=None,
                     config=None, reference: bool = False):
    """select_blocks over a context-parallel group (see the module docstring)."""
    import torch.distributed as dist
    world, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    keys, position = rank_candidates(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                     cp_size=world, cp_rank=rank, topk=topk,
                                     init_blocks=init_blocks, local_blocks=local_blocks,
                                     block_size=block_size, max_q_len=max_q_len, config=config,
                                     reference=reference)
    from ..._dispatch import use_kernels
    candidates = exchange_candidates(keys, cp_group) if world > 1 else keys.unsqueeze(2)
    rule = dict(topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
                block_size=block_size, out=out)
    if not reference and use_kernels(index_q):
        return merge_candidates_kernel(candidates, position, **rule)
    return merge_candidates(candidates.reshape(*keys.shape[:2], -1), position, **rule)
