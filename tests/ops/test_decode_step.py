# SPDX-License-Identifier: Apache-2.0
"""decode_step: a layer's step between its projections, as one launch at small batch (ops/step).
It must give what prepare_and_select then sparse_attention give (bit for bit: the query, the
index query, the selection, the attention output and the three caches) over every phase form
the separate plans can hand it (one segment or several with their merge, sorted or searched,
one attention split, a fused merge or a merge phase), on broken metadata too, and leave its
counters at zero for the next launch or graph replay. On a GPU the same tests run with the
phases spinning on their counters."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import openmsa
from openmsa.ops.attention.plan import AttentionConfig, SplitForm
from openmsa.ops.indexer.plan import IndexerConfig
from openmsa.ops.step import api as step_api
from openmsa.ops.step.api import StepConfig, decode_step
from openmsa.ops.step.kernels.step import _arrive, _wait
from openmsa.ops.step.plan import ERROR_SLOT
from openmsa.ops.step.reference import decode_step as ref_decode_step

from helpers.sm90 import COMPILE_SKIP, F32, I32, I64, INTERPRET, compile_sm90
from helpers.steps import make_step

FP8 = torch.float8_e4m3fn
B = 16
CFG = openmsa.MSAConfig(num_heads=8, num_kv_heads=2, head_dim=64, num_index_heads=2,
                        index_head_dim=64, block_size=B, rotary_dim=32, rope_theta=5e6,
                        topk_blocks=4, init_blocks=1, local_blocks=1)
SEQ_LENS = [70, 33, 16, 120, 81]
ONE = StepConfig(max_tokens=16)
APART = StepConfig(max_tokens=0)

# the phase forms: the separate plans' choices, steered by their configs
FORMS = {
    "default": {},
    "segments": dict(indexer_config=IndexerConfig().replace(
        select=dict(segment=4, sort_widths=(4,)))),
    "segments-sorted": dict(indexer_config=IndexerConfig().replace(
        select=dict(segment=4, sort_widths=(4,), sort_waves=1 << 20))),
    # (off CUDA the attention plan splits every row of 4 steps or more in two)
    "one-split": dict(cfg=dataclasses.replace(CFG, topk_blocks=3)),
    "merge-phase": dict(attention_config=AttentionConfig(split=SplitForm(min_steps=1,
                                                                         fused_max=1))),
}


def _case(index_dtype, kv_dtype, seed=0, q_lens=(1, 1, 1, 1, 1)):
    """A step of the five requests (scattered pages, a spare table column, two padding tokens)
    with its projection rows and caches, on the CPU: decode, or verify with longer q_lens."""
    g = torch.Generator().manual_seed(seed)
    step = make_step(list(q_lens), SEQ_LENS, block_size=B, extra_columns=1, pad_tokens=2,
                     generator=g)
    t = step.num_tokens
    width = (CFG.num_heads + 2 * CFG.num_kv_heads) * CFG.head_dim \
        + (CFG.num_index_heads + 1) * CFG.index_head_dim
    # a strided view of a wider buffer, as an engine's fused GEMM output
    qkv = (torch.randn(t, width + 8, generator=g) * 3).half()[:, 4:-4]
    w = [(torch.randn(64, generator=g) * 0.2).half() for _ in range(4)]
    pages = step.num_pages
    kc = torch.randn(pages, B, CFG.num_kv_heads, CFG.head_dim, generator=g).to(kv_dtype)
    vc = torch.randn(pages, B, CFG.num_kv_heads, CFG.head_dim, generator=g).to(kv_dtype)
    ic = (torch.randn(pages, B, CFG.index_head_dim, generator=g) * 0.5).to(index_dtype)
    pos = torch.full((t,), -1, dtype=torch.int64)
    cu = step.cu_seqlens_q.tolist()
    for r, s in enumerate(SEQ_LENS):
        for i in range(cu[r + 1] - cu[r]):
            pos[cu[r] + i] = s - (cu[r + 1] - cu[r]) + i
    return step, qkv, w, kc, vc, ic, pos


def _run(fn, device, case, meta=None, index_side=None, **kw):
    """fn's (q, index_q, indices, out) and the three caches after it (on copies), on CPU.
    index_side: (index slots, index block table) of an index cache paged apart from K/V (the
    case's own layout by default)."""
    step, qkv, w, kc, vc, ic, pos = case
    cfg = kw.pop("cfg", CFG)
    kc, vc, ic = kc.clone().to(device), vc.clone().to(device), ic.clone().to(device)
    cu, sl, bt = meta or (step.cu_seqlens_q, step.seq_lens, step.block_table)
    islots, ibt = index_side or (step.slot_mapping, bt)
    scales = dict(k_scale=0.5, v_scale=2.0) if kc.dtype == FP8 else {}
    got = fn(qkv.to(device), pos.to(device), cfg, *[x.to(device) for x in w], kc, vc,
             step.slot_mapping.to(device), ic, islots.to(device), cu.to(device),
             sl.to(device), ibt.to(device), bt.to(device), max_q_len=max(step.q_lens),
             **scales, **kw)
    return tuple(x.cpu() for x in (*got, kc, vc, ic))


def _same(a, b):
    return torch.equal(a.float().nan_to_num(7.0), b.float().nan_to_num(7.0))


NAMES = ("q", "index_q", "indices", "out", "k_cache", "v_cache", "index_cache")


@pytest.fixture
def one_launches(monkeypatch):
    """The one launches' (launch, sizes) as decode_step runs them."""
    seen = []
    run = step_api._run

    def recording(launch, sizes, *args):
        seen.append((launch, sizes))
        return run(launch, sizes, *args)
    monkeypatch.setattr(step_api, "_run", recording)
    return seen


@pytest.mark.interpret
@pytest.mark.parametrize("index_dtype,kv_dtype", [(FP8, torch.float16),
                                                  (torch.float16, FP8)])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_equals_the_ops_apart(kernel_device, one_launches, index_dtype, kv_dtype, form):
    case = _case(index_dtype, kv_dtype)
    want = _run(decode_step, kernel_device, case, step_config=APART, **FORMS[form])
    assert not one_launches
    got = _run(decode_step, kernel_device, case, step_config=ONE, **FORMS[form])
    (launch, sizes), = one_launches
    if kernel_device == "cpu":
        # the form asked for is the one that ran (the interpreter's plans; a GPU's choose by
        # its SM count)
        p = launch.params
        if form.startswith("segments"):
            assert sizes["segments"] > 1 and p["M_CANDP"] > 0
            assert p["G_BY_SORT"] == (form == "segments-sorted")
        if form == "one-split":
            assert p["A_SPLITS"] == 1
        if form == "merge-phase":
            assert p["A_SPLITS"] > 1 and not p["A_FUSED_MERGE"]
            assert launch.grid[0] > sizes["ends"][-1]
    for name, a, b in zip(NAMES, got, want):
        assert _same(a, b), name
    # and the reference (its own arithmetic): the same selection, the output within rounding
    r = _run(ref_decode_step, "cpu", case, cfg=FORMS[form].get("cfg", CFG))
    assert torch.equal(got[2], r[2])
    assert (got[3].float() - r[3].float()).abs().max() < 2e-2


@pytest.mark.interpret
def test_index_cache_paged_apart_and_caller_outputs(kernel_device, one_launches):
    """The index cache with pages, a table and slots of its own (another page count and
    order than K/V's), and strided caller outputs (index_q_out, out): each side's arguments
    reach their own phase."""
    case = list(_case(FP8, torch.float16))
    step = case[0]
    other = make_step([1] * len(SEQ_LENS), SEQ_LENS, block_size=B, extra_columns=3,
                      pad_tokens=2, spare_pages=9, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(6)
    case[5] = (torch.randn(other.num_pages, B, CFG.index_head_dim, generator=g)
               * 0.5).to(FP8)
    side = (other.slot_mapping, other.block_table)
    t = step.num_tokens

    def outputs():
        iq = torch.empty(t, 2 * CFG.index_head_dim, CFG.num_index_heads, dtype=FP8,
                         device=kernel_device).transpose(1, 2)[:, :, ::2]
        out = torch.empty(CFG.num_heads, t, CFG.head_dim, dtype=torch.float16,
                          device=kernel_device).transpose(0, 1)
        return dict(index_q_out=iq, out=out)
    want = _run(decode_step, kernel_device, case, index_side=side, step_config=APART,
                **outputs())
    got = _run(decode_step, kernel_device, case, index_side=side, step_config=ONE,
               **outputs())
    assert len(one_launches) == 1
    for name, a, b in zip(NAMES, got, want):
        assert _same(a, b), name
    r = _run(ref_decode_step, "cpu", case, index_side=side)
    assert torch.equal(got[2], r[2])
    assert (got[3].float() - r[3].float()).abs().max() < 2e-2


@pytest.mark.interpret
@pytest.mark.parametrize("q_lens", [(1, 3, 1, 1, 1), (2, 2, 0, 4, 2)])
def test_verify_steps_equal_the_ops_apart(kernel_device, one_launches, q_lens):
    """Verify steps (several draft tokens a request, a request with none): each token's own
    causal cut, and the step's new keys (several in one block) scored as written."""
    case = _case(FP8, torch.float16, q_lens=q_lens)
    want = _run(decode_step, kernel_device, case, step_config=APART)
    got = _run(decode_step, kernel_device, case, step_config=ONE)
    assert len(one_launches) == 1
    for name, a, b in zip(NAMES, got, want):
        assert _same(a, b), name
    r = _run(ref_decode_step, "cpu", case)
    assert torch.equal(got[2], r[2])


@pytest.mark.interpret
@pytest.mark.parametrize("name", ["page_past_cache", "negative_page", "narrow_table",
                                  "cu_decreasing", "cu_past_tokens", "nan_pages"])
def test_broken_metadata_gives_the_ops_apart_result(kernel_device, one_launches, name):
    """A step whose table, seq_lens or cu_seqlens_q break the contract (docs/spec.md,
    "Bounds"), or whose pages hold NaN: the ops' results apart, bit for bit."""
    case = list(_case(FP8, torch.float16))
    step = case[0]
    cu, sl, bt = step.cu_seqlens_q.clone(), step.seq_lens.clone(), step.block_table.clone()
    if name == "page_past_cache":
        bt[0, 1], bt[3, 2], bt[4, 0] = step.num_pages, step.num_pages + 7, 2 ** 30
    elif name == "negative_page":
        bt[0, 2], bt[3, 0], bt[3, 5] = -2, -(2 ** 31), -7
    elif name == "narrow_table":
        sl[3] = 2000  # 125 blocks against a table of 9 columns: padding
    elif name == "cu_decreasing":
        cu[2] = cu[3] + 1
    elif name == "cu_past_tokens":
        cu[-1] = step.num_tokens + 3
    else:
        for c in (3, 4):  # index keys and K/V of the pages of request 3's blocks 1 and 5
            page = int(bt[3, 1 if c == 3 else 5])
            case[c] = case[c].clone()
            case[c][page] = float("nan")
        case[5] = case[5].clone()
        case[5][int(bt[3, 2])] = float("nan")
    meta = (cu, sl, bt)
    want = _run(decode_step, kernel_device, case, meta, step_config=APART)
    got = _run(decode_step, kernel_device, case, meta, step_config=ONE)
    assert len(one_launches) == 1
    for label, a, b in zip(NAMES, got, want):
        assert _same(a, b), (name, label)


@pytest.mark.interpret
def test_counters_return_to_zero(kernel_device, monkeypatch, one_launches):
    """Two calls on one counter buffer (as a graph replays): each leaves it at zero."""
    buf = torch.zeros(64, dtype=torch.int32, device=kernel_device)
    monkeypatch.setattr(step_api, "arrival_counters", lambda device, n, role: buf)
    case = _case(FP8, torch.float16)
    first = _run(decode_step, kernel_device, case, step_config=ONE, **FORMS["default"])
    assert int(buf.abs().sum()) == 0
    second = _run(decode_step, kernel_device, case, step_config=ONE, **FORMS["default"])
    assert int(buf.abs().sum()) == 0 and len(one_launches) == 2
    assert all(_same(a, b) for a, b in zip(first, second))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_trace_records_every_program_in_phase_order(one_launches):
    """The trace has a row for each program (its ticket) with start <= end of wait <= end on
    the global timer and its SM; the rows past the grid are untouched; the step's results are
    those of the untraced launch."""
    case = _case(FP8, torch.float16)
    plain = _run(decode_step, "cuda", case, step_config=ONE)
    trace = torch.full((4096, 4), -1, dtype=torch.int64, device="cuda")
    traced = _run(decode_step, "cuda", case, step_config=ONE, trace=trace)
    assert all(_same(a, b) for a, b in zip(plain, traced))
    (launch, sizes), _ = one_launches
    programs = launch.grid[0]
    rows = trace[:programs].cpu()
    assert bool((trace[programs:] == -1).all())
    t0, t1, t2, sm = rows.unbind(1)
    assert bool(((t0 <= t1) & (t1 <= t2)).all())
    assert bool(((sm >= 0) & (sm < torch.cuda.get_device_properties(0).multi_processor_count))
                .all())
    # a phase's programs end their wait no earlier than the first producer of the phase before
    # started
    ends = (0,) + sizes["ends"] + (programs,)
    phases = [(a, b) for a, b in zip(ends, ends[1:]) if b > a]
    for (a, b), (c, d) in zip(phases, phases[1:]):
        assert int(t1[c:d].min()) >= int(t0[a:b].min())
    with pytest.raises(ValueError, match="^trace must have at least"):
        _run(decode_step, "cuda", case, step_config=ONE, trace=trace[:2])


@triton.jit
def _two_phases(counters_ptr, producers, target):
    """Programs below `producers` arrive at counter 1, the rest wait for `target` arrivals."""
    if tl.program_id(0) < producers:
        _arrive(counters_ptr, 1)
    else:
        _wait(counters_ptr, 1, target, False, 0, False)


@pytest.mark.interpret
@pytest.mark.skipif(not INTERPRET, reason="the interpreter's check of the program order")
def test_interpreter_flags_a_phase_read_early():
    """The interpreter's wait flags a phase whose producers have not all arrived (the order
    bug a GPU would show as a wrong result or a hang), in the slot the op raises on."""
    for target, flagged in ((3, 0), (4, 1)):
        counters = torch.zeros(8, dtype=torch.int32)
        _two_phases[(5,)](counters, 3, target)
        assert int(counters[ERROR_SLOT]) == flagged


@pytest.mark.reference
def test_plan_takes_decode_steps_it_can_run():
    from openmsa.ops.attention.plan import AttentionShape
    from openmsa.ops.attention.plan import plan as attention_plan
    from openmsa.ops.cache.plan import PrepareShape
    from openmsa.ops.cache.plan import plan as prepare_plan
    from openmsa.ops.common.plan import DeviceFacts
    from openmsa.ops.indexer.plan import IndexerShape
    from openmsa.ops.indexer.plan import plan as indexer_plan
    from openmsa.ops.step.plan import plan

    dev = DeviceFacts(num_sms=132)

    def step(tokens, requests, context, max_q_len=1, index_dtype=FP8, config=ONE):
        # (max_q_len: the hint the indexer's plan reads)
        shape = IndexerShape(tokens, 4, 128, requests, context // 128, 128,
                             FP8 if index_dtype == torch.uint8 else index_dtype, index_dtype,
                             max_q_len=max_q_len, tma_rows=True, topk=16)
        att = attention_plan(AttentionShape(tokens, 64, 4, 128, 4, 16, 128, torch.bfloat16,
                                            torch.bfloat16), dev, AttentionConfig())
        prep = prepare_plan(PrepareShape(tokens, 64, 4, 4, 128, 128, 64, 128, 128,
                                         torch.bfloat16, index_dtype, FP8, False), dev)
        return plan(tokens, requests, prep, indexer_plan(shape, dev), att, dev, config)

    # M3 at TP1, B = 1, 128K: 7 preparation tiles, 256 scoring splits, 4 x 4 segments and
    # 4 merges, 4 x 16 attention splits, then 64 heads' merges
    launch, sizes = step(1, 1, 128 * 1024)
    assert sizes["ends"] == (7, 263, 279, 283, 347) and launch.grid == (411,)
    assert launch.params["SPIN"] and launch.params["num_warps"] == ONE.num_warps
    assert step(8, 8, 32 * 1024) is not None
    assert step(9, 8, 32 * 1024) is not None            # padding tokens of a decode step
    assert step(8, 2, 32 * 1024, max_q_len=4) is not None  # verify
    # a request past the decode scoring launch's q_len (the prefill launch scores it)
    assert step(17, 1, 32 * 1024, max_q_len=17, config=StepConfig(max_tokens=64)) is None
    assert step(16, 16, 32 * 1024, config=StepConfig(max_tokens=8)) is None
    assert step(2048, 1, 32 * 1024, max_q_len=2048) is None  # a prefill chunk
    assert step(1, 1, 32 * 1024, index_dtype=torch.uint8) is None  # NVFP4 pages
    dev = DeviceFacts(hip=True, capability=(9, 4), gluon_hopper=False)
    assert step(1, 1, 32 * 1024) is None  # ROCm: never built or run there


@pytest.mark.reference
def test_reference_has_the_same_signature():
    import inspect

    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    assert params(decode_step.__wrapped__) == params(ref_decode_step)


@pytest.mark.interpret
def test_rejects_bad_arguments(kernel_device):
    case = _case(FP8, torch.float16)
    d = kernel_device
    with pytest.raises(TypeError, match="step_config"):
        _run(decode_step, d, case, step_config={"max_tokens": 8})
    # each table and slot mapping named as decode_step names it
    slots, table = case[0].slot_mapping, case[0].block_table
    with pytest.raises(TypeError, match="^index_block_table must have dtype int32"):
        _run(decode_step, d, case, index_side=(slots, table.float()), step_config=ONE)
    with pytest.raises(TypeError, match="^block_table must have dtype int32"):
        _run(decode_step, d, case, (case[0].cu_seqlens_q, case[0].seq_lens, table.float()),
             index_side=(slots, table), step_config=ONE)
    with pytest.raises(TypeError, match="^index_slot_mapping"):
        _run(decode_step, d, case, index_side=(slots.float(), table), step_config=ONE)
    with pytest.raises(ValueError, match="^out must have shape"):
        _run(decode_step, d, case, out=torch.empty(3, 3, device=d), step_config=ONE)
    with pytest.raises(ValueError, match="StepConfig.num_warps"):
        StepConfig(num_warps=0)
    with pytest.raises(TypeError, match="StepConfig.max_tokens"):
        StepConfig(max_tokens=1.5)
    # trace: the GPU's one launch only
    with pytest.raises(TypeError, match="^trace must be a torch.Tensor"):
        _run(decode_step, d, case, step_config=ONE, trace=[0] * 4096)
    with pytest.raises(ValueError, match="^trace must be on the step's GPU"):
        _run(decode_step, d, case, step_config=ONE,
             trace=torch.zeros(4096, dtype=torch.int64))
    for ns in (-1, 1_000_001):
        with pytest.raises(ValueError, match="StepConfig.sleep_ns"):
            StepConfig(sleep_ns=ns)


@pytest.mark.reference
@pytest.mark.skipif(INTERPRET, reason=COMPILE_SKIP)
@pytest.mark.parametrize("batch,context", [(1, 32 * 1024), (1, 128 * 1024), (8, 1024 * 1024)])
def test_kernel_compiles_for_sm90(batch, context):
    """The one launch at M3's TP1 shapes with the plan's constexprs (fp8 index keys, bf16
    K/V) builds for Hopper with its counters' release and acquire."""
    from openmsa.ops.attention.plan import AttentionShape
    from openmsa.ops.attention.plan import plan as attention_plan
    from openmsa.ops.cache.plan import PrepareShape
    from openmsa.ops.cache.plan import plan as prepare_plan
    from openmsa.ops.common.plan import DeviceFacts
    from openmsa.ops.indexer.plan import IndexerShape
    from openmsa.ops.indexer.plan import plan as indexer_plan
    from openmsa.ops.step.kernels.step import _decode_step_kernel
    from openmsa.ops.step.plan import plan

    dev, bf16 = DeviceFacts(), torch.bfloat16
    shape = IndexerShape(batch, 4, 128, batch, context // 128, 128, FP8, FP8, max_q_len=1,
                         tma_rows=True, topk=16)
    launch, sizes = plan(batch, batch,
                     prepare_plan(PrepareShape(batch, 64, 4, 4, 128, 128, 64, 128, 128, bf16,
                                               FP8, FP8, False), dev),
                     indexer_plan(shape, dev),
                     attention_plan(AttentionShape(batch, 64, 4, 128, 4, 16, 128, bf16, bf16),
                                    dev, AttentionConfig()), dev)
    b = "*bf16"
    pointers = dict(qkv_ptr=b, pos_ptr=I64, qw_ptr=b, kw_ptr=b, iqw_ptr=b, ikw_ptr=b,
                    rope_ptr=F32, k_cache_ptr=b, v_cache_ptr=b, slot_ptr=I64,
                    index_cache_ptr="*fp8e4nv", index_slot_ptr=I64, k_scale_ptr=F32,
                    v_scale_ptr=F32, q_ptr=b, iq_ptr="*fp8e4nv", cu_ptr=I32, seq_lens_ptr=I32,
                    ibt_ptr=I32, bt_ptr=I32, scores_ptr=F32, idx_ptr=I32, cand_ptr=I64,
                    scratch_ptr=I64, out_ptr=b, part_ptr=F32, counters_ptr=I32)
    params = dict(launch.params)
    options = dict(num_warps=params.pop("num_warps"), num_stages=params.pop("num_stages"))
    # the launcher specializes an int argument of 1 as a constexpr: the counts of a B = 1 step
    ones = dict(num_tokens=batch, num_requests=batch, num_segments=sizes["segments"])
    params.update({k: 1 for k, v in ones.items() if v == 1})
    # (B = 1 at 32K: with a trace, whose timestamps are the GPU's global timer)
    traced = (batch, context) == (1, 32 * 1024)
    if traced:
        pointers["trace_ptr"] = I64
    else:
        params["trace_ptr"] = None
    k = compile_sm90(_decode_step_kernel, pointers, dict(eps="fp32", sm_scale="fp32"), params,
                     options=options)
    ptx = k.asm["ptx"]
    # the phases' hand-off: release adds after the stores; thread 0's acquire loads, with a
    # pause between polls
    assert "atom.global.gpu.release.add" in ptx and "ld.acquire.gpu.global.b32" in ptx
    assert "nanosleep.u32" in ptx
    assert ("%globaltimer" in ptx) == traced
