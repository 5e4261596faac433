# SPDX-License-Identifier: Apache-2.0
"""The geometry the index branch's kernels are written for: sizes a kernel body assumes, which
the plan (plan.py) and the kernels (kernels/) both read. Not knobs: changing one means changing
a kernel. The launch knobs are plan.py's IndexerConfig."""

__all__ = ["SMALL_Q", "ANY_Q", "DECODE_ROWS", "SECTOR_BLOCKS", "GLUON_WG_ROWS", "GLUON_CH",
           "GLUON_CONSUMERS", "GLUON_WARPS", "NVFP4_DECODE_WARPS", "NVFP4_ROWS",
           "SHORT_ROWS_MAX_KP", "GROUP_MAX_KP", "WARP", "MIN_ARANGE", "MIN_DOT_K", "MIN_DOT_K_FP8"]

# requests with q_len <= SMALL_Q (decode, speculative verify) take the decode launch, which
# walks a request's tokens in one program (the max_q_len hint's bound, docs/spec.md)
SMALL_Q = 16
# the decode launch's q_len bound when the caller's max_q_len says no request is long
ANY_Q = 2 ** 30
# (token, head) rows of the decode launch's tensor-core tile (the MMA's smallest M)
DECODE_ROWS = 16
# fp32 scores of 8 blocks: one 32-byte sector of a score row (the Gluon prefill launch's least
# split)
SECTOR_BLOCKS = 8
# the Gluon prefill kernel (kernels/scores_gluon.py): rows per consumer warpgroup (Hopper's MMA
# M), blocks per chunk of a consumer's maxima (each chunk stored as one [CH, 64] tile), its
# consumer warpgroups (the kernel body writes out four), and its warps at launch (one consumer
# warpgroup; the partitions add theirs)
GLUON_WG_ROWS = 64
GLUON_CH = 32
GLUON_CONSUMERS = 4
GLUON_WARPS = 4
# the Gluon NVFP4 decode kernel (kernels/scores_nvfp4.py): one-warp programs (its MMA layout
# has one warp), and the (token, head) rows of a pass (the MMA's N: 8, or 16)
NVFP4_DECODE_WARPS = 1
NVFP4_ROWS = (8, 16)
# the most KP (a power of two >= topk) the short-row selection (kernels/select_rows.py) and the
# group-bound selection (kernels/select.py) hold per row
SHORT_ROWS_MAX_KP = 64
GROUP_MAX_KP = 32
# threads of a warp (the short-row selection's most threads per row)
WARP = 32
# the least tl.arange extent the context-parallel kernels lay out (a tile Triton lays out)
MIN_ARANGE = 16
# the least reduction depth of a tensor-core dot (Triton's min_dot_size on NVIDIA): 16 for 16-bit
# and fp32 operands, 32 for fp8 ones; the scoring kernel pads the index head dim up to it
MIN_DOT_K = 16
MIN_DOT_K_FP8 = 32
