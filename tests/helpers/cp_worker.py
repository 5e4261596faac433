# SPDX-License-Identifier: Apache-2.0
"""One rank of tests/test_cp.py's multi-process runs (gloo on CPU):

    python cp_worker.py RANK WORLD INIT_FILE MODE

joins the group, runs select_blocks(cp_group=...) on every case of cp_cases (MODE "reference"
or "quick": the interpreter's shorter list), replicated and sharded, and exits non-zero unless
each result is bit-identical to select_blocks without a group in this process."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import openmsa  # noqa: E402
from helpers.cp_cases import B, cases, shard  # noqa: E402


def main():
    rank, world, init_file, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    group = dist.new_group(list(range(world)))
    bad = []
    for name, args, (topk, init, local) in cases(quick=mode == "quick"):
        q, c, cu, seq, table = args
        rule = dict(topk=topk, init_blocks=init, local_blocks=local, block_size=B)
        want = openmsa.select_blocks(*args, **rule)
        for sharded in (False, True):
            cache, tab = shard(c, table, world, rank) if sharded else (c, table)
            out = torch.full_like(want, -7)
            got = openmsa.select_blocks(q, cache, cu, seq, tab, **rule, cp_group=group, out=out)
            if got is not out or not torch.equal(got, want):
                bad.append(f"{name} sharded={sharded}")
    dist.barrier()
    dist.destroy_process_group()
    if bad:
        print(f"rank {rank}/{world}: mismatch in " + "; ".join(bad), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
