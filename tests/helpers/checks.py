# SPDX-License-Identifier: Apache-2.0
"""The one tolerance table, and the checks tests share."""

from __future__ import annotations

import torch

__all__ = ["TOLERANCES", "assert_close", "assert_selection_near_optimal"]

# (atol, rtol) by output dtype; relaxing one is a design change, not a test fix
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 msg: str = "") -> None:
    """Values within TOLERANCES[dtype]; NaN and inf positions must match exactly."""
    atol, rtol = TOLERANCES[dtype or actual.dtype]
    a, e = actual.float().cpu(), expected.float().cpu()
    assert torch.equal(a.isnan(), e.isnan()), f"NaN positions differ {msg}"
    assert torch.equal(a.isinf(), e.isinf()) and torch.equal(a[a.isinf()], e[e.isinf()]), \
        f"inf positions differ {msg}"
    finite = a.isfinite()
    torch.testing.assert_close(a[finite], e[finite], atol=atol, rtol=rtol, msg=msg or None)


def assert_selection_near_optimal(indices: torch.Tensor, scores: torch.Tensor,
                                  positions: torch.Tensor, *, topk: int, init_blocks: int,
                                  local_blocks: int, block_size: int, rtol: float = 1e-3) -> None:
    """A selection computed with other roundings than `scores` (the reference's block scores of
    the same inputs): every row holds min(n, topk) ascending distinct ids, all forced blocks, and
    each freely chosen block scores at least the best unchosen candidate's rank-th score minus a
    rounding margin. Where the scores have no near-ties this is exact selection."""
    indices, scores, positions = indices.cpu(), scores.float().cpu(), positions.cpu()
    for t in range(indices.shape[0]):
        p = int(positions[t])
        n = p // block_size + 1 if p >= 0 else 0
        for h in range(indices.shape[1]):
            row = [b for b in indices[t, h].tolist() if b >= 0]
            assert row == sorted(set(row)) and len(row) == min(n, topk), \
                f"token {t} head {h}: {indices[t, h].tolist()} for {n} causal blocks"
            if n <= topk:
                continue
            forced = {b for b in range(n) if b < init_blocks or b >= n - local_blocks}
            assert forced <= set(row), f"token {t} head {h}: forced {forced} not in {row}"
            free = torch.tensor([b for b in range(n) if b not in forced])
            cand = scores[t, h, free].nan_to_num(float("-inf"))
            kth = torch.topk(cand, topk - len(forced)).values[-1]
            for b in row:
                if b not in forced:
                    s = scores[t, h, b].nan_to_num(float("-inf"))
                    assert s >= kth - rtol * (1 + kth.abs()), \
                        f"token {t} head {h}: block {b} scores {s} < the threshold {kth}"
