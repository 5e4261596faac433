# SPDX-License-Identifier: Apache-2.0
"""What a chain of dependent launches costs on this GPU with (almost) no work in them: the floor
under a small decode step's separate kernels (issue 57).

Each link of a chain is one launch of 64 programs of 4 warps (a B = 1 attention step's grid)
that reads what the link before it wrote and writes one value per program; "cold" links also
make one load that depends on it from a buffer no link has touched since the L2 flush (one HBM
round trip each). Chains of 1 to 6 links are timed as run.graph_call_us times a call (graphs of
(flush, chain) and of (flush) replayed back to back, the difference), launched plainly and as
programmatic dependents (each link waits with griddepcontrol.wait, then lets the next start).

    python3 benchmarks/launch_floor.py [--links 1,2,4,6] [--json PATH]
"""

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

PROGRAMS = 64
# a cold link's loads land this many int32 apart (a page of their own), per link and program
COLD_STRIDE = 1 << 12


@triton.jit
def _link(src_ptr, dst_ptr, cold_ptr, link, PDL: tl.constexpr, COLD: tl.constexpr,
          STRIDE: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    v = tl.load(src_ptr + pid)
    if COLD:
        # the address depends on v, so this load waits for the one above: two round trips
        v = v + tl.load(cold_ptr + ((link * tl.num_programs(0) + pid) * STRIDE + (v & 7)))
    tl.store(dst_ptr + pid, v + 1)


def chain(links: int, pdl: bool, cold: bool):
    bufs = [torch.zeros(PROGRAMS, dtype=torch.int32, device="cuda") for _ in range(links + 1)]
    cold_buf = torch.zeros((links * PROGRAMS + 1) * COLD_STRIDE, dtype=torch.int32,
                           device="cuda")

    def call():
        for i in range(links):
            _link[(PROGRAMS,)](bufs[i], bufs[i + 1], cold_buf, i, PDL=pdl, COLD=cold,
                               STRIDE=COLD_STRIDE, num_warps=4, launch_pdl=pdl)
    call.result = bufs[-1]
    return call


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--links", default="1,2,4,6")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(run.provenance(), flush=True)
    rows = []
    for cold in (False, True):
        for pdl in (False, True):
            for n in (int(x) for x in args.links.split(",")):
                fn = chain(n, pdl, cold)
                us = run.graph_call_us(fn, args.iters)
                dev = run.med(run.device_times_us(fn, 20))
                torch.cuda.synchronize()
                ok = bool((fn.result >= n).all())
                row = dict(links=n, pdl=pdl, cold=cold, graph_us=us, device_us=dev, ok=ok)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(provenance=run.provenance(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
