# SPDX-License-Identifier: Apache-2.0
"""Context-parallel test cases (tests/test_cp.py and its per-rank worker, cp_worker.py): the same
deterministic inputs in every process, and one rank's view of a sharded index cache."""

from __future__ import annotations

import torch

from openmsa._dispatch import use_kernels
from openmsa.ops.indexer.api import merge_candidates_kernel, rank_candidates
from openmsa.ops.indexer.cp import local_candidates, merge_candidates, owned_table

from .steps import make_step, random_index_inputs

B = 16
# decode, verify (q_len 3 and 16), a prefill chunk (20), requests without tokens or context, a
# context shorter than topk blocks (seq_len 5, 9), two padding tokens after the last request
Q_LENS = [1, 3, 0, 20, 1, 0, 16]
SEQ_LENS = [70, 45, 9, 100, 5, 0, 200]
# (topk, init_blocks, local_blocks)
RULES = [(4, 0, 1), (3, 1, 1), (5, 1, 2), (4, 0, 0), (16, 2, 1)]


def make_case(seed: int, *, q_dtype=torch.bfloat16, c_dtype=torch.bfloat16, integer=True,
              nan_keys=False, heads=2, dim=32, q_lens=Q_LENS, seq_lens=SEQ_LENS, device="cpu"):
    """(index_q, index_cache, cu_seqlens_q, seq_lens, block_table) of a step. integer: small
    integer values, so that many blocks tie; nan_keys: a few NaN index keys."""
    step = make_step(q_lens, seq_lens, block_size=B, extra_columns=2, pad_tokens=2,
                     generator=torch.Generator().manual_seed(seed))
    q, c = random_index_inputs(step, num_heads=heads, head_dim=dim, block_size=B,
                               q_dtype=q_dtype, cache_dtype=c_dtype, integer=integer,
                               generator=torch.Generator().manual_seed(seed + 1))
    if nan_keys:
        g = torch.Generator().manual_seed(seed + 2)
        flat = c.view(-1, dim)
        rows = torch.randint(0, flat.shape[0], (max(1, flat.shape[0] // 20),), generator=g)
        flat[rows] = float("nan")
        # and one whole page of NaN keys: its block scores -inf
        c[int(step.block_table[0, 1])] = float("nan")
    return tuple(x.to(device) for x in (q, c, step.cu_seqlens_q, step.seq_lens,
                                        step.block_table))


def shard(index_cache, block_table, cp_size, cp_rank):
    """Rank cp_rank's sharded index: its table has -1 at other ranks' blocks and the pages of
    those blocks are poisoned with NaN in its copy of the cache (were one read, results would
    change)."""
    table = owned_table(block_table, cp_size, cp_rank)
    others = block_table[(block_table >= 0) & (table < 0)].long()
    cache = index_cache.clone()
    if others.numel():
        cache[others] = float("nan")
    return cache, table


def cases(device="cpu", quick=False):
    """(name, args, rule) triples; quick: fewer (the interpreter is slow)."""
    out = []
    dtypes = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float8_e4m3fn)]
    for i, (qd, cd) in enumerate(dtypes[:1] if quick else dtypes):
        for integer, nan_keys in ((True, False),) if quick else ((True, False), (False, True)):
            args = make_case(10 * i + 3 * integer + nan_keys, q_dtype=qd, c_dtype=cd,
                             integer=integer, nan_keys=nan_keys, device=device)
            rules = RULES[2:3] if quick else RULES
            for rule in rules:
                out.append((f"{qd}-{cd}-int{integer}-nan{nan_keys}-{rule}", args, rule))
    return out


def simulate(args, rule, cp_size, *, sharded=False, max_q_len=None):
    """The CP selection run rank by rank in one process: each rank's candidates, stacked as the
    all-gather would, merged."""
    q, c, cu, seq, table = args
    topk, init, local = rule
    keys = []
    for r in range(cp_size):
        cache, tab = shard(c, table, cp_size, r) if sharded else (c, table)
        k, position = rank_candidates(q, cache, cu, seq, tab, cp_size=cp_size, cp_rank=r,
                                      topk=topk, init_blocks=init, local_blocks=local,
                                      block_size=B, max_q_len=max_q_len)
        keys.append(k)
    cand = torch.stack(keys, 2)  # [T, H, W, k], as the all-gather's view
    rule = dict(topk=topk, init_blocks=init, local_blocks=local, block_size=B)
    if use_kernels(q):
        return merge_candidates_kernel(cand, position, **rule)
    return merge_candidates(cand.reshape(q.shape[0], q.shape[1], -1), position, **rule)


__all__ = ["B", "make_case", "shard", "cases", "simulate", "local_candidates"]
