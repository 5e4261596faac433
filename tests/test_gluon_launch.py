# SPDX-License-Identifier: Apache-2.0
"""The Gluon launches' host side: TMA descriptors (ops/common/launch.py) and the Triton versions
the Hopper Gluon kernels are chosen on (each op's launch rules: tests/plans/)."""

import pytest
import torch

pytestmark = pytest.mark.reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_tma_descriptor_matches_a_direct_one(dtype):
    """launch.tma_descriptor: the same descriptor as one built with the layout computed per
    call, and the layout computed once per box and dtype."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from openmsa.ops.common.launch import tma_descriptor
    t = torch.zeros(10, 128, 4, 256, dtype=dtype)[..., 128:]
    box = (1, 64, 1, 128)
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
           torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    want = TensorDescriptor(t, list(t.shape), list(t.stride()), list(box),
                            gl.NVMMASharedLayout.get_default_for(list(box), gdt))
    got = tma_descriptor(t, t.shape, t.stride(), box)
    assert got.base is t
    assert (list(got.shape), list(got.strides), list(got.block_shape), got.layout) == \
        (list(want.shape), list(want.strides), list(want.block_shape), want.layout)
    assert tma_descriptor(t, t.shape, t.stride(), box).layout is got.layout


@pytest.mark.parametrize("version, setting, want", [
    ("3.6.0", "", True), ("3.6.1", "", True), ("3.5.1", "", False), ("3.7.0", "", False),
    ("3.7.0", "1", True), ("3.6.0", "0", False)])
def test_gluon_kernels_only_on_the_triton_they_were_tested_on(monkeypatch, version, setting,
                                                              want):
    """Gluon's API moves between Triton minor versions: the Hopper Gluon kernels are chosen
    on 3.6 (the tested one), on another only with OPENMSA_GLUON=1, never with =0."""
    import triton

    from openmsa import _device
    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.setenv("OPENMSA_GLUON", setting)
    _device.gluon_hopper_available.cache_clear()
    try:
        assert _device.gluon_hopper_available() == want
    finally:
        monkeypatch.undo()
        _device.gluon_hopper_available.cache_clear()
