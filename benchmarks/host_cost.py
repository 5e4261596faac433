# SPDX-License-Identifier: Apache-2.0
"""Host cost of eager calls: what an engine that does not capture a graph pays per call.

    python3 benchmarks/host_cost.py [CASE...] [--out FILE.json]   # profile_case.py's case names

Per case: the synchronised eager call (wall time from an idle GPU: host + device), the host's
own time per call (calls back to back, no synchronisation: the host returns once its launches
are queued, so on small steps this is the host cost), the share of it spent launching
(openmsa's `Launcher`, or Triton's `JITFunction.run` for calls around it, timed by wrapping)
and a cProfile of 200 calls. Then micro-benchmarks of the pieces: an empty Triton kernel with
1 and with 48 arguments launched through `kernel[grid](...)` and through openmsa's `Launcher`
(its result checked), `torch.empty` and the stream query.
"""

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch
import triton
import triton.language as tl
import triton.runtime.jit as tjit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_case  # noqa: E402
import run  # noqa: E402

try:  # (absent before 4a7a14e: host_cost.py also measures older trees, PYTHONPATH=old/src)
    from openmsa.ops.common.launch import Launcher  # noqa: E402
except ImportError:
    Launcher = None


def host_us(fn, n: int = 300) -> float:
    """Median host time of one call with calls back to back (no synchronisation between)."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def launcher_us(fn, n: int = 300) -> tuple[float, float]:
    """(µs per call inside the launches, launches per call): openmsa's `Launcher.__call__` and
    `Launcher.planned` (the compiled launcher included) and, for calls that go around them,
    Triton's JITFunction.run."""
    acc = [0.0, 0]
    origs = [(tjit.JITFunction, "run", tjit.JITFunction.run)]
    if Launcher is not None:
        origs.append((Launcher, "__call__", Launcher.__call__))
        if hasattr(Launcher, "planned"):  # (the ops' launches since 9e7de02)
            origs.append((Launcher, "planned", Launcher.planned))
    depth = [0]

    def wrap(orig):
        def timed(self, *args, **kwargs):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return orig(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:  # a Launcher miss calls JITFunction.run: counted once
                    acc[0] += time.perf_counter() - t
                    acc[1] += 1
        return timed

    fn()
    torch.cuda.synchronize()
    for cls, name, orig in origs:
        setattr(cls, name, wrap(orig))
    try:
        for _ in range(n):
            fn()
    finally:
        for cls, name, orig in origs:
            setattr(cls, name, orig)
    torch.cuda.synchronize()
    return acc[0] / n * 1e6, acc[1] / n


@triton.jit
def _one(x_ptr):
    tl.store(x_ptr, 1)


@triton.jit
def _many(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11,
          i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13, i14,
          i15, i16, i17, i18, i19, i20, i21, i22, i23, i24, i25, i26, i27, i28, i29,
          f0, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
          C4: tl.constexpr, C5: tl.constexpr):
    # stores a sum of its int arguments, so the direct launch path is checked, not only timed
    s = i0 + i1 + i2 + i3 + i4 + i5 + i6 + i7 + i8 + i9 + i10 + i11 + i12 + i13 + i14
    s += i15 + i16 + i17 + i18 + i19 + i20 + i21 + i22 + i23 + i24 + i25 + i26 + i27 + i28 + i29
    tl.store(p0, s + C0 + C1 + C2 + C3 + C4 + C5 + f0.to(tl.int32))


def micro() -> dict[str, float]:
    dev = torch.device("cuda")
    x = torch.zeros(16, dtype=torch.int32, device=dev)
    ptrs = [x] * 12
    ints = list(range(3, 33))
    consts = dict(C0=1, C1=2, C2=3, C3=4, C4=5, C5=6)
    want = sum(ints) + 21 + 2

    def t_one():
        _one[(1,)](x)

    def t_many():
        _many[(1, 2, 3)](*ptrs, *ints, 2.0, **consts)

    rows = {"empty kernel, 1 argument, kernel[grid]": host_us(t_one, 2000),
            "empty kernel, 48 arguments, kernel[grid]": host_us(t_many, 2000)}
    torch.cuda.synchronize()
    assert int(x[0]) == want, (int(x[0]), want)
    x.zero_()
    launch = Launcher(_many)

    def t_direct():
        launch((1, 2, 3), *ptrs, *ints, 2.0, **consts)

    rows["empty kernel, 48 arguments, cached launcher"] = host_us(t_direct, 2000)
    torch.cuda.synchronize()
    assert int(x[0]) == want, ("cached launcher", int(x[0]), want)
    rows["torch.empty (8, 64) fp32"] = host_us(
        lambda: torch.empty((8, 64), dtype=torch.float32, device=dev), 2000)
    rows["torch.cuda.current_stream().cuda_stream"] = host_us(
        lambda: torch.cuda.current_stream(dev).cuda_stream, 2000)
    for k, v in rows.items():
        print(f"micro: {k}: {v:.2f} µs", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", default=["attn-fp8-tp1-b8-out", "attn-fp8-tp1-b1",
                                                    "idx-fp8-b32-32k", "idx-fp8-b1-32k",
                                                    "layer-fp8-tp1-b8-32k"])
    parser.add_argument("--out", help="also write the numbers as JSON here")
    args = parser.parse_args()
    names = args.cases
    result = {"provenance": run.provenance(), "micro_us": {}, "rows": []}

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    if Launcher is not None:
        result["micro_us"] = micro()
        save()
    for name in names:
        fn = profile_case.CASES[name]()
        call = run.eager_call_us(fn, 20)
        host = host_us(fn)
        inside, launches = launcher_us(fn)
        print(f"{name}: eager call {call:.1f} µs (synchronised, device + host); host "
              f"{host:.1f} µs per call back to back, of which {inside:.1f} in its "
              f"{launches:.0f} launches", flush=True)
        result["rows"].append(dict(case=name, eager_call_us=call, host_us=host,
                                   launch_us=inside, launches=launches))
        save()
    for name in names:
        fn = profile_case.CASES[name]()
        fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"--- {name}: cProfile of 200 calls", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
