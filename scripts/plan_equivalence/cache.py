# SPDX-License-Identifier: Apache-2.0
"""The cache op's launch plans (write_index_cache, write_kv_cache, fused_prepare) of this tree
against the base tree's: every launch equal (kernel name, grid, every constexpr and launch
option with its type) and the sizes, on a sweep of step shapes x devices x configs.

    python3 benchmarks/prepare_ab.py e0ad0dd .ab     # once: the base tree as .ab/openmsa_base
    python3 scripts/plan_equivalence/cache.py        # from the repo root; exits 1 on a difference

Step shapes: 0 to 64K tokens; index writes of several row widths, page sizes and cache dtypes
(16-bit, fp32, fp8 e4m3 and e4m3fnuz, NVFP4 pages); KV writes of 1-8 KV heads, head dims 64-256,
with and without scales; the preparation at M3's TP1/TP4/TP8 head counts and another group,
head/index/rotary dims, page sizes, bf16/fp16/fp8 main caches, bf16/fp8/NVFP4 index caches,
bf16/fp8 index queries, scales, fp32 angles and a YaRN factor. Devices: H200, H100 PCIe, sm_80,
a ROCm GPU and the interpreter under the default config; the CacheConfig variants on the H200.
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

import openmsa_base.ops.cache.plan as base  # noqa: E402
from openmsa.nvfp4 import DTYPE as NVFP4  # noqa: E402
from openmsa.ops.cache import plan as new  # noqa: E402
from openmsa.ops.common.plan import DeviceFacts  # noqa: E402
from openmsa_base.ops.common.plan import DeviceFacts as BaseFacts  # noqa: E402

# base launch name -> this tree's (the launch names did not change)
KERNELS = {"write_index_cache": "write_index_cache", "write_kv_cache": "write_kv_cache",
           "fused_prepare": "fused_prepare"}

DEVICES = {name: ALL_DEVICES[name] for name in ("h200", "h100-pcie", "sm80", "hip", "cpu")}
CONFIGS = ({}, dict(prepare_head_tile=1), dict(prepare_head_tile=8),
           dict(prepare_head_tile=32), dict(prepare_warps=2), dict(prepare_warps=8))

FP8, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TOKENS = (0, 1, 2, 3, 4, 7, 8, 16, 17, 64, 100, 128, 512, 1000, 2048, 4096, 8192, 16384, 65536)


def _shapes():
    """(class name, fields) of every step shape of the sweep."""
    for t, dim, block, dtype in itertools.product(TOKENS, (64, 72, 128, 192, 256),
                                                  (16, 64, 128),
                                                  (BF16, FP16, FP32, FP8, FNUZ, NVFP4)):
        yield "IndexWriteShape", dict(num_tokens=t, dim=dim, block_size=block, cache_dtype=dtype)
    for t, hkv, d, block, dtype, scale in itertools.product(
            TOKENS, (1, 2, 4, 8), (64, 128, 256), (16, 64, 128), (BF16, FP16, FP32, FP8, FNUZ),
            (False, True)):
        yield "KVWriteShape", dict(num_tokens=t, num_kv_heads=hkv, head_dim=d, block_size=block,
                                   cache_dtype=dtype, has_scale=scale)
    for t, (hq, hkv, h), (d, di, rot), (block, iblock), kv, index, iq, scale, fp32, rs in (
            itertools.product(TOKENS, ((64, 4, 4), (16, 1, 1), (8, 1, 1), (32, 8, 2)),
                              ((128, 128, 64), (64, 64, 32), (128, 64, 128)),
                              ((128, 128), (64, 128)), (BF16, FP16, FP8), (BF16, FP8, NVFP4),
                              (BF16, FP8), (False, True), (False, True), (1.0, 1.2))):
        yield "PrepareShape", dict(num_tokens=t, num_heads=hq, num_kv_heads=hkv,
                                   num_index_heads=h, head_dim=d, index_head_dim=di,
                                   rotary_dim=rot, block_size=block, index_block_size=iblock,
                                   kv_cache_dtype=kv, index_cache_dtype=index, index_q_dtype=iq,
                                   has_scale=scale, fp32_angles=fp32, rope_scale=rs)


def _launches(p, names=None):
    """A plan as comparable data: (kernel, grid, params with their types) per launch, sizes."""
    rows = tuple(((names or {}).get(l.kernel, l.kernel), l.grid,
                  tuple(sorted((k, type(v).__name__, v) for k, v in l.params.items())))
                 for l in p.launches)
    return rows, tuple(sorted(p.sizes.items()))


def main() -> int:
    start = time.time()
    pairs = [(getattr(base, cls)(**f), getattr(new, cls)(**f)) for cls, f in _shapes()]
    compared, diffs = 0, []
    for changes in CONFIGS:
        bconf = dataclasses.replace(base.DEFAULT, **changes)
        nconf = dataclasses.replace(new.DEFAULT, **changes)
        for dname, facts in DEVICES.items():
            if changes and dname != "h200":
                continue
            bdev, ndev = BaseFacts(**facts), DeviceFacts(**facts)
            for bshape, nshape in pairs:
                want = _launches(base.plan(bshape, bdev, bconf), KERNELS)
                got = _launches(new.plan(nshape, ndev, nconf))
                compared += 1
                if want != got:
                    diffs.append((changes, dname, nshape, want, got))
    print(f"cache: {len(pairs)} step shapes ({len(DEVICES)} devices under the default config, "
          f"the H200 under {len(CONFIGS) - 1} others): {compared} plans compared, "
          f"{len(diffs)} differ ({time.time() - start:.0f} s)")
    for d in diffs[:5]:
        print("DIFF", *d, sep="\n  ")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
