# SPDX-License-Identifier: Apache-2.0
"""benchmarks/resources.py builds kernels for sm_90 on a machine without a GPU (each op's own
sm_90 compile tests are in tests/ops/, through tests/helpers/sm90.py)."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.reference

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("compilation needs the real compiler, not the interpreter", allow_module_level=True)


def test_resources_tool():
    """benchmarks/resources.py (docs/performance.md's offline counts) still compiles its specs
    with the kernels' current signatures, and finds the selection's search loop in the SASS."""
    resources = pytest.importorskip("resources")
    regs, spills, _, per_sm, _ = resources.index_resources("fp8", 128, 32, 3, 4)
    assert 0 < regs <= 255 and per_sm >= 1
    regs, _, _, _, _ = resources.index_resources("fp8", 16, 32, 3, 4, decode=True)
    assert 0 < regs <= 255
    regs, spills, _, _, loops = resources.select_resources("search", 64, 0, 1, sass=True)
    assert spills == 0 and loops, "no search loop (a REDUX in a backward branch) found"
    # the short-row selection (Gluon): its search loop, and its ALU-pipe share counted
    regs, spills, _, _, loops = resources.short_rows_resources(16, 4, 4, 1, sass=True)
    assert spills == 0 and len(loops) == 1, "no search loop (a SHFL in a backward branch)"
    count, _, _, alu = loops[0]
    assert 0 < alu < count
    # the NVFP4 decode launch (Gluon) under its 8-row register cap: its two loops, over the
    # blocks that need no causal mask (two ring units an iteration) and over the rest (one),
    # the first with fewer instructions a unit; 16-row passes have the second alone
    regs, spills, _, per_sm, loops = resources.nvfp4_resources(8, sass=True)
    assert spills == 0 and regs <= 112 and per_sm >= 15 and len(loops) == 2
    (unmasked, _, bars_u, _), (masked, _, bars_m, _) = loops
    assert (bars_u, bars_m) == (4, 2) and masked < unmasked < 2 * masked
    regs, spills, _, per_sm, loops = resources.nvfp4_resources(16, sass=True)
    assert spills == 0 and per_sm >= 15 and len(loops) == 1


def test_sass_diff(tmp_path):
    """benchmarks/sass_diff.py (the evidence that a change moved kernel code without changing
    what runs) finds this tree's merge launch identical to itself and tells a one-constant
    change apart."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    src, tool = os.path.join(root, "src"), os.path.join(root, "benchmarks", "sass_diff.py")
    same = subprocess.run([sys.executable, tool, "--base", src, "amerge:4"],
                          capture_output=True, text=True)
    assert same.returncode == 0 and "amerge:4" in same.stdout and "identical" in same.stdout
    base = tmp_path / "src"
    shutil.copytree(src, base, ignore=shutil.ignore_patterns("__pycache__"))
    token = base / "openmsa" / "ops" / "attention" / "kernels" / "token.py"
    text = token.read_text()
    # the merge's shift for a row whose partials are all -inf: 0.0 -> 1.0
    old = 'shift = tl.where(m == float("-inf"), 0.0, m)'
    assert text.count(old) == 1
    token.write_text(text.replace(old, old.replace("0.0", "1.0")))
    differs = subprocess.run([sys.executable, tool, "--base", str(base), "amerge:4"],
                             capture_output=True, text=True)
    assert differs.returncode == 1 and "DIFFERS" in differs.stdout
