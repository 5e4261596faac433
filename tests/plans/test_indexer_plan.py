# SPDX-License-Identifier: Apache-2.0
"""The index branch's launch plan (ops/indexer/plan.py) as a pure function of step shapes and
hand-made device facts: which launches a step gets, their grids and the constexprs the
measured rules choose, on an H200's 132 SMs (the M3 shapes whose times chose the rules,
docs/performance.md)."""

import dataclasses

import pytest
import torch

from openmsa.ops.common.plan import DeviceFacts
from openmsa.ops.indexer.plan import (DEFAULT, SMALL_Q, IndexerConfig, IndexerShape, cp_local_keys,
                                      cp_merge, cp_plan, cp_share, plan, selection_layout,
                                      selection_plan)

pytestmark = pytest.mark.reference

FP8 = torch.float8_e4m3fn
H200 = DeviceFacts(kind="cuda", num_sms=132, capability=(9, 0), gluon_hopper=True)
CPU = DeviceFacts(kind="cpu", num_sms=4, capability=(0, 0), gluon_hopper=False)


def _shape(tokens=8192, heads=4, requests=1, blocks=1024, dtype=FP8, cache_dtype=None, dim=128,
           block=128, max_q_len=None, tma_rows=True, topk=None, tma_q=None):
    return IndexerShape(num_tokens=tokens, num_heads=heads, head_dim=dim, num_requests=requests,
                        max_blocks=blocks, block_size=block, q_dtype=dtype,
                        cache_dtype=cache_dtype or dtype, max_q_len=max_q_len,
                        tma_rows=tma_rows, topk=topk,
                        tma_q=tma_rows if tma_q is None else tma_q)


def test_config_lists_every_knob():
    """A newcomer lists every knob of the op from one frozen dataclass of at most 15 fields,
    each a small frozen form of one launch's knobs (or the NVFP4 prefill choice); a variant is
    a dataclasses.replace of DEFAULT (IndexerConfig.replace takes a form's changes as a dict),
    hashed and compared by value."""
    fields = dataclasses.fields(IndexerConfig)
    assert len(fields) <= 15 and DEFAULT == IndexerConfig()
    for f in fields:
        form = getattr(DEFAULT, f.name)
        assert f.name == "nvfp4_prefill" or dataclasses.is_dataclass(form)
        if dataclasses.is_dataclass(form):
            assert len(dataclasses.fields(form)) <= 10
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(form, dataclasses.fields(form)[0].name, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.select = None
    variant = DEFAULT.replace(gluon={"waves": 2})
    assert variant.gluon.waves == 2 and variant.gluon.stages_fp8 == DEFAULT.gluon.stages_fp8
    assert variant == dataclasses.replace(DEFAULT, gluon=dataclasses.replace(DEFAULT.gluon,
                                                                             waves=2))
    assert hash(variant) == hash(DEFAULT.replace(gluon={"waves": 2})) != hash(DEFAULT)
    import pickle
    assert pickle.loads(pickle.dumps(variant)) == variant


@pytest.mark.parametrize("rows, blocks, want", [
    (64, 1024, (256, True)),    # TP4 B=64 128K: 4 segments of 256 on the sort path
    (128, 1024, (512, True)),   # TP1 B=32 128K: 256 programs stay under the sort path's 264
    (4, 8192, (256, True)),     # B=1 at 1M: 128 programs
    (128, 256, (256, True)),    # B=32 32K: a row is one segment
    (2048, 256, (256, False)),  # B=128 32K q_len 4: the threshold search, one warp per row
    (32768, 1000, (1024, False)),  # an 8K prefill chunk after 120K (4 heads)
])
def test_selection_layout(rows, blocks, want):
    assert selection_layout(rows, blocks, 16, 132) == want


@pytest.mark.parametrize("tokens, blocks, chunk", [
    (128 * 4, 256, 0),     # TP1 B=128 32K q_len 4: 2048 programs, all resident unchunked
    (64 * 4, 1024, 0),     # TP1 B=64 128K q_len 4: 1024 programs
    (8 * 4, 8192, 0),      # TP1 1M B=8 q_len 4: 1024 programs (8 segments per row)
    (128 * 4, 8192, 128),  # TP1 1M B=128 q_len 4: 16384 programs
    (8192, 1000, 128),     # an 8K prefill chunk after 120K: 32768 programs
])
def test_selection_chunks(tokens, blocks, chunk):
    """The search path reads its segments in chunks only in launches of >= select.chunk_min_waves
    programs per SM (a decode step's programs fit at once, and there the chunks' serial loads
    cost). (select.py's plan: off Hopper, and on it for rows past short_rows.max_blocks.)"""
    for facts in (dataclasses.replace(H200, gluon_hopper=False),
                  dataclasses.replace(H200, capability=(10, 0))):
        # (the group-bound path is not what this pins)
        config = DEFAULT.replace(group={"min_blocks": 1 << 30})
        launch = selection_plan(_shape(tokens, blocks=blocks, topk=16), facts,
                                config).find("select_segments")
        assert launch.params["BY_SORT"] is False and launch.params["CH"] == chunk


@pytest.mark.parametrize("tokens, blocks, topk, want", [
    (8192, 64, 16, (16, 4, 4, 4, True)),   # an 8K chunk with no context: 4 threads per row
    (2048, 64, 16, (16, 4, 4, 4, True)),   # the same at TP4 (8192 rows)
    (4096, 50, 16, (16, 4, 1, 4, True)),   # a width that 4 does not divide: scalar loads
    (1024, 8, 16, (8, 1, 4, 4, True)),     # fewer blocks than K: groups of one (never sorted)
    (2048, 64, 64, (64, 1, 4, 4, True)),
    (8192, 65, 16, (16, 8, 1, 8, True)),   # wider rows: 16 blocks per thread, sorted to 128
    (8192, 129, 16, (16, 16, 1, 16, False)),  # searched past 128 blocks
    (8192, 1000, 16, (16, 64, 4, 32, False)),  # after 120K: a warp per row, 32 blocks a thread
    (8192, 1025, 16, None),          # past short_rows.max_blocks
    (16, 64, 16, None),              # a decode step of few rows: the sort path
])
def test_short_rows_selection_plan(tokens, blocks, topk, want):
    """Launches of many rows of at most short_rows.max_blocks blocks select on Hopper with
    select_rows.py's kernel (G groups of W blocks, TPR threads per row, 16-byte loads when 4
    divides the width, rows of at most 128 blocks sorted, wider ones searched); others, other
    GPUs and short_rows.max_blocks 0 keep select.py's launches."""

    def short(facts=H200, config=DEFAULT):
        launch = selection_plan(_shape(tokens, blocks=blocks, topk=topk), facts,
                                config).find("select_short_rows")
        return launch and tuple(launch.params[k] for k in ("G", "W", "VEC", "TPR", "SORT"))
    assert short() == want
    if want:
        launch = selection_plan(_shape(tokens, blocks=blocks, topk=topk), H200, DEFAULT)
        # 32 / TPR rows per warp, one warp per program; a programmatic dependent launch
        assert launch.launches[0].grid == (-(-tokens * 4 // (32 // want[3])),)
        assert launch.launches[0].params["launch_pdl"] and len(launch) == 1
        assert short(config=DEFAULT.replace(short_rows={"max_blocks": 0})) is None
        assert short(facts=dataclasses.replace(H200, capability=(8, 0))) is None
        assert short(facts=dataclasses.replace(H200, gluon_hopper=False)) is None


def test_selection_forms_and_their_sizes():
    """The three forms of the selection and the buffers api.py makes for them: segments (and
    candidates with several), the group-bound path's maxima and scratch, none for short rows."""
    # a decode step at 1M: 8 sort segments per row, merged
    p = selection_plan(_shape(1, blocks=8192, topk=16), H200)
    assert p.kernels() == ("select_segments", "select_merge")
    assert dict(p.sizes) == dict(segments=32, candidates=16, scratch=0)
    assert p.find("select_merge").params["PDL"] and p.find("select_segments").params["BY_SORT"]
    # an 8K chunk after 1M: the group-bound path
    p = selection_plan(_shape(8192, blocks=8192, topk=16), H200)
    assert p.kernels() == ("select_group_max", "select_group_bound")
    assert dict(p.sizes) == dict(groups=512, group_scratch=64)
    assert p.find("select_group_max").grid == (8192, 4, 8)
    # without the group-bound path: 1024-block segments searched with scratch rows
    p = selection_plan(_shape(8192, blocks=8192, topk=16), H200,
                       DEFAULT.replace(group={"min_blocks": 1 << 30}))
    assert p.kernels() == ("select_segments", "select_merge")
    assert dict(p.sizes) == dict(segments=8, candidates=16, scratch=64)
    assert not p.find("select_merge").params["PDL"]
    # a short-row chunk: one launch, no buffers
    assert dict(selection_plan(_shape(8192, blocks=64, topk=16), H200).sizes) == {}
    # nothing to select
    assert len(selection_plan(_shape(0, topk=16), H200)) == 0
    assert len(selection_plan(_shape(8192), H200)) == 0


@pytest.mark.parametrize("heads, want_grid, want_bps", [
    (4, (128, 4), 256),   # TP1 8K chunk after 120K: 128 tiles of 64 tokens, ~4 programs per SM
    (1, (32, 16), 64),    # TP4: 256 tokens per tile
])
def test_prefill_tile_launch_is_the_gluon_kernel_on_hopper(heads, want_grid, want_bps):
    p = plan(_shape(heads=heads), H200)
    assert p.kernels() == ("scores_prefill_gluon", "scores_prefill_unaligned")
    gluon, triton_tile = p.launches
    assert gluon.grid == want_grid and gluon.params["bps"] == want_bps
    # the Triton prefill launch beside it, for bases TMA cannot take
    assert triton_tile.params["TILE_MODE"] and gluon.key != triton_tile.key


@pytest.mark.parametrize("heads, blocks, want_grid, want_bps", [
    # TP4, 8K chunk, no context (the model: 10-block splits end in 16 block steps, 16-block in
    # 20)
    (1, 64, (32, 7), 10),
    (1, 128, (32, 6), 25),   # TP4 after 8K (longer splits pay fewer starts)
    (1, 320, (32, 14), 24),  # TP4 after 32K
    # TP1, no context: whole chunks
    (4, 64, (128, 2), 32),
])
def test_short_prefill_splits_weigh_starts_against_balance(heads, blocks, want_grid, want_bps):
    """A split shorter than a chunk of CH blocks takes as many blocks (8 or more) as the
    start-cost model (plan._short_prefill_bps) finds fastest: the orderings measured on the H200."""
    gluon = plan(_shape(heads=heads, blocks=blocks), H200).find("scores_prefill_gluon")
    assert gluon.grid == want_grid and gluon.params["bps"] == want_bps


def test_short_prefill_splits_model_extremes():
    """With an SM per program the longest program decides (the shortest splits win); with one
    SM every start adds up (the longest win)."""
    from openmsa.ops.indexer.plan import _short_prefill_bps
    shape = _shape(heads=1, blocks=64)
    assert _short_prefill_bps(shape, 10 ** 4, 256, 32, 32) == 8
    assert _short_prefill_bps(shape, 1, 256, 32, 32) == 32


@pytest.mark.parametrize("tokens, requests, max_q_len, want", [
    (8192, 1, None, ["tile"]),               # a one-request chunk: no decode launch
    (8192, 2, None, ["request", "tile"]),
    (16, 1, None, ["request"]),              # T <= SMALL_Q: a decode or verify step
    (64, 1, 4, ["request"]),                 # the caller's bound: every request short
])
def test_one_request_step_makes_the_tile_launch_only(tokens, requests, max_q_len, want):
    """A step of one request and more than SMALL_Q tokens is scored by the prefill launch alone,
    which then takes any q_len (SMALL_Q 0) and is no programmatic dependent (nothing of ours
    runs before it)."""
    for dtype in (FP8, torch.float32):  # the Gluon launch, the Triton one
        p = plan(_shape(tokens, requests=requests, blocks=64, dtype=dtype,
                        max_q_len=max_q_len), H200)
        kinds = ["request" if k == "scores_decode" else "tile" for k in p.kernels()
                 if k != "scores_prefill_unaligned"]
        assert kinds == want
        tiles = [launch for launch in p if launch.kernel.startswith("scores_prefill")]
        if want == ["tile"]:
            for launch in tiles:
                assert launch.params["SMALL_Q"] == 0 and not launch.params.get("launch_pdl")
        else:
            for launch in tiles:
                assert launch.params["SMALL_Q"] == SMALL_Q
        if "request" in want and tiles and tiles[0].kernel == "scores_prefill_gluon":
            assert tiles[0].params["launch_pdl"]  # a dependent of the decode launch


@pytest.mark.parametrize("case", ["heads3", "no_tma_rows", "mixed", "dim64", "block64", "sm100",
                                  "no_gluon", "cpu"])
def test_prefill_tile_launch_stays_triton(case):
    """Layouts a TMA descriptor of rows cannot describe (api.py's tma_rows), other GPUs, a
    Triton whose Gluon the kernel was not written for, the interpreter: the Triton tile
    launch, same scores."""
    shape, facts = _shape(), H200
    if case == "heads3":
        shape = _shape(heads=3)
    elif case == "no_tma_rows":
        shape = _shape(tma_rows=False)
    elif case == "mixed":
        shape = _shape(dtype=torch.bfloat16, cache_dtype=FP8)
    elif case == "dim64":
        shape = _shape(dim=64)
    elif case == "block64":
        shape = _shape(block=64)
    elif case == "sm100":
        facts = dataclasses.replace(H200, capability=(10, 0))
    elif case == "no_gluon":
        facts = dataclasses.replace(H200, gluon_hopper=False)
    else:
        facts = CPU
    assert plan(shape, facts).kernels() == ("scores_prefill",)


@pytest.mark.parametrize("requests, blocks, want_bps, want_grid", [
    (1, 1024, 4, (1, 256)),     # B = 1 at 128K: 264 splits wanted, a power of two of blocks
    (1, 8192, 32, (1, 256)),    # B = 1 at 1M
    (128, 256, 64, (128, 4)),   # B = 128 at 32K: 3 splits wanted, capped at decode.max_bps
    (32, 8192, 64, (32, 128)),  # B = 32 at 1M
])
def test_request_launch_splits(requests, blocks, want_bps, want_grid):
    """The decode launch cuts each request's blocks into splits for decode.waves programs per
    SM, a power of two of blocks each, at most decode.max_bps."""
    (launch,) = plan(_shape(requests, requests=requests, blocks=blocks, max_q_len=1), H200)
    assert launch.kernel == "scores_decode"
    assert launch.params["BPS"] == want_bps and launch.grid == want_grid
    assert launch.params["KEYS_AS_ROWS"] and launch.params["PDL"]
    assert launch.params["MAX_SKIPS_NAN"] and launch.params["table_width"] == blocks
    # the interpreter: 4 "SMs", no programmatic dependent launches, NaN cleaned per key
    (launch,) = plan(_shape(requests, requests=requests, blocks=blocks, max_q_len=1), CPU)
    assert not launch.params["PDL"] and not launch.params["MAX_SKIPS_NAN"]
    # fp32 queries keep the IEEE dot with the queries as rows
    (launch,) = plan(_shape(requests, requests=requests, blocks=blocks, max_q_len=1,
                            dtype=torch.float32), H200)
    assert launch.params["IEEE"] and not launch.params["KEYS_AS_ROWS"]


def test_hint_sends_every_request_to_the_request_launch():
    """max_q_len <= SMALL_Q on a step of more than SMALL_Q tokens: one scoring launch, which then
    takes any q_len (a wrong hint stays exact); no hint: the prefill launch too."""
    p = plan(_shape(21, requests=8, blocks=16, max_q_len=4), H200)
    assert p.kernels() == ("scores_decode",) and p.launches[0].params["SMALL_Q"] == 2 ** 30
    p = plan(_shape(16, requests=8, blocks=16, max_q_len=4), H200)
    assert p.launches[0].params["SMALL_Q"] == SMALL_Q
    assert plan(_shape(21, requests=8, blocks=16), H200).kernels()[0] == "scores_decode"
    assert len(plan(_shape(21, requests=8, blocks=16), H200)) == 3  # + the Gluon pair


def test_empty_steps_launch_nothing():
    for shape in (_shape(0), _shape(requests=0), _shape(blocks=0)):
        assert len(plan(shape, H200)) == 0


def test_plans_are_pure():
    """The same inputs give equal launches (kernels, grids, parameters); each plan's launches
    have keys of their own (the launch cache's), so two plans never share one."""
    a, b = plan(_shape(topk=16), H200), plan(_shape(topk=16), H200)
    assert a.launches == b.launches and dict(a.sizes) == dict(b.sizes)
    assert not {x.key for x in a} & {y.key for y in b}


@pytest.mark.parametrize("form, field, value, error", [
    ("decode", "waves", 0, ValueError), ("prefill", "rows", 100, ValueError),
    ("select", "chunk", 96, ValueError), ("gluon", "stages_fp8", 1.5, TypeError),
    ("gluon", "waves", True, TypeError), ("gluon", "stages_fp8", 0, ValueError),
    ("select", "sort_waves", -1, ValueError), ("select", "sort_widths", (256, 100), ValueError),
    ("select", "sort_widths", 256, TypeError), ("decode_nvfp4", "programs", 0, ValueError),
    ("stage", "rank_chunk", 96, ValueError), ("cp", "keys_chunk", 0, ValueError),
    ("group", "size", 12, ValueError), ("short_rows", "warps", 0, ValueError)])
def test_config_values_are_checked(form, field, value, error):
    name = type(getattr(DEFAULT, form)).__name__
    with pytest.raises(error, match=f"{name}.{field}"):
        DEFAULT.replace(**{form: {field: value}})
    with pytest.raises(TypeError, match=f"IndexerConfig.{form}"):
        dataclasses.replace(DEFAULT, **{form: {field: value}})
    # 0 where it means something: unchunked, never sort, always chunk, one split
    DEFAULT.replace(select=dict(chunk=0, sort_waves=0, chunk_min_waves=0),
                    short_rows=dict(max_blocks=0), group=dict(min_blocks=0),
                    gluon=dict(waves=0))
    config = DEFAULT.replace(select={"sort_waves": 0})
    assert not selection_layout(1, 64, 16, 132, config)[1]  # 0 waves: never the sort path


@pytest.mark.parametrize("q_dtype", [FP8, torch.float16, torch.bfloat16])
def test_nvfp4_cache_launches(q_dtype):
    """An NVFP4 cache (uint8 pages): on Hopper the decode launch is the Gluon kernel for an
    fp8 or fp16 query and the Triton one (NVFP4 set) for bf16; the prefill launch is Triton's
    (never the Gluon tile kernel, which cannot dequantize), at most 64 rows (128 spill);
    another cache's launches say NVFP4=False."""
    shape = _shape(tokens=8192 + 64, requests=65, dtype=q_dtype, cache_dtype=torch.uint8)
    assert shape.nvfp4
    p = plan(shape, H200)
    gluon = q_dtype != torch.bfloat16
    assert [k for k in p.kernels() if k.startswith("scores_")] == [
        "scores_decode_nvfp4" if gluon else "scores_decode", "scores_prefill"]
    for launch in p:
        if launch.kernel in ("scores_decode", "scores_prefill"):
            assert launch.params["NVFP4"] and not launch.params["CAST_K"]
    assert p.find("scores_prefill").params["ROWS_T"] == 64 // 4
    if gluon:
        # 16 rows a pass without a q_len bound; 8 when max_q_len says 1 token x 4 heads fit
        assert p.find("scores_decode_nvfp4").params["NP"] == 16
        hinted = plan(dataclasses.replace(shape, max_q_len=2), H200)
        assert hinted.find("scores_decode_nvfp4").params["NP"] == 8
        # a context-parallel share and a GPU without the Hopper kernels keep Triton's
        for other, device in ((dataclasses.replace(shape, cp=True), H200),
                              (shape, dataclasses.replace(H200, gluon_hopper=False))):
            assert "scores_decode" in plan(other, device).kernels()
    fp8 = plan(_shape(tokens=8192 + 64, requests=65), H200)
    assert not fp8.find("scores_decode").params["NVFP4"] and "scores_prefill_gluon" in fp8.kernels()


@pytest.mark.parametrize("requests, blocks, want_bps", [
    (128, 1024, 16),   # B = 128 at 128K: 8192 programs, about 64 an SM
    (32, 1024, 4),     # B = 32 at 128K: 8192
    (128, 8192, 32),   # B = 128 at 1M: the 32-block cap
    (8, 1024, 2),      # B = 8 at 128K: 1-block splits by the count, floored at 2
    (1, 8192, 2),      # B = 1 at 1M
    (1, 1, 2),         # one block: a split larger than the request is one split
])
def test_nvfp4_decode_splits(requests, blocks, want_bps):
    """The Gluon NVFP4 decode launch's splits aim at 64 one-warp programs an SM (over four
    waves of the 15 an SM holds, so the last is short), power-of-two blocks between 2 (a
    program's query gather costs about a block at 16 rows) and 32; a decode.max_bps below 2
    still caps them."""
    shape = _shape(requests, requests=requests, blocks=blocks, max_q_len=1,
                   cache_dtype=torch.uint8)
    launch = plan(shape, H200).find("scores_decode_nvfp4")
    assert launch.params["BPS"] == want_bps
    assert launch.grid == (requests, -(-blocks // want_bps))
    capped = plan(shape, H200, DEFAULT.replace(decode={"max_bps": 1}))
    assert capped.find("scores_decode_nvfp4").params["BPS"] == 1


STAGED = dataclasses.replace(DEFAULT, nvfp4_prefill="staged")


@pytest.mark.parametrize("q_dtype, stage", [(FP8, torch.float16), (torch.bfloat16, torch.bfloat16),
                                            (torch.float16, torch.float16)])
def test_nvfp4_staged_prefill_takes_the_gluon_tile_on_hopper(q_dtype, stage):
    """nvfp4_prefill="staged" on an H200: the staging launch first (so that the prefill launch, a
    programmatic dependent of the decode launch, finds it complete), the decode launch as
    in the in-kernel form (NVFP4 pages, decode and verify), and the prefill launch of a 16-bit
    query against the 16-bit staging cache (bf16 for a bf16 query): the Gluon kernel, with
    the 16-bit cache's stages. The staging cache: min(R, T // 17) slots of max_blocks pages."""
    shape = _shape(tokens=8192 + 64, requests=65, dtype=q_dtype, cache_dtype=torch.uint8,
                   tma_rows=False, tma_q=True)
    inkernel, staged = plan(shape, H200), plan(shape, H200, STAGED)
    request = "scores_decode" if q_dtype == torch.bfloat16 else "scores_decode_nvfp4"
    assert staged.kernels()[:4] == ("stage_nvfp4", request, "scores_prefill_gluon",
                                    "scores_prefill_unaligned")
    assert staged.find(request) == inkernel.find(request)
    assert staged.sizes["staged_pages"] == 65 * 1024
    stage_launch = staged.find("stage_nvfp4")
    assert stage_launch.grid == (65, 1024 // 2) and stage_launch.params["SMALL_Q"] == SMALL_Q
    assert stage_launch.params["slots"] == 65 and stage_launch.params["PTX"]
    gluon = staged.find("scores_prefill_gluon")
    assert gluon.params["STAGES"] == DEFAULT.gluon.stages_16 and gluon.params["launch_pdl"]
    want = plan(_shape(tokens=8192 + 64, requests=65, dtype=stage), H200)
    assert gluon.grid == want.find("scores_prefill_gluon").grid
    unaligned = staged.find("scores_prefill_unaligned").params
    assert not unaligned["NVFP4"] and unaligned["ROWS_T"] == DEFAULT.prefill.rows // 4
    # the selection is the same either way
    assert staged.kernels()[4:] == inkernel.kernels()[2:]


def test_nvfp4_staged_prefill_routes():
    """The staged form changes only the prefill launch: the default (in-kernel) plan is as ever;
    a step of short requests (max_q_len <= 16, or T <= 16) stages nothing; a one-request
    chunk stages one slot (any q_len) and its tile is no programmatic dependent; a 16-bit
    query whose rows TMA cannot take scores the staging cache with the Triton tile (an fp8
    one is copied, so it still takes the Gluon kernel); off Hopper, the Triton tile."""
    nv = dict(dtype=FP8, cache_dtype=torch.uint8, tma_rows=False, tma_q=True)
    assert "stage_nvfp4" not in plan(_shape(requests=3, **nv), H200).kernels()
    assert "stage_nvfp4" not in plan(_shape(requests=3, max_q_len=SMALL_Q, **nv), H200,
                                     STAGED).kernels()
    assert plan(_shape(tokens=SMALL_Q, requests=3, **nv), H200, STAGED).kernels() == (
        "scores_decode_nvfp4",)
    one = plan(_shape(tokens=8192, requests=1, **nv), H200, STAGED)
    assert one.kernels()[:2] == ("stage_nvfp4", "scores_prefill_gluon")
    assert one.sizes["staged_pages"] == 1024 and one.find("stage_nvfp4").params["SMALL_Q"] == 0
    assert not one.find("scores_prefill_gluon").params["launch_pdl"]
    # at most T // 17 long requests: 200 tokens of 64 requests leave 11 slots
    assert plan(_shape(tokens=200, requests=64, **nv), H200, STAGED).sizes["staged_pages"] \
        == 11 * 1024
    strided = dict(nv, dtype=torch.bfloat16, tma_q=False)
    assert "scores_prefill_gluon" not in plan(_shape(requests=3, **strided), H200, STAGED).kernels()
    assert "scores_prefill_gluon" in plan(_shape(requests=3, **dict(nv, tma_q=False)), H200,
                                    STAGED).kernels()
    cpu = plan(_shape(requests=3, **nv), CPU, STAGED)
    assert cpu.kernels()[:3] == ("stage_nvfp4", "scores_decode", "scores_prefill")
    assert not cpu.find("stage_nvfp4").params["PTX"]
    tile = cpu.find("scores_prefill").params
    assert not tile["NVFP4"] and not tile["CAST_K"]
    # a non-NVFP4 cache ignores the option
    assert plan(_shape(requests=3), H200, STAGED).kernels() == plan(_shape(requests=3),
                                                                    H200).kernels()


@pytest.mark.parametrize("value", ["stage", "", 1, None])
def test_nvfp4_prefill_option_is_checked(value):
    with pytest.raises(ValueError, match="IndexerConfig.nvfp4_prefill"):
        dataclasses.replace(DEFAULT, nvfp4_prefill=value)


def test_nvfp4_prefill_auto_stages_a_chunk_alone():
    """The default nvfp4_prefill="auto": a step whose prefill launch takes one request (a prefill
    chunk alone) is staged (its staging cache: max_blocks pages), a mixed step (whose staging
    bound grows with its requests) is scored in-kernel, and a decode step stages nothing."""
    nv = dict(dtype=FP8, cache_dtype=torch.uint8, tma_rows=False, tma_q=True)
    assert DEFAULT.nvfp4_prefill == "auto"
    alone = plan(_shape(tokens=8192, requests=1, **nv), H200)
    assert alone.kernels()[0] == "stage_nvfp4" and alone.sizes["staged_pages"] == 1024
    mixed = plan(_shape(tokens=8192 + 64, requests=65, **nv), H200)
    assert "stage_nvfp4" not in mixed.kernels() and mixed.find("scores_prefill").params["NVFP4"]
    assert "stage_nvfp4" not in plan(_shape(tokens=64, requests=64, **nv), H200).kernels()


def test_cp_share_takes_the_triton_forms():
    """A context-parallel share (cp=True) is scored by scores.py's Triton launches alone: no
    Gluon decode launch, and an NVFP4 chunk is not staged, whatever nvfp4_prefill says."""
    nv = dict(dtype=FP8, cache_dtype=torch.uint8, tma_rows=False, tma_q=True)
    for config in (DEFAULT, STAGED):
        for shape in (_shape(tokens=8192, requests=1, **nv),
                      _shape(tokens=8192 + 64, requests=65, **nv)):
            kernels = plan(dataclasses.replace(shape, cp=True), H200, config).kernels()
            assert "stage_nvfp4" not in kernels and "scores_decode_nvfp4" not in kernels
            assert "scores_prefill" in kernels


@pytest.mark.parametrize("blocks, world, rank, want_blocks", [
    (1024, 4, 0, 256), (1023, 4, 3, 255), (5, 8, 6, 0), (1, 1, 0, 1)])
def test_cp_share_scores_the_ranks_blocks_with_the_triton_launches(blocks, world, rank,
                                                                   want_blocks):
    """A context-parallel rank scores block_table[:, rank::world] (its blocks b % W == rank):
    the Triton launches alone (no TMA rows, cp), scoring only; no blocks, no launch."""
    shape = _shape(tokens=8192 + 64, requests=65, blocks=blocks, topk=16)
    share = cp_share(shape, world, rank)
    assert share.max_blocks == want_blocks and share.cp and not share.tma_rows
    assert share.topk is None
    p = plan(share, H200)
    assert set(p.kernels()) <= {"scores_decode", "scores_prefill"}
    assert (len(p) == 0) == (want_blocks == 0)


@pytest.mark.parametrize("tokens, heads, width, want_chunk, want_grid", [
    (64, 4, 256, 256, (64, 1)),     # TP1 decode, W = 4 at 128K: one program a token
    (8, 4, 8192, 1024, (8, 8)),     # 1M on one rank: 1024-block chunks
    (3, 1, 5, 16, (3, 1)),          # at least a 16-wide tile
    (2, 1, 0, 16, (2, 1)),          # a rank with no blocks still writes the positions
])
def test_cp_local_keys_launch(tokens, heads, width, want_chunk, want_grid):
    launch = cp_local_keys(tokens, heads, width, 128)
    assert launch.kernel == "cp_local_keys" and launch.grid == want_grid
    assert dict(launch.params) == dict(H=heads, BLOCK=128, CHUNK=want_chunk)
    smaller = cp_local_keys(tokens, heads, width, 128, DEFAULT.replace(cp={"keys_chunk": 16}))
    assert smaller.params["CHUNK"] == 16
    assert cp_local_keys(0, heads, width, 128) is None


def test_cp_merge_launch_and_plan():
    """The merge: one program per (token, head) row sorting the W * k candidates (a power of
    two, at least 16); none without rows or candidates. cp_plan: the share's scoring, then the
    packing and the merge, with the local width and the candidates per rank."""
    launch = cp_merge(5, 4, 4, 16, 16, 128)
    assert launch.grid == (20,) and dict(launch.params) == dict(H=4, BLOCK=128, CP2=64, KP2=16)
    assert cp_merge(5, 4, 3, 1, 1, 128).params["CP2"] == 16
    assert cp_merge(5, 4, 4, 0, 16, 128) is None and cp_merge(0, 4, 4, 16, 16, 128) is None
    shape = _shape(tokens=64, requests=64, blocks=1024, topk=16, max_q_len=1)
    p = cp_plan(shape, H200, DEFAULT, 4, 1)
    assert p.kernels() == ("scores_decode", "cp_local_keys", "cp_merge")
    assert p.find("scores_decode") == plan(cp_share(shape, 4, 1), H200).find("scores_decode")
    assert dict(p.sizes) == dict(width=256, per_rank=16)
    assert cp_plan(_shape(tokens=64, requests=64, blocks=4, topk=16, max_q_len=1), H200,
                   DEFAULT, 8, 7).kernels() == ("cp_local_keys", "cp_merge")


@pytest.mark.parametrize("dim", [16, 24, 32, 128])
@pytest.mark.parametrize("dtype", [FP8, torch.bfloat16, torch.float32])
def test_index_dim_padded_to_the_dot_depth(dim, dtype):
    # an fp8 query's tensor-core dot needs K >= 32 (Triton refuses 16 at compile time on a GPU;
    # the interpreter does not care), a 16-bit or fp32 one K >= 16
    least = 32 if dtype == FP8 else 16
    for tokens, requests in ((1, 1), (8192, 1), (40, 3)):
        shape = _shape(tokens=tokens, requests=requests, blocks=64, dtype=dtype, dim=dim)
        for launch in plan(shape, DeviceFacts(gluon_hopper=False), DEFAULT):
            if "DIP" in launch.params:
                assert launch.params["DIP"] == max(least, 1 << (dim - 1).bit_length())
