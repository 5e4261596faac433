# SPDX-License-Identifier: Apache-2.0
"""Public sparse_attention: validation, then the Triton kernels (CUDA, or CPU under
TRITON_INTERPRET=1) or the reference (CPU)."""

from __future__ import annotations

from ..._dispatch import use_kernels
from . import reference

__all__ = ["sparse_attention"]


def sparse_attention(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table, *,
                     scale=None, block_size=128, out=None, return_lse=False, k_scale=None,
                     v_scale=None):
    """Exact GQA attention over the selected blocks; see reference.sparse_attention."""
    if not use_kernels(q):
        return reference.sparse_attention(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens,
                                          block_table, scale=scale, block_size=block_size,
                                          out=out, return_lse=return_lse, k_scale=k_scale,
                                          v_scale=v_scale)
    raise NotImplementedError("sparse_attention has no kernel yet")
