# SPDX-License-Identifier: Apache-2.0
"""Registers, spills and shared memory of the attention kernel for sm_90, on any machine (no GPU):
Triton compiles to PTX, Triton's bundled ptxas assembles it. The signature mirrors a runtime
launch on M3's packed fp8/bf16 cache (unit strides specialised as 1, the others divisible by 16),
so the counts match what Nsight Compute reports on the H200 (255 registers / 73.7 KB for fp8 with
whole 128-key blocks and 3 stages, 185 / 139 KB for bf16). Count before you measure:

    python3 benchmarks/resources.py fp8,64,3,4 bf16,64,3,4     # kv dtype, sub, stages, warps

Programs per SM = min(65536 // (regs rounded up to 8 * 32 * warps), 228 KB // (smem + 1 KB)).
"""

import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from openmsa.ops.attention.decode import _sparse_attention_kernel

UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_vd", "stride_ik", "stride_btb", "stride_od",
                "stride_lh"}
KV_TYPES = {"fp8": "*fp8e4nv", "bf16": "*bf16"}


def attention_resources(kv: str, sub: int, stages: int, warps: int, splits: int = 2):
    fn = _sparse_attention_kernel
    kv_type = KV_TYPES[kv]
    pointers = dict(q_ptr="*bf16", k_ptr=kv_type, v_ptr=kv_type, idx_ptr="*i32",
                    out_ptr="*bf16", lse_ptr="*fp32", part_out_ptr="*fp32",
                    part_lse_ptr="*fp32", counter_ptr="*i32", k_scale_ptr="*fp32",
                    v_scale_ptr="*fp32",
                    cu_ptr="*i32", seq_lens_ptr="*i32", bt_ptr="*i32")
    constexprs = dict(NUM_HEADS=64, NUM_KV_HEADS=4, NUM_INDEX_HEADS=4, G=16, M=16, D=128,
                      BLOCK=128, TOPK=16, KP=16, SUB=sub, STEPS=16 * 128 // sub // splits,
                      SPLITS=splits, HAS_SCALE=False, IEEE=False, F16_COMPUTE=kv == "fp8",
                      FUSED_MERGE=True)
    constexprs.update({name: 1 for name in UNIT_STRIDES})
    signature = {name: "constexpr" if name in constexprs
                 else pointers.get(name, "fp32" if name == "sm_scale" else "i32")
                 for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in constexprs and (name in pointers or name.startswith("stride"))}
    src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.o")],
                              capture_output=True, text=True, check=True).stderr
    regs = int(info.split("Used ")[1].split(" registers")[0])
    spills = info.split("bytes spill stores")[0].rsplit(",", 1)[-1].strip()
    smem = compiled.metadata.shared
    per_sm = min(65536 // (-(-regs // 8) * 8 * 32 * warps), 233472 // (smem + 1024))
    return regs, int(spills), smem, per_sm


if __name__ == "__main__":
    print("kv    sub stages warps  registers spill_bytes smem_KB programs/SM")
    for arg in sys.argv[1:] or ["fp8,128,3,4", "fp8,64,3,4", "bf16,128,3,4", "bf16,64,3,4"]:
        kv, sub, stages, warps = arg.split(",")
        regs, spills, smem, per_sm = attention_resources(kv, int(sub), int(stages), int(warps))
        print(f"{kv:5s} {sub:>3s} {stages:>6s} {warps:>5s}  {regs:9d} {spills:11d} "
              f"{smem / 1024:7.1f} {per_sm:12d}", flush=True)
