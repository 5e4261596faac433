# SPDX-License-Identifier: Apache-2.0
"""The staged form of prefill scoring on NVFP4 index pages (issue 41): the pages that the long
requests' causal blocks reference, dequantized into a contiguous 16-bit staging cache, so that
the prefill launch scores them as a 16-bit cache (on Hopper: scores_gluon.py's Gluon kernel, which
reads keys by TMA and cannot dequantize), against the in-kernel form of scores.py, which
dequantizes every block in registers in each tile program that reads it.

The staging cache is [slots * width, 128, 128] (fp16, or bf16 for a bf16 query: a key value,
code * scale, is exact in both, nvfp4.py), and the remapped block table [R, width] int32 points
into it: the k-th long request of the step (in request order) owns pages [k * width,
(k + 1) * width). `slots` bounds the number of long requests from shapes alone (plan.py), so
nothing is read back on the host; a request past it is staged nowhere (its entries stay -1,
so it scores -inf; only a step whose cu_seqlens_q runs past its tokens can have one).
"""

import triton
import triton.language as tl

from .scores import _nvfp4_keys


@triton.jit
def _stage_nvfp4_kernel(cache_ptr, cu_ptr, seq_lens_ptr, bt_ptr, staged_ptr, staged_bt_ptr,
                        num_requests, width, num_pages, stride_cp, stride_btr, stride_btb, slots,
                        SMALL_Q: tl.constexpr, BPP: tl.constexpr, BLOCK: tl.constexpr,
                        DI: tl.constexpr, RCH: tl.constexpr, PTX: tl.constexpr):
    """Program (r, s): blocks [s * BPP, (s + 1) * BPP) of request r. For a long request (q_len >
    SMALL_Q, the prefill launch's rule) its causal blocks' pages are dequantized into its slot and
    their table entries point there (an entry naming no page of the cache, negative or past it,
    becomes -1: it reads nothing); every other entry of the program's part of the remapped
    table is -1 (the prefill launch never reads it)."""
    r = tl.program_id(0)
    b_first = tl.program_id(1) * BPP
    cols = b_first + tl.arange(0, BPP)
    q_len = tl.load(cu_ptr + r + 1) - tl.load(cu_ptr + r)
    seq_len = tl.load(seq_lens_ptr + r)
    is_long = q_len > SMALL_Q
    # the request's slot: how many long requests come before it
    rank = r * 0
    if is_long:
        for i in range(0, r, RCH):
            rr = i + tl.arange(0, RCH)
            before = rr < r
            t0 = tl.load(cu_ptr + rr, mask=before, other=0)
            t1 = tl.load(cu_ptr + rr + 1, mask=before, other=0)
            rank += tl.sum((before & (t1 - t0 > SMALL_Q)).to(tl.int32), axis=0)
    # the blocks the prefill launch may read: those of the request's last position, at most
    n_blocks = tl.minimum(tl.where(seq_len > 0, (seq_len - 1) // BLOCK + 1, 0), width)
    n_blocks = tl.where(is_long & (rank < slots), n_blocks, 0)
    row = bt_ptr + r.to(tl.int64) * stride_btr
    pages = tl.load(row + cols * stride_btb, mask=cols < n_blocks, other=-1)
    slot_first = rank.to(tl.int64) * width
    remapped = tl.where((pages >= 0) & (pages < num_pages), slot_first + cols, -1)
    tl.store(staged_bt_ptr + r.to(tl.int64) * width + cols, remapped.to(tl.int32),
             mask=cols < width)
    offs = tl.arange(0, BLOCK)[:, None] * DI + tl.arange(0, DI)[None, :]
    for b in range(b_first, tl.minimum(b_first + BPP, n_blocks)):
        page = tl.load(row + b * stride_btb).to(tl.int64)
        if (page >= 0) & (page < num_pages):
            k = _nvfp4_keys(cache_ptr, page, True, stride_cp, BLOCK, DI,
                            staged_ptr.dtype.element_ty, PTX)
            tl.store(staged_ptr + (slot_first + b) * (BLOCK * DI) + offs, k)
