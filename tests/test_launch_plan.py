# SPDX-License-Identifier: Apache-2.0
"""The host-side launch decisions that shape a kernel's grid, as plain functions of the step's
shapes: the attention split count, on an H200's 132 SMs. The cases are the M3 shapes whose
measured times chose the rules (docs/performance.md). (The indexer's: tests/plans.)"""

import pytest
import torch

from openmsa.ops.attention import api as attention_api

pytestmark = pytest.mark.reference

CUDA = torch.device("cuda")  # a device object only: nothing runs on it


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(attention_api, "num_sms", lambda device: 132)


@pytest.mark.parametrize("pairs, steps, sub, want", [
    (32, 16, 128, 4),   # TP1 B=8 q_len 1, TP4 B=8 q_len 4: 4 fused splits, no merge launch
    (16, 16, 128, 8),   # TP1 B=1 q_len 4: 4 fused splits would leave half the SMs idle
    (40, 16, 128, 6),   # 4 fused splits would put 2 programs on some SMs: merge launch wins
    (4, 32, 64, 16),    # B=1 decode, 64-key steps: 16 splits and a merge launch
    (256, 16, 128, 1),  # TP1 B=64: one round of whole selections
])
def test_attention_split_count(h200, pairs, steps, sub, want):
    assert attention_api._num_splits(pairs, 1, steps, CUDA, 2, sub) == want


def test_attention_split_count_without_the_merge_charge(h200, monkeypatch):
    monkeypatch.setitem(attention_api.TUNING, "merge_launch_keys", 0)
    assert attention_api._num_splits(32, 1, 16, CUDA, 2, 128) == 8  # the rule before a merge
    # launch was charged (measured 13.1 µs against 12.4 with 4 fused splits)


@pytest.mark.parametrize("pairs, steps, sub, resident, key_bytes, want", [
    (128, 16, 128, 2, 256, 1),  # TP4 B=128 q_len 1: unsplit (measured 23.2 µs against 24.2)
    (40, 16, 128, 2, 256, 3),   # TP1 B=10: 3 fused splits (13.4 against 15.0 for 6 + a launch)
    (64, 16, 128, 2, 256, 4),   # TP4 B=64: 4 fused splits stay (16.0 against 16.8 for 2)
    (32, 16, 128, 2, 256, 4),   # TP1 B=8: as the rounds cost
    (16, 16, 128, 2, 256, 8),   # TP1 B=1 q_len 4: as the rounds cost
    (4, 32, 64, 2, 256, 16),    # B=1, 64-key steps: as the rounds cost
    (64, 16, 128, 1, 512, 2),   # bf16 TP4 B=64 (one program per SM): as the rounds cost
    (128, 16, 128, 1, 512, 1),
])
def test_attention_split_count_modelled(h200, monkeypatch, pairs, steps, sub, resident,
                                        key_bytes, want):
    # split_cost "model" (the default): bandwidth shared by an SM's programs, fixed and merge costs
    monkeypatch.setitem(attention_api.TUNING, "split_cost", "model")
    assert attention_api._num_splits(pairs, 1, steps, CUDA, resident, sub, key_bytes) == want
    # without key_bytes (a caller that does not pass them) the rounds cost decides
    monkeypatch.setitem(attention_api.TUNING, "split_cost", "rounds")
    rounds = attention_api._num_splits(pairs, 1, steps, CUDA, resident, sub)
    monkeypatch.setitem(attention_api.TUNING, "split_cost", "model")
    assert attention_api._num_splits(pairs, 1, steps, CUDA, resident, sub) == rounds


@pytest.mark.parametrize("tokens, heads, kv_heads, kv_dtype, want", [
    (10, 64, 4, torch.float8_e4m3fn, 3),    # TP1 B=10: 3 fused splits (6 and a merge launch
                                            # by rounds; measured 14.8 -> 13.4 µs)
    (128, 16, 1, torch.float8_e4m3fn, 1),   # TP4 B=128 q_len 1: unsplit (23.7 -> 23.1 µs)
    (32, 64, 4, torch.float8_e4m3fn, 1),    # TP1 B=8 q_len 4: unsplit
    (64, 16, 1, torch.float8_e4m3fn, 4),    # TP4 B=64 q_len 1: 4 fused splits either way
    (64, 16, 1, torch.bfloat16, 2),         # bf16, one program per SM: as the rounds cost
])
def test_attention_decode_plan_prices_splits_in_us(h200, monkeypatch, tokens, heads, kv_heads,
                                                  kv_dtype, want):
    """The default plan of a decode step (the split count _plan passes K/V's bytes per key to,
    so split_cost "model" decides) on M3 shapes, from meta tensors on a stand-in H200."""
    from openmsa import support
    monkeypatch.setattr(support, "capability", lambda device: (9, 0))
    assert attention_api.TUNING["split_cost"] == "model"
    q = _OnCuda(torch.empty(tokens, heads, 128, dtype=torch.bfloat16, device="meta"))
    kv = _OnCuda(torch.empty(64, 128, kv_heads, 128, dtype=kv_dtype, device="meta"))
    indices = _OnCuda(torch.empty(tokens, kv_heads, 16, dtype=torch.int32, device="meta"))
    assert attention_api._plan(q, kv, kv, indices, None, 128).splits == want


def test_attention_split_count_is_bounded_by_steps(h200):
    # never more splits than steps / min_steps_per_split, never fewer than one
    for pairs in (1, 3, 8, 33, 500, 5000):
        for steps in (1, 2, 16, 32):
            s = attention_api._num_splits(pairs, 1, steps, CUDA, 2, 128)
            assert 1 <= s <= max(1, steps // attention_api.TUNING["min_steps_per_split"])


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


def _kv_pair(layout="flash", dtype=torch.bfloat16, pages=300, kv_heads=4, dim=128):
    if layout == "flash":
        k = v = torch.empty(pages, 128, kv_heads, dim, dtype=dtype, device="meta")
    elif layout == "packed":  # vLLM's [P, Hkv, B, 2 * D], K first, V second
        packed = torch.empty(pages, kv_heads, 128, 2 * dim, dtype=dtype, device="meta")
        k = packed[..., :dim].permute(0, 2, 1, 3)
        v = packed[..., dim:].permute(0, 2, 1, 3)
    else:  # heads padded to an odd row length: strides that are not 16-byte multiples
        k = v = torch.empty(pages, 128, kv_heads, dim + 3, dtype=dtype, device="meta")[..., :dim]
    return _OnCuda(k), _OnCuda(v)


@pytest.mark.parametrize("case, want", [("flash", True), ("packed", True), ("fp16", True),
                                        ("dim64", False), ("fp8", True), ("fp8_off", False),
                                        ("rows32", False),
                                        ("odd_strides", False), ("dim256", False),
                                        ("sm100", False), ("off", False), ("no_gluon", False),
                                        ("block64", False), ("sub64", True),
                                        ("fp8_sub64", True), ("fp8_odd_sub", False)])
def test_attention_prefill_tiles_take_the_gluon_kernel_where_tma_can(monkeypatch, case, want):
    """The attention prefill tiles run prefill_ws.py's kernel on Hopper for 16-bit or fp8 K/V
    views a TMA descriptor describes (the flash layout and vLLM's packed one), 64-row tiles;
    fp8 in whole-block steps unless through the loader (ws_sub_fp8)."""
    monkeypatch.setattr(attention_api, "capability", lambda device: (9, 0))
    fp8 = torch.float8_e4m3fn
    dtype = {"fp16": torch.float16, "fp8": fp8, "fp8_off": fp8,
             "fp8_sub64": fp8, "fp8_odd_sub": fp8}.get(case, torch.bfloat16)
    dim = {"dim64": 64, "dim256": 256}.get(case, 128)
    k, v = _kv_pair("packed" if case == "packed" else "odd" if case == "odd_strides" else "flash",
                    dtype, dim=dim)
    q = _OnCuda(torch.empty(8192, 64, dim, dtype=torch.float16 if case == "fp16"
                            else torch.bfloat16, device="meta"))
    if case == "sm100":
        monkeypatch.setattr(attention_api, "capability", lambda device: (10, 0))
    if case == "off":
        monkeypatch.setitem(attention_api.TUNING, "tile_ws", False)
    if case == "fp8_off":
        monkeypatch.setitem(attention_api.TUNING, "tile_ws_fp8", False)
    if case == "no_gluon":
        monkeypatch.setattr(attention_api, "gluon_hopper_available", lambda: False)
    if case.endswith("sub64"):  # 64-key steps: 16-bit K/V, or fp8 through the loader
        monkeypatch.setitem(attention_api.TUNING, "ws_sub", 64)
        monkeypatch.setitem(attention_api.TUNING, "ws_sub_fp8", 64)
    if case == "fp8_odd_sub":  # steps that do not divide a block
        monkeypatch.setitem(attention_api.TUNING, "ws_sub_fp8", 48)
    rows = 32 if case == "rows32" else 64
    assert attention_api._ws_eligible(q, k, v, 64 if case == "block64" else 128, rows) == want


def test_attention_gluon_steps_per_dtype(monkeypatch):
    """Keys per step of the Gluon tiles: ws_sub for 16-bit K/V; for fp8 K/V ws_sub_fp8 through
    the loader, whole blocks through the forms that convert in the consumer (wrong on 64-key
    steps, api.py)."""
    for name, value in (("ws_sub", 64), ("ws_sub_fp8", 32)):
        monkeypatch.setitem(attention_api.TUNING, name, value)
    assert attention_api._ws_sub(False, 128) == 64
    assert attention_api._ws_sub(True, 128) == 32
    assert attention_api._ws_sub(True, 16) == 16
    monkeypatch.setitem(attention_api.TUNING, "ws_fp8_qk", True)
    assert attention_api._ws_sub(True, 128) == 128
    monkeypatch.setitem(attention_api.TUNING, "ws_fp8_qk", False)
    monkeypatch.setitem(attention_api.TUNING, "ws_fp8_loader", False)
    assert attention_api._ws_sub(True, 128) == 128


def test_attention_gluon_launch_descriptors(monkeypatch):
    """The Gluon tile launch's host side (no GPU: the kernel is replaced): K and V described as
    their own [P, B, Hkv, D] views (vLLM's packed layout here: V starts D elements in), one
    [SUB, D] box of one page and KV head, one program per (tile, KV head) item."""
    from types import SimpleNamespace

    from openmsa.ops.attention import prefill_ws
    seen = {}

    class Kernel:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.update(grid=grid, args=args, kwargs=kwargs)
            return run
    monkeypatch.setattr(prefill_ws, "_sparse_attention_tile_ws_kernel", Kernel())
    packed = torch.zeros(10, 4, 128, 256, dtype=torch.bfloat16)
    k, v = packed[..., :128].permute(0, 2, 1, 3), packed[..., 128:].permute(0, 2, 1, 3)
    q = torch.zeros(64, 64, 128, dtype=torch.bfloat16)
    out, lse = torch.zeros_like(q), torch.zeros(64, 64)
    i32 = torch.zeros(3, dtype=torch.int32)
    kwargs = dict(QT=4, STAGES=2, FP8_LOADER=False)
    plan = SimpleNamespace(serial=7, tile_items=64, sm_scale=0.125,
                           tile_ws=dict(sub=64, kwargs=kwargs))
    attention_api._launch_tile_ws(q, k, v, i32, i32, out, lse, i32, i32, i32, i32, plan, False)
    k_desc, v_desc = seen["args"][1:3]
    for desc, tensor in ((k_desc, k), (v_desc, v)):
        assert desc.base.data_ptr() == tensor.data_ptr()
        assert list(desc.shape) == [10, 128, 4, 128]
        assert list(desc.strides) == [4 * 128 * 256, 256, 128 * 256, 1]
        assert list(desc.block_shape) == [1, 64, 1, 128]
    assert v_desc.base.data_ptr() - k_desc.base.data_ptr() == 128 * 2
    assert seen["grid"] == (64,) and seen["kwargs"] == dict(HAS_SCALE=False, **kwargs)
    assert seen["args"][11] == 0.125
    # the caches' page, slot and head strides, K's then V's (what the fp8 loader reads)
    assert seen["args"][-6:] == (4 * 128 * 256, 256, 128 * 256) * 2
    # ws_fp8_loader: the views themselves instead of descriptors
    kwargs["FP8_LOADER"] = True
    attention_api._launch_tile_ws(q, k, v, i32, i32, out, lse, i32, i32, i32, i32, plan, False)
    assert seen["args"][1] is k and seen["args"][2] is v


@pytest.mark.parametrize("case", ["fp8", "bf16", "off", "group4", "no_roll", "fp8_qk",
                                  "bf16_pair"])
def test_attention_prefill_fp8_tiles_in_pairs(h200, monkeypatch, case):
    """An 8K chunk of fp8 K/V on Hopper at G = 16: tiles of 8 tokens in two consumer
    warpgroups over one loader (ws_pair: PAIR, one 384-thread program per SM whose registers
    add up), the plan of 128 entries by a sort; 4-token tiles for bf16, with ws_pair off, when
    a pair would exceed 16 tokens (G = 4), and where the loader's ROLL loop or the loader
    itself is off; bf16 in pairs over the TMA producer with ws_pair_16."""
    from openmsa import support
    for module in (attention_api, support):
        monkeypatch.setattr(module, "capability", lambda device: (9, 0))
    monkeypatch.setattr(attention_api, "gluon_hopper_available", lambda: True)
    knob = dict(off=("ws_pair", False), no_roll=("ws_loader_roll", False),
                fp8_qk=("ws_fp8_qk", True), bf16_pair=("ws_pair_16", True)).get(case)
    if knob:
        monkeypatch.setitem(attention_api.TUNING, *knob)
    k, v = _kv_pair("packed", torch.bfloat16 if case.startswith("bf16")
                    else torch.float8_e4m3fn)
    heads = 16 if case == "group4" else 64
    q = _OnCuda(torch.empty(8192, heads, 128, dtype=torch.bfloat16, device="meta"))
    idx = _OnCuda(torch.empty(8192, 4, 16, dtype=torch.int32, device="meta"))
    plan = attention_api._plan(q, k, v, idx, None, 128)
    ws = plan.tile_ws["kwargs"]
    pair = case in ("fp8", "bf16_pair")
    assert ws["PAIR"] == pair and plan.plan_kwargs["SORTED"]
    want_qt = 16 if case == "group4" else 8 if pair else 4
    assert plan.tile_qt == ws["QT"] == plan.plan_kwargs["QT"] == want_qt
    assert plan.tile_items == 8192 // want_qt * 4
    if pair:
        t = attention_api.TUNING
        assert ws["maxnreg"] == t["ws_pair_maxnreg"] and ws["LOADER_ROLL"] == (case == "fp8")
        assert (ws["STAGES_K"], ws["STAGES_V"]) == (t["ws_pair_stages_k"], t["ws_pair_stages_v"])
        assert ws["PRODUCER_REGS"] == t["ws_pair_loader_regs" if case == "fp8" else
                                        "ws_producer_regs"]
        # the first consumer gets what the loader and the second leave of 3 x maxnreg
        first = 3 * ws["maxnreg"] - ws["PRODUCER_REGS"] - ws["CONSUMER_REGS"]
        assert first >= ws["CONSUMER_REGS"] and 3 * ws["maxnreg"] * 128 <= 65536
    else:
        assert ws["maxnreg"] == attention_api.TUNING["ws_maxnreg"]


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


@pytest.mark.parametrize("fp8", [False, True])
def test_attention_prefill_gluon_tiles_route(h200, monkeypatch, fp8):
    """An 8K chunk on Hopper: the plan takes the Gluon tiles with their own waste threshold
    (ws_waste: per dtype) and launches the per-token kernel as their programmatic dependent
    (ws_pdl: the tile programs signal, one per-token program waits). At launch, K or V at an
    address TMA cannot take sends the tiles to the Triton kernel, with tile_waste and no PDL."""
    from openmsa import support
    for module in (attention_api, support):
        monkeypatch.setattr(module, "capability", lambda device: (9, 0))
    monkeypatch.setattr(attention_api, "gluon_hopper_available", lambda: True)
    k, v = _kv_pair("packed", torch.float8_e4m3fn if fp8 else torch.bfloat16)
    q = _OnCuda(torch.empty(8192, 64, 128, dtype=torch.bfloat16, device="meta"))
    idx = _OnCuda(torch.empty(8192, 4, 16, dtype=torch.int32, device="meta"))
    plan = attention_api._plan(q, k, v, idx, None, 128)
    want_waste = attention_api.TUNING["ws_waste_fp8" if fp8 else "ws_waste"]
    assert plan.tile_ws is not None and plan.tile_ws["kwargs"]["PDL"]
    assert plan.ws_waste == want_waste and plan.ws_pdl
    assert plan.kwargs_overlap == dict(plan.kwargs, WAIT_TILES=True, launch_pdl=True)
    tile_waste = float(attention_api.TUNING["tile_waste"])
    assert attention_api._tile_route(plan, 4096, 4096 + 256) == (True, want_waste, True)
    assert attention_api._tile_route(plan, 4096, 4096 + 1) == (False, tile_waste, False)
    assert attention_api._tile_route(plan, 4096 + 8, 4096) == (False, tile_waste, False)
    monkeypatch.setitem(attention_api.TUNING, "ws_pdl", False)
    plan = attention_api._plan(q, k, v, idx, None, 128)
    assert "PDL" not in plan.tile_ws["kwargs"]
    assert attention_api._tile_route(plan, 4096, 4096) == (True, want_waste, False)
    monkeypatch.setitem(attention_api.TUNING, "tile_ws", False)
    plan = attention_api._plan(q, k, v, idx, None, 128)
    assert attention_api._tile_route(plan, 4096, 4096) == (False, tile_waste, False)


@pytest.mark.parametrize("fp8", [False, True])
def test_attention_prefill_per_token_stages(h200, monkeypatch, fp8):
    """An 8K chunk's per-token launch (the tokens no tile takes) pipelines 3 stages of fp8 K/V
    (prefill_stages_fp8) and 2 of 16-bit (prefill_stages); a decode step keeps `stages`."""
    from openmsa import support
    for module in (attention_api, support):
        monkeypatch.setattr(module, "capability", lambda device: (9, 0))
    k, v = _kv_pair("packed", torch.float8_e4m3fn if fp8 else torch.bfloat16)
    t = attention_api.TUNING
    for tokens, want in ((8192, t["prefill_stages_fp8" if fp8 else "prefill_stages"]),
                         (8, t["stages"])):
        q = _OnCuda(torch.empty(tokens, 64, 128, dtype=torch.bfloat16, device="meta"))
        idx = _OnCuda(torch.empty(tokens, 4, 16, dtype=torch.int32, device="meta"))
        plan = attention_api._plan(q, k, v, idx, None, 128)
        assert plan.kwargs["num_stages"] == want
    assert t["prefill_stages_fp8"] != t["prefill_stages"]  # else the case proves nothing
