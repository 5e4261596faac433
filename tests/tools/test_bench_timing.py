# SPDX-License-Identifier: Apache-2.0
"""The benchmark's device-time bookkeeping (benchmarks/run.py), on made-up profiler events: the
tables in docs/performance.md are only as right as these few lines."""

import sys

import pytest

pytestmark = pytest.mark.reference

run = pytest.importorskip("run")

FLUSH = "_bench_l2_flush_kernel"


def test_union_counts_overlap_once():
    # a dependent launch (PDL) starting inside its predecessor, one nested in it, a gap
    assert run._union_length([(0, 10), (8, 15), (9, 12), (20, 21)]) == 16
    assert run._union_length([]) == 0
    assert run._union_length([(5, 5)]) == 0


def test_split_calls_alternating_functions():
    """Calls alternate over the functions, each after a flush kernel; events before the first
    flush (warm-up) and the flushes themselves do not count, unsorted input is sorted."""
    events = [
        (-5, -1, "warmup_kernel"),
        (0, 60, FLUSH), (61, 70, "ours_scores"), (68, 72, "ours_select"),   # ours: 11
        (73, 133, FLUSH), (140, 150, "fi_proxy"), (151, 153, "fi_topk"),    # FlashInfer: 12
        (154, 214, FLUSH), (215, 224, "ours_scores"),                       # ours: 9
        (225, 285, FLUSH),                                                  # FlashInfer: none
    ]
    ours, theirs = run.split_calls(list(reversed(events)), 2)
    assert ours == [11, 9]
    assert theirs == [12, 0]
    assert run.split_calls(events, 1) == [[11, 12, 9, 0]]


def test_parts_add_up_to_the_call():
    """A dependent launch that starts early and waits adds only what runs past its
    predecessor's end; a kernel inside another adds nothing; a kernel launched twice sums; each
    call's parts add up to its union (split_calls)."""
    events = [
        (0, 60, FLUSH), (61, 70, "scores"), (62, 74, "select"), (75, 80, "attn"),
        (76, 78, "inside"), (81, 83, "merge"), (84, 85, "merge"),
        (90, 150, FLUSH), (151, 160, "scores"), (161, 163, "select"),
    ]
    first, second = run.added_by_kernel(events)
    assert first == {"scores": 9, "select": 4, "attn": 5, "inside": 0, "merge": 3}
    assert second == {"scores": 9, "select": 2}
    assert [sum(c.values()) for c in (first, second)] == run.split_calls(events, 1)[0]


def test_sm_clock_reads_nvidia_smi(monkeypatch):
    """The prefill rows' clock column: nvidia-smi's SM clock for torch's device, None where
    nvidia-smi is missing or says something else."""
    import subprocess
    from types import SimpleNamespace
    seen = []

    def fake(cmd, **kwargs):
        seen.append(cmd)
        return SimpleNamespace(stdout=reply)
    monkeypatch.setattr(run.torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(subprocess, "run", fake)
    reply = "1980\n"
    assert run.sm_clock_mhz() == 1980 and seen[0][-2:] == ["-i", "3"]
    reply = "[N/A]\n"
    assert run.sm_clock_mhz() is None

    def missing(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])
    monkeypatch.setattr(subprocess, "run", missing)
    assert run.sm_clock_mhz() is None


@pytest.mark.interpret
def test_gather_roof_reads_each_selected_block(kernel_device):
    """run.py's gather roof reads, per (token, KV head), the K and V tiles of the selected blocks
    through the page table (strided views of a packed cache, one index head per 2 KV heads):
    its sums equal torch's over the same tiles, so the roof times the per-token kernel's
    bytes."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    pages, hkv, bs, d, t, hidx, kk = 6, 2, 16, 32, 5, 1, 3
    packed = torch.randn(pages, hkv, bs, 2 * d, generator=g).to(kernel_device)
    k = packed[..., :d].permute(0, 2, 1, 3)
    v = packed[..., d:].permute(0, 2, 1, 3)
    table = torch.randperm(pages, generator=g).int().view(1, pages).to(kernel_device)
    idx = torch.randint(0, pages, (t, hidx, kk), generator=g).int().to(kernel_device)
    out = torch.empty(t, hkv, d, device=kernel_device)
    run._bench_gather_kernel[(t, hkv)](
        k, v, idx, table, out, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), idx.stride(0), idx.stride(1), HKV=hkv, HIDX=hidx, K=kk, BLOCK=bs, D=d)
    pg = table[0, idx[:, 0].long()].long()                      # [t, kk]
    want = torch.stack([(k[pg, :, h] + v[pg, :, h]).sum((1, 2)) for h in range(hkv)], 1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


def test_tune_cases_filter():
    """tune.py --cases: '|'-separated substrings of the printed case names; none takes all."""
    import argparse
    tune = pytest.importorskip("tune")
    rows = ["dec fp8 B8 L128K q1 H1", "dec fp8 B32 L128K q1 H4", "dec fp8 B1 L128K q4 H4",
            "m3-tp1 fp8 s16 j0.2"]

    def pick(cases):
        return [r for r in rows if tune.wanted(argparse.Namespace(cases=cases), r)]
    assert pick("") == rows
    assert pick("B8 L128K|B1 L128K") == [rows[0], rows[2]]
    assert pick("s1 j") == []  # 's16 j' does not contain 's1 j'
    assert pick("fp8 s1") == [rows[3]]


def test_tune_varies_every_attention_and_cache_knob():
    """Every field of AttentionConfig and of each of its forms, and every CacheConfig field,
    is a variant tune.py can name: run.attention_config takes a form's fields as a dict, and
    the cache's fields go to dataclasses.replace."""
    import dataclasses

    from openmsa.ops.attention.plan import DEFAULT
    from openmsa.ops.cache.plan import DEFAULT as CACHE_DEFAULT
    for field in dataclasses.fields(DEFAULT):
        value = getattr(DEFAULT, field.name)
        if dataclasses.is_dataclass(value):
            for sub in dataclasses.fields(value):
                old = getattr(value, sub.name)
                changed = (not old if isinstance(old, bool) else
                           None if old is None else 2 * old)
                config = run.attention_config({field.name: {sub.name: changed}})
                assert getattr(getattr(config, field.name), sub.name) == changed
        elif not isinstance(value, bool):
            assert getattr(run.attention_config({field.name: 2 * value}), field.name) == 2 * value
    for field in dataclasses.fields(CACHE_DEFAULT):
        value = getattr(CACHE_DEFAULT, field.name)
        assert getattr(dataclasses.replace(CACHE_DEFAULT, **{field.name: 2 * value}),
                       field.name) == 2 * value


def test_grid_restriction_keeps_only_named_values(monkeypatch):
    """--contexts / --batches restrict every grid's contexts / batches to the values named, and
    a grid that would be left with none keeps its own (the restriction is for one run)."""
    import shapes
    # the real grids restricted are copies, put back after the test
    for name, value in list(vars(shapes).items()):
        if isinstance(value, dict):
            monkeypatch.setattr(shapes, name, dict(value))
    grids = {"a": dict(contexts=(1, 2, 3), batches=(8, 32)), "b": dict(contexts=(5,))}
    for name, grid in grids.items():
        monkeypatch.setattr(shapes, f"_TEST_GRID_{name}", grid, raising=False)
    run._restrict_grids("contexts", {2, 3})
    run._restrict_grids("batches", {32, 64})
    assert grids["a"] == dict(contexts=(2, 3), batches=(32,))
    assert grids["b"] == dict(contexts=(5,))


def test_dtype_restriction_and_unknown_names(monkeypatch):
    """--dtypes restricts the peers' and the openmsa-only dtypes together (a grid naming none of
    them keeps its own); an unknown name is refused by name."""
    import subprocess

    import shapes
    for name, value in list(vars(shapes).items()):
        if isinstance(value, dict):
            monkeypatch.setattr(shapes, name, dict(value))
    grids = {"a": dict(dtypes=("bf16", "fp8"), openmsa_only_dtypes=("nvfp4",)),
             "b": dict(dtypes=("bf16",))}
    for name, grid in grids.items():
        monkeypatch.setattr(shapes, f"_TEST_GRID_{name}", grid, raising=False)
    run._restrict_dtypes({"nvfp4"})
    assert grids["a"] == dict(dtypes=(), openmsa_only_dtypes=("nvfp4",))
    assert grids["b"] == dict(dtypes=("bf16",))
    done = subprocess.run([sys.executable, run.__file__, "--dry-run", "--dtypes", "fp8,fp9"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "unknown dtypes ['fp9']" in done.stderr


def test_revision_names_a_modified_tree(monkeypatch, tmp_path):
    """The provenance line's commit: a given revision wins; else git's HEAD, marked where the
    tracked files differ from it (a stale .git in a copied tree must not name the wrong code)."""
    import subprocess
    monkeypatch.delenv("OPENMSA_REVISION", raising=False)
    assert run._revision(str(tmp_path)) == "unknown"
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    try:
        subprocess.run(git + ["init", "-q"], check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git is not available")
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run(git + ["add", "a.py"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "a"], check=True)
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert run._revision(str(tmp_path)) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert run._revision(str(tmp_path)) == head + "+modified"
    (tmp_path / "REVISION").write_text("abc1234\n")
    assert run._revision(str(tmp_path)) == "abc1234"
    monkeypatch.setenv("OPENMSA_REVISION", "def5678")
    assert run._revision(str(tmp_path)) == "def5678"


def test_kernel_columns_follow_the_kernel_names():
    # the per-kernel columns sort profiler events by the kernels' names: each of today's kernels
    # lands in its own column, not in "other"
    from openmsa.ops.attention.kernels import tile, token
    from openmsa.ops.cache.kernels import prepare
    from openmsa.ops.indexer.kernels import scores, scores_gluon, scores_nvfp4, select, select_rows
    columns = {scores._block_scores_kernel: "score", scores_gluon._block_scores_gluon_kernel:
               "score", scores_nvfp4._nvfp4_decode_kernel: "score",
               select_rows._short_rows_topk_kernel: "topk", select._segment_topk_kernel: "topk",
               select._merge_topk_kernel: "topk-merge", prepare._fused_prepare_kernel: "prep",
               token._sparse_attention_kernel: "attn", token._merge_splits_kernel: "attn-merge",
               tile._tile_plan_kernel: "attn-plan", tile._sparse_attention_tile_kernel:
               "attn-tile"}
    for kernel, column in columns.items():
        name = getattr(kernel, "__name__", None) or kernel.fn.__name__
        assert run._short(name) == column, name


def test_failure_reason_keeps_the_compiler_errors():
    """A JIT build's failure says only 'build failed' on its first line: the reason a row keeps
    (engine_dense_<backend>_failed) takes the error lines after it, on one line."""
    e = RuntimeError("Ninja build failed. Ninja output:\n[1/3] nvcc -c a.cu\n"
                     "a.cu(12): error: identifier \"x\" is undefined\n\n"
                     "1 error detected in the compilation of \"a.cu\".\nninja: build stopped")
    why = run.failure_reason(e)
    assert why == ('RuntimeError: Ninja build failed. Ninja output: | a.cu(12): error: '
                   'identifier "x" is undefined | 1 error detected in the compilation of "a.cu".')
    assert run.failure_reason(ValueError("bad shape")) == "ValueError: bad shape"
    assert len(run.failure_reason(RuntimeError("error " * 200))) == 400
