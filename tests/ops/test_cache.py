# SPDX-License-Identifier: Apache-2.0
"""The cache op: write_index_cache, write_kv_cache and fused_prepare. The reference's rules
(saturating casts, skipped slots, strided views, Gemma RMSNorm, NeoX RoPE at large positions),
the kernels against the reference (interpret and GPU tiers, markers), the argument checks, and
the kernels compiled for sm_90. The launch plans are tested in tests/plans/test_cache_plan.py."""

import math

import pytest
import torch

import openmsa
from openmsa import reference as ref
from openmsa._interpreter import INTERPRET
from helpers import assert_close, nan_poison
from helpers.sm90 import COMPILE_SKIP, F32, I32, I64, compile_sm90

FP8 = torch.float8_e4m3fn
B = 16


@pytest.mark.reference
def test_index_write_saturates_and_skips_negative_slots():
    cache = torch.zeros(3, 4, 8, dtype=FP8)
    k = torch.tensor([[1000.0] * 4 + [-1000.0] * 4, [1.5] * 8, [7.0] * 8])
    ref.write_index_cache(k, cache, torch.tensor([5, -1, 11]))
    c = cache.float()
    assert (c[1, 1, :4] == 448).all() and (c[1, 1, 4:] == -448).all()
    assert (c[2, 3] == 7).all()
    assert (c.flatten(0, 1)[[i for i in range(12) if i not in (5, 11)]] == 0).all()


@pytest.mark.reference
def test_index_write_keeps_nan():
    cache = torch.zeros(1, 2, 2, dtype=FP8)
    ref.write_index_cache(torch.tensor([[float("nan"), 3.0]]), cache, torch.tensor([1]))
    assert math.isnan(float(cache[0, 1, 0].float())) and float(cache[0, 1, 1].float()) == 3


@pytest.mark.reference
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


@pytest.mark.reference
def test_kv_write_fp8_scale():
    kc, vc = torch.zeros(1, 2, 1, 4, dtype=FP8), torch.zeros(1, 2, 1, 4, dtype=FP8)
    k = torch.full((1, 1, 4), 3.0)
    ref.write_kv_cache(k, k, kc, vc, torch.tensor([1]), k_scale=0.5, v_scale=0.001)
    assert (kc[0, 1].float() == 6).all() and (vc[0, 1].float() == 448).all()


@pytest.mark.reference
def test_rms_norm_is_gemma_style():
    x = torch.randn(5, 3, 16)
    w = torch.randn(16)
    y = ref.rms_norm(x, w, 1e-6)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    torch.testing.assert_close(y, want)


@pytest.mark.reference
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


@pytest.mark.reference
def test_prepare_index_qk_casts_to_cache_dtype():
    q, k = torch.randn(3, 2, 16) * 100, torch.randn(3, 16) * 100
    w = torch.zeros(16)
    qq, kk = ref.prepare_index_qk(q, k, w, w, torch.arange(3), rotary_dim=8, rope_theta=5e6,
                                  eps=1e-6, cache_dtype=FP8)
    assert qq.dtype == FP8 and kk.dtype == FP8 and qq.shape == (3, 2, 16) and kk.shape == (3, 16)
    # after RMSNorm every row has unit RMS (rotation keeps the norm)
    torch.testing.assert_close(qq.float().pow(2).mean(-1), torch.ones(3, 2), atol=0.1, rtol=0.1)


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
    """Within one rounding of `dtype` (the kernel's fp32 sums, in another order than torch's,
    may put a value across a rounding boundary); NaN positions equal exactly."""
    if dtype == FP8:
        a, e = actual.float().cpu(), expected.float().cpu()
        assert torch.equal(a.isnan(), e.isnan())
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


def _same_bits(got, want) -> bool:
    """The same bits, NaN at the same places (a GPU writes its own NaN pattern)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[want.element_size()]
    nan = want.float().isnan()
    return torch.equal(got.float().isnan(), nan) and torch.equal(got.view(bits)[~nan],
                                                                  want.view(bits)[~nan])


@pytest.mark.interpret
def test_cache_writes_match_reference(kernel_device):
    """The writes' casts give the reference's bytes, on any device (the interpreter's casts are
    the GPU's, openmsa._interpreter): random fp32 keys (most between two values of the cache's
    type: the rounding decides), values past fp8's range, NaN, -0.0 and infinities, into
    fp16, bf16 and fp8 caches, the KV write with scales."""
    g = torch.Generator().manual_seed(11)
    slots = torch.tensor([5, -1, 17, 30, -3], dtype=torch.int64)
    x = torch.randn(5, 32, generator=g) * torch.exp2(torch.randint(-12, 10, (5, 32),
                                                                   generator=g).float())
    x[0, :6] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 500.0, -1e-9])
    for dtype in (torch.float16, torch.bfloat16, FP8):
        want = torch.zeros(2, B, 32, dtype=dtype)
        ref.write_index_cache(x, want, slots)
        got = torch.zeros(2, B, 32, dtype=dtype, device=kernel_device)
        openmsa.write_index_cache(x.to(kernel_device), got, slots.to(kernel_device))
        assert _same_bits(got.cpu(), want), dtype
    k, v = x.view(5, 2, 16), -x.view(5, 2, 16) * 3
    for dtype, scales in ((torch.bfloat16, {}), (FP8, dict(k_scale=0.75, v_scale=3.0))):
        want_k, want_v = torch.zeros(2, B, 2, 16, dtype=dtype), torch.zeros(2, B, 2, 16,
                                                                            dtype=dtype)
        ref.write_kv_cache(k, v, want_k, want_v, slots, **scales)
        got_k = torch.zeros(2, B, 2, 16, dtype=dtype, device=kernel_device)
        got_v = torch.zeros_like(got_k)
        openmsa.write_kv_cache(k.to(kernel_device), v.to(kernel_device), got_k, got_v,
                               slots.to(kernel_device), **scales)
        assert _same_bits(got_k.cpu(), want_k), dtype
        assert _same_bits(got_v.cpu(), want_v), dtype
    packed = torch.zeros(2, 2, B, 2 * 64, dtype=torch.float16, device=kernel_device)
    kc, vc = packed[..., :64].permute(0, 2, 1, 3), packed[..., 64:].permute(0, 2, 1, 3)
    k, v = torch.randn(5, 2, 64, generator=g).half(), torch.randn(5, 2, 64, generator=g).half()
    wk, wv = torch.zeros(2, B, 2, 64, dtype=torch.float16), torch.zeros(2, B, 2, 64,
                                                                        dtype=torch.float16)
    ref.write_kv_cache(k, v, wk, wv, slots)
    openmsa.write_kv_cache(k.to(kernel_device), v.to(kernel_device), kc, vc,
                           slots.to(kernel_device))
    assert torch.equal(kc.cpu(), wk) and torch.equal(vc.cpu(), wv)


@pytest.mark.reference
@pytest.mark.skipif(INTERPRET, reason=COMPILE_SKIP)
def test_cache_write_kernels_compile_sm90():
    from openmsa.ops.cache.kernels.write import _write_index_cache_kernel, _write_kv_cache_kernel

    compile_sm90(_write_index_cache_kernel, dict(src_ptr="*bf16", cache_ptr="*fp8e4nv",
                                             slot_ptr=I64), {},
             dict(BLOCK=128, DI=128, DIP=128, SATURATE=True, NVFP4=False))
    compile_sm90(_write_index_cache_kernel, dict(src_ptr="*bf16", cache_ptr="*u8",
                                             slot_ptr=I64), {},
             dict(BLOCK=128, DI=128, DIP=128, SATURATE=False, NVFP4=True))
    compile_sm90(_write_kv_cache_kernel, dict(k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr="*fp8e4nv",
                                          v_cache_ptr="*fp8e4nv", slot_ptr=I64,
                                          k_scale_ptr=F32, v_scale_ptr=F32), {},
             dict(BLOCK=128, HKV=4, HKVP=4, D=128, DP=128, SATURATE=True, HAS_SCALE=True))


@pytest.mark.reference
@pytest.mark.skipif(INTERPRET, reason=COMPILE_SKIP)
@pytest.mark.parametrize("kv_type, index_type, fp32_angles, rope_scale",
                         [("*fp8e4nv", "*fp8e4nv", False, 1.0), ("*bf16", "*bf16", False, 1.0),
                          ("*bf16", "*fp8e4nv", True, 1.0693147180559945),  # fp32 form, YaRN
                          ("*bf16", "*u8", False, 1.0)])  # NVFP4 index pages
def test_fused_prepare_kernel_compiles_sm90(kv_type, index_type, fp32_angles, rope_scale):
    from openmsa.ops.cache.kernels.prepare import _fused_prepare_kernel

    fp8 = kv_type == "*fp8e4nv"
    nvfp4 = index_type == "*u8"
    compile_sm90(_fused_prepare_kernel,
             dict(qkv_ptr="*bf16", pos_ptr=I32, qw_ptr="*bf16", kw_ptr="*bf16", iqw_ptr="*bf16",
                  ikw_ptr="*bf16", table_ptr=F32, k_cache_ptr=kv_type, v_cache_ptr=kv_type,
                  slot_ptr=I64, index_cache_ptr=index_type, index_slot_ptr=I64,
                  k_scale_ptr=F32, v_scale_ptr=F32, q_out_ptr="*bf16",
                  iq_out_ptr="*fp8e4nv" if nvfp4 else index_type),
             dict(eps="fp32"),
             dict(HQ=64, HKV=4, H=4, D=128, DI=128, DP=128, DIP=128, ROT=64, NCOARSE=16384,
                  BLOCK=128, IBLOCK=128, HT=16, KV_SATURATE=fp8,
                  INDEX_SATURATE=index_type == "*fp8e4nv",
                  IQ_SATURATE=index_type == "*fp8e4nv" or nvfp4, INDEX_NVFP4=nvfp4,
                  HAS_SCALE=fp8, FP32_ANGLES=fp32_angles, ROPE_SCALE=rope_scale))


@pytest.mark.reference
def test_launch_config_type_is_checked():
    x = torch.zeros(2, 32)
    cache = torch.zeros(2, B, 32)
    slots = torch.tensor([0, -1])
    with pytest.raises(TypeError, match="config"):
        openmsa.write_index_cache(x, cache, slots, config=dict(prepare_warps=4))
    with pytest.raises(TypeError, match="config"):
        openmsa.write_kv_cache(x[:, None], x[:, None], cache[:, :, None], cache[:, :, None],
                               slots, config="fast")
    qkv, w, packed, kc, vc, ic, (pos, s, islots) = _case("cpu", torch.bfloat16,
                                                          torch.bfloat16)
    with pytest.raises(TypeError, match="cache_config"):
        openmsa.fused_prepare(qkv, pos, CFG, *w, kc, vc, s, ic, islots, cache_config=CFG)


FNUZ = torch.float8_e4m3fnuz


@pytest.mark.reference
def test_fnuz_cache_cast_saturates_at_240_keeps_nan_and_has_one_zero():
    x = torch.tensor([[1000.0, -1000.0, 240.0, -241.0, float("nan"), -0.0, 0.0, 1.5]])
    cache = torch.zeros(1, 2, 8, dtype=FNUZ)
    ref.write_index_cache(x, cache, torch.tensor([1]))
    got = cache[0, 1]
    assert got.float()[:4].tolist() == [240.0, -240.0, 240.0, -240.0]
    assert math.isnan(float(got[4].float())) and got[7].float() == 1.5
    # fnuz has no -0.0: its bits (0x80) are the NaN
    assert got.view(torch.uint8)[4:7].tolist() == [0x80, 0, 0]
    kc, vc = torch.zeros(1, 2, 1, 4, dtype=FNUZ), torch.zeros(1, 2, 1, 4, dtype=FNUZ)
    k = torch.full((1, 1, 4), 3.0)
    ref.write_kv_cache(k, k, kc, vc, torch.tensor([1]), k_scale=0.5, v_scale=0.001)
    assert (kc[0, 1].float() == 6).all() and (vc[0, 1].float() == 240).all()


@pytest.mark.interpret
@pytest.mark.skipif(torch.cuda.is_available() and torch.version.hip is None,
                    reason="e4m3fnuz is AMD gfx942's fp8; NVIDIA GPUs have none")
def test_fnuz_cache_writes_match_reference(kernel_device):
    """The write kernels' saturating cast into an fnuz cache: +-240, NaN as 0x80, -0.0 as 0,
    rounding to nearest even, the same bytes as the reference on random values."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, generator=g) * 100
    x[0, :6] = torch.tensor([1000.0, -1000.0, float("nan"), -0.0, 0.0, 240.0])
    slots = torch.tensor([3, -1, 0, 7, 12, 5])
    want = torch.zeros(2, 8, 32, dtype=FNUZ)
    ref.write_index_cache(x, want, slots)
    got = torch.zeros(2, 8, 32, dtype=FNUZ, device=kernel_device)
    openmsa.write_index_cache(x.to(kernel_device), got, slots.to(kernel_device))
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    k, v = x.view(6, 2, 16), -x.view(6, 2, 16)
    want_k, want_v = torch.zeros(2, 8, 2, 16, dtype=FNUZ), torch.zeros(2, 8, 2, 16, dtype=FNUZ)
    ref.write_kv_cache(k, v, want_k, want_v, slots, k_scale=0.5)
    got_k = torch.zeros(2, 8, 2, 16, dtype=FNUZ, device=kernel_device)
    got_v = torch.zeros_like(got_k)
    openmsa.write_kv_cache(k.to(kernel_device), v.to(kernel_device), got_k, got_v,
                           slots.to(kernel_device), k_scale=0.5)
    assert torch.equal(got_k.cpu().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.cpu().view(torch.uint8), want_v.view(torch.uint8))


NVFP4_STRIDE = 9216 + 48  # pages apart in a wider buffer (a multiple of 16)
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _ulps(x: torch.Tensor, n: int) -> torch.Tensor:
    """x and its fp32 neighbours up to n steps either side, [..., 2n + 1]."""
    out = [x]
    up, down = x, x
    for _ in range(n):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, float("-inf")))
        out += [up, down]
    return torch.stack(out, -1)


def _nvfp4_keys(seed=0) -> torch.Tensor:
    """fp32 [N, 128] keys that hit every rule of the quantizer: random keys from 1e-6 to 1e4,
    group maxima sweeping every e4m3 scale and the midpoints between scales (and one ulp around
    them), below the 2^-9 floor and above the 448 cap; values whose product x * r lands exactly
    on and a few ulps around every E2M1 midpoint; zeros, fp32 subnormals, +-1e30, infinities
    and NaN."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    groups.append((torch.randn(64, 8, 16, generator=g)
                   * torch.logspace(-6, 4, 64)[:, None, None]).reshape(-1, 16))
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    scales = torch.cat([e4m3, _ulps(mids, 1).flatten(), torch.tensor([2.0 ** -12, 2.0 ** -10,
                                                                      460.0, 1e4])])
    amax = scales * 6
    rest = (torch.rand(len(amax), 15, generator=g) * 2 - 1) * amax[:, None]
    groups.append(torch.cat([amax[:, None] * torch.where(torch.rand(len(amax), 1, generator=g)
                                                        < 0.5, 1.0, -1.0), rest], 1))
    for s in e4m3[::5]:  # products on and around the midpoints: x = m / r and its neighbours
        r = 1.0 / s
        x = _ulps(torch.tensor(MIDPOINTS) / r, 2).flatten()
        x = torch.cat([x, -x, torch.tensor(MIDPOINTS) * s])
        for chunk in x.split(15):
            row = torch.zeros(16)
            row[0] = 6 * s  # the group's max sets the scale to s
            row[1:1 + len(chunk)] = chunk
            groups.append(row[None])
    groups.append(torch.tensor([[0.0] * 16, [-0.0] * 16, [1e-40, -1e-41] * 8,
                                [1e30, -1e30] + [1.0] * 14]))
    # NaN in a group (one, all, beside an infinity, negative NaN): the NaN scale, codes 7
    nan, inf = float("nan"), float("inf")
    groups.append(torch.tensor([[3.0, nan] + [0.5] * 14, [nan] * 16, [inf, nan] + [-2.0] * 14,
                                [-nan] + [1e-3] * 15, [inf, -inf] + [1.0] * 14]))
    rows = torch.cat(groups)
    rows = torch.cat([rows, torch.zeros(-len(rows) % 8, 16)])
    return rows.reshape(-1, 128)


def _nvfp4_cache(pages, device, fill=0xAB):
    buf = torch.full((pages * NVFP4_STRIDE,), fill, dtype=torch.uint8, device=device)
    return buf, buf.as_strided((pages, 128, 72), (NVFP4_STRIDE, 72, 1))


@pytest.mark.reference
def test_nvfp4_reference_write_is_the_format_module():
    keys = _nvfp4_keys()
    n = keys.shape[0]
    buf, cache = _nvfp4_cache(2, "cpu")
    slots = torch.arange(n) - 1  # slot -1 skipped
    ref.write_index_cache(keys, cache, slots)
    codes, scales = openmsa.nvfp4.quantize_index_keys(keys[1:])
    got_codes, got_scales = openmsa.nvfp4.page_parts(cache)
    assert torch.equal(got_codes.reshape(-1, 64)[:n - 1], codes)
    assert torch.equal(got_scales.reshape(-1, 8)[:n - 1], scales)
    assert (got_codes.reshape(-1, 64)[n - 1:] == 0xAB).all()
    # nothing outside the pages' 9216 bytes was touched
    gaps = buf.view(2, NVFP4_STRIDE)[:, 9216:]
    assert (gaps == 0xAB).all()


def _check_nvfp4_write(device, keys, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = keys.shape[0]
    pages = -(-n // 128) + 1
    slots = torch.randperm(pages * 128, generator=g)[:n]
    slots[::17] = -1
    want_buf, want = _nvfp4_cache(pages, "cpu")
    ref.write_index_cache(keys, want, slots)
    got_buf, got = _nvfp4_cache(pages, device)
    openmsa.write_index_cache(keys.to(device), got, slots.to(device))
    got_buf = got_buf.cpu()
    differ = (got_buf != want_buf).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} bytes differ, first at {differ[:8].tolist()}"


@pytest.mark.interpret
def test_nvfp4_index_write_kernel_is_bit_exact(kernel_device):
    _check_nvfp4_write(kernel_device, _nvfp4_keys())


@pytest.mark.interpret
def test_nvfp4_index_write_kernel_from_16bit_keys(kernel_device):
    keys = (torch.randn(40, 128, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    _check_nvfp4_write(kernel_device, keys, seed=1)


@pytest.mark.gpu
def test_nvfp4_index_write_kernel_is_bit_exact_on_gpu():
    keys = torch.cat([_nvfp4_keys(seed) for seed in range(4)])
    _check_nvfp4_write("cuda", keys)
    big = torch.randn(20000, 128, generator=torch.Generator().manual_seed(9)) * 2
    _check_nvfp4_write("cuda", big, seed=2)


# the index branch at NVFP4's geometry (Di = 128, 128-token pages); a small main branch
CFG_NVFP4 = openmsa.MSAConfig(num_heads=8, num_kv_heads=2, head_dim=64, num_index_heads=2,
                              index_head_dim=128, block_size=128, rotary_dim=32,
                              rope_theta=5e6)
NVFP4_INDEX_SLOTS = [30, -1, 2, 140, 200, 201, 255, -1]


def _nvfp4_prepare(device, fn, seed=0, nan_token=None):
    """fn's fused_prepare of one step into a strided NVFP4 index cache: (q, index_q, the cache's
    buffer, k_cache); nan_token: that token's index key input holds a NaN."""
    g = torch.Generator().manual_seed(seed)
    cfg, t = CFG_NVFP4, len(POSITIONS)
    qkv = (torch.randn(t, _width(cfg), generator=g) * 3).to(torch.bfloat16)
    if nan_token is not None:
        qkv[nan_token, -1] = float("nan")  # the index key is the last index_head_dim columns
    w = [(torch.randn(n, generator=g) * 0.2).to(torch.bfloat16) for n in (64, 64, 128, 128)]
    kc = torch.zeros(2, 128, 2, 64, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    buf, ic = _nvfp4_cache(2, device)
    ints = [torch.tensor(x, device=device) for x in (POSITIONS, SLOTS, NVFP4_INDEX_SLOTS)]
    q, iq = fn(qkv.to(device), ints[0], cfg, *[x.to(device) for x in w], kc.to(device),
               vc.to(device), ints[1], ic, ints[2])
    return q, iq, buf.cpu(), kc


@pytest.mark.interpret
def test_fused_prepare_nvfp4_index_cache_is_bit_exact(kernel_device):
    q, iq, buf, _ = _nvfp4_prepare(kernel_device, openmsa.fused_prepare)
    wq, wiq, want, _ = _nvfp4_prepare("cpu", ref.fused_prepare)
    assert iq.dtype == FP8 and wiq.dtype == FP8  # fp8 index query against NVFP4 pages
    _close(q, wq, torch.bfloat16)
    _close(iq, wiq, FP8)
    # the index keys' bytes, quantized in the kernel: as the reference's, and only at the slots
    differ = (buf != want).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} bytes differ, first at {differ[:8].tolist()}"
    pages = want.view(2, NVFP4_STRIDE)
    written = sorted(s for s in NVFP4_INDEX_SLOTS if s >= 0)
    untouched = [s for s in range(256) if s not in written]
    codes, scales = openmsa.nvfp4.page_parts(
        want.as_strided((2, 128, 72), (NVFP4_STRIDE, 72, 1)))
    assert (codes.reshape(256, 64)[untouched] == 0xAB).all()
    assert (scales.reshape(256, 8)[written] != 0xAB).any(-1).all()
    assert (pages[:, 9216:] == 0xAB).all()
    # a NaN in a token's index key: its norm spreads it to every group, stored as NaN groups
    _, _, buf, _ = _nvfp4_prepare(kernel_device, openmsa.fused_prepare, nan_token=2)
    _, _, want, _ = _nvfp4_prepare("cpu", ref.fused_prepare, nan_token=2)
    assert torch.equal(buf, want)
    scales = openmsa.nvfp4.page_parts(want.as_strided((2, 128, 72), (NVFP4_STRIDE, 72, 1)))[1]
    assert (scales.reshape(256, 8)[NVFP4_INDEX_SLOTS[2]] == 0x7F).all()


@pytest.mark.gpu
def test_fused_prepare_nvfp4_on_gpu():
    """On the GPU the fp32 index key may differ from the reference's by the RMS sum's order, so
    a code can flip where a product sits at an E2M1 midpoint: the bytes must agree on all but a
    few tokens, and every differing token's dequantized key within one code step."""
    q, iq, buf, _ = _nvfp4_prepare("cuda", openmsa.fused_prepare)
    wq, wiq, want, _ = _nvfp4_prepare("cpu", ref.fused_prepare)
    _close(q, wq, torch.bfloat16)
    _close(iq, wiq, FP8)
    pages = [b.as_strided((2, 128, 72), (NVFP4_STRIDE, 72, 1)) for b in (buf, want)]
    got_k, want_k = (openmsa.dequantize_index_pages(p) for p in pages)
    # one code step is at most 2 scales (4 -> 6); a scale one e4m3 step apart moves a value by
    # at most 1/8 of 6 scales: within 2 of the larger scale either way
    scales = [openmsa.nvfp4.page_parts(p)[1].view(torch.float8_e4m3fn).float() for p in pages]
    bound = 2 * torch.maximum(*scales).abs().repeat_interleave(16, dim=-1)  # 0xAB fill < 0
    assert ((got_k - want_k).abs() <= bound).all()
    assert (buf != want).float().mean().item() < 0.001


@pytest.mark.reference
def test_an_unknown_launch_name_raises():
    """api.py finds each launch's kernel in a table of launch names: a name it lacks raises."""
    from openmsa.ops.cache import api
    with pytest.raises(ValueError, match="no kernel 'write_cache'"):
        api._kernel("write_cache")
