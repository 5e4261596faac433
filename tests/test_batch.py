# SPDX-License-Identifier: Apache-2.0
import pytest
import torch

from openmsa import validate_batch
from openmsa.batch import token_layout

pytestmark = pytest.mark.reference


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


def test_right_aligned_positions_mixed_step():
    # a prefill chunk (3 tokens after 5), a decode, a 4-token verify, a padding request, and a
    # padding token after cu_seqlens_q[R]
    cu = _i32([0, 3, 4, 8, 8])
    sl = _i32([8, 20, 11, 0])
    req, pos = token_layout(cu, sl, 9)
    assert req.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 4]
    assert pos.tolist() == [5, 6, 7, 19, 7, 8, 9, 10, -1]


def test_malformed_request_is_padding():
    req, pos = token_layout(_i32([0, 3]), _i32([2]), 3)
    assert pos.tolist() == [-1, -1, -1]


def test_validate_batch_accepts_good_step():
    validate_batch(_i32([0, 1, 5]), _i32([300, 4]), _i32([[0, 1, 2], [3, -1, -1]]),
                   block_size=128, num_pages=4)


@pytest.mark.parametrize("cu, sl, bt, num_pages, match", [
    ([1, 2], [5], [[0]], None, "cu_seqlens_q\\[0\\]"),
    ([0, 3, 2], [5, 5], [[0], [1]], None, "request 1: cu_seqlens_q decreases"),
    ([0, 6], [5], [[0]], None, "request 0: q_len 6 exceeds seq_len 5"),
    ([0, 1], [300], [[0, 1]], None, "request 0: seq_len 300 needs 3 blocks"),
    ([0, 1], [200], [[0, 9]], 4, "request 0: block_table\\[0, 1\\] = 9"),
    ([0, 1], [200], [[-1, 0]], 4, "block_table\\[0, 0\\] = -1"),
    ([0, 1], [-2], [[0]], None, "seq_lens is negative"),
])
def test_validate_batch_rejects(cu, sl, bt, num_pages, match):
    with pytest.raises(ValueError, match=match):
        validate_batch(_i32(cu), _i32(sl), _i32(bt), block_size=128, num_pages=num_pages)


def test_validate_batch_types():
    with pytest.raises(TypeError, match="seq_lens"):
        validate_batch(_i32([0, 1]), torch.tensor([5]), _i32([[0]]))
    with pytest.raises(ValueError, match="cu_seqlens_q must have"):
        validate_batch(_i32([0, 1, 2]), _i32([5]), _i32([[0]]))


def test_validate_batch_checks_the_token_count():
    """cu_seqlens_q past the step's tokens is malformed (docs/spec.md, "Bounds"): token_layout
    pads the step, validate_batch names it when given num_tokens."""
    cu, sl, bt = _i32([0, 5]), _i32([5]), _i32([[0]])
    validate_batch(cu, sl, bt, num_tokens=5)
    assert token_layout(cu, sl, 3, block_size=128, table_width=1)[1].tolist() == [-1] * 3
    with pytest.raises(ValueError, match="past the step's 3 tokens"):
        validate_batch(cu, sl, bt, num_tokens=3)
    with pytest.raises(TypeError, match="num_tokens"):
        validate_batch(cu, sl, bt, num_tokens=3.0)
    with pytest.raises(TypeError, match="block_size and table_width"):
        token_layout(cu, sl, 3, table_width=1)
