# SPDX-License-Identifier: Apache-2.0
"""Tiers 1 and 2: every kernel against the reference, on the kernel device (the CPU through
Triton's interpreter, or a GPU). Shapes stay tiny so the interpreter runs them in seconds."""

import pytest
import torch
import triton
import triton.language as tl

import openmsa
from openmsa import reference as ref
from openmsa.batch import token_layout
from openmsa.ops.common.counters import COUNTERS
from openmsa.ops.common.triton_utils import find_request, split_e4m3_pairs
from openmsa.ops.indexer import api as indexer_api
from openmsa.ops.indexer import reference as indexer_ref
from openmsa.testing import (RecordingKernel, assert_close, assert_selection_near_optimal,
                             make_step, nan_poison, random_index_inputs, random_kv_cache)

pytestmark = pytest.mark.interpret

B = 16
# decode, 3-token verify, q_len 0, a 20-token prefill chunk (the tile launch), decode in the
# first block, seq_len 0, and 2 padding tokens after cu_seqlens_q[R]
Q_LENS = [1, 3, 0, 20, 1, 0]
SEQ_LENS = [70, 45, 9, 100, 5, 0]
FP8 = torch.float8_e4m3fn
INDEX_DTYPES = [(torch.float16, torch.float16), (torch.float16, FP8), (FP8, FP8),
                (torch.float32, torch.float32)]


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


@pytest.mark.parametrize("q_dtype, c_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("topk, init, local, segment", [(4, 0, 1, None), (3, 1, 1, 4)])
def test_select_exact_on_integer_inputs(kernel_device, q_dtype, c_dtype, topk, init, local,
                                        segment, monkeypatch):
    """Integer-valued inputs: exact dot products on both sides and many tied blocks, so the
    indices must agree exactly, tie rule included. `segment` cuts score rows into several
    selection programs, so the merge launch runs too."""
    if segment is not None:
        monkeypatch.setitem(indexer_api.TUNING, "select_segment", segment)
    step, q, c, dstep = _index_case(kernel_device, q_dtype, c_dtype, integer=True)
    args = (step.cu_seqlens_q, step.seq_lens, step.block_table)
    dargs = (dstep.cu_seqlens_q, dstep.seq_lens, dstep.block_table)
    want = ref.select_blocks(q, c, *args, topk=topk, init_blocks=init, local_blocks=local,
                             block_size=B)
    got = openmsa.select_blocks(q.to(kernel_device), c.to(kernel_device), *dargs, topk=topk,
                                init_blocks=init, local_blocks=local, block_size=B)
    assert torch.equal(got.cpu(), want)
    s_want = ref.block_scores(q, c, *args, block_size=B)
    s_got = openmsa.block_scores(q.to(kernel_device), c.to(kernel_device), *dargs, block_size=B)
    assert torch.equal(s_got.cpu(), s_want)


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


@pytest.mark.parametrize("by_sort, group_bound, fused", [(False, True, False),
                                                         (False, False, False),
                                                         (True, False, False),
                                                         (True, False, True)])
@pytest.mark.parametrize("topk, init, local, segment", [(4, 0, 1, None), (5, 1, 2, 8),
                                                        (16, 0, 1, None)])
def test_selection_kernels_on_crafted_scores(kernel_device, topk, init, local, segment, by_sort,
                                             group_bound, fused, monkeypatch):
    """The selection launches alone on score rows drawn from CRAFTED (many exact ties, all-equal
    rows, all -inf rows, rows shorter and longer than topk, one segment or several), equal to
    the reference selection from the same scores; every path (threshold search per segment, or
    for rows of several segments the group-bound path, and the bitonic sort, whose rows of
    several segments the merge launch or, `fused`, their last segment program merges)."""
    monkeypatch.setitem(indexer_api.TUNING, "select_sort_fused", fused)
    monkeypatch.setitem(indexer_api.TUNING, "select_sort_waves", 10**9 if by_sort else 0)
    monkeypatch.setitem(indexer_api.TUNING, "select_group_bound", group_bound)
    monkeypatch.setitem(indexer_api.TUNING, "select_group_min_blocks", 0)  # short rows too
    if segment is not None:
        monkeypatch.setitem(indexer_api.TUNING, "select_segment", segment)
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
    if fused and segment is not None:  # the path under test: several segments, no merge launch
        plan = indexer_api._select_plan(step.num_tokens, 3, width, topk, init, local, B,
                                        torch.device(kernel_device))
        assert plan[1] > 1 and plan[4].get("FUSED")
    _check_selection_launch(kernel_device, step, scores, topk, init, local)
    # every merger put its row's counter back (the next launch and graph replay need zeros)
    assert all(int(c.count_nonzero()) == 0 for c in COUNTERS.values())


@pytest.mark.parametrize("chunk, segment, group_bound", [(0, None, False), (128, None, False),
                                                        (256, 512, False), (0, None, True),
                                                        (0, 512, True)])
@pytest.mark.parametrize("topk, init", [(16, 0), (5, 2), (64, 3)])
def test_selection_scratch_path(kernel_device, topk, init, chunk, segment, group_bound,
                                monkeypatch):
    """Rows of 1000 blocks make 1024-wide segments (or two of 512, merged), where the threshold
    path first packs the keys that can be picked into a scratch row: distinct random scores take
    it (with a run of equal top keys inside, and one row whose best keys sit in a few groups), a
    row of ties overflows it and searches the segment (on the group-bound path, taken here by
    rows of any length, a row of 400 equal top keys in 25 groups overflows its candidates'
    scratch row). `chunk`: the segment read in chunks (TUNING select_chunk), the overflow's
    search included."""
    monkeypatch.setitem(indexer_api.TUNING, "select_sort_waves", 0)
    monkeypatch.setitem(indexer_api.TUNING, "select_group_bound", group_bound)
    monkeypatch.setitem(indexer_api.TUNING, "select_group_min_blocks", 0)
    monkeypatch.setitem(indexer_api.TUNING, "select_chunk", chunk)
    monkeypatch.setitem(indexer_api.TUNING, "select_chunk_min_waves", 0)  # a small launch
    if segment is not None:
        monkeypatch.setitem(indexer_api.TUNING, "select_segment", segment)
    g = torch.Generator().manual_seed(topk)
    step = make_step([3, 1], [16 * 1000, 16 * 999 + 3], block_size=B, pad_tokens=1)
    scores = torch.randn(step.num_tokens, 2, step.block_table.shape[1], generator=g)
    scores[0, 0, 500:520] = 7.0
    # 25 groups of equal top keys: the group-bound path's candidates overflow its scratch row
    scores[0, 1, :400] = 5.0
    scores[1, 0, :] = 1.0
    scores[1, 1, 40:60] = 9.0 + torch.arange(20.0)
    scores[2, 1] = scores[2, 1].round()
    _check_selection_launch(kernel_device, step, scores, topk, init, 1)


def _check_selection_launch(kernel_device, step, scores, topk, init, local):
    """launch_select on `scores` equals the reference selection from the same scores."""
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    want = indexer_ref.select_from_scores(scores, pos, topk=topk, init_blocks=init,
                                          local_blocks=local, block_size=B)
    d = _to(step, kernel_device)
    out = nan_poison((*scores.shape[:2], topk), torch.int32, kernel_device)
    indexer_api.launch_select(scores.to(kernel_device), d.cu_seqlens_q, d.seq_lens, out,
                              topk=topk, init_blocks=init, local_blocks=local, block_size=B)
    assert torch.equal(out.cpu(), want)


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


@pytest.mark.parametrize("knobs", [dict(decode_pages_early=False, decode_one_loop=False),
                                   dict(decode_pages_early=True, decode_one_loop=False),
                                   dict(decode_pages_early=False, decode_one_loop=True),
                                   dict(decode_split_major=True),
                                   # 2 tiles (the last one holds the chunk's last tokens)
                                   # x 4 splits
                                   dict(prefill_reverse_tiles=True, prefill_rows=32,
                                        prefill_bps=2),
                                   dict(prefill_reverse_splits=True, prefill_rows=32,
                                        prefill_bps=2),
                                   dict(prefill_reverse_tiles=True, prefill_reverse_splits=True,
                                        prefill_split_major=True, prefill_rows=32,
                                        prefill_bps=2)])
@pytest.mark.parametrize("q_dtype, c_dtype", [(torch.float16, torch.float16), (FP8, FP8)])
def test_decode_launch_variants(kernel_device, q_dtype, c_dtype, knobs, monkeypatch):
    """The launch-order knobs (the 20-token request takes the tile launch) and the decode
    launch's knobs (defaults: page ids early, one loop) keep the reference's exact
    scores and selection. The table's entries past each request's blocks hold page ids far
    outside the cache: decode_pages_early loads them (masked by the table's width, not the
    request's length) and must never read the keys they point to (on the GPU such a read
    faults)."""
    for name, value in knobs.items():
        monkeypatch.setitem(indexer_api.TUNING, name, value)
    step, q, c, dstep = _index_case(kernel_device, q_dtype, c_dtype, integer=True, seed=5)
    table = step.block_table.clone()
    for r, seq_len in enumerate(SEQ_LENS):
        table[r, -(-seq_len // B):] = 1 << 30
    args = (step.cu_seqlens_q, step.seq_lens, table)
    dargs = (dstep.cu_seqlens_q, dstep.seq_lens, table.to(kernel_device))
    s_want = ref.block_scores(q, c, *args, block_size=B)
    s_got = openmsa.block_scores(q.to(kernel_device), c.to(kernel_device), *dargs, block_size=B)
    assert torch.equal(s_got.cpu(), s_want)
    want = ref.select_blocks(q, c, *args, topk=4, block_size=B)
    got = openmsa.select_blocks(q.to(kernel_device), c.to(kernel_device), *dargs, topk=4,
                                block_size=B)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("q_lens", [[3, 1, 4, 2, 3, 1, 4, 3],  # verify, 21 tokens: no long one
                                    [1] + [0] * 20 + [17, 2]])  # a long one after 20 empty ones
@pytest.mark.parametrize("knobs", [dict(), dict(tile_quick_exit=False, tile_overlap=False)])
def test_steps_of_more_than_small_q_tokens(kernel_device, q_lens, knobs, monkeypatch):
    """A step of more than SMALL_Q tokens also runs the tile launch: with no long request its
    programs end after one look at their requests (tile_quick_exit), which must not skip a long
    request standing after more requests than that look covers (8-token tiles here, so the
    look spans 16 requests)."""
    monkeypatch.setitem(indexer_api.TUNING, "prefill_rows", 16)
    for name, value in knobs.items():
        monkeypatch.setitem(indexer_api.TUNING, name, value)
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
    assert step.num_tokens > indexer_api.SMALL_Q
    s_want = ref.block_scores(q, c, *args, block_size=B)
    s_got = openmsa.block_scores(q.to(kernel_device), c.to(kernel_device), *dargs, block_size=B)
    assert torch.equal(s_got.cpu(), s_want)
    want = ref.select_blocks(q, c, *args, topk=4, block_size=B)
    got = openmsa.select_blocks(q.to(kernel_device), c.to(kernel_device), *dargs, topk=4,
                                block_size=B)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("q_lens, hint, launches", [
    ([3, 1, 4, 2, 3, 1, 4, 3], 4, 1),  # a verify step of 21 tokens, hint right: one launch
    ([3, 1, 4, 2, 3, 1, 4, 3], None, 2),  # no hint: the tile launch runs too
    ([1, 3, 20, 1], 1, 1),  # hint wrong (a 20-token chunk): still exact, by the request launch
    ([1, 3, 20, 1], 20, 2)])
def test_max_q_len_hint(kernel_device, q_lens, hint, launches, monkeypatch):
    """max_q_len <= 16 makes a step of more than 16 tokens one scoring launch; it is a speed hint
    only: with a request longer than the hint the scores and the selection stay exact."""
    from openmsa.ops.indexer import scores as scores_mod
    seen = []
    monkeypatch.setattr(scores_mod, "_block_scores_kernel",
                        RecordingKernel(scores_mod._block_scores_kernel, seen, arg=0))
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
    s_got = openmsa.block_scores(q.to(kernel_device), c.to(kernel_device), *dargs, block_size=B,
                                 max_q_len=hint)
    assert len(seen) == launches
    assert torch.equal(s_got.cpu(), ref.block_scores(q, c, *args, block_size=B))
    got = openmsa.select_blocks(q.to(kernel_device), c.to(kernel_device), *dargs, topk=4,
                                block_size=B, max_q_len=hint)
    assert torch.equal(got.cpu(), ref.select_blocks(q, c, *args, topk=4, block_size=B))


def test_select_is_deterministic(kernel_device):
    _, q, c, dstep = _index_case(kernel_device, torch.float16, torch.float16, integer=False)
    args = (q.to(kernel_device), c.to(kernel_device), dstep.cu_seqlens_q, dstep.seq_lens,
            dstep.block_table)
    a = openmsa.select_blocks(*args, topk=4, block_size=B)
    b = openmsa.select_blocks(*args, topk=4, block_size=B)
    assert torch.equal(a, b)


def test_cache_writes_match_reference(kernel_device):
    g = torch.Generator().manual_seed(11)
    slots = torch.tensor([5, -1, 17, 30, -3], dtype=torch.int64)
    for dtype in (torch.float16, FP8):
        # exact fp8 values: the interpreter's kernel-side fp32->fp8 rounding is unreliable
        x = torch.randint(-20, 20, (5, 32), generator=g).float() * 32
        want = torch.zeros(2, B, 32, dtype=dtype)
        ref.write_index_cache(x, want, slots)
        got = torch.zeros(2, B, 32, dtype=dtype, device=kernel_device)
        openmsa.write_index_cache(x.to(kernel_device), got, slots.to(kernel_device))
        assert torch.equal(got.cpu().float(), want.float())
    packed = torch.zeros(2, 2, B, 2 * 64, dtype=torch.float16, device=kernel_device)
    kc, vc = packed[..., :64].permute(0, 2, 1, 3), packed[..., 64:].permute(0, 2, 1, 3)
    k, v = torch.randn(5, 2, 64, generator=g).half(), torch.randn(5, 2, 64, generator=g).half()
    wk, wv = torch.zeros(2, B, 2, 64, dtype=torch.float16), torch.zeros(2, B, 2, 64,
                                                                        dtype=torch.float16)
    ref.write_kv_cache(k, v, wk, wv, slots)
    openmsa.write_kv_cache(k.to(kernel_device), v.to(kernel_device), kc, vc,
                           slots.to(kernel_device))
    assert torch.equal(kc.cpu(), wk) and torch.equal(vc.cpu(), wv)


@pytest.mark.parametrize("dtype", [torch.float16, FP8])
def test_nan_keys_and_unfilled_pages_match_reference(kernel_device, dtype):
    """NaN index keys rank as -inf (the block's other keys still count) and a negative page id in
    the block table reads nothing, in the kernels exactly as in the reference. fp8 (e4m3's NaN is
    S.1111.111) on the GPU only: Triton's interpreter converts that pattern to +-480."""
    if dtype == FP8 and kernel_device != "cuda":
        pytest.skip("Triton's interpreter reads e4m3 NaN as +-480")
    step, q, c, dstep = _index_case(kernel_device, dtype, dtype, integer=True)
    c = c.clone()
    c[int(step.block_table[0, 1]), :5] = float("nan")  # part of a page request 0 reads
    c[int(step.block_table[3, 0])] = float("nan")  # a whole page of request 3
    # part of a page of request 3 (a 20-token chunk: the prefill tile launch), including its last
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


@pytest.mark.parametrize("block, index_dim, head_dim", [(32, 64, 128), (64, 256, 256)])
def test_other_block_sizes_and_head_dims(kernel_device, block, index_dim, head_dim):
    """Block sizes and head dims besides the 16/32/64 of the cases above: exact selection on
    integer inputs, attention within tolerance, one step with a decode, a verify and a chunk."""
    q_lens, seq_lens = [1, 3, 18], [5 * block + 3, 2 * block, 4 * block - 1]
    step = make_step(q_lens, seq_lens, block_size=block, extra_columns=1)
    d = _to(make_step(q_lens, seq_lens, block_size=block, extra_columns=1), kernel_device)
    qi, ci = random_index_inputs(step, num_heads=2, head_dim=index_dim, block_size=block,
                                 q_dtype=torch.float16, cache_dtype=torch.float16, integer=True)
    want = ref.select_blocks(qi, ci, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=3,
                             block_size=block)
    got = openmsa.select_blocks(qi.to(kernel_device), ci.to(kernel_device), d.cu_seqlens_q,
                                d.seq_lens, d.block_table, topk=3, block_size=block)
    assert torch.equal(got.cpu(), want)
    k, v = random_kv_cache(step.num_pages, block, 1, head_dim, dtype=torch.float16)
    q = torch.randn(step.num_tokens, 2, head_dim).half()
    want = ref.sparse_attention(q, k, v, want, step.cu_seqlens_q, step.seq_lens,
                                step.block_table, block_size=block)
    out = openmsa.sparse_attention(q.to(kernel_device), k.to(kernel_device), v.to(kernel_device),
                                   got, d.cu_seqlens_q, d.seq_lens, d.block_table,
                                   block_size=block)
    assert_close(out, want)


@triton.jit
def _split_pairs_kernel(x_ptr, lo_ptr, hi_ptr, PTX: tl.constexpr, N: tl.constexpr):
    i = tl.program_id(0) * N + tl.arange(0, N)
    lo, hi = split_e4m3_pairs(tl.load(x_ptr.to(tl.pointer_type(tl.uint16)) + i), PTX)
    tl.store(lo_ptr + i, lo)
    tl.store(hi_ptr + i, hi)


def test_fp8_byte_pairs_split_exactly_on_every_pattern(kernel_device):
    """split_e4m3_pairs (the attention's fp8 V path) on all 65536 16-bit patterns: low and high
    bytes as fp16 bit for bit as torch converts them, signed zeros, subnormals, the extremes
    (+-448) and NaN included; the PTX path on the GPU, the casts under the interpreter."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    lo = torch.empty(65536, dtype=torch.float16, device=kernel_device)
    hi = torch.empty_like(lo)
    _split_pairs_kernel[(64,)](x.to(kernel_device), lo, hi, PTX=kernel_device == "cuda", N=1024)
    # little-endian: element bits 0-7 are its first byte
    raw = x.view(torch.uint8).view(-1, 2)
    for got, byte in ((lo, raw[:, 0]), (hi, raw[:, 1])):
        want = byte.contiguous().view(FP8).to(torch.float16)
        got = got.cpu()
        assert torch.equal(got.isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16))


@triton.jit
def _find_request_kernel(cu_ptr, guess_ptr, out_ptr, num_requests):
    t = tl.program_id(0)
    tl.store(out_ptr + t, find_request(cu_ptr, num_requests, t, tl.load(guess_ptr + t)))


def test_find_request_with_any_guess(kernel_device):
    """find_request's guess (one check of cu[g] <= t < cu[g+1] before the binary search) gives
    the search's answer for every guess: right ones, wrong ones, -1, out of range; on layouts
    with zero-length requests, padding tokens past cu[R] and equal q_len (where t * R // T is
    always right)."""
    g = torch.Generator().manual_seed(11)
    layouts = [[1] * 8, [4] * 5, [0, 3, 0, 0, 2, 5, 0], [1, 3, 0, 20, 1, 0], [7], [0, 0, 2]]
    for q_lens in layouts:
        cu = torch.tensor([0] + q_lens).cumsum(0).int()
        num_tokens = int(cu[-1]) + 3  # 3 padding tokens
        r = len(q_lens)
        t = torch.arange(num_tokens)
        want = torch.searchsorted(cu[1:], t, right=True).clamp(max=r).int()
        guesses = [t * r // num_tokens, want.long(), torch.full_like(t, -1),
                   torch.full_like(t, r + 2), torch.randint(0, r, (num_tokens,), generator=g)]
        for guess in guesses:
            out = torch.full((num_tokens,), -7, dtype=torch.int32, device=kernel_device)
            _find_request_kernel[(num_tokens,)](cu.to(kernel_device),
                                                guess.int().to(kernel_device), out, r)
            assert torch.equal(out.cpu(), want), (q_lens, guess)


def test_launch_plans_follow_knobs_and_layouts(kernel_device, monkeypatch):
    """The selection's cached launch plans (ops/common/launch.py): a repeated call reuses its
    plan; a changed selection option makes a new one, and every call matches the reference.
    (sparse_attention's: tests/ops/test_attention.py.)"""
    from openmsa.ops.common.launch import PlanCache
    plans = []
    monkeypatch.setattr(indexer_api, "_PLANS", PlanCache())
    orig = indexer_api._select_plan
    monkeypatch.setattr(indexer_api, "_select_plan",
                        lambda *a, **k: plans.append(1) or orig(*a, **k))
    step = make_step(Q_LENS, SEQ_LENS, block_size=B, extra_columns=2, pad_tokens=2,
                     generator=torch.Generator().manual_seed(7))
    dstep = _to(make_step(Q_LENS, SEQ_LENS, block_size=B, extra_columns=2, pad_tokens=2,
                          generator=torch.Generator().manual_seed(7)), kernel_device)
    iq, ic = random_index_inputs(step, num_heads=2, head_dim=16, block_size=B,
                                 q_dtype=torch.float16, cache_dtype=torch.float16, integer=True)
    iargs = (iq.to(kernel_device), ic.to(kernel_device), dstep.cu_seqlens_q, dstep.seq_lens,
             dstep.block_table)
    for topk, hint in ((4, None), (4, None), (3, None), (4, 32)):
        got = openmsa.select_blocks(*iargs, topk=topk, block_size=B, max_q_len=hint)
        assert torch.equal(got.cpu(), ref.select_blocks(
            iq, ic, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=topk,
            block_size=B))
    assert len(plans) == 3  # topk 4, topk 3, the hint
