# SPDX-License-Identifier: Apache-2.0
"""sparse_attention and sparse_page_table against the reference, on every tier: the config's
checks (reference), the kernels built for sm_90 on any machine (reference: the real compiler),
the kernels under Triton's interpreter on tiny shapes (interpret), and M3 shapes, Gluon tiles,
caches past 2^31 elements and CUDA-graph replay on an H200 (gpu). The launch heuristics
themselves are pure functions, tested in tests/plans/test_attention_plan.py.

Tests that need another knob value pass an AttentionConfig; tests of a kernel path no config
reaches (a split count, a launch without its overlap) run a plan edited by hand through
api._run."""

import dataclasses
import os

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

import openmsa
from openmsa import reference as ref
from openmsa.batch import token_layout
from openmsa.ops.attention import api
from openmsa.ops.attention.kernels import tile as tile_kernels
from openmsa.ops.attention.plan import DEFAULT, AttentionConfig, plan
from openmsa.ops.common.counters import COUNTERS
from openmsa.ops.common.plan import DeviceFacts, Launch, LaunchPlan
from helpers import (assert_close, compact_pages, cuda_step, make_step, nan_poison,
                     random_index_inputs, random_kv_cache, to_device)

FP8 = torch.float8_e4m3fn
FNUZ = torch.float8_e4m3fnuz
# AMD gfx942's fp8 (e4m3fnuz): on the interpreter and ROCm only (NVIDIA GPUs have no fnuz)
ON_FNUZ = pytest.mark.skipif(torch.cuda.is_available() and torch.version.hip is None,
                             reason="e4m3fnuz is AMD gfx942's fp8; NVIDIA GPUs have none")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# the Triton tiles instead of the Gluon ones (the fallback's form, on Hopper too)
TRITON_TILES = dataclasses.replace(DEFAULT, gluon_16=None, gluon_fp8=None, gluon_pair_fp8=None)


def _config(**changes) -> AttentionConfig:
    return dataclasses.replace(DEFAULT, **changes)


def _plan_of(q, k, v, idx, *, block_size, config=DEFAULT, return_lse=False, has_scale=False):
    """The plan sparse_attention runs for these tensors."""
    shape = api.step_shape(q, k, v, idx, block_size=block_size, return_lse=return_lse,
                           has_scale=has_scale)
    return plan(shape, DeviceFacts.of(q.device), config)


def _taken(p: LaunchPlan, idx, d):
    """The tile plan's result (per (tile, KV head) its union size, -1 where left to the
    per-token kernel) for plan p: its tile_plan launch, run alone."""
    launch = p.find("tile_plan")
    qt = p.sizes["tile_tokens"]
    blocks = torch.full((-(-idx.shape[0] // qt), launch.grid[1]), -7, dtype=torch.int32,
                        device=idx.device)
    union = torch.empty((p.sizes["tile_items"], 3, p.sizes["union_width"]), dtype=torch.int32,
                        device=idx.device)
    launch.run(tile_kernels._tile_plan_kernel, idx, d.cu_seqlens_q, d.seq_lens, d.block_table,
               blocks, union, d.seq_lens.shape[0], idx.shape[0], d.block_table.shape[1],
               d.num_pages, *idx.stride(), *d.block_table.stride())
    return blocks


def _run_plan(p, q, k, v, idx, d, *, out=None, return_lse=False, scale=None, k_scale=None,
              v_scale=None):
    """sparse_attention's launches for a given plan."""
    sm_scale = q.shape[2] ** -0.5 if scale is None else scale
    return api._run(p, q, k, v, idx, d.cu_seqlens_q, d.seq_lens, d.block_table, out,
                    return_lse, sm_scale, k_scale, v_scale)


def _resplit(p: LaunchPlan, splits: int, fused: bool) -> LaunchPlan:
    """p's per-token launch split `splits` ways, merged by its last program (fused) or by a
    merge launch (a programmatic dependent on CUDA)."""
    token = p.find("token")
    t, hkv, _ = token.grid
    par = token.params
    steps = par["TOPK"] * (par["BLOCK"] // par["SUB"])
    per = -(-steps // splits)
    pdl = par["PTX"] and not fused
    sp = triton.next_power_of_2(splits)
    launches = [Launch("token", (t, hkv, splits), dict(par, SPLITS=splits, STEPS=per, SP=sp,
                                                       FUSED_MERGE=fused, PDL=pdl))]
    if not fused:
        launches.append(Launch("merge", (t, par["NUM_HEADS"]), dict(
            NUM_HEADS=par["NUM_HEADS"], D=par["D"], SPLITS=splits, SP=sp, PDL=pdl,
            STORE_LSE=par["STORE_LSE"], num_warps=4, launch_pdl=pdl)))
    return LaunchPlan(launches, dict(p.sizes, splits=splits, fused=int(fused)))


@pytest.mark.reference
def test_config_must_be_an_attention_config():
    with pytest.raises(TypeError, match="config"):
        openmsa.sparse_attention(None, None, None, None, None, None, None, config={"sub": 64})
    with pytest.raises(TypeError, match="config"):
        openmsa.sparse_attention(None, None, None, None, None, None, None,
                                 config=dataclasses.asdict(DEFAULT))


@pytest.mark.reference
def test_config_is_frozen_and_hashable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.tiles = False
    assert hash(_config(tiles=False)) != hash(DEFAULT) or _config(tiles=False) != DEFAULT
    # a small config: the numbers of one launch grouped into a form, not fields of their own
    # (a form per K/V dtype family where the measured best differs: decode, small, prefill)
    assert len(dataclasses.fields(AttentionConfig)) <= 17


@pytest.mark.reference
def test_an_unknown_launch_name_raises():
    """api.py runs a plan's launches through a table of launch names: a name the table lacks
    raises before anything launches (never skipped)."""
    p = LaunchPlan([Launch("tokens", (1, 1, 1))], dict(splits=1, fused=1, store_lse=0,
                                                       tile_tokens=0, tile_items=0,
                                                       union_width=0))
    q = torch.zeros(1, 16, 128)
    k = v = torch.zeros(1, 128, 1, 128)
    idx = torch.zeros(1, 1, 1, dtype=torch.int32)
    step = torch.zeros(2, dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="no kernel 'tokens'"):
        api._run(p, q, k, v, idx, step, step[:1], table, None, False, 1.0, None, None)


@pytest.mark.reference
def test_gluon_tiles_read_their_own_views():
    """What the Gluon tiles read (api._tile_sources, no GPU): 16-bit K and V described as
    their own [P, B, Hkv, D] views (vLLM's packed layout here: V starts D elements in), one
    [SUB, D] box of one page and KV head; fp8 K/V as the views themselves (the loader reads
    them with their strides)."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    packed = torch.zeros(10, 4, 128, 256, dtype=torch.bfloat16)
    k, v = packed[..., :128].permute(0, 2, 1, 3), packed[..., 128:].permute(0, 2, 1, 3)
    gluon = Launch("tiles_gluon", (64,), dict(SUB=64, FP8=False))
    k_desc, v_desc = api._tile_sources(gluon, k, v)
    for desc, tensor in ((k_desc, k), (v_desc, v)):
        assert desc.base.data_ptr() == tensor.data_ptr()
        assert list(desc.shape) == [10, 128, 4, 128]
        assert list(desc.strides) == [4 * 128 * 256, 256, 128 * 256, 1]
        assert list(desc.block_shape) == [1, 64, 1, 128]
    assert v_desc.base.data_ptr() - k_desc.base.data_ptr() == 128 * 2
    k8, v8 = api._tile_sources(Launch("tiles_gluon", (64,), dict(SUB=128, FP8=True)), k, v)
    assert k8 is k and v8 is v


def _sm90():
    if INTERPRET:
        pytest.skip("compilation needs the real compiler, not the interpreter")
    from helpers import sm90
    return sm90


I32, F32 = "*i32", "*fp32"
STEP = dict(cu_ptr=I32, seq_lens_ptr=I32, bt_ptr=I32)
TOKEN_POINTERS = dict(idx_ptr=I32, out_ptr="*bf16", lse_ptr=F32, part_out_ptr=F32,
                      counter_ptr=I32, tile_blocks_ptr=I32, k_scale_ptr=F32, v_scale_ptr=F32,
                      q_ptr="*bf16", **STEP)
H200 = DeviceFacts(kind="cuda", num_sms=132, capability=(9, 0), gluon_hopper=True)


def _m3_shape(tokens, heads=64, kv_heads=4, kv_dtype=torch.bfloat16, topk=16, **kw):
    """An M3 step shape: q in K/V's dtype (bf16 for fp8 K/V), head dim 128."""
    from openmsa.ops.attention.plan import AttentionShape
    return AttentionShape(num_tokens=tokens, num_heads=heads, num_kv_heads=kv_heads,
                          head_dim=128, num_index_heads=kv_heads, topk=topk, block_size=128,
                          q_dtype=torch.bfloat16 if kv_dtype == FP8 else kv_dtype,
                          kv_dtype=kv_dtype, **kw)


def _constexprs(launch: Launch):
    """A launch's constexprs, and its options (num_warps, num_stages, maxnreg) apart."""
    options = {k: v for k, v in launch.params.items()
               if k in ("num_warps", "num_stages", "maxnreg", "launch_pdl")}
    return {k: v for k, v in launch.params.items() if k not in options}, options


@pytest.mark.reference
def test_first_launch_waits_for_the_kernel_before():
    """A decode step's only launch starts with griddepcontrol.wait (WAIT_PRIOR), which the
    launches after a tile launch must not have."""
    sm90 = _sm90()
    from openmsa.ops.attention.kernels.token import _sparse_attention_kernel
    token = plan(_m3_shape(8), H200, DEFAULT).find("token")
    constexprs, _ = _constexprs(token)
    assert constexprs["WAIT_PRIOR"]
    k = sm90.compile_sm90(_sparse_attention_kernel,
                            dict(TOKEN_POINTERS, k_ptr="*bf16", v_ptr="*bf16"),
                            dict(sm_scale="fp32"), constexprs)
    assert "griddepcontrol.wait" in k.asm["ptx"]


@pytest.mark.reference
@pytest.mark.parametrize("kv_dtype, tokens, heads, topk", [
    (FP8, 8192, (64, 4), 16), (torch.bfloat16, 8192, (64, 4), 16), (FP8, 128, (64, 4), 16),
    (FP8, 1, (64, 4), 16), (torch.bfloat16, 64, (16, 1), 16), (FP8, 8192, (32, 8), 16),
    (FP8, 8192, (64, 4), 1), (torch.bfloat16, 1, (64, 4), 1)])
def test_attention_kernels_compile_as_planned(kv_dtype, tokens, heads, topk):
    """The plan's Triton launches (the per-token kernel, the tile plan and tiles, the merge)
    compile for sm_90 at M3 shapes with the constexprs the plan gives them; after the Gluon
    tiles, one program of the per-token kernel waits for them (WAIT_TILES). topk 1: a
    selection of one block per row (KP = 1)."""
    sm90 = _sm90()
    from openmsa.ops.attention.kernels.token import _merge_splits_kernel, _sparse_attention_kernel
    kv = "*fp8e4nv" if kv_dtype == FP8 else "*bf16"
    for aligned in (True, False):
        p = plan(_m3_shape(tokens, *heads, kv_dtype=kv_dtype, tma_aligned=aligned,
                           has_scale=kv_dtype == FP8, topk=topk), H200, DEFAULT)
        constexprs, options = _constexprs(p.find("token"))
        k = sm90.compile_sm90(_sparse_attention_kernel,
                                dict(TOKEN_POINTERS, k_ptr=kv, v_ptr=kv), dict(sm_scale="fp32"),
                                constexprs, options=options)
        assert ("griddepcontrol.wait" in k.asm["ptx"]) == bool(
            constexprs.get("WAIT_TILES") or constexprs.get("WAIT_PRIOR"))
        if p.find("tile_plan") is not None:
            constexprs, options = _constexprs(p.find("tile_plan"))
            del constexprs["waste"]
            sm90.compile_sm90(tile_kernels._tile_plan_kernel,
                                dict(idx_ptr=I32, blocks_ptr=I32, union_ptr=I32, **STEP),
                                dict(waste="fp32"), constexprs, options=options)
        if p.find("tiles") is not None:
            constexprs, options = _constexprs(p.find("tiles"))
            sm90.compile_sm90(tile_kernels._sparse_attention_tile_kernel,
                                dict(q_ptr="*bf16", k_ptr=kv, v_ptr=kv, out_ptr="*bf16",
                                     lse_ptr=F32, blocks_ptr=I32, union_ptr=I32,
                                     k_scale_ptr=F32, v_scale_ptr=F32, **STEP),
                                dict(sm_scale="fp32"), constexprs, options=options)
        if p.find("merge") is not None:
            constexprs, options = _constexprs(p.find("merge"))
            merge = sm90.compile_sm90(_merge_splits_kernel,
                                        dict(part_out_ptr=F32, out_ptr="*bf16", lse_ptr=F32),
                                        {}, constexprs, options=options)
            # a dependent launch waits for its predecessor before reading
            assert ("griddepcontrol.wait" in merge.asm["ptx"]) == constexprs["PDL"]


@pytest.mark.reference
@pytest.mark.parametrize("topk", [16, 1])
def test_page_table_kernel_compiles(topk):
    sm90 = _sm90()
    from openmsa.ops.attention.kernels.page_table import _sparse_page_table_kernel
    sm90.compile_sm90(_sparse_page_table_kernel,
                        dict(idx_ptr=I32, pages_ptr=I32, lens_ptr=I32, **STEP), {},
                        dict(NUM_KV_HEADS=4, NUM_INDEX_HEADS=4, TOPK=topk, KP=topk, BLOCK=128,
                             SUB=16))


# every Gluon tile form the default plan takes (16-bit; fp8 through the loader, alone and in
# pairs), and the config variants the GPU tests run
GLUON_FORMS = [
    ("bf16", (64, 4), {}), ("fp16", (8, 1), {}), ("fp8", (64, 4), {}), ("fp8", (8, 1), {}),
    ("fp8", (32, 8), {}), ("fp8", (64, 4), dict(gluon_pair_fp8=None)),
    ("bf16", (64, 4), dict(gluon_16=dataclasses.replace(DEFAULT.gluon_16, sub=64, stages_k=2,
                                                        stages_v=2))),
    ("fp8", (64, 4), dict(gluon_pair_fp8=dataclasses.replace(DEFAULT.gluon_pair_fp8, sub=64))),
    ("fp8", (16, 1), dict(gluon_pair_fp8=None,
                          gluon_fp8=dataclasses.replace(DEFAULT.gluon_fp8, sub=64, stages_k=3,
                                                        stages_v=2))),
    ("fp8", (64, 4), dict(gluon_pair_fp8=dataclasses.replace(DEFAULT.gluon_pair_fp8,
                                                             stages_k=2, stages_v=1)))]


@pytest.mark.reference
@pytest.mark.parametrize("dtype, heads, changes, topk",
                         [(*form, 16) for form in GLUON_FORMS]
                         + [(*form, 1) for form in GLUON_FORMS[:3]], ids=str)
def test_gluon_tile_kernel_compiles_as_planned(dtype, heads, changes, topk):
    """The Gluon prefill tiles (tile_gluon.py) with the constexprs and options the plan gives
    them: warp specialisation, 4-D TMA boxes (16-bit) or the fp8 loader, both wgmma forms (P
    from registers) lower for sm_90; two programs fit on an SM (one for pairs: 384 threads at
    168 registers), and ptxas spills nothing (the loader a few bytes)."""
    sm90 = _sm90()
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from openmsa.ops.attention.kernels.tile_gluon import _sparse_attention_tile_gluon_kernel as fn
    kv_dtype = dict(bf16=torch.bfloat16, fp16=torch.float16, fp8=FP8)[dtype]
    p = plan(_m3_shape(8192, *heads, kv_dtype=kv_dtype, topk=topk), H200, _config(**changes))
    launch = p.find("tiles_gluon")
    assert launch is not None
    constexprs, options = _constexprs(launch)
    constexprs["num_warps"] = options["num_warps"]  # (a parameter of the kernel too)
    loader, pair = constexprs["FP8"], constexprs["PAIR"]
    ttype = dict(bf16="bf16", fp16="fp16", fp8="fp8e4nv")[dtype]
    gdt = dict(bf16=gl.bfloat16, fp16=gl.float16, fp8=gl.float8e4nv)[dtype]
    q_type = "*fp16" if dtype == "fp16" else "*bf16"
    sub = constexprs["SUB"]
    box = [1, sub, 1, 128]
    layout = gl.NVMMASharedLayout.get_default_for(box, gdt)
    desc = f"tensordesc<{ttype}[1, {sub}, 1, 128],{layout!r}>"
    signature = {n: "constexpr" if n in constexprs else "i32" for n in fn.arg_names}
    src_type = "*fp8e4nv" if loader else desc
    signature.update(q_ptr=q_type, k_src=src_type, v_src=src_type, out_ptr=q_type,
                     lse_ptr=F32, blocks_ptr=I32, union_ptr=I32, k_scale_ptr=F32,
                     v_scale_ptr=F32, sm_scale="fp32", cu_ptr=I32, seq_lens_ptr=I32)
    # what a launch specialises on: 16-byte aligned caches, strides of 16 elements' multiples
    # (the loader's 8-byte loads need it; without it they are byte loads and spill)
    aligned = ("k_src", "v_src", "stride_kp", "stride_kb", "stride_kh", "stride_vp",
               "stride_vb", "stride_vh") if loader else ()
    src = GluonASTSource(fn, signature,
                         {(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                         {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    k = triton.compile(src, target=sm90.target(), options=options)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and ("cp.async.bulk.tensor.4d" in ptx) != loader
    assert "e4m3.e4m3" not in ptx  # every MMA in 16 bits
    # the per-token launch may start once every program has begun
    assert "griddepcontrol.launch_dependents" in ptx
    if pair:  # one program of 384 threads at 168 registers (the file holds 170)
        assert ".maxnreg 168" in ptx and ".reqntid 384" in ptx
        assert k.metadata.shared <= 227 * 1024 - 1024
    else:
        assert ".maxnreg 128" in ptx and ".reqntid 256" in ptx  # 2 x 256 x 128 = the file
        assert k.metadata.shared <= 227 * 1024 // 2 - 1024
    # (the loader's warpgroup at 80 registers leaves the consumer 176, where ptxas keeps 2-3
    # of its scalars on the stack; one more on some shapes. G = 4, 16 tokens per tile, not an
    # M3 shape: 36-40 bytes, the consumer's per-token cut loop being longer)
    sm90.assert_no_spills(ptx, (40 if constexprs["QT"] == 16 else 24) if loader else 0)


B = 16
# decode, 3-token verify, q_len 0, a 20-token prefill chunk (the tile launch), decode in the
# first block, seq_len 0, and 2 padding tokens after cu_seqlens_q[R]
Q_LENS = [1, 3, 0, 20, 1, 0]
SEQ_LENS = [70, 45, 9, 100, 5, 0]


def _to(step, device):
    for name in ("cu_seqlens_q", "seq_lens", "block_table", "slot_mapping"):
        setattr(step, name, getattr(step, name).to(device))
    return step


def _attention_case(device, kv_dtype, layout, hq=8, hkv=2, h=2, d=64, seed=7, block=B):
    g = torch.Generator().manual_seed(seed)
    step = make_step(Q_LENS, SEQ_LENS, block_size=block, extra_columns=2, pad_tokens=2,
                     generator=g)
    qi, ci = random_index_inputs(step, num_heads=h, head_dim=16, block_size=block,
                                 q_dtype=torch.float32, cache_dtype=torch.float32,
                                 generator=torch.Generator().manual_seed(seed + 1))
    idx = ref.select_blocks(qi, ci, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=4,
                            block_size=block)
    k, v = random_kv_cache(step.num_pages, block, hkv, d, dtype=kv_dtype, layout=layout,
                           generator=torch.Generator().manual_seed(seed + 2))
    q = torch.randn(step.num_tokens, hq, d, generator=torch.Generator().manual_seed(seed + 3))
    dstep = _to(make_step(Q_LENS, SEQ_LENS, block_size=block, extra_columns=2, pad_tokens=2,
                          generator=torch.Generator().manual_seed(seed)), device)
    return step, dstep, q, k, v, idx


def _attention_dtype(device):
    # the interpreter's bf16 arithmetic is wrong (support.py), so it runs fp16
    return torch.bfloat16 if device == "cuda" else torch.float16


def _sub_config(sub):
    """Every per-token form with `sub` keys per step."""
    return _config(**{name: dataclasses.replace(getattr(DEFAULT, name), sub=sub) for name in (
        "decode_fp8", "decode_16", "small_fp8", "small_16", "rounds_fp8", "prefill_fp8",
        "prefill_16")})


@pytest.mark.interpret
@pytest.mark.parametrize("kv_dtype, layout", [
    ("q", "flash"), ("q", "vllm"), (FP8, "vllm"), (FP8, "odd"),
    pytest.param(FNUZ, "vllm", marks=ON_FNUZ, id="fnuz-vllm")])
@pytest.mark.parametrize("block, sub", [(B, B), (32, 16)])
def test_sparse_attention_matches_reference(kernel_device, kv_dtype, layout, block, sub):
    """Whole blocks per loop step, and two 16-key steps per 32-token block (a block's causal cut
    then falls in either step). fp8 V in the packed layout is read in byte pairs (V_PAIRS); at
    odd strides and an odd offset, byte by byte."""
    config = _sub_config(sub)
    dtype = _attention_dtype(kernel_device)
    kv_dtype = dtype if kv_dtype == "q" else kv_dtype
    step, dstep, q, k, v, idx = _attention_case(kernel_device, kv_dtype, layout, block=block)
    k_dev, v_dev = to_device(k, kernel_device), to_device(v, kernel_device)
    assert v_dev.stride() == v.stride()
    assert api._reads_as_pairs(v_dev) == (layout != "odd")
    q = q.to(dtype)
    want, want_lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                          step.block_table, block_size=block, return_lse=True)
    out = nan_poison(q.shape, dtype, kernel_device)
    got, lse = openmsa.sparse_attention(
        q.to(kernel_device), k_dev, v_dev, idx.to(kernel_device),
        dstep.cu_seqlens_q, dstep.seq_lens, dstep.block_table, block_size=block, out=out,
        return_lse=True, config=config)
    assert got.data_ptr() == out.data_ptr()
    assert_close(got, want)
    assert_close(lse, want_lse, torch.float32 if dtype == torch.float16 else dtype)
    # without the LSE (not stored at all, STORE_LSE off): the same output bits
    alone = openmsa.sparse_attention(
        q.to(kernel_device), k_dev, v_dev, idx.to(kernel_device), dstep.cu_seqlens_q,
        dstep.seq_lens, dstep.block_table, block_size=block,
        out=nan_poison(q.shape, dtype, kernel_device), config=config)
    assert torch.equal(alone, got)
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    assert (got.cpu()[pos < 0] == 0).all() and torch.isneginf(lse.cpu()[pos < 0]).all()


@pytest.mark.interpret
@pytest.mark.parametrize("splits, fused", [(None, None), (2, False), (3, True)])
def test_sparse_attention_index_head_sharing_scales_and_noisy_rows(kernel_device, splits,
                                                                    fused):
    """One index head serving two KV heads, fp8 with per-tensor scales, and rows holding -1,
    out-of-range and repeated ids; the default plan, then (plans edited by hand) splits merged
    by a second launch, and 3 splits merged by their last program (the fused merge reads their
    LSEs as one row padded to 4)."""
    dtype = _attention_dtype(kernel_device)
    step, dstep, q, k, v, idx = _attention_case(kernel_device, FP8, "flash", hq=4, hkv=2, h=1)
    idx = torch.cat([idx, torch.full_like(idx[..., :1], 99), idx[..., :1]], dim=-1)
    q = q.to(dtype)
    kw = dict(block_size=B, k_scale=0.75, v_scale=1.5, return_lse=True)
    want, want_lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                          step.block_table, **kw)
    ks = torch.tensor([0.75], device=kernel_device)
    qd, kd, vd, idxd = (x.to(kernel_device) for x in (q, k, v, idx))

    def attend(out=None, return_lse=True):
        if splits is None:
            return openmsa.sparse_attention(qd, kd, vd, idxd, dstep.cu_seqlens_q, dstep.seq_lens,
                                            dstep.block_table, block_size=B, k_scale=ks,
                                            v_scale=1.5, return_lse=return_lse, out=out)
        p = _resplit(_plan_of(qd, kd, vd, idxd, block_size=B, return_lse=return_lse,
                              has_scale=True), splits, fused)
        assert p.sizes["splits"] == splits
        return _run_plan(p, qd, kd, vd, idxd, dstep, out=out, return_lse=return_lse,
                         k_scale=ks, v_scale=1.5)

    got, lse = attend()
    assert_close(got, want)
    assert_close(lse, want_lse, torch.float32 if dtype == torch.float16 else dtype)
    # without the LSE (not stored at all, STORE_LSE off): the same output bits
    alone = attend(out=nan_poison(q.shape, dtype, kernel_device), return_lse=False)
    assert torch.equal(alone, got)
    if fused is not False and kernel_device == "cuda":
        # every merging program put its arrival counter back: the next launch starts at 0
        assert all(int(c.count_nonzero()) == 0 for c in COUNTERS.values())


def _tiles_taken(idx, step, block, qt, num_kv_heads, waste):
    """[tiles, Hkv]: 1 where a tile of qt tokens lies in one request, no page of the union holds
    two of the tokens' selected blocks, and the union of their selected pages, times qt, is at
    most waste x the sum of each token's distinct pages."""
    request, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    num_tiles = -(-step.num_tokens // qt)
    taken = torch.zeros(num_tiles, num_kv_heads, dtype=torch.int32)
    for i in range(num_tiles):
        toks = range(i * qt, (i + 1) * qt)
        if toks[-1] >= step.num_tokens or len({int(request[t]) for t in toks}) > 1 \
                or any(int(pos[t]) < 0 for t in toks):
            continue
        for g in range(num_kv_heads):
            h = g * idx.shape[1] // num_kv_heads
            sets = [{int(step.block_table[request[t], b]) for b in idx[t, h].tolist()
                     if 0 <= b <= pos[t] // block and step.block_table[request[t], b] >= 0}
                    for t in toks]
            union = set().union(*sets)
            blocks_of = {}
            for t in toks:
                for b in idx[t, h].tolist():
                    if 0 <= b <= pos[t] // block and step.block_table[request[t], b] >= 0:
                        blocks_of.setdefault(int(step.block_table[request[t], b]), set()).add(b)
            aliased = any(len(x) > 1 for x in blocks_of.values())
            taken[i, g] = not aliased and len(union) * qt <= waste * sum(len(x) for x in sets)
    return taken


def _prefill_tiles_config(rows, waste, sub=None, persistent=False):
    """Every step a prefill step, tiles of `rows` rows, the threshold `waste` for both tile
    kernels."""
    forms = {}
    for name in ("tile_16", "tile_fp8"):
        forms[name] = dataclasses.replace(getattr(DEFAULT, name), rows=rows, waste=waste,
                                          persistent=persistent,
                                          sub=sub or getattr(DEFAULT, name).sub)
    for name in ("gluon_16", "gluon_fp8", "gluon_pair_fp8"):
        forms[name] = dataclasses.replace(getattr(DEFAULT, name), waste=waste)
    return _config(prefill_min_tokens=1, **forms)


@pytest.mark.interpret
@pytest.mark.parametrize("waste, alias", [(0.0, False), (1.5, False), (1e9, False), (1e9, True)])
@pytest.mark.parametrize("kv_dtype, block, sub, hq", [("q", B, B, 8), (FP8, 32, 16, 8),
                                                     ("q", B, B, 6)])
def test_sparse_attention_prefill_tiles_match_reference(kernel_device, kv_dtype, block, sub, hq,
                                                        waste, alias):
    """The prefill path: tiles of 4 tokens over the union of their selections, taken by the tile
    kernel (waste 1e9: every tile inside one request), by neither (0: all left to the per-token
    kernel), or by the device's choice per tile (1.5); tiles straddling requests always go to the
    per-token kernel. Rows hold -1, out-of-range and repeated ids; one index head serves both KV
    heads. The persistent variant runs with 1.5. 6 query heads: 3 per KV head, padded to 4 row
    slots per token (dead rows) and a softmax scale of 0.2; fp8 with dequantisation scales, the
    K one negative. `alias`: a block table mapping two blocks of every request to one page (the
    20-token request's last two); a tile whose tokens selected both goes to the per-token kernel
    (one page, two causal cuts)."""
    config = _prefill_tiles_config(16, waste, sub, persistent=waste == 1.5)
    dtype = _attention_dtype(kernel_device)
    kv_dtype = dtype if kv_dtype == "q" else kv_dtype
    step, dstep, q, k, v, idx = _attention_case(kernel_device, kv_dtype, "vllm", hq=hq, h=1,
                                                block=block)
    idx = torch.cat([idx, torch.full_like(idx[..., :1], 99), idx[..., :1]], dim=-1)
    q = q.to(dtype)
    if alias:
        for st in (step, dstep):
            last = -(-SEQ_LENS[3] // block) - 1  # the 20-token request's own last block
            st.block_table[:, last] = st.block_table[:, last - 1]
    # fp8: a negative K scale (the kernel moves the sign onto q: its row max is taken before
    # scaling) as a device tensor; 6 heads: a softmax scale other than D ** -0.5
    scales = dict(k_scale=-0.75, v_scale=1.5) if kv_dtype == FP8 else {}
    if hq == 6:
        scales["scale"] = 0.2
    want, want_lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                          step.block_table, block_size=block, return_lse=True,
                                          **scales)
    if kv_dtype == FP8:
        scales["k_scale"] = torch.tensor([-0.75], device=kernel_device)
    out = nan_poison(q.shape, dtype, kernel_device)
    k_dev, v_dev = to_device(k, kernel_device), to_device(v, kernel_device)  # the packed views
    qd, idxd = q.to(kernel_device), idx.to(kernel_device)
    got, lse = openmsa.sparse_attention(
        qd, k_dev, v_dev, idxd, dstep.cu_seqlens_q, dstep.seq_lens, dstep.block_table,
        block_size=block, out=out, return_lse=True, config=config, **scales)
    assert_close(got, want)
    assert_close(lse, want_lse, torch.float32 if dtype == torch.float16 else dtype)
    # the tiles the kernel took follow its rule, recomputed here; 27 packed tokens: tiles 1-5
    # lie inside the 20-token request, 0 and 6 straddle requests
    p = _plan_of(qd, k_dev, v_dev, idxd, block_size=block, config=config, return_lse=True,
                 has_scale=kv_dtype == FP8)
    assert p.sizes["tile_tokens"] == 4
    want_taken = _tiles_taken(idx, step, block, qt=4, num_kv_heads=2, waste=waste)
    assert torch.equal((_taken(p, idxd, dstep) >= 0).int().cpu(), want_taken)
    if alias:  # the case shows the rule: some tiles of the 20-token request are left
        assert 0 < int(want_taken[1:6].sum()) < want_taken[1:6].numel()
    else:
        assert want_taken[1:6].all() if waste == 1e9 else not want_taken[[0, 6]].any()


@pytest.mark.interpret
@pytest.mark.parametrize("tiles", [False, True])
def test_sparse_attention_of_one_block_per_row(kernel_device, tiles):
    """topk = 1 (KP = 1 in the kernels): each token's best block alone (often not its own),
    through the per-token kernel, or with every step a prefill step through the tiles over
    their tokens' unions."""
    config = _prefill_tiles_config(16, 1e9) if tiles else DEFAULT
    dtype = _attention_dtype(kernel_device)
    step, dstep, q, k, v, _ = _attention_case(kernel_device, dtype, "flash")
    qi, ci = random_index_inputs(step, num_heads=2, head_dim=16, block_size=B,
                                 q_dtype=torch.float32, cache_dtype=torch.float32,
                                 generator=torch.Generator().manual_seed(3))
    idx = ref.select_blocks(qi, ci, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=1,
                            local_blocks=0, block_size=B)
    q = q.to(dtype)
    want, want_lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                          step.block_table, block_size=B, return_lse=True)
    got, lse = openmsa.sparse_attention(
        q.to(kernel_device), to_device(k, kernel_device), to_device(v, kernel_device),
        idx.to(kernel_device), dstep.cu_seqlens_q, dstep.seq_lens, dstep.block_table,
        block_size=B, return_lse=True, config=config)
    assert_close(got, want)
    assert_close(lse, want_lse, torch.float32 if dtype == torch.float16 else dtype)


@pytest.mark.interpret
def test_sparse_attention_prefill_tiles_cap_at_16_tokens(kernel_device):
    """One query head per KV head (G = 1): 64 rows would make tiles of 64 tokens; they are
    capped at 16 (the plan keeps a bit per token beside 8 flag bits in an int32), and a
    40-token request holds two whole tiles, which the tile kernel takes."""
    config = _prefill_tiles_config(64, 1e9)
    dtype = _attention_dtype(kernel_device)
    q_lens, seq_lens = [40, 2], [150, 40]

    def step_of(seed):
        return make_step(q_lens, seq_lens, block_size=B,
                         generator=torch.Generator().manual_seed(seed))
    step, dstep = step_of(5), _to(step_of(5), kernel_device)
    qi, ci = random_index_inputs(step, num_heads=1, head_dim=16, block_size=B,
                                 q_dtype=torch.float32, cache_dtype=torch.float32,
                                 generator=torch.Generator().manual_seed(6))
    idx = ref.select_blocks(qi, ci, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=4,
                            block_size=B)
    k, v = random_kv_cache(step.num_pages, B, 2, 64, dtype=dtype, layout="flash",
                           generator=torch.Generator().manual_seed(7))
    q = torch.randn(step.num_tokens, 2, 64, generator=torch.Generator().manual_seed(8)).to(dtype)
    want = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens, step.block_table,
                                block_size=B)
    qd, kd, vd, idxd = (q.to(kernel_device), to_device(k, kernel_device),
                        to_device(v, kernel_device), idx.to(kernel_device))
    got = openmsa.sparse_attention(qd, kd, vd, idxd, dstep.cu_seqlens_q, dstep.seq_lens,
                                   dstep.block_table, block_size=B, config=config)
    assert_close(got, want)
    p = _plan_of(qd, kd, vd, idxd, block_size=B, config=config)
    assert p.sizes["tile_tokens"] == 16
    taken = (_taken(p, idxd, dstep) >= 0).cpu()
    assert taken.shape == (3, 2) and taken[:2].all() and not taken[2].any()


def _union_model(idx, step, qt, num_kv_heads, tile, g):
    """The union tile_plan writes for a taken (tile, KV head): pages ascending, their block ids
    and the bits of the tokens that selected them."""
    request, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    h = g * idx.shape[1] // num_kv_heads
    pages = {}
    for k, t in enumerate(range(tile * qt, (tile + 1) * qt)):
        for b in idx[t, h].tolist():
            if 0 <= b <= pos[t] // B and step.block_table[request[t], b] >= 0:
                page = int(step.block_table[request[t], b])
                pages.setdefault(page, [b, 0])[1] |= 1 << k
    order = sorted(pages)
    return (torch.tensor(order, dtype=torch.int32),
            torch.tensor([pages[p][0] for p in order], dtype=torch.int32),
            torch.tensor([pages[p][1] for p in order], dtype=torch.int32))


@pytest.mark.interpret
@pytest.mark.parametrize("qt, topk, alias", [(4, 4, False), (8, 4, True), (16, 3, False),
                                              (8, 16, True)])
def test_tile_plan_unions_and_taken_tiles(kernel_device, qt, topk, alias):
    """The prefill plan (tile.py's _tile_plan_kernel, a sort of the tile's N = QT * KP
    entries) against the rule and the union recomputed here: which tiles it takes, and for
    those the union (pages ascending, their block ids and token bits), on rows with -1,
    out-of-range and repeated ids, shared and scattered pages, tiles straddling requests and,
    with `alias`, a block table mapping two blocks to one page (those tiles are left)."""
    g = torch.Generator().manual_seed(qt + topk)
    q_lens, seq_lens = [3, 40, 1, 29], [300, 40 + 1000, 17, 29 + 60]
    step = make_step(q_lens, seq_lens, block_size=B, generator=g)
    if alias:
        step.block_table[1, 3] = step.block_table[1, 2]
    idx = torch.randint(-2, 12, (step.num_tokens, 2, topk), generator=g, dtype=torch.int32)
    idx[::3, :, :2] = 1  # shared pages, and a repeated id within one token
    idx[5:9] = idx[5:6]  # a run of tokens with one selection
    idx[:, :, -1] = torch.where(idx[:, :, -1] > 5, 10 ** 6, idx[:, :, -1])  # out of range
    kp = triton.next_power_of_2(topk)
    num_tiles = -(-step.num_tokens // qt)
    d = _to(make_step(q_lens, seq_lens, block_size=B, generator=torch.Generator()),
            kernel_device)
    d.block_table = step.block_table.to(kernel_device)
    d.cu_seqlens_q, d.seq_lens = step.cu_seqlens_q.to(kernel_device), step.seq_lens.to(
        kernel_device)
    idx_d = idx.to(kernel_device)
    # (waste 0.45 x qt: the union-size rule decides, over counts without repeated ids)
    for waste in (1e9, 0.45 * qt):
        blocks = torch.full((num_tiles, 2), -7, dtype=torch.int32, device=kernel_device)
        union = torch.full((num_tiles * 2, 3, qt * kp), -7, dtype=torch.int32,
                           device=kernel_device)
        tile_kernels._tile_plan_kernel[(num_tiles, 2)](
            idx_d, d.cu_seqlens_q, d.seq_lens, d.block_table, blocks, union,
            step.seq_lens.shape[0], step.num_tokens, step.block_table.shape[1], step.num_pages,
            *idx_d.stride(), *d.block_table.stride(), waste=waste,
            NUM_KV_HEADS=2, NUM_INDEX_HEADS=2, QT=qt, BLOCK=B, TOPK=topk, KP=kp,
            num_warps=1 if qt * kp <= 64 else 2)
        blocks, union = blocks.cpu(), union.cpu()
        want = _tiles_taken(idx, step, B, qt, 2, waste)
        assert torch.equal((blocks >= 0).int(), want), waste
        assert want.any() and (want == 0).any()
        for item, n in enumerate(blocks.flatten().tolist()):
            if n >= 0:
                pages, ids, bits = _union_model(idx, step, qt, 2, item // 2, item % 2)
                assert n == len(pages)
                assert torch.equal(union[item, 0, :n], pages), item
                assert torch.equal(union[item, 1, :n], ids), item
                assert torch.equal(union[item, 2, :n], bits), item


@pytest.mark.interpret
@pytest.mark.parametrize("sub_page_size", [16, 8])
def test_sparse_page_table_matches_reference(kernel_device, sub_page_size):
    step, dstep, _, _, _, idx = _attention_case(kernel_device, torch.float32, "flash", hq=4,
                                                hkv=4, h=2)
    idx = idx.clone()
    idx[::3, :, 0] = -1
    idx[1::4, :, 1] = idx[1::4, :, 2]
    want = ref.sparse_page_table(idx, step.cu_seqlens_q, step.seq_lens, step.block_table,
                                 num_kv_heads=4, block_size=B, sub_page_size=sub_page_size)
    got = openmsa.sparse_page_table(idx.to(kernel_device), dstep.cu_seqlens_q, dstep.seq_lens,
                                    dstep.block_table, num_kv_heads=4, block_size=B,
                                    sub_page_size=sub_page_size)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.interpret
def test_sparse_attention_long_requests_share_tiles(kernel_device):
    """Several long requests (the tile kernel) whose tokens share tiles with each other and with
    a decode token, one of them starting at position 0."""
    q_lens, seq_lens = [18, 21, 1, 17], [40, 100, 50, 17]
    step = make_step(q_lens, seq_lens, block_size=B, pad_tokens=1)
    qi, ci = random_index_inputs(step, num_heads=1, head_dim=16, block_size=B,
                                 q_dtype=torch.float32, cache_dtype=torch.float32)
    idx = ref.select_blocks(qi, ci, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=3,
                            block_size=B)
    k, v = random_kv_cache(step.num_pages, B, 2, 64, dtype=torch.float16)
    q = torch.randn(step.num_tokens, 4, 64).half()
    want, want_lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                          step.block_table, block_size=B, return_lse=True)
    d = _to(make_step(q_lens, seq_lens, block_size=B, pad_tokens=1), kernel_device)
    got, lse = openmsa.sparse_attention(q.to(kernel_device), k.to(kernel_device),
                                        v.to(kernel_device), idx.to(kernel_device),
                                        d.cu_seqlens_q, d.seq_lens, d.block_table, block_size=B,
                                        return_lse=True)
    assert_close(got, want)
    assert_close(lse, want_lse, torch.float32)


@pytest.mark.interpret
def test_launch_plans_follow_config_and_layouts(kernel_device):
    """The cached launch plans (ops/common/launch.py's PlanCache): a repeated call reuses its
    plan; another config or output layout makes a new one, and every call matches the
    reference."""
    from openmsa.ops.common.launch import PlanCache
    cache = api._PLANS
    api._PLANS = PlanCache("attention")
    try:
        dtype = _attention_dtype(kernel_device)
        step, dstep, q, k, v, idx = _attention_case(kernel_device, dtype, "vllm")
        q = q.to(dtype)
        want = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                    step.block_table, block_size=B)
        dargs = (idx.to(kernel_device), dstep.cu_seqlens_q, dstep.seq_lens, dstep.block_table)
        qd, kd, vd = q.to(kernel_device), to_device(k, kernel_device), to_device(v,
                                                                                 kernel_device)

        def attend(out=None, config=None):
            assert_close(openmsa.sparse_attention(qd, kd, vd, *dargs, block_size=B, out=out,
                                                  config=config), want)
            return len(api._PLANS._plans)

        assert attend() == 1
        assert attend() == 1
        assert attend(config=_config(tiles=False)) == 2
        assert attend(out=torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=dtype,
                                      device=kernel_device).transpose(0, 1)) == 3
        assert attend(config=DEFAULT) == 3  # None and DEFAULT: one plan
    finally:
        api._PLANS = cache


GB = 128


def _m3_attention_case(kv_dtype, num_heads=64, num_kv_heads=4, context=65536, q_lens=(1, 4, 1)):
    seq_lens = [context, context - 1000, 20_000]
    step = make_step(list(q_lens), seq_lens, block_size=GB, extra_columns=1)
    pages = step.num_pages
    g = torch.Generator().manual_seed(0)
    k = torch.randn(pages, GB, num_kv_heads, 128, generator=g).to(kv_dtype)
    v = torch.randn(pages, GB, num_kv_heads, 128, generator=g).to(kv_dtype)
    qi, ci = random_index_inputs(step, num_heads=num_kv_heads, head_dim=128, block_size=GB,
                                 q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    idx = ref.select_blocks(qi, ci, step.cu_seqlens_q, step.seq_lens, step.block_table,
                            block_size=GB)
    q = torch.randn(step.num_tokens, num_heads, 128, generator=g).bfloat16()
    return step, q, k, v, idx


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
# (q heads, KV heads) of an M3 rank at TP1, TP4 and TP8 (a KV head replicated on 2 ranks)
@pytest.mark.parametrize("heads", [(64, 4), (16, 1), (8, 1)])
def test_attention_m3_shapes(kv_dtype, heads):
    step, q, k, v, idx = _m3_attention_case(kv_dtype, *heads)
    want, want_lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                          step.block_table, return_lse=True)
    d = cuda_step(step)
    got, lse = openmsa.sparse_attention(q.cuda(), k.cuda(), v.cuda(), idx.cuda(), d.cu_seqlens_q,
                                        d.seq_lens, d.block_table, return_lse=True)
    assert_close(got, want)
    assert_close(lse, want_lse, torch.bfloat16)
    again = openmsa.sparse_attention(q.cuda(), k.cuda(), v.cuda(), idx.cuda(), d.cu_seqlens_q,
                                     d.seq_lens, d.block_table)
    assert torch.equal(again, got)


def _tile_tokens(kv_dtype, heads, config=DEFAULT):
    """Tokens per prefill tile of an 8K chunk on this GPU: rows // G, twice that for the fp8
    Gluon tiles of two consumers (up to 16 tokens)."""
    from openmsa.ops.attention.plan import AttentionShape
    shape = AttentionShape(num_tokens=8192, num_heads=heads[0], num_kv_heads=heads[1],
                           head_dim=128, num_index_heads=heads[1], topk=16, block_size=GB,
                           q_dtype=torch.bfloat16, kv_dtype=kv_dtype)
    return plan(shape, DeviceFacts.of(torch.device("cuda")), config).sizes["tile_tokens"]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("heads", [(64, 4), (16, 1), (8, 1)])
def test_attention_prefill_tiles_m3(kv_dtype, heads):
    """A 2100-token chunk next to decode rows: every other run of a tile's length shares one
    selection (tiles the union kernel takes), the others keep their own (left to the per-token
    kernel). A tile holds 64 // G tokens: 4 at G = 16, 8 at G = 8 (fp8: twice)."""
    step, q, k, v, idx = _m3_attention_case(kv_dtype, *heads, context=11_000,
                                            q_lens=(3, 2100, 1))
    run = _tile_tokens(kv_dtype, heads)
    # runs aligned with the tiles (packed tokens [i * run, (i + 1) * run)); the chunk's tokens
    # are 3 .. 2102
    first = -(-3 // run) * run
    shared = idx[first:first + (2103 - first) // run * run].view(-1, run, *idx.shape[1:])
    shared[::2] = shared[::2, :1].clone()
    want, want_lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                          step.block_table, return_lse=True)
    d = cuda_step(step)
    qd, kd, vd, idxd = q.cuda(), k.cuda(), v.cuda(), idx.cuda()
    got, lse = openmsa.sparse_attention(qd, kd, vd, idxd, d.cu_seqlens_q, d.seq_lens,
                                        d.block_table, return_lse=True)
    assert_close(got, want)
    assert_close(lse, want_lse, torch.bfloat16)
    p = _plan_of(qd, kd, vd, idxd, block_size=GB, return_lse=True)
    assert p.sizes["tile_tokens"] == run
    taken = _taken(p, idxd, d).cpu() >= 0
    assert taken.any() and not taken.all()
    again = openmsa.sparse_attention(qd, kd, vd, idxd, d.cu_seqlens_q, d.seq_lens,
                                     d.block_table)
    assert torch.equal(again, got)


def _mixed_tiles_chunk(heads, dtype):
    """A prefill step for the tile paths: chunks with and without context beside decode rows,
    partial own blocks whose unwritten K/V tail is NaN, and every other run of a tile's tokens
    sharing one selection (the plan takes those tiles and leaves the rest). Returns the CPU
    step, q (16-bit; heads of different magnitudes), K, V [P, B, Hkv, 128] and the selection."""
    num_heads, num_kv = heads
    q_lens, seq_lens = [3, 1030, 1, 1500], [5000, 1030 + 3000, 900, 1500 + 77]
    step = make_step(q_lens, seq_lens, block_size=GB, extra_columns=1)
    g = torch.Generator().manual_seed(3)
    shape = (step.num_pages, GB, num_kv, 128)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    for r, length in enumerate(seq_lens):  # the unwritten tail of each request's last page
        if length % GB:
            k[int(step.block_table[r, (length - 1) // GB]), length % GB:] = float("nan")
            v[int(step.block_table[r, (length - 1) // GB]), length % GB:] = float("nan")
    qi, ci = random_index_inputs(step, num_heads=num_kv, head_dim=128, block_size=GB,
                                 q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    idx = ref.select_blocks(qi, ci, step.cu_seqlens_q, step.seq_lens, step.block_table,
                            block_size=GB)
    run = _tile_tokens(dtype, heads)
    shared = idx[:idx.shape[0] // run * run].view(-1, run, *idx.shape[1:])
    shared[::2] = shared[::2, :1].clone()
    q_dtype = torch.bfloat16 if dtype == FP8 else dtype
    head_scale = torch.tensor([0.25, 1.0, 3.0]).repeat(num_heads)[:num_heads, None]
    q = (torch.randn(step.num_tokens, num_heads, 128, generator=g) * head_scale).to(q_dtype)
    return step, q, k, v, idx


def _gluon(**forms):
    """DEFAULT with Gluon forms changed: name=dict of GluonForm fields, or None."""
    return _config(**{name: None if changes is None else dataclasses.replace(
        getattr(DEFAULT, name), **changes) for name, changes in forms.items()})


@pytest.mark.gpu
@pytest.mark.parametrize("heads, dtype, layout, config", [
    ((64, 4), torch.bfloat16, "flash", DEFAULT), ((64, 4), torch.bfloat16, "packed", DEFAULT),
    ((8, 1), torch.float16, "packed", DEFAULT), ((16, 1), torch.bfloat16, "flash", DEFAULT),
    ((8, 1), torch.float16, "flash", DEFAULT),
    ((64, 4), FP8, "packed", DEFAULT), ((16, 1), FP8, "flash", DEFAULT),
    ((8, 1), FP8, "packed", DEFAULT), ((32, 8), FP8, "packed", DEFAULT),
    ((64, 4), FP8, "packed", _gluon(gluon_fp8=dict(stages_k=1))),
    ((64, 4), FP8, "packed", _gluon(gluon_pair_fp8=dict(sub=64),
                                    gluon_fp8=dict(sub=64, stages_k=3, stages_v=2))),
    ((16, 1), FP8, "flash", _gluon(gluon_pair_fp8=dict(sub=64), gluon_fp8=dict(sub=64))),
    ((16, 1), FP8, "flash", _gluon(gluon_pair_fp8=None, gluon_fp8=dict(sub=64))),
    ((16, 1), FP8, "packed", _gluon(gluon_fp8=dict(stages_k=1, stages_v=2))),
    ((16, 1), FP8, "flash", _gluon(gluon_pair_fp8=None)),
    ((64, 4), FP8, "packed", _gluon(gluon_pair_fp8=None)),
    ((64, 4), FP8, "packed", _gluon(gluon_pair_fp8=dict(stages_k=2, stages_v=1))),
    ((64, 4), torch.bfloat16, "packed", _gluon(gluon_16=dict(sub=64, stages_k=2,
                                                              stages_v=2)))], ids=str)
def test_attention_prefill_gluon_tiles(heads, dtype, layout, config):
    """The warp-specialised tile kernel (tile_gluon.py) against the reference and the Triton
    tile kernel: chunks with and without context, partial own blocks whose unwritten tail is NaN
    in K and V (copied by TMA or the fp8 loader, never reaching the output), tiles the plan
    takes and leaves, the flash and vLLM packed layouts, per-tensor scales (one negative), a
    strided out=, and the Triton fallback for a base address TMA cannot take. Forms: fp8 tiles
    alone (G = 4, or no pair form) and in pairs, 64-key steps through the loader, other ring
    depths."""
    num_heads, num_kv = heads
    step, q, k, v, idx = _mixed_tiles_chunk(heads, dtype)
    shape, q_dtype = k.shape, q.dtype
    d = cuda_step(step)
    if layout == "packed":  # vLLM's [P, Hkv, B, 2 * D]
        buf = torch.empty(step.num_pages, num_kv, GB, 256, dtype=dtype, device="cuda")
        kd, vd = buf[..., :128].transpose(1, 2), buf[..., 128:].transpose(1, 2)
        kd.copy_(k)
        vd.copy_(v)
    else:
        kd, vd = k.cuda(), v.cuda()
    args = (idx, step.cu_seqlens_q, step.seq_lens, step.block_table)
    dargs = (idx.cuda(), d.cu_seqlens_q, d.seq_lens, d.block_table)
    qd = q.cuda()
    for scales in (dict(), dict(k_scale=-0.5, v_scale=2.0)):
        p = _plan_of(qd, kd, vd, dargs[0], block_size=GB, config=config, return_lse=True,
                     has_scale=bool(scales))
        assert p.find("tiles_gluon") is not None
        assert (_taken(p, dargs[0], d) >= 0).any()  # tiles are taken
        want, want_lse = ref.sparse_attention(q, k, v, *args, return_lse=True, **scales)
        assert not want.isnan().any()
        out = torch.full((num_heads, q.shape[0], 128), 7.0, device="cuda").to(q_dtype)
        got, lse = openmsa.sparse_attention(qd, kd, vd, *dargs, return_lse=True,
                                            out=out.transpose(0, 1), config=config, **scales)
        assert_close(got, want)
        assert_close(lse, want_lse, torch.bfloat16)
        triton_out = openmsa.sparse_attention(qd, kd, vd, *dargs, config=TRITON_TILES, **scales)
        assert_close(got, triton_out)
    # K and V one element past a 16-byte boundary: the Triton tile kernel takes them
    kbuf = torch.empty(kd.numel() + 8, dtype=dtype, device="cuda")[1:1 + kd.numel()]
    vbuf = torch.empty(vd.numel() + 8, dtype=dtype, device="cuda")[1:1 + vd.numel()]
    ks, vs = kbuf.view(shape).copy_(kd), vbuf.view(shape).copy_(vd)
    assert _plan_of(qd, ks, vs, dargs[0], block_size=GB, config=config).find(
        "tiles_gluon") is None
    assert_close(openmsa.sparse_attention(qd, ks, vs, *dargs, config=config),
                 ref.sparse_attention(q, k, v, *args))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_attention_prefill_tiles_overlap_graph_replay(dtype):
    """The per-token launch as a programmatic dependent of the Gluon tiles (WAIT_TILES): the
    same bits as launched after them (a plan edited by hand), eagerly and replayed from a CUDA
    graph with new queries (both kernels are deterministic; overlapping changes only when they
    run)."""
    step, q, k, v, idx = _mixed_tiles_chunk((64, 4), dtype)
    d = cuda_step(step)
    kd, vd, idxd = k.cuda(), v.cuda(), idx.cuda()
    args = (kd, vd, idxd, d.cu_seqlens_q, d.seq_lens, d.block_table)
    qd = q.cuda()
    p = _plan_of(qd, kd, vd, idxd, block_size=GB)
    token = p.find("token")
    assert p.find("tiles_gluon") is not None
    assert token.params["WAIT_TILES"] and token.params["launch_pdl"]
    after = LaunchPlan([launch if launch.kernel != "token" else Launch(
        "token", token.grid, {k: v for k, v in token.params.items()
                              if k not in ("WAIT_TILES", "launch_pdl")}) for launch in p],
        p.sizes)
    want = [_run_plan(after, qd * s, kd, vd, idxd, d) for s in (1.0, 0.5, 2.0)]
    out = torch.full_like(qd, float("nan"))
    openmsa.sparse_attention(qd, *args, out=out)  # eager, on the capturing stream's device
    assert torch.equal(out, want[0])
    q_in = qd.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        openmsa.sparse_attention(q_in, *args, out=out)
    for s, expected in zip((0.5, 2.0, 1.0), (want[1], want[2], want[0])):
        out.fill_(float("nan"))
        q_in.copy_(qd * s)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


@pytest.mark.gpu
def test_attention_prefill_waste_follows_the_kernel_that_runs():
    """The plan's union-size threshold is the Gluon tiles' when they run and the Triton tiles'
    when a base address TMA cannot take sends the tiles there: with the Triton tiles' at 0 and
    the Gluon tiles' at 1e9, the aligned call takes the tiles whose tokens share a selection
    and the misaligned one takes none; both match the reference."""
    config = _config(tile_16=dataclasses.replace(DEFAULT.tile_16, waste=0.0),
                     tile_fp8=dataclasses.replace(DEFAULT.tile_fp8, waste=0.0),
                     **{name: dataclasses.replace(getattr(DEFAULT, name), waste=1e9)
                        for name in ("gluon_16", "gluon_fp8", "gluon_pair_fp8")})
    step, q, k, v, idx = _mixed_tiles_chunk((64, 4), torch.bfloat16)
    d = cuda_step(step)
    dargs = (idx.cuda(), d.cu_seqlens_q, d.seq_lens, d.block_table)
    want = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens, step.block_table)
    qd, kd, vd = q.cuda(), k.cuda(), v.cuda()
    assert_close(openmsa.sparse_attention(qd, kd, vd, *dargs, config=config), want)
    assert (_taken(_plan_of(qd, kd, vd, dargs[0], block_size=GB, config=config), dargs[0],
                   d) >= 0).any()
    # K and V one element past a 16-byte boundary: the Triton tiles' threshold
    kbuf = torch.empty(k.numel() + 8, dtype=k.dtype, device="cuda")[1:1 + k.numel()]
    vbuf = torch.empty(v.numel() + 8, dtype=v.dtype, device="cuda")[1:1 + v.numel()]
    ks, vs = kbuf.view(k.shape).copy_(k), vbuf.view(v.shape).copy_(v)
    assert_close(openmsa.sparse_attention(qd, ks, vs, *dargs, config=config), want)
    assert not (_taken(_plan_of(qd, ks, vs, dargs[0], block_size=GB, config=config), dargs[0],
                       d) >= 0).any()


@pytest.mark.gpu
def test_attention_prefill_equals_dense_sdpa():
    """topk covering every block: sparse attention is dense causal attention."""
    from openmsa.dense import dense_paged_attention
    ctx, chunk = 1500, 500
    step = make_step([chunk], [ctx + chunk], block_size=GB)
    d = cuda_step(step)
    g = torch.Generator(device="cuda").manual_seed(1)
    k = torch.randn(step.num_pages, GB, 2, 128, generator=g, device="cuda").bfloat16()
    v = torch.randn(step.num_pages, GB, 2, 128, generator=g, device="cuda").bfloat16()
    q = torch.randn(chunk, 32, 128, generator=g, device="cuda").bfloat16()
    qi = torch.randn(chunk, 2, 128, device="cuda").bfloat16()
    ci = torch.randn(step.num_pages, GB, 128, device="cuda").bfloat16()
    idx = openmsa.select_blocks(qi, ci, d.cu_seqlens_q, d.seq_lens, d.block_table, topk=32,
                                block_size=GB)
    got = openmsa.sparse_attention(q, k, v, idx, d.cu_seqlens_q, d.seq_lens, d.block_table)
    want = dense_paged_attention(q, k, v, d.cu_seqlens_q, d.seq_lens, d.block_table,
                                 block_size=GB, dtype=torch.float32)
    assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
def test_attention_cache_over_2_31_elements_and_graph_replay(kv_dtype):
    """fp8: V read in byte pairs, whose offsets are halved byte offsets past 2^31."""
    pages = (1 << 31) // (GB * 128) + 64  # one KV head: past 2^31 elements per cache
    packed = torch.empty(pages, 1, GB, 256, dtype=kv_dtype, device="cuda")
    k, v = packed[..., :128].permute(0, 2, 1, 3), packed[..., 128:].permute(0, 2, 1, 3)
    num_req = 4
    step = make_step([1] * num_req, [5000, 3000, 129, 2000], block_size=GB)
    step.block_table = torch.where(step.block_table >= 0, step.block_table + pages - 150, -1)
    packed[-150:] = torch.randn(150, 1, GB, 256, device="cuda").to(kv_dtype)
    d = cuda_step(step)
    q = torch.randn(num_req, 16, 128, device="cuda").bfloat16()
    idx = torch.randint(0, 40, (num_req, 1, 16), device="cuda").int()
    out = torch.empty_like(q)
    run = lambda: openmsa.sparse_attention(q, k, v, idx, d.cu_seqlens_q, d.seq_lens,  # noqa
                                           d.block_table, out=out)
    run()
    small_k, table = compact_pages(k, step)
    small_v, _ = compact_pages(v, step)
    want = ref.sparse_attention(q.cpu(), small_k, small_v, idx.cpu(), step.cu_seqlens_q,
                                step.seq_lens, table)
    assert_close(out, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    q.copy_(torch.randn_like(q))
    d.seq_lens.copy_(torch.tensor([4000, 100, 200, 700], dtype=torch.int32))
    graph.replay()
    eager = openmsa.sparse_attention(q, k, v, idx, d.cu_seqlens_q, d.seq_lens, d.block_table)
    assert torch.equal(out, eager)


@pytest.mark.gpu
def test_attention_fused_merge_graph_replay_and_two_streams():
    """A step whose splits the last program merges (arrival counters): eager against the
    reference, a captured graph replayed with new queries and lengths, and two launches running
    at once on two streams (each stream has its own counters) equal to their eager results."""
    num_req = 64
    step = make_step([1] * num_req, [3000 + 37 * i for i in range(num_req)], block_size=GB)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(step.num_pages, GB, 1, 128, generator=g).bfloat16()
    v = torch.randn(step.num_pages, GB, 1, 128, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(24, generator=g)[:16] for _ in range(num_req)])[:, None]
    idx = idx.int().sort(-1).values
    q = torch.randn(num_req, 16, 128, generator=g).bfloat16()
    want = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens, step.block_table)
    d = cuda_step(step)
    qc, kc, vc, ic = q.cuda(), k.cuda(), v.cuda(), idx.cuda()
    p = _plan_of(qc, kc, vc, ic, block_size=GB)
    # the path under test
    assert 1 < p.sizes["splits"] <= DEFAULT.split.fused_max and p.sizes["fused"]
    out = torch.empty_like(qc)
    run = lambda: openmsa.sparse_attention(qc, kc, vc, ic, d.cu_seqlens_q, d.seq_lens,  # noqa
                                           d.block_table, out=out)
    run()
    assert_close(out, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for trial in range(3):
        qc.copy_(torch.randn_like(qc))
        d.seq_lens.copy_(torch.randint(2000, 3000, (num_req,), dtype=torch.int32))
        graph.replay()
        eager = openmsa.sparse_attention(qc, kc, vc, ic, d.cu_seqlens_q, d.seq_lens,
                                         d.block_table)
        assert torch.equal(out, eager), trial
    # two streams at once: no shared counter between them
    q2 = torch.randn_like(qc)
    want1 = openmsa.sparse_attention(qc, kc, vc, ic, d.cu_seqlens_q, d.seq_lens, d.block_table)
    want2 = openmsa.sparse_attention(q2, kc, vc, ic, d.cu_seqlens_q, d.seq_lens, d.block_table)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(20):
        with torch.cuda.stream(s1):
            a = openmsa.sparse_attention(qc, kc, vc, ic, d.cu_seqlens_q, d.seq_lens,
                                         d.block_table)
        with torch.cuda.stream(s2):
            b = openmsa.sparse_attention(q2, kc, vc, ic, d.cu_seqlens_q, d.seq_lens,
                                         d.block_table)
        outs.append((a, b))
    torch.cuda.synchronize()
    for a, b in outs:
        assert torch.equal(a, want1) and torch.equal(b, want2)
    assert all(int(c.count_nonzero()) == 0 for c in COUNTERS.values())


@triton.jit
def _late_copy_kernel(src_ptr, dst_ptr, n, spin, BLOCK: tl.constexpr):
    """dst = src, written only after a long spin, by a kernel that lets its programmatic
    dependents start at once: a dependent that read dst before its gdc_wait would see the old
    values."""
    gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n, other=0)
    acc = tl.program_id(0).to(tl.float32)
    for _ in range(spin):
        acc = acc * 0.5 + 1.0  # stays in [0, 2]: the select below never fires
    x = tl.where(acc < -1.0, 0, x)
    tl.store(dst_ptr + offs, x, mask=offs < n)


def _late_copy(src, dst, spin=200000):
    """Copy src into dst (same dtype and shape, contiguous) with _late_copy_kernel: ~0.1-0.5 ms
    of spinning before the store."""
    s, d = src.view(torch.int16).view(-1), dst.view(torch.int16).view(-1)
    _late_copy_kernel[(triton.cdiv(s.numel(), 1024),)](s, d, s.numel(), spin, BLOCK=1024)


@pytest.mark.gpu
def test_first_launch_waits_for_the_kernel_before_on_gpu():
    """A decode step's launch is a programmatic dependent of whatever kernel precedes it. Here
    that kernel lets dependents start at once and writes the queries only after a long spin, so
    a launch that read them before its gdc_wait would use the old queries: eager and replayed
    in a CUDA graph (new queries each time), the outputs equal the reference's for the new
    queries. The plan is checked to take the path under test."""
    num_req = 8
    step = make_step([1, 2, 1, 4, 1, 3, 1, 1], [3000 + 517 * i for i in range(num_req)],
                     block_size=GB)
    d = cuda_step(step)
    args = (d.cu_seqlens_q, d.seq_lens, d.block_table)
    g = torch.Generator().manual_seed(11)
    k, v = random_kv_cache(step.num_pages, GB, 4, 128, dtype=torch.bfloat16, generator=g)
    kc, vc = k.cuda(), v.cuda()
    idx = torch.stack([torch.randperm(20, generator=g)[:16] for _ in range(4)])
    idx = idx.int().sort(-1).values[None].expand(step.num_tokens, 4, 16).contiguous()
    ic = idx.cuda()
    out = torch.empty(step.num_tokens, 64, 128, dtype=torch.bfloat16, device="cuda")
    token = _plan_of(out, kc, vc, ic, block_size=GB).find("token")
    assert token.params.get("WAIT_PRIOR") and token.params.get("launch_pdl")

    def new_q():
        return torch.randn(step.num_tokens, 64, 128, generator=g).bfloat16()

    def call(qd):
        openmsa.sparse_attention(qd, kc, vc, ic, *args, out=out)

    def check(qq):
        want = ref.sparse_attention(qq, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                    step.block_table)
        assert_close(out.cpu(), want)
    qd = new_q().cuda()
    src = torch.empty_like(qd)
    call(qd)  # compile outside the timed chain
    for trial in range(2):
        qq = new_q()
        src.copy_(qq)
        _late_copy(src, qd)
        call(qd)
        check(qq)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _late_copy(src, qd)
        call(qd)
    for trial in range(3):
        qq = new_q()
        src.copy_(qq)
        graph.replay()
        check(qq)
