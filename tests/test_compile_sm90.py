# SPDX-License-Identifier: Apache-2.0
"""Every kernel compiles for Hopper (sm_90) through Triton's own compiler and ptxas, on a machine
without a GPU: the interpreter tier checks what the kernels compute, this checks that the code the
GPU runs can be built at M3's shapes (a frontend or register-allocation failure shows up here)."""

import os

import pytest

pytestmark = pytest.mark.reference

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("compilation needs the real compiler, not the interpreter", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from openmsa.ops.cache.write import _write_index_cache_kernel, _write_kv_cache_kernel  # noqa
from openmsa.ops.indexer.scores import _block_scores_kernel  # noqa: E402
from openmsa.ops.indexer.select import _merge_topk_kernel, _segment_topk_kernel  # noqa: E402

I32, I64, F32 = "*i32", "*i64", "*fp32"
STEP = dict(cu_ptr=I32, seq_lens_ptr=I32, bt_ptr=I32)


def _compile(fn, pointers, scalars, constexprs):
    # a constexpr parameter left out takes its default, as at a runtime launch (not an i32)
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default},
                  **constexprs}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name) or scalars.get(name, "i32")
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))


@pytest.mark.parametrize("tile_mode, q_type, c_type, early", [(False, "*fp8e4nv", "*fp8e4nv", 0),
                                                              (False, "*fp8e4nv", "*fp8e4nv", 1),
                                                              (True, "*fp8e4nv", "*fp8e4nv", 0),
                                                              (False, "*bf16", "*fp8e4nv", 1),
                                                              (True, "*bf16", "*bf16", 1)])
def test_block_scores_kernel(tile_mode, q_type, c_type, early):
    # early: the decode launch's page ids loaded up front and one causal loop (TUNING
    # decode_pages_early, decode_one_loop); the tile launch's quick exit and its wait at the end
    # (tile_quick_exit, tile_overlap), its heaviest-first order (prefill_reverse_tiles and
    # _splits, on both tile launches) and its split-major grid (prefill_split_major)
    pointers = dict(q_ptr=q_type, cache_ptr=c_type, out_ptr=F32, **STEP)
    k = _compile(_block_scores_kernel, pointers, {},
             dict(H=4, HP=4, DI=128, DIP=128, BLOCK=128, BPS=32 if tile_mode else 16,
                  SMALL_Q=16, TILE_MODE=tile_mode, ROWS_T=32 if tile_mode else 4,
                  CAST_K=q_type != c_type, IEEE=False, KEYS_AS_ROWS=not tile_mode,
                  MAX_SKIPS_NAN=True, PDL=tile_mode, PAGES_EARLY=bool(early),
                  ONE_LOOP=bool(early), QUICK_EXIT=bool(early),
                  WAIT_AT_END=tile_mode and bool(early), SPLIT_MAJOR=tile_mode and bool(early),
                  REVERSE_TILES=tile_mode, REVERSE_SPLITS=tile_mode))
    assert ("griddepcontrol.wait" in k.asm["ptx"]) == (tile_mode and bool(early))


def test_first_launches_wait_for_the_kernel_before():
    # first_pdl: the indexer's request launch starts with griddepcontrol.wait, which the
    # launches without it (above) must not have (the attention's: tests/ops/test_attention.py)
    step = dict(q_ptr="*bf16", out_ptr=F32, **STEP)
    k = _compile(_block_scores_kernel, dict(step, cache_ptr="*bf16"), {},
                 dict(H=4, HP=4, DI=128, DIP=128, BLOCK=128, BPS=16, SMALL_Q=16,
                      TILE_MODE=False, ROWS_T=4, CAST_K=False, IEEE=False, KEYS_AS_ROWS=True,
                      MAX_SKIPS_NAN=True, PDL=True, WAIT_PRIOR=True))
    assert "griddepcontrol.wait" in k.asm["ptx"]


@pytest.mark.parametrize("dtype, heads", [("fp8e4nv", 4), ("fp8e4nv", 1), ("bf16", 4)])
def test_block_scores_ws_kernel(dtype, heads):
    # the Gluon tile launch (scores_ws.py) with the knobs api.py passes: warp specialisation,
    # TMA and wgmma lower for sm_90, and its shared memory fits one program per SM
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from openmsa.ops.indexer.api import TUNING
    from openmsa.ops.indexer.scores_ws import _block_scores_ws_kernel as fn
    gdt = gl.float8e4nv if dtype == "fp8e4nv" else gl.bfloat16

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, 128], gdt)
        return f"tensordesc<{dtype}[{rows}, 128],{layout!r}>"
    constexprs = dict(H=heads, SMALL_Q=16,
                      STAGES=TUNING["ws_stages" if dtype == "fp8e4nv" else "ws_stages_16"],
                      CONSUMER_REGS=TUNING["ws_consumer_regs"], REVERSE_TILES=True,
                      CONSUMERS=TUNING["ws_consumers"], Q_IN_REGS=TUNING["ws_q_in_regs"],
                      CONVERT=heads == 4, SKIP_IDLE=heads == 4, WAIT_AT_END=heads == 4,
                      num_warps=4)
    signature = {n: "constexpr" if n in constexprs else "i32" for n in fn.arg_names}
    signature.update(q_desc=desc(64), k_desc=desc(128), out_ptr=F32, **STEP)
    src = GluonASTSource(fn, signature,
                         {(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert "wgmma.mma_async" in k.asm["ptx"] and "setmaxnreg" in k.asm["ptx"]
    assert k.metadata.shared <= 227 * 1024
    assert ("griddepcontrol.wait" in k.asm["ptx"]) == (heads == 4)


@pytest.mark.parametrize("g, w, vec, tpr, warps", [(16, 4, 4, 4, 1), (16, 4, 4, 1, 1),
                                                  (16, 1, 4, 2, 2), (8, 1, 1, 4, 1),
                                                  (64, 1, 4, 4, 1), (16, 64, 4, 32, 1)])
def test_short_rows_topk_kernel(g, w, vec, tpr, warps):
    # the selection with a row in tpr threads (indexer/select_rows.py): a row's counts cross
    # only its threads (no shared memory with one warp, shuffles only with tpr > 1 or several
    # warps), no spills, the counts' comparisons as PTX `set`; with VEC = 4 on 16-divisible
    # strides (what Triton specialises at launch), 16-byte loads
    import re

    from triton.experimental.gluon._runtime import GluonASTSource

    from openmsa.ops.indexer.select_rows import _short_rows_topk_kernel as fn
    constexprs = dict(H=4, TOPK=min(16, g * w), KP=16, INIT=0, LOCAL=1, BLOCK=128, G=g, W=w,
                      VEC=vec, TPR=tpr, num_warps=warps, stride_sb=1, PDL=tpr == 4,
                      REVERSE=warps == 1)
    signature = {n: "constexpr" if n in constexprs else "i32" for n in fn.arg_names}
    signature.update(scores_ptr=F32, out_ptr=I32, cu_ptr=I32, seq_lens_ptr=I32)
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
               for n in ("scores_ptr", "out_ptr", "stride_st", "stride_sh")}
    src = GluonASTSource(fn, signature,
                         {(fn.arg_names.index(k),): v for k, v in constexprs.items()}, aligned)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    ptx = k.asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == (tpr == 4)
    # (several warps share one search loop: only its "any row still searching" crosses them)
    assert k.metadata.shared <= 4 * (warps - 1) * 2 and "ld.local" not in ptx
    assert ("shfl" in ptx) == (warps > 1 or tpr > 1)
    # (counts: 1.0 / 0.0 per compare, a float sum)
    assert "set.ge.f32.f32" in ptx and "set.gt.f32.f32" in ptx
    loads = re.findall(r"ld\.global[.a-z0-9]*", ptx)
    assert sum(".v4" in op for op in loads) == (g * w // tpr // 4 if vec == 4 else 0)


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


@pytest.mark.parametrize("by_sort", [False, True])
def test_selection_kernels(by_sort):
    for single in (False, True):
        for cap, chunk in ((0, 0), (64, 0), (64, 128)):  # chunk: TUNING select_chunk
            _compile(_segment_topk_kernel, dict(scores_ptr=F32, cu_ptr=I32, seq_lens_ptr=I32,
                                                out_ptr=I32, cand_ptr=I64, scratch_ptr=I64,
                                                counter_ptr=I32), {},
                     dict(TOPK=16, KP=16, INIT=0, LOCAL=1, BLOCK=128, SEG=1024, SINGLE=single,
                          BY_SORT=by_sort, CAP=cap, NG=64, PDL=single, CH=chunk))
    merge = _compile(_merge_topk_kernel, dict(cand_ptr=I64, cu_ptr=I32, seq_lens_ptr=I32,
                                              out_ptr=I32), {},
                     dict(TOPK=16, KP=16, BLOCK=128, SEG=1024, CANDP=128, BY_SORT=by_sort,
                          PDL=by_sort))
    # a dependent launch waits for its predecessor before reading (and only then)
    assert ("griddepcontrol.wait" in merge.asm["ptx"]) == by_sort
    if by_sort:  # the sort path's merge in the last segment program (select_sort_fused)
        fused = _compile(_segment_topk_kernel, dict(scores_ptr=F32, cu_ptr=I32, seq_lens_ptr=I32,
                                                    out_ptr=I32, cand_ptr=I64, scratch_ptr=I64,
                                                    counter_ptr=I32), {},
                         dict(TOPK=16, KP=16, INIT=0, LOCAL=1, BLOCK=128, SEG=256, SINGLE=False,
                              BY_SORT=True, CAP=0, NG=64, PDL=True, FUSED=True, CANDP=64))
        assert "atom" in fused.asm["ptx"]
    # the group-bound path (api.py, select_group_bound) at 1M tokens: 512 groups of 16 blocks
    from openmsa.ops.indexer.select import _group_bound_select_kernel, _group_max_kernel
    common = dict(TOPK=16, INIT=0, LOCAL=1, BLOCK=128, GS=16)
    _compile(_group_max_kernel, dict(scores_ptr=F32, gmax_ptr=I32, cu_ptr=I32,
                                     seq_lens_ptr=I32), {}, dict(**common, GB=64))
    _compile(_group_bound_select_kernel, dict(scores_ptr=F32, gmax_ptr=I32, out_ptr=I32,
                                              scratch_ptr=I64, cu_ptr=I32, seq_lens_ptr=I32), {},
             dict(**common, KP=16, NGP=512, CG=32, CAP=64, CH=128))


def test_cache_write_kernels():
    _compile(_write_index_cache_kernel, dict(src_ptr="*bf16", cache_ptr="*fp8e4nv",
                                             slot_ptr=I64), {},
             dict(BLOCK=128, DI=128, DIP=128, SATURATE=True))
    _compile(_write_kv_cache_kernel, dict(k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr="*fp8e4nv",
                                          v_cache_ptr="*fp8e4nv", slot_ptr=I64,
                                          k_scale_ptr=F32, v_scale_ptr=F32), {},
             dict(BLOCK=128, HKV=4, HKVP=4, D=128, DP=128, SATURATE=True, HAS_SCALE=True))


@pytest.mark.parametrize("kv_type, index_type", [("*fp8e4nv", "*fp8e4nv"), ("*bf16", "*bf16")])
def test_fused_prepare_kernel(kv_type, index_type):
    from openmsa.ops.cache.prepare import _fused_prepare_kernel

    fp8 = kv_type == "*fp8e4nv"
    _compile(_fused_prepare_kernel,
             dict(qkv_ptr="*bf16", pos_ptr=I32, qw_ptr="*bf16", kw_ptr="*bf16", iqw_ptr="*bf16",
                  ikw_ptr="*bf16", table_ptr=F32, k_cache_ptr=kv_type, v_cache_ptr=kv_type,
                  slot_ptr=I64, index_cache_ptr=index_type, index_slot_ptr=I64,
                  k_scale_ptr=F32, v_scale_ptr=F32, q_out_ptr="*bf16", iq_out_ptr=index_type),
             dict(eps="fp32"),
             dict(HQ=64, HKV=4, H=4, D=128, DI=128, DP=128, DIP=128, ROT=64, NCOARSE=16384,
                  BLOCK=128, IBLOCK=128, HT=16, KV_SATURATE=fp8,
                  INDEX_SATURATE=index_type == "*fp8e4nv", IQ_SATURATE=index_type == "*fp8e4nv",
                  HAS_SCALE=fp8))


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
