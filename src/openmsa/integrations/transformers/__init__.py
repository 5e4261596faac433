# SPDX-License-Identifier: Apache-2.0
"""transformers' MiniMax-M3 on openmsa: `use_openmsa(model)` swaps the attention of every sparse
layer (`layer_types[i] == "minimax_m3_sparse"`) of a `MiniMaxM3VLForCausalLM`, or of the VL
wrapper's language model, for an `MSAAttention` over paged caches this module manages; the rest
of the model (embeddings, full-attention layers, MLPs, the LM head, `generate`) stays
transformers'.

How a step runs. A forward pre-hook on the text model reads the step's 2-D attention mask (or
None) and how many tokens the transformers cache already holds. The first sparse layer of the
step then plans it once for all sparse layers: the step's real tokens (mask 1) of each batch row
are appended to that row's openmsa sequence, so a row's blocks follow its own content positions
whatever padding surrounds them (left padding gives the same blocks as the prompt alone); padding
tokens are neither written nor attended and get a zero attention output. Tokens are packed row
after row and cut into chunks of at most `max_chunk_tokens`, each planned with `MSAPlanner` and run
through `MSAAttention` (fused_prepare, select_blocks, sparse_attention), in order. The
transformers cache keeps, for a sparse layer, a one-element-per-token placeholder only, so that
its length bookkeeping (positions, masks of the full-attention layers) goes on as before.

The openmsa caches of a generation belong to the transformers cache object that `generate` (or
the caller) passes; they are released when that object is garbage collected, or reused when a
step starts again from an empty cache.

The package, one module a role: `api` (use_openmsa: the options, then the rest installed),
`attention` (the layer swap), `steps` (a step's hooks, chunks and plans), `sessions` (the openmsa
side of each transformers cache), `pages` (the paged caches and their free list), `guards` (what
`generate` and `save_pretrained` refuse).
"""

from .api import use_openmsa
from .attention import OpenMSASparseAttention

__all__ = ["use_openmsa", "OpenMSASparseAttention"]
