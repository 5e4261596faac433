# SPDX-License-Identifier: Apache-2.0
"""sparse_attention's launch plan (ops/attention/plan.py) as a pure function of step shapes and
device facts: the split count on an H200's 132 SMs, the forms each kind of step takes, and the
route of prefill tiles. The cases are the M3 shapes whose measured times chose the rules
(docs/performance.md)."""

import dataclasses

import pytest
import torch

from openmsa.ops.attention.plan import (DEFAULT, AttentionShape, SplitForm, TileForm,
                                        TokenForm, num_splits, plan)
from openmsa.ops.common.plan import DeviceFacts

pytestmark = pytest.mark.reference

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
H200 = DeviceFacts(kind="cuda", num_sms=132, capability=(9, 0), gluon_hopper=True)
H200_NO_GLUON = dataclasses.replace(H200, gluon_hopper=False)
CPU = DeviceFacts(kind="cpu", num_sms=4, capability=(0, 0), gluon_hopper=False)


def shape(tokens, heads=64, kv_heads=4, kv_dtype=FP8, q_dtype=BF16, topk=16, block=128,
          **kw):
    """An M3 step: head dim 128, one index head per KV head."""
    return AttentionShape(num_tokens=tokens, num_heads=heads, num_kv_heads=kv_heads,
                          head_dim=128, num_index_heads=kv_heads, topk=topk, block_size=block,
                          q_dtype=q_dtype, kv_dtype=kv_dtype, **kw)


@pytest.mark.parametrize("pairs, steps, sub, resident, key_bytes, want", [
    (128, 16, 128, 2, 256, 1),  # TP4 B=128 q_len 1: unsplit (measured 23.2 µs against 24.2)
    (40, 16, 128, 2, 256, 3),   # TP1 B=10: 3 fused splits (13.4 against 15.0 for 6 + a launch)
    (64, 16, 128, 2, 256, 4),   # TP4 B=64: 4 fused splits stay (16.0 against 16.8 for 2)
    (32, 16, 128, 2, 256, 4),   # TP1 B=8, TP4 B=8 q_len 4: 4 fused splits, no merge launch
    (16, 16, 128, 2, 256, 8),   # TP1 B=1 q_len 4: 4 fused splits would leave half the SMs idle
    (4, 32, 64, 2, 256, 16),    # B=1, 64-key steps: 16 splits and a merge launch
    (256, 16, 128, 2, 256, 1),  # TP1 B=64: one round of whole selections
    (64, 16, 128, 1, 512, 2),   # bf16 TP4 B=64 (one program per SM)
    (128, 16, 128, 1, 512, 1),
])
def test_attention_split_count_modelled(pairs, steps, sub, resident, key_bytes, want):
    # bandwidth shared by an SM's programs, fixed and merge costs
    assert num_splits(pairs, steps, sub, key_bytes, resident, H200) == want


def test_attention_split_count_is_bounded_by_steps():
    # never more splits than steps / min_steps, never fewer than one
    for pairs in (1, 3, 8, 33, 500, 5000):
        for steps in (1, 2, 16, 32):
            for key_bytes in (256, 512):
                s = num_splits(pairs, steps, 128, key_bytes, 2, H200)
                assert 1 <= s <= max(1, steps // DEFAULT.split.min_steps)


def test_attention_split_count_off_cuda_always_merges():
    """Under the interpreter every step of at least 4 steps takes 2 splits: the merge runs."""
    assert num_splits(1000, 4, 128, 256, 2, CPU) == 2
    assert num_splits(1000, 3, 128, 256, 2, CPU) == 1


@pytest.mark.parametrize("tokens, heads, kv_heads, kv_dtype, want", [
    (10, 64, 4, FP8, 3),    # TP1 B=10: 3 fused splits (measured 14.8 -> 13.4 µs against 6
                            # splits and a merge launch)
    (128, 16, 1, FP8, 1),   # TP4 B=128 q_len 1: unsplit (23.7 -> 23.1 µs)
    (32, 64, 4, FP8, 1),    # TP1 B=8 q_len 4: unsplit
    (64, 16, 1, FP8, 4),    # TP4 B=64 q_len 1: 4 fused splits
    (64, 16, 1, BF16, 2),   # bf16, one program per SM
])
def test_attention_decode_plan_prices_splits_in_us(tokens, heads, kv_heads, kv_dtype, want):
    """The default plan of a decode step on M3 shapes: the split count the model prices from
    K/V's bytes per key."""
    p = plan(shape(tokens, heads, kv_heads, kv_dtype), H200, DEFAULT)
    assert p.sizes["splits"] == want
    assert p.find("token").grid == (tokens, kv_heads, want)
    assert (p.find("merge") is not None) == (want > DEFAULT.split.fused_max)


def test_decode_step_is_one_programmatic_dependent_launch():
    """A decode step: one launch, a programmatic dependent of the kernel before it on the
    stream (WAIT_PRIOR); 128-key steps, 4 warps, 3 stages; fp8 V read in pairs."""
    p = plan(shape(64, 16, 1), H200, DEFAULT)
    assert p.kernels() == ("token",)
    token = p.find("token").params
    assert token["WAIT_PRIOR"] and token["launch_pdl"] and token["FUSED_MERGE"]
    assert (token["SUB"], token["num_warps"], token["num_stages"]) == (128, 4, 3)
    assert token["V_PAIRS"] and token["F16_COMPUTE"] and token["LAZY_SUM"]
    assert "maxnreg" not in token and not token["STORE_LSE"]
    # an odd V view (not readable as byte pairs) reads fp8 V byte by byte
    assert not plan(shape(64, 16, 1, v_pairs_view=False), H200, DEFAULT).find(
        "token").params["V_PAIRS"]
    assert plan(shape(64, 16, 1, return_lse=True), H200, DEFAULT).sizes["store_lse"]


def test_small_steps_take_finer_steps_and_a_merge_launch():
    """B = 1 decode (4 (token, KV head) pairs): 64-key steps, on 4 warps with fp8 K/V and 8
    with bf16, 16 splits, merged by a second launch that starts early (PDL)."""
    for kv_dtype, warps in ((FP8, 4), (BF16, 8)):
        p = plan(shape(1, kv_dtype=kv_dtype), H200, DEFAULT)
        assert p.kernels() == ("token", "merge")
        token, merge = p.find("token").params, p.find("merge").params
        assert (token["SUB"], token["num_warps"], token["SPLITS"]) == (64, warps, 16)
        assert token["PDL"] and not token["FUSED_MERGE"] and token["SP"] == 16
        assert merge["PDL"] and merge["launch_pdl"] and p.find("merge").grid == (1, 64)


def test_fp8_grids_of_more_than_one_round_take_64_key_steps():
    """TP1 B = 128 fp8 (512 pairs, more than 2 x 132 programs): 64-key steps packed for 4
    programs per SM; bf16 there keeps 128-key steps on 2 stages."""
    token = plan(shape(128), H200, DEFAULT).find("token").params
    assert token["SUB"] == 64 and token["num_stages"] == 3
    token = plan(shape(128, kv_dtype=BF16), H200, DEFAULT).find("token").params
    assert token["SUB"] == 128 and token["num_stages"] == DEFAULT.rounds_stages_16 == 2
    # one round (TP4 B = 64): neither
    token = plan(shape(64, 16, 1, kv_dtype=BF16), H200, DEFAULT).find("token").params
    assert token["num_stages"] == 3


@pytest.mark.parametrize("heads, kv_heads, kv_dtype, kernel, tokens_per_tile, pair", [
    (64, 4, FP8, "tiles_gluon", 8, True),     # TP1 fp8: pairs of 4-token tiles
    (16, 1, FP8, "tiles_gluon", 8, True),
    (8, 1, FP8, "tiles_gluon", 16, True),     # G = 8: 2 x 8 tokens
    (32, 8, FP8, "tiles_gluon", 16, False),   # G = 4: 16 tokens already (the cap)
    (64, 4, BF16, "tiles_gluon", 4, False),   # 16-bit: one consumer per program
    (64, 64, BF16, "tiles", 16, False),       # G = 1: 16 rows per tile, no Gluon form
])
def test_prefill_chunk_on_hopper(heads, kv_heads, kv_dtype, kernel, tokens_per_tile, pair):
    """An 8K chunk: the tile plan, the tiles, then the per-token kernel for the tiles left (no
    splits: nothing would merge a taken token's partials)."""
    p = plan(shape(8192, heads, kv_heads, kv_dtype), H200, DEFAULT)
    assert p.kernels() == ("tile_plan", kernel, "token")
    assert p.sizes["tile_tokens"] == tokens_per_tile and p.sizes["splits"] == 1
    assert p.find("tile_plan").grid == (-(-8192 // tokens_per_tile), kv_heads)
    assert p.find("token").params["TILE_QT"] == tokens_per_tile
    assert p.sizes["store_lse"]  # the tiles always write the LSE
    if kernel == "tiles_gluon":
        gluon = p.find("tiles_gluon")
        assert gluon.params["PAIR"] == pair and gluon.grid == (p.sizes["tile_items"],)
        assert gluon.params["maxnreg"] == (168 if pair else 128)
        # the per-token launch overlaps the tiles' tail
        assert p.find("token").params["WAIT_TILES"]
        waste = (DEFAULT.gluon_fp8 if kv_dtype == FP8 else DEFAULT.gluon_16).waste
        assert p.find("tile_plan").params["waste"] == waste
    token = p.find("token").params
    assert "WAIT_PRIOR" not in token
    assert token.get("maxnreg") == (168 if kv_dtype == FP8 else None)


@pytest.mark.parametrize("kv_dtype", [FP8, BF16])
def test_prefill_tiles_take_triton_where_tma_cannot(kv_dtype):
    """Misaligned K/V bases, views TMA cannot describe, no Gluon, or no Gluon form in the
    config: the Triton tiles with their own waste threshold, the per-token launch after them."""
    tile = DEFAULT.tile_fp8 if kv_dtype == FP8 else DEFAULT.tile_16
    for s, device, config in (
            (shape(8192, kv_dtype=kv_dtype, tma_aligned=False), H200, DEFAULT),
            (shape(8192, kv_dtype=kv_dtype, tma_views=False), H200, DEFAULT),
            (shape(8192, kv_dtype=kv_dtype), H200_NO_GLUON, DEFAULT),
            (shape(8192, kv_dtype=kv_dtype), H200,
             dataclasses.replace(DEFAULT, gluon_16=None, gluon_fp8=None, gluon_pair_fp8=None))):
        p = plan(s, device, config)
        assert p.kernels() == ("tile_plan", "tiles", "token")
        assert p.find("tile_plan").params["waste"] == tile.waste
        # no pairs off the Gluon path, but for a misaligned fp8 view: the pair's tile size
        # follows the views, not the addresses, as the Gluon route did before it was a shape
        misaligned_pair = kv_dtype == FP8 and not s.tma_aligned
        assert p.sizes["tile_tokens"] == (8 if misaligned_pair else 4)
        tiles = p.find("tiles").params
        assert (tiles["SUB"], tiles["PERSISTENT"]) == (tile.sub, tile.persistent)
        programs = min(p.sizes["tile_items"], 2 * 132) if tile.persistent else p.sizes[
            "tile_items"]
        assert p.find("tiles").grid == (programs,)
        assert "WAIT_TILES" not in p.find("token").params


def test_prefill_without_tiles_splits_like_decode():
    """tiles=False (the per-token kernel alone, benchmarks/run.py's comparison): no tile
    launches, the prefill form (fp8: 128-key steps, 3 stages, the register cap)."""
    p = plan(shape(8192), H200, dataclasses.replace(DEFAULT, tiles=False))
    assert p.kernels() == ("token",)
    token = p.find("token").params
    assert (token["SUB"], token["num_stages"], token["maxnreg"]) == (128, 3, 168)
    assert token["TILE_QT"] == 0 and token["WAIT_PRIOR"]
    p = plan(shape(8192, kv_dtype=BF16), H200, dataclasses.replace(DEFAULT, tiles=False))
    token = p.find("token").params
    assert (token["SUB"], token["num_stages"]) == (64, 2) and "maxnreg" not in token


def test_interpreter_plan():
    """CPU tensors (the interpreter): no PTX, no programmatic dependents, 3 persistent tile
    programs, 2 splits whenever a row has 4 steps."""
    p = plan(shape(30, 8, 2, kv_dtype=FP8, q_dtype=torch.float16, topk=4, block=16), CPU,
             DEFAULT)
    token = p.find("token").params
    assert not token["PTX"] and "launch_pdl" not in token and token["SPLITS"] == 2
    p = plan(shape(30, 8, 2, kv_dtype=FP8, q_dtype=torch.float16, topk=4, block=16), CPU,
             dataclasses.replace(DEFAULT, prefill_min_tokens=1))
    assert p.kernels() == ("tile_plan", "tiles", "token")
    assert p.find("tiles").grid == (3,) and p.find("tiles").params["PERSISTENT"]


def test_plan_is_a_function_of_its_inputs():
    """Equal inputs, equal launches (each plan's launch keys are its own)."""
    a, b = plan(shape(8192), H200, DEFAULT), plan(shape(8192), H200, DEFAULT)
    assert a.launches == b.launches and dict(a.sizes) == dict(b.sizes)
    assert a.find("token").key != b.find("token").key
    assert plan(shape(8192), H200, dataclasses.replace(DEFAULT, tiles=False)) != a


@pytest.mark.parametrize("case, want", [
    ("flash", True), ("fp16", True), ("fp8", True), ("sub64", True), ("fp8_sub64", True),
    ("dim64", False), ("dim256", False), ("fp8_off", False), ("rows32", False),
    ("odd_strides", False), ("sm100", False), ("off", False), ("no_gluon", False),
    ("block64", False), ("fp8_odd_sub", False)])
def test_prefill_tiles_take_the_gluon_kernel_where_tma_can(case, want):
    """The prefill tiles run tile_gluon.py's kernel on Hopper for 16-bit or fp8 K/V views a TMA
    descriptor describes, head dim and block size 128, 64 rows per consumer; 64-key steps
    (16-bit, or fp8 through the loader) too, steps that do not divide a block not."""
    fp8 = case.startswith("fp8")
    kv = {"fp16": torch.float16}.get(case, FP8 if fp8 else BF16)
    s = AttentionShape(num_tokens=8192, num_heads=64, num_kv_heads=4,
                       head_dim={"dim64": 64, "dim256": 256}.get(case, 128), num_index_heads=4,
                       topk=16, block_size=64 if case == "block64" else 128,
                       q_dtype=torch.float16 if case == "fp16" else BF16, kv_dtype=kv,
                       tma_views=case != "odd_strides")
    device = {"sm100": dataclasses.replace(H200, capability=(10, 0)),
              "no_gluon": H200_NO_GLUON}.get(case, H200)
    gluon = dict(gluon_16=DEFAULT.gluon_16, gluon_fp8=DEFAULT.gluon_fp8,
                 gluon_pair_fp8=DEFAULT.gluon_pair_fp8)
    sub = {"sub64": 64, "fp8_sub64": 64, "fp8_odd_sub": 48}.get(case)
    if sub:
        gluon = {k: dataclasses.replace(v, sub=sub) for k, v in gluon.items()}
    if case == "off":
        gluon = dict.fromkeys(gluon)
    if case == "fp8_off":
        gluon.update(gluon_fp8=None, gluon_pair_fp8=None)
    config = dataclasses.replace(DEFAULT, **gluon)
    if case == "rows32":
        config = dataclasses.replace(config, tile_16=dataclasses.replace(DEFAULT.tile_16,
                                                                          rows=32))
    p = plan(s, device, config)
    assert p.find("tile_plan") is not None
    assert (p.find("tiles_gluon") is not None) == want
    if want:
        assert p.find("tiles_gluon").params["SUB"] == (sub or 128)


@pytest.mark.parametrize("case", ["fp8", "bf16", "off", "group4"])
def test_prefill_fp8_tiles_in_pairs(case):
    """An 8K chunk of fp8 K/V on Hopper at G = 16: tiles of 8 tokens in two consumer
    warpgroups over one loader (PAIR, one 384-thread program per SM whose registers add up),
    the plan of 128 entries; 4-token tiles for bf16 and without the pair form, and 16 when a
    pair would exceed 16 tokens (G = 4)."""
    config = dataclasses.replace(DEFAULT, gluon_pair_fp8=None) if case == "off" else DEFAULT
    s = shape(8192, 16 if case == "group4" else 64, 4, BF16 if case == "bf16" else FP8)
    p = plan(s, H200, config)
    gluon = p.find("tiles_gluon").params
    pair = case == "fp8"
    want_qt = 16 if case == "group4" else 8 if pair else 4
    assert gluon["PAIR"] == pair
    assert p.sizes["tile_tokens"] == gluon["QT"] == p.find("tile_plan").params["QT"] == want_qt
    assert p.sizes["tile_items"] == 8192 // want_qt * 4 == p.find("tiles_gluon").grid[0]
    assert p.sizes["union_width"] == want_qt * 16
    if pair:
        form = DEFAULT.gluon_pair_fp8
        assert gluon["maxnreg"] == form.maxnreg
        assert (gluon["STAGES_K"], gluon["STAGES_V"]) == (form.stages_k, form.stages_v)
        assert gluon["PRODUCER_REGS"] == form.producer_regs
        # the first consumer gets what the loader and the second leave of 3 x maxnreg
        first = 3 * gluon["maxnreg"] - gluon["PRODUCER_REGS"] - gluon["CONSUMER_REGS"]
        assert first >= gluon["CONSUMER_REGS"] and 3 * gluon["maxnreg"] * 128 <= 65536
    else:
        assert gluon["maxnreg"] == 128 and gluon["CONSUMER_REGS"] == 0


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_per_token_stages(fp8):
    """An 8K chunk's per-token launch (the tokens no tile takes) pipelines 3 stages of fp8 K/V
    and 2 of 16-bit; a decode step keeps 3."""
    kv = FP8 if fp8 else BF16
    assert plan(shape(8192, kv_dtype=kv), H200, DEFAULT).find("token").params[
        "num_stages"] == (3 if fp8 else 2)
    assert plan(shape(8, kv_dtype=kv), H200, DEFAULT).find("token").params["num_stages"] == 3
    assert DEFAULT.prefill_fp8.stages != DEFAULT.prefill_16.stages  # else this proves nothing


@pytest.mark.parametrize("field, value, error", [
    ("prefill_min_tokens", 0, ValueError), ("tiles", 1, TypeError),
    ("small_pairs", True, TypeError),
    ("decode_fp8", None, TypeError), ("gluon_16", TokenForm(sub=64), TypeError),
    ("split", None, TypeError), ("tile_16", SplitForm(), TypeError)])
def test_config_values_are_checked(field, value, error):
    with pytest.raises(error, match=f"AttentionConfig.{field}"):
        dataclasses.replace(DEFAULT, **{field: value})
    # a Gluon form of None: the Triton tiles run instead
    dataclasses.replace(DEFAULT, gluon_fp8=None, gluon_16=None, gluon_pair_fp8=None)


def test_form_sizes_are_checked():
    with pytest.raises(ValueError, match="TokenForm.sub"):
        TokenForm(sub=0)
    with pytest.raises(ValueError, match="TileForm.waste"):
        dataclasses.replace(DEFAULT.tile_16, waste=-1.0)
    dataclasses.replace(DEFAULT.tile_16, waste=0.0)  # 0: no tile is taken
    with pytest.raises(ValueError, match="TileForm.plan_warps"):
        dataclasses.replace(DEFAULT.tile_16, plan_warps=0)
    with pytest.raises(ValueError, match="SplitForm.copy_tbs"):
        SplitForm(copy_tbs=0.0)
    with pytest.raises(TypeError, match="SplitForm.min_steps"):
        SplitForm(min_steps=1.5)
    with pytest.raises(TypeError, match="TileForm.persistent"):
        dataclasses.replace(DEFAULT.tile_16, persistent=1)
    with pytest.raises(ValueError, match="GluonForm.consumer_regs"):
        dataclasses.replace(DEFAULT.gluon_16, consumer_regs=-1)
    SplitForm(per_split_us=0.0)  # a cost may be 0


def test_split_form_drives_the_split_count_and_the_merge():
    """The split count's model and bounds are AttentionConfig.split's: a dearer merge launch
    keeps fused splits, a larger fused_max fuses more, min_steps bounds the count, and the
    merge launch takes merge_warps."""
    step = shape(1, 64, 4, FP8, topk=64)  # B=1, 64-key steps: splits and a merge launch
    base = plan(step, H200, DEFAULT)
    assert base.sizes["splits"] > DEFAULT.split.fused_max and base.find("merge") is not None
    assert base.find("merge").params["num_warps"] == DEFAULT.split.merge_warps
    fused = dataclasses.replace(DEFAULT, split=SplitForm(fused_max=64))
    p = plan(step, H200, fused)
    assert p.sizes["fused"] and p.find("merge") is None
    warps = dataclasses.replace(DEFAULT, split=SplitForm(merge_warps=8))
    assert plan(step, H200, warps).find("merge").params["num_warps"] == 8
    few = dataclasses.replace(DEFAULT, split=SplitForm(min_steps=128))  # 128 steps of 64 keys
    assert plan(step, H200, few).sizes["splits"] == 1
    # a dear merge launch: the splits the last program merges
    dear = dataclasses.replace(DEFAULT, split=SplitForm(launch_us=1000.0))
    assert 1 < plan(step, H200, dear).sizes["splits"] <= DEFAULT.split.fused_max


def test_tile_form_launch_knobs():
    """The Triton tile launch's warps, persistent programs per SM (and under the interpreter)
    and the plan launch's warps are TileForm's."""
    step = shape(8192, kv_dtype=FP8)
    form = TileForm(rows=64, sub=128, stages=2, persistent=True, waste=2.0, warps=8,
                    resident=3, interpret_programs=5, plan_warps=2)
    config = dataclasses.replace(DEFAULT, tile_fp8=form, gluon_16=None, gluon_fp8=None,
                                 gluon_pair_fp8=None)
    p = plan(step, H200, config)
    assert p.find("tiles").params["num_warps"] == 8
    assert p.find("tiles").grid == (min(p.sizes["tile_items"], 3 * H200.num_sms),)
    assert p.find("tile_plan").params["num_warps"] == 2
    assert plan(step, CPU, config).find("tiles").grid == (5,)
    # the defaults: 4 warps, 2 programs per SM, 3 under the interpreter, a one-warp plan
    p = plan(step, H200, dataclasses.replace(config, tile_fp8=DEFAULT.tile_fp8))
    assert p.find("tiles").params["num_warps"] == 4 and p.find("tile_plan").params[
        "num_warps"] == 1
    assert p.find("tiles").grid == (min(p.sizes["tile_items"], 2 * H200.num_sms),)
