# SPDX-License-Identifier: Apache-2.0
"""Shared @gluon.jit helpers of the Hopper kernels (Gluon cannot call @triton.jit functions)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def find_request(cu_ptr, num_requests, token):
    """The smallest r with cu[r + 1] > token (R if none), for one token or for each of a tensor
    of tokens (a lane's own lookup): triton_utils.find_request without the guess. A tensor's
    lookups halve their intervals in step, floor(log2(R)) + 1 times (which empties any interval
    of R), each lane's load masked once its interval is empty."""
    if token.type.is_block():
        lo = gl.zeros_like(token)
        hi = gl.zeros_like(token) + num_requests
        steps = 0
        left = num_requests
        while left > 0:
            left = left // 2
            steps += 1
        for _ in range(steps):
            active = lo < hi
            mid = (lo + hi) // 2
            after = gl.load(cu_ptr + mid + 1, mask=active, other=0) > token
            hi = gl.where(active & after, mid, hi)
            lo = gl.where(active & (after == 0), mid + 1, lo)
    else:
        lo = 0
        hi = num_requests
        while lo < hi:
            mid = (lo + hi) // 2
            if gl.load(cu_ptr + mid + 1) > token:
                hi = mid
            else:
                lo = mid + 1
    return lo


@gluon.jit
def step_well_formed(cu_ptr, num_requests, num_tokens):
    """triton_utils.step_well_formed: cu_seqlens_q starts at 0, never decreases and ends at most
    at num_tokens (else the step is padding as a whole), a warp's 32 offsets at a time (as
    triton_utils.step_well_formed)."""
    CHUNK: gl.constexpr = 32
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    ok = (gl.load(cu_ptr) == 0) & (gl.load(cu_ptr + num_requests) <= num_tokens)
    for i in range(0, num_requests, CHUNK):
        r = i + gl.arange(0, CHUNK, layout=layout)
        m = r < num_requests
        a = gl.load(cu_ptr + r, mask=m, other=0)
        b = gl.load(cu_ptr + r + 1, mask=m, other=0)
        ok = ok & (gl.sum((m & (b < a)).to(gl.int32), axis=0) == 0)
    return ok


@gluon.jit
def request_ok(q_len, seq_len, table_width, BLOCK: gl.constexpr):
    """triton_utils.request_ok: q_len <= seq_len and a table column for every block."""
    return (seq_len >= q_len) & ((seq_len - 1) // BLOCK < table_width)


@gluon.jit
def token_position(cu_ptr, seq_lens_ptr, num_requests, num_tokens, table_width, token,
                   BLOCK: gl.constexpr):
    """(request, position) of each packed token of a tensor, right-aligned in its request
    (docs/spec.md, "Batch layout"); the position is -1 for padding (triton_utils.token_position:
    a token past cu[R], a request failing request_ok, a step failing step_well_formed)."""
    r = find_request(cu_ptr, num_requests, token)
    real = r < num_requests
    t_req = gl.load(cu_ptr + r, mask=real, other=0)
    q_len = gl.load(cu_ptr + r + 1, mask=real, other=0) - t_req
    seq_len = gl.load(seq_lens_ptr + r, mask=real, other=0)
    ok = (real & request_ok(q_len, seq_len, table_width, BLOCK) & (token >= t_req)
          & step_well_formed(cu_ptr, num_requests, num_tokens))
    return r, gl.where(ok, seq_len - q_len + (token - t_req), -1)


@gluon.jit
def tile_position(cu_ptr, seq_lens_ptr, num_requests, t0):
    """The position of packed token t0 in its request (right-aligned: seq_len - q_len + its
    index), for a token the caller knows to lie in a request with valid positions (no padding
    check: triton_utils.tile_position's `whole` was true for its tile)."""
    r = find_request(cu_ptr, num_requests, t0)
    t_req = gl.load(cu_ptr + r)
    return gl.load(seq_lens_ptr + r) - (gl.load(cu_ptr + r + 1) - t_req) + (t0 - t_req)


@gluon.jit
def launch_dependents():
    """griddepcontrol.launch_dependents: the launch after this one, if it is a programmatic
    dependent launch, may start once every program of this one has passed here."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def wait_prerequisites():
    """griddepcontrol.wait: this program waits until the launch it is a programmatic dependent
    of has finished and its writes are visible (returns at once otherwise)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)
