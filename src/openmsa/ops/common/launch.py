# SPDX-License-Identifier: Apache-2.0
"""Kernel launches with less host work per call than `kernel[grid](...)`.

Measured on the H200 machine's host (`python3 benchmarks/host_cost.py`): an empty kernel with 48
arguments takes 39 µs to launch through `kernel[grid](...)`, 13.5 µs with one argument, and a
decode step's one attention launch 66 µs of its 133 µs of host time. Per call, Triton's
`JITFunction.run` specialises every argument in native code (type, 16-byte alignment, value 1),
builds and hashes a cache key (with `str()` of the options), checks the kernel's globals, and
its compiled launcher then calls `data_ptr()` and the driver's `cuPointerGetAttribute` on every
tensor argument.

`Launcher` computes the same specialisation itself in one pass over the arguments, which also
turns each tensor into its address: its key is, per argument, the tensor's dtype and whether its
address is 16-byte aligned, an int's value (or, for a `do_not_specialize` parameter, whether it
fits 32 bits), and the constexprs and options as given. Whatever Triton would have compiled
differently gets a different key, so a cached kernel only runs on arguments it was compiled for.
The first call of a key, and every call while a launch hook is installed (profilers) or under the
interpreter, goes through `kernel[grid](...)`. The compiled launcher then gets addresses (ints),
for which it makes no driver call; the callers have checked that every tensor is on the launch's
device.
"""

from __future__ import annotations

import inspect

import torch
import triton
from triton import knobs

from ..._dispatch import INTERPRET

_I32 = range(-(2 ** 31), 2 ** 31)


# a key per distinct value of every int argument: a long-running engine whose prefill chunks
# take many token counts would grow the dict without bound, so past this many keys it restarts
# (each dropped key costs one call through kernel[grid] when it comes back)
MAX_KEYS = 1024


def launch(fn, grid, *args, **kwargs):
    """`fn[grid](*args, **kwargs)` through fn's Launcher (made on first use): tensors and the
    kernel's other non-constexpr parameters positionally, constexprs and options by keyword."""
    launcher = getattr(fn, "_openmsa_launcher", None)
    if launcher is None:
        # (the interpreter's functions, and tests' wrappers of a kernel, launch as they are)
        if INTERPRET or not isinstance(fn, triton.runtime.JITFunction):
            return fn[grid](*args, **kwargs)
        launcher = fn._openmsa_launcher = Launcher(fn)
    return launcher(grid, *args, **kwargs)


def _hooked(hook) -> bool:
    """Whether a launch hook is installed: Triton 3.6 keeps an always-present chain of hooks
    (empty unless a profiler adds one); older versions kept None."""
    return hook is not None and bool(getattr(hook, "calls", True))


class Launcher:
    """`Launcher(fn)(grid, *args, **kwargs)` launches like `fn[grid](*args, **kwargs)`: the
    kernel's non-constexpr parameters positionally (a tensor passed by keyword would be keyed
    by identity and never hit), its constexprs and the launch options (num_warps, ...) by
    keyword."""

    def __init__(self, fn: triton.JITFunction):
        self.fn = fn
        self._kernels: dict = {}
        params = list(inspect.signature(fn.fn).parameters.values())
        self._names = [p.name for p in params]
        self._defaults = {p.name: p.default for p in params
                          if p.default is not inspect.Parameter.empty}
        self._dns = [kp.do_not_specialize for kp in fn.params]

    def __call__(self, grid, *args, **kwargs):
        fn = self.fn
        if _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            return fn[grid](*args, **kwargs)
        vals = []
        key = [tuple(kwargs.items())]
        for a, dns in zip(args, self._dns):
            if isinstance(a, torch.Tensor):
                p = a.data_ptr()
                vals.append(p)
                key.append((a.dtype, not p & 15))
            else:
                vals.append(a)
                if isinstance(a, float):
                    key.append(float)
                elif dns and type(a) is int:
                    key.append(a in _I32)
                else:
                    key.append(a)
        device = torch.cuda.current_device()
        key.append(device)
        key = tuple(key)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = fn[grid](*args, **kwargs)
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            if len(self._kernels) >= MAX_KEYS:
                self._kernels.clear()
            self._kernels[key] = kernel
            return kernel
        for name in self._names[len(args):]:
            vals.append(kwargs[name] if name in kwargs else self._defaults[name])
        n = len(grid)
        kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                   torch._C._cuda_getCurrentRawStream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *vals)
        return kernel
