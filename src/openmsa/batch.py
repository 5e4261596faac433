# SPDX-License-Identifier: Apache-2.0
"""The layout of one forward step (docs/spec.md, Batch layout and Padding): packed query tokens,
right-aligned against each request's KV.

A step holds R requests and T query tokens. `cu_seqlens_q` (int32 [R+1]) gives token offsets and
`seq_lens` (int32 [R]) the KV length after this step's tokens were written. Token i of request r
sits at position p = seq_lens[r] - q_len[r] + i and sees keys 0..p. A token at or past
`cu_seqlens_q[R]` belongs to no request, and every token of a request with q_len > seq_len
(malformed; rejected by `validate_batch`) sees nothing.

`token_layout` is the host-side request lookup, the one the references and the planner share
(the kernels' device-side lookups are ops/common/triton_utils.py and gluon_utils.py).
"""

from __future__ import annotations

import torch

__all__ = ["token_layout", "validate_batch", "num_causal_blocks"]


def token_layout(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token request id and position, computed on the tensors' device without a host sync.

    Returns:
        request: int32 [T], the request of each token, or R for a token past cu_seqlens_q[R].
        position: int32 [T], the token's position in its request, or -1 for padding tokens.
    """
    device = cu_seqlens_q.device
    num_requests = seq_lens.shape[0]
    t = torch.arange(num_tokens, device=device, dtype=torch.int64)
    cu = cu_seqlens_q.to(torch.int64)
    # request r holds tokens cu[r] <= t < cu[r+1]: the count of ends <= t is r
    request = torch.searchsorted(cu[1:].contiguous(), t, right=True)
    valid = request < num_requests
    r = request.clamp(max=max(num_requests - 1, 0))
    if num_requests == 0:
        return request.to(torch.int32), torch.full_like(t, -1, dtype=torch.int32)
    q_len = cu[1:] - cu[:-1]
    pos = seq_lens.to(torch.int64)[r] - q_len[r] + (t - cu[r])
    # a request with q_len > seq_len is malformed (validate_batch rejects it): all its tokens pad
    ok = valid & (q_len[r] <= seq_lens.to(torch.int64)[r])
    pos = torch.where(ok & (pos >= 0), pos, torch.full_like(pos, -1))
    return request.to(torch.int32), pos.to(torch.int32)


def request_spans(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int,
                  block_table: torch.Tensor, block_size: int):
    """For the references (this reads the tensors on the host): each request with tokens and
    context, as (request, first token, end token, seq_len, its nb = ceil(seq_len / B) page ids
    as int64) in order; requests with no token or no context are skipped."""
    cu, sl = cu_seqlens_q.tolist(), seq_lens.tolist()
    for r in range(len(sl)):
        start, end = cu[r], min(cu[r + 1], num_tokens)
        if end <= start or sl[r] <= 0:
            continue
        nb = -(-sl[r] // block_size)
        yield r, start, end, sl[r], block_table[r, :nb].long()


def num_causal_blocks(position: torch.Tensor, block_size: int) -> torch.Tensor:
    """n = p // B + 1 causal blocks for a token at position p; 0 for padding (p < 0)."""
    return torch.where(position >= 0, torch.div(position, block_size, rounding_mode="floor") + 1,
                       torch.zeros_like(position))


def validate_batch(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                   *, block_size: int = 128, num_pages: int | None = None) -> None:
    """Check the step's metadata values (this synchronises: call it in debug mode, not per layer).

    Checks: cu_seqlens_q starts at 0 and never decreases; seq_lens >= 0; q_len <= seq_len; the
    block table has a column for every block of every request; every page a request uses lies in
    [0, num_pages) when num_pages is given. Raises ValueError naming the first bad request.
    """
    from ._checks import check_step

    num_requests = check_step(cu_seqlens_q, seq_lens, block_table, cu_seqlens_q.device
                              if isinstance(cu_seqlens_q, torch.Tensor) else None)
    cu = cu_seqlens_q.detach().cpu().to(torch.int64)
    sl = seq_lens.detach().cpu().to(torch.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens_q[0] must be 0, got {int(cu[0])}")
    q_len = cu[1:] - cu[:-1]
    width = block_table.shape[1]
    bt = block_table.detach().cpu()
    for r in range(num_requests):
        if q_len[r] < 0:
            raise ValueError(f"request {r}: cu_seqlens_q decreases ({int(cu[r])} -> "
                             f"{int(cu[r + 1])})")
        if sl[r] < 0:
            raise ValueError(f"request {r}: seq_lens is negative ({int(sl[r])})")
        if q_len[r] > sl[r]:
            raise ValueError(f"request {r}: q_len {int(q_len[r])} exceeds seq_len {int(sl[r])}")
        nb = (int(sl[r]) + block_size - 1) // block_size
        if nb > width:
            raise ValueError(f"request {r}: seq_len {int(sl[r])} needs {nb} blocks of "
                             f"{block_size} but block_table has {width} columns")
        if num_pages is not None and nb > 0:
            pages = bt[r, :nb]
            bad = (pages < 0) | (pages >= num_pages)
            if bool(bad.any()):
                j = int(bad.nonzero()[0, 0])
                raise ValueError(f"request {r}: block_table[{r}, {j}] = {int(pages[j])} is not a "
                                 f"page in [0, {num_pages})")
