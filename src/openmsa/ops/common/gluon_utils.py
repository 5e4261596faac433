# SPDX-License-Identifier: Apache-2.0
"""Shared @gluon.jit helpers of the Hopper kernels (Gluon cannot call @triton.jit functions)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def find_request(cu_ptr, num_requests, token):
    """The smallest r with cu[r + 1] > token (R if none): triton_utils.find_request without
    the guess."""
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
