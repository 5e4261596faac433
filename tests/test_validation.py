# SPDX-License-Identifier: Apache-2.0
"""Bad input raises ValueError/TypeError naming the argument, on every public op, before any
launch. Runs on the reference path and, under the interpreter, on the kernel path."""

import inspect

import pytest
import torch

import openmsa
from openmsa import reference as ref
from helpers import make_step

pytestmark = pytest.mark.reference

B = 16
D = 64
FP8 = torch.float8_e4m3fn


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


def _indexer_args():
    step = make_step([1, 2], [40, 20], block_size=B)
    q = torch.randn(step.num_tokens, 2, 32).half()
    cache = torch.randn(step.num_pages, B, 32).half()
    return dict(index_q=q, index_cache=cache, cu_seqlens_q=step.cu_seqlens_q,
                seq_lens=step.seq_lens, block_table=step.block_table)


@pytest.mark.parametrize("fn", [openmsa.block_scores, openmsa.select_blocks])
@pytest.mark.parametrize("change, exc, match", [
    (dict(index_q=torch.randn(3, 32).half()), ValueError, "index_q must be 3-D"),
    (dict(index_q=[1, 2]), TypeError, "index_q must be a torch.Tensor"),
    (dict(index_cache=torch.randn(4, 8, 32).half()), ValueError, "index_cache must be"),
    (dict(index_cache=torch.randn(4, B, 16).half()), ValueError, "index_cache's last dim"),
    (dict(index_cache=torch.randn(4, B, 32).bfloat16()), TypeError, "index_q .* and index_cache"),
    (dict(index_q=torch.randn(3, 2, 32).to(FP8)), TypeError, "index_q .* and index_cache"),
    (dict(cu_seqlens_q=torch.tensor([0, 1, 3])), TypeError, "cu_seqlens_q must have dtype"),
    (dict(cu_seqlens_q=_i32([0, 3])), ValueError, "cu_seqlens_q must have len"),
    (dict(seq_lens=_i32([[40, 20]])), ValueError, "seq_lens must be 1-D"),
    (dict(block_table=_i32([[0, 1, 2]])), ValueError, "block_table must have a row per"),
    (dict(block_size=12), ValueError, "block_size must be a positive power of two"),
    (dict(seq_lens=_i32([[40, 0], [20, 0]])[:, 0]), ValueError, "seq_lens must be contiguous"),
    (dict(cu_seqlens_q=_i32([[0, 0], [1, 0], [3, 0]])[:, 0]), ValueError,
     "cu_seqlens_q must be contiguous"),
])
def test_indexer_bad_inputs(fn, change, exc, match):
    args, change = _indexer_args(), dict(change)
    fn(*args.values(), block_size=B)  # a good call first (see test_attention_bad_inputs)
    block_size = change.pop("block_size", B)
    args.update(change)
    with pytest.raises(exc, match=match):
        fn(*args.values(), block_size=block_size)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(topk=0), ValueError, "topk"),
    # the kernels' bound (openmsa._checks.MAX_TOPK), refused on every device alike
    (dict(topk=65), ValueError, "topk must be <= 64"),
    (dict(topk=1000), ValueError, "topk must be <= 64"),
    (dict(topk=2, init_blocks=2, local_blocks=1), ValueError, "init_blocks \\+ local_blocks"),
    (dict(local_blocks=-1), ValueError, "local_blocks"),
    (dict(out=torch.zeros(3, 2, 16, dtype=torch.int64)), TypeError, "out must have dtype"),
    (dict(out=torch.zeros(3, 2, 8, dtype=torch.int32)), ValueError, "out must have shape"),
])
def test_select_bad_options(kw, exc, match):
    with pytest.raises(exc, match=match):
        openmsa.select_blocks(*_indexer_args().values(), block_size=B, **kw)


@pytest.mark.parametrize("fn", [openmsa.block_scores, openmsa.select_blocks])
@pytest.mark.parametrize("hint", [-1, 2.0, "4", True])
def test_bad_max_q_len(fn, hint):
    # like topk and the other int options: ValueError naming the argument
    with pytest.raises(ValueError, match="max_q_len must be an int >= 0"):
        fn(*_indexer_args().values(), block_size=B, max_q_len=hint)


def test_block_scores_bad_out():
    with pytest.raises(ValueError, match="out must have shape"):
        openmsa.block_scores(*_indexer_args().values(), block_size=B,
                             out=torch.zeros(3, 2, 2))


def _attention_args():
    # (a head dim the kernels take: the interpreter tier runs a good call first)
    step = make_step([1, 2], [40, 20], block_size=B)
    return dict(q=torch.randn(3, 8, D).half(),
                k_cache=torch.randn(step.num_pages, B, 2, D).half(),
                v_cache=torch.randn(step.num_pages, B, 2, D).half(),
                indices=torch.zeros(3, 2, 4, dtype=torch.int32), cu_seqlens_q=step.cu_seqlens_q,
                seq_lens=step.seq_lens, block_table=step.block_table)


@pytest.mark.parametrize("change, exc, match", [
    (dict(q=torch.randn(3, 8, D).long()), TypeError, "q must have dtype"),
    (dict(q=torch.randn(3, 7, D).half()), ValueError, "multiple of the caches' KV heads"),
    (dict(k_cache=torch.randn(5, B, 2, 16).half()), ValueError, "k_cache and v_cache must have"),
    (dict(v_cache=torch.randn(5, B, 2, D).float()), ValueError, "k_cache and v_cache must have"),
    (dict(indices=torch.zeros(3, 2, 4)), TypeError, "indices must have dtype int32"),
    (dict(indices=torch.zeros(2, 2, 4, dtype=torch.int32)), ValueError, "indices must have a row"),
    (dict(indices=torch.zeros(3, 3, 4, dtype=torch.int32)), ValueError, "index heads"),
    (dict(scale=-1.0), ValueError, "scale must be a finite positive"),
    (dict(scale=0.0), ValueError, "scale must be a finite positive"),
    (dict(scale=float("inf")), ValueError, "scale must be a finite positive"),
    (dict(scale=float("nan")), ValueError, "scale must be a finite positive"),
    (dict(indices=torch.zeros(3, 2, 65, dtype=torch.int32)), ValueError,
     "indices must hold 1 to 64 blocks per row"),
    (dict(indices=torch.zeros(3, 2, 0, dtype=torch.int32)), ValueError,
     "indices must hold 1 to 64 blocks per row"),
    (dict(k_scale="x"), TypeError, "k_scale"),
    (dict(k_scale=float("nan")), ValueError, "k_scale must be a finite nonzero"),
    (dict(k_scale=0.0), ValueError, "k_scale must be a finite nonzero"),
    (dict(k_scale=0), ValueError, "k_scale must be a finite nonzero"),
    (dict(k_scale=float("-inf")), ValueError, "k_scale must be a finite nonzero"),
    (dict(out=torch.zeros(3, 8, D)), TypeError, "out must have dtype"),
    (dict(seq_lens=_i32([[40, 0], [20, 0]])[:, 0]), ValueError, "seq_lens must be contiguous"),
    # a view whose keys lie 2^28 elements apart (no storage: no pages)
    (dict(k_cache=torch.empty(0).half().as_strided((0, B, 2, D), (1, 2 ** 28, D, 1)),
          v_cache=torch.empty(0).half().as_strided((0, B, 2, D), (1, 2 ** 28, D, 1))),
     ValueError, "k_cache's block and head_dim strides must span fewer than 2"),
])
def test_attention_bad_inputs(change, exc, match):
    args, change = _attention_args(), dict(change)
    kw = {k: change.pop(k) for k in ("scale", "k_scale", "out") if k in change}
    # a good call of the same shapes first: its cached launch plan must not let the bad one
    # past the checks
    openmsa.sparse_attention(*args.values(), block_size=B)
    args.update(change)
    with pytest.raises(exc, match=match):
        openmsa.sparse_attention(*args.values(), block_size=B, **kw)


def test_cache_write_bad_inputs():
    cache = torch.zeros(2, B, 8, dtype=FP8)
    with pytest.raises(ValueError, match="slot_mapping must have a slot per token"):
        openmsa.write_index_cache(torch.randn(3, 8), cache, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="slot_mapping must have dtype"):
        openmsa.write_index_cache(torch.randn(3, 8), cache, torch.zeros(3))
    with pytest.raises(ValueError, match="index_cache's last dim"):
        openmsa.write_index_cache(torch.randn(3, 4), cache, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        openmsa.write_index_cache(torch.randn(3, 8), cache,
                                  torch.zeros(3, 2, dtype=torch.int64)[:, 0])
    kc = torch.zeros(2, B, 2, 8)
    with pytest.raises(ValueError, match="k_cache must be"):
        openmsa.write_kv_cache(torch.randn(3, 1, 8), torch.randn(3, 1, 8), kc, kc,
                               torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="k and v must have one shape"):
        openmsa.write_kv_cache(torch.randn(3, 2, 8), torch.randn(2, 2, 8), kc, kc,
                               torch.zeros(3, dtype=torch.int64))
    kc8 = torch.zeros(2, B, 2, 8, dtype=FP8)
    with pytest.raises(ValueError, match="v_scale must be a finite nonzero"):
        openmsa.write_kv_cache(torch.randn(3, 2, 8), torch.randn(3, 2, 8), kc8, kc8,
                               torch.zeros(3, dtype=torch.int64), v_scale=float("inf"))


def test_page_table_bad_inputs():
    a = _attention_args()
    args = (a["indices"], a["cu_seqlens_q"], a["seq_lens"], a["block_table"])
    with pytest.raises(ValueError, match="sub_page_size"):
        openmsa.sparse_page_table(*args, num_kv_heads=2, block_size=B, sub_page_size=3)
    with pytest.raises(ValueError, match="sub_page_size"):
        openmsa.sparse_page_table(*args, num_kv_heads=2, block_size=B, sub_page_size=32)
    with pytest.raises(ValueError, match="num_kv_heads"):
        openmsa.sparse_page_table(*args, num_kv_heads=3, block_size=B)
    with pytest.raises(TypeError, match="indices"):
        openmsa.sparse_page_table(a["indices"].long(), *args[1:], num_kv_heads=2, block_size=B)


@pytest.mark.parametrize("name", ["block_scores", "select_blocks", "sparse_attention",
                                  "sparse_page_table", "validate_batch", "write_index_cache",
                                  "write_kv_cache", "fused_prepare"])
def test_reference_signatures_equal_public(name):
    """The same signatures but the launch knobs (a keyword-only `*Config`, which the reference
    has no use for: `config`, or `cache_config` where `config` is the layer's geometry)."""
    def without_launch_config(fn):
        sig = inspect.signature(fn)
        return sig.replace(parameters=[
            p for p in sig.parameters.values()
            if not (p.kind is p.KEYWORD_ONLY and "Config" in str(p.annotation))])
    public, reference = getattr(openmsa, name), getattr(ref, name)
    assert without_launch_config(public) == without_launch_config(reference)


def test_unsupported_reason():
    assert openmsa.unsupported_reason() is None
    assert openmsa.unsupported_reason(index_dtype=torch.bfloat16, kv_dtype=FP8) is None
    assert openmsa.unsupported_reason(index_query_dtype=torch.bfloat16) is None  # bf16 q, fp8 cache
    reason = openmsa.unsupported_reason(index_dtype=torch.bfloat16, index_query_dtype=FP8)
    assert "query only against a cache of the same type or fp8" in reason
    assert "queries" in openmsa.unsupported_reason(query_dtype=FP8)
    cfg = openmsa.MSAConfig(block_size=256)
    assert "block sizes" in openmsa.unsupported_reason(cfg)
    from openmsa.support import indexer_unsupported_reason
    reason = indexer_unsupported_reason(num_index_heads=4, index_head_dim=128, block_size=128,
                                        topk=128, query_dtype=FP8, cache_dtype=FP8)
    assert "topk up to 64" in reason
    assert "head dims" in openmsa.unsupported_reason(openmsa.MSAConfig(head_dim=96,
                                                                       rotary_dim=32))
    from openmsa.support import attention_unsupported_reason
    reason = attention_unsupported_reason(head_dim=128, block_size=128, group_size=16,
                                          query_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                                          topk=512)
    assert "up to 64 blocks" in reason


def test_topk_bound_is_the_same_everywhere():
    """topk from 1 to the kernels' bound is taken (a layer config, the reference op, and the
    kernels' verdict), past it refused by name on every device: MSAConfig, select_blocks and
    sparse_attention on CPU tensors (the reference) as the kernels refuse it."""
    from openmsa._checks import MAX_TOPK
    from openmsa.support import MAX_TOPK as KERNEL_MAX_TOPK
    assert MAX_TOPK == KERNEL_MAX_TOPK == 64
    for topk in (1, MAX_TOPK):
        cfg = openmsa.MSAConfig(topk_blocks=topk, local_blocks=1)
        assert openmsa.unsupported_reason(cfg) is None
        out = openmsa.select_blocks(*_indexer_args().values(), block_size=B, topk=topk)
        assert out.shape == (3, 2, topk)
    with pytest.raises(ValueError, match="MSAConfig.topk_blocks must be <= 64"):
        openmsa.MSAConfig(topk_blocks=MAX_TOPK + 1)
    with pytest.raises(ValueError, match="topk_blocks"):
        openmsa.MSAConfig.from_hf_config({"num_attention_heads": 64, "num_key_value_heads": 4,
                                          "sparse_attention_config": {
                                              "sparse_topk_blocks": 1000}})


@pytest.mark.parametrize("field, value", [
    ("rope_theta", float("inf")), ("rope_theta", float("nan")), ("rope_theta", 0.0),
    ("rope_theta", -1.0), ("rope_theta", "5e6"), ("rms_norm_eps", float("inf")),
    ("rms_norm_eps", float("nan")), ("rms_norm_eps", -1e-6)])
def test_config_refuses_non_finite_rope_theta_and_eps(field, value):
    with pytest.raises(ValueError, match=f"MSAConfig.{field} must be a finite number"):
        openmsa.MSAConfig(**{field: value})


@pytest.mark.parametrize("change, exc, match", [
    (dict(q_lens="13"), TypeError, "q_lens must be a sequence of ints"),
    (dict(q_lens=[1.0, 2.0]), TypeError, "q_lens must be a sequence of ints"),
    (dict(seq_lens=[40.7, 20]), TypeError, "seq_lens must be a sequence of ints"),
    (dict(seq_lens=torch.tensor([40.0, 20.0])), TypeError, "seq_lens must be a sequence"),
    (dict(q_lens=[True, 2]), TypeError, "q_lens must be a sequence of ints"),
    (dict(q_lens=3), TypeError, "q_lens must be a sequence of ints"),
    (dict(pad_tokens_to=8.0), TypeError, "pad_tokens_to must be an int"),
    (dict(pad_requests_to="4"), TypeError, "pad_requests_to must be an int"),
    (dict(slot_mapping=torch.zeros(3)), TypeError, "slot_mapping must be an int32 or int64"),
    (dict(index_slot_mapping=torch.zeros(2, dtype=torch.int64)), ValueError,
     "index_slot_mapping must be \\[3\\]"),
])
def test_planner_plan_bad_arguments(change, exc, match):
    import numpy as np
    cfg = openmsa.MSAConfig(num_heads=4, num_kv_heads=2, head_dim=64, num_index_heads=2,
                            index_head_dim=32, block_size=B, topk_blocks=4, rotary_dim=32)
    planner = openmsa.MSAPlanner(cfg, max_requests=4, max_tokens=16, max_blocks=8,
                                 device="cpu")
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    args = dict(q_lens=[1, 2], seq_lens=[40, 20], block_table=table)
    # what is a sequence of ints: lists, tuples, integer tensors and NumPy arrays
    for q_lens in ([1, 2], (1, 2), torch.tensor([1, 2]), np.array([1, 2])):
        meta = planner.plan(**dict(args, q_lens=q_lens))
        assert meta.cu_seqlens_q.tolist() == [0, 1, 3]
    args.update(change)
    with pytest.raises(exc, match=match):
        planner.plan(**args)


def _layer_case():
    cfg = openmsa.MSAConfig(num_heads=4, num_kv_heads=2, head_dim=64, num_index_heads=2,
                            index_head_dim=32, block_size=B, topk_blocks=4, rotary_dim=32)
    layer = openmsa.MSAAttention(cfg, 32, dtype=torch.float32, ops="reference")
    for p in layer.parameters():
        p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    planner = openmsa.MSAPlanner(cfg, max_requests=2, max_tokens=8, max_blocks=4, device="cpu")
    meta = planner.plan([1, 2], [20, 9], torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    kv = (torch.zeros(4, B, 2, 64), torch.zeros(4, B, 2, 64))
    return layer, dict(hidden=torch.randn(3, 32), meta=meta, kv_cache=kv,
                       index_cache=torch.zeros(4, B, 32))


@pytest.mark.parametrize("change, exc, match", [
    (dict(hidden=[[0.0] * 32] * 3), TypeError, "hidden must be a torch.Tensor"),
    (dict(hidden=torch.randn(3, 1, 32)), ValueError, "hidden must be \\[tokens, hidden_size=32"),
    (dict(hidden=torch.randn(3, 16)), ValueError, "hidden must be \\[tokens, hidden_size=32"),
    (dict(hidden=torch.randn(3, 32).double()), ValueError, "hidden must be torch.float32"),
    (dict(hidden=torch.randn(4, 32)), ValueError, "hidden must have a row per token of meta"),
    (dict(meta=None), TypeError, "meta must be an MSAMetadata"),
    (dict(kv_cache=(torch.zeros(4, B, 2, 64),)), TypeError,
     "kv_cache must be a \\(k_cache, v_cache\\) pair of tensors, got a tuple of 1"),
    (dict(kv_cache=torch.zeros(4, B, 2, 64)), TypeError, "kv_cache must be a"),
    (dict(index_cache=None), TypeError, "index_cache must be a torch.Tensor"),
])
def test_layer_forward_names_bad_arguments(change, exc, match):
    layer, args = _layer_case()
    assert layer(**args).shape == (3, 32)  # the good call runs
    args.update(change)
    with pytest.raises(exc, match=match):
        layer(**args)


@pytest.mark.parametrize("kw, match", [
    (dict(hidden_size=0), "hidden_size must be a positive int"),
    (dict(hidden_size=32.0), "hidden_size must be a positive int"),
    (dict(tp_size=2.0), "tp_size must be a positive int"),
    (dict(tp_size=2, tp_rank=2), "tp_rank must be an int in \\[0, tp_size=2\\)"),
    (dict(tp_rank=0.0), "tp_rank must be an int"),
])
def test_layer_constructor_names_bad_arguments(kw, match):
    cfg = openmsa.MSAConfig(num_heads=4, num_kv_heads=2, head_dim=64, num_index_heads=2,
                            index_head_dim=32, block_size=B, topk_blocks=4, rotary_dim=32)
    args = {"hidden_size": 32, **kw}
    with pytest.raises(ValueError, match=match):
        openmsa.MSAAttention(cfg, args.pop("hidden_size"), ops="reference", **args)


def test_unsupported_reason_fnuz_and_rocm():
    """fp8 e4m3fnuz (AMD gfx942's) is a supported cache and query type; on ROCm the device's
    sentence names the arch's fp8 and the archs the kernels are built for."""
    from openmsa.support import _rocm_reason
    fnuz = torch.float8_e4m3fnuz
    assert openmsa.unsupported_reason(index_dtype=fnuz, kv_dtype=fnuz) is None
    assert openmsa.unsupported_reason(index_dtype=fnuz, index_query_dtype=torch.bfloat16) is None
    assert openmsa.unsupported_reason(index_dtype=fnuz, index_query_dtype=FP8) is not None
    assert _rocm_reason("gfx942", fnuz) is None and _rocm_reason("gfx950", FP8) is None
    assert _rocm_reason("gfx942", None) is None
    assert _rocm_reason("gfx942", FP8) == \
        "gfx942's fp8 is float8_e4m3fnuz, got float8_e4m3fn inputs"
    assert _rocm_reason("gfx950", fnuz) == \
        "gfx950's fp8 is float8_e4m3fn, got float8_e4m3fnuz inputs"
    assert "gfx942 and gfx950 only, this GPU is gfx90a" in _rocm_reason("gfx90a", None)


# NVFP4 index caches (uint8 [P, 128, 72] pages): every bad cache is refused by name
def _nvfp4_bad_caches():
    u8 = dict(dtype=torch.uint8)
    return [
        (torch.zeros(2, 128, 64, **u8), r"\[P, 128, 72\]"),
        (torch.zeros(2, 64, 72, **u8), r"\[P, 128, 72\]"),
        (torch.zeros(2, 9216, **u8), "3-D"),
        (torch.zeros(2, 72, 128, **u8).transpose(1, 2), "contiguous bytes"),
        (torch.zeros(2 * 9216, **u8).as_strided((2, 128, 72), (9200, 72, 1)), "page stride"),
        (torch.zeros(3 * 9224, **u8).as_strided((2, 128, 72), (9224, 72, 1)), "multiple of 16"),
        (torch.zeros(2 * 9216 + 16, **u8)[1:].as_strided((2, 128, 72), (9216, 72, 1)),
         "aligned"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_nvfp4_index_write_bad_caches(case):
    cache, match = _nvfp4_bad_caches()[case]
    with pytest.raises(ValueError, match=match) as e:
        openmsa.write_index_cache(torch.randn(3, 128), cache, torch.zeros(3, dtype=torch.int64))
    assert str(e.value).startswith("index_cache")


def test_nvfp4_index_write_needs_128_dim_keys():
    cache = torch.zeros(2, 128, 72, dtype=torch.uint8)
    with pytest.raises(ValueError, match="index_k: an NVFP4 index cache holds 128-dim"):
        openmsa.write_index_cache(torch.randn(3, 64), cache, torch.zeros(3, dtype=torch.int64))


NVFP4_CFG = openmsa.MSAConfig(num_heads=4, num_kv_heads=1, head_dim=64, num_index_heads=1,
                              index_head_dim=128, block_size=128, rotary_dim=32)


def _prepare_args(cfg=NVFP4_CFG, index_cache=None):
    t, d, di = 3, cfg.head_dim, cfg.index_head_dim
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * d + (cfg.num_index_heads + 1) * di
    kc = torch.zeros(2, cfg.block_size, cfg.num_kv_heads, d)
    slots = torch.zeros(t, dtype=torch.int64)
    if index_cache is None:
        index_cache = torch.zeros(2, 128, 72, dtype=torch.uint8)
    return [torch.randn(t, width), slots, cfg, torch.zeros(d), torch.zeros(d), torch.zeros(di),
            torch.zeros(di), kc, kc.clone(), slots, index_cache, slots]


@pytest.mark.parametrize("case", range(7))
def test_nvfp4_fused_prepare_bad_caches(case):
    cache, match = _nvfp4_bad_caches()[case]
    with pytest.raises(ValueError, match=match) as e:
        openmsa.fused_prepare(*_prepare_args(index_cache=cache))
    assert str(e.value).startswith("index_cache")


def test_nvfp4_fused_prepare_geometry_and_query():
    q, iq = openmsa.fused_prepare(*_prepare_args())  # the good case runs
    assert iq.dtype == FP8 and iq.shape == (3, 1, 128)
    small = openmsa.MSAConfig(num_heads=4, num_kv_heads=1, head_dim=64, num_index_heads=1,
                              index_head_dim=64, block_size=128, rotary_dim=32)
    with pytest.raises(ValueError, match="config.index_head_dim: an NVFP4 index cache holds"):
        openmsa.fused_prepare(*_prepare_args(small, torch.zeros(2, 128, 72, dtype=torch.uint8)))
    paged64 = openmsa.MSAConfig(num_heads=4, num_kv_heads=1, head_dim=64, num_index_heads=1,
                                index_head_dim=128, block_size=64, rotary_dim=32)
    with pytest.raises(ValueError, match="block_size must be 128"):
        openmsa.fused_prepare(*_prepare_args(paged64, torch.zeros(2, 128, 72,
                                                                  dtype=torch.uint8)))
    with pytest.raises(TypeError, match="index_q against an NVFP4 index cache"):
        openmsa.fused_prepare(*_prepare_args(),
                              index_q_out=torch.empty(3, 1, 128, dtype=torch.float8_e4m3fnuz))


def test_unsupported_reason_nvfp4():
    u8 = torch.uint8
    assert openmsa.unsupported_reason(index_dtype=u8) is None  # M3: Di 128, 128-token pages
    assert openmsa.unsupported_reason(index_dtype=u8, index_query_dtype=torch.bfloat16) is None
    reason = openmsa.unsupported_reason(openmsa.MSAConfig(block_size=64), index_dtype=u8)
    assert "NVFP4 index cache needs index_head_dim == 128 and block_size == 128" in reason
    reason = openmsa.unsupported_reason(openmsa.MSAConfig(index_head_dim=64), index_dtype=u8)
    assert "index_head_dim 64" in reason
    reason = openmsa.unsupported_reason(index_dtype=u8, index_query_dtype=torch.float32)
    assert "NVFP4 index cache takes a float8_e4m3fn, bfloat16 or float16 index query" in reason
