# SPDX-License-Identifier: Apache-2.0
"""benchmarks/stack.py (issue 57's stack of sparse layers in one graph): how many cache sets it
allocates, and its arguments checked before any GPU work."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.reference


def test_cache_sets_one_per_layer_where_memory_holds_them():
    stack = pytest.importorskip("stack")
    gib = 2 ** 30
    assert stack.cache_sets(57, gib // 8, 70 * gib) == 57        # 128K fp8: 57 sets fit
    assert stack.cache_sets(57, int(1.15 * gib), 70 * gib) == 51  # 1M fp8: 51 sets of 1.15 GiB
    assert stack.cache_sets(57, 10 * gib, 5 * gib) == 1           # at least one
    with pytest.raises(ValueError, match="per_set_bytes"):
        stack.cache_sets(57, 0, gib)


def test_arguments_are_checked_first():
    from conftest import BENCHMARKS
    proc = subprocess.run([sys.executable, f"{BENCHMARKS}/stack.py", "--layers", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--layers" in proc.stderr
