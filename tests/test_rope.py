# SPDX-License-Identifier: Apache-2.0
"""RoPE: YaRN scaling and the fp32 angle form (openmsa.rope), read from Hugging Face configs,
applied by fused_prepare's reference and kernel on the main and the index branch, compared with
transformers' rotary embedding at positions past M3's native 512K."""

import math

import pytest
import torch

import openmsa
from openmsa import reference as ref
from openmsa import rope
from openmsa.ops.cache.reference import split_projection
from openmsa.rope import YarnScaling, rope_scaling_from_hf

# the published 1M serving recipe's override of text_config.rope_scaling
RECIPE = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 524288}
YARN = YarnScaling(factor=2.0, original_max_position_embeddings=524288)
M3 = openmsa.MSAConfig(rope_scaling=YARN)
# past 512K, up to the last position of a 1M context
FAR = [524_288, 524_289, 700_001, 999_999, 1_000_003, 1_048_575]


def _transformers_rotary(angles_cfg=RECIPE, head_dim=128, rotary=64):
    pytest.importorskip("transformers.models.minimax_m3_vl")
    import transformers as tr
    tr.logging.set_verbosity_error()
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
        MiniMaxM3VLRotaryEmbedding)
    cfg = tr.MiniMaxM3VLTextConfig(num_hidden_layers=1, head_dim=head_dim,
                                   partial_rotary_factor=rotary / head_dim,
                                   rotary_dim=rotary, rope_scaling=dict(angles_cfg))
    return MiniMaxM3VLRotaryEmbedding(cfg), cfg


def _python_yarn_inv_freq(rot, theta, factor, orig, beta_fast=32, beta_slow=1):
    """YaRN's blended inverse frequencies in plain float64 Python, from the formulas."""
    def dim_of(rotations):
        return rot * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low = max(math.floor(dim_of(beta_fast)), 0)
    high = min(math.ceil(dim_of(beta_slow)), rot - 1)
    out = []
    for i in range(rot // 2):
        base = theta ** (2 * i / rot)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append((1 / (factor * base)) * ramp + (1 / base) * (1 - ramp))
    return out


@pytest.mark.reference
def test_fp32_angles_reproduce_transformers_rotary_embedding_past_512k():
    emb, _ = _transformers_rotary()
    pos = torch.tensor(FAR)
    cos_t, sin_t = emb(torch.zeros(1, dtype=torch.float32), pos[None])
    cfg = openmsa.MSAConfig(rope_scaling=YARN, rope_angles="fp32")
    assert torch.equal(rope.inv_freq(cfg), emb.inv_freq.float())
    assert rope.attention_factor(cfg) == pytest.approx(emb.attention_scaling, abs=0)
    cos, sin = rope.cos_sin(pos, cfg)
    # transformers' cos/sin repeat the half: [cos | cos]
    torch.testing.assert_close(cos, cos_t[0, :, :32], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, sin_t[0, :, :32], atol=1e-6, rtol=0)
    # and the plain (unscaled) M3 rotary as well
    emb0, _ = _transformers_rotary({"rope_type": "default"})
    c0, s0 = emb0(torch.zeros(1), pos[None])
    cos, sin = rope.cos_sin(pos, openmsa.MSAConfig(rope_angles="fp32"))
    torch.testing.assert_close(cos, c0[0, :, :32], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, s0[0, :, :32], atol=1e-6, rtol=0)


@pytest.mark.reference
def test_exact_angles_are_yarn_in_float64_and_fp32_is_up_to_0_06_rad_off_at_1m():
    want = _python_yarn_inv_freq(64, 5e6, 2.0, 524288)
    got = rope.inv_freq(M3)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-13, atol=0)
    scale = 0.1 * math.log(2.0) + 1.0
    assert rope.attention_factor(M3) == pytest.approx(scale, rel=1e-15)
    pos = torch.tensor(FAR)
    cos, sin = rope.cos_sin(pos, M3)
    wc = torch.tensor([[math.cos(p * f) * scale for f in want] for p in FAR])
    ws = torch.tensor([[math.sin(p * f) * scale for f in want] for p in FAR])
    torch.testing.assert_close(cos, wc.float(), atol=2e-7, rtol=0)
    torch.testing.assert_close(sin, ws.float(), atol=2e-7, rtol=0)
    # the fp32 form is a different number at 1M positions (what transformers and vLLM compute)
    c32, s32 = rope.cos_sin(pos, M3, angles="fp32")
    gap = torch.atan2(s32 * cos - c32 * sin, c32 * cos + s32 * sin).abs().max().item()
    assert 1e-3 < gap < 0.2
    # YaRN changes the frequencies: the unscaled ones are not these
    assert not torch.allclose(rope.inv_freq(openmsa.MSAConfig()), got)


@pytest.mark.reference
@pytest.mark.parametrize("angles", ["exact", "fp32"])
def test_reference_prepare_applies_yarn_like_transformers_on_both_branches(angles):
    """fused_prepare's reference against transformers' own q/k norm + rotary at positions past
    512K, for q, the cached k, the index query and the cached index key."""
    pytest.importorskip("transformers.models.minimax_m3_vl")
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm
    emb, _ = _transformers_rotary()
    cfg = openmsa.MSAConfig(num_heads=4, num_kv_heads=2, num_index_heads=2, block_size=16,
                            rope_scaling=YARN, rope_angles=angles)
    g = torch.Generator().manual_seed(0)
    t, d = len(FAR), 128
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * d + (cfg.num_index_heads + 1) * d
    qkv = torch.randn(t, width, generator=g)
    w = [torch.randn(d, generator=g) * 0.2 for _ in range(4)]
    pages = -(-t // 16) + 1
    kc = torch.zeros(pages, 16, 2, d)
    vc = torch.zeros_like(kc)
    ic = torch.zeros(pages, 16, d)
    slots = torch.arange(t)
    pos = torch.tensor(FAR)
    q, iq = ref.fused_prepare(qkv, pos, cfg, *w, kc, vc, slots, ic, slots)
    cos, sin = emb(torch.zeros(1), pos[None])
    qs, ks, _, iqs, iks = split_projection(qkv, cfg)

    def theirs(x, weight):  # [T, H, D]: transformers' Gemma RMSNorm, then its partial rotary
        norm = mm.MiniMaxM3VLRMSNorm(d, eps=cfg.rms_norm_eps)
        norm.weight.data.copy_(weight)
        x = norm(x).transpose(0, 1)[None]              # [1, H, T, D]
        out, _ = mm.apply_rotary_pos_emb(x, x, cos, sin)
        return out[0].transpose(0, 1)

    atol = 1e-5 if angles == "fp32" else 0.3  # exact differs from fp32 by <= 0.06 rad here
    torch.testing.assert_close(q, theirs(qs, w[0]), atol=atol, rtol=0)
    torch.testing.assert_close(kc.reshape(-1, 2, d)[:t], theirs(ks, w[1]), atol=atol, rtol=0)
    torch.testing.assert_close(iq, theirs(iqs, w[2]), atol=atol, rtol=0)
    torch.testing.assert_close(ic.reshape(-1, d)[:t], theirs(iks[:, None], w[3])[:, 0],
                               atol=atol, rtol=0)
    if angles == "exact":  # close to transformers' numbers, but not its fp32 angles
        assert (q - theirs(qs, w[0])).abs().max() > 1e-4


@pytest.mark.reference
def test_hf_rope_scaling_is_read_and_what_openmsa_lacks_is_refused_by_name():
    ckpt = {"text_config": {"sparse_attention_config": {"sparse_block_size": 128},
                            "rope_theta": 5e6, "rotary_dim": 64, "rope_scaling": RECIPE}}
    cfg = openmsa.MSAConfig.from_hf_config(ckpt)
    assert cfg.rope_scaling == YARN and cfg.rope_angles == "exact"
    assert rope_scaling_from_hf({"rope_type": "default", "rope_theta": 1e4}) is None
    assert rope_scaling_from_hf({"type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 100}).factor == 4.0
    # factor omitted: max_position_embeddings / original, as transformers
    assert rope_scaling_from_hf({"rope_type": "yarn", "original_max_position_embeddings": 512},
                                1024).factor == 2.0
    assert rope_scaling_from_hf(dict(RECIPE, attention_factor=1.5)).mscale_factor == 1.5
    for rope_type in ("linear", "dynamic", "llama3", "longrope", "mrope"):
        with pytest.raises(ValueError, match=rope_type):
            rope_scaling_from_hf({"rope_type": rope_type, "factor": 2.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_scaling_from_hf(dict(RECIPE, low_freq_factor=1.0))
    with pytest.raises(ValueError, match="mrope_section"):
        rope_scaling_from_hf({"rope_type": "default", "mrope_section": [1, 2]})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope_scaling_from_hf({"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="factor"):
        YarnScaling(factor=0.0, original_max_position_embeddings=10)
    with pytest.raises(ValueError, match="llama3"):
        openmsa.MSAConfig.from_hf_config(
            {"sparse_attention_config": {}, "rope_scaling": {"rope_type": "llama3"}})
    with pytest.raises(TypeError, match="rope_scaling"):
        rope_scaling_from_hf(["yarn"])


@pytest.mark.reference
def test_config_rope_fields_are_checked():
    assert openmsa.MSAConfig(rope_scaling=dict(RECIPE)).rope_scaling == YARN
    with pytest.raises(ValueError, match="rope_angles"):
        openmsa.MSAConfig(rope_angles="float16")
    with pytest.raises(TypeError, match="rope_scaling"):
        openmsa.MSAConfig(rope_scaling=2.0)
    with pytest.raises(ValueError, match="angles"):
        rope.inv_freq(M3, angles="bf16")
    # the shard keeps the rope fields (what the layer of each rank uses)
    assert openmsa.MSAConfig(rope_scaling=YARN, rope_angles="fp32").shard(4).rope_angles == "fp32"


def _prepare_case(device, cfg, positions, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = len(positions)
    d, di = cfg.head_dim, cfg.index_head_dim
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * d + (cfg.num_index_heads + 1) * di
    qkv = torch.randn(t, width, generator=g).to(device)
    w = [(torch.randn(n, generator=g) * 0.2).to(device) for n in (d, d, di, di)]
    pages = -(-t // cfg.block_size)
    kc = torch.zeros(pages, cfg.block_size, cfg.num_kv_heads, d, device=device)
    vc = torch.zeros_like(kc)
    ic = torch.zeros(pages, cfg.block_size, di, device=device)
    pos = torch.tensor(positions, device=device)
    slots = torch.arange(t, device=device)
    return qkv, w, kc, vc, ic, pos, slots


@pytest.mark.interpret
@pytest.mark.parametrize("angles", ["exact", "fp32"])
def test_fused_prepare_kernel_applies_yarn_and_fp32_angles(kernel_device, angles):
    """The Triton preparation against the reference with YaRN, past 512K (fp32 in and out)."""
    cfg = openmsa.MSAConfig(num_heads=4, num_kv_heads=2, head_dim=64, num_index_heads=2,
                            index_head_dim=64, block_size=16, rotary_dim=32,
                            rope_scaling=YarnScaling(2.0, 524288), rope_angles=angles)
    positions = FAR + [0, 1023, 1024, 3]
    qkv, w, kc, vc, ic, pos, slots = _prepare_case(kernel_device, cfg, positions)
    q, iq = openmsa.fused_prepare(qkv, pos, cfg, *w, kc, vc, slots, ic, slots)
    wqkv, ww, wkc, wvc, wic, wpos, wslots = _prepare_case("cpu", cfg, positions)
    wq, wiq = ref.fused_prepare(wqkv, wpos, cfg, *ww, wkc, wvc, wslots, wic, wslots)
    for got, want in ((q, wq), (iq, wiq), (kc, wkc), (ic, wic), (vc, wvc)):
        torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-5)
    # the attention factor is in: without it the rotated part would be smaller
    plain = openmsa.MSAConfig(**{**{f: getattr(cfg, f) for f in
                                    ("num_heads", "num_kv_heads", "head_dim", "num_index_heads",
                                     "index_head_dim", "block_size", "rotary_dim")},
                                 "rope_angles": angles})
    pq, _ = openmsa.fused_prepare(qkv, pos, plain, *w, kc, vc, slots, ic, slots)
    assert not torch.allclose(pq.cpu()[:, :, :32], wq[:, :, :32], atol=1e-3)
