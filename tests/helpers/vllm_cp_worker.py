# SPDX-License-Identifier: Apache-2.0
"""One rank of tests/test_vllm.py's context-parallel check (gloo on CPU):

    python vllm_cp_worker.py RANK WORLD INIT_FILE

Each rank holds its own 2 index heads of the step's index query (as vLLM shards them over TP)
and the whole index cache; `cp_select_blocks` must give each rank exactly what `select_blocks`
gives for those heads alone, over a step of decode, verify and prefill rows. Exits non-zero
otherwise."""

import sys

import torch
import torch.distributed as dist

from openmsa import select_blocks
from openmsa.integrations.vllm.impls import cp_select_blocks


def main(rank: int, world: int, init: str) -> int:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    heads, block, pages = 2, 16, 40
    q_lens, seq_lens = [1, 1, 3, 3, 40], [70, 120, 100, 33, 128]  # <= 8 blocks of 16
    t = sum(q_lens)
    every = torch.randn(t, heads * world, 32, generator=g)
    cache = torch.randn(pages, block, 32, generator=g)
    table = torch.randperm(pages, generator=g)[:5 * 8].int().view(5, 8)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    mine = every[:, rank * heads:(rank + 1) * heads]
    kw = dict(topk=4, init_blocks=1, local_blocks=1, block_size=block)
    out = torch.full((t, heads, 4), -7, dtype=torch.int32)
    got = cp_select_blocks(mine, cache, cu, seq, table, group=dist.group.WORLD, rank=rank,
                           world=world, out=out, max_q_len=40, **kw)
    want = select_blocks(mine.contiguous(), cache, cu, seq, table, **kw)
    ok = got is out and torch.equal(got, want)
    # bf16 queries travel as bytes
    got16 = cp_select_blocks(mine.bfloat16(), cache.bfloat16(), cu, seq, table,
                             group=dist.group.WORLD, rank=rank, world=world, **kw)
    ok &= torch.equal(got16, select_blocks(mine.bfloat16().contiguous(), cache.bfloat16(), cu,
                                           seq, table, **kw))
    dist.destroy_process_group()
    print("rank", rank, "ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
