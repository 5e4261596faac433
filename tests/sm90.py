# SPDX-License-Identifier: Apache-2.0
"""Building kernels for Hopper (sm_90) on a machine without a GPU, for the tier-0 compile tests:
Triton's own compiler and ptxas, with a launch's constexprs and options."""

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, pointers, scalars, constexprs, **options):
    """fn built for sm_90: `pointers` and `scalars` map parameter names to Triton types (other
    non-constexprs are i32); a constexpr left out takes its default, as at a launch."""
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
    return triton.compile(src, target=TARGET, options=options or None)


def assert_no_spills(ptx, allowed_bytes=0):
    """ptxas (Triton's own) spills at most `allowed_bytes` in any function of `ptx`."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(ptx)
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o",
                               os.path.join(d, "k.cubin")], capture_output=True, text=True,
                              check=True).stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", info)]
    assert spills and max(spills) <= allowed_bytes, info
