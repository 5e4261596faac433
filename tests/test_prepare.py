# SPDX-License-Identifier: Apache-2.0
"""fused_prepare: the one-launch norm + RoPE + cast + cache insertion against the reference
(interpret/GPU tiers), the reference's RoPE at large positions, and its argument checks."""

import math

import pytest
import torch

import openmsa
from openmsa import reference as ref
from openmsa._dispatch import INTERPRET
from helpers import assert_close, nan_poison

FP8 = torch.float8_e4m3fn
B = 16
CFG = openmsa.MSAConfig(num_heads=8, num_kv_heads=2, head_dim=64, num_index_heads=2,
                        index_head_dim=64, block_size=B, rotary_dim=32, rope_theta=5e6)
# positions across both RoPE table levels, including ~1M (coarse row 976) and padding (-1)
POSITIONS = [0, 5, 1023, 1024, 1_000_123, 77, 3, -1]
SLOTS = [3, 17, -1, 40, 41, 90, 5, -1]
INDEX_SLOTS = [30, -1, 2, 4, 60, 61, 62, -1]
PAGES = 6


def _width(cfg):
    return (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim \
        + (cfg.num_index_heads + 1) * cfg.index_head_dim


def _case(device, kv_dtype, index_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = len(POSITIONS)
    # a strided view of a wider buffer, as an engine's fused GEMM output with padding columns
    qkv = (torch.randn(t, _width(CFG) + 8, generator=g) * 3).to(torch.bfloat16)[:, 4:-4]
    weights = [(torch.randn(n, generator=g) * 0.2).to(torch.bfloat16)
               for n in (CFG.head_dim, CFG.head_dim, CFG.index_head_dim, CFG.index_head_dim)]
    # vLLM's packed main cache [P, Hkv, B, 2D] seen as K and V views; everything NaN-poisoned
    packed = nan_poison((PAGES, CFG.num_kv_heads, B, 2 * CFG.head_dim), torch.float32, "cpu")
    packed = packed.to(kv_dtype).to(device)
    kc = packed[..., :CFG.head_dim].permute(0, 2, 1, 3)
    vc = packed[..., CFG.head_dim:].permute(0, 2, 1, 3)
    ic = nan_poison((PAGES, B, CFG.index_head_dim), torch.float32, "cpu").to(index_dtype)
    ic = ic.to(device)
    ints = [torch.tensor(x, dtype=torch.int64, device=device)
            for x in (POSITIONS, SLOTS, INDEX_SLOTS)]
    return qkv.to(device), [w.to(device) for w in weights], packed, kc, vc, ic, ints


def _close(actual, expected, dtype):
    """Within one rounding of `dtype` (Triton's interpreter truncates fp32 -> bf16/fp8 instead
    of rounding, so the kernel may sit one step off); NaN positions equal exactly."""
    if dtype == FP8:
        a, e = actual.float().cpu(), expected.float().cpu()
        assert torch.equal(a.isnan(), e.isnan())
        if INTERPRET:
            # Triton 3.6's interpreter rounds fp32 -> e4m3 up into a power of two without the
            # exponent carry (1.99 -> 1.0 instead of 2.0): forgive exactly that, on CPU only
            mant = torch.frexp(e.nan_to_num(3.0))[0].abs()
            a = torch.where((mant == 0.5) & (a * 2 == e), e, a)
        torch.testing.assert_close(a[~a.isnan()], e[~e.isnan()], atol=2.0 ** -9, rtol=0.13)
    else:
        assert_close(actual, expected, dtype)


@pytest.mark.interpret
@pytest.mark.parametrize("kv_dtype,index_dtype", [(torch.bfloat16, torch.bfloat16),
                                                  (FP8, FP8), (torch.bfloat16, FP8)])
def test_fused_prepare_matches_reference(kernel_device, kv_dtype, index_dtype):
    qkv, w, packed, kc, vc, ic, (pos, slots, islots) = _case(kernel_device, kv_dtype,
                                                             index_dtype)
    _, _, want_packed, wkc, wvc, wic, _ = _case("cpu", kv_dtype, index_dtype)
    scale = dict(k_scale=0.5, v_scale=2.0) if kv_dtype == FP8 else {}
    q, iq = openmsa.fused_prepare(qkv, pos, CFG, *w, kc, vc, slots, ic, islots, **scale)
    wq, wiq = ref.fused_prepare(qkv.cpu(), pos.cpu(), CFG, *[x.cpu() for x in w], wkc, wvc,
                                slots.cpu(), wic, islots.cpu(), **scale)
    assert q.dtype == torch.bfloat16 and iq.dtype == index_dtype
    _close(q, wq, torch.bfloat16)
    _close(iq, wiq, index_dtype)
    # the caches: written exactly where the slots say (NaN poison elsewhere), values as the
    # reference's; v is a plain copy, bit-exact in bf16
    _close(packed, want_packed, kv_dtype)
    _close(ic, wic, index_dtype)
    if kv_dtype == torch.bfloat16:
        assert torch.equal(vc.cpu().float().nan_to_num(7.0), wvc.float().nan_to_num(7.0))


@pytest.mark.interpret
def test_fused_prepare_out_buffers_and_16bit_index_query(kernel_device):
    qkv, w, _, kc, vc, ic, (pos, slots, islots) = _case(kernel_device, torch.bfloat16, FP8)
    t = qkv.shape[0]
    # strided outputs: [H, T, D] buffers seen as [T, H, D]
    q_out = nan_poison((CFG.num_heads, t, CFG.head_dim), torch.bfloat16, kernel_device)
    iq_out = nan_poison((CFG.num_index_heads, t, CFG.index_head_dim), torch.bfloat16,
                        kernel_device)
    q, iq = openmsa.fused_prepare(qkv, pos, CFG, *w, kc, vc, slots, ic, islots,
                                  q_out=q_out.transpose(0, 1), index_q_out=iq_out.transpose(0, 1))
    assert q.data_ptr() == q_out.data_ptr() and iq.data_ptr() == iq_out.data_ptr()
    _, _, _, wkc, wvc, wic, _ = _case("cpu", torch.bfloat16, FP8)
    wq, wiq = ref.fused_prepare(qkv.cpu(), pos.cpu(), CFG, *[x.cpu() for x in w], wkc, wvc,
                                slots.cpu(), wic, islots.cpu(),
                                index_q_out=torch.empty(t, 2, 64, dtype=torch.bfloat16))
    _close(q_out.transpose(0, 1), wq, torch.bfloat16)
    _close(iq_out.transpose(0, 1), wiq, torch.bfloat16)  # bf16 index query, fp8 cache


@pytest.mark.reference
def test_rope_at_a_million_tokens_is_exact():
    """The reference's angles are float64 (one fp32 ulp of 1e6 rad is 0.06 rad)."""
    x = torch.randn(1, 1, 8, dtype=torch.float64).float()
    p = 1_048_575
    y = ref.apply_rope(x, torch.tensor([p]), rotary_dim=8, theta=10.0)
    for i in range(4):
        a = p * 10.0 ** (-2 * i / 8)
        c, s = math.cos(a), math.sin(a)
        x1, x2 = float(x[0, 0, i]), float(x[0, 0, i + 4])
        assert abs(float(y[0, 0, i]) - (x1 * c - x2 * s)) < 1e-5
        assert abs(float(y[0, 0, i + 4]) - (x2 * c + x1 * s)) < 1e-5


@pytest.mark.reference
def test_rope_table_levels_compose_to_the_angle():
    from openmsa.ops.cache.api import rope_table

    table = rope_table(8, 5e6, "cpu").double()
    for p in (0, 1, 1023, 1024, 1_000_123, (1 << 24) - 1):
        lo, hi = p % 1024, p // 1024
        c1, s1 = table[lo, :4], table[lo, 4:]
        c2, s2 = table[1024 + hi, :4], table[1024 + hi, 4:]
        inv = 5e6 ** (-torch.arange(4, dtype=torch.float64) * 2 / 8)
        torch.testing.assert_close(c1 * c2 - s1 * s2, (p * inv).cos(), atol=3e-7, rtol=0)
        torch.testing.assert_close(s1 * c2 + c1 * s2, (p * inv).sin(), atol=3e-7, rtol=0)


@pytest.mark.reference
def test_fused_prepare_rejects_bad_arguments():
    qkv, w, _, kc, vc, ic, (pos, slots, islots) = _case("cpu", torch.bfloat16, torch.bfloat16)
    args = [qkv, pos, CFG, *w, kc, vc, slots, ic, islots]

    def call(i, value, match, exc=ValueError):
        bad = list(args)
        bad[i] = value
        with pytest.raises(exc, match=match):
            openmsa.fused_prepare(*bad)

    call(0, qkv[:, :-1], "qkv must be")
    call(1, pos[:-1], "positions")
    call(1, pos.float(), "positions", TypeError)
    call(2, {"num_heads": 8}, "config", TypeError)
    call(3, w[0][:-1], "q_norm_weight")
    call(6, w[3][:10], "index_k_norm_weight")
    call(7, kc[:, :, :1], "k_cache")
    small = torch.zeros(PAGES, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_size"):
        openmsa.fused_prepare(*args[:7], small, small, *args[9:])
    call(9, slots[:3], "slot_mapping")
    call(10, ic[..., :32], "index_cache")
    call(11, islots.float(), "index_slot_mapping", TypeError)
    # 1-D inputs the kernel reads as plain arrays: a strided view is refused, not misread
    call(1, torch.stack([pos, pos], 1)[:, 0], "positions must be contiguous")
    call(9, torch.stack([slots, slots], 1)[:, 0], "slot_mapping must be contiguous")
    call(4, torch.stack([w[1], w[1]], 1)[:, 0], "k_norm_weight must be contiguous")
    with pytest.raises(ValueError, match="q_out"):
        openmsa.fused_prepare(*args, q_out=torch.empty(3, 8, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="index_q"):
        openmsa.fused_prepare(*args, index_q_out=torch.empty(8, 2, 64, dtype=FP8))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
def test_fused_prepare_bits_at_m3_shapes(kv_dtype):
    """On the GPU at M3's TP1 shapes: v is bit-exact, and k, index_k, q, index_q equal the
    reference's bits except where the fp32 RMS sum's order (kernel tree vs torch) moves a value
    across a rounding boundary: then one step of the stored type apart, on < 1% of elements."""
    cfg = openmsa.MSAConfig()
    t, pages = 300, 4
    g = torch.Generator().manual_seed(3)
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * 128 + (cfg.num_index_heads + 1) * 128
    qkv = (torch.randn(t, width, generator=g) * 2).bfloat16().cuda()
    w = [(torch.randn(128, generator=g) * 0.2).bfloat16().cuda() for _ in range(4)]
    pos = torch.randint(0, 1 << 20, (t,), generator=g).cuda()
    slots = torch.randperm(pages * 128, generator=g)[:t].cuda()
    islots = torch.randperm(pages * 128, generator=g)[:t].cuda()
    res = []
    for impl in (openmsa.fused_prepare, ref.fused_prepare):
        kc = torch.zeros(pages, 128, 4, 128, device="cuda").to(kv_dtype)
        vc, ic = torch.zeros_like(kc), torch.zeros(pages, 128, 128, device="cuda").to(FP8)
        q, iq = impl(qkv, pos, cfg, *w, kc, vc, slots, ic, islots)
        res.append((q, iq, kc, vc, ic))
    assert torch.equal(res[0][3].view(torch.uint8), res[1][3].view(torch.uint8))  # v
    for name, a, b in zip(("q", "index_q", "k_cache", "v_cache", "index_cache"), *res):
        a, b = a.float(), b.float()
        differ = (a != b).float().mean().item()
        assert differ < 0.01, f"{name}: {differ:.2%} of elements differ"
        _close(a, b, FP8 if name in ("index_q", "index_cache") or
               (name == "k_cache" and kv_dtype == FP8) else torch.bfloat16)
