# SPDX-License-Identifier: Apache-2.0
"""benchmarks/nvfp4_recall.py, docs/performance.md's NVFP4 quality table, at a small context."""

import pytest
import torch

pytestmark = pytest.mark.reference


def test_recall_benchmark_runs_every_key_set(tmp_path, monkeypatch):
    """benchmarks/nvfp4_recall.py (docs/performance.md's quality table) runs its five key sets,
    the small model's among them, at a small context: recalls are fractions, and a selection
    recalls itself whole."""
    import json
    import sys
    recall = pytest.importorskip("nvfp4_recall")
    out = tmp_path / "recall.json"
    monkeypatch.setattr(sys, "argv", ["nvfp4_recall.py", "--context", "2048", "--tokens", "8",
                                      "--seeds", "1", "--out", str(out)])
    recall.main()
    rows = json.loads(out.read_text())
    assert [r["keys"] for r in rows] == ["iid", "outliers", "topical", "model-uniform",
                                         "model-topical"]
    assert all(0 < r["fp8_recall"] <= 1 and 0 < r["nvfp4_recall"] <= 1 for r in rows)
    q, keys = recall._model_inputs("model-topical", 2048, 8, torch.Generator().manual_seed(0))
    assert q.shape == (8, 4, 128) and keys.shape == (2048, 128)
    sel = recall._select(q, keys, 2048, 8)
    assert recall._recall(sel, sel, 2048, 8) == 1.0
