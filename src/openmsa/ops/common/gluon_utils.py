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
