# SPDX-License-Identifier: Apache-2.0
"""Tier 0: the index-branch reference against brute force and the rules of docs/spec.md
("Block score", "Selection: forced blocks and the tie rule", "Padding")."""

import pytest
import torch

from openmsa import reference as ref
from openmsa.batch import token_layout
from openmsa.ops.indexer.reference import select_from_scores
from helpers import make_step, random_index_inputs

from brute import brute_scores, brute_select, positions

pytestmark = pytest.mark.reference

B = 16
# decode, 3-token verify, padding request (q_len 0), chunked prefill, decode in the first block,
# a request of seq_len 0, plus 2 padding tokens past cu_seqlens_q[R]
Q_LENS = [1, 3, 0, 20, 1, 0]
SEQ_LENS = [70, 45, 9, 100, 5, 0]


def _step(**kw):
    return make_step(Q_LENS, SEQ_LENS, block_size=B, extra_columns=2, pad_tokens=2, **kw)


@pytest.mark.parametrize("integer", [True, False])
def test_scores_match_brute_force(integer):
    step = _step()
    q, c = random_index_inputs(step, num_heads=3, head_dim=8, block_size=B,
                               q_dtype=torch.float32, cache_dtype=torch.float32, integer=integer)
    got = ref.block_scores(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table,
                           block_size=B)
    want = brute_scores(q, c, step.cu_seqlens_q.tolist(), step.seq_lens.tolist(),
                        step.block_table, B)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("topk, init, local", [(4, 0, 1), (3, 1, 1), (5, 2, 2), (1, 0, 1),
                                               (2, 0, 0)])
def test_selection_matches_brute_force_with_ties(topk, init, local):
    """Integer inputs make equal block scores common: the lower block must win each tie."""
    step = _step()
    q, c = random_index_inputs(step, num_heads=2, head_dim=4, block_size=B,
                               q_dtype=torch.float32, cache_dtype=torch.float32, integer=True)
    got = ref.select_blocks(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table,
                            topk=topk, init_blocks=init, local_blocks=local, block_size=B)
    scores = brute_scores(q, c, step.cu_seqlens_q.tolist(), step.seq_lens.tolist(),
                          step.block_table, B)
    _, pos = positions(step.cu_seqlens_q.tolist(), step.seq_lens.tolist(), step.num_tokens)
    ties = 0
    for t in range(step.num_tokens):
        n = pos[t] // B + 1 if pos[t] >= 0 else 0
        for h in range(2):
            row = scores[t, h].tolist()
            ties += len(row[:n]) - len(set(row[:n]))
            assert got[t, h].tolist() == brute_select(row, n, topk, init, local), (t, h)
    assert ties > 10, "the case must contain ties for the tie rule to be tested"


def test_tie_rule_and_nan_on_crafted_scores():
    scores = torch.tensor([[[1.0, 5.0, 5.0, float("nan"), 5.0, -1.0, 2.0, 0.0]]])
    pos = torch.tensor([8 * 4 - 1], dtype=torch.int32)  # n = 8 blocks of 4
    got = select_from_scores(scores, pos, topk=4, init_blocks=0, local_blocks=1, block_size=4)
    # forced last block 7, then the three 5.0s (1, 2, 4): lower blocks first on ties
    assert got.tolist() == [[[1, 2, 4, 7]]]
    got = select_from_scores(scores, pos, topk=6, init_blocks=1, local_blocks=1, block_size=4)
    assert got.tolist() == [[[0, 1, 2, 4, 6, 7]]]
    # NaN ranks as -inf: with every other score -inf it still fills the row by lowest index
    all_inf = torch.full((1, 1, 8), float("-inf"))
    all_inf[0, 0, 3] = float("nan")
    got = select_from_scores(all_inf, pos, topk=3, init_blocks=0, local_blocks=1, block_size=4)
    assert got.tolist() == [[[0, 1, 7]]]


def test_forced_blocks_win_over_infinite_scores():
    scores = torch.full((1, 1, 6), float("inf"))
    pos = torch.tensor([6 * 4 - 1], dtype=torch.int32)
    got = select_from_scores(scores, pos, topk=3, init_blocks=1, local_blocks=1, block_size=4)
    assert got.tolist() == [[[0, 1, 5]]]


def test_short_contexts_select_everything_ascending():
    step = make_step([1, 2], [3 * B, 2 * B - 5], block_size=B)
    q, c = random_index_inputs(step, num_heads=2, head_dim=8, block_size=B,
                               q_dtype=torch.float32, cache_dtype=torch.float32)
    got = ref.select_blocks(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=5,
                            block_size=B)
    assert got[0, 0].tolist() == [0, 1, 2, -1, -1]
    # request 1 sits at positions 2B-7 and 2B-6: two causal blocks each
    assert got[1, 1].tolist() == [0, 1, -1, -1, -1]
    assert got[2, 0].tolist() == [0, 1, -1, -1, -1]


def test_padding_rows_are_minus_one():
    step = _step()
    q, c = random_index_inputs(step, num_heads=2, head_dim=8, block_size=B,
                               q_dtype=torch.float32, cache_dtype=torch.float32)
    got = ref.select_blocks(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=4,
                            block_size=B)
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    pad = pos < 0
    assert pad.sum() == 2
    assert (got[pad] == -1).all()
    s = ref.block_scores(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table, block_size=B)
    assert torch.isneginf(s[pad]).all()


def test_output_is_sorted_unique_and_padded():
    step = _step()
    q, c = random_index_inputs(step, num_heads=2, head_dim=8, block_size=B,
                               q_dtype=torch.float32, cache_dtype=torch.float32)
    got = ref.select_blocks(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=4,
                            block_size=B)
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    for t in range(step.num_tokens):
        n = int(pos[t]) // B + 1 if pos[t] >= 0 else 0
        for row in got[t].tolist():
            valid = [b for b in row if b >= 0]
            assert valid == sorted(set(valid)) and len(valid) == min(n, 4)
            assert row[len(valid):] == [-1] * (4 - len(valid))
            if n:
                assert n - 1 in valid  # the query's own block is always there


def test_paged_equals_flat_and_page_permutation_is_invisible():
    step = _step()
    q, c = random_index_inputs(step, num_heads=2, head_dim=8, block_size=B,
                               q_dtype=torch.float32, cache_dtype=torch.float32)
    args = (step.cu_seqlens_q, step.seq_lens)
    base = ref.block_scores(q, c, *args, step.block_table, block_size=B)
    # flat: each request's pages copied to a contiguous run, identity-like table
    flat_pages, table = [], torch.full_like(step.block_table, -1)
    for r, sl in enumerate(step.seq_lens.tolist()):
        nb = -(-sl // B)
        table[r, :nb] = torch.arange(len(flat_pages), len(flat_pages) + nb, dtype=torch.int32)
        flat_pages += step.block_table[r, :nb].tolist()
    flat = c[torch.tensor(flat_pages, dtype=torch.long)] if flat_pages else c[:0]
    assert torch.equal(ref.block_scores(q, flat, *args, table, block_size=B), base)
    # permute physical pages
    perm = torch.randperm(c.shape[0], generator=torch.Generator().manual_seed(5))
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(len(perm))
    table2 = torch.where(step.block_table >= 0, inv[step.block_table.clamp(min=0).long()].int(),
                         step.block_table)
    assert torch.equal(ref.block_scores(q, c[perm], *args, table2, block_size=B), base)


@pytest.mark.parametrize("q_dtype, c_dtype", [(torch.bfloat16, torch.bfloat16),
                                              (torch.float16, torch.float8_e4m3fn),
                                              (torch.float8_e4m3fn, torch.float8_e4m3fn)])
def test_low_precision_inputs_score_in_fp32(q_dtype, c_dtype):
    step = _step()
    q, c = random_index_inputs(step, num_heads=2, head_dim=8, block_size=B, q_dtype=q_dtype,
                               cache_dtype=c_dtype)
    got = ref.block_scores(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table,
                           block_size=B)
    want = brute_scores(q.float(), c.float(), step.cu_seqlens_q.tolist(),
                        step.seq_lens.tolist(), step.block_table, B)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_out_buffer_strided_view():
    step = _step()
    q, c = random_index_inputs(step, num_heads=2, head_dim=8, block_size=B,
                               q_dtype=torch.float32, cache_dtype=torch.float32)
    buf = torch.full((2, step.num_tokens, 4), -7, dtype=torch.int32)
    out = buf.transpose(0, 1)
    res = ref.select_blocks(q, c, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=4,
                            block_size=B, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert torch.equal(out, ref.select_blocks(q, c, step.cu_seqlens_q, step.seq_lens,
                                              step.block_table, topk=4, block_size=B))
