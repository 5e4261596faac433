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

This module holds the rule and the exchange in plain PyTorch, shared by both paths: the
reference (reference.py) runs the rule as written here; the kernel path (api.py) runs the same
rule as kernels/cp.py's two launches. Both exchange with exchange_candidates.
"""

from __future__ import annotations

import torch

from ...batch import num_causal_blocks

__all__ = ["pack_keys", "key_block_ids", "local_candidates", "merge_candidates",
           "exchange_candidates", "owned_table", "INT64_MIN"]

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


def owned_table(block_table: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The block table with -1 at the blocks rank cp_rank does not own (b % cp_size != r)."""
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    return torch.where((cols % cp_size == cp_rank)[None, :], block_table,
                       torch.full_like(block_table, -1))
