# SPDX-License-Identifier: Apache-2.0
"""A scalar model of select_rows.py's per-row search, checked against the reference selection,
and its step counts. Runs on CPU in seconds; the Gluon kernel itself runs only on the GPU, so
this is where a change to the search is tried before a device call.

    PYTHONPATH=src python3 scripts/select_rows_model.py           # seconds
    PYTHONPATH=src python3 scripts/select_rows_model.py --bench   # ~10 s

Prints the number of mismatches with `reference.select_from_scores` on random rows (normal,
integer and special values: NaN, +-inf, -0.0; topk, init, local and widths varied), then, per
number of candidates a step (1: the kernel's bisection, which it keeps for rows of more than
64 blocks; 2^d - 1: the interval split in 2^d parts, forms tried on rows of <= 64 blocks
before those were sorted: docs/history/tried.md) and of
value-midpoint steps V (the kernel takes 8), the search's steps on rows of 17-64 blocks: per row,
and the largest of 8 consecutive rows (a warp of TPR = 4 threads per row runs until its slowest
row ends). `--bench` counts the same on the rows of the benchmark's no-context fp8 chunk
(8192 tokens, 4 index heads, normal queries and keys cast to fp8, as
benchmarks/run.py's _index_step draws them).
"""

import sys

import numpy as np
import torch

from openmsa.ops.indexer import reference


def key(x) -> int:
    bits = int(np.float32(x).view(np.int32))
    return bits ^ 0x7FFFFFFF if bits < 0 else bits


def value(k: int) -> np.float32:
    bits = k ^ 0x7FFFFFFF if k < 0 else k
    return np.int32(bits).view(np.float32)


def midpoint(lo: int, hi: int, by_value: bool) -> int:
    """The search's candidate in [lo, hi): the keys' midpoint, or the values' where by_value and
    it lies strictly inside."""
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)
    if by_value:
        lo_v, hi_v = value(lo), value(hi)
        with np.errstate(all="ignore"):
            v = np.float32(lo_v * np.float32(0.5) + hi_v * np.float32(0.5))
        if np.isfinite(lo_v) and np.isfinite(hi_v) and lo < key(v) < hi:
            mid = key(v)
    return mid


def split(lo: int, hi: int, cands: int, by_value: bool) -> list[int]:
    """cands = 2^d - 1 candidates in [lo, hi), ascending: the midpoint, then those of the two
    halves (d - 1 levels)."""
    if cands == 0:
        return []
    m = midpoint(lo, hi, by_value)
    return split(lo, m, cands // 2, by_value) + [m] + split(m, hi, cands // 2, by_value)


def select_row(s, n, topk, init, local, groups, width, value_steps, steps_out, cands=1):
    """select_rows.py's selection of one row (scores s, n causal blocks); ids, -1 padded."""
    seg = groups * width
    b = np.arange(seg)
    live = b < n
    forced = live & ((b < init) | (b >= n - local))
    ss = np.full(seg, -np.inf, np.float32)
    ss[:min(n, len(s))] = s[:min(n, len(s))]
    v = np.where(live & ~forced, np.where(np.isnan(ss), -np.inf, ss), np.nan).astype(np.float32)
    k2 = topk - init - local
    if n <= topk:
        picked = live
    elif k2 == 0:
        picked = forced
    else:
        high = np.nanmax(v)
        hi = key(np.float32(0.0) if high == 0 else high) + 1
        gm = np.array([np.nanmax(g) if not np.isnan(g).all() else np.nan
                       for g in v.reshape(groups, width)], np.float32)
        low = np.nanmin(gm) if (~np.isnan(gm)).sum() >= k2 else np.nanmin(v)
        lo = key(low)
        step = 0
        searching = lo + 1 < hi
        while searching:
            # cands = 2^d - 1 candidates a step split [lo, hi) into 2^d parts
            mids = split(lo, hi, cands, step < value_steps)
            step += 1
            with np.errstate(invalid="ignore"):
                counts = [int(np.sum(v >= value(m))) for m in mids]
            lo_count = -1
            for m, count in zip(mids, counts):
                if count >= k2:
                    lo, lo_count = m, count
            hi = next((m for m, count in zip(mids, counts) if count < k2), hi)
            searching = lo_count != k2 and lo + 1 < hi
        steps_out.append(step)
        t = value(lo)
        with np.errstate(invalid="ignore"):
            above, tied = v > t, v == t
        picked = forced | above | (tied & (np.cumsum(tied) <= k2 - above.sum()))
    ids = b[picked]
    out = np.full(topk, -1)
    out[:len(ids)] = ids
    return out


def chunk_scores(tokens=8192, heads=4, dim=128, block=128, seed=0) -> np.ndarray:
    """[tokens * heads, tokens / block] block scores of one chunk with no context (blocks past a
    token's causal count are -inf)."""
    nb = tokens // block
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(nb * block, dim, generator=g).to(torch.float8_e4m3fn).float()
    q = torch.randn(tokens, heads, dim, generator=g).to(torch.float8_e4m3fn).float()
    pos = torch.arange(tokens)
    out = torch.empty(tokens, heads, nb)
    for c in range(0, tokens, 512):
        s = (q[c:c + 512].reshape(-1, dim) @ keys.T).view(-1, heads, nb * block)
        s = s.masked_fill(pos[None, None, :] > pos[c:c + 512, None, None], float("-inf"))
        out[c:c + 512] = s.view(-1, heads, nb, block).amax(-1)
    return out.reshape(tokens * heads, nb).numpy()


def main_bench(heads=4, block=128):
    rows = chunk_scores(heads=heads, block=block)
    n = np.arange(rows.shape[0]) // heads // block + 1
    for cands, value_steps in ((1, 8), (3, 4), (3, 8), (7, 2), (7, 3), (7, 4), (15, 2)):
        steps = np.zeros(len(n), int)
        for i in range(len(n)):
            out = []
            select_row(rows[i], int(n[i]), 16, 0, 1, 16, rows.shape[1] // 16, value_steps, out,
                       cands)
            steps[i] = out[0] if out else 0
        searched = n > 16
        warp = steps.reshape(-1, 8).max(1)[searched.reshape(-1, 8).any(1)]
        warp4 = steps.reshape(-1, 4).max(1)[searched.reshape(-1, 4).any(1)]
        print(f"cands {cands} V={value_steps}: rows searched {searched.sum()}: steps per row "
              f"{steps[searched].mean():.2f} (max {steps.max()}), per 8-row warp "
              f"{warp.mean():.2f}, per 4-row warp {warp4.mean():.2f}")


def main():
    if "--bench" in sys.argv:
        return main_bench()
    rng = np.random.default_rng(0)
    bad = trials = 0
    for trial in range(3000):
        topk = int(rng.choice([4, 8, 16, 16, 16, 64]))
        init, local = int(rng.integers(0, 3)), int(rng.integers(1, 3))
        if init + local > topk:
            continue
        width = int(rng.integers(1, 65))
        seg = max(1 << (width - 1).bit_length(), 4)
        groups = min(1 << (topk - 1).bit_length(), seg)
        n = int(rng.integers(0, width + 1))
        if trial % 3 == 0:
            s = rng.standard_normal(width).astype(np.float32)
        else:
            s = rng.integers(-3, 4, width).astype(np.float32)
            if trial % 3 == 2:
                m = rng.random(width)
                s[m < 0.1] = np.nan
                s[(m >= 0.1) & (m < 0.2)] = -np.inf
                s[(m >= 0.2) & (m < 0.25)] = np.inf
                s[(m >= 0.25) & (m < 0.4)] = -0.0
        # (one candidate a step on even trials, three on odd)
        got = select_row(s, n, topk, init, local, groups, seg // groups, 8, [],
                         1 + 2 * (trial % 2))
        want = reference.select_from_scores(
            torch.from_numpy(s).view(1, 1, width), torch.tensor([n * 128 - 1 if n else -1]),
            topk=topk, init_blocks=init, local_blocks=local, block_size=128)[0, 0].numpy()
        trials += 1
        bad += not np.array_equal(got, want)
    print(f"mismatches: {bad} of {trials} rows")
    for cands, value_steps in ((1, 0), (1, 8), (3, 4), (3, 8), (3, 99)):
        for dist in ("normal", "uniform", "integer"):
            steps = []
            for n in range(17, 65):
                for _ in range(30):
                    s = (rng.standard_normal(64) if dist == "normal" else rng.random(64)
                         if dist == "uniform" else rng.integers(-3, 4, 64)).astype(np.float32)
                    select_row(s, n, 16, 0, 1, 16, 4, value_steps, steps, cands)
            st = np.array(steps)
            warp = st[:len(st) // 8 * 8].reshape(-1, 8).max(1)
            print(f"cands {cands} V={value_steps:2d} {dist:8s} steps per row: mean "
                  f"{st.mean():.1f}, p95 "
                  f"{np.percentile(st, 95):.0f}, max {st.max()}; slowest of 8: mean "
                  f"{warp.mean():.1f}")


if __name__ == "__main__":
    main()
