# SPDX-License-Identifier: Apache-2.0
"""Tier 0 (CPU): the cached launch path of ops/common/launch.py with Triton's compile-and-launch
replaced by a recorder, so its key and argument list are checked without a GPU (test_gpu.py runs
the real thing: test_launcher_cache_keys_on_what_triton_specialises)."""

import pytest
import torch
import triton
import triton.language as tl
import triton.runtime.jit as tjit

from openmsa.ops.common import launch as launch_mod


@triton.jit
def _probe_kernel(x_ptr, y_ptr, n, stride, scale, N_DNS, A: tl.constexpr, B: tl.constexpr = 7,
                  width=3):
    pass


_probe_kernel_dns = triton.jit(_probe_kernel.fn, do_not_specialize=["N_DNS"])


class _Compiled:
    """Stands for a CompiledKernel: records what the cached path hands its launcher."""

    function = "function"
    packed_metadata = "metadata"

    def __init__(self, spec):
        self.spec = spec
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


@pytest.fixture
def compiled(monkeypatch):
    """JITFunction.run (kernel[grid]'s path) replaced: each call 'compiles' a new kernel."""
    made = []

    def fake_run(self, *args, grid, warmup, **kwargs):
        made.append(_Compiled((args, kwargs)))
        return made[-1]

    monkeypatch.setattr(tjit.JITFunction, "run", fake_run)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234,
                        raising=False)
    return made


def test_cached_path_passes_addresses_then_the_signature_in_order(compiled):
    """Tensors as addresses, every parameter in signature order: the constexprs (which the
    compiled launcher skips) as None, a keyword or default non-constexpr with its value."""
    launcher = launch_mod.Launcher(_probe_kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    launcher((3, 2), x, y, 5, 32, 0.5, 9, A=4, num_warps=2)  # compiles
    assert len(compiled) == 1 and not compiled[0].launches
    launcher((3, 2), x, y, 5, 32, 0.25, 9, A=4, num_warps=2)  # cached (a float is not keyed)
    launcher((3, 2), x, y, 5, 32, 0.25, 9, A=4, num_warps=2, width=11)  # a new key
    launcher((3, 2), x, y, 5, 32, 0.25, 9, A=4, num_warps=2, width=11)
    assert len(compiled) == 2
    (args,) = compiled[0].launches
    assert args[:9] == (3, 2, 1, 1234, "function", "metadata", None, None, None)
    assert args[9:] == (x.data_ptr(), y.data_ptr(), 5, 32, 0.25, 9, None, None, 3)
    assert compiled[1].launches[0][9:] == (x.data_ptr(), y.data_ptr(), 5, 32, 0.25, 9, None,
                                           None, 11)


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int value", "one", "constexpr",
                                    "option"])
def test_what_triton_specialises_misses_the_cache(compiled, change):
    launcher = launch_mod.Launcher(_probe_kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    base = dict(args=[x, y, 5, 32, 0.5, 9], kwargs=dict(A=4, num_warps=2))
    launcher((1,), *base["args"], **base["kwargs"])
    args, kwargs = list(base["args"]), dict(base["kwargs"])
    if change == "misaligned":
        args[0] = x[1:]  # 4 bytes off a 16-byte boundary
    elif change == "dtype":
        args[1] = y.half()
    elif change == "int value":
        args[3] = 48
    elif change == "one":
        args[2] = 1
    elif change == "constexpr":
        kwargs["A"] = 8
    else:
        kwargs["num_warps"] = 4
    launcher((1,), *args, **kwargs)
    assert len(compiled) == 2  # a miss: through kernel[grid], never the first kernel
    assert not compiled[0].launches


def test_do_not_specialize_ints_key_on_their_width_only(compiled):
    launcher = launch_mod.Launcher(_probe_kernel_dns)
    x, y = torch.zeros(64), torch.zeros(64)
    for n in (9, 1, 16, 2 ** 20):
        launcher((1,), x, y, 5, 32, 0.5, n, A=4)
    assert len(compiled) == 1 and len(compiled[0].launches) == 3
    launcher((1,), x, y, 5, 32, 0.5, 2 ** 40, A=4)  # an i64 argument: another kernel
    assert len(compiled) == 2


def test_installed_launch_hook_takes_tritons_path(compiled, monkeypatch):
    launcher = launch_mod.Launcher(_probe_kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    launcher((1,), x, y, 5, 32, 0.5, 9, A=4)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    launcher((1,), x, y, 5, 32, 0.5, 9, A=4)
    assert len(compiled) == 2 and not compiled[0].launches


def test_key_count_is_bounded(compiled, monkeypatch):
    monkeypatch.setattr(launch_mod, "MAX_KEYS", 4)
    launcher = launch_mod.Launcher(_probe_kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    for n in range(10):
        launcher((1,), x, y, n + 2, 32, 0.5, 9, A=4)
    assert len(launcher._kernels) <= 4


class _CudaLauncherLike:
    """Stands for Triton 3.6's CudaLauncher: a native launch and the scratch sizes."""

    launch_cooperative_grid = False
    launch_pdl = True

    def __init__(self, scratch):
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.native, self.wrapped = [], []

    def launch(self, *args):
        self.native.append(args)

    def __call__(self, *args):
        self.wrapped.append(args)


@pytest.mark.parametrize("scratch", [0, 256])
def test_native_launch_without_scratch(compiled, monkeypatch, scratch):
    """With no scratch buffer the native launch is called directly (grid, stream, function,
    the launch flags, no scratch, metadata, no hooks, the arguments); with one, the launcher's
    own wrapper allocates it."""
    launcher = launch_mod.Launcher(_probe_kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    monkeypatch.setattr(_Compiled, "run", _CudaLauncherLike(scratch))
    launcher((4,), x, y, 5, 32, 0.5, 9, A=4)
    launcher((4,), x, y, 5, 32, 0.5, 9, A=4)
    run = _Compiled.run
    tail = (x.data_ptr(), y.data_ptr(), 5, 32, 0.5, 9, None, None, 3)
    if scratch:
        assert not run.native and run.wrapped == [(4, 1, 1, 1234, "function", "metadata", None,
                                                   None, None, *tail)]
    else:
        assert not run.wrapped and run.native == [(4, 1, 1, 1234, "function", False, True, None,
                                                   None, "metadata", None, None, None, *tail)]


def test_planned_launch_looks_only_at_addresses(compiled, monkeypatch):
    """A plan key's first call takes the full path; later calls launch the same kernel without
    it, until a tensor's alignment changes (a new key: the full path again)."""
    monkeypatch.setattr(launch_mod, "VERIFY_PLAN_KEYS", False)
    launcher = launch_mod.Launcher(_probe_kernel)
    full = []
    orig = launcher._launch_full
    monkeypatch.setattr(launcher, "_launch_full", lambda *a: full.append(1) or orig(*a))
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(3):  # miss (compiles), full-path hit (remembered), planned hit
        launcher.planned(("plan", 0), (2,), (x, y, 5, 32, 0.5, 9), dict(A=4))
    assert len(compiled) == 1 and len(full) == 2 and len(compiled[0].launches) == 2
    assert compiled[0].launches[-1][9:] == (x.data_ptr(), y.data_ptr(), 5, 32, 0.5, 9, None,
                                            None, 3)
    launcher.planned(("plan", 0), (2,), (x[1:], y, 5, 32, 0.5, 9), dict(A=4))  # misaligned
    assert len(full) == 3 and len(compiled) == 2


def test_verify_mode_catches_a_plan_key_that_does_not_fix_an_int(compiled, monkeypatch):
    """With VERIFY_PLAN_KEYS (set for the whole test suite) a plan key reused for arguments
    that Triton specialises differently raises instead of running the wrong binary."""
    monkeypatch.setattr(launch_mod, "VERIFY_PLAN_KEYS", True)
    launcher = launch_mod.Launcher(_probe_kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(2):
        launcher.planned(("plan", 1), (2,), (x, y, 5, 32, 0.5, 9), dict(A=4))
    launcher.planned(("plan", 1), (2,), (x, y, 5, 1, 0.5, 9), dict(A=4))  # stride 1: compiles
    with pytest.raises(AssertionError, match="plan key"):
        launcher.planned(("plan", 1), (2,), (x, y, 5, 1, 0.5, 9), dict(A=4))


def test_suite_runs_with_plan_key_verification():
    assert launch_mod.VERIFY_PLAN_KEYS  # tests/conftest.py sets it before openmsa is imported


def test_gluon_descriptor_arguments(compiled, monkeypatch):
    """A Gluon TMA descriptor argument (the Hopper prefill launches) is passed as itself (the
    compiled launcher encodes it); the full path keys it by dtype, box, layout, shape and
    strides, a plan key not at all (its base is 16-byte aligned: the descriptor checks)."""
    monkeypatch.setattr(launch_mod, "VERIFY_PLAN_KEYS", False)
    launcher = launch_mod.Launcher(_probe_kernel)
    x = torch.zeros(64)
    cache = torch.zeros(4, 128, 128, dtype=torch.bfloat16)

    def desc(t, box=(64, 128)):
        return launch_mod.tma_descriptor(t, (t.shape[0] * 128, 128), (128, 1), box)
    d = desc(cache)
    for _ in range(3):  # miss (compiles), full-path hit, planned hit
        launcher.planned(("plan", 2), (2,), (x, d, 5, 32, 0.5, 9), dict(A=4))
    assert len(compiled) == 1 and len(compiled[0].launches) == 2
    assert compiled[0].launches[-1][10] is d and compiled[0].launches[-1][9] == x.data_ptr()
    # another box: another kernel on the full path; the same form over another tensor: not
    launcher((2,), x, desc(cache, (128, 128)), 5, 32, 0.5, 9, A=4)
    assert len(compiled) == 2
    launcher((2,), x, desc(cache.clone()), 5, 32, 0.5, 9, A=4)
    assert len(compiled) == 2


def test_cp_kernels_launch_through_the_cached_launcher(compiled, monkeypatch):
    """ops/indexer/kernels/cp.py's two kernels run through Launch.run (launch_planned) under a
    plan cached by call key: a repeated call compiles nothing, and the suite's VERIFY_PLAN_KEYS
    checks on every call that the key names Triton's own specialisation (other ranks, widths,
    rules and a strided out among the calls)."""
    from openmsa.ops.indexer import api as cp
    from openmsa.ops.indexer.kernels import cp as kcp
    for fn in (kcp._local_keys_kernel, kcp._merge_kernel):  # fresh launchers, dropped after
        monkeypatch.setattr(fn, "_openmsa_launcher", launch_mod.Launcher(fn), raising=False)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    seq = torch.tensor([300, 700], dtype=torch.int32)
    calls = 0
    for _ in range(3):
        for cp_size, cp_rank, topk in [(1, 0, 4), (2, 0, 4), (2, 1, 4), (2, 1, 2)]:
            rule = dict(topk=topk, init_blocks=1, local_blocks=1, block_size=128)
            scores = torch.zeros(3, 2, -(-6 // cp_size))
            keys, position = cp.local_candidates_kernel(scores, cu, seq, cp_size=cp_size,
                                                        cp_rank=cp_rank, max_blocks=6, **rule)
            cand = keys.unsqueeze(2).expand(3, 2, cp_size, keys.shape[2])
            out = torch.empty(2, 3, topk, dtype=torch.int32).transpose(0, 1)
            for o in (None, out):
                cp.merge_candidates_kernel(cand, position, out=o, **rule)
            calls += 3
    # the first round compiled or found every kernel, the next two launched them cached
    assert sum(len(c.launches) for c in compiled) == calls - len(compiled)
    assert len(compiled) <= calls // 3


@pytest.mark.reference
def test_show_plans_logs_each_plan_made_once(monkeypatch, caplog):
    # OPENMSA_SHOW_PLANS=1: a plan is logged when it is made (not on a cache hit), at INFO even
    # where the root logger keeps warnings only
    import logging

    from openmsa.ops.common.plan import Launch, LaunchPlan
    monkeypatch.setattr(launch_mod, "SHOW_PLANS", True)
    logging.getLogger().setLevel(logging.WARNING)
    cache = launch_mod.PlanCache("attention")
    made = []

    def make():
        made.append(1)
        return LaunchPlan([Launch("token", (4, 2), dict(num_warps=4))], dict(splits=2))
    for _ in range(3):
        cache.get_or_plan(("key",), make)
    assert len(made) == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "openmsa.plans"]
    assert len(logged) == 1 and "openmsa plan for attention" in logged[0]
    assert "token grid=(4, 2) num_warps=4" in logged[0] and "splits" in logged[0]
