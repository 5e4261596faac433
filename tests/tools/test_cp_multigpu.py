# SPDX-License-Identifier: Apache-2.0
"""benchmarks/cp_multigpu.py (the context-parallel collective's cost) on CPU: its NCCL runs are
scripts/gpu_check.sh multigpu's."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.reference
def test_cp_multigpu_benchmark_smoke(tmp_path):
    """benchmarks/cp_multigpu.py's whole path (spawned ranks, timing, gather, JSON, table) over
    gloo on CPU with tiny shapes: every CP selection exact."""
    import json
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("the reference tier runs it (reference ops on CPU)")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    script = os.path.join(REPO, "benchmarks", "cp_multigpu.py")
    p = subprocess.run([sys.executable, script, "--cpu", "--world", "2", "--iters", "2",
                        "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads((tmp_path / "cp_multigpu-w2.json").read_text())
    assert len(data["rows"]) == 4 and all(r["exact"] for r in data["rows"])
    for s in data["summary"]:
        assert s["cp_device_us"] > 0 and s["coll_eager_us"] > 0 and s["coll_share_device"] > 0
    assert "share" in p.stdout
