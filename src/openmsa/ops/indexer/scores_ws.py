# SPDX-License-Identifier: Apache-2.0
"""Gluon kernel of the prefill tile launch on Hopper, warp-specialised (fp8 and 16-bit caches).

The same scores as scores.py's tile launch (S[t, h, b] = max over block b's causal keys of
q[t, h] . key), for the tiles of packed tokens of long requests, in the shape FlashInfer's fp32
prefill kernel uses: a program owns 256 (token, head) rows and one split of `bps` blocks, as four
64-row consumer warpgroups and one producer warp (or three, 192 rows: ws_consumers).

* The producer warp copies each block's keys (one [BLOCK, DI] tile of a page) into a ring of
  STAGES shared-memory buffers with TMA, ahead of the consumers.
* Each consumer warpgroup waits for a buffer, multiplies its 64 query rows by it (`wgmma`), hands
  the buffer back, and takes its rows' maxima. Nothing synchronises the four warpgroups, so
  while one takes maxima the others keep the tensor cores busy. Triton's loop cannot do this:
  its 4-warp programs wait for their own MMA, then reduce, and its 16-warp programs keep the
  warpgroups in step (two CTA barriers per block); measured on the same loop
  (`benchmarks/probe_mma_overlap.py`), 837 µs against Triton's 1058, and in the library an 8K
  chunk after 120K scores in 814 µs against the Triton launch's 963 (docs/performance.md).
* A consumer keeps its maxima in shared memory, [CH, 64] per warpgroup, and stores them as one
  tile every CH blocks, coalesced along the blocks as scores.py's tile is (read back a block
  row per warp instruction and converted to the store's layout in registers: reading the
  store's layout straight from the chunk hit each bank 8 times). So a split can be
  long: the grid is sized to a few programs per SM (api.py, ws_waves), because a program's
  start idles its SM, one program per SM leaving nothing to hide it behind. The start is three
  dependent memory round trips: the request lookup; one look at the window of requests, which
  also loads the first request's offsets, length and page id (a split past every request's
  causal edge ends here, SKIP_IDLE); then the queries and the first keys together (the
  consumers, not the whole program, wait for the queries). Measured: the no-context chunk's
  scoring 34.8 -> 33.3 µs, the chunk after 120K 813 -> 795 (docs/performance.md).

Used when the index query and cache allow TMA (api.py, `_ws_eligible`): CUDA sm_90, a
power-of-two number of heads, q rows [T * H, DI] and cache rows [pages * BLOCK, DI] each one
strided 2-D array with 16-byte aligned bases, BLOCK = DI = 128, and the Triton these Gluon
kernels are tested on (`_dispatch.gluon_hopper_available`). Everything else, and the
interpreter, keeps scores.py. Keys of a page id < 0 are not read (TMA fills an out-of-range box
with zeros) and score -inf, as in scores.py.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..common.gluon_utils import find_request, launch_dependents, wait_prerequisites

# rows per consumer warpgroup (Hopper's MMA M); blocks per chunk of a consumer's maxima (each
# chunk is stored as one [CH, 64] tile)
WG_ROWS = gl.constexpr(64)
CH = gl.constexpr(32)


@gluon.jit
def _request_blocks(t_req, t_next, seq_len, tile_begin, tile_end, b_first, bps,
                    BLOCK: gl.constexpr, SMALL_Q: gl.constexpr):
    """A request's part of this tile, from its cu_seqlens_q[r], cu_seqlens_q[r + 1] and
    seq_lens[r]: (its tokens' first position, the tile's token range in it, the blocks
    [b_first, b_first + n) to score); n = 0 when the request is short (the request launch's),
    padding, or has no block in this split."""
    q_len = t_next - t_req
    t_begin = gl.maximum(t_req, tile_begin)
    t_end = gl.minimum(t_next, tile_end)
    first_pos = seq_len - q_len
    # causal: the tile's last token of r sees blocks < its position // BLOCK + 1
    b_hi = gl.minimum(b_first + bps, (first_pos + (t_end - 1 - t_req)) // BLOCK + 1)
    n = gl.where((q_len > SMALL_Q) & (seq_len >= q_len) & (t_begin < t_end),
                 gl.maximum(b_hi - b_first, 0), 0)
    return first_pos, t_begin, t_end, n


@gluon.jit
def _next_request(cu_ptr, seq_lens_ptr, bt_ptr, stride_btr, stride_btb, num_requests, r, t_req,
                  tile_end, b_first):
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
    return r, t_req, t_next, seq_len, page


@gluon.jit
def _produce_item(k_desc, k_smem, ready, empty, cu_ptr, seq_lens_ptr, bt_ptr, stride_btr,
                  stride_btb, num_requests, tile_begin, tile_end, b_first, r_first, t_req, t_next,
                  seq_len, page, bps, j, BLOCK: gl.constexpr, SMALL_Q: gl.constexpr,
                  STAGES: gl.constexpr):
    """The producer's part of one (tile, split): every block it scores, in the consumers'
    order, into the ring (t_req, t_next, seq_len, page: request r_first's, looked up
    already); j: blocks issued before it (the ring's position and phase), returned updated."""
    j = gl.to_tensor(j)  # (0 from _producer / _consumer: a constant otherwise)
    r = r_first
    while r < num_requests:
        first_pos, t_begin, t_end, n = _request_blocks(
            t_req, t_next, seq_len, tile_begin, tile_end, b_first, bps, BLOCK, SMALL_Q)
        # each block's page id loaded one block ahead: no copy waits on a global load (as
        # scalars: a tensor carried through this loop and reassigned under an `if` came out
        # wrong on the GPU inside a warp-specialised partition, Triton 3.6)
        row = bt_ptr + r.to(gl.int64) * stride_btr + b_first * stride_btb
        for i in range(n):
            page_next = gl.load(row + (i + 1) * stride_btb, mask=i + 1 < n, other=-1)
            s = j % STAGES
            # the buffer's previous block released by all consumers
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1, pred=j >= STAGES)
            mbarrier.expect(ready.index(s), k_desc.block_type.nbytes)
            # a page id < 0 lands outside the descriptor: TMA writes zeros and reads nothing
            tma.async_copy_global_to_shared(k_desc, [page * BLOCK, 0], ready.index(s),
                                            k_smem.index(s))
            page = page_next
            j += 1
        r, t_req, t_next, seq_len, page = _next_request(
            cu_ptr, seq_lens_ptr, bt_ptr, stride_btr, stride_btb, num_requests, r, t_req,
            tile_end, b_first)
    return j


@gluon.jit
def _producer(k_desc, k_smem, ready, empty, cu_ptr, seq_lens_ptr, bt_ptr, stride_btr,
              stride_btb, num_requests, tile_begin, tile_end, b_first, r_first, t_req, t_next,
              seq_len, page, bps, BLOCK: gl.constexpr, SMALL_Q: gl.constexpr,
              STAGES: gl.constexpr):
    """One warp: the program's one (tile, split) into the ring (t_req, t_next, seq_len, page:
    request r_first's, from the prologue)."""
    _produce_item(k_desc, k_smem, ready, empty, cu_ptr, seq_lens_ptr, bt_ptr, stride_btr,
                  stride_btb, num_requests, tile_begin, tile_end, b_first, r_first, t_req, t_next,
                  seq_len, page, bps, 0, BLOCK, SMALL_Q, STAGES)


@gluon.jit
def _consume_item(q_rows, k_smem, ready, empty, mine, cu_ptr, seq_lens_ptr, bt_ptr, out_ptr,
                  stride_btr, stride_btb, stride_ot, stride_oh, stride_ob, num_requests,
                  tile_begin, tile_end, b_first, r_first, t_req, t_next, seq_len, page, bps,
                  part, j, H: gl.constexpr, BLOCK: gl.constexpr, SMALL_Q: gl.constexpr,
                  STAGES: gl.constexpr, Q_IN_REGS: gl.constexpr, CONVERT: gl.constexpr):
    """One warpgroup's part of one (tile, split): rows [part * 64, part * 64 + 64) of the
    tile's (token, head) rows, whose queries are q_rows (in shared memory, arrived); `mine`:
    its maxima of the current chunk of CH blocks, [CH, 64] in shared memory; j: blocks taken
    from the ring before it, returned updated."""
    # one MMA instruction: 64 rows x BLOCK keys x 32 bytes of head dim
    KW: gl.constexpr = 256 // q_rows.dtype.primitive_bitwidth
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK, KW])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    keys_l: gl.constexpr = gl.SliceLayout(0, mma)
    # a chunk's store: 8 consecutive blocks (a 32-byte sector) of 4 rows per warp instruction,
    # so that each thread holds few of the rows' addresses (they live through the loop)
    out_l: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [1, 4], [0, 1])
    in_l: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    if Q_IN_REGS:
        # the query rows in registers (the MMA's A operand), read once: each MMA then reads
        # only its key tile from shared memory (16 registers a thread for fp8)
        q_i = q_rows.load(gl.DotOperandLayout(
            operand_index=0, parent=mma, k_width=32 // q_rows.dtype.primitive_bitwidth))
    else:
        q_i = q_rows
    zero = gl.zeros([WG_ROWS, BLOCK], gl.float32, layout=mma)
    local = part * WG_ROWS + gl.arange(0, WG_ROWS, layout=rows_l)
    tok = tile_begin + local // H
    keys = gl.arange(0, BLOCK, layout=keys_l)
    local_o = part * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(0, out_l))
    tok_o = tile_begin + local_o // H
    head_o = local_o % H
    cols_o = gl.arange(0, CH, layout=gl.SliceLayout(1, out_l))
    j = gl.to_tensor(j)  # (0 from _producer / _consumer: a constant otherwise)
    r = r_first
    while r < num_requests:
        first_pos, t_begin, t_end, n = _request_blocks(
            t_req, t_next, seq_len, tile_begin, tile_end, b_first, bps, BLOCK, SMALL_Q)
        pos = first_pos + (tok - t_req)  # [64]
        # blocks wholly at or before this warpgroup's earliest token need no causal mask
        wg_first = gl.maximum(t_begin, tile_begin + (part * WG_ROWS) // H)
        b_full = (first_pos + (wg_first - t_req) + 1) // BLOCK
        # each block's page id loaded one block ahead (a page id < 0 scores -inf)
        row = bt_ptr + r.to(gl.int64) * stride_btr + b_first * stride_btb
        for i in range(n):
            page_next = gl.load(row + (i + 1) * stride_btb, mask=i + 1 < n, other=-1)
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
                if CONVERT:
                    # read one block's 32 rows per warp instruction (32 banks: no conflict;
                    # 8 blocks x 4 rows hit each bank 8 times), then into the store's layout
                    # through the compiler's own conflict-free scratch
                    tile = gl.convert_layout(rows_major.load(in_l), out_l)
                else:
                    tile = rows_major.load(out_l)
                ok = ((tok_o >= t_begin) & (tok_o < t_end))[None, :] & (cols_o <= c)[:, None]
                dst = (out_ptr + tok_o.to(gl.int64)[None, :] * stride_ot
                       + head_o.to(gl.int64)[None, :] * stride_oh
                       + (b - c + cols_o).to(gl.int64)[:, None] * stride_ob)
                gl.store(dst, tile, mask=ok)
                gl.thread_barrier()  # read before the next chunk overwrites them
        r, t_req, t_next, seq_len, page = _next_request(
            cu_ptr, seq_lens_ptr, bt_ptr, stride_btr, stride_btb, num_requests, r, t_req,
            tile_end, b_first)
    return j


@gluon.jit
def _consumer(q_smem, q_bar, k_smem, ready, empty, mine, cu_ptr, seq_lens_ptr, bt_ptr, out_ptr,
              stride_btr, stride_btb, stride_ot, stride_oh, stride_ob, num_requests,
              tile_begin, tile_end, b_first, r_first, t_req, t_next, seq_len, page, bps, part,
              H: gl.constexpr,
              BLOCK: gl.constexpr, SMALL_Q: gl.constexpr, STAGES: gl.constexpr,
              Q_IN_REGS: gl.constexpr, CONVERT: gl.constexpr):
    """One warpgroup: the program's one (tile, split)."""
    mbarrier.wait(q_bar, 0)  # the tile's query rows (the kernel's prologue issued them)
    _consume_item(q_smem.index(part), k_smem, ready, empty, mine, cu_ptr, seq_lens_ptr, bt_ptr,
                  out_ptr, stride_btr, stride_btb, stride_ot, stride_oh, stride_ob, num_requests,
                  tile_begin, tile_end, b_first, r_first, t_req, t_next, seq_len, page, bps,
                  part, 0, H, BLOCK, SMALL_Q, STAGES, Q_IN_REGS, CONVERT)


@gluon.jit
def _look(cu_ptr, seq_lens_ptr, bt_ptr, stride_btr, stride_btb, num_requests, tile_begin,
          tile_end, b_first, WIN: gl.constexpr, BLOCK: gl.constexpr, SMALL_Q: gl.constexpr,
          SKIP_IDLE: gl.constexpr, WARPS: gl.constexpr):
    """A (tile, split)'s first request r_first, whether the split has work (`go`), and request
    r_first's cu_seqlens_q[r], cu_seqlens_q[r + 1], seq_lens[r] and block_table[r, b_first]:
    two memory round trips (the request lookup, then one look at the window of WIN requests
    from r_first, which loads the first request's values with it)."""
    r_first = find_request(cu_ptr, num_requests, tile_begin)
    # the requests overlapping the tile (at most its tokens' count hold a token, plus any empty
    # ones between): a tile of decode tokens ends here without loading its queries
    win_l: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    rr = r_first + gl.arange(0, WIN, layout=win_l)
    in_range = rr < num_requests
    t0 = gl.load(cu_ptr + rr, mask=in_range, other=0)
    t1 = gl.load(cu_ptr + rr + 1, mask=in_range, other=0)
    before = in_range & (t0 < tile_end)
    work = before & (t1 - t0 > SMALL_Q)
    if SKIP_IDLE:
        # and a block of this split before the causal edge of the request's last token in
        # the tile (_request_blocks' n > 0): the splits past the edge (3 of every 4 programs
        # of the first tiles of a chunk with no context) end before loading their queries
        seq = gl.load(seq_lens_ptr + rr, mask=in_range, other=0)
        first_pos = seq - (t1 - t0)
        t_last = gl.minimum(t1, tile_end) - 1
        work = (work & (first_pos >= 0) & (gl.maximum(t0, tile_begin) <= t_last)
                & (b_first < (first_pos + gl.maximum(t_last - t0, 0)) // BLOCK + 1))
    n_work = gl.sum(work.to(gl.int32), axis=0)
    # cu is nondecreasing: if the window's last request also starts before tile_end, there
    # may be more, so the tile is walked in full
    n_seen = gl.sum(before.to(gl.int32), axis=0)
    # the first request's values, loaded with the window (the walk would load them one round
    # trip later)
    ok0 = r_first < num_requests
    t_req0 = gl.load(cu_ptr + r_first, mask=ok0, other=0)
    t_next0 = gl.load(cu_ptr + r_first + 1, mask=ok0, other=0)
    seq0 = gl.load(seq_lens_ptr + r_first, mask=ok0, other=0)
    page0 = gl.load(bt_ptr + r_first.to(gl.int64) * stride_btr + b_first * stride_btb, mask=ok0,
                    other=-1)
    return r_first, (n_work > 0) | (n_seen >= WIN), t_req0, t_next0, seq0, page0


@gluon.jit
def _block_scores_ws_kernel(q_desc, k_desc, cu_ptr, seq_lens_ptr, bt_ptr, out_ptr,
                            num_requests, num_tokens, stride_btr, stride_btb, stride_ot,
                            stride_oh, stride_ob, bps, H: gl.constexpr, SMALL_Q: gl.constexpr,
                            STAGES: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, REVERSE_TILES: gl.constexpr,
                            CONSUMERS: gl.constexpr, Q_IN_REGS: gl.constexpr,
                            CONVERT: gl.constexpr, SKIP_IDLE: gl.constexpr,
                            WAIT_AT_END: gl.constexpr, num_warps: gl.constexpr):
    BLOCK: gl.constexpr = k_desc.block_type.shape[0]
    DI: gl.constexpr = k_desc.block_type.shape[1]
    ROWS_T: gl.constexpr = WG_ROWS * CONSUMERS // H
    if WAIT_AT_END:
        # (with the PDL of api.py's plan) a selection launched as a programmatic dependent of
        # this one (select_short_pdl) may start its request lookups now, on the SMs this
        # launch's last wave leaves idle; it reads scores only after this launch has finished
        launch_dependents()
    pid = gl.program_id(0)
    if REVERSE_TILES:
        # later tokens see more blocks: the longest programs first (scores.py)
        pid = gl.num_programs(0) - 1 - pid
    b_first = gl.program_id(1) * bps
    tile_begin = pid * ROWS_T
    tile_end = gl.minimum(tile_begin + ROWS_T, num_tokens)
    WIN: gl.constexpr = 2 * 4 * WG_ROWS // H  # a power of two >= 2 * ROWS_T
    r_first, go, t_req0, t_next0, seq0, page0 = _look(
        cu_ptr, seq_lens_ptr, bt_ptr, stride_btr, stride_btb, num_requests, tile_begin, tile_end,
        b_first, WIN, BLOCK, SMALL_Q, SKIP_IDLE, num_warps)
    if go:
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
        if CONSUMERS == 4:
            gl.warp_specialize([
                (_consumer, (q_smem, q_bar, k_smem, ready, empty, maxima0, cu_ptr, seq_lens_ptr,
                             bt_ptr, out_ptr, stride_btr, stride_btb, stride_ot, stride_oh,
                             stride_ob, num_requests, tile_begin, tile_end, b_first, r_first,
                             t_req0, t_next0, seq0, page0, bps, 0, H, BLOCK, SMALL_Q, STAGES,
                             Q_IN_REGS, CONVERT)),
                (_consumer, (q_smem, q_bar, k_smem, ready, empty, maxima1, cu_ptr, seq_lens_ptr,
                             bt_ptr, out_ptr, stride_btr, stride_btb, stride_ot, stride_oh,
                             stride_ob, num_requests, tile_begin, tile_end, b_first, r_first,
                             t_req0, t_next0, seq0, page0, bps, 1, H, BLOCK, SMALL_Q, STAGES,
                             Q_IN_REGS, CONVERT)),
                (_consumer, (q_smem, q_bar, k_smem, ready, empty, maxima2, cu_ptr, seq_lens_ptr,
                             bt_ptr, out_ptr, stride_btr, stride_btb, stride_ot, stride_oh,
                             stride_ob, num_requests, tile_begin, tile_end, b_first, r_first,
                             t_req0, t_next0, seq0, page0, bps, 2, H, BLOCK, SMALL_Q, STAGES,
                             Q_IN_REGS, CONVERT)),
                (_consumer, (q_smem, q_bar, k_smem, ready, empty, maxima3, cu_ptr, seq_lens_ptr,
                             bt_ptr, out_ptr, stride_btr, stride_btb, stride_ot, stride_oh,
                             stride_ob, num_requests, tile_begin, tile_end, b_first, r_first,
                             t_req0, t_next0, seq0, page0, bps, 3, H, BLOCK, SMALL_Q, STAGES,
                             Q_IN_REGS, CONVERT)),
                (_producer, (k_desc, k_smem, ready, empty, cu_ptr, seq_lens_ptr, bt_ptr,
                             stride_btr, stride_btb, num_requests, tile_begin, tile_end, b_first,
                             r_first, t_req0, t_next0, seq0, page0, bps, BLOCK, SMALL_Q,
                             STAGES)),
            ], [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, 24])
        else:
            gl.warp_specialize([
                (_consumer, (q_smem, q_bar, k_smem, ready, empty, maxima0, cu_ptr, seq_lens_ptr,
                             bt_ptr, out_ptr, stride_btr, stride_btb, stride_ot, stride_oh,
                             stride_ob, num_requests, tile_begin, tile_end, b_first, r_first,
                             t_req0, t_next0, seq0, page0, bps, 0, H, BLOCK, SMALL_Q, STAGES,
                             Q_IN_REGS, CONVERT)),
                (_consumer, (q_smem, q_bar, k_smem, ready, empty, maxima1, cu_ptr, seq_lens_ptr,
                             bt_ptr, out_ptr, stride_btr, stride_btb, stride_ot, stride_oh,
                             stride_ob, num_requests, tile_begin, tile_end, b_first, r_first,
                             t_req0, t_next0, seq0, page0, bps, 1, H, BLOCK, SMALL_Q, STAGES,
                             Q_IN_REGS, CONVERT)),
                (_consumer, (q_smem, q_bar, k_smem, ready, empty, maxima2, cu_ptr, seq_lens_ptr,
                             bt_ptr, out_ptr, stride_btr, stride_btb, stride_ot, stride_oh,
                             stride_ob, num_requests, tile_begin, tile_end, b_first, r_first,
                             t_req0, t_next0, seq0, page0, bps, 2, H, BLOCK, SMALL_Q, STAGES,
                             Q_IN_REGS, CONVERT)),
                (_producer, (k_desc, k_smem, ready, empty, cu_ptr, seq_lens_ptr, bt_ptr,
                             stride_btr, stride_btb, num_requests, tile_begin, tile_end, b_first,
                             r_first, t_req0, t_next0, seq0, page0, bps, BLOCK, SMALL_Q,
                             STAGES)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
    if WAIT_AT_END:
        # launched as a programmatic dependent of the request launch (api.py, tile_overlap:
        # the two write disjoint rows, so nothing above waits for it), this launch ends only
        # after that one has: the selection launch, which waits for this one, sees both
        wait_prerequisites()


# ------------------------------------------------------------------------- the persistent form
# One program per SM takes (tile, split) items until none is left: the first from its program
# id, the next from a counter every program adds 1 to (the hardware's order, taken by whoever
# is free first). The producer looks each item up, loads its queries into one of Q_BUFS query
# buffers and its keys into the ring while the consumers still score the item before, and hands
# the consumers the item through a slot of shared memory beside the query buffer: what a new
# program's start cost (its launch, two memory round trips of lookups, the first queries and
# keys) runs under the previous item's MMAs instead of idling the SM.
# A slot's values: the item, its first request and that request's cu_seqlens_q[r],
# cu_seqlens_q[r + 1], seq_lens[r] and block_table[r, b_first]; item -1 ends the consumers.
SLOT = gl.constexpr(8)


@gluon.jit
def _item_tile(item, num_tiles, num_tokens, bps, ROWS_T: gl.constexpr,
               REVERSE_TILES: gl.constexpr):
    """(tile_begin, tile_end, b_first) of an item: items are the grid of the non-persistent
    launch, (tiles, splits), in its launch order (tiles fastest)."""
    x = item % num_tiles
    if REVERSE_TILES:
        x = num_tiles - 1 - x
    tile_begin = x * ROWS_T
    return tile_begin, gl.minimum(tile_begin + ROWS_T, num_tokens), (item // num_tiles) * bps


@gluon.jit
def _take_item(counter_ptr, num_programs):
    """A persistent program's next item: the counter's value before this program's +1, after
    the grid's own first items (one lane's atomic, shared with the warp by a reduction)."""
    lane_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=lane_l)
    old = gl.atomic_add(counter_ptr + lane * 0, gl.full([32], 1, gl.int32, lane_l),
                        mask=lane == 0, sem="relaxed")
    return gl.max(gl.where(lane == 0, old, 0), axis=0) + num_programs


@gluon.jit
def _release_counter(counter_ptr, num_programs):
    """After a program's last _take_item: counter_ptr[1] counts the programs done, and the last
    one sets both counters back to 0 for the next launch (every program has taken its last
    item by then), so the buffer needs no reset between launches or graph replays."""
    lane_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=lane_l)
    done = gl.atomic_add(counter_ptr + 1 + lane * 0, gl.full([32], 1, gl.int32, lane_l),
                         mask=lane == 0, sem="acq_rel")
    last = gl.max(gl.where(lane == 0, done, 0), axis=0) == num_programs - 1
    gl.atomic_xchg(counter_ptr + lane, gl.zeros([32], gl.int32, lane_l), mask=(lane < 2) & last,
                   sem="relaxed")


@gluon.jit
def _persistent_producer(q_desc, k_desc, q_smem, q_bar, q_free, info, k_smem, ready, empty,
                         counter_ptr, cu_ptr, seq_lens_ptr, bt_ptr, stride_btr, stride_btb,
                         num_requests, num_tokens, num_tiles, num_items, bps, H: gl.constexpr,
                         BLOCK: gl.constexpr, SMALL_Q: gl.constexpr, STAGES: gl.constexpr,
                         CONSUMERS: gl.constexpr, Q_BUFS: gl.constexpr,
                         REVERSE_TILES: gl.constexpr, SKIP_IDLE: gl.constexpr):
    """One warp: takes the items, looks each up, and fills slot, query buffer and key ring
    for the consumers (a split with no work is skipped here: the consumers never see it)."""
    ROWS_T: gl.constexpr = WG_ROWS * CONSUMERS // H
    # (a smaller window than the prologue's: this warp has few registers; a window that fills
    # up only sends the split to the consumers' walk)
    WIN: gl.constexpr = 32
    slot_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    field = gl.arange(0, SLOT, layout=slot_l)
    programs = gl.num_programs(0)
    j = 0  # blocks issued (the ring's position and phase)
    k = 0  # items handed over (the slots' position and phase)
    item = gl.program_id(0)
    while item < num_items:
        tile_begin, tile_end, b_first = _item_tile(item, num_tiles, num_tokens, bps, ROWS_T,
                                                   REVERSE_TILES)
        r_first, go, t_req, t_next, seq_len, page = _look(
            cu_ptr, seq_lens_ptr, bt_ptr, stride_btr, stride_btb, num_requests, tile_begin,
            tile_end, b_first, WIN, BLOCK, SMALL_Q, SKIP_IDLE, 1)
        if go:
            b = k % Q_BUFS
            # the buffer's previous item finished by all consumers
            mbarrier.wait(q_free.index(b), ((k // Q_BUFS) & 1) ^ 1, pred=k >= Q_BUFS)
            vals = gl.where(field == 0, item, gl.where(field == 1, r_first, gl.where(
                field == 2, t_req, gl.where(field == 3, t_next, gl.where(
                    field == 4, seq_len, page)))))
            info.index(b).store(vals)
            gl.thread_barrier()  # every lane's store before the arrival that publishes them
            mbarrier.expect(q_bar.index(b), q_desc.block_type.nbytes * CONSUMERS)
            for p in gl.static_range(CONSUMERS):
                tma.async_copy_global_to_shared(q_desc, [tile_begin * H + p * WG_ROWS, 0],
                                                q_bar.index(b),
                                                q_smem.index(b * CONSUMERS + p))
            j = _produce_item(k_desc, k_smem, ready, empty, cu_ptr, seq_lens_ptr, bt_ptr,
                              stride_btr, stride_btb, num_requests, tile_begin, tile_end,
                              b_first, r_first, t_req, t_next, seq_len, page, bps, j, BLOCK,
                              SMALL_Q, STAGES)
            k += 1
        # the next item only now, with this item's last keys issued (the consumers still have
        # up to STAGES blocks to score): taken at the item's start, it was a second item held
        # by a busy program while others ran out of work (measured: SMs busy 17K to 99K
        # cycles, the no-context chunk's scoring 33 -> 55 µs)
        item = _take_item(counter_ptr, programs)
    b = k % Q_BUFS
    mbarrier.wait(q_free.index(b), ((k // Q_BUFS) & 1) ^ 1, pred=k >= Q_BUFS)
    info.index(b).store(gl.full([SLOT], -1, gl.int32, slot_l))
    gl.thread_barrier()
    mbarrier.arrive(q_bar.index(b), count=1)
    _release_counter(counter_ptr, programs)


@gluon.jit
def _field(vals, field, i: gl.constexpr):
    """Field i of a slot's values, as a value ptxas knows to be the same in every lane (a
    warp's redux.sync: it then keeps the value and what follows from it in uniform registers,
    as with the non-persistent kernel's program ids; from the reduction alone the consumers
    spilled)."""
    x = gl.sum(gl.where(field == i, vals, 0), axis=0)
    return gl.inline_asm_elementwise("redux.sync.max.s32 $0, $1, 0xffffffff;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _persistent_consumer(q_smem, q_bar, q_free, info, k_smem, ready, empty, mine, cu_ptr,
                         seq_lens_ptr, bt_ptr, out_ptr, stride_btr, stride_btb, stride_ot,
                         stride_oh, stride_ob, num_requests, num_tokens, num_tiles, bps, part,
                         H: gl.constexpr, BLOCK: gl.constexpr, SMALL_Q: gl.constexpr,
                         STAGES: gl.constexpr, CONSUMERS: gl.constexpr, Q_BUFS: gl.constexpr,
                         REVERSE_TILES: gl.constexpr, Q_IN_REGS: gl.constexpr,
                         CONVERT: gl.constexpr):
    """One warpgroup: the producer's items, one after another, until item -1 (the values read
    from each slot as scalars: see _produce_item on tensors carried through loops)."""
    ROWS_T: gl.constexpr = WG_ROWS * CONSUMERS // H
    slot_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    field = gl.arange(0, SLOT, layout=slot_l)
    j = 0
    k = 0
    mbarrier.wait(q_bar.index(0), 0)
    item = _field(info.index(0).load(slot_l), field, 0)
    while item >= 0:
        b = k % Q_BUFS
        # the item's other values read again here, not carried through the loop (registers)
        vals = info.index(b).load(slot_l)
        tile_begin, tile_end, b_first = _item_tile(item, num_tiles, num_tokens, bps, ROWS_T,
                                                   REVERSE_TILES)
        j = _consume_item(q_smem.index(b * CONSUMERS + part), k_smem, ready, empty, mine,
                          cu_ptr, seq_lens_ptr, bt_ptr, out_ptr, stride_btr, stride_btb,
                          stride_ot, stride_oh, stride_ob, num_requests, tile_begin, tile_end,
                          b_first, _field(vals, field, 1), _field(vals, field, 2),
                          _field(vals, field, 3), _field(vals, field, 4), _field(vals, field, 5),
                          bps, part, j, H, BLOCK, SMALL_Q, STAGES, Q_IN_REGS, CONVERT)
        # (every MMA of the item waited for: its query buffer and slot are free)
        mbarrier.arrive(q_free.index(b), count=1)
        k += 1
        b = k % Q_BUFS
        mbarrier.wait(q_bar.index(b), (k // Q_BUFS) & 1)
        item = _field(info.index(b).load(slot_l), field, 0)


@gluon.jit
def _block_scores_ws_persistent_kernel(q_desc, k_desc, cu_ptr, seq_lens_ptr, bt_ptr, out_ptr,
                                       counter_ptr, num_requests, num_tokens, num_tiles,
                                       num_items, stride_btr, stride_btb, stride_ot, stride_oh,
                                       stride_ob, bps, H: gl.constexpr, SMALL_Q: gl.constexpr,
                                       STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                       REVERSE_TILES: gl.constexpr, CONSUMERS: gl.constexpr,
                                       Q_IN_REGS: gl.constexpr, CONVERT: gl.constexpr,
                                       SKIP_IDLE: gl.constexpr, WAIT_AT_END: gl.constexpr,
                                       Q_BUFS: gl.constexpr, num_warps: gl.constexpr):
    """The same scores as _block_scores_ws_kernel over the same (tile, split) items, from a
    grid of at most one program per SM (api.py, ws_persistent); counter_ptr: two int32 zeros
    (left zero at the end)."""
    gl.static_assert(CONSUMERS == 4, "the persistent form has four consumers")
    BLOCK: gl.constexpr = k_desc.block_type.shape[0]
    DI: gl.constexpr = k_desc.block_type.shape[1]
    if WAIT_AT_END:
        launch_dependents()  # (as in _block_scores_ws_kernel)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [Q_BUFS * CONSUMERS, WG_ROWS, DI],
                                       q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK, DI], k_desc.layout)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    maxima0 = gl.allocate_shared_memory(gl.float32, [CH, WG_ROWS], flat)
    maxima1 = gl.allocate_shared_memory(gl.float32, [CH, WG_ROWS], flat)
    maxima2 = gl.allocate_shared_memory(gl.float32, [CH, WG_ROWS], flat)
    maxima3 = gl.allocate_shared_memory(gl.float32, [CH, WG_ROWS], flat)
    info = gl.allocate_shared_memory(gl.int32, [2, SLOT], flat)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(q_free.index(i), count=CONSUMERS)
    gl.warp_specialize([
        (_persistent_consumer, (q_smem, q_bar, q_free, info, k_smem, ready, empty, maxima0,
                                cu_ptr, seq_lens_ptr, bt_ptr, out_ptr, stride_btr, stride_btb,
                                stride_ot, stride_oh, stride_ob, num_requests, num_tokens,
                                num_tiles, bps, 0, H, BLOCK, SMALL_Q, STAGES, CONSUMERS, Q_BUFS,
                                REVERSE_TILES, Q_IN_REGS, CONVERT)),
        (_persistent_consumer, (q_smem, q_bar, q_free, info, k_smem, ready, empty, maxima1,
                                cu_ptr, seq_lens_ptr, bt_ptr, out_ptr, stride_btr, stride_btb,
                                stride_ot, stride_oh, stride_ob, num_requests, num_tokens,
                                num_tiles, bps, 1, H, BLOCK, SMALL_Q, STAGES, CONSUMERS, Q_BUFS,
                                REVERSE_TILES, Q_IN_REGS, CONVERT)),
        (_persistent_consumer, (q_smem, q_bar, q_free, info, k_smem, ready, empty, maxima2,
                                cu_ptr, seq_lens_ptr, bt_ptr, out_ptr, stride_btr, stride_btb,
                                stride_ot, stride_oh, stride_ob, num_requests, num_tokens,
                                num_tiles, bps, 2, H, BLOCK, SMALL_Q, STAGES, CONSUMERS, Q_BUFS,
                                REVERSE_TILES, Q_IN_REGS, CONVERT)),
        (_persistent_consumer, (q_smem, q_bar, q_free, info, k_smem, ready, empty, maxima3,
                                cu_ptr, seq_lens_ptr, bt_ptr, out_ptr, stride_btr, stride_btb,
                                stride_ot, stride_oh, stride_ob, num_requests, num_tokens,
                                num_tiles, bps, 3, H, BLOCK, SMALL_Q, STAGES, CONSUMERS, Q_BUFS,
                                REVERSE_TILES, Q_IN_REGS, CONVERT)),
        (_persistent_producer, (q_desc, k_desc, q_smem, q_bar, q_free, info, k_smem, ready,
                                empty, counter_ptr, cu_ptr, seq_lens_ptr, bt_ptr, stride_btr,
                                stride_btb, num_requests, num_tokens, num_tiles, num_items, bps,
                                H, BLOCK, SMALL_Q, STAGES, CONSUMERS, Q_BUFS, REVERSE_TILES,
                                SKIP_IDLE)),
    ], [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, 24])
    if WAIT_AT_END:
        wait_prerequisites()  # (as in _block_scores_ws_kernel)
