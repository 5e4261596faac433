# SPDX-License-Identifier: Apache-2.0
"""Every Triton launch the plans pick on an AMD Instinct GPU, compiled for gfx942 (MI300X/MI325X)
and gfx950 (MI355X) by Triton's AMD backend on a machine without a GPU, with the constexprs and
options the plan gives it: the attention (per-token kernel, tile plan, Triton tiles, merge), the
indexer (decode and prefill scoring, every selection form) and the cache writes and preparation,
at decode, verify and prefill steps (helpers/rocm.py), 16-bit and fp8 caches. Each compiled
kernel must be an AMDGPU code object with no NVIDIA-only instruction in it; its registers and
LDS bytes are printed (pytest -s) and checked against the CU's limits.

fp8 pointers are typed for each target's fp8: e4m3fnuz ("fp8e4b8") on gfx942, OCP e4m3
("fp8e4nv") on gfx950. This is a build test only: nothing here has run on AMD hardware.
Not under the interpreter."""

import os

import pytest
import torch

from openmsa.ops.cache.plan import IndexWriteShape, KVWriteShape, PrepareShape, plan as cplan
from helpers.rocm import DEVICES, FP8_OF, plans

pytestmark = [pytest.mark.reference,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1",
                                 reason="compilation needs the real compiler")]

ARCHS = ("gfx942", "gfx950")
FP8_TYPE = {"gfx942": "*fp8e4b8", "gfx950": "*fp8e4nv"}
OPTIONS = ("num_warps", "num_stages")
# LDS per workgroup: 64 KiB on gfx942, 160 KiB on gfx950; 512 VGPRs (with AGPRs) per lane
LDS = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
I32, I64, F32 = "*i32", "*i64", "*fp32"


def _kernels():
    from openmsa.ops.attention.kernels.token import _merge_splits_kernel, _sparse_attention_kernel
    from openmsa.ops.attention.kernels.page_table import _sparse_page_table_kernel
    from openmsa.ops.attention.kernels.tile import _sparse_attention_tile_kernel, _tile_plan_kernel
    from openmsa.ops.cache.kernels.prepare import _fused_prepare_kernel
    from openmsa.ops.cache.kernels.write import _write_index_cache_kernel, _write_kv_cache_kernel
    from openmsa.ops.indexer.kernels.scores import _block_scores_kernel
    from openmsa.ops.indexer.kernels.select import (_group_bound_select_kernel,
                                                    _group_max_kernel, _merge_topk_kernel,
                                                    _segment_topk_kernel)
    return {"token": _sparse_attention_kernel, "merge": _merge_splits_kernel,
            "tile_plan": _tile_plan_kernel, "tiles": _sparse_attention_tile_kernel,
            "page_table": _sparse_page_table_kernel,
            "scores_decode": _block_scores_kernel, "scores_prefill": _block_scores_kernel,
            "scores_prefill_unaligned": _block_scores_kernel,
            "select_segments": _segment_topk_kernel, "select_merge": _merge_topk_kernel,
            "select_group_max": _group_max_kernel,
            "select_group_bound": _group_bound_select_kernel,
            "write_index_cache": _write_index_cache_kernel,
            "write_kv_cache": _write_kv_cache_kernel, "fused_prepare": _fused_prepare_kernel}


def _pointer_types(kernel: str, arch: str, q: str, kv: str) -> dict:
    """Element types of a kernel's pointers: q / K/V (or index q / index cache) as given, the
    int64 slots and candidates, fp32 scores, partials and scales; int32 otherwise."""
    types = dict(q_ptr=q, k_ptr=kv, v_ptr=kv, cache_ptr=kv, out_ptr=I32, lse_ptr=F32,
                 part_out_ptr=F32, k_scale_ptr=F32, v_scale_ptr=F32, scores_ptr=F32,
                 gmax_ptr=F32, cand_ptr=I64, scratch_ptr=I64, slot_ptr=I64, index_slot_ptr=I64,
                 table_ptr=F32)
    if kernel in ("token", "tiles", "merge"):
        types["out_ptr"] = "*bf16"
    if kernel.startswith("scores"):
        types["out_ptr"] = F32
    return types


def compile_rocm(fn, arch, pointers, scalars, constexprs, options):
    """Compile `fn` for `arch` (wave64) as compile_sm90 does for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default},
                  **constexprs}
    signature = {name: "constexpr" if name in constexprs
                 else pointers.get(name, I32) if name.endswith("_ptr")
                 else scalars.get(name, "i32") for name in fn.arg_names}
    index = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=index)
    return triton.compile(src, target=GPUTarget("hip", arch, 64), options=options or None)


def resources(k) -> dict:
    """What the AMD compiler reports of a compiled kernel: VGPRs (with AGPRs), SGPRs, VGPR
    spills, waves per SIMD (occupancy) and LDS bytes."""
    import re
    amdgcn = k.asm["amdgcn"]

    def field(pattern):
        m = re.search(pattern, amdgcn)
        return int(m.group(1)) if m else None
    return dict(vgprs=field(r"\.vgpr_count:\s+(\d+)"), sgprs=field(r"\.sgpr_count:\s+(\d+)"),
                spills=field(r"\.vgpr_spill_count:\s+(\d+)"),
                occupancy=field(r"; Occupancy: (\d+)"), lds=k.metadata.shared)


def _check(k, arch, what):
    assert k.asm.get("hsaco"), what
    amdgcn = k.asm["amdgcn"]
    assert "griddepcontrol" not in amdgcn and "cvt.rn.f16x2" not in amdgcn, what
    r = resources(k)
    print(f"{arch} {what}: warps {k.metadata.num_warps}, " +
          ", ".join(f"{name} {value}" for name, value in r.items()))
    assert r["lds"] <= LDS[arch], (what, r)
    assert r["vgprs"] is not None and r["vgprs"] <= 512, (what, r)


def _compile_launch(launch, arch, q, kv, what):
    kernels = _kernels()
    params = dict(launch.params)
    options = {k: params.pop(k) for k in OPTIONS if k in params}
    assert not params.pop("launch_pdl", False), what  # (CUDA only; tests/plans/test_rocm_plan.py)
    scalars = dict(sm_scale="fp32", eps="fp32")
    if launch.kernel == "tile_plan":
        del params["waste"]
        scalars["waste"] = "fp32"
    if launch.kernel.startswith("scores"):
        params.pop("table_width", None)
    k = compile_rocm(kernels[launch.kernel], arch, _pointer_types(launch.kernel, arch, q, kv),
                     scalars, params, options)
    _check(k, arch, f"{what} {launch.kernel}")
    return k


def _cases():
    out = []
    for arch in ARCHS:
        for label, op, p in plans(DEVICES[arch]):
            out.append(pytest.param(arch, label, op, p, id=f"{arch}-{op}-{label}"))
    return out


@pytest.mark.parametrize("arch, label, op, p", _cases())
def test_planned_launches_compile_for_rocm(arch, label, op, p):
    fp8 = FP8_TYPE[arch]
    if op == "attention":
        kv = fp8 if "-fp8-" in label else "*bf16"
        q = "*bf16"
    else:
        q = "*bf16" if "-bf16" in label else fp8
        kv = fp8 if "fp8" in label.split("-")[-1] or "-fp8-" in label else "*bf16"
    assert len(p) > 0
    for launch in p:
        if launch.kernel in ("select_group_max", "select_group_bound", "select_segments",
                             "select_merge") and not label.startswith(("decode-b1-", "prefill-8k")):
            continue  # the selection's forms are covered by one decode and one prefill step
        _compile_launch(launch, arch, q, kv, label)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fp8", [False, True])
def test_cache_launches_compile_for_rocm(arch, fp8):
    kv = FP8_TYPE[arch] if fp8 else "*bf16"
    dtype = FP8_OF[DEVICES[arch]] if fp8 else torch.bfloat16
    shapes = [IndexWriteShape(8, 128, 128, dtype), KVWriteShape(8, 4, 128, 128, dtype, fp8),
              PrepareShape(8, 64, 4, 4, 128, 128, 64, 128, 128, dtype, dtype, dtype, fp8)]
    for shape in shapes:
        for launch in cplan(shape, DEVICES[arch]):
            pointers = dict(src_ptr="*bf16", cache_ptr=kv, k_ptr="*bf16", v_ptr="*bf16",
                            k_cache_ptr=kv, v_cache_ptr=kv, slot_ptr=I64, k_scale_ptr=F32,
                            v_scale_ptr=F32, qkv_ptr="*bf16", pos_ptr=I32, qw_ptr="*bf16",
                            kw_ptr="*bf16", iqw_ptr="*bf16", ikw_ptr="*bf16", table_ptr=F32,
                            index_cache_ptr=kv, index_slot_ptr=I64, q_out_ptr="*bf16",
                            iq_out_ptr=kv)
            params = dict(launch.params)
            options = {k: params.pop(k) for k in OPTIONS if k in params}
            k = compile_rocm(_kernels()[launch.kernel], arch, pointers, dict(eps="fp32"), params,
                             options)
            _check(k, arch, f"{'fp8' if fp8 else 'bf16'} {launch.kernel}")


@pytest.mark.parametrize("arch", ARCHS)
def test_page_table_kernel_compiles_for_rocm(arch):
    from openmsa.ops.attention.kernels.page_table import _sparse_page_table_kernel
    k = compile_rocm(_sparse_page_table_kernel, arch, {}, {},
                     dict(NUM_KV_HEADS=4, NUM_INDEX_HEADS=4, TOPK=16, KP=16, BLOCK=128, SUB=16),
                     None)
    _check(k, arch, "page_table")
