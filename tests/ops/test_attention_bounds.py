# SPDX-License-Identifier: Apache-2.0
"""sparse_attention and sparse_page_table on metadata an engine did not check (docs/spec.md,
"Bounds"): page ids past the cache and negative ids other than -1, a block table narrower than a
request needs, q_len > seq_len, cu_seqlens_q not starting at 0, decreasing or ending past T.
The reference gives the spec's result (tier 0); every kernel path gives the reference's, reads
no K/V page outside the cache (the cache is a view between NaN guard pages: a read there would
put NaN in the output) and writes nothing outside `out` (a view between NaN guard rows)."""

import dataclasses

import pytest
import torch

import openmsa
from openmsa import reference as ref
from openmsa.batch import token_layout
from openmsa.ops.attention.plan import DEFAULT
from helpers import assert_close, make_step, nan_poison

from test_attention import _plan_of, _prefill_tiles_config, _resplit, _run_plan, _taken

B = 16
GUARD = 2
# decode with stale and negative ids, a verify request reading an id past the cache and one at
# int32's top, q_len > seq_len, a request needing 7 blocks of a 5-column table, a clean decode,
# a 12-token chunk (holding a prefill tile of 8) with a page past the cache, and 2 padding tokens
Q_LENS = [1, 3, 2, 6, 1, 12]
SEQ_LENS = [70, 45, 1, 100, 30, 40]
WIDTH = 5
TOPK = 8


def _hostile_step(generator_seed=0, far=True):
    """The step above with its table cut to WIDTH columns and hostile entries written into the
    requests' blocks: (step, [(request, column, hostile id)]). Without `far`, every hostile id
    lies in the guard pages around the cache (a kernel reading one gets NaN, where one reading
    far outside would crash the interpreter)."""
    step = make_step(Q_LENS, SEQ_LENS, block_size=B, pad_tokens=2,
                     generator=torch.Generator().manual_seed(generator_seed))
    p = step.num_pages
    step.block_table = step.block_table[:, :WIDTH].contiguous()
    hostile = [(0, 1, p), (0, 2, -5 if far else -2), (0, 3, -1), (1, 0, p + 1),
               (1, 2, 2 ** 31 - 1 if far else -GUARD), (5, 1, p + 1)]
    for r, c, page in hostile:
        step.block_table[r, c] = page
    return step, hostile


def _selection(num_tokens, heads=2, seed=3):
    """Every token selects all its causal blocks (TOPK >= any request's 5 blocks) in a random
    order, with -1, out-of-range and repeated ids among them: every hostile entry is selected."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.stack([torch.randperm(TOPK, generator=g) for _ in range(heads)])
                       for _ in range(num_tokens)]).to(torch.int32)
    idx[::2, :, -1] = -1
    idx[1::3, :, -2] = 99
    return idx


def _inputs(step, kv_dtype, device, hq=4, hkv=2, d=64, seed=5):
    """q, and K/V [P, B, Hkv, D] as views of buffers with GUARD NaN pages before and after."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(step.num_tokens, hq, d, generator=g).half()
    caches = []
    for _ in range(2):
        buf = nan_poison((step.num_pages + 2 * GUARD, B, hkv, d), torch.float32, "cpu")
        buf[GUARD:GUARD + step.num_pages] = torch.randn(step.num_pages, B, hkv, d, generator=g)
        buf = buf.to(kv_dtype).to(device)
        caches.append(buf[GUARD:GUARD + step.num_pages])
    return q.to(device), caches[0], caches[1]


def _guarded_out(shape, dtype, device):
    """(buffer, out): out a view of a buffer with GUARD NaN rows before and after."""
    buf = nan_poison((shape[0] + 2 * GUARD, *shape[1:]), dtype, device)
    return buf, buf[GUARD:GUARD + shape[0]]


def _on(step, device):
    return dataclasses.replace(step, **{name: getattr(step, name).to(device) for name in (
        "cu_seqlens_q", "seq_lens", "block_table", "slot_mapping")})


def _reference(q, k, v, idx, step):
    return ref.sparse_attention(q.cpu(), k.cpu(), v.cpu(), idx.cpu(), step.cu_seqlens_q,
                                step.seq_lens, step.block_table, block_size=B,
                                return_lse=True)


def _padding(step):
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens, block_size=B,
                          table_width=step.block_table.shape[1])
    return pos < 0


def _assert_padding(out, lse, rows):
    assert (out.cpu().float()[rows] == 0).all()
    assert torch.isneginf(lse.cpu()[rows]).all()


# a cu_seqlens_q of each malformed kind, for the step above (T = 27 tokens)
def _malformed(cu):
    starts_late = cu.clone()
    starts_late[0] = 1
    decreasing = cu.clone()
    decreasing[3] = decreasing[2] - 1
    past_end = cu.clone()
    past_end[-1] = 28
    return {"starts_late": starts_late, "decreasing": decreasing, "past_end": past_end}


@pytest.mark.reference
def test_reference_reads_nothing_from_pages_outside_the_cache():
    """An entry past the cache or negative reads nothing, exactly as -1 does; the requests with
    q_len > seq_len or too narrow a table are padding, the others unchanged by them; no NaN of
    the guard pages reaches the output."""
    step, hostile = _hostile_step()
    q, k, v = _inputs(step, torch.float16, "cpu")
    idx = _selection(step.num_tokens)
    out, lse = _reference(q, k, v, idx, step)
    unfilled = dataclasses.replace(step, block_table=step.block_table.clone())
    for r, c, _ in hostile:
        unfilled.block_table[r, c] = -1
    want, want_lse = _reference(q, k, v, idx, unfilled)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert not out.isnan().any() and not lse.isnan().any()
    pad = _padding(step)
    cu = step.cu_seqlens_q.tolist()
    malformed = list(range(cu[2], cu[4]))  # q_len > seq_len, and 7 blocks in 5 columns
    assert pad[malformed].all() and not pad[:cu[2]].any() and not pad[cu[4]:cu[-1]].any()
    _assert_padding(out, lse, pad)
    # the 7-block request with a table wide enough is not padding; the others do not change
    wide = make_step(Q_LENS, SEQ_LENS, block_size=B, pad_tokens=2,
                     generator=torch.Generator().manual_seed(0))
    wide.block_table[:, :WIDTH] = unfilled.block_table
    wide_out, wide_lse = _reference(q, k, v, idx, wide)
    assert torch.isfinite(wide_lse[cu[3]:cu[4]]).all()
    keep = ~pad
    assert torch.equal(out[keep], wide_out[keep]) and torch.equal(lse[keep], wide_lse[keep])


@pytest.mark.reference
@pytest.mark.parametrize("kind", ["starts_late", "decreasing", "past_end"])
def test_reference_malformed_step_is_padding(kind):
    step, _ = _hostile_step()
    step.cu_seqlens_q = _malformed(step.cu_seqlens_q)[kind]
    q, k, v = _inputs(step, torch.float16, "cpu")
    out, lse = _reference(q, k, v, _selection(step.num_tokens), step)
    _assert_padding(out, lse, slice(None))


@pytest.mark.reference
def test_reference_page_table_drops_pages_outside_the_cache():
    """sparse_page_table(num_pages=P) drops a selected block whose entry lies outside [0, P)
    as it drops a repeated id (the same rows as with those entries -1 and no num_pages), and
    never lists a sub-page outside [0, P * B/S); without num_pages only negative entries are
    dropped."""
    step, hostile = _hostile_step()
    idx = _selection(step.num_tokens)
    args = (idx, step.cu_seqlens_q, step.seq_lens, step.block_table)
    kw = dict(num_kv_heads=2, block_size=B, sub_page_size=8)
    pages, lens = ref.sparse_page_table(*args, num_pages=step.num_pages, **kw)
    unfilled = step.block_table.clone()
    for r, c, _ in hostile:
        unfilled[r, c] = -1
    want = ref.sparse_page_table(*args[:3], unfilled, **kw)
    assert torch.equal(pages, want[0]) and torch.equal(lens, want[1])
    assert pages.min() >= 0 and pages.max() < step.num_pages * 2
    pad = _padding(step).repeat_interleave(2)
    assert (lens[pad] == 0).all() and (pages[pad] == 0).all() and (lens[~pad] > 0).any()
    # num_pages=None keeps the ids past the cache (the caller vouches for them)
    loose, _ = ref.sparse_page_table(*args, **kw)
    assert (loose // 2 >= step.num_pages).any()
    assert (loose >= 0).all()


@pytest.mark.reference
@pytest.mark.parametrize("fn", [ref.sparse_page_table, openmsa.sparse_page_table])
def test_page_table_num_pages_is_checked(fn):
    step, _ = _hostile_step()
    args = (_selection(step.num_tokens), step.cu_seqlens_q, step.seq_lens, step.block_table)
    for bad, error in ((-1, ValueError), (2.0, TypeError), (True, TypeError),
                       (torch.tensor(3), TypeError)):
        with pytest.raises(error, match="num_pages"):
            fn(*args, num_kv_heads=2, block_size=B, num_pages=bad)
    fn(*args, num_kv_heads=2, block_size=B, num_pages=0)


def _token_only():
    """The per-token kernel for every token (no tiles, the decode forms' knobs)."""
    return dataclasses.replace(DEFAULT, prefill_min_tokens=10 ** 6)


def _attend(path, q, k, v, idx, d, out):
    """sparse_attention on `path`: 'token' (the per-token kernel alone), 'split' (3 splits
    merged by a second launch), 'tiles' (tiles of 4 tokens taken wherever whole)."""
    if path == "split":
        p = _resplit(_plan_of(q, k, v, idx, block_size=B, config=_token_only(),
                              return_lse=True), 3, False)
        return _run_plan(p, q, k, v, idx, d, out=out, return_lse=True)
    config = _token_only() if path == "token" else _prefill_tiles_config(16, 1e9)
    return openmsa.sparse_attention(q, k, v, idx, d.cu_seqlens_q, d.seq_lens, d.block_table,
                                    block_size=B, out=out, return_lse=True, config=config)


@pytest.mark.interpret
@pytest.mark.parametrize("path, kv_dtype, far", [
    ("token", torch.float16, True), ("token", torch.float8_e4m3fn, True),
    ("split", torch.float16, False), ("tiles", torch.float16, True)], ids=str)
def test_kernels_read_nothing_outside_the_cache(kernel_device, path, kv_dtype, far):
    """Hostile page ids, a narrow table and q_len > seq_len: the reference's result, bit for bit
    on padding rows; nothing read from the guard pages around K/V, nothing written around out.
    On the tile path a tile of the chunk is taken with a page past the cache in its union."""
    step, _ = _hostile_step(far=far)
    d = _on(step, kernel_device)
    q, k, v = _inputs(step, kv_dtype, kernel_device)
    idx = _selection(step.num_tokens).to(kernel_device)
    want, want_lse = _reference(q, k, v, idx, step)
    buf, out = _guarded_out(q.shape, q.dtype, kernel_device)
    got, lse = _attend(path, q, k, v, idx, d, out)
    assert got.data_ptr() == out.data_ptr()
    assert_close(got, want)
    assert_close(lse, want_lse, torch.float32)
    pad = _padding(step)
    _assert_padding(got, lse, pad)
    assert buf[:GUARD].isnan().all() and buf[GUARD + q.shape[0]:].isnan().all()
    if path == "tiles":
        p = _plan_of(q, k, v, idx, block_size=B, config=_prefill_tiles_config(16, 1e9),
                     return_lse=True)
        taken = _taken(p, idx, d).cpu() >= 0
        cu = step.cu_seqlens_q.tolist()
        # tiles of 8 tokens (16 rows, G = 2); the chunk's tokens [cu[5], cu[6]) = [13, 25):
        # tile 2 lies inside it
        assert p.sizes["tile_tokens"] == 8 and cu[5] == 13
        assert taken[2].all() and not taken[[0, 1, 3]].any()


@pytest.mark.interpret
@pytest.mark.parametrize("kind", ["starts_late", "decreasing", "past_end"])
@pytest.mark.parametrize("path", ["token", "tiles"])
def test_kernels_pad_a_malformed_step(kernel_device, kind, path):
    """A malformed cu_seqlens_q: every token out = 0, lse = -inf (the reference's), no tile
    taken, nothing written around out (past_end: a tile past T would write there)."""
    step, _ = _hostile_step(far=False)
    step.cu_seqlens_q = _malformed(step.cu_seqlens_q)[kind]
    d = _on(step, kernel_device)
    q, k, v = _inputs(step, torch.float16, kernel_device)
    idx = _selection(step.num_tokens).to(kernel_device)
    buf, out = _guarded_out(q.shape, q.dtype, kernel_device)
    got, lse = _attend(path, q, k, v, idx, d, out)
    _assert_padding(got, lse, slice(None))
    assert buf[:GUARD].isnan().all() and buf[GUARD + q.shape[0]:].isnan().all()
    if path == "tiles":
        p = _plan_of(q, k, v, idx, block_size=B, config=_prefill_tiles_config(16, 1e9),
                     return_lse=True)
        assert not (_taken(p, idx, d) >= 0).any()


@pytest.mark.interpret
@pytest.mark.parametrize("num_pages", ["cache", None, 0])
def test_page_table_kernel_matches_reference_on_hostile_metadata(kernel_device, num_pages):
    step, _ = _hostile_step()
    num_pages = step.num_pages if num_pages == "cache" else num_pages
    idx = _selection(step.num_tokens)
    kw = dict(num_kv_heads=2, block_size=B, sub_page_size=8, num_pages=num_pages)
    d = _on(step, kernel_device)
    for cu in (step.cu_seqlens_q, _malformed(step.cu_seqlens_q)["decreasing"]):
        want = ref.sparse_page_table(idx, cu, step.seq_lens, step.block_table, **kw)
        got = openmsa.sparse_page_table(idx.to(kernel_device), cu.to(kernel_device),
                                        d.seq_lens, d.block_table, **kw)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def _gluon_hostile_case(dtype):
    """test_attention's mixed prefill chunk (B = D = 128, M3's 64 / 4 heads) with the table
    entries of blocks 0-2 (block 0: every token's first selected block) of both chunks'
    requests a page past the cache, a negative one other than -1, and int32's largest: (step,
    q, K, V, indices), K and V on the GPU between GUARD NaN pages."""
    from test_attention import _mixed_tiles_chunk
    step, q, k, v, idx = _mixed_tiles_chunk((64, 4), dtype)
    for r in (1, 3):
        step.block_table[r, :3] = torch.tensor([step.num_pages, -GUARD, 2 ** 31 - 1])
    caches = []
    for c in (k, v):
        buf = torch.full((c.shape[0] + 2 * GUARD, *c.shape[1:]), float("nan"),
                         device="cuda").to(c.dtype)
        buf[GUARD:GUARD + c.shape[0]] = c.cuda()
        caches.append(buf[GUARD:GUARD + c.shape[0]])
    return step, q, caches[0], caches[1], idx


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gluon_tiles_read_nothing_outside_the_cache(dtype):
    """The Gluon prefill tiles (16-bit K/V through TMA, fp8 through the loader warpgroup, which
    would read the NaN guard pages) with hostile page ids in the blocks their tiles select: the
    reference's result, nothing written around out; then a malformed step (cu_seqlens_q past
    T): no tile taken, every row 0 and -inf."""
    step, q, kd, vd, idx = _gluon_hostile_case(dtype)
    d = _on(step, "cuda")
    qd, idxd = q.cuda(), idx.cuda()
    p = _plan_of(qd, kd, vd, idxd, block_size=128, return_lse=True)
    assert p.find("tiles_gluon") is not None
    assert (_taken(p, idxd, d) >= 0).any()
    want, want_lse = ref.sparse_attention(q, kd.cpu(), vd.cpu(), idx, step.cu_seqlens_q,
                                          step.seq_lens, step.block_table, block_size=128,
                                          return_lse=True)
    buf, out = _guarded_out(q.shape, q.dtype, "cuda")
    got, lse = openmsa.sparse_attention(qd, kd, vd, idxd, d.cu_seqlens_q, d.seq_lens,
                                        d.block_table, block_size=128, out=out,
                                        return_lse=True)
    assert_close(got, want)
    assert_close(lse, want_lse, torch.bfloat16)
    assert buf[:GUARD].isnan().all() and buf[GUARD + q.shape[0]:].isnan().all()
    d.cu_seqlens_q[-1] = q.shape[0] + 1
    buf, out = _guarded_out(q.shape, q.dtype, "cuda")
    got, lse = openmsa.sparse_attention(qd, kd, vd, idxd, d.cu_seqlens_q, d.seq_lens,
                                        d.block_table, block_size=128, out=out,
                                        return_lse=True)
    assert not (_taken(p, idxd, d) >= 0).any()
    _assert_padding(got, lse, slice(None))
    assert buf[:GUARD].isnan().all() and buf[GUARD + q.shape[0]:].isnan().all()


@pytest.mark.interpret
def test_a_step_of_no_request_reads_nothing(kernel_device):
    """R = 0 with T > 0 (an engine's padded step holding no request): every token is padding on
    the per-token and the tile path (the tile plan's request lookup must not read seq_lens[-1]:
    an empty seq_lens has no element at all)."""
    g = torch.Generator().manual_seed(9)
    num_tokens, pages = 16, 3
    q = torch.randn(num_tokens, 4, 64, generator=g).half().to(kernel_device)
    k = torch.randn(pages, B, 2, 64, generator=g).half().to(kernel_device)
    v = torch.randn(pages, B, 2, 64, generator=g).half().to(kernel_device)
    idx = torch.zeros(num_tokens, 2, TOPK, dtype=torch.int32, device=kernel_device)
    cu = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    sl = torch.zeros(0, dtype=torch.int32, device=kernel_device)
    bt = torch.zeros(0, 4, dtype=torch.int32, device=kernel_device)
    for config in (DEFAULT, _prefill_tiles_config(16, 1e9)):
        out, lse = openmsa.sparse_attention(q, k, v, idx, cu, sl, bt, block_size=B,
                                            return_lse=True, config=config)
        assert torch.equal(out.cpu(), torch.zeros_like(out.cpu()))
        assert (lse == float("-inf")).all()
