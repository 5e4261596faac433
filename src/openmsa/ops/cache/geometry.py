# SPDX-License-Identifier: Apache-2.0
"""The RoPE table's layout, shared by the plan (plan.py), the table (api.py's rope_table) and
the preparation kernel (kernels/prepare.py). No kernels here, so the pure plan imports no
device code."""

# the coarse table covers positions below ROPE_MAX_POSITION (16M tokens, 4 MiB at 64 dims);
# positions split as p = hi * ROPE_FINE + lo, one fine and one coarse row combined
ROPE_MAX_POSITION = 1 << 24
ROPE_FINE = 1024
