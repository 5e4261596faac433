# SPDX-License-Identifier: Apache-2.0
"""The one shape of a launch plan, shared by every op.

Each op has a frozen config dataclass (its knobs), a pure `plan(shape, device, config)` in its
`plan.py` that returns a `LaunchPlan`, and an `api.py` that checks arguments, gets the plan
(cached by call key, ops/common/launch.py's `PlanCache`) and runs it. A plan is a function of
shapes, dtypes, device facts and the config only, never of tensor values: the same plan serves
every replay of a CUDA graph, and the plan tests build shapes and `DeviceFacts` by hand.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import torch

__all__ = ["DeviceFacts", "Launch", "LaunchPlan", "cached_hash", "check_form",
           "config_or_default", "next_pow2", "state_without_hash"]

from ..._device import capability, gluon_hopper_available, num_sms
from .launch import launch_planned, plan_serials


@dataclass(frozen=True)
class DeviceFacts:
    """What a plan may know about the device: its kind, SM count and capability, whether the
    Hopper Gluon kernels can run (Triton version, sm_90) and whether the GPU is AMD's (ROCm:
    torch calls it "cuda" too, with torch.version.hip set). CPU tensors (the interpreter) get 4
    "SMs" so that grids stay small. The defaults are an H200."""

    kind: str = "cuda"
    num_sms: int = 132
    capability: tuple[int, int] = (9, 0)
    gluon_hopper: bool = True
    hip: bool = False

    @property
    def cuda(self) -> bool:
        """A GPU (NVIDIA's or, through ROCm, AMD's), not the interpreter."""
        return self.kind == "cuda"

    @property
    def nvidia(self) -> bool:
        """An NVIDIA GPU: inline PTX, programmatic dependent launch (griddepcontrol) and the
        GPU max skipping NaN (PTX max.f32) may be used. False on ROCm."""
        return self.cuda and not self.hip

    @property
    def hopper(self) -> bool:
        """sm_90 with the Gluon this project's Hopper kernels are tested on."""
        return self.nvidia and self.capability == (9, 0) and self.gluon_hopper

    @staticmethod
    def of(device: torch.device) -> "DeviceFacts":
        return _facts(device.type, device.index)


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _facts(kind: str, index: int | None) -> DeviceFacts:
    if kind != "cuda":
        return DeviceFacts(kind=kind, num_sms=4, capability=(0, 0), gluon_hopper=False)
    device = torch.device(kind, index if index is not None else torch.cuda.current_device())
    hip = torch.version.hip is not None
    return DeviceFacts(kind=kind, num_sms=num_sms(device), capability=capability(device),
                       gluon_hopper=not hip and gluon_hopper_available(), hip=hip)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: which of the op's kernels (a name its api maps to the function), the
    grid, and the keyword arguments (constexprs and launch options such as num_warps)."""

    kernel: str
    grid: tuple[int, ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    # launch_planned caches the compiled kernel's launch under this key, which stands for every
    # int and constexpr the launch passes (serial numbers: never reused, unlike id())
    key: int = field(default_factory=lambda: next(plan_serials), compare=False)

    def __post_init__(self):
        object.__setattr__(self, "grid", tuple(int(g) for g in self.grid))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    def run(self, fn, *args) -> None:
        """fn[grid](*args, **params) through the launch cache keyed on this launch."""
        launch_planned(fn, self.key, self.grid, *args, **self.params)


@dataclass(frozen=True)
class LaunchPlan:
    """A step's launches in order, and the sizes of the temporary buffers they share (named by
    the op: scratch slots, segment counts)."""

    launches: tuple[Launch, ...] = ()
    sizes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "launches", tuple(self.launches))
        object.__setattr__(self, "sizes", MappingProxyType(dict(self.sizes)))

    def __iter__(self):
        return iter(self.launches)

    def __len__(self) -> int:
        return len(self.launches)

    def kernels(self) -> tuple[str, ...]:
        return tuple(launch.kernel for launch in self.launches)

    def find(self, kernel: str) -> Launch | None:
        """The first launch of `kernel`, or None."""
        return next((launch for launch in self.launches if launch.kernel == kernel), None)


def check_form(form, *, positive=(), pow2=(), pow2_or_zero=()) -> None:
    """A frozen launch form's fields, by their annotations: an `int` field holds an int (a
    `tuple[int, ...]` one a tuple of them, an `int | None` one may hold None: no cap), a `float`
    field a number, a `bool` field a bool; every number is at least 0, those in `positive`
    above 0, those in `pow2` powers of two (tl.arange extents; `pow2_or_zero`: or 0, "none").
    A wrong type is a TypeError and a wrong value a ValueError, each naming Form.field."""
    name = type(form).__name__
    for f in dataclasses.fields(form):
        value, kind = getattr(form, f.name), str(f.type)
        if value is None and "None" in kind:
            continue
        if kind == "bool":
            if not isinstance(value, bool):
                raise TypeError(f"{name}.{f.name} must be a bool, got {value!r}")
            continue
        if kind.startswith("tuple"):
            if not isinstance(value, tuple):
                raise TypeError(f"{name}.{f.name} must be a tuple of ints, got {value!r}")
            values = value
        else:
            values = (value,)
        for v in values:
            numbers = (int, float) if kind == "float" else (int,)
            if isinstance(v, bool) or not isinstance(v, numbers):
                what = "a number" if kind == "float" else "an int"
                raise TypeError(f"{name}.{f.name} must be {what}, got {v!r}")
            if f.name in pow2 or f.name in pow2_or_zero:
                if (v <= 0 or v & (v - 1)) and not (f.name in pow2_or_zero and v == 0):
                    raise ValueError(f"{name}.{f.name} must be a power of two, got {v}")
            elif v < 0 or (v == 0 and f.name in positive):
                raise ValueError(f"{name}.{f.name} must be "
                                 f"{'positive' if f.name in positive else 'at least 0'}, got {v}")


def cached_hash(config) -> int:
    """An op config's `__hash__`, computed once: the config is part of every call's plan key,
    and hashing every field and form again would cost each eager call host time."""
    h = config.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(config, f.name) for f in dataclasses.fields(config)))
        object.__setattr__(config, "_hash", h)
    return h


def state_without_hash(config) -> dict:
    """An op config's `__getstate__`: the cached hash stays behind (a string's hash differs
    between processes)."""
    state = dict(config.__dict__)
    state.pop("_hash", None)
    return state


def config_or_default(config, default, name: str = "config"):
    """An op's `config=` argument: None means the op's default; anything but an instance of
    the default's class is a TypeError naming the argument."""
    if config is None:
        return default
    if not isinstance(config, type(default)):
        raise TypeError(f"{name} must be an openmsa.{type(default).__name__} or None, got "
                        f"{type(config).__name__}")
    return config
