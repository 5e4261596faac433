# SPDX-License-Identifier: Apache-2.0
"""prepare_and_select: fused_prepare then select_blocks, which on the kernel path runs a decode
step's preparation inside the scoring launch. It must give what the two ops give one after the
other (bit for bit: outputs, caches, selections), also where the step's index slots land in
blocks other rows read (the preparation's writes then change scores), and it must take the
fused launch for decode and verify steps."""

from __future__ import annotations

import pytest
import torch

import openmsa
from openmsa import reference as ref
from openmsa._interpreter import INTERPRET
from openmsa.ops.indexer import api as indexer_api

from helpers.sm90 import COMPILE_SKIP, F32, I32, I64, compile_sm90
from helpers.steps import make_step

FP8 = torch.float8_e4m3fn
B = 16
CFG = openmsa.MSAConfig(num_heads=8, num_kv_heads=2, head_dim=64, num_index_heads=2,
                        index_head_dim=64, block_size=B, rotary_dim=32, rope_theta=5e6,
                        topk_blocks=4, init_blocks=1, local_blocks=1)
SEQ_LENS = [70, 33, 16, 120, 81]


def _width(cfg):
    return (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim \
        + (cfg.num_index_heads + 1) * cfg.index_head_dim


def _case(q_lens, index_dtype, seed=0, pad_tokens=2):
    """A step (scattered pages, a spare table column, padding tokens) with its projection
    rows and caches, on the CPU. The cached index keys are small (|S| ~ 0.01), the step's own
    keys unit-RMS: a block that gets one of them scores far above the others."""
    g = torch.Generator().manual_seed(seed)
    step = make_step(q_lens, SEQ_LENS, block_size=B, extra_columns=1, pad_tokens=pad_tokens,
                     generator=g)
    t = step.num_tokens
    # a strided view of a wider buffer, as an engine's fused GEMM output
    qkv = (torch.randn(t, _width(CFG) + 8, generator=g) * 3).to(torch.bfloat16)[:, 4:-4]
    weights = [(torch.randn(n, generator=g) * 0.2).to(torch.bfloat16)
               for n in (CFG.head_dim, CFG.head_dim, CFG.index_head_dim, CFG.index_head_dim)]
    pages = step.num_pages
    kc = torch.randn(pages, B, CFG.num_kv_heads, CFG.head_dim, generator=g).to(torch.bfloat16)
    vc = torch.randn(pages, B, CFG.num_kv_heads, CFG.head_dim, generator=g).to(torch.bfloat16)
    ic = (torch.randn(pages, B, CFG.index_head_dim, generator=g) * 0.01).to(index_dtype)
    cu = step.cu_seqlens_q.tolist()
    pos = torch.full((t,), -1, dtype=torch.int64)
    for r, s in enumerate(SEQ_LENS):
        for i in range(cu[r + 1] - cu[r]):
            pos[cu[r] + i] = s - (cu[r + 1] - cu[r]) + i
    return step, qkv, weights, kc, vc, ic, pos


def _run(op_device, step, qkv, weights, kc, vc, ic, pos, index_slots, fused: bool,
         meta=None):
    max_q_len = max(step.q_lens)
    """(q, index_q, indices, k_cache, v_cache, index_cache) from prepare_and_select (fused) or
    from fused_prepare and select_blocks (each on its own caches' copies)."""
    d = op_device
    kc, vc, ic = kc.clone().to(d), vc.clone().to(d), ic.clone().to(d)
    args = (qkv.to(d), pos.to(d), CFG, *[w.to(d) for w in weights], kc, vc,
            step.slot_mapping.to(d), ic, index_slots.to(d))
    meta = tuple(x.to(d) for x in (meta or (step.cu_seqlens_q, step.seq_lens,
                                            step.block_table)))
    if fused:
        q, iq, idx = openmsa.prepare_and_select(*args, *meta, max_q_len=max_q_len)
    else:
        q, iq = openmsa.fused_prepare(*args)
        idx = openmsa.select_blocks(iq, ic, *meta, topk=CFG.topk_blocks,
                                    init_blocks=CFG.init_blocks, local_blocks=CFG.local_blocks,
                                    block_size=B, max_q_len=max_q_len)
    return tuple(x.cpu() for x in (q, iq, idx, kc, vc, ic))


def _same(a, b):
    return torch.equal(a.float().nan_to_num(7.0), b.float().nan_to_num(7.0))


def _hostile_slots(step, name):
    """The step's index slots with one broken: `into_other_block` sends request 4's key into
    a middle block of request 3 (read by its selection: neither forced nor a short row). (The
    interpreter runs programs in grid order, request 3's scoring before request 4's
    preparation: without the second scoring it would miss the key.)"""
    slots = step.slot_mapping.clone()
    first = int(step.cu_seqlens_q[4])
    if name == "into_other_block":
        slots[first] = int(step.block_table[3, 2]) * B + 5
    elif name == "past_cache":
        slots[first] = step.num_pages * B + 3
    elif name is not None:
        raise AssertionError(name)
    return slots


@pytest.mark.interpret
@pytest.mark.parametrize("index_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("q_lens,hostile", [
    ([1, 1, 1, 1, 1], None),
    ([1, 1, 1, 1, 1], "into_other_block"),
    ([1, 1, 1, 1, 1], "past_cache"),
    # three tokens for request 4 (positions 78-80), no more tokens than requests (the fused
    # launch's steps): they straddle blocks 4 and 5, and block 4 is neither forced nor in a
    # short row for the token at 80, so it is scored again with the new keys
    ([1, 1, 0, 0, 3], None),
])
def test_equals_the_two_ops(kernel_device, monkeypatch, index_dtype, q_lens, hostile):
    # (decode: two padding tokens, planned as decode by max_q_len 1; the q_len 3 step as many
    # tokens as requests)
    step, qkv, w, kc, vc, ic, pos = _case(q_lens, index_dtype,
                                          pad_tokens=2 if max(q_lens) == 1 else 0)
    slots = _hostile_slots(step, hostile)
    want = _run(kernel_device, step, qkv, w, kc, vc, ic, pos, slots, fused=False)

    def no_separate_preparation(*args, **kwargs):
        raise AssertionError("prepare_and_select ran fused_prepare: the fused launch was not "
                             "taken")
    monkeypatch.setattr(indexer_api, "fused_prepare", no_separate_preparation)
    got = _run(kernel_device, step, qkv, w, kc, vc, ic, pos, slots, fused=True)
    for name, a, b in zip(("q", "index_q", "indices", "k_cache", "v_cache", "index_cache"),
                          got, want):
        assert _same(a, b), name
    # and the reference's selection (its own preparation, in torch's order of sums)
    r = ref.prepare_and_select(qkv, pos, CFG, *w, kc.clone(), vc.clone(), step.slot_mapping,
                               ic.clone(), slots, step.cu_seqlens_q, step.seq_lens,
                               step.block_table)
    assert torch.equal(got[2], r[2])
    if hostile == "into_other_block":
        # the test can fail: request 3's rows chose the block that got the stray key
        rows = got[2][int(step.cu_seqlens_q[3]):int(step.cu_seqlens_q[4])]
        assert (rows == 2).any()


@pytest.mark.interpret
@pytest.mark.parametrize("name", ["page_past_cache", "negative_page", "narrow_table",
                                  "cu_decreasing", "cu_not_from_zero", "cu_past_tokens"])
def test_broken_metadata_gives_the_two_ops_result(kernel_device, monkeypatch, name):
    """A decode step (the fused launch) whose table, seq_lens or cu_seqlens_q break the
    contract (docs/spec.md, "Bounds"): the two ops' results, bit for bit, and the reference's
    selection."""
    step, qkv, w, kc, vc, ic, pos = _case([1, 1, 1, 1, 1], FP8)
    cu, sl, bt = step.cu_seqlens_q.clone(), step.seq_lens.clone(), step.block_table.clone()
    if name == "page_past_cache":
        bt[0, 1], bt[3, 2], bt[4, 0] = step.num_pages, step.num_pages + 7, 2 ** 30
    elif name == "negative_page":
        bt[0, 2], bt[3, 0], bt[3, 5] = -2, -(2 ** 31), -7
    elif name == "narrow_table":
        sl[3] = 2000  # 125 blocks against a table of 9 columns: padding
    elif name == "cu_decreasing":
        cu[2] = cu[3] + 1
    elif name == "cu_not_from_zero":
        cu[0] = 1
    else:
        cu[-1] = step.num_tokens + 3
    meta = (cu, sl, bt)
    want = _run(kernel_device, step, qkv, w, kc, vc, ic, pos, step.slot_mapping, False, meta)
    monkeypatch.setattr(indexer_api, "fused_prepare", None)  # (the fused launch must run)
    got = _run(kernel_device, step, qkv, w, kc, vc, ic, pos, step.slot_mapping, True, meta)
    for label, a, b in zip(("q", "index_q", "indices", "k_cache", "v_cache", "index_cache"),
                           got, want):
        assert _same(a, b), (name, label)
    r = ref.prepare_and_select(qkv, pos, CFG, *w, kc.clone(), vc.clone(), step.slot_mapping,
                               ic.clone(), step.slot_mapping, *meta)
    assert torch.equal(got[2], r[2]), name


@pytest.mark.interpret
@pytest.mark.parametrize("q_lens", [[1, 20, 1, 1, 1], [1, 3, 1, 1, 1]])
def test_other_steps_run_the_two_ops(kernel_device, q_lens):
    """A step with a long request (the prefill launch), or more tokens than requests (verify),
    gives the two ops' results through them."""
    step, qkv, w, kc, vc, ic, pos = _case(q_lens, torch.bfloat16)
    want = _run(kernel_device, step, qkv, w, kc, vc, ic, pos, step.slot_mapping, fused=False)
    got = _run(kernel_device, step, qkv, w, kc, vc, ic, pos, step.slot_mapping, fused=True)
    assert all(_same(a, b) for a, b in zip(got, want))


@pytest.mark.reference
def test_plan_fuses_short_decode_steps_only():
    from openmsa.ops.common.plan import DeviceFacts, Launch
    from openmsa.ops.indexer.plan import IndexerShape, plan, prepared_plan

    prep = Launch("fused_prepare", (8, 7), dict(INDEX_NVFP4=False, HQ=64, HKV=4, D=128, DP=128,
                                                ROT=64, NCOARSE=16384, FP32_ANGLES=False,
                                                ROPE_SCALE=1.0, BLOCK=128, HT=16,
                                                KV_SATURATE=False, INDEX_SATURATE=True,
                                                IQ_SATURATE=True, HAS_SCALE=False))

    def fused(tokens, requests, blocks):
        shape = IndexerShape(tokens, 4, 128, requests, blocks, 128, FP8, FP8, topk=16)
        p = prepared_plan(plan(shape, DeviceFacts()), prep, shape)
        return None if p is None else p.kernels()[0]
    assert fused(8, 8, 256) == "prepare_scores"
    assert fused(1, 1, 257) is None  # past decode.prepare_max_blocks
    assert fused(9, 8, 256) is None  # more tokens than requests, no max_q_len
    shape = IndexerShape(10, 4, 128, 8, 256, 128, FP8, FP8, max_q_len=1, topk=16)
    assert prepared_plan(plan(shape, DeviceFacts()), prep, shape) is not None
    assert fused(40, 1, 256) is None  # a prefill chunk


@pytest.mark.reference
def test_rejects_bad_arguments():
    step, qkv, w, kc, vc, ic, pos = _case([1, 1, 1, 1, 1], torch.bfloat16)
    args = [qkv, pos, CFG, *w, kc, vc, step.slot_mapping, ic, step.slot_mapping,
            step.cu_seqlens_q, step.seq_lens, step.block_table]
    with pytest.raises(TypeError, match="config"):
        openmsa.prepare_and_select(*args[:2], {"num_heads": 8}, *args[3:])
    with pytest.raises(ValueError, match="block_table"):
        openmsa.prepare_and_select(*args[:-1], step.block_table[:, :1].expand(5, 1)[:4])
    with pytest.raises(ValueError, match="qkv"):
        openmsa.prepare_and_select(qkv[:, :-1], *args[1:])


@pytest.mark.reference
@pytest.mark.skipif(INTERPRET, reason=COMPILE_SKIP)
@pytest.mark.parametrize("index_type", ["*fp8e4nv", "*bf16"])
def test_kernel_compiles_for_sm90(index_type):
    """The fused launch at M3's TP1 shapes, with the constexprs prepared_plan passes: it builds
    for Hopper and spills nothing (the scoring programs' prologue now prepares the query)."""
    from openmsa.ops.indexer.kernels.scores import _prepare_scores_kernel

    bf16 = "*bf16"
    pointers = dict(cache_ptr=index_type, out_ptr=F32, cu_ptr=I32, seq_lens_ptr=I32, bt_ptr=I32,
                    qkv_ptr=bf16, pos_ptr=I64, qw_ptr=bf16, kw_ptr=bf16, iqw_ptr=bf16,
                    ikw_ptr=bf16, table_ptr=F32, k_cache_ptr=bf16, v_cache_ptr=bf16,
                    slot_ptr=I64, index_slot_ptr=I64, k_scale_ptr=F32, v_scale_ptr=F32,
                    q_out_ptr=bf16, iq_out_ptr=index_type)
    fp8 = index_type == "*fp8e4nv"
    k = compile_sm90(_prepare_scores_kernel, pointers, dict(eps="fp32"), dict(
        H=4, HP=4, DI=128, DIP=128, BLOCK=128, BPS=16, SMALL_Q=16, ROWS_T=4, CAST_K=False,
        IEEE=False, KEYS_AS_ROWS=True, MAX_SKIPS_NAN=True, PDL=True, HQ=64, HKV=4, D=128,
        DP=128, ROT=64, NCOARSE=1024, FP32_ANGLES=False, ROPE_SCALE=1.0, KV_BLOCK=128, HT=16,
        KV_SATURATE=False, INDEX_SATURATE=fp8, IQ_SATURATE=fp8, HAS_SCALE=False, PREP_TILES=10),
        options=dict(num_warps=4, num_stages=3))
    assert "griddepcontrol.launch_dependents" in k.asm["ptx"]
    assert k.metadata.shared >= 0
