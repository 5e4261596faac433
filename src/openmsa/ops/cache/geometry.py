# SPDX-License-Identifier: Apache-2.0
"""The RoPE table's layout, shared by the plan (plan.py), the table (api.py's rope_table) and
the preparation kernel (kernels/prepare.py), and the fused projection row's layout. No kernels
here, so the pure plan imports no device code."""

# the coarse table covers positions below ROPE_MAX_POSITION (16M tokens, 4 MiB at 64 dims);
# positions split as p = hi * ROPE_FINE + lo, one fine and one coarse row combined
ROPE_MAX_POSITION = 1 << 24
ROPE_FINE = 1024


def projection_widths(config) -> tuple[int, int, int, int, int]:
    """Column widths of a fused projection row `[q | k | v | index_q | index_k]` for one rank's
    config (the preparation kernel derives the same offsets from its constexprs)."""
    d, di = config.head_dim, config.index_head_dim
    return (config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d,
            config.num_index_heads * di, di)
