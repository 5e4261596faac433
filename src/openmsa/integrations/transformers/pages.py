# SPDX-License-Identifier: Apache-2.0
"""The sparse layers' paged caches: one set of page ids for every sparse layer, handed out from a
free list; the caches grow by doubling when it runs dry."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ... import nvfp4
from ...layer import MSAAttention


@dataclass
class _Row:
    """One batch row's openmsa sequence: its length and its pages, in order."""
    length: int = 0                       # content tokens written
    pages: list[int] = field(default_factory=list)
    # the same pages as an int32 host tensor (capacity doubling), so that a step's block table
    # is a slice of it: no list copy or tensor build of O(context) per decode step
    table: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))

    def add_pages(self, pages: list[int]) -> None:
        n, m = len(self.pages), len(self.pages) + len(pages)
        if m > self.table.numel():
            grown = torch.empty(max(m, 2 * self.table.numel(), 16), dtype=torch.int32)
            grown[:n] = self.table[:n]
            self.table = grown
        self.table[n:m] = torch.tensor(pages, dtype=torch.int32)
        self.pages.extend(pages)


class PagedCaches:
    """The K, V and index caches of every sparse layer (`caches[layer]`), over one page table:
    a page id names the same page in each layer's caches, each on its layer's own device."""

    def __init__(self, block_size: int, kv_dtype: torch.dtype, index_dtype: torch.dtype,
                 initial_pages: int | None):
        self.block_size = block_size
        self.kv_dtype, self.index_dtype = kv_dtype, index_dtype
        self.initial_pages = initial_pages
        self.layers: dict[int, MSAAttention] = {}
        self.caches: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.num_pages = 0
        self.free: list[int] = []

    def _allocate(self, layer: int, pages: int):
        c, b = self.layers[layer].config, self.block_size
        kw = dict(device=self.layers[layer].qkv_weight.device)  # the layer's own GPU
        k = torch.zeros(pages, b, c.num_kv_heads, c.head_dim, dtype=self.kv_dtype, **kw)
        v = torch.zeros_like(k)
        ic = torch.zeros(nvfp4.index_cache_shape(pages, b, c.index_head_dim, self.index_dtype),
                         dtype=self.index_dtype, **kw)
        return k, v, ic

    def grow(self, need: int) -> None:
        """At least `need` more pages in every layer's caches, the pages written kept."""
        old = self.num_pages
        new = max(old * 2, old + need, self.initial_pages or 0, 16)
        for layer in self.layers:
            fresh = self._allocate(layer, new)
            if old:
                for dst, src in zip(fresh, self.caches[layer]):
                    dst[:old].copy_(src)
            self.caches[layer] = fresh
        self.free.extend(range(new - 1, old - 1, -1))
        self.num_pages = new

    def take(self, n: int) -> list[int]:
        if len(self.free) < n:
            self.grow(n - len(self.free))
        taken = self.free[-n:] if n else []
        del self.free[len(self.free) - n:]
        return taken

    def release(self, rows: list[_Row]) -> None:
        """The rows' pages back to the free list; the rows are left empty."""
        for row in rows:
            self.free.extend(reversed(row.pages))
            row.pages = []
            row.table = torch.empty(0, dtype=torch.int32)
