# SPDX-License-Identifier: Apache-2.0
"""openmsa: MiniMax Sparse Attention (MSA) for inference engines.

Public names only; see ../../README.md and docs/ for the layout of the package.
"""

from . import nvfp4, reference
from .batch import validate_batch
from .config import MSAConfig
# each op's launch config (every knob of the op): `config=` of the op, `cache_config=` of
# fused_prepare
from .ops.attention.api import sparse_attention, sparse_page_table
from .ops.attention.plan import AttentionConfig
from .ops.cache.api import fused_prepare, write_index_cache, write_kv_cache
from .ops.cache.plan import CacheConfig
from .ops.indexer.api import block_scores, prepare_and_select, select_blocks
from .ops.indexer.plan import IndexerConfig
from .layer import MSAAttention
from .nvfp4 import dequantize_index_pages
from .metadata import MSAMetadata, MSAPlanner
from .support import unsupported_reason

__version__ = "0.1.0"


def __getattr__(name):
    # `openmsa.integrations` (optional dependencies) is imported on first use only
    if name == "integrations":
        import importlib
        return importlib.import_module(".integrations", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MSAConfig", "block_scores", "select_blocks", "sparse_attention", "sparse_page_table",
           "validate_batch", "write_index_cache", "write_kv_cache", "fused_prepare",
           "prepare_and_select",
           "unsupported_reason", "reference", "MSAAttention", "MSAPlanner", "MSAMetadata",
           "IndexerConfig", "AttentionConfig", "CacheConfig", "nvfp4", "dequantize_index_pages",
           "__version__"]
