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
