# SPDX-License-Identifier: Apache-2.0
"""benchmarks/plot.py and benchmarks/perf_doc.py on a made-up bench.json of run.py's schema:
the figures and the generated doc section come out of one command each. The figures need
matplotlib (the `bench` extra); the doc section does not."""

import json
import os

import pytest

pytestmark = pytest.mark.reference

plot = pytest.importorskip("plot")
perf_doc = pytest.importorskip("perf_doc")

K = 1024


def _rows():
    rows = [dict(section="ceilings", copy_tbs=4.4, bf16_tflops=790.0)]
    for b in (1, 32):
        for L in (32 * K, 128 * K, 1024 * K):
            base = L * b / 4e6
            rows.append(dict(section="indexer-decode", model="m3-tp1", dtype="fp8", L=L, B=b,
                             q_len=1, us=base + 8, call_us=base + 9, tbs=3.9, pct_copy=88.0,
                             fi_us=base + 9, fi_ratio=0.95, ratio=0.95, fi_call_us=120.0,
                             fi_graph_us=base + 10, same_rows=0.99, fi_rows_differ=2,
                             fi_rows_beyond_ties=0, fi_agrees=True, vllm_us=base + 12,
                             vllm_ratio=0.8, vllm_call_us=90.0, vllm_graph_us=None,
                             vllm_graph="not captured: RuntimeError: made up",
                             vllm_rows_differ=40, vllm_rows_beyond_ties=3, vllm_agrees=False,
                             dense_us=base * 30 if b == 1 else None))
            rows.append(dict(section="indexer-decode", model="m3-tp1", dtype="nvfp4", L=L, B=b,
                             q_len=1, us=base * 0.6 + 8, call_us=base * 0.6 + 9, tbs=3.5,
                             query="fp8"))
    rows.append(dict(section="indexer-decode", model="m3-tp4", dtype="nvfp4", L=32 * K, B=8,
                     q_len=4, note="not run: NotImplementedError: made up"))
    rows.append(dict(section="indexer-prefill", model="m3-tp4", dtype="fp8", context=0, T=8192,
                     us=33.7, call_us=35.0, tflops=300.0, fi_us=18.8, fi_ratio=1.79,
                     fi_graph_us=19.5, fi_call_us=60.0, vllm_us=25.0, vllm_ratio=1.35,
                     vllm_graph_us=26.0, vllm_call_us=70.0, vllm_rows_differ=0,
                     vllm_rows_beyond_ties=0, vllm_agrees=True))
    rows.append(dict(section="attention-decode", model="m3-tp1", dtype="fp8", B=8, q_len=1,
                     L=64 * K, us=12.0, call_us=13.0, tbs=3.0, fi_us=12.5, fi_ratio=0.96,
                     fi_graph_us=13.2, fi_call_us=80.0, max_diff_vs_fi=0.004, fi_agrees=True,
                     vllm="not run"))
    rows.append(dict(section="attention-prefill", model="m3-tp4", dtype="bf16", context=8 * K,
                     T=8192, selections="independent", us=800.0, tflops=140.0,
                     vllm_us=900.0, vllm_ratio=0.89, vllm_call_us=950.0, max_diff_vs_vllm=0.01,
                     vllm_agrees=True))
    rows.append(dict(section="layer-prefill", model="m3-tp1", dtype="fp8", B=1, L=128 * K,
                     q_len=8192, us=3900.0, dense_bf16_us=98000.0, speedup=25.1,
                     engine_dense_attn_us=30000.0, engine_dense_backend="fa2",
                     speedup_engine=7.7))
    for model in ("m3-tp1", "m3-tp4"):
        for L in (32 * K, 128 * K, 512 * K, 1024 * K):
            for dname in ("bf16", "fp8", "nvfp4"):
                rows.append(dict(section="layer-decode", model=model, dtype=dname, B=32, L=L,
                                 q_len=1, us=50.0 + L / 1e4, call_us=55.0 + L / 1e4,
                                 dense_bf16_us=L / 100, speedup=(L / 100) / (50.0 + L / 1e4)))
    return rows


@pytest.fixture
def bench(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"provenance": "# made-up GPU @ test", "rows": _rows()}))
    return str(path)


def test_series_skip_disagreeing_peers():
    rows = _rows()
    s = plot.indexer_series(rows, 1)
    assert [x for x, _ in s["openmsa fp8"]] == [32 * K, 128 * K, 1024 * K]
    assert "vLLM 0.34 fp8" not in s  # every vLLM row disagrees: not drawn
    assert len(s["FlashInfer fp8"]) == 3 and len(s["openmsa NVFP4 keys"]) == 3
    assert "dense attention (bf16 SDPA)" not in plot.indexer_series(rows, 32)
    layer = plot.layer_series(rows, 32)
    assert set(layer) == {f"{tp}, {kv}" for tp in ("TP1", "TP4")
                          for kv in ("bf16 K/V", "fp8 K/V", "fp8 K/V, NVFP4 keys")}
    # --layer-dtypes: only those rows (a row that a newer results file supersedes left out)
    layer = plot.layer_series(rows, 32, ["bf16", "fp8"])
    assert set(layer) == {f"{tp}, {kv}" for tp in ("TP1", "TP4") for kv in ("bf16 K/V", "fp8 K/V")}
    # a row with the speed-up over FlashInfer's dense attention adds that series
    engine = [dict(r, speedup_engine=r["speedup"] * 0.8) if r["section"] == "layer-decode"
              and r["model"] == "m3-tp1" and r["dtype"] == "fp8" else r for r in rows]
    layer = plot.layer_series(engine, 32, ["fp8"])
    assert set(layer) == {"TP1, fp8 K/V", "TP4, fp8 K/V", "TP1, fp8 K/V, over FlashInfer's dense"}
    assert [y for _, y in layer["TP1, fp8 K/V, over FlashInfer's dense"]] == pytest.approx(
        [y * 0.8 for _, y in layer["TP1, fp8 K/V"]])


def test_default_panels_are_in_the_run_grids():
    """plot.py's default batch sizes are rows of run.py's indexer-decode grid, --quick too."""
    shapes = pytest.importorskip("shapes")
    default = {int(b) for b in plot.DEFAULT_BATCHES.split(",")}
    for grid in (shapes.INDEXER_DECODE, shapes.INDEXER_DECODE_QUICK):
        assert default <= set(grid["batches"])


def test_figures_written(bench, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "figures"
    written = plot.main([bench, "--out", str(out)])
    assert sorted(os.path.basename(w) for w in written) == ["indexer_decode.png",
                                                            "layer_speedup.png"]
    for w in written:
        with open(w, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # a file without layer rows leaves layer_speedup.png as it was
    only_indexer = tmp_path / "indexer.json"
    only_indexer.write_text(json.dumps({"rows": [r for r in _rows()
                                                 if r["section"] != "layer-decode"]}))
    before = (out / "layer_speedup.png").read_bytes()
    assert [os.path.basename(w) for w in plot.main([str(only_indexer), "--out", str(out)])] \
        == ["indexer_decode.png"]
    assert (out / "layer_speedup.png").read_bytes() == before


def test_doc_section_generated(bench, tmp_path):
    doc = tmp_path / "perf.md"
    doc.write_text(f"# title\n\nbefore\n\n{perf_doc.BEGIN}\nold text\n{perf_doc.END}\n\nafter\n")
    perf_doc.main([bench, "--doc", str(doc)])
    text = doc.read_text()
    assert text.startswith("# title\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "old text" not in text and text.count(perf_doc.BEGIN) == 1
    assert "### Decode indexer" in text and "### Prefill indexer" in text
    assert "**40 / 3**" in text  # the disagreeing peer's check, marked
    assert "no graph" in text  # a capture that failed
    assert "not run: NotImplementedError: made up" in text
    assert "_run=" not in text and "_file=" not in text  # the merge's tags stay out of the doc
    # each table names the run and file its rows come from
    assert text.count("Measured: made-up GPU @ test (`bench.json`).") == 6  # 6 sections
    assert "| 25.10 | 7.70 (FA2) |" in text  # the prefill backend FlashInfer's dense row ran
    # twice gives the same doc
    perf_doc.main([bench, "--doc", str(doc)])
    assert doc.read_text() == text


def test_a_later_file_replaces_the_same_cases(bench, tmp_path):
    # a newer run of part of a grid beside an older whole one: a case both hold comes from the
    # later file, in the earlier one's place; the other cases (and every run's ceilings) stay,
    # each row tagged with its run
    newer = tmp_path / "newer.json"
    row = dict(section="indexer-prefill", model="m3-tp4", dtype="fp8", context=0, T=8192,
               us=19.4, tflops=443.0)
    other = dict(section="indexer-decode", model="m3-tp4", dtype="fp8", L=32 * K, B=1,
                 q_len=1, us=7.0)
    newer.write_text(json.dumps({"provenance": "# newer @ later",
                                 "rows": [dict(section="ceilings", copy_tbs=4.3), row, other]}))
    prov, rows = plot.load([bench, str(newer)])
    assert prov == ["# made-up GPU @ test", "# newer @ later"]
    pre = [r for r in rows if r["section"] == "indexer-prefill"]
    assert [r["us"] for r in pre] == [19.4] and pre[0]["_run"] == 1
    assert pre[0]["_file"] == str(newer)
    assert sum(r["section"] == "ceilings" for r in rows) == 2
    decode = [r for r in rows if r["section"] == "indexer-decode"]
    assert len(decode) == 14 and decode[-1]["us"] == 7.0
    assert [r["section"] for r in rows].index("indexer-prefill") \
        < [r["section"] for r in rows].index("attention-decode")
    # in the other order the older file's row replaces the newer one's
    _, rows = plot.load([str(newer), bench])
    assert [r["us"] for r in rows if r["section"] == "indexer-prefill"] == [33.7]
    # a later call that did not get to a case leaves the earlier measurement in place
    skipped = tmp_path / "skipped.json"
    skipped.write_text(json.dumps({"provenance": "# cut short", "rows": [
        {k: row[k] for k in ("section", "model", "dtype", "context", "T")}
        | dict(note="not run: budget")]}))
    _, rows = plot.load([str(newer), str(skipped)])
    pre = [r for r in rows if r["section"] == "indexer-prefill"]
    assert [r["us"] for r in pre] == [19.4] and pre[0]["_run"] == 0


def test_readme_speed_table_from_results(tmp_path):
    # perf_doc.py --readme: one line per section and dtype, ours over each peer's time as in the
    # rows (NVFP4 against the peer's fp8 time on the same step), a later file's row replacing
    # an earlier one's of the same case, and the layer's speed-up; each line names its files,
    # commits and GPU; the text between the README markers is all that changes
    prov = "# NVIDIA H200 (132 SMs), CUDA 13.0, torch 2.11.0, triton 3.6.0, openmsa 0.1.0 @ {}, x"
    step = dict(section="indexer-decode", model="m3-tp1", L=131072, q_len=1)
    old = dict(provenance=prov.format("aaaaaaa"), rows=[
        dict(step, dtype="fp8", B=1, us=9.0, call_us=9.0, fi_us=10.0, fi_graph_us=10.0,
             fi_ratio=0.9, vllm_us=9.0, vllm_ratio=1.0)])
    new = dict(provenance=prov.format("bbbbbbb"), rows=[
        dict(step, dtype="fp8", B=1, us=8.0, call_us=8.0, fi_us=10.0, fi_graph_us=16.0,
             fi_ratio=0.8),
        dict(step, dtype="fp8", B=8, us=20.0, call_us=20.0, fi_us=10.0, fi_graph_us=10.0,
             fi_ratio=2.0, fi_agrees=False),
        dict(step, dtype="nvfp4", B=1, us=5.0, call_us=4.0),
        dict(section="layer-decode", model="m3-tp1", dtype="fp8", B=32, L=1 << 20, q_len=1,
             speedup=15.2), ])
    paths = []
    for name, doc in (("old.json", old), ("new.json", new)):
        paths.append(str(tmp_path / name))
        with open(paths[-1], "w") as f:
            json.dump(doc, f)
    table = perf_doc.headline(paths, str(tmp_path))
    lines = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| ")}
    fp8 = lines["| indexer-decode, fp8 keys"]
    # the newer file's B = 1 row replaced the older one's: FI from its agreeing row (B = 8
    # disagrees), vLLM from none (the newer row has no vLLM time)
    fi_cell, vllm_cell = fp8.split(" | ")[1:3]
    assert fi_cell == "graph 0.500, device 0.800 (0.80-0.80, 1 rows)"
    assert vllm_cell == "-"
    assert "(bbbbbbb, H200)" in fp8 and "aaaaaaa" not in fp8
    # a case only the older file holds stays, with the older file named
    lone = dict(old, rows=[dict(step, dtype="bf16", B=1, us=9.0, call_us=9.0, vllm_us=10.0,
                                vllm_ratio=0.9)])
    with open(tmp_path / "lone.json", "w") as f:
        json.dump(lone, f)
    bf16 = [line for line in perf_doc.headline([str(tmp_path / "lone.json"), *paths],
                                               str(tmp_path)).splitlines()
            if line.startswith("| indexer-decode, bf16 keys")][0]
    assert "device 0.900 (0.90-0.90, 1 rows)" in bf16 and "(aaaaaaa, H200)" in bf16
    assert "graph 0.250, device 0.500 (0.50-0.50, 1 rows) against its fp8 time" \
        in lines["| indexer-decode, nvfp4 keys"]
    assert "fp8 15.2x" in table.splitlines()[-3]
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{perf_doc.README_BEGIN}\nold\n{perf_doc.README_END}\nb\n")
    perf_doc.main(["--readme", str(readme), *paths])
    text = readme.read_text()
    assert text.startswith("a\n") and text.endswith("b\n") and "old" not in text.split("\n")[2]
    assert fp8 in text
