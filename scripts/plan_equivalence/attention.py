# SPDX-License-Identifier: Apache-2.0
"""sparse_attention's launch plans of this tree against the base tree's: every launch equal
(kernel name, grid, every constexpr and launch option with its type) and the sizes, on a sweep
of step shapes x devices x configs, and the split count (num_splits) on a grid of its own.

    python3 benchmarks/prepare_ab.py e0ad0dd .ab     # once: the base tree as .ab/openmsa_base
    python3 scripts/plan_equivalence/attention.py    # from the repo root; exits 1 on a difference

Step shapes: decode and verify steps (B 1..128 x q_len 1..33) and prefill chunks (2047..128K
tokens), M3's head counts at TP1/TP4/TP8 and other groups (G 1..32), head dims and block sizes,
16-bit, fp32 and fp8 (e4m3, e4m3fnuz) K/V under 16-bit and fp32 queries, topk 1..64, and the
properties of the K/V views (pairs, TMA views, alignment, LSE, scales). The context length is
no input of the plan (the selection is): contexts up to 1M tokens give the same plans as these.
Devices: H200 and H100 SXM (132 SMs), H100 PCIe (114), Hopper without Gluon, sm_80, a ROCm GPU
and the interpreter (CPU), under the default config; under the other configs (the tile and
Gluon switches, other thresholds and forms, and the numbers that were module constants of the
base's plan.py, set there as globals and here as AttentionConfig fields) H200, sm_80 and the
CPU on every 7th shape.
"""

import dataclasses
import itertools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, ".ab")]

import torch  # noqa: E402

from devices import DEVICES as ALL_DEVICES  # noqa: E402

import openmsa_base.ops.attention.plan as base  # noqa: E402
from openmsa.ops.attention import plan as new  # noqa: E402
from openmsa.ops.common.plan import DeviceFacts  # noqa: E402
from openmsa_base.ops.common.plan import DeviceFacts as BaseFacts  # noqa: E402

# base launch name -> this tree's (the launch names did not change)
KERNELS = {"token": "token", "merge": "merge", "tile_plan": "tile_plan", "tiles": "tiles",
           "tiles_gluon": "tiles_gluon"}

DEVICES = {name: ALL_DEVICES[name] for name in
           ("h200", "h100-pcie", "hopper-no-gluon", "sm80", "hip", "cpu")}

NO_GLUON = dict(gluon_16=None, gluon_fp8=None, gluon_pair_fp8=None)


def _tile_forms(config, **fields):
    return dict(tile_16=dataclasses.replace(config.tile_16, **fields),
                tile_fp8=dataclasses.replace(config.tile_fp8, **fields))


# (name, base config fields, base module globals, this tree's config fields)
CONFIGS = [
    ("default", {}, {}, {}),
    ("no-tiles", dict(tiles=False), {}, dict(tiles=False)),
    ("no-gluon", NO_GLUON, {}, NO_GLUON),
    ("gluon-16-only", dict(gluon_fp8=None, gluon_pair_fp8=None), {},
     dict(gluon_fp8=None, gluon_pair_fp8=None)),
    ("thresholds", dict(small_pairs=1, prefill_min_tokens=512, rounds_stages_16=3), {},
     dict(small_pairs=1, prefill_min_tokens=512, rounds_stages_16=3)),
    ("tile-forms", dict(NO_GLUON, tile_16=base.TileForm(rows=128, sub=128, stages=3,
                                                        persistent=True, waste=3.0),
                        tile_fp8=base.TileForm(rows=32, sub=64, stages=2, persistent=False,
                                               waste=1.0)), {},
     dict(NO_GLUON, tile_16=new.TileForm(rows=128, sub=128, stages=3, persistent=True,
                                         waste=3.0),
          tile_fp8=new.TileForm(rows=32, sub=64, stages=2, persistent=False, waste=1.0))),
    ("moved-tile-knobs", NO_GLUON,
     dict(TILE_WARPS=8, TILE_PLAN_WARPS=2, TILE_RESIDENT=3, INTERPRET_TILE_PROGRAMS=5,
          MERGE_WARPS=8),
     dict(NO_GLUON, **_tile_forms(new.DEFAULT, warps=8, plan_warps=2, resident=3,
                                  interpret_programs=5),
          split=new.SplitForm(merge_warps=8))),
    ("moved-split-model", {},
     dict(MIN_STEPS_PER_SPLIT=1, FUSED_MAX_SPLITS=8, SPLIT_FIXED_US=3.0, SPLIT_STEP_US=2.0,
          SPLIT_FUSED_US=1.0, SPLIT_LAUNCH_US=6.0, SPLIT_PER_SPLIT_US=0.3, SPLIT_COPY_TBS=3.35),
     dict(split=new.SplitForm(min_steps=1, fused_max=8, fixed_us=3.0, step_us=2.0,
                              fused_us=1.0, launch_us=6.0, per_split_us=0.3,
                              copy_tbs=3.35))),
]

FP8, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
BATCHES = (1, 2, 3, 4, 5, 8, 10, 16, 32, 64, 100, 128)
Q_LENS = (1, 2, 3, 4, 8, 16, 17, 33)
PREFILL = (2047, 2048, 2049, 3000, 4096, 8192, 8193, 16384, 65536, 131072)
TOKENS = sorted({b * q for b in BATCHES for q in Q_LENS} | set(PREFILL) | {0})
# (Hq, Hkv, index heads): M3 at TP1, TP4, TP8, and groups of 1, 4 and 32
HEADS = ((64, 4, 4), (16, 1, 1), (8, 1, 1), (4, 4, 4), (32, 8, 8), (32, 1, 1))
DTYPES = ((BF16, BF16), (BF16, FP8), (FP16, FP16), (FP16, FP8), (BF16, FNUZ), (FP32, FP32),
          (FP32, FP8))
TOPKS = (1, 2, 4, 8, 16, 17, 32, 64)
DIMS = ((128, 128), (128, 64), (64, 128))  # (head dim, block size)
# (v_pairs_view, tma_views, tma_aligned, return_lse, has_scale)
FLAGS = ((True, True, True, False, False), (False, True, True, True, False),
         (True, True, False, False, True), (True, False, True, False, False),
         (True, True, True, True, True))


OTHER_DEVICES = ("h200", "sm80", "cpu")
OTHER_STRIDE = 7


def _launches(p, names=None):
    """A plan as comparable data: (kernel, grid, params with their types) per launch, sizes."""
    rows = tuple(((names or {}).get(l.kernel, l.kernel), l.grid,
                  tuple(sorted((k, type(v).__name__, v) for k, v in l.params.items())))
                 for l in p.launches)
    return rows, tuple(sorted(p.sizes.items()))


def compare_plans() -> tuple[int, int, list]:
    shapes = [dict(num_tokens=t, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                   num_index_heads=hi, topk=k, block_size=b, q_dtype=qd, kv_dtype=kd,
                   v_pairs_view=vp, tma_views=tv, tma_aligned=ta, return_lse=lse,
                   has_scale=hs)
              for t, (hq, hkv, hi), (qd, kd), k, (d, b), (vp, tv, ta, lse, hs)
              in itertools.product(TOKENS, HEADS, DTYPES, TOPKS, DIMS, FLAGS)]
    pairs = [(base.AttentionShape(**s), new.AttentionShape(**s)) for s in shapes]
    compared, diffs = 0, []
    # the default config on every device and shape; the others on every OTHER_STRIDE-th shape
    # of OTHER_DEVICES (the sweep stays within minutes on one core)
    saved = {name: getattr(base, name) for _, _, g, _ in CONFIGS for name in g}
    for cname, base_fields, base_globals, new_fields in CONFIGS:
        bconf = dataclasses.replace(base.DEFAULT, **base_fields)
        nconf = dataclasses.replace(new.DEFAULT, **new_fields)
        for name, value in base_globals.items():
            setattr(base, name, value)
        try:
            default = cname == "default"
            for dname, facts in DEVICES.items():
                if not default and dname not in OTHER_DEVICES:
                    continue
                bdev, ndev = BaseFacts(**facts), DeviceFacts(**facts)
                for bshape, nshape in pairs if default else pairs[::OTHER_STRIDE]:
                    want = _launches(base.plan(bshape, bdev, bconf), KERNELS)
                    got = _launches(new.plan(nshape, ndev, nconf))
                    compared += 1
                    if want != got and len(diffs) < 20:
                        diffs.append((cname, dname, nshape, want, got))
                    elif want != got:
                        diffs.append(None)
        finally:
            for name, value in saved.items():
                setattr(base, name, value)
    return len(shapes), compared, diffs


def compare_splits() -> tuple[int, list]:
    """num_splits on its own grid: pairs x steps x keys per step x bytes per key x programs
    per SM x devices, under the default model and the moved one."""
    model = next(c for c in CONFIGS if c[0] == "moved-split-model")
    compared, diffs = 0, []
    for base_globals, form in (({}, new.SplitForm()), (model[2], model[3]["split"])):
        saved = {name: getattr(base, name) for name in base_globals}
        for name, value in base_globals.items():
            setattr(base, name, value)
        try:
            for facts in DEVICES.values():
                bdev, ndev = BaseFacts(**facts), DeviceFacts(**facts)
                for args in itertools.product(
                        (1, 2, 3, 4, 7, 8, 10, 16, 31, 32, 40, 64, 100, 128, 256, 512, 1000,
                         4096, 65536), (1, 2, 3, 4, 8, 15, 16, 32, 64, 128), (16, 32, 64, 128),
                        (128, 256, 512, 1024), (1, 2, 3, 4)):
                    want = base.num_splits(*args, bdev)
                    got = new.num_splits(*args, ndev, form)
                    compared += 1
                    if want != got:
                        diffs.append((args, facts, want, got))
        finally:
            for name, value in saved.items():
                setattr(base, name, value)
    return compared, diffs


def main() -> int:
    start = time.time()
    shapes, compared, diffs = compare_plans()
    splits, split_diffs = compare_splits()
    print(f"attention: {shapes} step shapes ({len(DEVICES)} devices under the default config, "
          f"{len(OTHER_DEVICES)} under {len(CONFIGS) - 1} others on every {OTHER_STRIDE}th "
          f"shape): {compared} plans compared, {len(diffs)} differ; num_splits: {splits} "
          f"calls compared, {len(split_diffs)} differ ({time.time() - start:.0f} s)")
    for d in [d for d in diffs if d is not None][:5] + split_diffs[:5]:
        print("DIFF", *d, sep="\n  ")
    return 1 if diffs or split_diffs else 0


if __name__ == "__main__":
    sys.exit(main())
