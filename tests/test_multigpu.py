# SPDX-License-Identifier: Apache-2.0
"""Multi-GPU runs (issue 43): one process per GPU over NCCL (tests/helpers/multigpu_worker.py),
world sizes 2 and 4:

* the context-parallel selection (select_blocks(cp_group=...)) bit-identical to one GPU's
  select_blocks(cp_group=None) on mixed decode/verify/prefill steps, fp8 and bf16 caches,
  replicated and sharded index caches;
* the same captured in a CUDA graph (the NCCL all-gather inside it), replayed with new lengths,
  tables, queries and keys: equal to the eager one-GPU selection after each replay;
* MSAAttention at TP2/TP4 with the engine's all-reduce of the o_proj partial outputs: equal to
  the TP1 layer within bf16 tolerance over prefill, decode and verify steps, with and without
  cp_group.

The gpu-marked tests skip (and only skip) where fewer GPUs than the world size are present:

    PYTHONPATH=src python3 -m pytest -q -rs tests/test_multigpu.py
    bash scripts/gpu_check.sh multigpu      # the tests, then benchmarks/cp_multigpu.py

The reference-marked test runs the same worker on CPU over gloo (world size 2, small shapes; the
"graph" is the step function rerun on the same buffers): it proves the workers' logic on any
machine."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_group(world: int, backend: str, checks: str, timeout: float = 900):
    """WORLD worker processes (rank r on cuda:r for nccl), joined through a file:// rendezvous;
    fails with every failing rank's output tail."""
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(HERE), "src")
    env["PYTHONPATH"] = os.pathsep.join([src, HERE, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "init")
        procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "helpers",
                                                                "multigpu_worker.py"),
                                   str(r), str(world), init, backend, checks], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]
        outs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:  # a rank stuck in a collective: end the whole group
                    q.kill()
                out, _ = p.communicate()
                out += f"\n(timed out after {timeout} s)"
            outs.append(out)
    failed = [(r, o[-4000:]) for r, (p, o) in enumerate(zip(procs, outs)) if p.returncode != 0]
    assert not failed, "\n".join(f"--- rank {r}:\n{o}" for r, o in failed)


@pytest.mark.reference
def test_gloo_workers_run_the_multigpu_checks():
    """The NCCL tests' worker on CPU over gloo, world size 2: CP selection (replicated and
    sharded, fp8 and bf16), the rerun-on-the-same-buffers form of the graph check, and the TP2
    layer with the all-reduce against TP1, with and without cp_group."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("the reference tier runs it (reference ops on CPU)")
    run_group(2, "gloo", "select,graph,layer", timeout=300)


def _needs(world):
    return pytest.mark.skipif(GPUS < world, reason=f"needs {world} CUDA GPUs, found {GPUS}")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [pytest.param(2, marks=_needs(2)),
                                   pytest.param(4, marks=_needs(4))])
def test_nccl_cp_selection(world):
    """select_blocks(cp_group=NCCL group) bit-identical to one GPU, replicated and sharded."""
    run_group(world, "nccl", "select")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [pytest.param(2, marks=_needs(2)),
                                   pytest.param(4, marks=_needs(4))])
def test_nccl_cp_selection_in_a_cuda_graph(world):
    """The CP selection with its NCCL all-gather captured in a CUDA graph, replayed with new
    inputs in the same buffers: equal to the eager one-GPU selection after each replay."""
    run_group(world, "nccl", "graph")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [pytest.param(2, marks=_needs(2)),
                                   pytest.param(4, marks=_needs(4))])
def test_nccl_tensor_parallel_layer(world):
    """MSAAttention at TP world with the all-reduce of o_proj against TP1, with and without
    cp_group (sharded index cache), bf16 and fp8 index caches."""
    run_group(world, "nccl", "layer")
