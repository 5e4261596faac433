# SPDX-License-Identifier: Apache-2.0
"""Shared @triton.jit helpers of the kernels."""
