# SPDX-License-Identifier: Apache-2.0
"""The host-side launch decisions that shape a kernel's grid, as plain functions of the step's
shapes: the indexer's selection layout, on an H200's 132 SMs (the attention's plan:
tests/plans/test_attention_plan.py).
The cases are the M3 shapes whose measured times chose the rules (docs/performance.md), and
which prefill scoring kernel (Gluon or Triton) a layout gets."""

import pytest
import torch

from openmsa.ops.indexer import api as indexer_api

pytestmark = pytest.mark.reference

CUDA = torch.device("cuda")  # a device object only: nothing runs on it


@pytest.mark.parametrize("rows, blocks, want", [
    (64, 1024, (256, True)),    # TP4 B=64 128K: 4 segments of 256 on the sort path
    (128, 1024, (512, True)),   # TP1 B=32 128K: 256 programs stay under the sort path's 264
    (4, 8192, (256, True)),     # B=1 at 1M: 128 programs
    (128, 256, (256, True)),    # B=32 32K: a row is one segment
    (2048, 256, (256, False)),  # B=128 32K q_len 4: the threshold search, one warp per row
    (32768, 1000, (1024, False)),  # an 8K prefill chunk after 120K (4 heads)
])
def test_selection_layout(rows, blocks, want):
    assert indexer_api._selection_layout(rows, blocks, 16, 132) == want


def test_selection_layout_without_fill(monkeypatch):
    monkeypatch.setitem(indexer_api.TUNING, "select_segment_fill", False)
    assert indexer_api._selection_layout(64, 1024, 16, 132) == (1024, True)


@pytest.mark.parametrize("tokens, blocks, chunk", [
    (128 * 4, 256, 0),     # TP1 B=128 32K q_len 4: 2048 programs, all resident unchunked
    (64 * 4, 1024, 0),     # TP1 B=64 128K q_len 4: 1024 programs
    (8 * 4, 8192, 0),      # TP1 1M B=8 q_len 4: 1024 programs (8 segments per row)
    (128 * 4, 8192, 128),  # TP1 1M B=128 q_len 4: 16384 programs
    (8192, 1000, 128),     # an 8K prefill chunk after 120K: 32768 programs
])
def test_selection_chunks(monkeypatch, tokens, blocks, chunk):
    """The search path reads its segments in chunks only in launches of >= select_chunk_min_waves
    programs per SM (measured: a decode step's chunked reads cost 2-4 µs). (select.py's plan:
    off Hopper, and on it for rows past select_short_max.)"""
    monkeypatch.setattr(indexer_api, "num_sms", lambda device: 132)
    monkeypatch.setitem(indexer_api.TUNING, "select_short_rows", False)
    kwargs = indexer_api._select_plan(tokens, 4, blocks, 16, 0, 1, 128, CUDA)[4]
    assert kwargs["BY_SORT"] is False and kwargs["CH"] == chunk


@pytest.mark.parametrize("tokens, blocks, topk, want", [
    (8192, 64, 16, (16, 4, 4, 4)),   # an 8K chunk with no context: 4 threads per row
    (4096, 50, 16, (16, 4, 1, 4)),   # a width that 4 does not divide: scalar loads
    (1024, 8, 16, (8, 1, 4, 4)),     # fewer blocks than K: groups of one (the search never runs)
    (2048, 64, 64, (64, 1, 4, 4)),
    (8192, 65, 16, (16, 8, 1, 8)),   # wider rows: 16 blocks per thread
    (8192, 1000, 16, (16, 64, 4, 32)),  # after 120K: a warp per row, 32 blocks per thread
    (8192, 1025, 16, None),          # past select_short_max
    (16, 64, 16, None),              # a decode step of few rows: the sort path
])
def test_short_rows_selection_plan(monkeypatch, tokens, blocks, topk, want):
    """Launches of many rows of at most select_short_max blocks select on Hopper with
    select_rows.py's kernel (G groups of W blocks, TPR threads per row, 16-byte loads when 4
    divides the width); others, other GPUs and select_short_rows off keep select.py's
    launches."""
    monkeypatch.setattr(indexer_api, "num_sms", lambda device: 132)
    monkeypatch.setattr(indexer_api, "capability", lambda device: (9, 0))
    monkeypatch.setattr(indexer_api, "gluon_hopper_available", lambda: True)

    def short():
        plan = indexer_api._select_plan(tokens, 4, blocks, topk, 0, 1, 128, CUDA)
        return plan[-1] and (plan[-1]["G"], plan[-1]["W"], plan[-1]["VEC"], plan[-1]["TPR"])
    assert short() == want
    if want:
        monkeypatch.setitem(indexer_api.TUNING, "select_short_rows", False)
        assert short() is None
        monkeypatch.setitem(indexer_api.TUNING, "select_short_rows", True)
        monkeypatch.setattr(indexer_api, "capability", lambda device: (8, 0))
        assert short() is None


class _OnCuda:
    """What launch planning reads of a tensor (shape, strides, dtype) on a CUDA device, from a
    meta tensor: planning needs no GPU."""

    def __init__(self, t):
        self.t, self.shape, self.dtype = t, t.shape, t.dtype
        self.device, self.is_cuda = CUDA, True

    def stride(self, *dim):
        return self.t.stride(*dim)

    def data_ptr(self):
        return 1 << 20  # an aligned stand-in (planning reads the V cache's parity)


def _index_pair(tokens=8192, heads=4, dim=128, pages=1088, dtype=torch.float8_e4m3fn,
                page_rows=128, q_view=None):
    q = torch.empty(tokens, heads, dim, dtype=dtype, device="meta")
    # page_rows > 128: each page padded (a page stride TMA rows cannot step over)
    c = torch.empty(pages, page_rows, dim, dtype=dtype, device="meta")[:, :128]
    return _OnCuda(q_view(q) if q_view else q), _OnCuda(c)


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(indexer_api, "num_sms", lambda device: 132)
    monkeypatch.setattr(indexer_api, "capability", lambda device: (9, 0))


@pytest.mark.parametrize("heads, want_grid, want_bps", [
    (4, (128, 4), 256),   # TP1 8K chunk after 120K: 128 tiles of 64 tokens, ~4 programs per SM
    (1, (32, 16), 64),    # TP4: 256 tokens per tile
])
def test_prefill_tile_launch_is_the_gluon_kernel_on_hopper(hopper, heads, want_grid, want_bps):
    q, c = _index_pair(heads=heads)
    plan = indexer_api._scores_plan(q, c, 1, 1024, 128, None)
    serial, grid, kwargs = plan[-1]
    # (a serial of its own: the Gluon launch goes through launch_planned too)
    assert isinstance(serial, int) and grid == want_grid and kwargs["GLUON"]["bps"] == want_bps
    assert "GLUON" not in kwargs["FALLBACK"][2]  # the Triton tile launch, for unaligned bases


@pytest.mark.parametrize("tokens, requests, max_q_len, knob, want", [
    (8192, 1, None, True, ["tile"]),         # a one-request chunk: no request launch
    (8192, 1, None, False, ["request", "tile"]),
    (8192, 2, None, True, ["request", "tile"]),
    (16, 1, None, True, ["request"]),        # T <= SMALL_Q: a decode or verify step
    (64, 1, 4, True, ["request"]),           # the caller's bound: every request short
])
def test_one_request_step_makes_the_tile_launch_only(hopper, monkeypatch, tokens, requests,
                                                     max_q_len, knob, want):
    """tile_one_request: a step of one request and more than SMALL_Q tokens is scored by the
    tile launch alone, which then takes any q_len (SMALL_Q 0) and is no programmatic dependent
    (nothing of ours runs before it)."""
    monkeypatch.setitem(indexer_api.TUNING, "tile_one_request", knob)
    for dtype in (torch.float8_e4m3fn, torch.float32):  # the Gluon launch, the Triton one
        q, c = _index_pair(tokens=tokens, dtype=dtype)
        plan = indexer_api._scores_plan(q, c, requests, 64, 128, max_q_len)
        kinds = ["tile" if kw.get("TILE_MODE") or "GLUON" in kw else "request"
                 for _, _, kw in plan]
        assert kinds == want
        if want == ["tile"]:
            kw = plan[0][2]
            for launch in ([kw["GLUON"], kw["FALLBACK"][2]] if "GLUON" in kw else [kw]):
                assert launch["SMALL_Q"] == 0 and not launch["launch_pdl"]
        elif "tile" in want:
            kw = plan[-1][2]
            assert (kw["GLUON"] if "GLUON" in kw else kw)["SMALL_Q"] == indexer_api.SMALL_Q


@pytest.mark.parametrize("case", ["heads3", "q_slice", "page_padding", "mixed", "dim64", "sm100",
                                  "off", "no_gluon"])
def test_prefill_tile_launch_stays_triton(hopper, monkeypatch, case):
    """Layouts a TMA descriptor of rows cannot describe, other GPUs, the knob off: the Triton
    tile launch, same scores."""
    if case == "q_slice":
        q, c = _index_pair(heads=8, q_view=lambda q: q[:, :4])
    elif case == "heads3":
        q, c = _index_pair(heads=3)
    elif case == "dim64":
        q, c = _index_pair(dim=64)
    elif case == "mixed":
        q = _OnCuda(torch.empty(8192, 4, 128, dtype=torch.bfloat16, device="meta"))
        c = _index_pair()[1]
    else:
        q, c = _index_pair(page_rows=130 if case == "page_padding" else 128)
    if case == "sm100":
        monkeypatch.setattr(indexer_api, "capability", lambda device: (10, 0))
    if case == "off":
        monkeypatch.setitem(indexer_api.TUNING, "prefill_ws", False)
    if case == "no_gluon":  # a Triton whose Gluon the kernel was not written for
        monkeypatch.setattr(indexer_api, "gluon_hopper_available", lambda: False)
    plan = indexer_api._scores_plan(q, c, 1, 1024, 128, None)
    assert plan[-1][0] is not None and "GLUON" not in plan[-1][2]


@pytest.mark.parametrize("dtype, heads", [(torch.float8_e4m3fn, 4), (torch.bfloat16, 1)])
def test_gluon_launch_descriptors(monkeypatch, dtype, heads):
    """The Gluon launch's host side (no GPU: the kernel is replaced): q as [T * H, Di] rows in
    64-row boxes, the cache as [P * B, Di] rows in one-block boxes, the split size passed as
    an argument and the rest as the plan's keywords."""
    from openmsa.ops.indexer import scores_ws
    seen = {}

    class Kernel:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.update(grid=grid, args=args, kwargs=kwargs)
            return run
    monkeypatch.setattr(scores_ws, "_block_scores_ws_kernel", Kernel())
    q = torch.zeros(100, heads, 128, dtype=dtype)
    cache = torch.zeros(10, 128, 128, dtype=dtype)
    table = torch.zeros(2, 7, dtype=torch.int32)
    scores = torch.zeros(100, heads, 7)
    indexer_api._launch_ws(q, cache, torch.zeros(3, dtype=torch.int32),
                           torch.zeros(2, dtype=torch.int32), table, scores, (2, 1),
                           dict(bps=32, H=heads, STAGES=6))
    q_desc, k_desc = seen["args"][:2]
    assert (list(q_desc.shape), list(q_desc.strides), list(q_desc.block_shape)) == \
        ([100 * heads, 128], [128, 1], [64, 128])
    assert (list(k_desc.shape), list(k_desc.strides), list(k_desc.block_shape)) == \
        ([1280, 128], [128, 1], [128, 128])
    assert seen["args"][-1] == 32 and seen["kwargs"] == dict(H=heads, STAGES=6)
    assert seen["grid"] == (2, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_tma_descriptor_matches_a_direct_one(dtype):
    """launch.tma_descriptor: the same descriptor as one built with the layout computed per
    call, and the layout computed once per box and dtype."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from openmsa.ops.common.launch import tma_descriptor
    t = torch.zeros(10, 128, 4, 256, dtype=dtype)[..., 128:]
    box = (1, 64, 1, 128)
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
           torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    want = TensorDescriptor(t, list(t.shape), list(t.stride()), list(box),
                            gl.NVMMASharedLayout.get_default_for(list(box), gdt))
    got = tma_descriptor(t, t.shape, t.stride(), box)
    assert got.base is t
    assert (list(got.shape), list(got.strides), list(got.block_shape), got.layout) == \
        (list(want.shape), list(want.strides), list(want.block_shape), want.layout)
    assert tma_descriptor(t, t.shape, t.stride(), box).layout is got.layout


@pytest.mark.parametrize("version, setting, want", [
    ("3.6.0", "", True), ("3.6.1", "", True), ("3.5.1", "", False), ("3.7.0", "", False),
    ("3.7.0", "1", True), ("3.6.0", "0", False)])
def test_gluon_kernels_only_on_the_triton_they_were_tested_on(monkeypatch, version, setting,
                                                              want):
    """Gluon's API moves between Triton minor versions: the Hopper Gluon kernels are chosen
    on 3.6 (the tested one), on another only with OPENMSA_GLUON=1, never with =0."""
    import triton

    from openmsa import _dispatch
    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.setenv("OPENMSA_GLUON", setting)
    _dispatch.gluon_hopper_available.cache_clear()
    try:
        assert _dispatch.gluon_hopper_available() == want
    finally:
        monkeypatch.undo()
        _dispatch.gluon_hopper_available.cache_clear()
