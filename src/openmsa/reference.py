# SPDX-License-Identifier: Apache-2.0
"""Every public op as pure PyTorch with fp32 math and the same signature: docs/spec.md in code."""

from .batch import validate_batch
from .ops.attention.reference import sparse_attention, sparse_page_table
from .ops.cache.reference import (apply_rope, fused_prepare, prepare_index_qk, prepare_qkv,
                                  rms_norm, write_index_cache, write_kv_cache)
from .ops.indexer.reference import block_scores, prepare_and_select, select_blocks

__all__ = ["block_scores", "select_blocks", "sparse_attention", "sparse_page_table",
           "validate_batch",
           "write_index_cache", "write_kv_cache", "rms_norm", "apply_rope", "prepare_index_qk",
           "prepare_qkv", "fused_prepare", "prepare_and_select"]
