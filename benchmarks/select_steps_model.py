# SPDX-License-Identifier: Apache-2.0
"""Offline model of the short-row selection's search (indexer/select_rows.py), on CPU.

Builds the scores of the benchmark's no-context fp8 chunk (8192 tokens, 4 index heads, random
normal queries and keys cast to fp8, as benchmarks/run.py's _index_step draws them) and runs
the kernel's search loop in numpy, row by row in lockstep, to count its steps: per row, and per
8-row warp (a warp's loop runs until its slowest row is done). Two schedules:

* `midpoints`: the kernel's (lower bound from the group maxima, up to 8 value midpoints, then
  key midpoints);
* `interpolated`: regula falsi on the counts from [min, max] for up to 8 steps, then the same
  (tried as select_short_interp: docs/performance.md, "What was tried").

    python3 benchmarks/select_steps_model.py      # ~10 s on 2 cores
    python3 benchmarks/select_steps_model.py --wide   # rows of ~1000 blocks (after 120K)

`--wide` models the chunk after 120K tokens (rows of 961-1024 blocks, a warp per row since
select_short_max 1024; 1024 of its rows, every 32nd token) and compares the loop's lower
bound, the smallest of G group maxima, with a tighter one, the K2-th largest group maximum.
"""

import sys

import numpy as np
import torch

T, H, D, B, NB = 8192, 4, 128, 128, 64
TOPK, INIT, LOCAL, G, W = 16, 0, 1, 16, 4
K2 = TOPK - INIT - LOCAL
VALUE_STEPS = 8


def chunk_scores(seed: int = 0) -> np.ndarray:
    """[T * H, NB] block scores of one 8K chunk with no context (blocks past a token's causal
    count are -inf; the search masks them anyway)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(NB * B, D, generator=g).to(torch.float8_e4m3fn).float()
    q = torch.randn(T, H, D, generator=g).to(torch.float8_e4m3fn).float()
    pos = torch.arange(T)
    out = torch.empty(T, H, NB)
    for c in range(0, T, 512):
        s = (q[c:c + 512].reshape(-1, D) @ keys.T).view(512, H, NB * B)
        s = s.masked_fill(pos[None, None, :] > pos[c:c + 512, None, None], float("-inf"))
        out[c:c + 512] = s.view(512, H, NB, B).amax(-1)
    return out.reshape(T * H, NB).numpy()


def key(x):
    bits = np.asarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def value(k):
    return np.where(k < 0, k ^ 0x7FFFFFFF, k).astype(np.int32).view(np.float32)


def search(v: np.ndarray, n: np.ndarray, interp_steps: int, low=None):
    """Steps per row of the kernel's loop (interp_steps = 0: its midpoint schedule) and the
    final lower bound's key; `low`: the loop's starting lower bound per row instead of the
    kernel's."""
    masked = np.where(np.isnan(v), -np.inf, v)
    hi = key(np.where(masked.max(1) == 0, 0.0, masked.max(1))) + 1
    with np.errstate(invalid="ignore", divide="ignore"):
        if low is not None:
            lo = key(low)
        elif interp_steps:
            lo = key(np.nanmin(np.where(np.isnan(v), np.inf, v), axis=1))
            c_lo, c_hi = n - INIT - LOCAL, np.zeros_like(n)
        else:
            groups = masked.reshape(-1, G, W).max(2)
            valid = (~np.isnan(v)).reshape(-1, G, W).any(2)
            low = np.where(valid.sum(1) >= K2, np.where(valid, groups, np.inf).min(1),
                           np.where(np.isnan(v), np.inf, v).min(1))
            lo = key(low)
    searching = (n > TOPK) & (lo + 1 < hi)
    steps = np.zeros(len(n), int)
    step = 0
    while searching.any():
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)
        lo_v, hi_v = value(lo), value(hi)
        finite = (np.abs(lo_v) < np.inf) & (np.abs(hi_v) < np.inf)
        with np.errstate(all="ignore"):
            if step < interp_steps:
                frac = ((K2 - c_hi) / np.maximum(c_lo - c_hi, 1)).astype(np.float32)
                guess = key((hi_v - (hi_v - lo_v) * frac).astype(np.float32))
            elif step < interp_steps + VALUE_STEPS:
                guess = key((lo_v * np.float32(0.5) + hi_v * np.float32(0.5)).astype(np.float32))
            else:
                guess = mid
        mid = np.where(finite & (guess > lo) & (guess < hi), guess, mid)
        step += 1
        with np.errstate(invalid="ignore"):
            count = (v >= value(mid)[:, None]).sum(1)
        reach = count >= K2
        lo = np.where(searching & reach, mid, lo)
        hi = np.where(searching & ~reach, mid, hi)
        if interp_steps:
            c_lo = np.where(searching & reach, count, c_lo)
            c_hi = np.where(searching & ~reach, count, c_hi)
        steps += searching
        searching &= (count != K2) & (lo + 1 < hi)
    return steps, lo


def wide_rows(tokens: int = 256, context: int = 120 * 1024):
    """Block scores [tokens * H, 1024] of `tokens` of an 8K chunk after `context` tokens (every
    32nd token), and each row's causal block count."""
    nb = 1024
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(nb * B, D, generator=g).to(torch.float8_e4m3fn).float()
    q = torch.randn(tokens, H, D, generator=g).to(torch.float8_e4m3fn).float()
    pos = context + torch.arange(tokens) * (T // tokens)
    s = (q.reshape(-1, D) @ keys.T).view(tokens, H, nb * B)
    s = s.masked_fill(torch.arange(nb * B)[None, None, :] > pos[:, None, None], float("-inf"))
    n = (pos // B + 1)[:, None].expand(tokens, H).reshape(-1).numpy()
    return s.view(tokens, H, nb, B).amax(-1).reshape(tokens * H, nb).numpy(), n


def searched_values(rows, n):
    b = np.arange(rows.shape[1])[None, :]
    live = b < n[:, None]
    forced = live & ((b < INIT) | (b >= n[:, None] - LOCAL))
    v = np.where(live & ~forced, np.where(np.isnan(rows), -np.inf, rows), np.nan)
    return v.astype(np.float32)


def main_wide():
    global G, W
    rows, n = wide_rows()
    v = searched_values(rows, n)
    masked = np.where(np.isnan(v), -np.inf, v)
    kth = -np.sort(-masked, axis=1)[:, K2 - 1]
    for groups, bound in ((16, "min"), (64, "min"), (16, "kth"), (64, "kth"), (256, "kth")):
        G, W = groups, v.shape[1] // groups
        maxima = masked.reshape(-1, G, W).max(2)
        low = maxima.min(1) if bound == "min" else -np.sort(-maxima, axis=1)[:, K2 - 1]
        steps, lo = search(v, n, 0, None if bound == "min" else low)
        with np.errstate(invalid="ignore"):
            reach = (v >= value(lo)[:, None]).sum(1)
            above = (v >= low[:, None]).sum(1)
        ok = bool(((value(lo) == kth) | (reach == K2)).all())
        name = "smallest" if bound == "min" else f"{K2}th largest"
        print(f"lower bound: the {name} of {G} group maxima: {above.mean():.1f} values reach "
              f"it, steps per row {steps.mean():.2f} (max {steps.max()}), thresholds exact: "
              f"{ok}")


def main():
    if "--wide" in sys.argv:
        return main_wide()
    rows = chunk_scores()
    n = np.arange(T * H) // H // B + 1
    b = np.arange(NB)[None, :]
    live = b < n[:, None]
    forced = live & ((b < INIT) | (b >= n[:, None] - LOCAL))
    v = np.where(live & ~forced, np.where(np.isnan(rows), -np.inf, rows), np.nan)
    v = v.astype(np.float32)
    kth = -np.sort(-np.where(np.isnan(v), -np.inf, v), axis=1)[:, K2 - 1]
    searched = n > TOPK
    for name, interp in (("midpoints", 0), ("interpolated", 8)):
        steps, lo = search(v, n, interp)
        # the threshold found is the K2-th largest value, or below it with exactly K2 above
        with np.errstate(invalid="ignore"):
            reach = (v >= value(lo)[:, None]).sum(1)
        ok = searched <= ((value(lo) == kth) | (reach == K2))
        warp = steps.reshape(-1, 8).max(1)[searched.reshape(-1, 8).any(1)]
        print(f"{name:12s} rows searched {searched.sum()}: steps per row "
              f"{steps[searched].mean():.2f} (max {steps.max()}), per 8-row warp "
              f"{warp.mean():.2f}, thresholds exact: {bool(ok.all())}")


if __name__ == "__main__":
    main()
