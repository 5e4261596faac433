# SPDX-License-Identifier: Apache-2.0
"""Tier 0: cache writes and the per-layer preparation."""

import math

import pytest
import torch

from openmsa import reference as ref

pytestmark = pytest.mark.reference

FP8 = torch.float8_e4m3fn


def test_index_write_saturates_and_skips_negative_slots():
    cache = torch.zeros(3, 4, 8, dtype=FP8)
    k = torch.tensor([[1000.0] * 4 + [-1000.0] * 4, [1.5] * 8, [7.0] * 8])
    ref.write_index_cache(k, cache, torch.tensor([5, -1, 11]))
    c = cache.float()
    assert (c[1, 1, :4] == 448).all() and (c[1, 1, 4:] == -448).all()
    assert (c[2, 3] == 7).all()
    assert (c.flatten(0, 1)[[i for i in range(12) if i not in (5, 11)]] == 0).all()


def test_index_write_keeps_nan():
    cache = torch.zeros(1, 2, 2, dtype=FP8)
    ref.write_index_cache(torch.tensor([[float("nan"), 3.0]]), cache, torch.tensor([1]))
    assert math.isnan(float(cache[0, 1, 0].float())) and float(cache[0, 1, 1].float()) == 3


@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_kv_write_into_strided_views(layout):
    pages, block, hkv, d = 3, 4, 2, 8
    if layout == "flash":
        kc, vc = torch.zeros(pages, block, hkv, d), torch.zeros(pages, block, hkv, d)
    else:
        packed = torch.zeros(pages, hkv, block, 2 * d)
        kc, vc = packed[..., :d].permute(0, 2, 1, 3), packed[..., d:].permute(0, 2, 1, 3)
    k, v = torch.randn(3, hkv, d), torch.randn(3, hkv, d)
    ref.write_kv_cache(k, v, kc, vc, torch.tensor([6, -1, 0]))
    assert torch.equal(kc[1, 2], k[0]) and torch.equal(vc[0, 0], v[2])
    written = (kc != 0).any(-1).any(-1)  # [pages, block]: only slots 6 and 0
    assert written.flatten().nonzero().flatten().tolist() == [0, 6]
    if layout == "vllm":
        assert torch.equal(packed[1, :, 2, :d], k[0]) and torch.equal(packed[1, :, 2, d:], v[0])


def test_kv_write_fp8_scale():
    kc, vc = torch.zeros(1, 2, 1, 4, dtype=FP8), torch.zeros(1, 2, 1, 4, dtype=FP8)
    k = torch.full((1, 1, 4), 3.0)
    ref.write_kv_cache(k, k, kc, vc, torch.tensor([1]), k_scale=0.5, v_scale=0.001)
    assert (kc[0, 1].float() == 6).all() and (vc[0, 1].float() == 448).all()


def test_rms_norm_is_gemma_style():
    x = torch.randn(5, 3, 16)
    w = torch.randn(16)
    y = ref.rms_norm(x, w, 1e-6)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    torch.testing.assert_close(y, want)


def test_rope_neox_partial():
    x = torch.randn(4, 2, 16)
    pos = torch.tensor([0, 1, 5, 1000])
    y = ref.apply_rope(x, pos, rotary_dim=8, theta=5e6)
    assert torch.equal(y[0], x[0])  # position 0 is the identity
    assert torch.equal(y[..., 8:], x[..., 8:])  # dims past rotary_dim are untouched
    # pair i = (x[i], x[i+4]) turns by pos * theta^(-2i/8)
    for t, p in enumerate(pos.tolist()):
        for i in range(4):
            a = p * 5e6 ** (-2 * i / 8)
            c, s = math.cos(a), math.sin(a)
            x1, x2 = x[t, :, i], x[t, :, i + 4]
            torch.testing.assert_close(y[t, :, i], x1 * c - x2 * s, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(y[t, :, i + 4], x2 * c + x1 * s, atol=1e-5, rtol=1e-5)
    # dot products depend on relative positions only
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    d1 = (ref.apply_rope(q, torch.tensor([7]), 8, 1e4) * ref.apply_rope(k, torch.tensor([3]), 8,
                                                                         1e4)).sum()
    d2 = (ref.apply_rope(q, torch.tensor([104]), 8, 1e4) * ref.apply_rope(k, torch.tensor([100]),
                                                                           8, 1e4)).sum()
    torch.testing.assert_close(d1, d2, atol=1e-4, rtol=1e-4)


def test_prepare_index_qk_casts_to_cache_dtype():
    q, k = torch.randn(3, 2, 16) * 100, torch.randn(3, 16) * 100
    w = torch.zeros(16)
    qq, kk = ref.prepare_index_qk(q, k, w, w, torch.arange(3), rotary_dim=8, rope_theta=5e6,
                                  eps=1e-6, cache_dtype=FP8)
    assert qq.dtype == FP8 and kk.dtype == FP8 and qq.shape == (3, 2, 16) and kk.shape == (3, 16)
    # after RMSNorm every row has unit RMS (rotation keeps the norm)
    torch.testing.assert_close(qq.float().pow(2).mean(-1), torch.ones(3, 2), atol=0.1, rtol=0.1)
