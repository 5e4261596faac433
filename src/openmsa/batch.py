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

__all__ = ["token_layout", "validate_batch", "num_causal_blocks", "step_well_formed",
           "request_fits_table", "page_in_cache"]


def token_layout(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, *,
                 block_size: int | None = None, table_width: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token request id and position, computed on the tensors' device without a host sync
    (docs/spec.md, "Padding" and "Bounds").

    A token is padding (position -1) when it lies past cu_seqlens_q[R], when its request has
    q_len > seq_len, when the step's cu_seqlens_q is malformed (not starting at 0, decreasing
    somewhere, or ending past num_tokens: then every token is padding), and, given block_size
    and table_width, when its request needs more blocks than the table has columns.

    Returns:
        request: int32 [T], the request of each token, or R for a token past cu_seqlens_q[R].
        position: int32 [T], the token's position in its request, or -1 for padding tokens.
    """
    device = cu_seqlens_q.device
    num_requests = seq_lens.shape[0]
    t = torch.arange(num_tokens, device=device, dtype=torch.int64)
    cu = cu_seqlens_q.to(torch.int64)
    if num_requests == 0:
        return (torch.zeros_like(t, dtype=torch.int32),
                torch.full_like(t, -1, dtype=torch.int32))
    # request r holds tokens cu[r] <= t < cu[r+1]: the count of ends <= t is r
    request = torch.searchsorted(cu[1:].contiguous(), t, right=True)
    r = request.clamp(max=num_requests - 1)
    sl = seq_lens.to(torch.int64)
    q_len = cu[1:] - cu[:-1]
    pos = sl[r] - q_len[r] + (t - cu[r])
    ok = (request < num_requests) & (q_len[r] <= sl[r]) & step_well_formed(cu, num_tokens)
    if (table_width is None) != (block_size is None):
        raise TypeError("token_layout: give block_size and table_width together, or neither")
    if table_width is not None:
        ok &= request_fits_table(sl[r], block_size, table_width)
    pos = torch.where(ok & (pos >= 0), pos, torch.full_like(pos, -1))
    return request.to(torch.int32), pos.to(torch.int32)


def step_well_formed(cu_seqlens_q: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """A 0-d bool tensor (no host sync): cu_seqlens_q starts at 0, never decreases and ends at
    most at num_tokens. A step failing this is padding as a whole (docs/spec.md, "Bounds")."""
    cu = cu_seqlens_q.to(torch.int64)
    return (cu[0] == 0) & (cu[-1] <= num_tokens) & (cu[1:] >= cu[:-1]).all()


def request_fits_table(seq_len: torch.Tensor, block_size: int, table_width: int) -> torch.Tensor:
    """Whether a request of seq_len keys has a table column for each of its blocks (a request
    that does not is padding as a whole: docs/spec.md, "Bounds")."""
    return (seq_len <= 0) | (torch.div(seq_len - 1, block_size, rounding_mode="floor")
                             < table_width)


def page_in_cache(pages: torch.Tensor, num_pages: int) -> torch.Tensor:
    """Which table entries name a page of the cache: [0, num_pages). Any other entry (-1 for an
    unfilled one, or a stale id past the cache) reads nothing."""
    pages = pages.long()
    return (pages >= 0) & (pages < num_pages)


def request_spans(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int,
                  block_table: torch.Tensor, block_size: int):
    """For the references (this reads the tensors on the host): each request with a token that
    is not padding (token_layout with the table's width), as (request, first token, end token,
    seq_len, its nb = ceil(seq_len / B) table entries as int64) in order. A request's tokens
    that are not padding are the whole span, so the span is all a reference needs."""
    _, position = token_layout(cu_seqlens_q, seq_lens, num_tokens, block_size=block_size,
                               table_width=block_table.shape[1])
    cu, sl = cu_seqlens_q.tolist(), seq_lens.tolist()
    live = (position >= 0).tolist()
    for r in range(len(sl)):
        start, end = cu[r], min(cu[r + 1], num_tokens)
        if end <= start or start < 0 or not live[start]:
            continue
        nb = -(-sl[r] // block_size)
        yield r, start, end, sl[r], block_table[r, :nb].long()


def num_causal_blocks(position: torch.Tensor, block_size: int) -> torch.Tensor:
    """n = p // B + 1 causal blocks for a token at position p; 0 for padding (p < 0)."""
    return torch.where(position >= 0, torch.div(position, block_size, rounding_mode="floor") + 1,
                       torch.zeros_like(position))


def validate_batch(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                   *, block_size: int = 128, num_pages: int | None = None,
                   num_tokens: int | None = None) -> None:
    """Check the step's metadata values (this synchronises: call it in debug mode, not per layer).

    Checks: cu_seqlens_q starts at 0 and never decreases; seq_lens >= 0; q_len <= seq_len; the
    block table has a column for every block of every request; every page a request uses lies in
    [0, num_pages) when num_pages is given; cu_seqlens_q[R] <= num_tokens (the step's packed
    tokens, T) when num_tokens is given. Raises ValueError naming the first bad request.
    """
    from ._checks import check_step

    num_requests = check_step(cu_seqlens_q, seq_lens, block_table, cu_seqlens_q.device
                              if isinstance(cu_seqlens_q, torch.Tensor) else None)
    cu = cu_seqlens_q.detach().cpu().to(torch.int64)
    sl = seq_lens.detach().cpu().to(torch.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens_q[0] must be 0, got {int(cu[0])}")
    if num_tokens is not None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise TypeError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if cu[-1] > num_tokens:
            raise ValueError(f"cu_seqlens_q ends at {int(cu[-1])}, past the step's "
                             f"{num_tokens} tokens")
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
