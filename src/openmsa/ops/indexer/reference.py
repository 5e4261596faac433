# SPDX-License-Identifier: Apache-2.0
"""The index branch in pure PyTorch, fp32 math: the spec in code (see README.md beside this)."""

from __future__ import annotations

import torch

from ..._checks import check_cp_shape, check_process_group
from ...batch import num_causal_blocks, page_in_cache, request_spans, token_layout
from ...nvfp4 import dequantize_index_keys, is_nvfp4_cache, page_parts
from .checks import check_indexer_args, check_select_args
from .cp import exchange_candidates, local_candidates, merge_candidates, owned_table
from .plan import IndexerConfig

__all__ = ["block_scores", "select_blocks", "select_from_scores", "local_block_scores",
           "rank_candidates"]

# fp32 elements of one [tokens, heads, keys] score chunk: bounds the reference's memory (128 MB).
_CHUNK_ELEMENTS = 1 << 25


def block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *,
                 block_size=128, out=None, max_q_len=None, config: IndexerConfig | None = None):
    """S[t, h, b] = max over keys j <= p of block b of dot(index_q[t, h], key[j]), fp32.

    Args:
        index_q: [T, H, Di] query of each token and index head.
        index_cache: [P, B, Di] one index key per token slot (B == block_size), or an NVFP4
            cache (uint8 [P, 128, 72] pages, openmsa.nvfp4), scored on its exact fp32 keys.
        cu_seqlens_q: int32 [R+1]; seq_lens: int32 [R]; block_table: int32 [R, max_blocks].
        out: optional fp32 [T, H, max_blocks] (any strides), written in place.
        max_q_len: optional host int, an expected bound on every request's q_len (FlashInfer's
            max_seqlen_q); only a speed hint for the kernels, never changes a result.
        config: the kernels' launch knobs (plan.py); the reference has none, and ignores it.

    Returns:
        fp32 [T, H, max_blocks]; -inf for blocks past the token's causal blocks and for padding
        tokens. A NaN dot product counts as -inf, so S is never NaN.
    """
    check_indexer_args(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                       block_size=block_size, out=out, out_width=None, out_dtype=torch.float32,
                       max_q_len=max_q_len)
    num_tokens, num_heads, _ = index_q.shape
    max_blocks = block_table.shape[1]
    scores = torch.full((num_tokens, num_heads, max_blocks), float("-inf"), dtype=torch.float32,
                        device=index_q.device)
    _, position = token_layout(cu_seqlens_q, seq_lens, num_tokens, block_size=block_size,
                               table_width=max_blocks)
    for _, start, end, _, pages in request_spans(cu_seqlens_q, seq_lens, num_tokens, block_table,
                                                 block_size):
        nb = pages.shape[0]
        # an entry that names no page of the cache (-1 for an unfilled one, or a stale id past
        # the cache) reads nothing: its block scores -inf
        missing = ~page_in_cache(pages, index_cache.shape[0])
        unfilled = missing.repeat_interleave(block_size)  # [nb*B]
        keys = _page_keys(index_cache, pages.masked_fill(missing, 0)).reshape(nb * block_size, -1)
        key_pos = torch.arange(nb * block_size, device=keys.device)
        step = max(1, _CHUNK_ELEMENTS // (num_heads * nb * block_size))
        for s in range(start, end, step):
            e = min(end, s + step)
            p = position[s:e].long()
            # blocks past the chunk's last position lie beyond every token here: they stay -inf
            nc = min(nb, int(p.max()) // block_size + 1)
            if nc <= 0:
                continue
            kc = nc * block_size
            q = index_q[s:e].float()  # [c, H, Di]
            dots = torch.einsum("thd,jd->thj", q, keys[:kc])  # [c, H, nc*B]
            # keys past the token's position do not count; NaN counts as -inf
            hidden = (key_pos[None, :kc] > p[:, None]) | unfilled[None, :kc]
            dots = dots.masked_fill(hidden[:, None, :] | dots.isnan(), float("-inf"))
            scores[s:e, :, :nc] = dots.view(e - s, num_heads, nc, block_size).amax(-1)
    if out is None:
        return scores
    out.copy_(scores)
    return out


def _page_keys(index_cache, pages):
    """fp32 [nb, B, Di]: the keys of the given pages (an NVFP4 cache dequantized, exactly)."""
    if is_nvfp4_cache(index_cache):
        codes, scales = page_parts(index_cache)
        return dequantize_index_keys(codes[pages], scales[pages])
    return index_cache[pages].float()


def select_from_scores(scores, position, *, topk, init_blocks, local_blocks, block_size):
    """The selection rule (docs/spec.md, "Selection: forced blocks and the tie rule") applied to a
    score tensor.

    Args:
        scores: fp32 [T, H, max_blocks] (entries past a token's causal blocks are ignored).
        position: int32 [T], -1 for padding tokens.

    Returns:
        int32 [T, H, topk]: forced init/local blocks plus the best others (ties to the lower
        block, NaN as -inf), ascending, then -1.
    """
    num_tokens, num_heads, max_blocks = scores.shape
    device = scores.device
    n = num_causal_blocks(position.long(), block_size)[:, None]  # [T, 1]
    b = torch.arange(max_blocks, device=device)[None, :]  # [1, MB]
    exists = b < n
    forced = exists & ((b < init_blocks) | (b >= n - local_blocks))
    # rank by (forced, existing, score, lower block) through stable sorts, least significant key
    # first: a stable sort keeps equal keys in block order, which is the tie rule
    s = torch.nan_to_num(scores.float(), nan=float("-inf"), posinf=float("inf"),
                         neginf=float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices  # [T, H, MB]
    group = (exists.long() + forced.long())[:, None, :].expand(num_tokens, num_heads, max_blocks)
    g = torch.gather(group, -1, order)
    order = torch.gather(order, -1, torch.sort(g, dim=-1, descending=True, stable=True).indices)
    k = min(topk, max_blocks)
    chosen = order[..., :k]
    chosen_ok = torch.gather(group, -1, chosen) > 0
    big = torch.iinfo(torch.int64).max
    chosen = torch.where(chosen_ok, chosen, torch.full_like(chosen, big))
    chosen = torch.sort(chosen, dim=-1).values
    result = torch.full((num_tokens, num_heads, topk), -1, dtype=torch.int32, device=device)
    result[..., :k] = torch.where(chosen == big, torch.full_like(chosen, -1),
                                  chosen).to(torch.int32)
    return result


def select_blocks(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, topk=16,
                  init_blocks=0, local_blocks=1, block_size=128, out=None, max_q_len=None,
                  config: IndexerConfig | None = None, cp_group=None):
    """Top-`topk` blocks per (token, index head) by block_scores, with forced init/local blocks
    (max_q_len, config: the kernels' hint and knobs, see block_scores). cp_group: the
    context-parallel selection (cp.py's rule and exchange) on this reference path (see
    api.select_blocks).

    Returns:
        int32 [T, H, topk]: ascending block ids (logical, into the request's block table), -1
        padded. A token with n <= topk causal blocks gets all of 0..n-1.
    """
    check_select_args(topk, init_blocks, local_blocks)
    check_indexer_args(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                       block_size=block_size, out=out, out_width=topk, out_dtype=torch.int32,
                       max_q_len=max_q_len)
    if cp_group is not None:
        check_process_group("cp_group", cp_group)
        return _select_blocks_cp(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                 cp_group=cp_group, topk=topk, init_blocks=init_blocks,
                                 local_blocks=local_blocks, block_size=block_size, out=out)
    num_tokens = index_q.shape[0]
    scores = block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                          block_size=block_size)
    _, position = token_layout(cu_seqlens_q, seq_lens, num_tokens, block_size=block_size,
                               table_width=block_table.shape[1])
    result = select_from_scores(scores, position, topk=topk, init_blocks=init_blocks,
                                local_blocks=local_blocks, block_size=block_size)
    if out is None:
        return result
    out.copy_(result)
    return out


def local_block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, cp_size,
                       cp_rank, block_size=128, max_q_len=None,
                       config: IndexerConfig | None = None) -> torch.Tensor:
    """A context-parallel rank's scores: fp32 [T, H, ceil(max_blocks / cp_size)], column j the
    score of global block j * cp_size + cp_rank, read through the rank's blocks of block_table
    only (other entries may be -1); -inf past a token's causal blocks. Bit-identical, entry by
    entry, to block_scores over the whole table (max_q_len, config: see block_scores)."""
    check_cp_shape(cp_size, cp_rank)
    width = -(-block_table.shape[1] // cp_size)
    # the same shapes as the whole scan (so the same arithmetic per score), with pages of
    # other ranks' blocks as -1: their entries are masked out, never used
    full = block_scores(index_q, index_cache, cu_seqlens_q, seq_lens,
                        owned_table(block_table, cp_size, cp_rank), block_size=block_size,
                        max_q_len=max_q_len)
    local = torch.full((*index_q.shape[:2], width), float("-inf"), dtype=torch.float32,
                       device=index_q.device)
    own = full[:, :, cp_rank::cp_size]
    local[:, :, :own.shape[2]] = own
    return local


def rank_candidates(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, cp_size,
                    cp_rank, topk, init_blocks, local_blocks, block_size=128, max_q_len=None,
                    config: IndexerConfig | None = None):
    """One rank's share of the context-parallel selection: its local scores' candidate keys,
    int64 [T, H, min(topk, width)] (cp.local_candidates), and the tokens' positions, int32 [T]
    (-1: padding), which the merge reads."""
    scores = local_block_scores(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                cp_size=cp_size, cp_rank=cp_rank, block_size=block_size,
                                max_q_len=max_q_len)
    _, position = token_layout(cu_seqlens_q, seq_lens, index_q.shape[0], block_size=block_size,
                               table_width=block_table.shape[1])
    keys = local_candidates(scores, position, cp_size=cp_size, cp_rank=cp_rank,
                            max_blocks=block_table.shape[1], topk=topk, init_blocks=init_blocks,
                            local_blocks=local_blocks, block_size=block_size)
    return keys, position


def _select_blocks_cp(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, cp_group,
                      topk, init_blocks, local_blocks, block_size, out):
    """select_blocks over a context-parallel group (cp.py): this rank's candidates, every
    rank's by the exchange, merged."""
    import torch.distributed as dist
    world, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    keys, position = rank_candidates(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                     cp_size=world, cp_rank=rank, topk=topk,
                                     init_blocks=init_blocks, local_blocks=local_blocks,
                                     block_size=block_size)
    candidates = exchange_candidates(keys, cp_group) if world > 1 else keys.unsqueeze(2)
    return merge_candidates(candidates.reshape(*keys.shape[:2], -1), position, topk=topk,
                            init_blocks=init_blocks, local_blocks=local_blocks,
                            block_size=block_size, out=out)


def prepare_and_select(qkv, positions, config, q_norm_weight, k_norm_weight,
                       index_q_norm_weight, index_k_norm_weight, k_cache, v_cache, slot_mapping,
                       index_cache, index_slot_mapping, cu_seqlens_q, seq_lens, block_table, *,
                       max_q_len=None, k_scale=None, v_scale=None, q_out=None, index_q_out=None,
                       out=None, cache_config=None, indexer_config=None):
    """fused_prepare, then select_blocks with the selection rule of `config` (the rank's
    MSAConfig: topk_blocks, init_blocks, local_blocks, block_size) over the index query it
    prepared: (q, index_q, indices)."""
    from ..cache.reference import fused_prepare

    q, index_q = fused_prepare(qkv, positions, config, q_norm_weight, k_norm_weight,
                               index_q_norm_weight, index_k_norm_weight, k_cache, v_cache,
                               slot_mapping, index_cache, index_slot_mapping, k_scale=k_scale,
                               v_scale=v_scale, q_out=q_out, index_q_out=index_q_out,
                               cache_config=cache_config)
    indices = select_blocks(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                            topk=config.topk_blocks, init_blocks=config.init_blocks,
                            local_blocks=config.local_blocks, block_size=config.block_size,
                            out=out, max_q_len=max_q_len, config=indexer_config)
    return q, index_q, indices
