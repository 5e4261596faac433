# SPDX-License-Identifier: Apache-2.0
"""Gluon kernel of the prefill launch on Hopper, warp-specialised (fp8 and 16-bit caches).

The same scores as scores.py's prefill launch (S[t, h, b] = max over block b's causal keys of
q[t, h] . key), for the tiles of packed tokens of long requests, in the shape FlashInfer's fp32
prefill kernel uses: a program owns 256 (token, head) rows and one split of `bps` blocks, as four
64-row consumer warpgroups and one producer warp.

* The producer warp copies each block's keys (one [BLOCK, DI] tile of a page) into a ring of
  STAGES shared-memory buffers with TMA, ahead of the consumers.
* Each consumer warpgroup waits for a buffer, multiplies its 64 query rows by it (`wgmma`), hands
  the buffer back, and takes its rows' maxima. Nothing synchronises the four warpgroups, so
  while one takes maxima the others keep the tensor cores busy. Triton's loop cannot do this:
  its 4-warp programs wait for their own MMA, then reduce, and its 16-warp programs keep the
  warpgroups in step (two CTA barriers per block), and were slower on the same loop
  (docs/history/tried.md).
* A consumer keeps its maxima in shared memory, [CH, 64] per warpgroup, and stores them as one
  tile every CH blocks, coalesced along the blocks as scores.py's tile is (read back a block
  row per warp instruction and converted to the store's layout in registers: reading the
  store's layout straight from the chunk hit each bank 8 times). So a split can be long: the grid
  is sized to a few programs per SM (plan.py, GluonPrefillForm.waves), because a program's start
  idles its SM, one program per SM leaving nothing to hide it behind. The start is three dependent
  memory round trips: the request lookup; one look at the window of requests, which also loads the
  first request's offsets, length and page id (a split past every request's causal edge ends
  here); then the queries and the first keys together (the consumers, not the whole program, wait
  for the queries).

Used when the index query and cache allow TMA (plan.py, `gluon_eligible`): CUDA sm_90, a
power-of-two number of heads, q rows [T * H, DI] and cache rows [pages * BLOCK, DI] each one
strided 2-D array with 16-byte aligned bases, BLOCK = DI = 128, and the Triton these Gluon
kernels are tested on (`_device.gluon_hopper_available`). Everything else, and the
interpreter, keeps scores.py. Keys of a page id < 0 are not read (TMA fills an out-of-range box
with zeros) and score -inf, as in scores.py.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ...common.gluon_utils import (find_request, launch_dependents, request_ok,
                                   step_well_formed, wait_prerequisites)
from ..geometry import GLUON_CH, GLUON_CONSUMERS, GLUON_WG_ROWS

# rows per consumer warpgroup (Hopper's MMA M), blocks per chunk of a consumer's maxima (each
# chunk is stored as one [CH, 64] tile) and consumer warpgroups per program: geometry.py
WG_ROWS = gl.constexpr(GLUON_WG_ROWS)
CH = gl.constexpr(GLUON_CH)
CONSUMERS = gl.constexpr(GLUON_CONSUMERS)


@gluon.jit
def _page_id(page, num_pages):
    """A table entry as the page to copy, or -1 when it names no page of the cache (negative,
    or a stale id past it: docs/spec.md, "Bounds"): TMA fills a box at a negative row with
    zeros, and page * BLOCK stays clear of int32 overflow."""
    return gl.where((page >= 0) & (page < num_pages), page, -1)


@gluon.jit
def _request_blocks(t_req, t_next, seq_len, tile_begin, tile_end, b_first, bps, table_width,
                    BLOCK: gl.constexpr, SMALL_Q: gl.constexpr):
    """A request's part of this tile, from its cu_seqlens_q[r], cu_seqlens_q[r + 1] and
    seq_lens[r]: (its tokens' first position, the tile's token range in it, the blocks
    [b_first, b_first + n) to score); n = 0 when the request is short (the decode launch's),
    padding (request_ok: q_len > seq_len, or more blocks than the table's width), or has no
    block in this split."""
    q_len = t_next - t_req
    t_begin = gl.maximum(t_req, tile_begin)
    t_end = gl.minimum(t_next, tile_end)
    first_pos = seq_len - q_len
    # causal: the tile's last token of r sees blocks < its position // BLOCK + 1
    b_hi = gl.minimum(b_first + bps, (first_pos + (t_end - 1 - t_req)) // BLOCK + 1)
    n = gl.where((q_len > SMALL_Q) & request_ok(q_len, seq_len, table_width, BLOCK)
                 & (t_begin < t_end),
                 gl.maximum(b_hi - b_first, 0), 0)
    return first_pos, t_begin, t_end, n


@gluon.jit
def _next_request(cu_ptr, seq_lens_ptr, bt_ptr, stride_btr, stride_btb, num_requests, r, t_req,
                  tile_end, b_first, num_pages):
    """The request after r in this tile (num_requests once r starts at or past the tile's
    end) and its (cu_seqlens_q[r'], cu_seqlens_q[r' + 1], seq_lens[r'], block_table[r',
    b_first]), loaded together: one memory round trip per request (the first request's come
    from the kernel's prologue)."""
    r = gl.where(t_req >= tile_end, num_requests, r + 1)
    ok = r < num_requests
    t_req = gl.load(cu_ptr + r, mask=ok, other=0)
    t_next = gl.load(cu_ptr + r + 1, mask=ok, other=0)
    seq_len = gl.load(seq_lens_ptr + r, mask=ok, other=0)
    page = gl.load(bt_ptr + r.to(gl.int64) * stride_btr + b_first * stride_btb, mask=ok, other=-1)
    return r, t_req, t_next, seq_len, _page_id(page, num_pages)


@gluon.jit
def _producer(k_desc, k_smem, ready, empty, cu_ptr, seq_lens_ptr, bt_ptr, stride_btr,
              stride_btb, num_requests, tile_begin, tile_end, b_first, r_first, t_req, t_next,
              seq_len, page, bps, num_pages, table_width, BLOCK: gl.constexpr,
              SMALL_Q: gl.constexpr,
              STAGES: gl.constexpr):
    """One warp: every block this program scores, in the consumers' order, into the ring
    (t_req, t_next, seq_len, page: request r_first's, from the prologue)."""
    j = 0  # blocks issued so far (the ring's position and phase)
    r = r_first
    while r < num_requests:
        first_pos, t_begin, t_end, n = _request_blocks(
            t_req, t_next, seq_len, tile_begin, tile_end, b_first, bps, table_width, BLOCK,
            SMALL_Q)
        # each block's page id loaded one block ahead: no copy waits on a global load (as
        # scalars: a tensor carried through this loop and reassigned under an `if` came out
        # wrong on the GPU inside a warp-specialised partition, Triton 3.6)
        row = bt_ptr + r.to(gl.int64) * stride_btr + b_first * stride_btb
        for i in range(n):
            page_next = _page_id(gl.load(row + (i + 1) * stride_btb, mask=i + 1 < n, other=-1),
                                 num_pages)
            s = j % STAGES
            # the buffer's previous block released by all consumers
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1, pred=j >= STAGES)
            mbarrier.expect(ready.index(s), k_desc.block_type.nbytes)
            # a page id < 0 (no page) lands outside the descriptor: TMA writes zeros and reads
            # nothing
            tma.async_copy_global_to_shared(k_desc, [page * BLOCK, 0], ready.index(s),
                                            k_smem.index(s))
            page = page_next
            j += 1
        r, t_req, t_next, seq_len, page = _next_request(
            cu_ptr, seq_lens_ptr, bt_ptr, stride_btr, stride_btb, num_requests, r, t_req,
            tile_end, b_first, num_pages)


@gluon.jit
def _consumer(q_smem, q_bar, k_smem, ready, empty, mine, cu_ptr, seq_lens_ptr, bt_ptr, out_ptr,
              stride_btr, stride_btb, stride_ot, stride_oh, stride_ob, num_requests,
              tile_begin, tile_end, b_first, r_first, t_req, t_next, seq_len, page, bps, part,
              num_pages, table_width, H: gl.constexpr, BLOCK: gl.constexpr, SMALL_Q: gl.constexpr,
              STAGES: gl.constexpr):
    """One warpgroup: rows [part * 64, part * 64 + 64) of the program's (token, head) rows;
    `mine`: its maxima of the current chunk of CH blocks, [CH, 64] in shared memory."""
    # one MMA instruction: 64 rows x BLOCK keys x 32 bytes of head dim
    KW: gl.constexpr = 256 // q_smem.dtype.primitive_bitwidth
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK, KW])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    keys_l: gl.constexpr = gl.SliceLayout(0, mma)
    # a chunk's store: 8 consecutive blocks (a 32-byte sector) of 4 rows per warp instruction,
    # so that each thread holds few of the rows' addresses (they live through the loop)
    out_l: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [1, 4], [0, 1])
    in_l: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    mbarrier.wait(q_bar, 0)  # the tile's query rows (the kernel's prologue issued them)
    q_i = q_smem.index(part)
    zero = gl.zeros([WG_ROWS, BLOCK], gl.float32, layout=mma)
    local = part * WG_ROWS + gl.arange(0, WG_ROWS, layout=rows_l)
    tok = tile_begin + local // H
    keys = gl.arange(0, BLOCK, layout=keys_l)
    local_o = part * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(0, out_l))
    tok_o = tile_begin + local_o // H
    head_o = local_o % H
    cols_o = gl.arange(0, CH, layout=gl.SliceLayout(1, out_l))
    j = 0
    r = r_first
    while r < num_requests:
        first_pos, t_begin, t_end, n = _request_blocks(
            t_req, t_next, seq_len, tile_begin, tile_end, b_first, bps, table_width, BLOCK,
            SMALL_Q)
        pos = first_pos + (tok - t_req)  # [64]
        # blocks wholly at or before this warpgroup's earliest token need no causal mask
        wg_first = gl.maximum(t_begin, tile_begin + (part * WG_ROWS) // H)
        b_full = (first_pos + (wg_first - t_req) + 1) // BLOCK
        # each block's page id loaded one block ahead (a page id < 0 scores -inf)
        row = bt_ptr + r.to(gl.int64) * stride_btr + b_first * stride_btb
        for i in range(n):
            page_next = _page_id(gl.load(row + (i + 1) * stride_btb, mask=i + 1 < n, other=-1),
                                 num_pages)
            b = b_first + i
            c = i % CH
            s = j % STAGES
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            acc = warpgroup_mma(q_i, k_smem.index(s).permute((1, 0)), zero, use_acc=False,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(s), count=1)
            if b >= b_full:
                acc = gl.where((b * BLOCK + keys)[None, :] <= pos[:, None], acc, float("-inf"))
            # the max skips NaN (PTX max.f32), so only an all-NaN row is left to clean; a
            # skipped page's buffer holds zeros
            best = gl.max(acc, axis=1)
            best = gl.where((best == best) & (page >= 0), best, float("-inf"))
            mine.index(c).store(best)
            page = page_next
            j += 1
            if (c == CH - 1) | (i == n - 1):
                gl.thread_barrier()  # the chunk's maxima written before they are read
                # the same bytes as one [CH, 64] row-major tile (stored a block row at a time)
                rows_major = mine._reinterpret(gl.float32, [CH, WG_ROWS], gl.SwizzledSharedLayout(
                    vec=1, per_phase=1, max_phase=1, order=[1, 0]))
                # read one block's 32 rows per warp instruction (32 banks: no conflict; the
                # store's layout, 8 blocks x 4 rows, hit each bank 8 times), then into the
                # store's layout through the compiler's own conflict-free scratch
                tile = gl.convert_layout(rows_major.load(in_l), out_l)
                ok = ((tok_o >= t_begin) & (tok_o < t_end))[None, :] & (cols_o <= c)[:, None]
                dst = (out_ptr + tok_o.to(gl.int64)[None, :] * stride_ot
                       + head_o.to(gl.int64)[None, :] * stride_oh
                       + (b - c + cols_o).to(gl.int64)[:, None] * stride_ob)
                gl.store(dst, tile, mask=ok)
                gl.thread_barrier()  # read before the next chunk overwrites them
        r, t_req, t_next, seq_len, page = _next_request(
            cu_ptr, seq_lens_ptr, bt_ptr, stride_btr, stride_btb, num_requests, r, t_req,
            tile_end, b_first, num_pages)


@gluon.jit
def _block_scores_gluon_kernel(q_desc, k_desc, cu_ptr, seq_lens_ptr, bt_ptr, out_ptr,
                               num_requests, num_tokens, num_pages, table_width, stride_btr,
                               stride_btb, stride_ot, stride_oh, stride_ob, bps, H: gl.constexpr,
                               SMALL_Q: gl.constexpr, STAGES: gl.constexpr,
                               CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                               num_warps: gl.constexpr):
    """Program (tile, split): the tile's ROWS_T tokens (all heads) against the split's `bps`
    blocks. CONSUMER_REGS, PRODUCER_REGS: registers per thread of the consumer warpgroups and
    of the producer warp (setmaxnreg; plan.py's GluonPrefillForm)."""
    BLOCK: gl.constexpr = k_desc.block_type.shape[0]
    DI: gl.constexpr = k_desc.block_type.shape[1]
    ROWS_T: gl.constexpr = WG_ROWS * CONSUMERS // H
    # a selection launched as a programmatic dependent of this one may start its request
    # lookups now, on the SMs this launch's last wave leaves idle; it reads scores only after
    # this launch has finished (the wait at the end)
    launch_dependents()
    # the last tile first: later tokens see more blocks, so the longest programs start first
    # (scores.py)
    pid = gl.program_id(0)
    pid = gl.num_programs(0) - 1 - pid
    b_first = gl.program_id(1) * bps
    tile_begin = pid * ROWS_T
    tile_end = gl.minimum(tile_begin + ROWS_T, num_tokens)
    r_first = find_request(cu_ptr, num_requests, tile_begin)
    # one look at the requests overlapping the tile (at most ROWS_T hold a token, plus any
    # empty ones between): a tile of decode tokens ends here without loading its queries
    win_l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    WIN: gl.constexpr = 2 * 4 * WG_ROWS // H  # a power of two >= 2 * ROWS_T
    rr = r_first + gl.arange(0, WIN, layout=win_l)
    in_range = rr < num_requests
    t0 = gl.load(cu_ptr + rr, mask=in_range, other=0)
    t1 = gl.load(cu_ptr + rr + 1, mask=in_range, other=0)
    before = in_range & (t0 < tile_end)
    work = before & (t1 - t0 > SMALL_Q)
    # and a block of this split before the causal edge of the request's last token in the
    # tile (_request_blocks' n > 0): the splits past the edge (3 of every 4 programs of the
    # first tiles of a chunk with no context) end before loading their queries
    seq = gl.load(seq_lens_ptr + rr, mask=in_range, other=0)
    first_pos = seq - (t1 - t0)
    t_last = gl.minimum(t1, tile_end) - 1
    work = (work & (first_pos >= 0) & (gl.maximum(t0, tile_begin) <= t_last)
            & (b_first < (first_pos + gl.maximum(t_last - t0, 0)) // BLOCK + 1))
    n_work = gl.sum(work.to(gl.int32), axis=0)
    # cu is nondecreasing: if the window's last request also starts before tile_end, there
    # may be more, so the tile is walked in full
    n_seen = gl.sum(before.to(gl.int32), axis=0)
    # the first request's offsets, length and page id of block b_first, loaded with the window
    # (the partitions' walk would load them one round trip later)
    ok0 = r_first < num_requests
    t_req0 = gl.load(cu_ptr + r_first, mask=ok0, other=0)
    t_next0 = gl.load(cu_ptr + r_first + 1, mask=ok0, other=0)
    seq0 = gl.load(seq_lens_ptr + r_first, mask=ok0, other=0)
    page0 = _page_id(gl.load(bt_ptr + r_first.to(gl.int64) * stride_btr + b_first * stride_btb,
                             mask=ok0, other=-1), num_pages)
    # a malformed step is padding as a whole (docs/spec.md, "Bounds")
    if ((n_work > 0) | (n_seen >= WIN)) & step_well_formed(cu_ptr, num_requests, num_tokens):
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS, WG_ROWS, DI],
                                           q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK, DI], k_desc.layout)
        # each consumer's maxima, [CH, 64] (a block's 64 maxima are one contiguous row)
        flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        maxima0 = gl.allocate_shared_memory(gl.float32, [CH, WG_ROWS], flat)
        maxima1 = gl.allocate_shared_memory(gl.float32, [CH, WG_ROWS], flat)
        maxima2 = gl.allocate_shared_memory(gl.float32, [CH, WG_ROWS], flat)
        maxima3 = gl.allocate_shared_memory(gl.float32, [CH, WG_ROWS], flat)  # (4 consumers)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)
        mbarrier.init(q_bar, count=1)
        # the tile's query rows, (token, head) major to minor; rows past T * H read as zeros.
        # The consumers wait for them, so that they arrive while the producer's first keys do
        mbarrier.expect(q_bar, q_desc.block_type.nbytes * CONSUMERS)
        for p in gl.static_range(CONSUMERS):
            tma.async_copy_global_to_shared(q_desc, [tile_begin * H + p * WG_ROWS, 0], q_bar,
                                            q_smem.index(p))
        # (written out per consumer: adding tuples here turns their constexprs into ints)
        gl.warp_specialize([
            (_consumer, (q_smem, q_bar, k_smem, ready, empty, maxima0, cu_ptr, seq_lens_ptr,
                         bt_ptr, out_ptr, stride_btr, stride_btb, stride_ot, stride_oh,
                         stride_ob, num_requests, tile_begin, tile_end, b_first, r_first,
                         t_req0, t_next0, seq0, page0, bps, 0, num_pages, table_width, H,
                         BLOCK, SMALL_Q, STAGES)),
            (_consumer, (q_smem, q_bar, k_smem, ready, empty, maxima1, cu_ptr, seq_lens_ptr,
                         bt_ptr, out_ptr, stride_btr, stride_btb, stride_ot, stride_oh,
                         stride_ob, num_requests, tile_begin, tile_end, b_first, r_first,
                         t_req0, t_next0, seq0, page0, bps, 1, num_pages, table_width, H,
                         BLOCK, SMALL_Q, STAGES)),
            (_consumer, (q_smem, q_bar, k_smem, ready, empty, maxima2, cu_ptr, seq_lens_ptr,
                         bt_ptr, out_ptr, stride_btr, stride_btb, stride_ot, stride_oh,
                         stride_ob, num_requests, tile_begin, tile_end, b_first, r_first,
                         t_req0, t_next0, seq0, page0, bps, 2, num_pages, table_width, H,
                         BLOCK, SMALL_Q, STAGES)),
            (_consumer, (q_smem, q_bar, k_smem, ready, empty, maxima3, cu_ptr, seq_lens_ptr,
                         bt_ptr, out_ptr, stride_btr, stride_btb, stride_ot, stride_oh,
                         stride_ob, num_requests, tile_begin, tile_end, b_first, r_first,
                         t_req0, t_next0, seq0, page0, bps, 3, num_pages, table_width, H,
                         BLOCK, SMALL_Q, STAGES)),
            (_producer, (k_desc, k_smem, ready, empty, cu_ptr, seq_lens_ptr, bt_ptr,
                         stride_btr, stride_btb, num_requests, tile_begin, tile_end, b_first,
                         r_first, t_req0, t_next0, seq0, page0, bps, num_pages, table_width,
                         BLOCK, SMALL_Q, STAGES)),
        ], [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    # launched as a programmatic dependent of the decode launch (the two write disjoint rows,
    # so nothing above waits for it), this launch ends only after that one has: the selection
    # launch, which waits for this one, sees both (without a decode launch it returns at once)
    wait_prerequisites()
