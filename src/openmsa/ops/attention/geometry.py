# SPDX-License-Identifier: Apache-2.0
"""The geometry sparse_attention's kernels are written for: numbers the kernels and the plan
(plan.py) must agree on, not knobs (those are AttentionConfig's). No kernels here, so the pure
plan imports no device code."""

# rows of one Gluon tile consumer (QT tokens x GP head slots): the matrix unit's M for one
# warpgroup (kernels/tile_gluon.py's ROWS)
TILE_ROWS = 64
# tokens per tile at most: the tile plan keeps a bit per token beside 8 flag bits in an int32
TILE_MAX_TOKENS = 16
# warps at launch of the Gluon tile kernel: the consumer warpgroup its layouts are written for
# (the producer partitions add theirs)
GLUON_WARPS = 4
# the per-token kernel's rows at least (a group's heads padded up to it): tl.dot's smallest M
MIN_ROWS = 16
# warps of a sparse_page_table program: it writes one (token, KV head)'s topk <= 64 blocks'
# pages, a warp's lanes' worth
PAGE_TABLE_WARPS = 1
