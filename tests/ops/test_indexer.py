# SPDX-License-Identifier: Apache-2.0
"""The index branch (block_scores, select_blocks) by tier: the kernels against the reference on
the kernel device (`interpret`: the CPU through Triton's interpreter, or a GPU; tiny shapes),
the H200 tier (`gpu`: M3 shapes, 1M-token contexts, caches past 2^31 bytes, the Gluon
kernels, CUDA-graph replay) and, with no GPU, the kernels compiled for sm_90 and the host side
of the op (`reference`). The launch rules themselves are tests/plans/test_indexer_plan.py's."""

import dataclasses
import importlib.util
import os

import pytest
import torch

import openmsa
from openmsa import reference as ref
from openmsa.batch import token_layout
from openmsa.ops.common.plan import DeviceFacts
from openmsa.ops.indexer import api as indexer_api
from openmsa.ops.indexer import reference as indexer_ref
from openmsa.ops.indexer.plan import DEFAULT, SMALL_Q, IndexerShape, plan, selection_plan
from helpers import (assert_selection_near_optimal, compact_pages, cuda_step, make_step,
                     nan_poison, random_index_inputs)

FP8 = torch.float8_e4m3fn
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

B = 16
# decode, 3-token verify, q_len 0, a 20-token prefill chunk (the prefill launch), decode in the
# first block, seq_len 0, and 2 padding tokens after cu_seqlens_q[R]
Q_LENS = [1, 3, 0, 20, 1, 0]
SEQ_LENS = [70, 45, 9, 100, 5, 0]
FNUZ = torch.float8_e4m3fnuz
# AMD gfx942's fp8 (e4m3fnuz): on the interpreter and ROCm only (NVIDIA GPUs have no fnuz)
ON_FNUZ = pytest.mark.skipif(torch.cuda.is_available() and torch.version.hip is None,
                             reason="e4m3fnuz is AMD gfx942's fp8; NVIDIA GPUs have none")
# (bf16 under the interpreter too: its casts and bf16 dots are the GPU's, openmsa._interpreter)
INDEX_DTYPES = [(torch.float16, torch.float16), (torch.float16, FP8), (FP8, FP8),
                (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                (torch.bfloat16, FP8),
                pytest.param(torch.float16, FNUZ, marks=ON_FNUZ, id="float16-fnuz"),
                pytest.param(FNUZ, FNUZ, marks=ON_FNUZ, id="fnuz-fnuz")]


def _config(**knobs):
    """DEFAULT with knobs (a form's name takes a dict of its fields: IndexerConfig.replace)."""
    return DEFAULT.replace(**knobs)


def _to(step, device):
    for name in ("cu_seqlens_q", "seq_lens", "block_table", "slot_mapping"):
        setattr(step, name, getattr(step, name).to(device))
    return step


def _index_case(device, q_dtype, c_dtype, integer, heads=2, dim=32, seed=0):
    step = make_step(Q_LENS, SEQ_LENS, block_size=B, extra_columns=2, pad_tokens=2,
                     generator=torch.Generator().manual_seed(seed))
    q, c = random_index_inputs(step, num_heads=heads, head_dim=dim, block_size=B, q_dtype=q_dtype,
                               cache_dtype=c_dtype, integer=integer,
                               generator=torch.Generator().manual_seed(seed + 1))
    return step, q, c, _to(make_step(Q_LENS, SEQ_LENS, block_size=B, extra_columns=2,
                                     pad_tokens=2, generator=torch.Generator().manual_seed(seed)),
                           device)


def _request_launch(q, c, cu, seq, table, block_size=128):
    """The decode launch's name for these arguments: the Gluon NVFP4 one on Hopper for an fp8
    or fp16 query against NVFP4 pages, the Triton one otherwise."""
    from openmsa.ops.indexer.plan import nvfp4_decode_eligible
    shape = indexer_api._shape(q, c, seq, table, block_size, None)
    return ("scores_decode_nvfp4" if nvfp4_decode_eligible(shape, DeviceFacts.of(q.device))
            else "scores_decode")


def _scoring_launches(q, c, cu, seq, table, block_size, max_q_len=None, config=DEFAULT):
    """The scoring launches select_blocks makes for these arguments (its plan)."""
    shape = indexer_api._shape(q, c, seq, table, block_size, max_q_len)
    return [k for k in plan(shape, DeviceFacts.of(q.device), config).kernels()
            if k.startswith("scores_")]


@pytest.mark.interpret
@pytest.mark.parametrize("q_dtype, c_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("topk, init, local, segment", [(4, 0, 1, None), (3, 1, 1, 4)])
def test_select_exact_on_integer_inputs(kernel_device, q_dtype, c_dtype, topk, init, local,
                                        segment):
    """Integer-valued inputs: exact dot products on both sides and many tied blocks, so the
    indices must agree exactly, tie rule included. `segment` cuts score rows into several
    selection programs, so the merge launch runs too."""
    config = _config(**({} if segment is None else dict(select=dict(segment=segment))))
    step, q, c, dstep = _index_case(kernel_device, q_dtype, c_dtype, integer=True)
    args = (step.cu_seqlens_q, step.seq_lens, step.block_table)
    dargs = (dstep.cu_seqlens_q, dstep.seq_lens, dstep.block_table)
    want = ref.select_blocks(q, c, *args, topk=topk, init_blocks=init, local_blocks=local,
                             block_size=B)
    got = openmsa.select_blocks(q.to(kernel_device), c.to(kernel_device), *dargs, topk=topk,
                                init_blocks=init, local_blocks=local, block_size=B,
                                config=config)
    assert torch.equal(got.cpu(), want)
    s_want = ref.block_scores(q, c, *args, block_size=B)
    s_got = openmsa.block_scores(q.to(kernel_device), c.to(kernel_device), *dargs, block_size=B,
                                 config=config)
    assert torch.equal(s_got.cpu(), s_want)


@pytest.mark.interpret
@pytest.mark.parametrize("q_dtype, c_dtype", INDEX_DTYPES[:2])
def test_select_on_random_floats_meets_threshold(kernel_device, q_dtype, c_dtype):
    """Random floats: rounding may reorder near-equal blocks, so check that every selected block
    scores at least the K-th best (by the reference's scores) minus a rounding margin."""
    step, q, c, dstep = _index_case(kernel_device, q_dtype, c_dtype, integer=False, seed=4)
    topk = 4
    got = openmsa.select_blocks(q.to(kernel_device), c.to(kernel_device), dstep.cu_seqlens_q,
                                dstep.seq_lens, dstep.block_table, topk=topk,
                                block_size=B).cpu()
    scores = ref.block_scores(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table,
                              block_size=B)
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    assert_selection_near_optimal(got, scores, pos, topk=topk, init_blocks=0, local_blocks=1,
                                  block_size=B, rtol=1e-2)


# scores that stress the threshold search: signed zeros, infinities, NaN, subnormals, the
# extremes of fp32, and values equal in all but the last mantissa bit
CRAFTED = [float("-inf"), float("inf"), float("nan"), -0.0, 0.0, 1e-45, -1e-45, 3.4e38, -3.4e38,
           1.0, 1.0000001, -1.0, -1.0000001, 2.0, 2.0]


@pytest.mark.interpret
@pytest.mark.parametrize("by_sort, group_bound", [(False, True), (False, False), (True, False)])
@pytest.mark.parametrize("topk, init, local, segment", [(4, 0, 1, None), (5, 1, 2, 8),
                                                        (16, 0, 1, None), (1, 0, 1, None),
                                                        (1, 0, 0, 8)])
def test_selection_kernels_on_crafted_scores(kernel_device, topk, init, local, segment, by_sort,
                                             group_bound):
    """The selection launches alone on score rows drawn from CRAFTED (many exact ties, all-equal
    rows, all -inf rows, rows shorter and longer than topk, one segment or several), equal to
    the reference selection from the same scores; every path (threshold search per segment, or
    for rows of several segments the group-bound path, and the bitonic sort, whose rows of
    several segments the merge launch merges). topk = 1: the kernels' K width is 2 (tl.topk
    and tl.sort take no width of 1), of which one slot is written."""
    config = _config(select=dict(sort_waves=10**9 if by_sort else 0,
                                 **({} if segment is None else dict(segment=segment))),
                     # (the group-bound path on short rows too, or on none)
                     group=dict(min_blocks=0 if group_bound else 1 << 30))
    g = torch.Generator().manual_seed(topk)
    q_lens, seq_lens = [1, 1, 1, 1, 3, 40, 1], [700, 53, 16 * 2 + 1, 400, 260, 90, 1000]
    step = make_step(q_lens, seq_lens, block_size=B, pad_tokens=1)
    width = step.block_table.shape[1]
    palette = torch.tensor(CRAFTED)
    scores = palette[torch.randint(len(CRAFTED), (step.num_tokens, 3, width), generator=g)]
    scores[0, 0] = 2.0  # one value everywhere: the bounds agree, the tie rule decides
    scores[0, 1] = float("-inf")
    scores[1, 2] = float("nan")
    scores[2, 0, ::3] = 3.4e38  # more top keys than topk, spread over segments
    _check_selection_launch(kernel_device, step, scores, topk, init, local, config)


@pytest.mark.interpret
@pytest.mark.parametrize("chunk, segment, group_bound", [(0, None, False), (128, None, False),
                                                        (256, 512, False), (0, None, True),
                                                        (0, 512, True)])
@pytest.mark.parametrize("topk, init", [(16, 0), (5, 2), (64, 3), (1, 0)])
def test_selection_scratch_path(kernel_device, topk, init, chunk, segment, group_bound):
    """Rows of 1000 blocks make 1024-wide segments (or two of 512, merged), where the threshold
    path first packs the keys that can be picked into a scratch row: distinct random scores take
    it (with a run of equal top keys inside, and one row whose best keys sit in a few groups), a
    row of ties overflows it and searches the segment (on the group-bound path, taken here by
    rows of any length, a row of 400 equal top keys in 25 groups overflows its candidates'
    scratch row). `chunk`: the segment read in chunks (select_chunk), the overflow's search
    included."""
    config = _config(select=dict(sort_waves=0, chunk=chunk,
                                 chunk_min_waves=0,  # (a small launch)
                                 **({} if segment is None else dict(segment=segment))),
                     group=dict(min_blocks=0 if group_bound else 1 << 30))
    g = torch.Generator().manual_seed(topk)
    step = make_step([3, 1], [16 * 1000, 16 * 999 + 3], block_size=B, pad_tokens=1)
    scores = torch.randn(step.num_tokens, 2, step.block_table.shape[1], generator=g)
    scores[0, 0, 500:520] = 7.0
    # 25 groups of equal top keys: the group-bound path's candidates overflow its scratch row
    scores[0, 1, :400] = 5.0
    scores[1, 0, :] = 1.0
    scores[1, 1, 40:60] = 9.0 + torch.arange(20.0)
    scores[2, 1] = scores[2, 1].round()
    _check_selection_launch(kernel_device, step, scores, topk, init, 1, config)


def _check_selection_launch(kernel_device, step, scores, topk, init, local, config=DEFAULT):
    """launch_select on `scores` equals the reference selection from the same scores."""
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    want = indexer_ref.select_from_scores(scores, pos, topk=topk, init_blocks=init,
                                          local_blocks=local, block_size=B)
    d = _to(step, kernel_device)
    out = nan_poison((*scores.shape[:2], topk), torch.int32, kernel_device)
    indexer_api.launch_select(scores.to(kernel_device), d.cu_seqlens_q, d.seq_lens, out,
                              topk=topk, init_blocks=init, local_blocks=local, block_size=B,
                              config=config)
    assert torch.equal(out.cpu(), want)


@pytest.mark.interpret
def test_strided_out_is_written_in_place(kernel_device):
    step, q, c, dstep = _index_case(kernel_device, torch.float16, torch.float16, integer=True)
    buf = nan_poison((2, step.num_tokens, 4), torch.int32, kernel_device)
    out = buf.transpose(0, 1)
    res = openmsa.select_blocks(q.to(kernel_device), c.to(kernel_device), dstep.cu_seqlens_q,
                                dstep.seq_lens, dstep.block_table, topk=4, block_size=B, out=out)
    assert res.data_ptr() == out.data_ptr() and not (buf == -7).any()
    want = ref.select_blocks(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=4,
                             block_size=B)
    assert torch.equal(out.cpu(), want)
    sbuf = nan_poison((step.block_table.shape[1], step.num_tokens, 2), torch.float32,
                      kernel_device)
    openmsa.block_scores(q.to(kernel_device), c.to(kernel_device), dstep.cu_seqlens_q,
                         dstep.seq_lens, dstep.block_table, block_size=B,
                         out=sbuf.permute(1, 2, 0))
    assert torch.equal(sbuf.permute(1, 2, 0).cpu(),
                       ref.block_scores(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table,
                                        block_size=B))


@pytest.mark.interpret
@pytest.mark.parametrize("knobs", [dict(),
                                   # 2 tiles (the last one holds the chunk's last tokens)
                                   # x 4 splits
                                   dict(prefill=dict(rows=32, bps=2))])
@pytest.mark.parametrize("q_dtype, c_dtype", [(torch.float16, torch.float16), (FP8, FP8)])
def test_decode_and_tile_launches_exact(kernel_device, q_dtype, c_dtype, knobs):
    """The decode launch (page ids loaded up front, one causal loop) and the prefill launch (its
    last tile first; the 20-token request takes it) keep the reference's exact scores and
    selection. The table's entries past each request's blocks hold page ids far outside the
    cache: the decode launch loads them (masked by the table's width, not the request's
    length) and must never read the keys they point to (on the GPU such a read faults)."""
    config = _config(**knobs)
    step, q, c, dstep = _index_case(kernel_device, q_dtype, c_dtype, integer=True, seed=5)
    table = step.block_table.clone()
    for r, seq_len in enumerate(SEQ_LENS):
        table[r, -(-seq_len // B):] = 1 << 30
    args = (step.cu_seqlens_q, step.seq_lens, table)
    dargs = (dstep.cu_seqlens_q, dstep.seq_lens, table.to(kernel_device))
    s_want = ref.block_scores(q, c, *args, block_size=B)
    s_got = openmsa.block_scores(q.to(kernel_device), c.to(kernel_device), *dargs, block_size=B,
                                 config=config)
    assert torch.equal(s_got.cpu(), s_want)
    want = ref.select_blocks(q, c, *args, topk=4, block_size=B)
    got = openmsa.select_blocks(q.to(kernel_device), c.to(kernel_device), *dargs, topk=4,
                                block_size=B, config=config)
    assert torch.equal(got.cpu(), want)


@pytest.mark.interpret
@pytest.mark.parametrize("q_lens", [[3, 1, 4, 2, 3, 1, 4, 3],  # verify, 21 tokens: no long one
                                    [1] + [0] * 20 + [17, 2]])  # a long one after 20 empty ones
def test_steps_of_more_than_small_q_tokens(kernel_device, q_lens):
    """A step of more than SMALL_Q tokens also runs the prefill launch: with no long request its
    programs end after one look at their requests, which must not skip a long request standing
    after more requests than that look covers (8-token tiles here, so the look spans 16
    requests)."""
    config = _config(prefill=dict(rows=16))
    seq_lens = [max(q, 1) * 9 + 5 for q in q_lens]

    def step_on(device):
        st = make_step(q_lens, seq_lens, block_size=B, extra_columns=1, pad_tokens=3,
                       generator=torch.Generator().manual_seed(11))
        return _to(st, device) if device is not None else st
    step = step_on(None)
    q, c = random_index_inputs(step, num_heads=2, head_dim=32, block_size=B,
                               q_dtype=torch.float16, cache_dtype=torch.float16, integer=True,
                               generator=torch.Generator().manual_seed(12))
    d = step_on(kernel_device)
    args = (step.cu_seqlens_q, step.seq_lens, step.block_table)
    dargs = (d.cu_seqlens_q, d.seq_lens, d.block_table)
    assert step.num_tokens > SMALL_Q
    s_want = ref.block_scores(q, c, *args, block_size=B)
    s_got = openmsa.block_scores(q.to(kernel_device), c.to(kernel_device), *dargs, block_size=B,
                                 config=config)
    assert torch.equal(s_got.cpu(), s_want)
    want = ref.select_blocks(q, c, *args, topk=4, block_size=B)
    got = openmsa.select_blocks(q.to(kernel_device), c.to(kernel_device), *dargs, topk=4,
                                block_size=B, config=config)
    assert torch.equal(got.cpu(), want)


@pytest.mark.interpret
@pytest.mark.parametrize("q_lens, hint, launches", [
    ([3, 1, 4, 2, 3, 1, 4, 3], 4, 1),  # a verify step of 21 tokens, hint right: one launch
    ([3, 1, 4, 2, 3, 1, 4, 3], None, 2),  # no hint: the prefill launch runs too
    ([1, 3, 20, 1], 1, 1),  # hint wrong (a 20-token chunk): still exact, by the decode launch
    ([1, 3, 20, 1], 20, 2)])
def test_max_q_len_hint(kernel_device, q_lens, hint, launches):
    """max_q_len <= 16 makes a step of more than 16 tokens one scoring launch; it is a speed hint
    only: with a request longer than the hint the scores and the selection stay exact."""
    seq_lens = [q * 9 + 5 for q in q_lens]

    def step_on(device):
        st = make_step(q_lens, seq_lens, block_size=B, extra_columns=1, pad_tokens=2,
                       generator=torch.Generator().manual_seed(21))
        return _to(st, device) if device is not None else st
    step = step_on(None)
    q, c = random_index_inputs(step, num_heads=2, head_dim=32, block_size=B,
                               q_dtype=torch.float16, cache_dtype=torch.float16, integer=True,
                               generator=torch.Generator().manual_seed(22))
    d = step_on(kernel_device)
    args = (step.cu_seqlens_q, step.seq_lens, step.block_table)
    dargs = (d.cu_seqlens_q, d.seq_lens, d.block_table)
    qd, cd = q.to(kernel_device), c.to(kernel_device)
    # (a GPU with the Gluon prefill launch plans its Triton form beside it: one of the two runs)
    assert len([k for k in _scoring_launches(qd, cd, *dargs, B, hint)
                if k != "scores_prefill_unaligned"]) == launches
    s_got = openmsa.block_scores(qd, cd, *dargs, block_size=B, max_q_len=hint)
    assert torch.equal(s_got.cpu(), ref.block_scores(q, c, *args, block_size=B))
    got = openmsa.select_blocks(qd, cd, *dargs, topk=4, block_size=B, max_q_len=hint)
    assert torch.equal(got.cpu(), ref.select_blocks(q, c, *args, topk=4, block_size=B))


@pytest.mark.interpret
def test_select_is_deterministic(kernel_device):
    _, q, c, dstep = _index_case(kernel_device, torch.float16, torch.float16, integer=False)
    args = (q.to(kernel_device), c.to(kernel_device), dstep.cu_seqlens_q, dstep.seq_lens,
            dstep.block_table)
    a = openmsa.select_blocks(*args, topk=4, block_size=B)
    b = openmsa.select_blocks(*args, topk=4, block_size=B)
    assert torch.equal(a, b)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float16, FP8])
def test_nan_keys_and_unfilled_pages_match_reference(kernel_device, dtype):
    """NaN index keys rank as -inf (the block's other keys still count) and a negative page id in
    the block table reads nothing, in the kernels exactly as in the reference (fp8: e4m3's NaN
    is S.1111.111, which the interpreter read as +-480 before openmsa replaced its casts)."""
    step, q, c, dstep = _index_case(kernel_device, dtype, dtype, integer=True)
    c = c.clone()
    c[int(step.block_table[0, 1]), :5] = float("nan")  # part of a page request 0 reads
    c[int(step.block_table[3, 0])] = float("nan")  # a whole page of request 3
    # part of a page of request 3 (a 20-token chunk: the prefill prefill launch), including its last
    # key, so that the block's max must come from the other keys
    c[int(step.block_table[3, 1]), 9:] = float("nan")
    table = step.block_table.clone()
    table[3, 2] = -1  # an unfilled entry inside request 3's blocks
    args = (step.cu_seqlens_q, step.seq_lens, table)
    dargs = (dstep.cu_seqlens_q, dstep.seq_lens, table.to(kernel_device))
    want = ref.block_scores(q, c, *args, block_size=B)
    got = openmsa.block_scores(q.to(kernel_device), c.to(kernel_device), *dargs, block_size=B)
    assert not want.isnan().any() and torch.equal(got.cpu(), want)
    want = ref.select_blocks(q, c, *args, topk=4, block_size=B)
    got = openmsa.select_blocks(q.to(kernel_device), c.to(kernel_device), *dargs, topk=4,
                                block_size=B)
    assert torch.equal(got.cpu(), want)


@pytest.mark.interpret
def test_plans_are_cached_by_call(kernel_device):
    """The op's cached launch plans (ops/common/launch.py's PlanCache): a repeated call reuses
    its plan; another config, selection option or hint makes a new one, and every call matches
    the reference."""
    step = make_step(Q_LENS, SEQ_LENS, block_size=B, extra_columns=2, pad_tokens=2)
    dstep = _to(make_step(Q_LENS, SEQ_LENS, block_size=B, extra_columns=2, pad_tokens=2),
                kernel_device)
    iq, ic = random_index_inputs(step, num_heads=2, head_dim=16, block_size=B,
                                 q_dtype=torch.float16, cache_dtype=torch.float16, integer=True)
    iargs = (iq.to(kernel_device), ic.to(kernel_device), dstep.cu_seqlens_q, dstep.seq_lens,
             dstep.block_table)
    plans = []
    for topk, hint, config in ((4, None, None), (4, None, None), (3, None, None), (4, 32, None),
                               (4, None, _config(select=dict(segment=4))), (4, None, DEFAULT)):
        got = openmsa.select_blocks(*iargs, topk=topk, block_size=B, max_q_len=hint,
                                    config=config)
        assert torch.equal(got.cpu(), ref.select_blocks(
            iq, ic, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=topk,
            block_size=B))
        key = indexer_api._call_key("select", *iargs, None, B, hint, topk, 0, 1,
                                    config or DEFAULT)
        plans.append(indexer_api._PLANS._plans.get(key))
    assert all(p is not None for p in plans)
    # the same call twice, and config None as DEFAULT: one plan; the rest: one each
    assert plans[0] is plans[1] is plans[5]
    assert len({id(p) for p in plans}) == 4


@pytest.mark.reference
@pytest.mark.parametrize("phase", ["scores", "selection"])
def test_unknown_launch_names_raise(phase):
    """api.py runs a plan through tables from launch name to runner: a launch no table knows (a
    plan and its runners out of step) is an error, never skipped; each phase passes over the
    other's launches."""
    from openmsa.ops.common.plan import Launch, LaunchPlan
    q = torch.zeros(1, 1, 16)
    cu, seq = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    table, scores = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, 1)
    out = torch.zeros(1, 1, 1, dtype=torch.int32)
    other = "select_segments" if phase == "scores" else "scores_decode"
    bogus = LaunchPlan((Launch(other, (1,)), Launch("scores_typo", (1,))), dict(segments=1))
    with pytest.raises(ValueError, match="scores_typo"):
        if phase == "scores":
            indexer_api._run_scores(bogus, q, torch.zeros(1, 16, 16), cu, seq, table, scores)
        else:
            indexer_api._run_selection(bogus, scores, cu, seq, out)


@pytest.mark.reference
def test_config_is_checked():
    q = torch.zeros(1, 1, 16)
    args = (q, torch.zeros(1, 16, 16), torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32))
    for op in (openmsa.block_scores, openmsa.select_blocks):
        with pytest.raises(TypeError, match="config"):
            op(*args, block_size=16, config=dict(select=dict(segment=4)))


@pytest.mark.reference
@pytest.mark.parametrize("case, want", [("flat", True), ("q_slice", False),
                                        ("page_padding", False), ("q_transposed", False)])
def test_shape_says_where_tma_rows_fit(case, want):
    """api.py's step shape: q as [T * H, DI] rows and the cache as [pages * BLOCK, DI] rows,
    each one strided 2-D array (what the Gluon prefill launch's TMA descriptors take); tma_q: q's
    alone (the staged NVFP4 form's, whose staging cache always is)."""
    q = torch.empty(64, 8 if case == "q_slice" else 4, 128, device="meta")
    if case == "q_slice":
        q = q[:, :4]
    if case == "q_transposed":
        q = torch.empty(4, 64, 128, device="meta").transpose(0, 1)
    c = torch.empty(10, 130 if case == "page_padding" else 128, 128, device="meta")[:, :128]
    seq, table = torch.empty(2, dtype=torch.int32), torch.empty(2, 7, dtype=torch.int32)
    shape = indexer_api._shape(q, c, seq, table, 128, 4, 16, 1, 2)
    assert shape == IndexerShape(num_tokens=64, num_heads=4, head_dim=128, num_requests=2,
                                 max_blocks=7, block_size=128, q_dtype=q.dtype,
                                 cache_dtype=c.dtype, max_q_len=4, tma_rows=want, topk=16,
                                 init_blocks=1, local_blocks=2,
                                 tma_q=case in ("flat", "page_padding"))


@pytest.mark.reference
@pytest.mark.parametrize("dtype, heads", [(FP8, 4), (torch.bfloat16, 1)])
def test_gluon_launch_descriptors(dtype, heads):
    """The Gluon launch's host side: q as [T * H, Di] rows in 64-row boxes, the cache as
    [P * B, Di] rows in one-block boxes; the split size a keyword of the plan's launch."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    q = torch.zeros(100, heads, 128, dtype=dtype)
    cache = torch.zeros(10, 128, 128, dtype=dtype)
    q_desc, k_desc = indexer_api._gluon_descriptors(q, cache)
    assert (list(q_desc.shape), list(q_desc.strides), list(q_desc.block_shape)) == \
        ([100 * heads, 128], [128, 1], [64, 128])
    assert (list(k_desc.shape), list(k_desc.strides), list(k_desc.block_shape)) == \
        ([1280, 128], [128, 1], [128, 128])
    shape = IndexerShape(num_tokens=100, num_heads=heads, head_dim=128, num_requests=2,
                         max_blocks=7, block_size=128, q_dtype=dtype, cache_dtype=dtype,
                         tma_rows=True)
    gluon = plan(shape, DeviceFacts()).find("scores_prefill_gluon")
    # 7 blocks: one split of a whole 8-block sector
    assert gluon.params["bps"] == 8 and gluon.params["H"] == heads


def _compile(fn, pointers, scalars, constexprs, gluon=False, options=None, attrs=None):
    from helpers.sm90 import compile_sm90
    return compile_sm90(fn, pointers, scalars, constexprs, gluon=gluon, attrs=attrs,
                        options=options)


compiled = pytest.mark.skipif(INTERPRET, reason="compilation needs the real compiler")
I32, I64, F32 = "*i32", "*i64", "*fp32"
STEP = dict(cu_ptr=I32, seq_lens_ptr=I32, bt_ptr=I32)


@pytest.mark.reference
@compiled
@pytest.mark.parametrize("tile_mode, q_type, c_type", [(False, "*fp8e4nv", "*fp8e4nv"),
                                                       (True, "*fp8e4nv", "*fp8e4nv"),
                                                       (False, "*bf16", "*fp8e4nv"),
                                                       (True, "*bf16", "*bf16")])
def test_block_scores_kernel_compiles(tile_mode, q_type, c_type):
    # the decode launch (page ids up front, one causal loop) and the prefill launch (quick exit,
    # last tile first) with the constexprs plan.py passes; neither waits for the launch before
    # it (griddepcontrol.wait): only the selection after them does
    from openmsa.ops.indexer.kernels.scores import _block_scores_kernel
    k = _compile(_block_scores_kernel, dict(q_ptr=q_type, cache_ptr=c_type, out_ptr=F32, **STEP),
                 {}, dict(H=4, HP=4, DI=128, DIP=128, BLOCK=128, BPS=32 if tile_mode else 16,
                          SMALL_Q=16, TILE_MODE=tile_mode, ROWS_T=32 if tile_mode else 4,
                          CAST_K=q_type != c_type, IEEE=False, KEYS_AS_ROWS=not tile_mode,
                          MAX_SKIPS_NAN=True, PDL=True))
    ptx = k.asm["ptx"]
    assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" not in ptx


@pytest.mark.reference
@compiled
@pytest.mark.parametrize("dim", [16, 24])
def test_block_scores_kernel_compiles_for_short_fp8_index_dims(dim):
    # fp8 x fp8 tensor-core dots need K >= 32: the plan pads an index head dim under 32 up to
    # it (with 16, sm_90's compile failed: "Input shapes should have ... K >= 32")
    from openmsa.ops.indexer.kernels.scores import _block_scores_kernel
    fp8 = torch.float8_e4m3fn
    shape = IndexerShape(num_tokens=40, num_heads=4, head_dim=dim, num_requests=3, max_blocks=64,
                         block_size=128, q_dtype=fp8, cache_dtype=fp8, tma_rows=False)
    names = {p.name for p in _block_scores_kernel.params if p.is_constexpr}
    launches = [launch for launch in plan(shape, DeviceFacts(gluon_hopper=False))
                if launch.kernel in ("scores_decode", "scores_prefill")]
    assert {launch.kernel for launch in launches} == {"scores_decode", "scores_prefill"}
    for launch in launches:
        params = dict(launch.params)
        _compile(_block_scores_kernel, dict(q_ptr="*fp8e4nv", cache_ptr="*fp8e4nv",
                                            out_ptr=F32, **STEP), {},
                 {k: v for k, v in params.items() if k in names},
                 options=dict(num_warps=params["num_warps"], num_stages=params["num_stages"]))


@pytest.mark.reference
@compiled
@pytest.mark.parametrize("dtype, heads", [("fp8e4nv", 4), ("fp8e4nv", 1), ("bf16", 4)])
def test_block_scores_gluon_kernel_compiles(dtype, heads):
    # the Gluon prefill launch (scores_gluon.py) with the constexprs plan.py passes: warp
    # specialisation, TMA and wgmma lower for sm_90, its shared memory fits one program per SM,
    # and it waits for the decode launch only at its end
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    from openmsa.ops.indexer.kernels.scores_gluon import _block_scores_gluon_kernel as fn
    gdt = gl.float8e4nv if dtype == "fp8e4nv" else gl.bfloat16

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, 128], gdt)
        return f"tensordesc<{dtype}[{rows}, 128],{layout!r}>"
    shape = IndexerShape(num_tokens=8192, num_heads=heads, head_dim=128, num_requests=2,
                         max_blocks=1024, block_size=128, q_dtype=FP8 if dtype == "fp8e4nv"
                         else torch.bfloat16, cache_dtype=FP8 if dtype == "fp8e4nv"
                         else torch.bfloat16, tma_rows=True)
    params = dict(plan(shape, DeviceFacts()).find("scores_prefill_gluon").params)
    del params["bps"], params["launch_pdl"]
    k = _compile(fn, dict(q_desc=desc(64), k_desc=desc(128), out_ptr=F32, **STEP), {}, params,
                 gluon=True, options=dict(num_warps=4))
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx
    assert k.metadata.shared <= 227 * 1024
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


@pytest.mark.reference
@compiled
@pytest.mark.parametrize("g, w, vec, tpr, warps, sort", [
    (16, 4, 4, 4, 1, 0), (16, 4, 4, 4, 1, 1), (16, 4, 4, 8, 1, 1), (16, 4, 4, 1, 1, 0),
    (16, 1, 4, 2, 2, 1), (8, 1, 1, 4, 1, 0), (8, 2, 1, 16, 1, 1), (64, 1, 4, 4, 1, 0),
    (16, 8, 4, 8, 1, 1), (16, 64, 4, 32, 1, 0)])
def test_short_rows_topk_kernel_compiles(g, w, vec, tpr, warps, sort):
    # the selection with a row in tpr threads (indexer/select_rows.py): a row's counts cross
    # only its threads (no shared memory with one warp, shuffles only with tpr > 1 or several
    # warps), no spills, the counts' comparisons as PTX `set`; with VEC = 4 on 16-divisible
    # strides (what Triton specialises at launch), 16-byte loads; the scores read only after
    # the scoring launch (a programmatic dependent)
    import re
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")

    from openmsa.ops.indexer.kernels.select_rows import _short_rows_topk_kernel as fn
    constexprs = dict(H=4, TOPK=min(16, g * w), KP=16, INIT=0, LOCAL=1, BLOCK=128, G=g, W=w,
                      VEC=vec, TPR=tpr, SORT=sort, num_warps=warps, stride_sb=1)
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
               for n in ("scores_ptr", "out_ptr", "stride_st", "stride_sh")}
    k = _compile(fn, dict(scores_ptr=F32, out_ptr=I32, cu_ptr=I32, seq_lens_ptr=I32), {},
                 constexprs, gluon=True, options=dict(num_warps=warps), attrs=aligned)
    ptx = k.asm["ptx"]
    assert "griddepcontrol.wait" in ptx
    # (several warps share one search loop: only its "any row still searching" crosses them)
    assert k.metadata.shared <= 4 * (warps - 1) * 2 and "ld.local" not in ptx
    assert ("shfl" in ptx) == (warps > 1 or tpr > 1)
    # (counts: 1.0 / 0.0 per compare, a float sum)
    assert "set.ge.f32.f32" in ptx and "set.gt.f32.f32" in ptx
    loads = re.findall(r"ld\.global[.a-z0-9]*", ptx)
    assert sum(".v4" in op for op in loads) == (g * w // tpr // 4 if vec == 4 else 0)


@pytest.mark.reference
@compiled
@pytest.mark.parametrize("by_sort", [False, True])
def test_selection_kernels_compile(by_sort):
    from openmsa.ops.indexer.kernels.select import (_group_bound_select_kernel,
                                                    _group_max_kernel, _merge_topk_kernel,
                                                    _segment_topk_kernel)
    for single in (False, True):
        for cap, chunk in ((0, 0), (64, 0), (64, 128)):  # chunk: select_chunk
            _compile(_segment_topk_kernel, dict(scores_ptr=F32, cu_ptr=I32, seq_lens_ptr=I32,
                                                out_ptr=I32, cand_ptr=I64, scratch_ptr=I64), {},
                     dict(TOPK=16, KP=16, INIT=0, LOCAL=1, BLOCK=128, SEG=1024, SINGLE=single,
                          BY_SORT=by_sort, CAP=cap, NG=64, PDL=single, CH=chunk))
    merge = _compile(_merge_topk_kernel, dict(cand_ptr=I64, cu_ptr=I32, seq_lens_ptr=I32,
                                              out_ptr=I32), {},
                     dict(TOPK=16, KP=16, BLOCK=128, SEG=1024, CANDP=128, BY_SORT=by_sort,
                          PDL=by_sort))
    # a dependent launch waits for its predecessor before reading (and only then)
    assert ("griddepcontrol.wait" in merge.asm["ptx"]) == by_sort
    # the group-bound path at 1M tokens: 512 groups of 16 blocks
    common = dict(TOPK=16, INIT=0, LOCAL=1, BLOCK=128, GS=16)
    _compile(_group_max_kernel, dict(scores_ptr=F32, gmax_ptr=I32, cu_ptr=I32,
                                     seq_lens_ptr=I32), {}, dict(**common, GB=64))
    _compile(_group_bound_select_kernel, dict(scores_ptr=F32, gmax_ptr=I32, out_ptr=I32,
                                              scratch_ptr=I64, cu_ptr=I32, seq_lens_ptr=I32), {},
             dict(**common, KP=16, NGP=512, CG=32, CAP=64, CH=128))


@pytest.mark.reference
@compiled
@pytest.mark.parametrize("topk, init, local", [(1, 0, 1), (1, 0, 0), (2, 1, 1)])
def test_selection_launches_of_small_topk_compile(topk, init, local):
    """Every selection launch the plans make at topk 1 and 2 on an H200 (and without the Gluon
    kernels) compiles for sm_90: the sort path, alone and merged, the threshold path with and
    without scratch and chunks, the group-bound path (its fallback's chunk no wider than its
    NGP groups' blocks) and select_rows.py's kernel, sorting and searching. At topk 1 the
    kernels' K width is 2 (tl.topk and tl.sort take no width of 1)."""
    from openmsa.ops.indexer.kernels.select import (_group_bound_select_kernel,
                                                    _group_max_kernel, _merge_topk_kernel,
                                                    _segment_topk_kernel)
    kernels = dict(select_segments=_segment_topk_kernel, select_merge=_merge_topk_kernel,
                   select_group_max=_group_max_kernel,
                   select_group_bound=_group_bound_select_kernel)
    if importlib.util.find_spec("triton.experimental.gluon.nvidia.hopper") is not None:
        from openmsa.ops.indexer.kernels.select_rows import _short_rows_topk_kernel
        kernels["select_short_rows"] = _short_rows_topk_kernel
    pointers = dict(scores_ptr=F32, out_ptr=I32, cand_ptr=I64, scratch_ptr=I64, gmax_ptr=I32,
                    cu_ptr=I32, seq_lens_ptr=I32)
    # (tokens, blocks, knobs): decode (sort, merged at 1M), prefill chunks (short rows, the
    # group-bound path, the threshold path on long rows with and without chunks), and the
    # group-bound path on rows of 60 blocks (4 groups)
    cases = [(1, 8192, {}), (1, 64, {}), (8192, 8, {}), (8192, 1000, {}), (8192, 8192, {}),
             (64, 8192, dict(select=dict(sort_waves=0))),
             (8192, 3000, dict(short_rows=dict(max_blocks=0))),
             (32, 8192, dict(select=dict(sort_waves=0), group=dict(min_blocks=1 << 30))),
             (8192, 60, dict(short_rows=dict(max_blocks=0), group=dict(min_blocks=0)))]
    seen = set()
    for facts in (DeviceFacts(), DeviceFacts(gluon_hopper=False)):
        for tokens, blocks, knobs in cases:
            shape = IndexerShape(num_tokens=tokens, num_heads=4, head_dim=128, num_requests=1,
                                 max_blocks=blocks, block_size=128, q_dtype=FP8,
                                 cache_dtype=FP8, topk=topk, init_blocks=init,
                                 local_blocks=local)
            for launch in selection_plan(shape, facts, _config(**knobs)):
                options = {k: v for k, v in launch.params.items()
                           if k in ("num_warps", "launch_pdl")}
                constexprs = {k: v for k, v in launch.params.items() if k not in options}
                if (launch.kernel, tuple(sorted(constexprs.items()))) in seen:
                    continue
                seen.add((launch.kernel, tuple(sorted(constexprs.items()))))
                gluon = launch.kernel == "select_short_rows"
                if gluon:
                    constexprs["num_warps"] = options["num_warps"]
                fn = kernels[launch.kernel]
                _compile(fn, {k: v for k, v in pointers.items() if k in fn.arg_names}, {},
                         constexprs, gluon=gluon, options=dict(num_warps=options["num_warps"]))
    assert {kernel for kernel, _ in seen} == set(kernels)


GB = 128  # the GPU tier's block size (M3's)


def _triton_tiles():
    """This GPU's facts without the Gluon kernels: the plan the Triton prefill launch and
    select.py's launches serve (other GPUs, another Triton)."""
    return dataclasses.replace(DeviceFacts.of(torch.device("cuda")), gluon_hopper=False)


def _scores_with(facts, q, c, cu, seq, table, max_q_len=None, config=DEFAULT):
    """block_scores through a plan for other device facts (api.py's own runner)."""
    p = plan(indexer_api._shape(q, c, seq, table, GB, max_q_len), facts, config)
    out = torch.full((*q.shape[:2], table.shape[1]), float("-inf"), device=q.device)
    indexer_api._run_scores(p, q, c, cu, seq, table, out)
    return out


def _select_with(facts, q, c, cu, seq, table, max_q_len=None, config=DEFAULT, topk=16):
    """select_blocks (init 0, local 1) through a plan for other device facts."""
    p = plan(indexer_api._shape(q, c, seq, table, GB, max_q_len, topk, 0, 1), facts, config)
    scores = torch.empty((*q.shape[:2], table.shape[1]), device=q.device)
    out = torch.empty((*q.shape[:2], topk), dtype=torch.int32, device=q.device)
    indexer_api._run_scores(p, q, c, cu, seq, table, scores)
    indexer_api._run_selection(p, scores, cu, seq, out)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype, c_dtype", [(FP8, FP8), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, FP8)])
def test_million_token_contexts_exact(q_dtype, c_dtype):
    """Decode and a 4-token verify at 1M and 300K tokens, a prefill chunk after 20K: exact."""
    q_lens, seq_lens = [1, 4, 600], [1 << 20, 300_001, 20_600]
    step = make_step(q_lens, seq_lens, block_size=GB, extra_columns=3)
    q, c = random_index_inputs(step, num_heads=4, head_dim=128, block_size=GB, q_dtype=q_dtype,
                               cache_dtype=c_dtype, integer=True)
    want = ref.select_blocks(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table,
                             block_size=GB)
    d = cuda_step(step)
    got = openmsa.select_blocks(q.cuda(), c.cuda(), d.cu_seqlens_q, d.seq_lens, d.block_table,
                                block_size=GB)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
def test_index_cache_over_2_31_bytes():
    pages = (1 << 31) // (GB * 128 * 2) + 64  # bf16 cache past 2^31 bytes
    cache = torch.empty(pages, GB, 128, dtype=torch.bfloat16, device="cuda")
    step = make_step([1, 3], [40 * GB, 30 * GB + 7], block_size=GB)
    # place every used page at the far end of the cache
    step.block_table = torch.where(step.block_table >= 0, step.block_table + pages - 200, -1)
    g = torch.Generator(device="cuda").manual_seed(0)
    cache[-200:] = torch.randint(-2, 3, (200, GB, 128), generator=g, device="cuda").bfloat16()
    q = torch.randint(-2, 3, (4, 4, 128), generator=g, device="cuda").bfloat16()
    small, table = compact_pages(cache, step)
    want = ref.select_blocks(q.cpu(), small, step.cu_seqlens_q, step.seq_lens, table,
                             block_size=GB)
    d = cuda_step(step)
    got = openmsa.select_blocks(q, cache, d.cu_seqlens_q, d.seq_lens, d.block_table,
                                block_size=GB)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("group_bound", [True, False])
def test_selection_of_million_token_rows(group_bound):
    """The selection alone on rows of up to 8192 blocks (a chunk after 1M tokens, and one after
    300K): the group-bound path (select.py) or the per-segment search, against the reference
    selection from the same scores; random scores with a run of equal top scores, a row of one
    value (the group-bound path's fallback) and a row whose best blocks share a few groups."""
    config = DEFAULT if group_bound else _config(group=dict(min_blocks=1 << 30))
    step = make_step([48, 20], [(1 << 20) + 48, 300_000 + 20], block_size=GB)
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(step.num_tokens, 4, step.block_table.shape[1], generator=g)
    scores[0, 0, 3000:3040] = 9.0
    scores[1, 1] = 0.5
    scores[2, 2, 100:140] = 20.0 + torch.arange(40.0)
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    want = indexer_ref.select_from_scores(scores, pos, topk=16, init_blocks=1, local_blocks=2,
                                          block_size=GB)
    d = cuda_step(step)
    out = torch.full((step.num_tokens, 4, 16), -7, dtype=torch.int32, device="cuda")
    indexer_api.launch_select(scores.cuda(), d.cu_seqlens_q, d.seq_lens, out, topk=16,
                              init_blocks=1, local_blocks=2, block_size=GB, config=config)
    assert torch.equal(out.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("c_dtype", [torch.bfloat16, FP8])
def test_prefill_random_floats_threshold(c_dtype):
    step = make_step([2048, 1], [2048 + 6000, 9000], block_size=GB)
    q, c = random_index_inputs(step, num_heads=4, head_dim=128, block_size=GB,
                               q_dtype=torch.bfloat16 if c_dtype != FP8 else FP8,
                               cache_dtype=c_dtype)
    d = cuda_step(step)
    got = openmsa.select_blocks(q.cuda(), c.cuda(), d.cu_seqlens_q, d.seq_lens, d.block_table,
                                block_size=GB).cpu()
    scores = ref.block_scores(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table,
                              block_size=GB)
    s_got = openmsa.block_scores(q.cuda(), c.cuda(), d.cu_seqlens_q, d.seq_lens, d.block_table,
                                 block_size=GB).cpu()
    assert torch.equal(s_got.isinf(), scores.isinf())
    fin = scores.isfinite()
    torch.testing.assert_close(s_got[fin], scores[fin], atol=2e-2, rtol=2e-2)
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    n = (pos.long() // GB + 1)[:, None]
    kth = torch.where(torch.arange(scores.shape[-1])[None, None, :] < n[..., None] - 1, scores,
                      float("-inf")).topk(15, dim=-1).values[..., -1]
    sel = torch.gather(scores, -1, got.long().clamp(min=0))
    own = got == (n[..., None] - 1)
    ok = own | (sel >= kth[..., None] - 0.05 * (1 + kth[..., None].abs()))
    assert ok.all()


# the Gluon program's forms by config: the default grid; one split per tile (gluon.waves 0), whose
# maxima are stored in two chunks, the last one partial; two waves with fewer key buffers
GLUON_FORMS = [{}, dict(gluon=dict(waves=0)),
               dict(gluon=dict(waves=2, stages_fp8=4, stages_16=2))]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, heads, form", [(FP8, 4, 0), (FP8, 1, 0), (FP8, 2, 0),
                                                (torch.bfloat16, 4, 0), (FP8, 4, 1),
                                                (FP8, 1, 1), (torch.bfloat16, 2, 1), (FP8, 4, 2),
                                                (FP8, 1, 2), (FP8, 8, 0), (FP8, 16, 2),
                                                (torch.bfloat16, 16, 0)])
def test_prefill_gluon_tile_launch_exact(dtype, heads, form):
    """The warp-specialised prefill launch (scores_gluon.py) against the reference and the Triton
    prefill launch, exactly (integer inputs): tiles spanning several requests (long and short),
    chunks with and without context and partial last blocks, NaN keys (part of a block, a whole
    page), an unfilled page id, padding tokens, a strided out=, and the Triton fallback for a
    base address TMA cannot take. The selection takes the group-bound path on every row."""
    config = _config(group=dict(min_blocks=0), **GLUON_FORMS[form])
    q_lens = [1, 70, 3, 300, 0, 20, 517, 1, 40]
    seq_lens = [900, 70, 45, 300 + 1000, 9, 20 + 128 * 3, 517 + 4000, 5, 40 + 127]
    step = make_step(q_lens, seq_lens, block_size=GB, extra_columns=3, pad_tokens=2)
    q, c = random_index_inputs(step, num_heads=heads, head_dim=128, block_size=GB,
                               q_dtype=dtype, cache_dtype=dtype, integer=True)
    c[int(step.block_table[3, 1]), 5:40] = float("nan")
    c[int(step.block_table[3, 4])] = float("nan")
    c[int(step.block_table[6, 7]), 120:] = float("nan")
    step.block_table[6, 3] = -1
    args = (step.cu_seqlens_q, step.seq_lens, step.block_table)
    d = cuda_step(step)
    dargs = (d.cu_seqlens_q, d.seq_lens, d.block_table)
    want = ref.block_scores(q, c, *args, block_size=GB)
    qd, cd = q.cuda(), c.cuda()
    # the path under test: the Gluon launch, on aligned bases (api.py's rule)
    assert "scores_prefill_gluon" in _scoring_launches(qd, cd, *dargs, GB, config=config)
    assert qd.data_ptr() % 16 == 0 and cd.data_ptr() % 16 == 0
    got = openmsa.block_scores(qd, cd, *dargs, block_size=GB, config=config)
    assert not want.isnan().any() and torch.equal(got.cpu(), want)
    out = torch.full((heads, want.shape[0], want.shape[2]), 7.0, device="cuda")
    openmsa.block_scores(qd, cd, *dargs, block_size=GB, out=out.transpose(0, 1), config=config)
    assert torch.equal(out.transpose(0, 1).cpu(), want)
    sel = ref.select_blocks(q, c, *args, block_size=GB)
    assert torch.equal(openmsa.select_blocks(qd, cd, *dargs, block_size=GB,
                                             config=config).cpu(), sel)
    # with the caller's max_q_len (a plan of its own; the same launches)
    hint = max(q_lens)
    assert torch.equal(openmsa.block_scores(qd, cd, *dargs, block_size=GB, max_q_len=hint,
                                            config=config), got)
    assert torch.equal(openmsa.select_blocks(qd, cd, *dargs, block_size=GB, max_q_len=hint,
                                             config=config).cpu(), sel)
    # the Triton prefill launch alone (another GPU's plan)
    assert torch.equal(_scores_with(_triton_tiles(), qd, cd, *dargs, config=config), got)
    # a base one element past a 16-byte boundary: the Triton prefill launch takes it
    shifted = torch.empty(qd.numel() + 1, dtype=qd.dtype, device="cuda")[1:].view(qd.shape)
    shifted.copy_(qd)
    assert shifted.data_ptr() % 16 != 0
    assert torch.equal(openmsa.block_scores(shifted, cd, *dargs, block_size=GB, config=config),
                       got)
    assert torch.equal(openmsa.select_blocks(shifted, cd, *dargs, block_size=GB,
                                             config=config).cpu(), sel)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP8, torch.bfloat16])
@pytest.mark.parametrize("q_len, seq_len, pad", [(5, 900, 30), (300, 1300, 0), (17, 17, 3),
                                                 (40, 30, 0)])
def test_one_request_step_tile_launch_only(dtype, q_len, seq_len, pad):
    """A step of one request and more than SMALL_Q tokens: the prefill launch alone scores it
    whatever its q_len (a short request among padding tokens, a long one, an invalid one with
    q_len > seq_len), exactly as the reference and as the two-launch plan of the same step
    with an empty request added, through the Gluon and the Triton prefill launches."""
    step = make_step([q_len], [seq_len], block_size=GB, extra_columns=2, pad_tokens=pad)
    q, c = random_index_inputs(step, num_heads=4, head_dim=128, block_size=GB, q_dtype=dtype,
                               cache_dtype=dtype, integer=True)
    args = (step.cu_seqlens_q, step.seq_lens, step.block_table)
    want = ref.block_scores(q, c, *args, block_size=GB)
    sel = ref.select_blocks(q, c, *args, block_size=GB)
    d = cuda_step(step)
    qd, cd = q.cuda(), c.cuda()
    dargs = (d.cu_seqlens_q, d.seq_lens, d.block_table)
    # an empty second request: the decode launch and the prefill launch
    two = (torch.cat([d.cu_seqlens_q, d.cu_seqlens_q[-1:]]),
           torch.cat([d.seq_lens, d.seq_lens.new_zeros(1)]),
           torch.cat([d.block_table, d.block_table[:1]]))
    assert "scores_decode" not in _scoring_launches(qd, cd, *dargs, GB)
    assert "scores_decode" in _scoring_launches(qd, cd, *two, GB)
    for facts in (DeviceFacts.of(qd.device), _triton_tiles()):
        for steps in (dargs, two):
            assert torch.equal(_scores_with(facts, qd, cd, *steps).cpu(), want)
            assert torch.equal(_select_with(facts, qd, cd, *steps).cpu(), sel)
    assert torch.equal(openmsa.block_scores(qd, cd, *dargs, block_size=GB).cpu(), want)
    assert torch.equal(openmsa.select_blocks(qd, cd, *dargs, block_size=GB).cpu(), sel)


@pytest.mark.gpu
@pytest.mark.parametrize("hint", [None, 4])
def test_select_deterministic_and_graph_replay(hint):
    """A fixed-shape decode step is captured once and replayed with new lengths and queries;
    with max_q_len = 4 (one scoring launch) also with a step the hint does not describe (a
    20-token request), which must still match the eager call."""
    torch.manual_seed(0)
    num_req, width, pages = 8, 64, 600
    cache = torch.randn(pages, GB, 128, device="cuda").to(FP8)
    table = torch.randperm(pages, device="cuda")[:num_req * width].view(num_req, width).int()
    cu = torch.arange(0, 4 * num_req + 1, 4, dtype=torch.int32, device="cuda")  # q_len 4
    seq = torch.full((num_req,), 3000, dtype=torch.int32, device="cuda")
    q = torch.randn(4 * num_req, 4, 128, device="cuda").to(FP8)
    out = torch.empty(4 * num_req, 4, 16, dtype=torch.int32, device="cuda")
    args = (q, cache, cu, seq, table)
    openmsa.select_blocks(*args, block_size=GB, out=out, max_q_len=hint)  # compile first
    first = out.clone()
    openmsa.select_blocks(*args, block_size=GB, out=out, max_q_len=hint)
    assert torch.equal(out, first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        openmsa.select_blocks(*args, block_size=GB, out=out, max_q_len=hint)
    steps = [([4] * num_req, [5000] * num_req), ([4] * num_req, [129, 8000, 4, 17, 2048, 6000,
                                                                  300, 8191])]
    if hint is not None:
        steps.append(([20, 4, 4, 4, 0, 0, 0, 0], [3000, 500, 8000, 9, 0, 0, 0, 0]))
    for q_lens, lens in steps:
        cu.copy_(torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int())
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(4 * num_req, 4, 128, device="cuda").to(FP8))
        graph.replay()
        eager = openmsa.select_blocks(*args, block_size=GB, max_q_len=hint)
        assert torch.equal(out, eager)


def _short_rows_on(num_rows, heads, width, topk, config=DEFAULT):
    """Whether a selection launch of these shapes takes select_rows.py's kernel (on an H200
    with the tested Triton it must: a test of that kernel that silently ran select.py would
    prove nothing)."""
    shape = IndexerShape(num_tokens=num_rows // heads, num_heads=heads, head_dim=128,
                         num_requests=1, max_blocks=width, block_size=GB, q_dtype=FP8,
                         cache_dtype=FP8, topk=topk)
    p = selection_plan(shape, DeviceFacts.of(torch.device("cuda")), config)
    return p.find("select_short_rows") is not None


@pytest.mark.gpu
@pytest.mark.parametrize("wide", [0, 1, 2])
@pytest.mark.parametrize("topk, init, local, heads, extra, tpr", [
    (16, 0, 1, 4, 0, 4), (16, 1, 2, 4, 3, 1), (4, 0, 1, 1, 1, 8), (64, 2, 3, 2, 0, 4),
    (8, 1, 1, 4, 8, 2), (3, 1, 2, 2, 0, 4), (1, 0, 1, 4, 0, 4), (1, 0, 0, 2, 1, 8)])
def test_short_rows_selection_exact(topk, init, local, heads, extra, tpr, wide):
    """select_rows.py (select_short_tpr = tpr threads per row, at most 16 blocks per thread)
    against the reference selection from the same
    scores: a chunk with no context (rows of 1 to 6 blocks), a chunk after context, decode,
    verify, a request with q_len > seq_len and one with no token, padding tokens; integer
    scores (ties the rule decides) with NaN, -inf, +inf and -0.0 among them, a row of one
    value; transposed scores and out (strided, and scalar loads where 4 does not divide the
    width). Rows of <= 64 blocks (wide 0: 4 or 8 threads a row) and of
    65-128 (wide 1) are sorted (stages in registers and across threads); wide 2, rows of up to
    ~940 blocks (16 or more per thread, a warp per row), are searched."""
    config = _config(short_rows=dict(tpr=tpr))
    longest = (5000, 12000, 120000)[wide]
    seq_lens = [700, longest, 3000, longest // 2, 3, 128]
    step = make_step([700, 300, 1, 4, 5, 0], seq_lens, block_size=GB, extra_columns=extra,
                     pad_tokens=3)
    width = step.block_table.shape[1]
    assert (0, 64, 128, 1024)[wide] < width <= (64, 128, 1024)[wide]
    assert _short_rows_on(step.num_tokens * heads, heads, width, topk, config)
    g = torch.Generator().manual_seed(topk + extra)
    scores = torch.randint(-3, 4, (step.num_tokens, heads, width), generator=g).float()
    special = torch.rand(scores.shape, generator=g)
    scores[special < 0.05] = float("nan")
    scores[(special >= 0.05) & (special < 0.08)] = float("-inf")
    scores[(special >= 0.08) & (special < 0.09)] = float("inf")
    scores[(special >= 0.09) & (special < 0.15)] = -0.0
    scores[710, 0] = 2.0
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    want = indexer_ref.select_from_scores(scores, pos, topk=topk, init_blocks=init,
                                          local_blocks=local, block_size=GB)
    d = cuda_step(step)
    # scores as a transposed [T, H, width] view, out as a transposed [T, H, K] view
    s_dev = scores.cuda().permute(2, 0, 1).contiguous().permute(1, 2, 0)
    buf = torch.full((topk, heads, step.num_tokens), -7, dtype=torch.int32, device="cuda")
    out = buf.permute(2, 1, 0)
    indexer_api.launch_select(s_dev, d.cu_seqlens_q, d.seq_lens, out, topk=topk,
                              init_blocks=init, local_blocks=local, block_size=GB, config=config)
    assert torch.equal(out.cpu(), want)
    out2 = torch.full((step.num_tokens, heads, topk), -7, dtype=torch.int32, device="cuda")
    indexer_api.launch_select(scores.cuda(), d.cu_seqlens_q, d.seq_lens, out2, topk=topk,
                              init_blocks=init, local_blocks=local, block_size=GB, config=config)
    assert torch.equal(out2.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("c_dtype", [torch.bfloat16, FP8])
def test_short_rows_prefill_and_graph_replay(c_dtype):
    """select_blocks end to end on rows the thread-per-row kernel takes: a prefill chunk with
    little context, exact against the reference on integer inputs; then a 128-request verify
    step (512 rows of <= 64 blocks) captured in a CUDA graph and replayed with new lengths,
    equal to eager calls, repeatable, and equal to select.py's launches on the same step."""
    step = make_step([3000, 5], [3500, 7000], block_size=GB)
    q, c = random_index_inputs(step, num_heads=4, head_dim=128, block_size=GB, q_dtype=c_dtype,
                               cache_dtype=c_dtype, integer=True)
    assert _short_rows_on(step.num_tokens * 4, 4, step.block_table.shape[1], 16)
    want = ref.select_blocks(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table,
                             block_size=GB)
    d = cuda_step(step)
    got = openmsa.select_blocks(q.cuda(), c.cuda(), d.cu_seqlens_q, d.seq_lens, d.block_table,
                                block_size=GB)
    assert torch.equal(got.cpu(), want)
    # the Gluon prefill launch a programmatic dependent of the decode launch (the 5-token
    # request's scores), the selection one of the prefill launch: eager into a poisoned out=,
    # then replayed from a CUDA graph
    qd, cd, dargs = q.cuda(), c.cuda(), (d.cu_seqlens_q, d.seq_lens, d.block_table)
    out = torch.full(want.shape, -7, dtype=torch.int32, device="cuda")
    openmsa.select_blocks(qd, cd, *dargs, block_size=GB, out=out, max_q_len=3000)
    assert torch.equal(out.cpu(), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        openmsa.select_blocks(qd, cd, *dargs, block_size=GB, out=out, max_q_len=3000)
    out.fill_(-7)
    graph.replay()
    assert torch.equal(out.cpu(), want)

    torch.manual_seed(1)
    num_req, width, pages = 128, 64, 9000
    assert _short_rows_on(4 * num_req * 4, 4, width, 16)
    cache = torch.randn(pages, GB, 128, device="cuda").to(c_dtype)
    table = torch.randperm(pages, device="cuda")[:num_req * width].view(num_req, width).int()
    cu = torch.arange(0, 4 * num_req + 1, 4, dtype=torch.int32, device="cuda")
    seq = torch.full((num_req,), 3000, dtype=torch.int32, device="cuda")
    q = torch.randn(4 * num_req, 4, 128, device="cuda").to(c_dtype)
    out = torch.empty(4 * num_req, 4, 16, dtype=torch.int32, device="cuda")
    args = (q, cache, cu, seq, table)
    openmsa.select_blocks(*args, block_size=GB, out=out, max_q_len=4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        openmsa.select_blocks(*args, block_size=GB, out=out, max_q_len=4)
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        lens = torch.randint(1, width * GB + 1, (num_req,), generator=g, dtype=torch.int32)
        seq.copy_(lens)
        q.copy_(torch.randn(4 * num_req, 4, 128, device="cuda").to(c_dtype))
        graph.replay()
        eager = openmsa.select_blocks(*args, block_size=GB, max_q_len=4)
        assert torch.equal(out, eager)
        graph.replay()
        assert torch.equal(out, eager)
    no_short = _config(short_rows=dict(max_blocks=0))
    assert not _short_rows_on(4 * num_req * 4, 4, width, 16, no_short)
    assert torch.equal(openmsa.select_blocks(*args, block_size=GB, max_q_len=4,
                                             config=no_short), eager)


@pytest.mark.gpu
@pytest.mark.parametrize("context, want_bps", [(0, 10), (8192, 26)])
def test_short_prefill_splits_of_any_size(context, want_bps):
    """TP4's 8K chunk (one index head) with little context: the Gluon prefill launch's splits are
    as long as plan._short_prefill_bps finds fastest, not whole 8-block sectors of a score row,
    so neighbouring programs write parts of one sector; scores exact against the reference on
    integer inputs, and the selection too."""
    step = make_step([8192], [8192 + context], block_size=GB, pad_tokens=3)
    q, c = random_index_inputs(step, num_heads=1, head_dim=128, block_size=GB, q_dtype=FP8,
                               cache_dtype=FP8, integer=True)
    d = cuda_step(step)
    qd, cd, dargs = q.cuda(), c.cuda(), (d.cu_seqlens_q, d.seq_lens, d.block_table)
    p = plan(indexer_api._shape(qd, cd, d.seq_lens, d.block_table, GB, None),
             DeviceFacts.of(torch.device("cuda")))
    assert p.find("scores_prefill_gluon").params["bps"] == want_bps
    want = ref.block_scores(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table,
                            block_size=GB)
    assert torch.equal(openmsa.block_scores(qd, cd, *dargs, block_size=GB).cpu(), want)
    want_sel = ref.select_blocks(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table,
                                 block_size=GB)
    assert torch.equal(openmsa.select_blocks(qd, cd, *dargs, block_size=GB).cpu(), want_sel)


def _nvfp4_cache(num_pages, page_stride=None, generator=None, device="cpu"):
    """An NVFP4 cache of random keys, pages `page_stride` bytes apart (9216: packed), quantized
    with nvfp4.quantize_index_keys; returns (cache uint8 [P, 128, 72] view, fp32 keys)."""
    from openmsa import nvfp4
    stride = page_stride or nvfp4.PAGE_BYTES
    buf = torch.zeros(num_pages * stride, dtype=torch.uint8, device=device)
    cache = buf.as_strided((num_pages, nvfp4.PAGE_TOKENS, nvfp4.TOKEN_BYTES),
                           (stride, nvfp4.TOKEN_BYTES, 1))
    keys = torch.randn(num_pages * nvfp4.PAGE_TOKENS, nvfp4.HEAD_DIM, generator=generator)
    codes, scales = nvfp4.quantize_index_keys(keys.to(device))
    c, s = nvfp4.page_parts(cache)
    c.copy_(codes.view(num_pages, nvfp4.PAGE_TOKENS, -1))
    s.copy_(scales.view(num_pages, nvfp4.PAGE_TOKENS, -1))
    return cache, keys


def _assert_nvfp4_matches(got_scores, got_sel, want_scores, pos, topk, init, local):
    """Scores equal up to fp32 summation order (same -inf pattern); the selection equal to the
    reference's selection on the kernel's own scores (no ties between random floats, so this is
    exactly the reference selection wherever rounding does not reorder two blocks) and within
    rounding of the reference's best."""
    got_scores, pos = got_scores.cpu(), pos.cpu()
    assert torch.equal(got_scores.isinf(), want_scores.isinf())
    fin = want_scores.isfinite()
    torch.testing.assert_close(got_scores[fin], want_scores[fin], rtol=1e-5, atol=1e-3)
    want_sel = indexer_ref.select_from_scores(got_scores, pos, topk=topk, init_blocks=init,
                                              local_blocks=local, block_size=128)
    assert torch.equal(got_sel.cpu(), want_sel)
    assert_selection_near_optimal(got_sel.cpu(), want_scores, pos, topk=topk, init_blocks=init,
                                  local_blocks=local, block_size=128, rtol=1e-4)


# decode, a 16-token verify, a 3-token verify after a context shorter than topk blocks, q_len 0,
# a 37-token prefill chunk (the prefill launch) ending in a partial block, decode in the first block
NV_Q_LENS = [1, 16, 3, 0, 37, 1]
NV_SEQ_LENS = [700, 530, 200, 9, 420, 5]


@pytest.mark.interpret
@pytest.mark.parametrize("q_dtype", [FP8, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_stride", [None, 9216 + 48])
def test_nvfp4_cache_matches_reference(kernel_device, q_dtype, page_stride):
    """NVFP4 pages (scattered, at a packed or a padded page stride, one table entry -1) scored
    by the decode launch (decode, verify up to 16) and the prefill launch (a prefill chunk) in one
    call, against the reference on the dequantized keys; padding tokens score -inf."""
    g = torch.Generator().manual_seed(41)
    step = make_step(NV_Q_LENS, NV_SEQ_LENS, block_size=128, extra_columns=1, pad_tokens=2,
                     generator=g)
    cache, _ = _nvfp4_cache(step.num_pages, page_stride, generator=g)
    q = torch.randn(step.num_tokens, 2, 128, generator=g).to(q_dtype)
    table = step.block_table.clone()
    table[0, 2] = -1  # an unfilled entry: reads nothing, scores -inf
    args = (step.cu_seqlens_q, step.seq_lens, table)
    d = _to(make_step(NV_Q_LENS, NV_SEQ_LENS, block_size=128, extra_columns=1, pad_tokens=2,
                      generator=torch.Generator().manual_seed(41)), kernel_device)
    dargs = (d.cu_seqlens_q, d.seq_lens, table.to(kernel_device))
    qd, cd = q.to(kernel_device), cache.to(kernel_device)
    if page_stride is not None:  # (.to keeps the padded strides only on the same device)
        cd = _nvfp4_cache(step.num_pages, page_stride, device=kernel_device)[0]
        cd.copy_(cache.to(kernel_device))
    assert set(_scoring_launches(qd, cd, *dargs, 128)) >= {_request_launch(qd, cd, *dargs),
                                                           "scores_prefill"}
    want = ref.block_scores(q, cache, *args, block_size=128)
    got = openmsa.block_scores(qd, cd, *dargs, block_size=128)
    sel = openmsa.select_blocks(qd, cd, *dargs, topk=4, init_blocks=1, local_blocks=1,
                                block_size=128)
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    _assert_nvfp4_matches(got, sel, want, pos, 4, 1, 1)
    assert (got.cpu()[-2:] == float("-inf")).all()


@pytest.mark.interpret
def test_nvfp4_nan_groups_score_as_the_reference(kernel_device):
    """Groups holding NaN (what the writers store for a NaN key value: scale byte 0x7F, codes 7)
    read back as NaN, so a key with one scores -inf before its block's maximum and a block of
    only such keys scores -inf: request and prefill launches in one call (the chunk in-kernel and
    staged), as the reference."""
    from openmsa import nvfp4
    g = torch.Generator().manual_seed(43)
    step = make_step(NV_Q_LENS, NV_SEQ_LENS, block_size=128, extra_columns=1, pad_tokens=2,
                     generator=g)
    cache, _ = _nvfp4_cache(step.num_pages, generator=g)
    clean = cache.clone()
    codes, scales = nvfp4.page_parts(cache)
    for _ in range(300):  # one group of scattered tokens
        page, tok, grp = (int(torch.randint(0, n, (1,), generator=g))
                          for n in (step.num_pages, 128, 8))
        scales[page, tok, grp] = 0x7F
        codes[page, tok, 8 * grp:8 * grp + 8] = 0x77
    scales[int(step.block_table[0, 1]), :, 5] = 0x7F  # every key of a block
    q = torch.randn(step.num_tokens, 2, 128, generator=g).to(FP8)
    args = (step.cu_seqlens_q, step.seq_lens, step.block_table)
    want = ref.block_scores(q, cache, *args, block_size=128)
    assert want[0, :, 1].isneginf().all()
    assert not torch.equal(want, ref.block_scores(q, clean, *args, block_size=128))
    d = _to(step, kernel_device)
    dargs = (q.to(kernel_device), cache.to(kernel_device), d.cu_seqlens_q, d.seq_lens,
             d.block_table)
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    rule = dict(topk=4, init_blocks=1, local_blocks=1, block_size=128)
    # in-kernel, and with the prefill chunk staged into 16-bit pages (stage.py)
    for config in (None, STAGED):
        got = openmsa.block_scores(*dargs, block_size=128, config=config)
        sel = openmsa.select_blocks(*dargs, **rule, config=config)
        _assert_nvfp4_matches(got, sel, want, pos, 4, 1, 1)


@pytest.mark.reference
def test_nvfp4_reference_scores_dequantized_keys():
    """The reference scores an NVFP4 cache exactly as the fp32 cache of its dequantized keys."""
    from openmsa import nvfp4
    g = torch.Generator().manual_seed(3)
    step = make_step([1, 5], [300, 140], block_size=128, generator=g)
    cache, _ = _nvfp4_cache(step.num_pages, 9216 + 16, generator=g)
    q = torch.randn(step.num_tokens, 2, 128, generator=g)
    args = (step.cu_seqlens_q, step.seq_lens, step.block_table)
    dense = nvfp4.dequantize_index_pages(cache)
    assert torch.equal(ref.block_scores(q, cache, *args), ref.block_scores(q, dense, *args))
    assert torch.equal(ref.select_blocks(q, cache, *args, topk=2),
                       ref.select_blocks(q, dense, *args, topk=2))


@pytest.mark.reference
@pytest.mark.parametrize("case", ["shape", "dim3", "token_stride", "overlap", "misaligned",
                                  "block_size", "head_dim", "q_dtype"])
def test_nvfp4_cache_is_checked(case):
    """A uint8 index cache is NVFP4 pages or an error naming index_cache (never read as raw
    bytes); the query and block size it pairs with are checked too."""
    q = torch.zeros(1, 1, 128, dtype=FP8)
    cache = torch.zeros(3, 128, 72, dtype=torch.uint8)
    block_size, err = 128, ValueError
    if case == "shape":
        cache = torch.zeros(3, 128, 64, dtype=torch.uint8)
    elif case == "dim3":
        cache = torch.zeros(3, 128 * 72, dtype=torch.uint8)
    elif case == "token_stride":
        cache = torch.zeros(3, 128, 80, dtype=torch.uint8)[:, :, :72]
    elif case == "overlap":
        cache = torch.zeros(2 * 9216, dtype=torch.uint8).as_strided((3, 128, 72), (4608, 72, 1))
    elif case == "misaligned":
        cache = torch.zeros(3 * 9216 + 16, dtype=torch.uint8)[8:8 + 3 * 9216].view(3, 128, 72)
    elif case == "block_size":
        block_size = 64
    elif case == "head_dim":
        q = torch.zeros(1, 1, 64, dtype=FP8)
    elif case == "q_dtype":
        q, err = torch.zeros(1, 1, 128, dtype=torch.float8_e5m2), TypeError
    args = (q, cache, torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32))
    match = {"head_dim": "index_q", "q_dtype": "index_q against an NVFP4 index cache"}.get(
        case, "index_cache|block_size")
    for op in (openmsa.block_scores, openmsa.select_blocks):
        with pytest.raises(err, match=match):
            op(*args, block_size=block_size)


@pytest.mark.reference
def test_nvfp4_support_reasons():
    """support.py: NVFP4 takes fp8 e4m3 / 16-bit queries, 128-token blocks of 128 dims; fp32
    queries only on the reference."""
    from openmsa.support import indexer_unsupported_reason as why
    u8 = torch.uint8
    ok = dict(num_index_heads=4, index_head_dim=128, block_size=128, topk=16, cache_dtype=u8)
    for q in (FP8, torch.bfloat16, torch.float16):
        assert why(query_dtype=q, **ok) is None
    assert "query" in why(query_dtype=torch.float32, **ok)
    assert "128" in why(query_dtype=FP8, **{**ok, "block_size": 64})
    assert openmsa.unsupported_reason(index_dtype=u8) is None


@pytest.mark.reference
@compiled
@pytest.mark.parametrize("tile_mode, q_type", [(True, "*fp8e4nv"), (False, "*bf16"),
                                               (True, "*bf16")])
def test_block_scores_kernel_compiles_nvfp4(tile_mode, q_type):
    """The Triton NVFP4 launches as plan.py makes them on Hopper (M3's 4 index heads: the tile
    launch, and the decode launch of a bf16 query; an fp8 one is the Gluon kernel's, tested
    above), compiled for sm_90: the
    PTX dequantization (paired e4m3 -> f16 conversions, f16x2 scale multiplies), one wgmma
    chain per block, and no register spills."""
    from helpers.sm90 import assert_no_spills

    from openmsa.ops.indexer.kernels.scores import _block_scores_kernel
    q_dtype = FP8 if q_type == "*fp8e4nv" else torch.bfloat16
    shape = IndexerShape(num_tokens=8192 if tile_mode else 64, num_heads=4, head_dim=128,
                         num_requests=1 if tile_mode else 64, max_blocks=1024, block_size=128,
                         q_dtype=q_dtype, cache_dtype=torch.uint8)
    # (the in-kernel tile: what a mixed step's chunks take; a chunk alone is staged)
    launch = plan(shape, DeviceFacts(kind="cuda", num_sms=132, capability=(9, 0),
                                     gluon_hopper=True),
                  dataclasses.replace(DEFAULT, nvfp4_prefill="inkernel")).find(
        "scores_prefill" if tile_mode else "scores_decode")
    params = dict(launch.params)
    options = dict(num_warps=params.pop("num_warps"), num_stages=params.pop("num_stages"))
    if "maxnreg" in params:
        options["maxnreg"] = params.pop("maxnreg")
    params.pop("table_width", None)
    assert params["NVFP4"]
    # as launched on a packed cache: pointers and the page, query, table and score strides
    # multiples of 16 (the decode launch's 128-register cap spills ~230 bytes without that
    # specialization; the code that runs has it)
    div16 = ("q_ptr", "cache_ptr", "cu_ptr", "seq_lens_ptr", "bt_ptr", "out_ptr", "stride_cp",
             "stride_qt", "stride_qh", "stride_btr", "stride_ot", "stride_oh")
    attrs = {(_block_scores_kernel.arg_names.index(n),): [["tt.divisibility", 16]]
             for n in div16}
    # and the unit strides (Triton specializes an int argument equal to 1 as a constant)
    params.update(stride_qd=1, stride_cd=1, stride_btb=1, stride_ob=1)
    k = _compile(_block_scores_kernel, dict(q_ptr=q_type, cache_ptr="*u8", out_ptr=F32, **STEP),
                 {}, params, options=options, attrs=attrs)
    ptx = k.asm["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "mul.rn.f16x2" in ptx and "wgmma" in ptx
    assert_no_spills(ptx)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [FP8, torch.bfloat16])
@pytest.mark.parametrize("page_stride", [None, 9216 + 128])
def test_nvfp4_realistic_steps(q_dtype, page_stride):
    """M3's shapes on the GPU: decode at 128K and 300K, 4- and 16-token verifies, a 2K prefill
    chunk after 20K and one from scratch, in one call, 4 index heads; NVFP4 pages at a packed
    or padded stride with a -1 entry: scores within fp32 summation order of the reference and
    the selection the reference's rule makes of them."""
    g = torch.Generator().manual_seed(7)
    q_lens, seq_lens = [1, 4, 16, 2048, 1, 1000], [131072, 300_001, 9000, 22_000, 200, 1000]
    step = make_step(q_lens, seq_lens, block_size=GB, extra_columns=2, pad_tokens=5,
                     generator=g)
    cache, _ = _nvfp4_cache(step.num_pages, page_stride, generator=g)
    q = torch.randn(step.num_tokens, 4, 128, generator=g).to(q_dtype)
    table = step.block_table.clone()
    table[1, 7] = -1
    want = ref.block_scores(q, cache, step.cu_seqlens_q, step.seq_lens, table)
    d = cuda_step(step)
    dcache = _nvfp4_cache(step.num_pages, page_stride, device="cuda")[0]
    dcache.copy_(cache.cuda())
    dargs = (q.cuda(), dcache, d.cu_seqlens_q, d.seq_lens, table.cuda())
    got = openmsa.block_scores(*dargs)
    sel = openmsa.select_blocks(*dargs, topk=16, init_blocks=1, local_blocks=2)
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    _assert_nvfp4_matches(got, sel, want, pos, 16, 1, 2)
    # a decode-only step (the decode launch alone) and the max_q_len hint
    one = openmsa.select_blocks(*dargs, topk=16, init_blocks=1, local_blocks=2, max_q_len=2048)
    assert torch.equal(one, sel)


@pytest.mark.reference
@compiled
@pytest.mark.parametrize("np_rows", [8, 16])
def test_nvfp4_decode_kernel_compiles(np_rows):
    """The Gluon NVFP4 decode launch (scores_nvfp4.py) compiled for sm_90 as plan.py makes it
    (4 index heads): pages arrive by cp.async, the key operand reaches the MMA (mma.sync)
    straight from the registers the bit moves fill (the relabellings are layout changes without
    data movement, asserted at compile time), and nothing spills."""
    from helpers.sm90 import assert_no_spills

    from openmsa.ops.indexer.kernels.scores_nvfp4 import _nvfp4_decode_kernel
    shape = IndexerShape(num_tokens=64, num_heads=4, head_dim=128, num_requests=64,
                         max_blocks=1024, block_size=128, q_dtype=FP8,
                         cache_dtype=torch.uint8, max_q_len=2 if np_rows == 8 else None)
    launch = plan(shape, DeviceFacts(kind="cuda", num_sms=132, capability=(9, 0),
                                     gluon_hopper=True)).find("scores_decode_nvfp4")
    params = dict(launch.params)
    assert params["NP"] == np_rows
    options = dict(num_warps=params.pop("num_warps"), maxnreg=params.pop("maxnreg", None))
    div16 = ("q_ptr", "cache_ptr", "cu_ptr", "seq_lens_ptr", "bt_ptr", "out_ptr", "stride_cp",
             "stride_qt", "stride_qh", "stride_btr", "stride_ot", "stride_oh")
    attrs = {(_nvfp4_decode_kernel.arg_names.index(n),): [["tt.divisibility", 16]]
             for n in div16}
    params.update(stride_qd=1, stride_btb=1, stride_ob=1)
    k = _compile(_nvfp4_decode_kernel, dict(q_ptr="*fp8e4nv", cache_ptr="*u8", out_ptr=F32,
                                             **STEP), {}, params, options=options,
                 attrs=attrs, gluon=True)
    ptx = k.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16" in ptx and "prmt.b32" in ptx and "cp.async" in ptx
    assert_no_spills(ptx)


def _random_nvfp4_pages(num_pages, page_stride, generator, device, scale_bytes=None):
    """NVFP4 pages of arbitrary codes (every code) and scales drawn from scale_bytes (default:
    E4M3's whole finite range, subnormals included, NaN bytes 0x7f / 0xff excluded)."""
    from openmsa import nvfp4
    cache = _nvfp4_cache(num_pages, page_stride, device=device)[0]
    codes, scales = nvfp4.page_parts(cache)
    codes.copy_(torch.randint(0, 256, codes.shape, generator=generator, dtype=torch.uint8))
    if scale_bytes is None:
        scale_bytes = torch.arange(0x7f, dtype=torch.uint8)
    scales.copy_(scale_bytes[torch.randint(0, len(scale_bytes), scales.shape,
                                           generator=generator)])
    return cache


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [FP8, torch.float16])
@pytest.mark.parametrize("page_stride", [None, 9216 + 48])
def test_nvfp4_decode_kernel_is_exact_per_dim(q_dtype, page_stride):
    """One-hot queries read one head dim each, so every score is one dequantized key value's
    maximum over a block: exact, whatever the summation order. 32 decode requests of 4 heads
    cover all 128 dims (the kernel's head-dim order in the MMA registers, its bit moves on every
    code and its scales from E4M3's subnormals to 448), over scattered pages of arbitrary
    bytes, a -1 table entry, and partial last blocks; the scores equal the reference's."""
    g = torch.Generator().manual_seed(5)
    seq_lens = [900 + 37 * i for i in range(32)]
    step = make_step([1] * 32, seq_lens, block_size=128, extra_columns=1, generator=g)
    cache = _random_nvfp4_pages(step.num_pages, page_stride, g, "cpu")
    q = torch.zeros(32, 4, 128)
    q.view(128, 128)[torch.arange(128), torch.randperm(128, generator=g)] = 1.0
    q = q.to(q_dtype)
    table = step.block_table.clone()
    table[3, 1] = -1
    want = ref.block_scores(q, cache, step.cu_seqlens_q, step.seq_lens, table)
    d = cuda_step(step)
    dcache = _nvfp4_cache(step.num_pages, page_stride, device="cuda")[0]
    dcache.copy_(cache.cuda())
    dargs = (q.cuda(), dcache, d.cu_seqlens_q, d.seq_lens, table.cuda())
    assert "scores_decode_nvfp4" in _scoring_launches(*dargs, 128)
    got = openmsa.block_scores(*dargs)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
def test_nvfp4_decode_kernel_cuda_graph_and_strided_query():
    """The Gluon NVFP4 decode launch on a strided fp8 query ([T, H, D] view of a wider
    buffer), NaN-poisoned score buffer, verify steps of up to 16 tokens (several 16-row
    passes), captured in a CUDA graph and replayed with new lengths and tables: the scores of
    the eager call on the same inputs."""
    g = torch.Generator().manual_seed(9)
    q_lens, seq_lens = [1, 4, 16, 3], [5000, 70_000, 9000, 129]
    step = make_step(q_lens, seq_lens, block_size=128, extra_columns=3, generator=g)
    cache, _ = _nvfp4_cache(step.num_pages, None, generator=g)
    wide = torch.randn(step.num_tokens, 4, 192, generator=g).to(FP8)
    q = wide[:, :, 32:160]
    want = ref.block_scores(q, cache, step.cu_seqlens_q, step.seq_lens, step.block_table)
    d = cuda_step(step)
    qd, cd = wide.cuda()[:, :, 32:160], cache.cuda()
    out = nan_poison((step.num_tokens, 4, step.block_table.shape[1]), torch.float32, "cuda")
    args = (qd, cd, d.cu_seqlens_q, d.seq_lens, d.block_table)
    assert "scores_decode_nvfp4" in _scoring_launches(*args, 128, max_q_len=16)
    openmsa.block_scores(*args, out=out, max_q_len=16)
    fin = want.isfinite()
    assert torch.equal(out.cpu().isinf(), want.isinf())
    torch.testing.assert_close(out.cpu()[fin], want[fin], rtol=1e-5, atol=1e-3)
    # the graph: captured on these buffers, replayed after the step's lengths and table change
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        openmsa.block_scores(*args, out=out, max_q_len=16)
    new_lens = torch.tensor([4000, 60_000, 9100, 300], dtype=torch.int32)
    d.seq_lens.copy_(new_lens)
    perm = torch.randperm(step.num_pages, generator=g).to(torch.int32)
    table2 = torch.where(step.block_table >= 0, perm[step.block_table.clamp(min=0).long()],
                         step.block_table)
    d.block_table.copy_(table2)
    graph.replay()
    eager = openmsa.block_scores(*args, max_q_len=16)
    assert torch.equal(out.isinf(), eager.isinf())
    assert torch.equal(out[eager.isfinite()], eager[eager.isfinite()])


STAGED = _config(nvfp4_prefill="staged")
# three long requests (40, 21 and 18 tokens: staging slots 0, 1, 2) between decode, verify, q_len
# 0 and a 16-token verify (the decode launch's longest); partial last blocks, a request whose
# chunk starts inside its last block, 3 padding tokens
ST_Q_LENS = [1, 40, 3, 0, 21, 16, 18, 1]
ST_SEQ_LENS = [700, 300, 200, 9, 420, 150, 18, 5]


def _exact_nvfp4_cache(num_pages, generator, device="cpu"):
    """An NVFP4 cache of random codes with scales 0.5, 1 and 2: every key a multiple of 0.25
    of magnitude <= 12, so that dot products with small-integer queries are exact in fp32 in
    any summation order (scores equal the reference's bit for bit; ties are common, and the
    tie rule decides them alike)."""
    e4m3 = torch.tensor([0.5, 1.0, 2.0], dtype=FP8).view(torch.uint8)
    return _random_nvfp4_pages(num_pages, None, generator, "cpu", e4m3).to(device)


def _staged_plan(q, cache, cu, seq, table, max_q_len=None):
    """The staged form's plan for these arguments (as select_blocks makes it)."""
    shape = indexer_api._shape(q, cache, seq, table, GB, max_q_len)
    return plan(shape, DeviceFacts.of(q.device), STAGED)


def _staged_case(q_lens, seq_lens, q_dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    step = make_step(q_lens, seq_lens, block_size=GB, extra_columns=1, pad_tokens=3,
                     generator=g)
    cache = _exact_nvfp4_cache(step.num_pages, g)
    q = torch.randint(-4, 5, (step.num_tokens, 2, 128), generator=g).to(q_dtype)
    table = step.block_table.clone()
    if len(q_lens) == len(ST_Q_LENS):
        # unfilled entries inside long requests' causal blocks (any negative id), and a decode's
        table[1, 1] = -1
        table[4, 3] = -7
        table[0, 2] = -1
        # and a stale id past the cache, which reads nothing the same way
        table[4, 1] = step.num_pages + 2
    return step, q, cache, table


@pytest.mark.interpret
@pytest.mark.parametrize("q_dtype, max_q_len", [(FP8, None), (FP8, 40), (torch.float16, None),
                                                (torch.bfloat16, None)])
def test_nvfp4_staged_prefill_matches_reference(kernel_device, q_dtype, max_q_len):
    """The staged form (the long requests' pages dequantized into a 16-bit staging cache, then
    the 16-bit prefill launch) gives the reference's scores and selection exactly, on a ragged
    step mixing decode, verify and three prefill chunks over scattered pages with negative
    table entries; the decode launch is the one the in-kernel form makes."""
    step, q, cache, table = _staged_case(ST_Q_LENS, ST_SEQ_LENS, q_dtype, kernel_device, 5)
    args = (q, cache, step.cu_seqlens_q, step.seq_lens, table)
    dargs = tuple(a.to(kernel_device) for a in args)
    kernels = _scoring_launches(*dargs, GB, max_q_len, STAGED)
    assert kernels[:2] == [_request_launch(*dargs),
                           "scores_prefill" if INTERPRET else "scores_prefill_gluon"]
    assert _staged_plan(*dargs, max_q_len).kernels()[0] == "stage_nvfp4"
    want = ref.block_scores(*args, block_size=GB)
    got = openmsa.block_scores(*dargs, block_size=GB, max_q_len=max_q_len, config=STAGED)
    assert torch.equal(got.cpu(), want)
    rule = dict(topk=4, init_blocks=1, local_blocks=1, block_size=GB, max_q_len=max_q_len)
    sel = openmsa.select_blocks(*dargs, **rule, config=STAGED)
    assert torch.equal(sel.cpu(), ref.select_blocks(*args, **rule))


@pytest.mark.interpret
def test_nvfp4_staged_one_request_step(kernel_device):
    """A prefill chunk alone (the prefill launch takes it whatever its q_len; no decode launch),
    ending in a partial block, with a -1 entry: staged scores and selection exactly the
    reference's."""
    step, q, cache, table = _staged_case([150], [530], FP8, kernel_device, 6)
    table[0, 1] = -1
    args = (q, cache, step.cu_seqlens_q, step.seq_lens, table)
    dargs = tuple(a.to(kernel_device) for a in args)
    assert "scores_decode" not in _scoring_launches(*dargs, GB, None, STAGED)
    want = ref.block_scores(*args, block_size=GB)
    assert torch.equal(openmsa.block_scores(*dargs, block_size=GB, config=STAGED).cpu(), want)
    rule = dict(topk=3, init_blocks=1, local_blocks=1, block_size=GB)
    assert torch.equal(openmsa.select_blocks(*dargs, **rule, config=STAGED).cpu(),
                       ref.select_blocks(*args, **rule))


@pytest.mark.interpret
@pytest.mark.parametrize("q_dtype", [FP8, torch.bfloat16])
def test_nvfp4_staging_cache_and_table(kernel_device, q_dtype):
    """stage.py alone: each long request's causal pages dequantized exactly (fp16 for an fp8
    query, bf16 for a bf16 one) into its own slot of max_blocks pages, in request order; its
    entries naming no page -1 (docs/spec.md, "Bounds"); every other entry of the remapped table
    -1; and the query in the
    staging dtype (an fp8 one as an exact contiguous fp16 copy)."""
    from openmsa import nvfp4
    from openmsa.ops.indexer.plan import stage_dtype
    step, q, cache, table = _staged_case(ST_Q_LENS, ST_SEQ_LENS, q_dtype, kernel_device, 7)
    dargs = tuple(a.to(kernel_device) for a in (q, cache, step.cu_seqlens_q, step.seq_lens,
                                                   table))
    p = _staged_plan(*dargs)
    pages = p.sizes["staged_pages"]
    width = table.shape[1]
    # at most min(R, T // 17) long requests: 8 requests, 103 tokens -> 6 slots
    assert pages == min(len(ST_Q_LENS), step.num_tokens // (SMALL_Q + 1)) * width
    tile_q, staged, remapped = indexer_api._stage_nvfp4(p.find("stage_nvfp4"), pages, *dargs)
    dtype = stage_dtype(q_dtype)
    assert staged.dtype == dtype and tuple(staged.shape) == (pages, GB, 128)
    assert tile_q.dtype == dtype and tile_q.is_contiguous()
    assert torch.equal(tile_q.cpu().float(), q.float())
    keys = nvfp4.dequantize_index_pages(cache)
    staged, remapped = staged.cpu(), remapped.cpu()
    want = torch.full_like(table, -1)
    rank = 0
    for r, (ql, sl) in enumerate(zip(ST_Q_LENS, ST_SEQ_LENS)):
        if ql <= SMALL_Q:
            continue
        for b in range(-(-sl // GB)):
            page = int(table[r, b])
            want[r, b] = rank * width + b if 0 <= page < cache.shape[0] else -1
            if 0 <= page < cache.shape[0]:
                assert torch.equal(staged[rank * width + b].float(), keys[page])
        rank += 1
    assert rank == 3 and torch.equal(remapped, want)


@pytest.mark.reference
@compiled
@pytest.mark.parametrize("out_type", ["*fp16", "*bf16"])
def test_stage_kernel_compiles(out_type):
    """The staging launch as plan.py makes it at M3's 1M-token prefill, compiled for sm_90:
    the PTX dequantization (paired e4m3 -> f16 conversions) and no register spills."""
    from helpers.sm90 import assert_no_spills

    from openmsa.ops.indexer.kernels.stage import _stage_nvfp4_kernel
    shape = IndexerShape(num_tokens=8192, num_heads=4, head_dim=128, num_requests=1,
                         max_blocks=8192, block_size=128, q_dtype=FP8, cache_dtype=torch.uint8,
                         tma_q=True)
    launch = plan(shape, DeviceFacts(), STAGED).find("stage_nvfp4")
    params = dict(launch.params)
    options = dict(num_warps=params.pop("num_warps"))
    params.pop("slots")
    assert params["PTX"] and params["BPP"] == 16
    k = _compile(_stage_nvfp4_kernel, dict(cache_ptr="*u8", staged_ptr=out_type,
                                           staged_bt_ptr=I32, **STEP), {}, params,
                 options=options)
    ptx = k.asm["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert_no_spills(ptx)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [FP8, torch.bfloat16, torch.float16])
def test_nvfp4_staged_realistic_steps(q_dtype):
    """M3's shapes on the GPU, both forms: decode at 128K, 4- and 16-token verifies, a 2K
    chunk after 20K and a 1000-token one from scratch, 4 index heads, a -1 entry; the staged
    form's tile is the Gluon kernel (16-bit query and staging cache), its scores within fp32
    summation order of the reference and its selection the reference rule's on them."""
    g = torch.Generator().manual_seed(8)
    q_lens, seq_lens = [1, 4, 16, 2048, 1, 1000], [131072, 9000, 9000, 22_000, 200, 1000]
    step = make_step(q_lens, seq_lens, block_size=GB, extra_columns=2, pad_tokens=5,
                     generator=g)
    cache, _ = _nvfp4_cache(step.num_pages, generator=g)
    q = torch.randn(step.num_tokens, 4, 128, generator=g).to(q_dtype)
    table = step.block_table.clone()
    table[3, 7] = -1
    want = ref.block_scores(q, cache, step.cu_seqlens_q, step.seq_lens, table)
    d = cuda_step(step)
    dargs = (q.cuda(), cache.cuda(), d.cu_seqlens_q, d.seq_lens, table.cuda())
    assert "scores_prefill_gluon" in _scoring_launches(*dargs, GB, None, STAGED)
    got = openmsa.block_scores(*dargs, config=STAGED)
    sel = openmsa.select_blocks(*dargs, topk=16, init_blocks=1, local_blocks=2, config=STAGED)
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    _assert_nvfp4_matches(got, sel, want, pos, 16, 1, 2)
    inkernel = openmsa.block_scores(*dargs)
    torch.testing.assert_close(got, inkernel, rtol=1e-5, atol=1e-3)
