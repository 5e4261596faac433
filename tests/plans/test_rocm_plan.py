# SPDX-License-Identifier: Apache-2.0
"""The plans on AMD Instinct GPUs (ROCm): no Gluon kernel, no programmatic dependent launch, no
inline PTX and no ptxas register cap is ever planned there, at every step shape of
helpers/rocm.py; the NVIDIA defaults are unchanged."""

import pytest

from openmsa.ops.common.plan import DeviceFacts
from helpers.rocm import DEVICES, MI300X, MI300X_GLUON, plans

pytestmark = pytest.mark.reference

GLUON = {"tiles_gluon", "scores_prefill_gluon", "select_short_rows"}
NVIDIA_ONLY = {"launch_pdl", "maxnreg"}


def test_device_facts_know_rocm():
    assert not DeviceFacts().hip and DeviceFacts().nvidia and DeviceFacts().hopper
    for device in (*DEVICES.values(), MI300X_GLUON):
        assert device.cuda and device.hip and not device.nvidia and not device.hopper


@pytest.mark.parametrize("device", [*DEVICES.values(), MI300X_GLUON], ids=str)
def test_rocm_plans_take_no_cuda_only_form(device):
    cases = plans(device)
    assert len(cases) > 20
    for label, op, p in cases:
        assert not GLUON & set(p.kernels()), (label, op, p.kernels())
        for launch in p:
            params = dict(launch.params)
            assert not NVIDIA_ONLY & {k for k, v in params.items() if v}, (label, launch)
            for flag in ("PDL", "PTX", "WAIT_PRIOR", "WAIT_TILES", "MAX_SKIPS_NAN"):
                assert not params.get(flag, False), (label, launch.kernel, flag)


def test_the_same_steps_take_cuda_only_forms_on_hopper():
    """The cases above are not vacuous: on an H200 the same steps plan Gluon kernels, PDL and
    PTX."""
    cases = plans(DeviceFacts())
    kernels = {k for _, _, p in cases for k in p.kernels()}
    assert {"tiles_gluon", "scores_prefill_gluon"} <= kernels
    flags = {k for _, _, p in cases for launch in p for k, v in launch.params.items()
             if k in ("PDL", "PTX", "launch_pdl", "WAIT_PRIOR") and v}
    assert flags == {"PDL", "PTX", "launch_pdl", "WAIT_PRIOR"}


def test_fnuz_fp8_v_is_read_a_column_at_a_time():
    """The per-token kernel's fp8 byte-pair conversion is OCP e4m3's: gfx942's fnuz V takes
    the plain loads (V_PAIRS off), gfx950's OCP V the pairs; both compute in fp16."""
    import torch
    from openmsa.ops.attention.plan import DEFAULT, plan
    from helpers.rocm import MI355X, attention_shape
    for device, dtype, pairs in ((MI300X, torch.float8_e4m3fnuz, False),
                                 (MI355X, torch.float8_e4m3fn, True)):
        token = plan(attention_shape(8, kv_dtype=dtype), device, DEFAULT).find("token")
        assert token.params["V_PAIRS"] == pairs and token.params["F16_COMPUTE"]


def test_rocm_keeps_the_gpu_grids():
    """ROCm plans size grids by the device's CUs like any GPU (not the interpreter's 4)."""
    _, _, p = next(c for c in plans(MI300X) if c[0].startswith("decode-b1-bf16") and
                   c[1] == "indexer")
    assert p.find("scores_decode").grid[1] > 1
