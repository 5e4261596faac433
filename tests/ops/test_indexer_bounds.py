# SPDX-License-Identifier: Apache-2.0
"""The index branch under metadata that breaks the contract (docs/spec.md, "Bounds"): page ids
outside the cache, a table narrower than a request needs, malformed cu_seqlens_q and seq_lens.
The reference gives the spec's result; the kernels (interpreter or GPU) give the reference's,
and write nothing outside their outputs."""

from __future__ import annotations

import pytest
import torch

import openmsa
from openmsa.batch import token_layout
from openmsa.ops.indexer import reference as indexer_ref

from helpers.cp_cases import simulate
from helpers.steps import make_step, random_index_inputs

B = 16
Q_LENS = [1, 3, 0, 20, 1]
SEQ_LENS = [70, 45, 9, 100, 5]
RULE = dict(topk=4, init_blocks=1, local_blocks=1)


def _base(seed=0, q_dtype=torch.float32, c_dtype=torch.float32, dim=32, block_size=B):
    step = make_step(Q_LENS, SEQ_LENS, block_size=block_size, extra_columns=1, pad_tokens=2,
                     generator=torch.Generator().manual_seed(seed))
    q, c = random_index_inputs(step, num_heads=2, head_dim=dim, block_size=block_size,
                               q_dtype=q_dtype, cache_dtype=c_dtype, integer=True,
                               generator=torch.Generator().manual_seed(seed + 1))
    return step, q, c


def _hostile(name, step):
    """(cu_seqlens_q, seq_lens, block_table) of the step with one contract broken."""
    cu, sl, bt = step.cu_seqlens_q.clone(), step.seq_lens.clone(), step.block_table.clone()
    pages = step.num_pages
    if name == "page_past_cache":
        bt[0, 1], bt[3, 2], bt[1, 0] = pages, pages + 7, 2 ** 30
    elif name == "negative_page":
        bt[0, 2], bt[3, 0], bt[3, 5] = -2, -(2 ** 31), -7
    elif name == "narrow_table":
        # request 3 needs 7 blocks of 16 for 100 keys: give it 2000 keys against 8 columns
        sl[3] = 2000
        sl[0] = bt.shape[1] * B + 1
    elif name == "q_len_past_seq_len":
        sl[1] = 2
    elif name == "cu_decreasing":
        cu[2] = cu[3] + 1
    elif name == "cu_not_from_zero":
        cu[0] = 1
    elif name == "cu_past_tokens":
        cu[-1] = step.num_tokens + 3
    else:
        raise AssertionError(name)
    return cu, sl, bt


CASES = ["page_past_cache", "negative_page", "narrow_table", "q_len_past_seq_len",
         "cu_decreasing", "cu_not_from_zero", "cu_past_tokens"]
MALFORMED_STEP = {"cu_decreasing", "cu_not_from_zero", "cu_past_tokens"}


@pytest.mark.reference
@pytest.mark.parametrize("name", CASES)
def test_reference_gives_the_spec_result(name):
    """Entries outside [0, P) score -inf and nothing else changes; a malformed step is padding
    as a whole; a malformed request's tokens are padding and the others keep their result."""
    step, q, c = _base()
    cu, sl, bt = _hostile(name, step)
    scores = indexer_ref.block_scores(q, c, cu, sl, bt, block_size=B)
    indices = indexer_ref.select_blocks(q, c, cu, sl, bt, block_size=B, **RULE)
    _, pos = token_layout(cu, sl, step.num_tokens, block_size=B, table_width=bt.shape[1])
    if name in MALFORMED_STEP:
        assert (pos == -1).all()
        assert torch.equal(indices, torch.full_like(indices, -1))
        assert (scores == float("-inf")).all()
        return
    base_scores = indexer_ref.block_scores(q, c, step.cu_seqlens_q, step.seq_lens,
                                           step.block_table, block_size=B)
    if name in ("page_past_cache", "negative_page"):
        changed = bt != step.block_table
        for r, j in changed.nonzero().tolist():
            rows = slice(int(cu[r]), int(cu[r + 1]))
            assert (scores[rows, :, j] == float("-inf")).all()
        # an equivalent table with -1 at those entries gives the same scores
        minus_one = torch.where(changed, torch.full_like(bt, -1), bt)
        assert torch.equal(scores, indexer_ref.block_scores(q, c, cu, sl, minus_one,
                                                            block_size=B))
    else:
        bad = {"narrow_table": [0, 3], "q_len_past_seq_len": [1]}[name]
        for r in range(len(SEQ_LENS)):
            rows = slice(int(cu[r]), int(cu[r + 1]))
            if r in bad:
                assert (pos[rows] == -1).all() and (indices[rows] == -1).all()
                assert (scores[rows] == float("-inf")).all()
            else:
                assert torch.equal(scores[rows], base_scores[rows])


def _guarded(shape, dtype, fill, device):
    """A tensor of `shape` inside a larger buffer filled with `fill`: (view, buffer)."""
    margin = 64
    n = 1
    for s in shape:
        n *= s
    buf = torch.full((n + 2 * margin,), fill, dtype=dtype, device=device)
    return buf[margin:margin + n].view(shape), buf, margin


def _check_margins(buf, margin, fill):
    for part in (buf[:margin], buf[-margin:]):
        assert torch.equal(part, torch.full_like(part, fill)), "written outside the output"


@pytest.mark.interpret
@pytest.mark.parametrize("name", CASES)
def test_kernels_equal_the_reference(kernel_device, name):
    """block_scores and select_blocks on the kernel path: the reference's scores and the same
    indices bit for bit (integer inputs: ties decided by the tie rule), nothing written outside
    the outputs; with and without the decode hint (decode and prefill launches)."""
    step, q, c = _base(q_dtype=torch.float16, c_dtype=torch.float16)
    cu, sl, bt = _hostile(name, step)
    want_s = indexer_ref.block_scores(q, c, cu, sl, bt, block_size=B)
    want_i = indexer_ref.select_blocks(q, c, cu, sl, bt, block_size=B, **RULE)
    args = tuple(x.to(kernel_device) for x in (q, c, cu, sl, bt))
    for max_q_len in (None, 20):
        out, buf, margin = _guarded(want_s.shape, torch.float32, 12345.0, kernel_device)
        openmsa.block_scores(*args, block_size=B, out=out, max_q_len=max_q_len)
        _check_margins(buf, margin, 12345.0)
        # blocks past a token's causal ones are -inf on both paths
        assert torch.equal(out.cpu(), want_s), (name, max_q_len)
        idx, buf, margin = _guarded(want_i.shape, torch.int32, 777, kernel_device)
        openmsa.select_blocks(*args, block_size=B, out=idx, max_q_len=max_q_len, **RULE)
        _check_margins(buf, margin, 777)
        assert torch.equal(idx.cpu(), want_i), (name, max_q_len)


# a decode and verify step (every request the decode launch's) with padding tokens
DECODE_Q_LENS = [1, 3, 0, 4, 1]


@pytest.mark.interpret
@pytest.mark.parametrize("name", [None, *CASES])
def test_decode_steps_equal_the_reference(kernel_device, name):
    """A step of the decode launch alone (no prefill launch) under every broken contract:
    the reference's indices (padding tokens' and invalid requests' rows -1, a malformed step
    all -1) on the threshold and the sort paths, nothing written outside the output."""
    step = make_step(DECODE_Q_LENS, SEQ_LENS, block_size=B, extra_columns=1, pad_tokens=2,
                     generator=torch.Generator().manual_seed(5))
    q, c = random_index_inputs(step, num_heads=2, head_dim=32, block_size=B,
                               q_dtype=torch.float16, cache_dtype=torch.float16, integer=True,
                               generator=torch.Generator().manual_seed(6))
    cu, sl, bt = ((step.cu_seqlens_q, step.seq_lens, step.block_table) if name is None
                  else _hostile(name, step))
    want = indexer_ref.select_blocks(q, c, cu, sl, bt, block_size=B, **RULE)
    args = tuple(x.to(kernel_device) for x in (q, c, cu, sl, bt))
    for config in (None, openmsa.IndexerConfig().replace(select={"sort_waves": 2 ** 20})):
        idx, buf, margin = _guarded(want.shape, torch.int32, 777, kernel_device)
        openmsa.select_blocks(*args, block_size=B, out=idx, config=config, **RULE)
        _check_margins(buf, margin, 777)
        assert torch.equal(idx.cpu(), want), (name, config)


@pytest.mark.interpret
@pytest.mark.parametrize("name", ["page_past_cache", "negative_page", "narrow_table",
                                  "cu_decreasing"])
def test_nvfp4_kernels_equal_the_reference(kernel_device, name):
    """The NVFP4 scoring path (Di = B = 128) under the same hostile tables."""
    block = 128
    step = make_step([1, 2], [300, 130], block_size=block, extra_columns=1,
                     generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-2, 3, (step.num_tokens, 1, 128), generator=g).float()
    keys = torch.randn(step.num_pages * block, 128, generator=g)
    cache = torch.zeros(step.num_pages, block, 72, dtype=torch.uint8)
    openmsa.reference.write_index_cache(keys, cache, torch.arange(step.num_pages * block))
    cu, sl, bt = step.cu_seqlens_q.clone(), step.seq_lens.clone(), step.block_table.clone()
    if name == "page_past_cache":
        bt[0, 1] = step.num_pages + 1
    elif name == "negative_page":
        bt[0, 0] = -5
    elif name == "narrow_table":
        sl[1] = bt.shape[1] * block + 1
    else:
        cu[1] = cu[2] + 1
    q = q.to(torch.float16)
    want = indexer_ref.select_blocks(q, cache, cu, sl, bt, block_size=block, topk=2,
                                     init_blocks=0, local_blocks=1)
    want_s = indexer_ref.block_scores(q, cache, cu, sl, bt, block_size=block)
    args = tuple(x.to(kernel_device) for x in (q, cache, cu, sl, bt))
    got_s = openmsa.block_scores(*args, block_size=block, max_q_len=2)
    finite = want_s.isfinite()
    assert torch.equal(got_s.cpu().isfinite(), finite)
    torch.testing.assert_close(got_s.cpu()[finite], want_s[finite], rtol=1e-5, atol=1e-3)
    got = openmsa.select_blocks(*args, block_size=block, topk=2, init_blocks=0,
                                local_blocks=1, max_q_len=2)
    assert torch.equal(got.cpu(), want)


@pytest.mark.interpret
@pytest.mark.parametrize("name", ["page_past_cache", "narrow_table", "cu_decreasing"])
def test_context_parallel_kernels_equal_the_reference(kernel_device, name):
    """Context-parallel selection (ranks run one after another) under hostile metadata: the
    one-device reference's selection."""
    step, q, c = _base(q_dtype=torch.float16, c_dtype=torch.float16)
    cu, sl, bt = _hostile(name, step)
    want = indexer_ref.select_blocks(q, c, cu, sl, bt, block_size=B, **RULE)
    args = tuple(x.to(kernel_device) for x in (q, c, cu, sl, bt))
    got = simulate(args, (RULE["topk"], RULE["init_blocks"], RULE["local_blocks"]), 2)
    assert torch.equal(got.cpu(), want)


@pytest.mark.interpret
@pytest.mark.parametrize("where", [None, 35])
def test_a_decrease_past_the_first_chunk_of_offsets_pads_the_step(kernel_device, where):
    """The kernels check cu_seqlens_q a chunk of offsets at a time: a decrease in a later chunk
    (40 decode requests) still makes the whole step padding, as in the reference."""
    q_lens, seq_lens = [1] * 40, [20 + 3 * r for r in range(40)]
    step = make_step(q_lens, seq_lens, block_size=B, generator=torch.Generator().manual_seed(5))
    q, c = random_index_inputs(step, num_heads=1, head_dim=16, block_size=B,
                               q_dtype=torch.float16, cache_dtype=torch.float16, integer=True,
                               generator=torch.Generator().manual_seed(6))
    cu = step.cu_seqlens_q.clone()
    if where is not None:
        cu[where] = cu[where + 1] + 1
    want = indexer_ref.select_blocks(q, c, cu, step.seq_lens, step.block_table, block_size=B,
                                     **RULE)
    assert (want == -1).all() == (where is not None)
    args = tuple(x.to(kernel_device) for x in (q, c, cu, step.seq_lens, step.block_table))
    got = openmsa.select_blocks(*args, block_size=B, **RULE)
    assert torch.equal(got.cpu(), want)
