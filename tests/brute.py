# SPDX-License-Identifier: Apache-2.0
"""Brute-force MSA in plain Python loops, one token, head and block at a time: the independent
check of the reference on small cases (slow on purpose, written from docs/spec.md's text)."""

import math

import torch


def positions(cu, sl, num_tokens):
    pos = [-1] * num_tokens
    req = [-1] * num_tokens
    for r in range(len(sl)):
        q_len = cu[r + 1] - cu[r]
        if q_len > sl[r]:
            continue
        for i in range(q_len):
            pos[cu[r] + i] = sl[r] - q_len + i
            req[cu[r] + i] = r
    return req, pos


def brute_scores(index_q, index_cache, cu, sl, block_table, block_size):
    num_tokens, num_heads, _ = index_q.shape
    width = block_table.shape[1]
    out = torch.full((num_tokens, num_heads, width), float("-inf"))
    req, pos = positions(cu, sl, num_tokens)
    for t in range(num_tokens):
        if pos[t] < 0:
            continue
        for h in range(num_heads):
            for b in range(pos[t] // block_size + 1):
                page = int(block_table[req[t], b])
                best = float("-inf")
                for j in range(b * block_size, min(pos[t] + 1, (b + 1) * block_size)):
                    dot = float(torch.dot(index_q[t, h].double(),
                                          index_cache[page, j % block_size].double()))
                    if not math.isnan(dot):
                        best = max(best, dot)
                out[t, h, b] = best
    return out


def brute_select(scores_row, n, topk, init, local):
    """One row: the spec's rule written as a loop."""
    if n <= topk:
        chosen = list(range(n))
    else:
        forced = sorted(set(range(min(init, n))) | set(range(n - local, n)))
        rest = [b for b in range(n) if b not in forced]
        key = [(float("-inf") if math.isnan(scores_row[b]) else scores_row[b], -b) for b in rest]
        rest = [b for _, b in sorted(zip(key, rest), reverse=True)]
        chosen = sorted(forced + rest[:topk - len(forced)])
    return chosen + [-1] * (topk - len(chosen))
