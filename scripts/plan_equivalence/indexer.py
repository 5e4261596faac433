# SPDX-License-Identifier: Apache-2.0
"""The index branch's launch plans of this tree against the base tree's: every launch equal
(kernel name through the renames, grid, every constexpr and launch option with its type) and
the sizes, on a sweep of step shapes x devices x configs; the selection alone (selection_plan,
as launch_select plans it) and selection_layout; and the context-parallel launches (cp_plan:
the share's scoring, the key packing and the merge, against the base's scoring plan of the
strided view and the launches its cp.py made in closures).

    python3 benchmarks/prepare_ab.py e0ad0dd .ab     # once: the base tree as .ab/openmsa_base
    python3 scripts/plan_equivalence/indexer.py      # from the repo root; exits 1 on a difference

Step shapes: decode and verify steps (B 1..128 x q_len 1..33) and prefill chunks (alone, and
beside decode requests) with and without the max_q_len hint, contexts 128 tokens..1M, index
heads of M3 at TP1/TP4/TP8 (4, 1) and others, head dims and block sizes, fp8, 16-bit and fp32
queries over fp8, 16-bit, fp32 and NVFP4 caches (the staged forms), with and without TMA rows,
topk none (block_scores) and 1..64 with init/local blocks, context-parallel shares. Devices:
H200/H100 SXM (132 SMs), H100 PCIe (114), Hopper without Gluon, sm_100, sm_80, a ROCm GPU and
the interpreter (CPU). Configs: the default, the base's IndexerConfig fields (this tree's
forms), and the numbers that were module constants of the base's plan.py and kernel files (set
there as globals, here as form fields). The sweep's ~320K step shapes are sampled with a fixed
seed: 120K on every device under the default config (and the selection alone), 8K on four
devices under each other config, 2.5K x (W, rank) for the context-parallel plans. This tree's
Gluon prefill launch passes the register split (CONSUMER_REGS, PRODUCER_REGS) that the base's
kernel file held as constants: it is compared against those.
"""

import dataclasses
import itertools
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, ".ab")]

import torch  # noqa: E402

from devices import DEVICES  # noqa: E402

import openmsa_base.ops.indexer.cp as base_cp  # noqa: E402
import openmsa_base.ops.indexer.plan as base  # noqa: E402
import openmsa_base.ops.indexer.scores_ws as base_ws  # noqa: E402
import openmsa_base.ops.indexer.stage as base_stage  # noqa: E402
from openmsa.ops.common.plan import DeviceFacts  # noqa: E402
from openmsa.ops.indexer import plan as new  # noqa: E402
from openmsa_base.ops.common.plan import DeviceFacts as BaseFacts  # noqa: E402

# base launch name -> this tree's
KERNELS = {"scores_request": "scores_decode", "scores_request_nvfp4": "scores_decode_nvfp4",
           "scores_tile": "scores_prefill", "scores_tile_ws": "scores_prefill_gluon",
           "scores_tile_unaligned": "scores_prefill_unaligned", "stage_nvfp4": "stage_nvfp4",
           "select_short_rows": "select_short_rows", "select_group_max": "select_group_max",
           "select_group_bound": "select_group_bound", "select_segments": "select_segments",
           "select_merge": "select_merge", "local_keys": "cp_local_keys", "merge": "cp_merge"}


# (name, base IndexerConfig fields, base module globals {module: {name: value}}, this tree's
# IndexerConfig.replace changes)
P, WS, ST = "plan", "ws", "stage"
CONFIGS = [
    ("default", {}, {}, {}),
    ("decode", dict(decode_waves=8, decode_max_bps=16), {}, dict(decode=dict(waves=8,
                                                                            max_bps=16))),
    ("decode-bps1", dict(decode_waves=0 + 1, decode_max_bps=1), {},
     dict(decode=dict(waves=1, max_bps=1))),
    ("prefill", dict(prefill_rows=32, prefill_bps=8), {}, dict(prefill=dict(rows=32, bps=8))),
    ("gluon-one-split", dict(ws_waves=0), {}, dict(gluon=dict(waves=0))),
    ("gluon", dict(ws_waves=2, ws_stages=4, ws_stages_16=2), {},
     dict(gluon=dict(waves=2, stages_fp8=4, stages_16=2))),
    ("select", dict(select_segment=256, select_sort_waves=4, select_chunk=64,
                    select_chunk_min_waves=0), {},
     dict(select=dict(segment=256, sort_waves=4, chunk=64, chunk_min_waves=0))),
    ("select-never-sort", dict(select_sort_waves=0, select_chunk=0), {},
     dict(select=dict(sort_waves=0, chunk=0))),
    ("group-short", dict(select_group_min_blocks=0, select_short_max=64, select_short_tpr=8),
     {}, dict(group=dict(min_blocks=0), short_rows=dict(max_blocks=64, tpr=8))),
    ("no-group-no-short", dict(select_group_min_blocks=1 << 30, select_short_max=0), {},
     dict(group=dict(min_blocks=1 << 30), short_rows=dict(max_blocks=0))),
    ("staged", dict(nvfp4_prefill="staged"), {}, dict(nvfp4_prefill="staged")),
    ("inkernel", dict(nvfp4_prefill="inkernel"), {}, dict(nvfp4_prefill="inkernel")),
    # the base's module constants, as this tree's form fields
    ("decode-constants", {}, {P: dict(DECODE_WARPS=8, DECODE_STAGES=2, DECODE_MAXNREG_NVFP4=96)},
     dict(decode=dict(warps=8, stages=2, maxnreg_nvfp4=96))),
    ("nvfp4-constants", {}, {P: dict(NVFP4_PROGRAMS=32, NVFP4_STAGES=4, NVFP4_MAX_BPS=16,
                                     NVFP4_MIN_BPS=4, NVFP4_MAXNREG_8_ROWS=128)},
     dict(decode_nvfp4=dict(programs=32, stages=4, max_bps=16, min_bps=4, maxnreg_8_rows=128))),
    ("prefill-constants", {}, {P: dict(PREFILL_WARPS=8, PREFILL_STAGES=3, PREFILL_STAGES_FP8=2,
                                       PREFILL_STAGES_NVFP4=4, NVFP4_MAX_ROWS=32)},
     dict(prefill=dict(warps=8, stages_16=3, stages_fp8=2, stages_nvfp4=4, max_rows_nvfp4=32))),
    ("gluon-constants", {}, {P: dict(WS_START_BLOCKS=2, WS_EMPTY_BLOCKS=0),
                             WS: dict(CONSUMER_REGS=base_ws.gl.constexpr(104))},
     dict(gluon=dict(start_blocks=2, empty_blocks=0, consumer_regs=104))),
    ("stage-constants", dict(nvfp4_prefill="staged"),
     {P: dict(STAGE_MAX_BPP=8, STAGE_WAVES=2, STAGE_WARPS=8), ST: dict(RANK_CHUNK=64)},
     dict(nvfp4_prefill="staged", stage=dict(max_bpp=8, waves=2, warps=8, rank_chunk=64))),
    ("select-constants", dict(select_group_min_blocks=1 << 30),
     {P: dict(SORT_WARPS=8, SCRATCH_SLOTS=128, SHORT_WARPS=2, SHORT_SORT_MAX=256)},
     dict(group=dict(min_blocks=1 << 30), select=dict(sort_warps=8, scratch_slots=128),
          short_rows=dict(warps=2, sort_max=256))),
    ("group-constants", dict(select_group_min_blocks=0),
     {P: dict(GROUP_SIZE=32, GROUPS_PER_PROGRAM=32, GROUP_CHUNK=256)},
     dict(group=dict(min_blocks=0, size=32, per_program=32, chunk=256))),
]
MODULES = {P: base, WS: base_ws, ST: base_stage}

FP8, BF16, F16, F32, U8 = (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32,
                           torch.uint8)
# (q dtype, cache dtype): one dtype, 16-bit over fp8, fp32 (the reference precision), NVFP4 pages
DTYPES = [(FP8, FP8), (BF16, BF16), (F16, F16), (BF16, FP8), (F16, FP8), (F32, F32),
          (FP8, U8), (F16, U8), (BF16, U8)]
CONTEXTS = [128, 1000, 8192, 32768, 131072, 1 << 20]


def steps():
    """(num_tokens, num_requests, max_q_len hint, context) of decode/verify steps, prefill
    chunks alone and prefill chunks beside decode requests."""
    out = []
    for batch in (1, 2, 3, 8, 32, 64, 128):
        for q_len in (1, 2, 4, 16, 17, 33):
            for hint in {None, q_len, 16}:
                out.append((batch * q_len, batch, hint))
    for chunk in (17, 200, 2047, 8192):
        for hint in (None, chunk):
            out.append((chunk, 1, hint))
            out.append((chunk + 64, 65, hint))  # a chunk beside 64 decode requests
    return out


def shape_params():
    """Every step shape of the sweep, as IndexerShape fields: steps x contexts x heads x dtypes
    x block sizes and head dims x TMA layouts x selection rules."""
    out = []
    for (tokens, requests, hint), context, heads, (qd, cd) in itertools.product(
            steps(), CONTEXTS, (4, 1, 3), DTYPES):
        nvfp4 = cd == U8
        # (TMA rows and the TMA query apart only matter to the staged NVFP4 form)
        layouts = ((True, True), (False, True), (False, False)) if nvfp4 else \
            ((True, True), (False, False))
        for block, dim in ((128, 128),) if nvfp4 else ((128, 128), (64, 64)):
            for (topk, init, local), (tma_rows, tma_q) in itertools.product(
                    ((None, 0, 1), (1, 0, 1), (16, 1, 2), (64, 0, 1)), layouts):
                out.append(dict(num_tokens=tokens, num_heads=heads, head_dim=dim,
                                num_requests=requests, max_blocks=-(-context // block),
                                block_size=block, q_dtype=qd, cache_dtype=cd, max_q_len=hint,
                                tma_rows=tma_rows, topk=topk, init_blocks=init,
                                local_blocks=local, tma_q=tma_q))
    return out


def launch_key(launch, extra=None):
    """A launch as comparable data: kernel (base names mapped), grid and params with types."""
    params = dict(launch.params)
    if extra:
        params.update(extra)
    return (KERNELS.get(launch.kernel, launch.kernel), tuple(launch.grid),
            tuple(sorted((k, type(v).__name__, v) for k, v in params.items())))


def plan_key(p, gluon_regs=None):
    """A plan as comparable data; the base's Gluon prefill launch gets the register split its
    kernel file held (this tree passes it as constexprs)."""
    return ([launch_key(x, gluon_regs if x.kernel == "scores_tile_ws" else None) for x in p],
            sorted(dict(p.sizes).items()))


class _Recorded:
    """A base cp.py Launch made by its closures, kept instead of launched."""

    def __init__(self, kernel, grid, params):
        self.kernel, self.grid, self.params, self.sizes = kernel, grid, params, {}

    def run(self, *args):
        pass


def base_cp_launches(shape, cp_size, config):
    """The launches the base's cp.py made for a rank's candidates and the merge (its closures,
    run on meta tensors: nothing is computed)."""
    made = []

    def record(kernel, key, grid_and_params):
        made.append(_Recorded(kernel, *grid_and_params()))
        return made[-1]
    base_cp._launch = record
    width = -(-shape.max_blocks // cp_size)
    meta = dict(device="meta")
    scores = torch.empty((shape.num_tokens, shape.num_heads, width), **meta)
    cu = torch.empty(shape.num_requests + 1, dtype=torch.int32, **meta)
    seq = torch.empty(shape.num_requests, dtype=torch.int32, **meta)
    keys, position = base_cp.local_candidates_kernel(
        scores, cu, seq, cp_size=cp_size, cp_rank=0, max_blocks=shape.max_blocks,
        topk=shape.topk, init_blocks=shape.init_blocks, local_blocks=shape.local_blocks,
        block_size=shape.block_size)
    cand = keys.unsqueeze(2).expand(*keys.shape[:2], cp_size, keys.shape[2])
    base_cp.merge_candidates_kernel(cand, position, topk=shape.topk,
                                    init_blocks=shape.init_blocks,
                                    local_blocks=shape.local_blocks,
                                    block_size=shape.block_size)
    return made


def compare_plans(params, devices, configs, alone=False):
    """(compared, differ): plan() of every shape in `params` on `devices` under `configs`, and
    with `alone` the selection alone (as launch_select plans it: head dim 0, fp32 scores)."""
    compared = differ = 0
    for name, base_fields, globals_, new_changes in configs:
        saved = {m: {k: getattr(MODULES[m], k) for k in g} for m, g in globals_.items()}
        for m, g in globals_.items():
            for k, v in g.items():
                setattr(MODULES[m], k, v)
        try:
            bcfg = dataclasses.replace(base.DEFAULT, **base_fields)
            ncfg = new.DEFAULT.replace(**new_changes)
            regs = dict(CONSUMER_REGS=base_ws.CONSUMER_REGS.value, PRODUCER_REGS=24)
            for dname in devices:
                bdev, ndev = BaseFacts(**DEVICES[dname]), DeviceFacts(**DEVICES[dname])
                for fields in params:
                    bshape, nshape = base.IndexerShape(**fields), new.IndexerShape(**fields)
                    compared += 1
                    want = plan_key(base.plan(bshape, bdev, bcfg), regs)
                    got = plan_key(new.plan(nshape, ndev, ncfg))
                    if got != want:
                        differ += 1
                        if differ <= 10:
                            print(f"DIFF plan {name} {dname} {nshape}:\n  base {want}\n  "
                                  f"this {got}")
                    if alone and nshape.topk is not None:
                        sel = dict(head_dim=0, q_dtype=F32, cache_dtype=F32)
                        compared += 1
                        if (plan_key(base.selection_plan(dataclasses.replace(bshape, **sel),
                                                         bdev, bcfg))
                                != plan_key(new.selection_plan(
                                    dataclasses.replace(nshape, **sel), ndev, ncfg))):
                            differ += 1
                            print(f"DIFF selection_plan {name} {dname} {nshape}")
        finally:
            for m, g in saved.items():
                for k, v in g.items():
                    setattr(MODULES[m], k, v)
    return compared, differ


def main() -> int:
    start = time.time()
    params = shape_params()
    rng = random.Random(55)
    # the default config on every device over a large sample of the sweep; every other config
    # on a Hopper, an sm_80, a ROCm GPU and the interpreter over a smaller one
    full = rng.sample(params, 120000)
    compared, differ = compare_plans(full, DEVICES, CONFIGS[:1], alone=True)
    print(f"  default: {compared} compared, {differ} differ ({time.time() - start:.0f} s)",
          flush=True)
    for config in CONFIGS[1:]:
        c, d = compare_plans(rng.sample(params, 8000), ("h200", "sm80", "hip", "cpu"), [config])
        compared, differ = compared + c, differ + d
        print(f"  {config[0]}: {compared} compared, {differ} differ "
              f"({time.time() - start:.0f} s)", flush=True)
    # selection_layout on its own grid
    for rows, blocks, kp, per_wave in itertools.product(
            (1, 3, 4, 16, 64, 128, 264, 1000, 4096, 32768), (0, 1, 7, 64, 256, 1000, 1024, 8192),
            (2, 4, 16, 32, 64), (4, 108, 132, 304)):
        for name, base_fields, globals_, new_changes in CONFIGS[:12]:
            compared += 1
            if (base.selection_layout(rows, blocks, kp, per_wave,
                                      dataclasses.replace(base.DEFAULT, **base_fields))
                    != new.selection_layout(rows, blocks, kp, per_wave,
                                            new.DEFAULT.replace(**new_changes))):
                differ += 1
                print(f"DIFF selection_layout {rows} {blocks} {kp} {per_wave} {name}")
    # context-parallel ranks: the share's scoring plan (the base's api scored the strided view
    # block_table[:, rank::W] with tma_rows False and cp True), the packing and the merge
    cp_compared = 0
    for fields in rng.sample([f for f in params if f["topk"] is not None
                              and f["head_dim"] == 128], 2500):
        bshape, nshape = base.IndexerShape(**fields), new.IndexerShape(**fields)
        for world in (1, 2, 3, 4, 8):
            for rank in sorted({0, 1 % world, world - 1}):
                dname = ("h200", "sm80", "cpu")[cp_compared % 3]
                bdev, ndev = BaseFacts(**DEVICES[dname]), DeviceFacts(**DEVICES[dname])
                view = torch.empty(1, bshape.max_blocks, device="meta")[:, rank::world]
                share = dataclasses.replace(bshape, max_blocks=view.shape[1], tma_rows=False,
                                            cp=True, topk=None, init_blocks=0, local_blocks=1)
                scoring = base.plan(share, bdev, base.DEFAULT) if view.shape[1] else None
                made = base_cp_launches(bshape, world, base.DEFAULT)
                width = -(-bshape.max_blocks // world)
                want = ([launch_key(x) for x in (scoring or ())] + [launch_key(x) for x in made],
                        sorted({**(dict(scoring.sizes) if scoring else {}), "width": width,
                                "per_rank": min(bshape.topk, width)}.items()))
                got = plan_key(new.cp_plan(nshape, ndev, new.DEFAULT, world, rank))
                compared += 1
                cp_compared += 1
                if got != want:
                    differ += 1
                    if differ <= 20:
                        print(f"DIFF cp_plan {dname} W={world} r={rank} {nshape}:\n"
                              f"  base {want}\n  this {got}")
    print(f"  cp: {cp_compared} compared ({time.time() - start:.0f} s)")
    print(f"indexer plan equivalence: {compared} plans compared (of a sweep of {len(params)} "
          f"step shapes: {len(full)} x {len(DEVICES)} devices under the default config, with the "
          f"selection alone; 8000 x 4 devices under each of {len(CONFIGS) - 1} other configs; "
          f"selection_layout; {cp_compared} context-parallel ranks), {differ} differ, "
          f"{time.time() - start:.0f} s")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
