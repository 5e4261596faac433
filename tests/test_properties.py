# SPDX-License-Identifier: Apache-2.0
"""Property tests (hypothesis), tiers 0 and 1: random ragged steps against the naive
implementation of docs/spec.md in helpers/naive.py (written from the text, independent of
`openmsa.reference`), through the public ops: the reference on CPU (tier 0), the Triton kernels
under TRITON_INTERPRET=1 or on a GPU (tier 1, `interpret`).

A step holds 1-4 requests of q_len 0-8 (tier 0: seq_len up to 3000, block sizes 16-128), padding
tokens past cu_seqlens_q[R], pages in a random permutation, -1 holes inside a request's blocks,
garbage ids in unused table columns, NaN/inf in unused pages and in the never-written slots
past each request's keys, NaN in the query rows of padding tokens. The hostile variant adds
what docs/spec.md "Bounds" covers: page ids outside [0, P) (stale, negative, +-2^31), tables
narrower than a request needs, cu_seqlens_q not from 0 / decreasing / past T, seq_len below
q_len (negative, 2^31 - 1). Every op must give the spec's result, never crash.

Out-of-bounds guard: caches, tables and outputs are views inside larger buffers. Margin pages
hold values that would change a result if read (finite 64s for the index cache: a read scores
finitely where the spec says -inf; NaN for K/V), the table's memory past its width holds valid
page ids (a read past a row's width would score), and after every op the margins of every
written buffer must hold their old bits.

Inputs of the index branch are small integers, so every dot product is exact (fp32 and
float64 agree) and ties are frequent: selections compare exactly, the tie rule included.
Examples are derandomized (CI is reproducible); `print_blob` gives a failing example's
reproduction line.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import openmsa
from helpers.checks import assert_close
from helpers.naive import (FP8_MAX, naive_batch_is_valid, naive_block_scores, naive_layout,
                           naive_page_table, naive_select, naive_sparse_attention,
                           naive_write_index_cache, naive_write_kv_cache)

I32_MAX, I32_MIN = 2 ** 31 - 1, -2 ** 31
FP8 = torch.float8_e4m3fn
MARGIN = 2  # pages (or rows, columns) of guard band on each side of a buffer

# tier 0 runs the reference (fast), tier 1 the interpreter (~20-50 ms a program): tiny steps,
# few examples. deadline=None: a first example compiles; derandomize: the same examples on every
# run; no database: nothing written beside the tests.
_COMMON = dict(deadline=None, derandomize=True, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.function_scoped_fixture])
TIER0 = settings(max_examples=250, **_COMMON)
# the attention tests run in four variants, each example a naive softmax over up to K * B keys
# per (token, head): fewer examples a variant
TIER0_HEAVY = settings(max_examples=100, **_COMMON)
# no shrinking in tier 1: at a second or more per example it could run for minutes per failing
# test (hypothesis allows itself 5); the failing example prints as drawn, and tier 0 shrinks the
# same strategies
TIER1 = settings(max_examples=40, phases=(Phase.explicit, Phase.generate), **_COMMON)


@dataclasses.dataclass
class Geometry:
    """What a tier's steps may hold."""
    block_sizes: tuple[int, ...]
    max_seq: int
    max_q: int
    index_dims: tuple[int, ...]
    head_dims: tuple[int, ...]
    index_dtypes: tuple[tuple[torch.dtype, torch.dtype], ...]  # (query, cache)
    qkv_dtypes: tuple[tuple[torch.dtype, torch.dtype], ...]  # (q, K/V cache)
    max_topk: int


GEOMETRY0 = Geometry(block_sizes=(16, 32, 64, 128), max_seq=3000, max_q=8, index_dims=(16, 32),
                     head_dims=(16, 64),
                     index_dtypes=((torch.float32,) * 2, (torch.float16,) * 2,
                                   (torch.bfloat16,) * 2, (FP8, FP8), (torch.float16, FP8),
                                   (torch.bfloat16, FP8)),
                     qkv_dtypes=((torch.float32,) * 2, (torch.float16,) * 2,
                                 (torch.bfloat16,) * 2, (torch.float16, FP8),
                                 (torch.bfloat16, torch.bfloat16)),
                     max_topk=20)
# the interpreter: openmsa converts bf16 and fp8 there as the GPU does (issue 56), but its
# elementwise bf16 stays wrong, so the attention kernels refuse bf16 on CPU: fp32/fp16 q, K, V;
# the attention kernels take head dims 64-256, the indexer 16-256
GEOMETRY1 = Geometry(block_sizes=(16, 32), max_seq=200, max_q=5, index_dims=(16,),
                     head_dims=(64,),
                     index_dtypes=((torch.float32,) * 2, (torch.float16,) * 2,
                                   (torch.bfloat16,) * 2, (torch.float16, FP8), (FP8, FP8)),
                     qkv_dtypes=((torch.float32,) * 2, (torch.float16,) * 2),
                     max_topk=6)


# launch knobs that move a step onto the kernels' other paths (tier 1; the reference takes and
# ignores them): several selection segments and their merge; the threshold path in chunks and
# the group-bound form; split scoring launches and small prefill tiles; sorting selections
INDEXER_CONFIGS = (None, openmsa.IndexerConfig().replace(select=dict(segment=16)),
                   openmsa.IndexerConfig().replace(select=dict(segment=32, chunk=8,
                                                               chunk_min_waves=0),
                                                   group=dict(min_blocks=16)),
                   openmsa.IndexerConfig().replace(decode=dict(max_bps=2),
                                                   prefill=dict(rows=16, bps=2),
                                                   select=dict(sort_waves=0)))
# the prefill forms at any step size: tiles over the selections' union, or per-token programs
ATTENTION_CONFIGS = (None, openmsa.AttentionConfig(prefill_min_tokens=1),
                     openmsa.AttentionConfig(prefill_min_tokens=1, tiles=False))


@dataclasses.dataclass
class Case:
    """One step, its hostile edits applied. `table_buf` holds `table` (a [R, W] view) with
    valid page ids past the view's columns and rows."""
    block_size: int
    cu: list[int]
    seq_lens: list[int]
    num_tokens: int
    num_pages: int
    table_buf: torch.Tensor
    table: torch.Tensor
    read_pages: set[int]  # pages some request's blocks name: finite data
    tail_rows: dict[int, int]  # page -> first never-written row (a request's last block)
    seed: int

    def __repr__(self):
        # what a failing example prints: enough to rebuild the step by hand
        return (f"Case(B={self.block_size}, cu={self.cu}, seq_lens={self.seq_lens}, "
                f"T={self.num_tokens}, P={self.num_pages}, table={self.table.tolist()}, "
                f"seed={self.seed})")

    def metadata(self, device="cpu"):
        """(cu_seqlens_q, seq_lens, block_table) on `device`, each a view inside a larger
        buffer whose neighbours would change the result if read: a 0 offset after
        cu_seqlens_q[R] (a decrease: the step would become padding), seq_lens of 2^31 - 1."""
        i32 = dict(dtype=torch.int32, device=device)
        cu = torch.tensor([7, *self.cu, 0, 0], **i32)[1:len(self.cu) + 1]
        sl = torch.tensor([I32_MAX, *self.seq_lens, I32_MAX], **i32)[1:len(self.seq_lens) + 1]
        return cu, sl, moved(self.table_buf, self.table, device)[1]

    def positions(self, width: int | None = None) -> list[int]:
        width = self.table.shape[1] if width is None else width
        return [p for _, p in naive_layout(self.cu, self.seq_lens, self.num_tokens,
                                           self.block_size, width)]


def moved(buf: torch.Tensor, view: torch.Tensor, device):
    """(buf, view) on `device`: the same view of a copy of the whole buffer."""
    b = buf.to(device)
    return b, b.as_strided(view.shape, view.stride(), view.storage_offset())


def embedded(shape, dtype, fill, margin: int = MARGIN):
    """(buffer, view): a `shape` view inside a buffer `margin` larger on every side of every
    dim, all filled with `fill`."""
    buf = torch.full(tuple(s + 2 * margin for s in shape), fill, dtype=torch.float32 if
                     dtype.is_floating_point else torch.int64).to(dtype)
    view = buf[tuple(slice(margin, margin + s) for s in shape)]
    return buf, view


def assert_margins_kept(before: torch.Tensor, after: torch.Tensor, view: torch.Tensor):
    """Every element of `after` outside `view` (a view of it) holds `before`'s bits."""
    mask = torch.ones(after.shape, dtype=torch.bool)
    inside = mask.as_strided(view.shape, view.stride(), view.storage_offset())
    inside.fill_(False)
    raw = lambda x: x.cpu().view(torch.uint8 if x.element_size() == 1 else {
        2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
    assert torch.equal(raw(before)[mask], raw(after)[mask]), "a write landed outside its tensor"


def _garbage(dtype):
    # values a kernel must never let through: fp8 e4m3fn has no inf (448 its largest finite)
    if dtype in FP8_MAX:
        return [float("nan"), FP8_MAX[dtype], -FP8_MAX[dtype]]
    return [float("nan"), float("inf"), float("-inf"), 6e4]


@st.composite
def cases(draw, geo: Geometry, hostile: bool) -> Case:
    block = draw(st.sampled_from(geo.block_sizes))
    num_requests = draw(st.integers(1, 4))
    q_lens = [draw(st.integers(0, geo.max_q)) for _ in range(num_requests)]
    seq_lens = [draw(st.integers(q, geo.max_seq)) for q in q_lens]
    pad_tokens = draw(st.integers(0, 3))
    extra_columns = draw(st.integers(0, 2))
    spare_pages = draw(st.integers(0, 3))
    hole_rate = draw(st.sampled_from([0.0, 0.25]))
    share_prefix = draw(st.booleans())
    seed = draw(st.integers(0, 2 ** 32 - 1))
    g = torch.Generator().manual_seed(seed)

    blocks = [-(-s // block) for s in seq_lens]
    width = max(blocks + [1]) + extra_columns
    num_pages = max(sum(blocks) + spare_pages, 1)
    perm = torch.randperm(num_pages, generator=g).tolist()
    # the buffer past the view: valid page ids (a read past the width would see keys)
    table_buf = torch.randint(0, num_pages, (num_requests + MARGIN, width + MARGIN),
                              generator=g, dtype=torch.int32)
    table = table_buf[:num_requests, :width]
    # unused columns: garbage ids of every kind
    junk = [-1, -7, I32_MIN, I32_MAX, num_pages, num_pages + 5, 0]
    table.copy_(torch.tensor(junk)[torch.randint(0, len(junk), table.shape, generator=g)])
    used = 0
    for r, nb in enumerate(blocks):
        table[r, :nb] = torch.tensor(perm[used:used + nb], dtype=torch.int32)
        used += nb
        # prefix caching: two requests read one page (a full block 0 of both)
        if share_prefix and r > 0 and nb >= 2 and blocks[0] >= 2:
            table[r, 0] = table[0, 0]
        holes = torch.rand(nb, generator=g) < hole_rate
        table[r, :nb][holes] = -1
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    num_tokens = cu[-1] + pad_tokens

    if hostile:
        bad_rate = draw(st.sampled_from([0.0, 0.3]))
        stale = [num_pages, num_pages + 1, num_pages + MARGIN, I32_MAX, -2, -1000, I32_MIN]
        for r, nb in enumerate(blocks):
            bad = torch.rand(nb, generator=g) < bad_rate
            for j in bad.nonzero().flatten().tolist():
                table[r, j] = stale[int(torch.randint(0, len(stale), (), generator=g))]
        # each edit in a minority of examples, so that most hostile steps still have live
        # tokens beside the padded ones
        if draw(st.integers(0, 2)) == 0:
            # narrower than some request needs (the data past the view stays valid ids)
            width = draw(st.integers(1, max(blocks + [1])))
            table = table_buf[:num_requests, :width]
        cu_edit = draw(st.sampled_from(["none"] * 4 + ["start", "decrease", "past_end",
                                                       "extreme"]))
        if cu_edit == "start":
            cu[0] = draw(st.sampled_from([1, -1, I32_MIN]))
        elif cu_edit == "decrease":
            r = draw(st.integers(1, num_requests))
            cu[r] = cu[r - 1] - draw(st.integers(1, 3))
        elif cu_edit == "past_end":
            cu[-1] = num_tokens + draw(st.sampled_from([1, 5, I32_MAX - num_tokens]))
        elif cu_edit == "extreme":
            cu[draw(st.integers(1, num_requests))] = draw(st.sampled_from([I32_MAX, I32_MIN]))
        for r in range(num_requests):
            if draw(st.integers(0, 4)) == 0:
                q_len = cu[r + 1] - cu[r]
                seq_lens[r] = draw(st.sampled_from([q_len - 1, -1, I32_MIN, I32_MAX,
                                                    I32_MAX - 7]))
                # (q_len - 1 of hostile offsets may leave int32)
                seq_lens[r] = max(I32_MIN, min(I32_MAX, seq_lens[r]))
    read_pages, tail_rows = set(), {}
    for r, nb in enumerate(blocks):
        for j in range(min(nb, table.shape[1])):
            if 0 <= int(table[r, j]) < num_pages:
                read_pages.add(int(table[r, j]))
        if nb and 0 <= int(table_buf[r, nb - 1]) < num_pages and seq_lens[r] > 0:
            tail_rows[int(table_buf[r, nb - 1])] = seq_lens[r] - (nb - 1) * block
    return Case(block, cu, seq_lens, num_tokens, num_pages, table_buf, table, read_pages,
                tail_rows, seed)


def _poison_pages(cache: torch.Tensor, case: Case, g: torch.Generator):
    """NaN/inf (fp8: NaN/+-448) in pages no request names and in the never-written rows of
    each request's last block. `cache` is a [P, B, ...] view."""
    junk = torch.tensor(_garbage(cache.dtype))
    def fill(x):
        idx = torch.randint(0, len(junk), x.shape, generator=g)
        x.copy_(junk[idx].to(cache.dtype))
    for page in range(case.num_pages):
        if page not in case.read_pages:
            fill(cache[page])
    for page, row in case.tail_rows.items():
        if row < case.block_size:
            fill(cache[page, row:])


def index_inputs(case: Case, num_heads: int, head_dim: int, q_dtype, cache_dtype,
                 poison_keys: bool = False):
    """index_q [T, H, Di] (NaN rows for padding tokens) and the index cache (a view of its
    guard-band buffer, margin pages of 64s), small integers elsewhere. `poison_keys`: one key
    in 20 of the pages read holds a NaN or an inf in one dim ("Block score": a NaN dot
    counts as -inf; an inf one is +-inf or, against a 0 or another inf, NaN, in any order of
    summation)."""
    g = torch.Generator().manual_seed(case.seed + 1)
    q = torch.randint(-2, 3, (case.num_tokens, num_heads, head_dim), generator=g).float()
    for t, p in enumerate(case.positions()):
        if p < 0:
            q[t] = float("nan")
    buf, cache = embedded((case.num_pages, case.block_size, head_dim), cache_dtype, 64.0)
    keys = torch.randint(-2, 3, cache.shape, generator=g).float()
    if poison_keys:
        hit = torch.rand(cache.shape[:2], generator=g) < 0.05
        dim = torch.randint(0, head_dim, cache.shape[:2], generator=g)
        junk = torch.tensor(_garbage(cache_dtype))
        pick = junk[torch.randint(0, len(junk), cache.shape[:2], generator=g)]
        for page, row in hit.nonzero().tolist():
            keys[page, row, dim[page, row]] = pick[page, row]
    cache.copy_(keys.to(cache_dtype))
    _poison_pages(cache, case, g)
    return q.to(q_dtype), buf, cache


def kv_inputs(case: Case, num_heads: int, num_kv_heads: int, head_dim: int, q_dtype, kv_dtype):
    g = torch.Generator().manual_seed(case.seed + 2)
    q = torch.randn((case.num_tokens, num_heads, head_dim), generator=g)
    for t, p in enumerate(case.positions()):
        if p < 0:
            q[t] = float("nan")
    shape = (case.num_pages, case.block_size, num_kv_heads, head_dim)
    out = []
    for _ in range(2):
        buf, cache = embedded(shape, kv_dtype, float("nan"))
        cache.copy_(torch.randn(shape, generator=g).to(kv_dtype))
        _poison_pages(cache, case, g)
        out += [buf, cache]
    return (q.to(q_dtype), *out)


def hostile_indices(indices: torch.Tensor, positions: list[int], block_size: int,
                    g: torch.Generator) -> torch.Tensor:
    """A selection with anything in it: ids past the causal blocks, negative, +-2^31, repeats."""
    out = indices.clone()
    for t, p in enumerate(positions):
        n = p // block_size + 1 if p >= 0 else 1
        choices = torch.tensor([-1, -2, n, n + 1, I32_MAX, I32_MIN] + list(range(n)))
        idx = torch.randint(0, len(choices), out[t].shape, generator=g)
        keep = torch.rand(out[t].shape, generator=g) < 0.4
        out[t] = torch.where(keep, out[t], choices[idx].to(torch.int32))
    return out


def _dev(x, device):
    return x.to(device)


def check_block_scores(case, data, geo, device):
    num_heads = data.draw(st.sampled_from([1, 2, 4]), "num_heads")
    head_dim = data.draw(st.sampled_from(geo.index_dims), "head_dim")
    q_dtype, c_dtype = data.draw(st.sampled_from(geo.index_dtypes), "dtypes")
    poison = data.draw(st.booleans(), "poison_keys")
    q, cbuf, cache = index_inputs(case, num_heads, head_dim, q_dtype, c_dtype, poison)
    want = naive_block_scores(q, cache, case.cu, case.seq_lens, case.table, case.block_size)
    cu, sl, table = case.metadata(device)
    obuf, out = embedded(want.shape, torch.float32, 12345.0)
    obuf_d, out_d = moved(obuf, out, device)
    max_q_len = data.draw(st.sampled_from([None, 16]), "max_q_len")
    config = data.draw(st.sampled_from(INDEXER_CONFIGS), "config")
    got = openmsa.block_scores(_dev(q, device), moved(cbuf, cache, device)[1], cu, sl, table,
                               block_size=case.block_size, out=out_d, max_q_len=max_q_len,
                               config=config)
    assert got.data_ptr() == out_d.data_ptr()
    assert torch.equal(got.cpu(), want), _diff(got.cpu(), want)
    assert_margins_kept(obuf, obuf_d, out_d)


def check_select_blocks(case, data, geo, device):
    num_heads = data.draw(st.sampled_from([1, 2, 4]), "num_heads")
    head_dim = data.draw(st.sampled_from(geo.index_dims), "head_dim")
    q_dtype, c_dtype = data.draw(st.sampled_from(geo.index_dtypes), "dtypes")
    topk = data.draw(st.integers(1, geo.max_topk), "topk")
    init = data.draw(st.integers(0, min(2, topk)), "init_blocks")
    local = data.draw(st.integers(0, min(2, topk - init)), "local_blocks")
    poison = data.draw(st.booleans(), "poison_keys")
    q, cbuf, cache = index_inputs(case, num_heads, head_dim, q_dtype, c_dtype, poison)
    scores = naive_block_scores(q, cache, case.cu, case.seq_lens, case.table, case.block_size)
    want = naive_select(scores, case.positions(), topk=topk, init_blocks=init,
                        local_blocks=local, block_size=case.block_size)
    cu, sl, table = case.metadata(device)
    obuf, out = embedded(want.shape, torch.int32, -7)
    obuf_d, out_d = moved(obuf, out, device)
    got = openmsa.select_blocks(_dev(q, device), moved(cbuf, cache, device)[1], cu, sl, table,
                                topk=topk, init_blocks=init, local_blocks=local,
                                block_size=case.block_size, out=out_d,
                                config=data.draw(st.sampled_from(INDEXER_CONFIGS), "config"))
    assert torch.equal(got.cpu(), want), _diff(got.cpu(), want)
    assert_margins_kept(obuf, obuf_d, out_d)


def _selection(case, data, num_index_heads, topk, width=None):
    """A selection for the main branch: the naive one of random integer scores, or (drawn) one
    with hostile ids."""
    g = torch.Generator().manual_seed(case.seed + 3)
    positions = case.positions(width)
    scores = torch.randint(-3, 4, (case.num_tokens, num_index_heads, case.table.shape[1]),
                           generator=g).float()
    sel = naive_select(scores, positions, topk=topk, init_blocks=0, local_blocks=1,
                       block_size=case.block_size)
    if data.draw(st.booleans(), "hostile_ids"):
        sel = hostile_indices(sel, positions, case.block_size, g)
    return sel


def check_sparse_attention(case, data, geo, device, separate_main_table: bool):
    num_kv_heads = data.draw(st.sampled_from([1, 2]), "num_kv_heads")
    group = data.draw(st.sampled_from([1, 2, 4]), "group")
    num_index_heads = data.draw(st.sampled_from([1, 2, 4]), "num_index_heads")
    head_dim = data.draw(st.sampled_from(geo.head_dims), "head_dim")
    q_dtype, kv_dtype = data.draw(st.sampled_from(geo.qkv_dtypes), "dtypes")
    topk = data.draw(st.integers(1, geo.max_topk), "topk")
    scales = {}
    if kv_dtype in FP8_MAX and data.draw(st.booleans(), "scales"):
        scales = dict(k_scale=0.5, v_scale=2.0)
    if separate_main_table:
        # the main branch's own table, here narrower or wider than the index table
        width = data.draw(st.integers(1, case.table.shape[1] + 1), "main_width")
        case = dataclasses.replace(case, table=case.table_buf[:case.table.shape[0], :width])
    q, kbuf, k_cache, vbuf, v_cache = kv_inputs(case, group * num_kv_heads, num_kv_heads,
                                                head_dim, q_dtype, kv_dtype)
    indices = _selection(case, data, num_index_heads, topk)
    want, want_lse = naive_sparse_attention(q, k_cache, v_cache, indices, case.cu, case.seq_lens,
                                            case.table, block_size=case.block_size, **scales)
    cu, sl, table = case.metadata(device)
    obuf, out = embedded(q.shape, q_dtype, 7.0)
    obuf_d, out_d = moved(obuf, out, device)
    got, lse = openmsa.sparse_attention(
        _dev(q, device), moved(kbuf, k_cache, device)[1], moved(vbuf, v_cache, device)[1],
        _dev(indices, device), cu, sl, table, block_size=case.block_size, out=out_d,
        return_lse=True, config=data.draw(st.sampled_from(ATTENTION_CONFIGS), "config"),
        **scales)
    assert_close(got, want, msg="(out)")
    assert_close(lse, want_lse, msg="(lse)")
    assert_margins_kept(obuf, obuf_d, out_d)


def check_page_table(case, data, geo, device):
    num_kv_heads = data.draw(st.sampled_from([1, 2, 4]), "num_kv_heads")
    num_index_heads = data.draw(st.sampled_from([1, 2, 4]), "num_index_heads")
    topk = data.draw(st.integers(1, geo.max_topk), "topk")
    sub = data.draw(st.sampled_from([s for s in (1, 4, 16, 32, 128) if s <= case.block_size]),
                    "sub_page_size")
    indices = _selection(case, data, num_index_heads, topk)
    # the cache's page count, where the op takes it (then stale ids past it are dropped too)
    pages = {}
    if "num_pages" in inspect.signature(openmsa.sparse_page_table).parameters \
            and data.draw(st.booleans(), "num_pages"):
        pages = dict(num_pages=case.num_pages)
    want = naive_page_table(indices, case.cu, case.seq_lens, case.table,
                            num_kv_heads=num_kv_heads, block_size=case.block_size,
                            sub_page_size=sub, **pages)
    cu, sl, table = case.metadata(device)
    got = openmsa.sparse_page_table(_dev(indices, device), cu, sl, table,
                                    num_kv_heads=num_kv_heads, block_size=case.block_size,
                                    sub_page_size=sub, **pages)
    assert torch.equal(got[1].cpu(), want[1]), _diff(got[1].cpu(), want[1])
    assert torch.equal(got[0].cpu(), want[0]), _diff(got[0].cpu(), want[0])


def _diff(got, want):
    bad = (got != want) & ~(got.isnan() & want.isnan()) if got.is_floating_point() \
        else got != want
    where = bad.nonzero()[:5].tolist()
    return f"{int(bad.sum())} entries differ, first at {where}: got " \
           f"{[got[tuple(i)].item() for i in where]}, want {[want[tuple(i)].item() for i in where]}"


@st.composite
def slot_lists(draw, num_tokens_max: int = 12):
    """(num_pages, block_size, slots): distinct valid slots (a slot written twice has no
    defined winner) mixed with negative, past-the-cache and +-2^31/2^62 ones."""
    block = draw(st.sampled_from([16, 32]))
    num_pages = draw(st.integers(1, 4))
    n = draw(st.integers(0, num_tokens_max))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    g = torch.Generator().manual_seed(seed)
    valid = torch.randperm(num_pages * block, generator=g)[:n].tolist()
    bad = [-1, -2, num_pages * block, num_pages * block + 1, num_pages * block + block,
           I32_MAX, I32_MIN, 2 ** 40, -2 ** 40]
    slots = []
    for s in valid:
        slots.append(s if draw(st.integers(0, 2)) else bad[draw(st.integers(0, len(bad) - 1))])
    return num_pages, block, slots, seed


def check_write_index_cache(params, data, device, dtypes):
    num_pages, block, slots, seed = params
    slot_dtype = data.draw(st.sampled_from([torch.int64, torch.int32]), "slot_dtype")
    if slot_dtype == torch.int32:
        slots = [s if I32_MIN <= s <= I32_MAX else -1 for s in slots]
    k_dtype, c_dtype = data.draw(st.sampled_from(dtypes), "dtypes")
    dim = 16
    g = torch.Generator().manual_seed(seed)
    index_k = (torch.randn(len(slots), dim, generator=g) * 300).to(k_dtype)
    if len(slots):
        index_k[0, 0] = float("nan")
    buf, cache = embedded((num_pages, block, dim), c_dtype, 3.0)
    cache.copy_(torch.randn(cache.shape, generator=g).to(c_dtype))
    want = naive_write_index_cache(index_k, cache, slots)
    buf_d, cache_d = moved(buf, cache, device)
    before = buf_d.clone()
    openmsa.write_index_cache(_dev(index_k, device), cache_d,
                              torch.tensor(slots, dtype=slot_dtype, device=device))
    assert_bits_equal(cache_d, want)
    assert_margins_kept(before, buf_d, cache_d)


def check_write_kv_cache(params, data, device, dtypes):
    num_pages, block, slots, seed = params
    slot_dtype = data.draw(st.sampled_from([torch.int64, torch.int32]), "slot_dtype")
    if slot_dtype == torch.int32:
        slots = [s if I32_MIN <= s <= I32_MAX else -1 for s in slots]
    k_dtype, c_dtype = data.draw(st.sampled_from(dtypes), "dtypes")
    num_kv_heads, dim = data.draw(st.sampled_from([1, 2]), "num_kv_heads"), 16
    scales = dict(k_scale=0.5, v_scale=4.0) if c_dtype in FP8_MAX else {}
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(len(slots), num_kv_heads, dim, generator=g) * 300).to(k_dtype)
    v = torch.randn(len(slots), num_kv_heads, dim, generator=g).to(k_dtype)
    shape = (num_pages, block, num_kv_heads, dim)
    kbuf, kc = embedded(shape, c_dtype, 3.0)
    vbuf, vc = embedded(shape, c_dtype, 5.0)
    kc.copy_(torch.randn(shape, generator=g).to(c_dtype))
    vc.copy_(torch.randn(shape, generator=g).to(c_dtype))
    want_k, want_v = naive_write_kv_cache(k, v, kc, vc, slots, **scales)
    kbuf_d, kc_d = moved(kbuf, kc, device)
    vbuf_d, vc_d = moved(vbuf, vc, device)
    kb, vb = kbuf_d.clone(), vbuf_d.clone()
    openmsa.write_kv_cache(_dev(k, device), _dev(v, device), kc_d, vc_d,
                           torch.tensor(slots, dtype=slot_dtype, device=device), **scales)
    assert_bits_equal(kc_d, want_k)
    assert_bits_equal(vc_d, want_v)
    assert_margins_kept(kb, kbuf_d, kc_d)
    assert_margins_kept(vb, vbuf_d, vc_d)


def assert_bits_equal(got, want):
    """The same bits where `want` is a number (-0.0 is not 0.0), NaN where it is NaN (the spec
    keeps NaN a NaN, not its payload: torch's bf16 -> fp32 -> bf16 sets every bit of one)."""
    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    got = got.cpu().contiguous()
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan), "NaN positions differ"
    g, w = got.view(raw)[~nan], want.contiguous().view(raw)[~nan]
    assert torch.equal(g, w), _diff(got.float(), want.float())


def check_fused_prepare_slots(params, data, device, dtypes):
    """fused_prepare writes exactly the slots in [0, P * B) of both caches (the index cache
    follows its own slots) and nothing else, inside or outside the caches; V is stored as
    given (not normed), so its rows are checked exactly too."""
    num_pages, block, slots, seed = params
    x_dtype, c_dtype = data.draw(st.sampled_from(dtypes), "dtypes")
    g = torch.Generator().manual_seed(seed)
    index_slots = [slots[i] for i in torch.randperm(len(slots), generator=g).tolist()]
    cfg = openmsa.MSAConfig(num_heads=2, num_kv_heads=1, head_dim=64, num_index_heads=1,
                            index_head_dim=16, block_size=block, rotary_dim=16)
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim \
        + (cfg.num_index_heads + 1) * cfg.index_head_dim
    num_tokens = len(slots)
    qkv = torch.randn(num_tokens, width, generator=g).to(x_dtype)
    weights = [torch.randn(n, generator=g).to(x_dtype) * 0.1 for n in (64, 64, 16, 16)]
    positions = torch.randint(0, 5000, (num_tokens,), generator=g)
    kbuf, kc = embedded((num_pages, block, 1, 64), c_dtype, 3.0)
    vbuf, vc = embedded((num_pages, block, 1, 64), c_dtype, 5.0)
    ibuf, ic = embedded((num_pages, block, 16), c_dtype, 7.0)
    for c in (kc, vc, ic):
        c.fill_(float("nan"))
    # [q 2x64 | k 64 | v 64 | index_q 16 | index_k 16]
    v = qkv[:, 192:256].reshape(num_tokens, 1, 64)
    _, want_v = naive_write_kv_cache(v, v, vc, vc, slots)
    bufs = [moved(b, c, device) for b, c in ((kbuf, kc), (vbuf, vc), (ibuf, ic))]
    before = [b.clone() for b, _ in bufs]
    openmsa.fused_prepare(_dev(qkv, device), _dev(positions, device), cfg,
                          *[_dev(w, device) for w in weights], bufs[0][1], bufs[1][1],
                          torch.tensor(slots, dtype=torch.int64, device=device), bufs[2][1],
                          torch.tensor(index_slots, dtype=torch.int64, device=device))
    assert_bits_equal(bufs[1][1], want_v)
    for (b, c), old, sl in zip(bufs, before, (slots, slots, index_slots)):
        assert_margins_kept(old, b, c)
        # the NaN fill stays wherever no valid slot points
        written = torch.zeros(c.shape[:2], dtype=torch.bool)
        for s in sl:
            if 0 <= s < num_pages * block:
                written[s // block, s % block] = True
        cc = c.cpu().float()
        assert cc[~written].isnan().all(), "fused_prepare wrote a slot outside its slots"
        assert not cc[written].isnan().any(), "fused_prepare skipped a valid slot"


def _argument_errors(device):
    """Calls with a malformed shape or dtype and the argument their error must name."""
    i32 = dict(dtype=torch.int32, device=device)
    q = torch.zeros(3, 1, 16, device=device)
    cache = torch.zeros(2, 16, 16, device=device)
    kq = torch.zeros(3, 2, 64, device=device)
    kv = torch.zeros(2, 16, 1, 64, device=device)
    cu = torch.tensor([0, 1, 3], **i32)
    sl = torch.tensor([1, 2], **i32)
    table = torch.zeros(2, 1, **i32)
    idx = torch.zeros(3, 1, 2, **i32)
    score = lambda **kw: lambda: openmsa.block_scores(
        kw.get("q", q), cache, kw.get("cu", cu), kw.get("sl", sl), kw.get("table", table),
        block_size=16)
    attend = lambda **kw: lambda: openmsa.sparse_attention(
        kq, kv, kv, kw.get("idx", idx), kw.get("cu", cu), sl, kw.get("table", table),
        block_size=16)
    return [
        (score(table=torch.zeros(1, 4, **i32)), "block_table"),  # fewer rows than requests
        (score(table=torch.zeros(4, **i32)), "block_table"),
        (score(table=torch.zeros(2, 4, dtype=torch.int64, device=device)), "block_table"),
        (score(cu=torch.tensor([0, 3], **i32)), "cu_seqlens_q"),
        (score(cu=torch.tensor([0, 1, 3], dtype=torch.int64, device=device)), "cu_seqlens_q"),
        (score(cu=torch.tensor([0, 9, 1, 9, 3], **i32)[::2]), "cu_seqlens_q"),
        (score(sl=torch.tensor([[1, 2]], **i32)), "seq_lens"),
        (score(q=torch.zeros(3, 1, 8, device=device)), "index_"),
        (attend(idx=torch.zeros(2, 1, 2, **i32)), "indices"),
        (attend(idx=torch.zeros(3, 1, 2, dtype=torch.int64, device=device)), "indices"),
        (attend(table=torch.zeros(1, 1, **i32)), "block_table"),
        (lambda: openmsa.sparse_page_table(idx, cu, sl, table, num_kv_heads=1, block_size=16,
                                           sub_page_size=3), "sub_page_size"),
        (lambda: openmsa.write_index_cache(torch.zeros(3, 16, device=device), cache,
                                           torch.zeros(2, dtype=torch.int64, device=device)),
         "slot_mapping"),
        (lambda: openmsa.write_index_cache(torch.zeros(3, 16, device=device), cache,
                                           torch.zeros(3, device=device)), "slot_mapping"),
        (lambda: openmsa.write_kv_cache(kq[:, :1], kq[:, :1], kv, kv,
                                        torch.zeros(3, 2, dtype=torch.int64, device=device)),
         "slot_mapping"),
    ]


def check_argument_errors(device):
    for call, name in _argument_errors(device):
        with pytest.raises((TypeError, ValueError)) as err:
            call()
        assert name in str(err.value), f"the error does not name {name}: {err.value}"


def reference_tier(test):
    """The public ops on CPU tensors: the reference here; under TRITON_INTERPRET=1 they would
    run the kernels at tier-0 sizes, far too slow for the interpreter (conftest.py skips
    `dispatch` tests there)."""
    return pytest.mark.reference(pytest.mark.dispatch(test))


INDEX_WRITE_DTYPES0 = ((torch.float32, torch.float32), (torch.float16, torch.float16),
                       (torch.bfloat16, torch.bfloat16), (torch.float32, FP8),
                       (torch.bfloat16, FP8), (torch.float32, torch.float16))
KV_WRITE_DTYPES0 = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                    (torch.float16, FP8), (torch.float32, torch.float16))


HOSTILE = pytest.mark.parametrize("hostile", [False, True], ids=["step", "hostile"])


@reference_tier
@HOSTILE
@TIER0
@given(data=st.data())
def test_block_scores(hostile, data):
    check_block_scores(data.draw(cases(GEOMETRY0, hostile), "case"), data, GEOMETRY0, "cpu")


@reference_tier
@HOSTILE
@TIER0
@given(data=st.data())
def test_select_blocks(hostile, data):
    check_select_blocks(data.draw(cases(GEOMETRY0, hostile), "case"), data, GEOMETRY0, "cpu")


@reference_tier
@HOSTILE
@pytest.mark.parametrize("separate_main_table", [False, True], ids=["one_table", "two_tables"])
@TIER0_HEAVY
@given(data=st.data())
def test_sparse_attention(hostile, separate_main_table, data):
    check_sparse_attention(data.draw(cases(GEOMETRY0, hostile), "case"), data, GEOMETRY0, "cpu",
                           separate_main_table)


@reference_tier
@HOSTILE
@TIER0
@given(data=st.data())
def test_sparse_page_table(hostile, data):
    check_page_table(data.draw(cases(GEOMETRY0, hostile), "case"), data, GEOMETRY0, "cpu")


@reference_tier
@TIER0
@given(params=slot_lists(), data=st.data())
def test_write_index_cache(params, data):
    check_write_index_cache(params, data, "cpu", INDEX_WRITE_DTYPES0)


@reference_tier
@TIER0
@given(params=slot_lists(), data=st.data())
def test_write_kv_cache(params, data):
    check_write_kv_cache(params, data, "cpu", KV_WRITE_DTYPES0)


@reference_tier
@TIER0
@given(case=cases(GEOMETRY0, hostile=True), with_pages=st.booleans())
def test_validate_batch(case, with_pages):
    """validate_batch raises ValueError exactly on the steps the spec calls malformed (a table
    entry outside [0, P) only when num_pages is given); nothing else escapes."""
    cu, sl, table = case.metadata()
    num_pages = case.num_pages if with_pages else None
    valid = naive_batch_is_valid(case.cu, case.seq_lens, case.table,
                                 block_size=case.block_size, num_pages=num_pages)
    try:
        openmsa.validate_batch(cu, sl, table, block_size=case.block_size, num_pages=num_pages)
    except ValueError:
        assert not valid, "validate_batch refused a valid step"
    else:
        assert valid, "validate_batch accepted a malformed step"


@reference_tier
@TIER0_HEAVY
@given(params=slot_lists(), data=st.data())
def test_fused_prepare_slots(params, data):
    check_fused_prepare_slots(params, data, "cpu", ((torch.float32, torch.float32),
                                                    (torch.bfloat16, torch.bfloat16),
                                                    (torch.bfloat16, FP8)))


@reference_tier
def test_argument_errors_name_the_argument():
    """Malformed shapes and dtypes (what the ops do check) raise TypeError/ValueError naming
    the argument, on the reference."""
    check_argument_errors("cpu")


@reference_tier
def test_the_suite_catches_a_wrong_tie_rule():
    """The selection comparison can fail: with every score tied (all-zero keys), the naive
    selection with the tie rule flipped (higher id first) disagrees with select_blocks, while
    the naive one of the spec agrees."""
    block, seq_len = 16, 5 * 16
    cu, sl = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32)
    table = torch.arange(5, dtype=torch.int32)[None]
    q, cache = torch.ones(1, 1, 16), torch.zeros(5, block, 16)
    got = openmsa.select_blocks(q, cache, cu, sl, table, topk=3, local_blocks=1,
                                block_size=block)
    scores = naive_block_scores(q, cache, cu, sl, table, block)
    kw = dict(topk=3, init_blocks=0, local_blocks=1, block_size=block)
    assert torch.equal(got, naive_select(scores, [seq_len - 1], **kw))
    flipped = naive_select(scores, [seq_len - 1], lower_id_first=False, **kw)
    assert flipped[0, 0].tolist() == [2, 3, 4] and not torch.equal(got, flipped)


# NaN and inf keys and queries are deliberate: numpy's warning in the interpreter's dots says so
NAN_DOTS = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
INDEX_WRITE_DTYPES1 = ((torch.float32, torch.float32), (torch.float16, torch.float16),
                       (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
                       (torch.float32, FP8), (torch.bfloat16, FP8))
KV_WRITE_DTYPES1 = INDEX_WRITE_DTYPES1


@pytest.mark.interpret
@NAN_DOTS
@HOSTILE
@TIER1
@given(data=st.data())
def test_block_scores_kernels(kernel_device, hostile, data):
    check_block_scores(data.draw(cases(GEOMETRY1, hostile), "case"), data, GEOMETRY1,
                       kernel_device)


@pytest.mark.interpret
@NAN_DOTS
@HOSTILE
@TIER1
@given(data=st.data())
def test_select_blocks_kernels(kernel_device, hostile, data):
    check_select_blocks(data.draw(cases(GEOMETRY1, hostile), "case"), data, GEOMETRY1,
                        kernel_device)


@pytest.mark.interpret
@NAN_DOTS
@HOSTILE
@pytest.mark.parametrize("separate_main_table", [False, True], ids=["one_table", "two_tables"])
@TIER1
@given(data=st.data())
def test_sparse_attention_kernels(kernel_device, hostile, separate_main_table, data):
    check_sparse_attention(data.draw(cases(GEOMETRY1, hostile), "case"), data, GEOMETRY1,
                           kernel_device, separate_main_table)


@pytest.mark.interpret
@NAN_DOTS
@HOSTILE
@TIER1
@given(data=st.data())
def test_sparse_page_table_kernels(kernel_device, hostile, data):
    check_page_table(data.draw(cases(GEOMETRY1, hostile), "case"), data, GEOMETRY1,
                     kernel_device)


@pytest.mark.interpret
@TIER1
@given(params=slot_lists(), data=st.data())
def test_write_index_cache_kernels(kernel_device, params, data):
    check_write_index_cache(params, data, kernel_device, INDEX_WRITE_DTYPES1)


@pytest.mark.interpret
@TIER1
@given(params=slot_lists(), data=st.data())
def test_write_kv_cache_kernels(kernel_device, params, data):
    check_write_kv_cache(params, data, kernel_device, KV_WRITE_DTYPES1)


@pytest.mark.interpret
@TIER1
@given(params=slot_lists(), data=st.data())
def test_fused_prepare_slots_kernels(kernel_device, params, data):
    check_fused_prepare_slots(params, data, kernel_device, ((torch.float32, torch.float32),
                                                            (torch.float16, torch.float16),
                                                            (torch.bfloat16, FP8)))


@pytest.mark.interpret
def test_argument_errors_name_the_argument_kernels(kernel_device):
    check_argument_errors(kernel_device)
