# SPDX-License-Identifier: Apache-2.0
"""Kernel launches with less host work per call than `kernel[grid](...)`.

A launch through `kernel[grid](...)` costs host time in proportion to its arguments, and a
decode step's launches are a large share of its host time (`benchmarks/host_cost.py`; the
numbers in docs/history/2026-11-30-host-cost.md). Per call, Triton's
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

import functools
import inspect
import itertools
import operator
import os

import torch
import triton
from triton import knobs

from ..._interpreter import INTERPRET

_I32 = range(-(2 ** 31), 2 ** 31)
_MISALIGNED = 15
_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")


def _getter(positions):
    """A function returning the tuple of args at `positions` (itemgetter returns a bare item
    for one position and fails for none)."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


# a key per distinct value of every int argument: a long-running engine whose prefill chunks
# take many token counts would grow the dict without bound, so past this many keys it restarts
# (each dropped key costs one call through kernel[grid] when it comes back)
MAX_KEYS = 1024


@functools.lru_cache(maxsize=64)
def _nvmma_layout(box: tuple, dtype: torch.dtype):
    from triton.experimental.gluon import language as gl
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
           torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), gdt)


@functools.lru_cache(maxsize=1)
def _descriptor_class():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor


def _is_descriptor_type(t: type) -> bool:
    """Whether an argument type is Gluon's host-side TMA descriptor (TensorDescriptor)."""
    return t.__name__ == "TensorDescriptor" and t.__module__.startswith("triton.")


def _descriptor_key(d) -> tuple:
    """A TMA descriptor argument's key: what Triton compiles it for (dtype, box, shared layout,
    padding), and its shape and strides (runtime values to the kernel; keyed all the same).
    Its base is 16-byte aligned (TensorDescriptor checks), and a plan key fixes the rest, so
    the planned path looks at none of it."""
    return (d.base.dtype, tuple(d.block_shape), d.layout, d.padding, tuple(d.shape),
            tuple(d.strides))


def tma_descriptor(tensor: torch.Tensor, shape, strides, box):
    """A host-side TMA descriptor for a Gluon kernel: `tensor`'s memory as `shape` and
    `strides` (elements), copied in `box` tiles into the default NVMMA shared layout of its
    dtype. The layout is cached by box and dtype: computing it is Python work of several µs, once
    per descriptor per launch. The
    descriptor itself holds the tensor, so it is built per call (caching it would keep an
    engine's freed cache alive)."""
    return _descriptor_class()(tensor, list(shape), list(strides), list(box),
                               _nvmma_layout(tuple(box), tensor.dtype))


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


def launch_planned(fn, plan_key, grid, *args, **kwargs):
    """`launch` for a call whose `plan_key` fixes everything but the tensors' addresses (see
    Launcher.planned; ops key it on a launch plan's serial number)."""
    launcher = getattr(fn, "_openmsa_launcher", None)
    if launcher is None:
        if INTERPRET or not isinstance(fn, triton.runtime.JITFunction):
            return fn[grid](*args, **kwargs)
        launcher = fn._openmsa_launcher = Launcher(fn)
    return launcher.planned(plan_key, grid, args, kwargs)


# tests set OPENMSA_VERIFY_PLAN_KEYS=1 (tests/conftest.py): every planned launch is checked
# against Triton's own key
VERIFY_PLAN_KEYS = os.environ.get("OPENMSA_VERIFY_PLAN_KEYS", "0") == "1"
# serial numbers of launch plans (never reused, unlike id() of a dropped plan)
plan_serials = itertools.count()


class Launcher:
    """`Launcher(fn)(grid, *args, **kwargs)` launches like `fn[grid](*args, **kwargs)`: the
    kernel's tensors positionally (a tensor passed by keyword would be keyed by identity and
    never hit), anything else positionally or by keyword."""

    def __init__(self, fn: triton.JITFunction):
        self.fn = fn
        self._kernels: dict = {}
        self._layouts: dict = {}
        self._tensor_pos: dict = {}
        self._plan_layouts: dict = {}
        self._planned: dict = {}
        params = list(inspect.signature(fn.fn).parameters.values())
        self._params = [(p.name, p.default, kp.is_constexpr) for p, kp in zip(params, fn.params)]
        self._dns = [kp.do_not_specialize for kp in fn.params]

    def _layout(self, types: tuple):
        """For one tuple of positional argument types: the positions of tensors, of
        do_not_specialize ints, of Gluon TMA descriptors and of the other keyed values, and
        the parameters after them (the compiled launcher skips constexprs, which get None; a
        non-constexpr parameter given by keyword or left at its default gets its value)."""
        tensors = [i for i, t in enumerate(types) if issubclass(t, torch.Tensor)]
        dns = [i for i, t in enumerate(types) if t is int and self._dns[i]]
        descs = [i for i, t in enumerate(types) if _is_descriptor_type(t)]
        keyed = [i for i, t in enumerate(types)
                 if i not in tensors and i not in dns and i not in descs and t is not float]
        rest = self._params[len(types):]
        # the parameters after the positional ones: None for each constexpr, and the positions
        # of the others, whose values come from the keywords or their defaults
        pad = [None] * len(rest)
        given = [(j, name, default) for j, (name, default, const) in enumerate(rest)
                 if not const]
        self._tensor_pos[types] = tensors
        layout = (_getter(tensors), _getter(dns), _getter(keyed), _getter(descs), (pad, given))
        self._layouts[types] = layout
        return layout

    def __call__(self, grid, *args, **kwargs):
        if _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            self.fn[grid](*args, **kwargs)
            return
        self._launch_full(grid, args, kwargs)

    def _launch_full(self, grid, args, kwargs):
        """Launch through Triton's own key (computed here); returns the runner it used, or None
        when this call went through kernel[grid] (a miss: compiled or found there)."""
        types = tuple(map(type, args))
        layout = self._layouts.get(types) or self._layout(types)
        tensors, dns, keyed, descs, rest = layout
        # (C-level maps: a Python loop over ~15 tensors and ~30 ints cost more than the rest)
        objs = tensors(args)
        ptrs = list(map(_DATA_PTR, objs))
        device = torch.cuda.current_device()
        key = (types, tuple(map(_DTYPE, objs)), tuple(map(_MISALIGNED.__and__, ptrs)),
               keyed(args), tuple(map(_I32.__contains__, dns(args))),
               tuple(map(_descriptor_key, descs(args))), tuple(kwargs.items()), device)
        runner = self._kernels.get(key)
        if runner is None:
            kernel = self.fn[grid](*args, **kwargs)
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            if len(self._kernels) >= MAX_KEYS:
                self._kernels.clear()
            self._kernels[key] = _runner(kernel)
            return None
        self._run(runner, grid, args, kwargs, self._tensor_pos[types], ptrs, rest, device)
        return runner

    @staticmethod
    def _run(runner, grid, args, kwargs, tensor_pos, ptrs, rest, device):
        vals = list(args)
        for i, p in zip(tensor_pos, ptrs):
            vals[i] = p
        pad, given = rest
        if given:
            pad = list(pad)
            for j, name, default in given:
                pad[j] = kwargs.get(name, default)
        vals += pad
        n = len(grid)
        runner(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
               torch._C._cuda_getCurrentRawStream(device), vals)

    def planned(self, plan_key, grid, args, kwargs):
        """Launch for an op whose `plan_key` already fixes everything Triton specialises on but
        the tensors' addresses: the argument types, every int (shapes, strides), the tensors'
        dtypes, the constexprs and options. Per call only the addresses and their 16-byte
        alignment are looked at. The first call of a (plan key, alignment) takes the full
        path and remembers the runner it used; with VERIFY_PLAN_KEYS (the tests) every call
        also computes Triton's full key and checks that it names the same runner."""
        if _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            self.fn[grid](*args, **kwargs)
            return
        layout = self._plan_layouts.get(plan_key)
        if layout is None:
            types = tuple(map(type, args))
            layout = (self._layouts.get(types) or self._layout(types), self._tensor_pos[types])
            if len(self._plan_layouts) >= MAX_KEYS:
                self._plan_layouts.clear()
            self._plan_layouts[plan_key] = layout
        (tensors, _, _, _, rest), tensor_pos = layout
        ptrs = list(map(_DATA_PTR, tensors(args)))
        device = torch.cuda.current_device()
        key = (plan_key, tuple(map(_MISALIGNED.__and__, ptrs)), device)
        runner = self._planned.get(key)
        if runner is None or VERIFY_PLAN_KEYS:
            full = self._launch_full(grid, args, kwargs)
            if full is None:
                return  # a miss of Triton's key: next time the full path finds the runner
            if runner is not None and runner.kernel is not full.kernel:
                raise AssertionError(f"{self.fn.__name__}: plan key {plan_key} names another "
                                     f"kernel than Triton's specialisation of these arguments")
            if len(self._planned) >= MAX_KEYS:
                self._planned.clear()
            self._planned[key] = full
            return
        self._run(runner, grid, args, kwargs, tensor_pos, ptrs, rest, device)


def _runner(kernel):
    """A function (grid x, y, z, stream, argument list) launching a compiled kernel. Triton
    3.6's CudaLauncher wraps its native launch in Python that allocates scratch buffers (most
    kernels need none) and passes the hooks; with no scratch the native launch is called
    directly. Anything else goes through the launcher as JITFunction.run calls it."""
    run = kernel.run
    native = getattr(run, "launch", None)
    if (native is None or getattr(run, "global_scratch_size", 1) != 0
            or getattr(run, "profile_scratch_size", 1) != 0
            or not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl")):
        def launch_through_launcher(x, y, z, stream, vals):
            run(x, y, z, stream, kernel.function, kernel.packed_metadata, None, None, None, *vals)
        launch_through_launcher.kernel = kernel
        return launch_through_launcher
    function, metadata = kernel.function, kernel.packed_metadata
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl

    def launch_native(x, y, z, stream, vals):
        native(x, y, z, stream, function, coop, pdl, None, None, metadata, None, None, None, *vals)
    launch_native.kernel = kernel
    return launch_native


def tensor_key(t) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device)


def scale_key(s):
    """A dequantisation scale argument as a key: a tensor by shape, dtype and device (its value
    is read on the device), anything else as itself."""
    return (s.shape, s.dtype, s.device) if isinstance(s, torch.Tensor) else s


def scale_tensor(value, device) -> torch.Tensor:
    """A dequantisation scale as a one-element fp32 device tensor (a float becomes one)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(1).float()
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


def scale_args(k_scale, v_scale, device, placeholder: torch.Tensor):
    """(HAS_SCALE, k scale pointer, v scale pointer) for a launch. Without scales the kernel never
    reads the pointers, so any tensor stands in: no fill kernel per call for a constant 1.0."""
    if k_scale is None and v_scale is None:
        return False, placeholder, placeholder
    return (True, scale_tensor(1.0 if k_scale is None else k_scale, device),
            scale_tensor(1.0 if v_scale is None else v_scale, device))


def call_key(tensors, values) -> tuple | None:
    """A hashable key of everything an op's argument checks and launch choices read: the
    tensors' shapes, strides, dtypes and devices, and other values with their types (True and 1
    differ), or None when an argument is not a tensor or a value is unhashable (the op's checks
    then run and say why)."""
    try:
        key = (tuple(map(tensor_key, tensors)), tuple(map(type, values)), tuple(values))
        hash(key)
        return key
    except (AttributeError, TypeError):
        return None


class PlanCache:
    """Launch plans by call key: a repeated step shape (every decode step of an engine) skips
    the argument checks and the launch choices, which cost more host time than the launch
    itself (benchmarks/host_cost.py; docs/performance.md). Bounded like Launcher's keys."""

    def __init__(self, op: str):
        self.op = op
        self._plans: dict = {}

    def get_or_plan(self, key, make):
        """The plan cached under `key`, else `make()` (the argument checks and the launch
        choices), cached. A None key (an argument that is not hashable) is never cached: `make`
        runs, and its checks say what is wrong. With OPENMSA_SHOW_PLANS=1 each plan made is
        logged at INFO (logger "openmsa.plans", on stderr unless a handler is configured)."""
        plan = None if key is None else self._plans.get(key)
        if plan is None:
            plan = make()
            if SHOW_PLANS:
                _log_plan(self.op, plan)
            if key is not None:
                if len(self._plans) >= MAX_KEYS:
                    self._plans.clear()
                self._plans[key] = plan
        return plan


SHOW_PLANS = os.environ.get("OPENMSA_SHOW_PLANS", "0") == "1"


def _log_plan(op: str, plan) -> None:
    import logging
    log = logging.getLogger("openmsa.plans")
    # asked for by the variable: INFO even where the application's root logs warnings only
    log.setLevel(logging.INFO)
    if not log.hasHandlers():
        log.addHandler(logging.StreamHandler())
    launches = getattr(plan, "launches", plan)
    lines = [f"openmsa plan for {op}:"]
    if isinstance(launches, (tuple, list)):
        for launch in launches:
            params = ", ".join(f"{k}={v}" for k, v in getattr(launch, "params", {}).items())
            lines.append(f"  {getattr(launch, 'kernel', launch)} grid={getattr(launch, 'grid', '')}"
                         f" {params}")
    else:
        lines.append(f"  {plan!r}")
    sizes = getattr(plan, "sizes", None)
    if sizes:
        lines.append(f"  sizes: {dict(sizes)}")
    log.info("\n".join(lines))
