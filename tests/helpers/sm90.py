# SPDX-License-Identifier: Apache-2.0
"""Compiling a kernel for Hopper (sm_90) through Triton's own compiler and ptxas on a machine
without a GPU: each op's tests check that the code the GPU runs can be built at M3's shapes (a
frontend or register-allocation failure shows up here). Not under the interpreter."""

import os
import re
import subprocess
import tempfile

I32, I64, F32 = "*i32", "*i64", "*fp32"
STEP = dict(cu_ptr=I32, seq_lens_ptr=I32, bt_ptr=I32)
COMPILE_SKIP = "compilation needs the real compiler, not the interpreter"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def target():
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", 90, 32)


def compile_sm90(fn, pointers, scalars, constexprs, *, gluon=False, attrs=None, options=None):
    """Compile `fn` for sm_90: pointer types by name, scalar types by name (default i32), the
    constexprs (one left out takes its default, as at a runtime launch), launch options
    (num_warps, maxnreg, ...); `gluon` for a Gluon kernel; `attrs` (e.g. divisibility, as
    {(index,): [["tt.divisibility", 16]]}) as a runtime launch specializes them."""
    import triton
    from triton.compiler import ASTSource

    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default},
                  **constexprs}
    signature = {name: "constexpr" if name in constexprs
                 else pointers.get(name) or scalars.get(name, "i32") for name in fn.arg_names}
    index = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource
        src = GluonASTSource(fn, signature, index, attrs or {})
    else:
        src = ASTSource(fn=fn, signature=signature, constexprs=index, attrs=attrs)
    return triton.compile(src, target=target(), options=options or None)


def assert_no_spills(ptx, allowed_bytes=0):
    """ptxas (Triton's own) spills at most `allowed_bytes` in any function of `ptx`."""
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(ptx)
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o",
                               os.path.join(d, "k.cubin")], capture_output=True, text=True,
                              check=True).stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", info)]
    assert spills and max(spills) <= allowed_bytes, info
