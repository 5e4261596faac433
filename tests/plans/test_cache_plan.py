# SPDX-License-Identifier: Apache-2.0
"""The cache op's launch plans as pure functions of step shapes, device facts and CacheConfig
(no tensors, no monkeypatching)."""

import dataclasses

import pytest
import torch

from openmsa.ops.cache.plan import (DEFAULT, CacheConfig, IndexWriteShape, KVWriteShape,
                                    PrepareShape, plan)
from openmsa.ops.common.plan import DeviceFacts

pytestmark = pytest.mark.reference

FP8 = torch.float8_e4m3fn
H200 = DeviceFacts("cuda", 132, (9, 0), True)
H200_NO_GLUON = DeviceFacts("cuda", 132, (9, 0), False)
CPU = DeviceFacts("cpu", 4, (0, 0), False)


def _prepare(tokens=8, heads=(64, 4, 4), dims=(128, 128), kv=torch.bfloat16, index=FP8,
             index_q=None, scale=False):
    hq, hkv, h = heads
    return PrepareShape(tokens, hq, hkv, h, dims[0], dims[1], 64, 128, 128, kv, index,
                        index if index_q is None else index_q, scale)


@pytest.mark.parametrize("heads, tile, tiles", [
    ((64, 4, 4), 16, 4 + 1 + 1 + 1),   # M3 TP1: four q tiles, one each of KV and index q, index k
    ((16, 1, 1), 16, 1 + 1 + 1 + 1),   # TP4
    ((8, 1, 1), 8, 1 + 1 + 1 + 1),     # TP8: the tile shrinks to the widest head group
    ((3, 3, 1), 4, 1 + 1 + 1 + 1),
])
def test_prepare_tiles_heads_per_token(heads, tile, tiles):
    launch, = plan(_prepare(tokens=100, heads=heads), H200, DEFAULT)
    assert launch.kernel == "fused_prepare" and launch.grid == (100, tiles)
    assert launch.params["HT"] == tile and launch.params["num_warps"] == 4


def test_prepare_params_follow_dtypes_dims_and_scales():
    p = plan(_prepare(kv=FP8, index=FP8, index_q=torch.bfloat16, scale=True), H200).find(
        "fused_prepare").params
    assert (p["KV_SATURATE"], p["INDEX_SATURATE"], p["IQ_SATURATE"], p["HAS_SCALE"]) == \
        (True, True, False, True)
    assert (p["HQ"], p["HKV"], p["H"], p["D"], p["DI"], p["ROT"]) == (64, 4, 4, 128, 128, 64)
    assert p["NCOARSE"] == 1 << 14 and (p["BLOCK"], p["IBLOCK"]) == (128, 128)
    p = plan(_prepare(dims=(96, 64), kv=torch.bfloat16, index=torch.bfloat16), H200).launches[
        0].params
    assert (p["DP"], p["DIP"], p["KV_SATURATE"], p["INDEX_SATURATE"], p["HAS_SCALE"]) == \
        (128, 64, False, False, False)
    assert p["INDEX_NVFP4"] is False
    p = plan(_prepare(index=torch.uint8, index_q=FP8), H200).launches[0].params
    assert (p["INDEX_NVFP4"], p["INDEX_SATURATE"], p["IQ_SATURATE"]) == (True, False, True)


def test_prepare_knobs_come_from_the_config():
    config = dataclasses.replace(DEFAULT, prepare_head_tile=4, prepare_warps=8)
    launch, = plan(_prepare(tokens=3), H200, config)
    assert launch.grid == (3, 16 + 1 + 1 + 1) and launch.params["HT"] == 4
    assert launch.params["num_warps"] == 8


def test_writes():
    launch, = plan(IndexWriteShape(7, 96, 64, FP8), H200)
    assert launch.kernel == "write_index_cache" and launch.grid == (7,)
    assert dict(launch.params) == dict(BLOCK=64, DI=96, DIP=128, SATURATE=True, NVFP4=False)
    nvfp4, = plan(IndexWriteShape(7, 128, 128, torch.uint8), H200)
    assert dict(nvfp4.params) == dict(BLOCK=128, DI=128, DIP=128, SATURATE=False, NVFP4=True)
    launch, = plan(KVWriteShape(5, 3, 128, 16, torch.float16, False), H200)
    assert launch.kernel == "write_kv_cache" and launch.grid == (5,)
    assert dict(launch.params) == dict(BLOCK=16, HKV=3, HKVP=4, D=128, DP=128, SATURATE=False,
                                       HAS_SCALE=False)
    assert plan(KVWriteShape(5, 4, 128, 16, FP8, True), H200).launches[0].params[
        "HAS_SCALE"] is True


@pytest.mark.parametrize("shape", [IndexWriteShape(0, 128, 128, FP8),
                                   KVWriteShape(0, 4, 128, 128, FP8, True), _prepare(tokens=0)])
def test_an_empty_step_launches_nothing(shape):
    assert len(plan(shape, H200)) == 0


@pytest.mark.parametrize("shape", [IndexWriteShape(9, 128, 128, FP8),
                                   KVWriteShape(9, 4, 128, 128, torch.bfloat16, False),
                                   _prepare(tokens=9, heads=(16, 1, 1))])
def test_the_launches_are_the_same_on_every_device(shape):
    want = plan(shape, H200)
    assert plan(shape, H200_NO_GLUON) == want and plan(shape, CPU) == want


def test_config_fields_are_checked():
    with pytest.raises(ValueError, match="prepare_head_tile"):
        CacheConfig(prepare_head_tile=12)
    with pytest.raises(ValueError, match="prepare_warps"):
        CacheConfig(prepare_warps=0)
    with pytest.raises(TypeError, match="no cache plan"):
        plan(object(), H200)


def test_prepare_rope_form_reaches_the_kernel():
    """The fp32 angle form and YaRN's attention factor are constexprs of the preparation."""
    exact, = plan(_prepare(), H200, DEFAULT)
    assert exact.params["FP32_ANGLES"] is False and exact.params["ROPE_SCALE"] == 1.0
    yarn, = plan(dataclasses.replace(_prepare(), fp32_angles=True, rope_scale=1.0693),
                 H200, DEFAULT)
    assert yarn.params["FP32_ANGLES"] is True and yarn.params["ROPE_SCALE"] == 1.0693
