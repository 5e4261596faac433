# SPDX-License-Identifier: Apache-2.0
"""Compiling a kernel for Hopper (sm_90) through Triton's own compiler and ptxas on a machine
without a GPU: each op's tests check that the code the GPU runs can be built at M3's shapes (a
frontend or register-allocation failure shows up here). Not under the interpreter."""

import os

I32, I64, F32 = "*i32", "*i64", "*fp32"
STEP = dict(cu_ptr=I32, seq_lens_ptr=I32, bt_ptr=I32)
COMPILE_SKIP = "compilation needs the real compiler, not the interpreter"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def compile_sm90(fn, pointers, scalars, constexprs):
    """Compile `fn` for sm_90: pointer types by name, scalar types by name (default i32), and
    the constexprs (one left out takes its default, as at a runtime launch)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

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
