# SPDX-License-Identifier: Apache-2.0
"""Every kernel compiles for Hopper (sm_90) through Triton's own compiler and ptxas, on a machine
without a GPU: the interpreter tier checks what the kernels compute, this checks that the code the
GPU runs can be built at M3's shapes (a frontend or register-allocation failure shows up here).
The helper is tests/helpers/sm90.py; an op whose tests live in tests/ops/ compiles its kernels
there (the cache op's: tests/ops/test_cache.py)."""

import os

import pytest

pytestmark = pytest.mark.reference

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("compilation needs the real compiler, not the interpreter", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402

from openmsa.ops.attention.decode import _merge_splits_kernel, _sparse_attention_kernel  # noqa
from openmsa.ops.attention.page_table import _sparse_page_table_kernel  # noqa: E402
from openmsa.ops.attention.prefill import _sparse_attention_tile_kernel, _tile_plan_kernel  # noqa

from helpers.sm90 import F32, I32, I64, STEP  # noqa: E402,F401
from helpers.sm90 import compile_sm90 as _compile  # noqa: E402


def test_first_launches_wait_for_the_kernel_before():
    # first_pdl (attention api.py): the decode split launch starts with griddepcontrol.wait
    step = dict(q_ptr="*bf16", out_ptr=F32, **STEP)
    k = _compile(_sparse_attention_kernel,
                 dict(step, k_ptr="*bf16", v_ptr="*bf16", idx_ptr=I32, out_ptr="*bf16",
                      lse_ptr=F32, part_out_ptr=F32, counter_ptr=I32, tile_blocks_ptr=I32,
                      k_scale_ptr=F32, v_scale_ptr=F32),
                 dict(sm_scale="fp32"),
                 dict(NUM_HEADS=64, NUM_KV_HEADS=4, NUM_INDEX_HEADS=4, G=16, M=16, D=128,
                      BLOCK=128, TOPK=16, KP=16, SUB=128, STEPS=16, SPLITS=1, HAS_SCALE=False,
                      IEEE=False, F16_COMPUTE=False, FUSED_MERGE=False, TILE_QT=0,
                      V_PAIRS=False, PTX=True, GUESS=True, WAIT_PRIOR=True))
    assert "griddepcontrol.wait" in k.asm["ptx"]


@pytest.mark.parametrize("dtype, sub, stages, group", [
    ("bf16", 64, 2, 16), ("fp16", 128, 1, 8), ("bf16", 64, 3, 16), ("fp8e4nv", 128, 1, 16),
    ("fp8e4nv", 128, 2, 8), ("bf16", 128, 21, 16), ("fp8e4nv", 128, 21, 16),
    ("fp8qk", 128, 1, 16), ("fp8qk", 128, 21, 8), ("fp8ld", 128, 1, 16), ("fp8ld", 128, 21, 8),
    ("fp8roll", 128, 21, 16), ("fp8noroll", 128, 1, 8), ("fp8ld", 64, 32, 16),
    ("fp8pair", 128, 21, 16), ("fp8pair", 128, 32, 8), ("fp8paire", 128, 32, 16),
    ("bf16pair", 128, 32, 16), ("fp16pair", 128, 32, 8)])
def test_sparse_attention_tile_ws_kernel(dtype, sub, stages, group):
    # stages: one digit per ring (K, then V) where they differ; fp8qk: fp8 K/V with
    # S = Q K^T as fp8 MMAs (FP8_QK); fp8ld: fp8 K/V loaded and converted by a producer
    # warpgroup (FP8_LOADER; fp8roll / noroll: V's loads issued while K is stored or after,
    # LOADER_ROLL; fp8ld: api.py's default; fp8pair: two consumers of 64 rows over one
    # loader, PAIR, one program per SM; fp8paire: its loader's V loads with K's, LOADER_EAGER,
    # at 120 loader and 192 consumer registers)
    # (bf16pair / fp16pair: 16-bit K/V in pairs over the TMA producer, ws_pair_16)
    fp8_qk = dtype == "fp8qk"
    pair, eager = "pair" in dtype, dtype == "fp8paire"
    loader = dtype in ("fp8ld", "fp8roll", "fp8noroll") or dtype.startswith("fp8pair")
    roll, default_roll = dtype == "fp8roll" or dtype.startswith("fp8pair"), dtype == "fp8ld"
    dtype = "fp8e4nv" if fp8_qk or loader else dtype.removesuffix("pair")
    # the Gluon prefill tiles (attention/prefill_ws.py) with the launch options api.py passes:
    # warp specialisation, 4-D TMA boxes and both wgmma forms (P from registers) lower for
    # sm_90, fp8 K/V through their fp16 copy; two programs fit on an SM (registers at launch,
    # shared memory) and ptxas spills nothing
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from openmsa.ops.attention.api import TUNING
    from openmsa.ops.attention.prefill_ws import _sparse_attention_tile_ws_kernel as fn
    gdt = dict(bf16=gl.bfloat16, fp16=gl.float16, fp8e4nv=gl.float8e4nv)[dtype]
    q_type = "*bf16" if dtype == "fp8e4nv" else f"*{dtype}"
    box = [1, sub, 1, 128]
    layout = gl.NVMMASharedLayout.get_default_for(box, gdt)
    desc = f"tensordesc<{dtype}[1, {sub}, 1, 128],{layout!r}>"
    rows = 128 if pair else 64
    constexprs = dict(SUB=sub, D=128, NUM_KV_HEADS=4, G=group, GP=group, QT=rows // group, KP=16,
                      BLOCK=128, STAGES_K=stages // 10 or stages, STAGES_V=stages % 10,
                      KEYS_EARLY=stages != 2, HAS_SCALE=stages == 1, LAZY_MASK=stages != 3,
                      PRODUCER_REGS=(120 if eager else TUNING["ws_pair_loader_regs"]
                                     if pair and loader else
                                     TUNING["ws_loader_regs" if loader else
                                            "ws_producer_regs"]),
                      FP8=dtype == "fp8e4nv", FP8_QK=fp8_qk, FP8_LOADER=loader,
                      LOADER_ROLL=roll or (default_roll and TUNING["ws_loader_roll"]),
                      PDL=stages != 3, num_warps=4, PAIR=pair,
                      CONSUMER_REGS=(192 if eager else TUNING["ws_pair_consumer_regs"]
                                     if pair else 0), LOADER_EAGER=eager)
    signature = {n: "constexpr" if n in constexprs else "i32" for n in fn.arg_names}
    src_type = "*fp8e4nv" if loader else desc
    signature.update(q_ptr=q_type, k_src=src_type, v_src=src_type, out_ptr=q_type,
                     lse_ptr=F32, blocks_ptr=I32, union_ptr=I32, k_scale_ptr=F32,
                     v_scale_ptr=F32, sm_scale="fp32", **STEP)
    del signature["bt_ptr"]
    # what a launch specialises on: 16-byte aligned caches, strides of 16 elements' multiples
    # (the loader's 8-byte loads need it; without it they are byte loads and spill)
    aligned = ("k_src", "v_src", "stride_kp", "stride_kb", "stride_kh", "stride_vp",
               "stride_vb", "stride_vh") if loader else ()
    src = GluonASTSource(fn, signature,
                         {(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                         {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    maxnreg = TUNING["ws_pair_maxnreg" if pair else "ws_maxnreg"]
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, maxnreg=maxnreg))
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and ("cp.async.bulk.tensor.4d" in ptx) != loader
    assert ("e4m3.e4m3" in ptx) == fp8_qk  # the fp8 MMAs of S = Q K^T
    # PDL: the per-token launch may start once every program has begun (api.py's ws_pdl)
    assert ("griddepcontrol.launch_dependents" in ptx) == (stages != 3)
    if pair:  # one program of 384 threads at 168 registers (the file holds 170)
        assert ".maxnreg 168" in ptx and ".reqntid 384" in ptx
        assert k.metadata.shared <= 227 * 1024 - 1024
    else:
        assert ".maxnreg 128" in ptx and ".reqntid 256" in ptx  # 2 x 256 x 128 = the file
        assert k.metadata.shared <= 227 * 1024 // 2 - 1024
    # (the loader's warpgroup at ws_loader_regs leaves the consumer 176 registers, where ptxas
    # keeps 2-3 of its scalars on the stack: measured with them, api.py's ws_fp8_loader)
    # (LOADER_ROLL, the default, one scalar more: 20 bytes on some shapes)
    _assert_no_spills(ptx, 24 if loader else 0)


def _assert_no_spills(ptx, allowed_bytes=0):
    import os
    import subprocess
    import tempfile
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(ptx)
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o",
                               os.path.join(d, "k.cubin")], capture_output=True, text=True,
                              check=True).stderr
    import re
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", info)]
    assert spills and max(spills) <= allowed_bytes, info


@pytest.mark.parametrize("kv_type, splits, sub", [("*fp8e4nv", 2, 64), ("*bf16", 1, 128)])
def test_attention_kernels(kv_type, splits, sub):
    # WAIT_TILES (a prefill step after the Gluon tiles): one program waits for the tile launch
    k = _compile(_sparse_attention_kernel,
             dict(q_ptr="*bf16", k_ptr=kv_type, v_ptr=kv_type, idx_ptr=I32, out_ptr="*bf16",
                  lse_ptr=F32, part_out_ptr=F32, counter_ptr=I32,
                  tile_blocks_ptr=I32, k_scale_ptr=F32, v_scale_ptr=F32, **STEP),
             dict(sm_scale="fp32"),
             dict(NUM_HEADS=64, NUM_KV_HEADS=4, NUM_INDEX_HEADS=4, G=16, M=16, D=128,
                  BLOCK=128, TOPK=16, KP=16, SUB=sub, STEPS=16 * 128 // sub // splits,
                  SPLITS=splits, HAS_SCALE=kv_type == "*fp8e4nv", IEEE=False,
                  F16_COMPUTE=kv_type == "*fp8e4nv", FUSED_MERGE=splits > 1,
                  TILE_QT=4 if splits == 1 else 0, V_PAIRS=kv_type == "*fp8e4nv", PTX=True,
                  GUESS=True, SP=1 << (splits - 1).bit_length(), PDL=splits > 1,
                  STORE_LSE=splits == 1, LAZY_SUM=splits > 1, WAIT_TILES=splits == 1))
    assert ("griddepcontrol.wait" in k.asm["ptx"]) == (splits == 1)
    for qt, sorted_form in ((4, False), (8, True)):  # (the sort: ws_pair's 128 entries)
        _compile(_tile_plan_kernel, dict(idx_ptr=I32, blocks_ptr=I32, union_ptr=I32, **STEP),
                 dict(waste="fp32"), dict(NUM_KV_HEADS=4, NUM_INDEX_HEADS=4, QT=qt, BLOCK=128,
                                          TOPK=16, KP=16, SORTED=sorted_form))
    _compile(_sparse_attention_tile_kernel,
             dict(q_ptr="*bf16", k_ptr=kv_type, v_ptr=kv_type, out_ptr="*bf16", lse_ptr=F32,
                  blocks_ptr=I32, union_ptr=I32, k_scale_ptr=F32, v_scale_ptr=F32, **STEP),
             dict(sm_scale="fp32"),
             dict(NUM_KV_HEADS=4, G=16, GP=16, QT=4, D=128, BLOCK=128, KP=16, SUB=sub,
                  HAS_SCALE=kv_type == "*fp8e4nv", IEEE=False,
                  F16_COMPUTE=kv_type == "*fp8e4nv", LAZY_MASK=kv_type == "*fp8e4nv",
                  PERSISTENT=kv_type == "*bf16"))
    _compile(_merge_splits_kernel, dict(part_out_ptr=F32, out_ptr="*bf16",
                                        lse_ptr=F32), {},
             dict(NUM_HEADS=64, D=128, SPLITS=2, SP=2, PDL=True, STORE_LSE=False))
    _compile(_sparse_page_table_kernel, dict(idx_ptr=I32, pages_ptr=I32, lens_ptr=I32, **STEP),
             {}, dict(NUM_KV_HEADS=4, NUM_INDEX_HEADS=4, TOPK=16, KP=16, BLOCK=128, SUB=16))


def test_resources_tool():
    """benchmarks/resources.py (docs/performance.md's offline counts) still compiles its specs
    with the kernels' current signatures, and finds the selection's search loop in the SASS."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    resources = pytest.importorskip("resources")
    regs, spills, _, per_sm, _ = resources.index_resources("fp8", 128, 32, 3, 4)
    assert 0 < regs <= 255 and per_sm >= 1
    regs, _, _, _, _ = resources.index_resources("fp8", 16, 32, 3, 4, decode=True)
    assert 0 < regs <= 255
    regs, spills, _, _, loops = resources.select_resources("search", 64, 0, 1, sass=True)
    assert spills == 0 and loops, "no search loop (a REDUX in a backward branch) found"
    # the short-row selection (Gluon): its search loop, and its ALU-pipe share counted
    regs, spills, _, _, loops = resources.short_rows_resources(16, 4, 4, 1, sass=True)
    assert spills == 0 and len(loops) == 1, "no search loop (a SHFL in a backward branch)"
    count, _, _, alu = loops[0]
    assert 0 < alu < count
