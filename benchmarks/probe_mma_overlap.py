# SPDX-License-Identifier: Apache-2.0
"""A question for the GPU, not a kernel of the library: can the indexer's prefill scoring loop go
faster if block b + 1's matrix multiply runs while block b's maxima are taken?

The prefill tile launch (ops/indexer/scores.py) is latency-bound (Nsight Compute: 0.48 eligible
warps per scheduler, docs/performance.md): per 128-key block it waits for the warpgroup MMA
(`S = q K^T`, 128 rows x 128 keys), then reduces S to each row's max, then starts the next MMA.
Triton 3.6 always waits for a dot right after issuing it, also when the result is only used in
the next iteration (checked offline). Gluon (triton.experimental.gluon) states the wait
explicitly, so this file times, on synthetic contiguous fp8 keys, at the 8K-chunk-after-120K
scale (32768 rows = 8192 tokens x 4 heads, 1024 blocks of 128 keys, head dim 128):

  * `triton`: the Triton loop as the library writes it (dot, max, store; pipelined key loads);
  * `gluon`: TMA copies of the keys into a ring of STAGES buffers (one mbarrier each), q in
    shared memory, two accumulators on 8 warps: issue block b + 1's MMA, wait for block b's
    (`warpgroup_mma_wait(num_outstanding=1)`), take its maxima while b + 1 runs, refill the
    freed buffer.

Both write the [rows, blocks] block maxima (fp32, as the scores tensor). Prints each one's
median time and TFLOP/s (2 * rows * blocks * 128 * 128 flops) and checks both against torch on
a slice of rows. CUDA only:   python3 benchmarks/probe_mma_overlap.py [--stages 2,3,4]
Offline (no GPU), compile both for sm_90 and count the MMA waits:   ... --offline
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

ROWS, BLOCKS, KB, D, BPS = 8192 * 4, 1024, 128, 128, 32


@triton.jit
def _triton_block_max(q_ptr, k_ptr, out_ptr, num_blocks, M: tl.constexpr, KB: tl.constexpr,
                      D: tl.constexpr, BPS: tl.constexpr):
    pid_m = tl.program_id(0)
    b_lo = tl.program_id(1) * BPS
    b_hi = tl.minimum(b_lo + BPS, num_blocks)
    rows = pid_m * M + tl.arange(0, M)
    d = tl.arange(0, D)
    keys = tl.arange(0, KB)
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * D + d[None, :])
    out_row = out_ptr + rows.to(tl.int64) * num_blocks
    for b in range(b_lo, b_hi):
        k = tl.load(k_ptr + (b * KB + keys).to(tl.int64)[:, None] * D + d[None, :])
        s = tl.dot(q, tl.trans(k))
        tl.store(out_row + b, tl.max(s, axis=1))


@gluon.jit
def _gluon_step(prev, j, n, b_lo, q_smem, k_smem, bars, k_desc, out_row, zero,
                STAGES: gl.constexpr):
    """Issue block j's MMA, then finish block j - 1 (`prev`) while it runs: wait until only
    block j's MMA is in flight, store block j - 1's row maxima, and refill its buffer with block
    j - 1 + STAGES. Returns block j's MMA (in flight)."""
    KB: gl.constexpr = k_desc.block_type.shape[0]
    s = j % STAGES
    mbarrier.wait(bars.index(s), (j // STAGES) & 1)
    cur = warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)), zero, use_acc=False,
                        is_async=True)
    done = warpgroup_mma_wait(num_outstanding=1, deps=(prev, ))
    gl.store(out_row + b_lo + j - 1, gl.max(done, axis=1))
    nxt = j - 1 + STAGES
    t = (j - 1) % STAGES
    mbarrier.expect(bars.index(t), k_desc.block_type.nbytes, pred=nxt < n)
    tma.async_copy_global_to_shared(k_desc, [(b_lo + nxt) * KB, 0], bars.index(t),
                                    k_smem.index(t), pred=nxt < n)
    return cur


@gluon.jit
def _gluon_block_max(q_desc, k_desc, out_ptr, num_blocks, BPS: gl.constexpr,
                     STAGES: gl.constexpr, num_warps: gl.constexpr):
    M: gl.constexpr = q_desc.block_type.shape[0]
    KB: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    pid_m = gl.program_id(0)
    b_lo = gl.program_id(1) * BPS
    n = gl.minimum(b_lo + BPS, num_blocks) - b_lo
    # warps along the rows: each warp's 16 rows hold whole key rows, so a row's max needs no
    # other warp (8 warps: 64 fp32 registers per accumulator, two of them in flight)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, KB, 32])
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, KB, D], k_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.init(q_bar, count=1)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [pid_m * M, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):  # every buffer gets a block before the loop
        mbarrier.expect(bars.index(i), k_desc.block_type.nbytes, pred=i < n)
        tma.async_copy_global_to_shared(k_desc, [(b_lo + i) * KB, 0], bars.index(i),
                                        k_smem.index(i), pred=i < n)
    mbarrier.wait(q_bar, 0)
    rows = pid_m * M + gl.arange(0, M, layout=gl.SliceLayout(1, mma))
    out_row = out_ptr + rows.to(gl.int64) * num_blocks
    zero = gl.zeros([M, KB], gl.float32, layout=mma)
    if n > 0:
        mbarrier.wait(bars.index(0), 0)
        prev = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero, use_acc=False,
                             is_async=True)
        # two blocks per iteration: the accumulator carried to the next iteration is always the
        # second one issued, whose registers can be those of the one finished before it; with
        # one block per iteration the carried accumulator had to be copied while its MMA ran,
        # and ptxas then serialises every MMA (C7514)
        for j in range(1, n - 1, 2):
            mid = _gluon_step(prev, j, n, b_lo, q_smem, k_smem, bars, k_desc, out_row, zero,
                              STAGES)
            prev = _gluon_step(mid, j + 1, n, b_lo, q_smem, k_smem, bars, k_desc, out_row,
                               zero, STAGES)
        # the last block, one left after the pairs or none; each branch finishes its own
        # accumulator (merging two in-flight accumulators after the if would copy one, which
        # serialises the MMAs just the same)
        if n % 2 == 0:
            last = _gluon_step(prev, n - 1, n, b_lo, q_smem, k_smem, bars, k_desc, out_row,
                               zero, STAGES)
            done = warpgroup_mma_wait(num_outstanding=0, deps=(last, ))
            gl.store(out_row + b_lo + n - 1, gl.max(done, axis=1))
        else:
            done = warpgroup_mma_wait(num_outstanding=0, deps=(prev, ))
            gl.store(out_row + b_lo + n - 1, gl.max(done, axis=1))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(q_bar)


@gluon.jit
def _ws_consumer(q_smem, k_smem, ready, empty, out_ptr, part, row0, b_lo, n, num_rows,
                 STAGES: gl.constexpr):
    WR: gl.constexpr = q_smem.shape[1]
    KB: gl.constexpr = k_smem.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, KB, 32])
    q_i = q_smem.index(part)
    zero = gl.zeros([WR, KB], gl.float32, layout=mma)
    rows = row0 + part * WR + gl.arange(0, WR, layout=gl.SliceLayout(1, mma))
    # scores block-major: [blocks, rows], one coalesced row of WR floats per block
    out = out_ptr + rows
    for j in range(n):
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        acc = warpgroup_mma(q_i, k_smem.index(s).permute((1, 0)), zero, use_acc=False,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index(s), count=1)
        gl.store(out + (b_lo + j).to(gl.int64) * num_rows, gl.max(acc, axis=1))


@gluon.jit
def _ws_producer(k_desc, k_smem, ready, empty, b_lo, n, STAGES: gl.constexpr):
    KB: gl.constexpr = k_desc.block_type.shape[0]
    for j in range(n):
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1, pred=j >= STAGES)
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [(b_lo + j) * KB, 0], ready.index(s),
                                        k_smem.index(s))


@gluon.jit
def _ws_block_max(q_desc, k_desc, out_ptr, num_blocks, num_rows, BPS: gl.constexpr,
                  STAGES: gl.constexpr, NPART: gl.constexpr, CONS_REGS: gl.constexpr,
                  num_warps: gl.constexpr):
    WR: gl.constexpr = q_desc.block_type.shape[0]
    KB: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    pid_m = gl.program_id(0)
    b_lo = gl.program_id(1) * BPS
    n = gl.minimum(b_lo + BPS, num_blocks) - b_lo
    row0 = pid_m * (WR * NPART)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NPART, WR, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, KB, D], k_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NPART)
    mbarrier.init(q_bar, count=1)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes * NPART)
    for p in gl.static_range(NPART):
        tma.async_copy_global_to_shared(q_desc, [row0 + p * WR, 0], q_bar, q_smem.index(p))
    mbarrier.wait(q_bar, 0)
    gl.warp_specialize([
        (_ws_consumer, (q_smem, k_smem, ready, empty, out_ptr, 0, row0, b_lo, n, num_rows,
                        STAGES)),
        (_ws_consumer, (q_smem, k_smem, ready, empty, out_ptr, 1, row0, b_lo, n, num_rows,
                        STAGES)),
        (_ws_consumer, (q_smem, k_smem, ready, empty, out_ptr, 2, row0, b_lo, n, num_rows,
                        STAGES)),
        (_ws_consumer, (q_smem, k_smem, ready, empty, out_ptr, 3, row0, b_lo, n, num_rows,
                        STAGES)),
        (_ws_producer, (k_desc, k_smem, ready, empty, b_lo, n, STAGES)),
    ], [4, 4, 4, 1], [CONS_REGS, CONS_REGS, CONS_REGS, 24])


def run_triton(q, k, out):
    grid = (ROWS // 128, BLOCKS // BPS)
    _triton_block_max[grid](q, k, out, BLOCKS, M=128, KB=KB, D=D, BPS=BPS, num_warps=4,
                            num_stages=3)


def run_gluon(q, k, out, stages, warps=8, rows=128):
    """rows per program: 128 on 8 warps (two warpgroups of 64 rows), or 64 on 4 warps (one
    warpgroup, half the registers, so two programs fit on an SM)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    q_layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.float8e4nv)
    k_layout = gl.NVMMASharedLayout.get_default_for([KB, D], gl.float8e4nv)
    q_desc = TensorDescriptor(q, list(q.shape), list(q.stride()), [rows, D], q_layout)
    k_desc = TensorDescriptor(k, list(k.shape), list(k.stride()), [KB, D], k_layout)
    grid = (ROWS // rows, BLOCKS // BPS)
    _gluon_block_max[grid](q_desc, k_desc, out, BLOCKS, BPS=BPS, STAGES=stages,
                           num_warps=warps)


def run_gluon_ws(q, k, out_t, stages, regs=112):
    """FlashInfer's fp32 production shape (its planner's `wg4st` form): 256 rows per program as
    four 64-row consumer warpgroups, each waiting for, multiplying and reducing its own keys with
    no barrier across warpgroups, one TMA producer warp; out_t is [blocks, rows]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    q_layout = gl.NVMMASharedLayout.get_default_for([64, D], gl.float8e4nv)
    k_layout = gl.NVMMASharedLayout.get_default_for([KB, D], gl.float8e4nv)
    q_desc = TensorDescriptor(q, list(q.shape), list(q.stride()), [64, D], q_layout)
    k_desc = TensorDescriptor(k, list(k.shape), list(k.stride()), [KB, D], k_layout)
    grid = (ROWS // 256, BLOCKS // BPS)
    _ws_block_max[grid](q_desc, k_desc, out_t, BLOCKS, ROWS, BPS=BPS, STAGES=stages, NPART=4,
                        CONS_REGS=regs, num_warps=4)


def main_gpu(stage_list):
    import statistics

    import torch
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(ROWS, D, device="cuda", generator=g).to(torch.float8_e4m3fn)
    k = torch.randn(BLOCKS * KB, D, device="cuda", generator=g).to(torch.float8_e4m3fn)
    check = 256
    want = (q[:check].float() @ k.float().T).view(check, BLOCKS, KB).amax(-1)
    flops = 2 * ROWS * BLOCKS * KB * D
    runs = [("triton", lambda out: run_triton(q, k, out))]
    runs += [(f"gluon stages={s}", lambda out, s=s: run_gluon(q, k, out, s)) for s in stage_list]
    runs += [(f"gluon 64 rows s={s}", lambda out, s=s: run_gluon(q, k, out, s, 4, 64))
             for s in stage_list]
    runs += [(f"gluon ws s={s}", lambda out, s=s: run_gluon_ws(q, k, out, s), True)
             for s in stage_list]
    for name, fn, *transposed in runs:
        shape = (BLOCKS, ROWS) if transposed else (ROWS, BLOCKS)
        out = torch.full(shape, float("nan"), device="cuda")
        try:
            fn(out)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"{name:18s} failed: {type(e).__name__}: {e}", flush=True)
            continue
        got = out.T if transposed else out
        err = float((got[:check] - want).abs().max())
        times = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(out)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        us = statistics.median(times)
        print(f"{name:18s} {us:9.1f} µs {flops / us / 1e6:7.0f} TFLOP/s  max |err| {err:.3g}"
              f"  NaN left {int(out.isnan().sum())}", flush=True)


def main_offline(stage_list):
    """Compile both for sm_90 without a GPU: registers, and the MMA waits in the SASS."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource
    target = GPUTarget("cuda", 90, 32)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

    def report(name, compiled):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "k.ptx"), "w") as f:
                f.write(compiled.asm["ptx"])
            info = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(tmp, "k.ptx"), "-o",
                                   os.path.join(tmp, "k.o")], capture_output=True, text=True,
                                  check=True).stderr
            sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"),
                                   "--dump-sass", os.path.join(tmp, "k.o")], capture_output=True,
                                  text=True, check=True).stdout
        regs = info.split("Used ")[1].split(" registers")[0]
        waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
        print(f"{name:18s} {regs} registers; MMA waits (outstanding allowed): {waits}")

    names = list(_triton_block_max.arg_names)
    cx = dict(M=128, KB=KB, D=D, BPS=BPS)
    sig = {n: "constexpr" if n in cx else "i32" for n in names}
    sig.update(q_ptr="*fp8e4nv", k_ptr="*fp8e4nv", out_ptr="*fp32")
    report("triton", triton.compile(
        ASTSource(_triton_block_max, sig, {(names.index(k),): v for k, v in cx.items()}),
        target=target, options=dict(num_warps=4, num_stages=3)))
    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.float8e4nv)
        return f"tensordesc<fp8e4nv[{rows}, {D}],{layout!r}>"

    for warps, rows in ((8, 128), (4, 64)):
        for stages in stage_list:
            names = list(_gluon_block_max.arg_names)
            cx = dict(BPS=BPS, STAGES=stages, num_warps=warps)
            sig = {n: "constexpr" if n in cx else "i32" for n in names}
            sig.update(q_desc=desc(rows), k_desc=desc(KB), out_ptr="*fp32")
            src = GluonASTSource(_gluon_block_max, sig,
                                 {(names.index(k),): v for k, v in cx.items()})
            report(f"gluon {rows} rows s={stages}",
                   triton.compile(src, target=target, options=dict(num_warps=warps)))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default="2,3,4")
    p.add_argument("--offline", action="store_true")
    a = p.parse_args()
    stage_list = [int(s) for s in a.stages.split(",")]
    sys.exit(main_offline(stage_list) if a.offline else main_gpu(stage_list))
