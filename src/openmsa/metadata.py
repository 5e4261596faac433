# SPDX-License-Identifier: Apache-2.0
"""plan/run: turn a step's host metadata into device buffers once per step, so that every layer's
run reads the same buffers, synchronises with nothing, and a fixed-shape step can be captured in a
CUDA graph (plan again with new lengths, then replay).

    planner = MSAPlanner(config, max_requests=64, max_tokens=64, max_blocks=8192, device="cuda")
    meta = planner.plan(q_lens, seq_lens, block_table, pad_requests_to=64, pad_tokens_to=64)
    out = layer(hidden, meta, kv_cache, index_cache)          # every layer, no host sync
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

import torch

from ._checks import check_cp_shape
from .batch import token_layout
from .config import MSAConfig

__all__ = ["MSAMetadata", "MSAPlanner", "slots_from_table"]


@dataclass
class MSAMetadata:
    """One step's device metadata, shared by every layer (views of the planner's buffers).

    cu_seqlens_q int32 [R+1], seq_lens int32 [R], block_table and index_block_table int32
    [R, max_blocks], positions int32 [T] (-1 for padding tokens), slot_mapping and
    index_slot_mapping int64 [T] (-1 for padding tokens). max_q_len: the step's longest q_len
    (a host int, None when unknown), which the indexer takes as a speed hint (select_blocks).
    cp: (W, r) of a sharded index cache (MSAPlanner's cp_size / cp_rank), (1, 0)
    for a whole one; the layer checks it against its cp_group, since a table sharded for
    another rank would select wrongly without an error.
    """
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    index_block_table: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    index_slot_mapping: torch.Tensor
    max_q_len: int | None = None
    cp: tuple[int, int] = (1, 0)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def slots_from_table(request: torch.Tensor, position: torch.Tensor, block_table: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """slot = block_table[request, p // B] * B + p % B for each token, -1 where p < 0; device
    ops only (no host sync)."""
    valid = position >= 0
    r = request.long().clamp(max=max(block_table.shape[0] - 1, 0))
    p = position.long().clamp(min=0)
    col = torch.div(p, block_size, rounding_mode="floor").clamp(max=block_table.shape[1] - 1)
    page = block_table.long()[r, col]
    slot = page * block_size + p % block_size
    return torch.where(valid & (page >= 0), slot, torch.full_like(slot, -1))


def _host_ints(name: str, x) -> list[int]:
    """A host sequence of ints (a list, tuple, range, 1-D integer CPU tensor or NumPy array).
    A string is not one ("13" would read as [1, 3]), nor are floats (2.7 would read as 2) or
    bools."""
    if isinstance(x, torch.Tensor):
        if x.is_cuda:
            raise ValueError(f"{name} must be host metadata (a list or a CPU tensor): reading a "
                             f"CUDA tensor here would synchronise")
        x = x.tolist()
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(x).__name__}")
    values = list(x)
    for v in values:
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise TypeError(f"{name} must be a sequence of ints, got an element {v!r}")
    return [operator.index(v) for v in values]


def _host_int_or_none(name: str, x) -> None:
    if x is not None and (isinstance(x, bool) or not isinstance(x, int)):
        raise TypeError(f"{name} must be an int or None, got {x!r}")


class MSAPlanner:
    """Persistent device buffers sized for a capacity, filled by `plan` once per step.

    cp_size, cp_rank: a sharded index cache for context-parallel selection
    (select_blocks(cp_group=...), MSAAttention(cp_group=...)): this rank owns the logical
    blocks b % cp_size == cp_rank of every request. Its index block table then has -1
    at the other blocks and its index slot mapping -1 for tokens in them, so each token's index
    key is written by exactly one rank of the group and a rank's index cache needs pages only for
    its own blocks (1 / cp_size of them). The main KV cache is untouched."""

    def __init__(self, config: MSAConfig, *, max_requests: int, max_tokens: int, max_blocks: int,
                 device: torch.device | str, cp_size: int = 1, cp_rank: int = 0):
        if not isinstance(config, MSAConfig):
            raise TypeError(f"config must be an MSAConfig, got {type(config).__name__}")
        for name, v in (("max_requests", max_requests), ("max_tokens", max_tokens),
                        ("max_blocks", max_blocks)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        check_cp_shape(cp_size, cp_rank, names=("cp_size", "cp_rank"))
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.config = config
        self.max_requests, self.max_tokens, self.max_blocks = max_requests, max_tokens, max_blocks
        self.device = torch.device(device)
        i32 = dict(dtype=torch.int32, device=self.device)
        self._cu = torch.zeros(max_requests + 1, **i32)
        self._seq_lens = torch.zeros(max_requests, **i32)
        self._table = torch.full((max_requests, max_blocks), -1, **i32)
        self._index_table = torch.full((max_requests, max_blocks), -1, **i32)
        self._positions = torch.full((max_tokens,), -1, **i32)
        self._slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=self.device)
        self._index_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=self.device)
        # columns (logical blocks) of the index table this rank does not own
        self._not_owned = (torch.arange(max_blocks, device=self.device) % cp_size
                           != cp_rank)

    def _upload(self, dst: torch.Tensor, values) -> None:
        src = values if isinstance(values, torch.Tensor) else torch.tensor(values,
                                                                           dtype=dst.dtype)
        if self.device.type == "cuda" and not src.is_cuda:
            # pinned + non_blocking: no wait for the GPU; torch keeps the pinned block alive
            # until the copy has run
            src = src.pin_memory()
            dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)

    def plan(self, q_lens: Sequence[int], seq_lens: Sequence[int], block_table: torch.Tensor,
             index_block_table: torch.Tensor | None = None, *, pad_requests_to: int | None = None,
             pad_tokens_to: int | None = None, slot_mapping: torch.Tensor | None = None,
             index_slot_mapping: torch.Tensor | None = None) -> MSAMetadata:
        """Fill the buffers for one step and return views of them.

        Args:
            q_lens, seq_lens: host ints per request (seq_len counts this step's tokens).
            block_table, index_block_table: int32 [R, >= blocks needed] on the host or the
                device (the index cache's own table; the main one when None).
            pad_requests_to, pad_tokens_to: fixed sizes for a CUDA graph (padding requests have
                q_len 0 and seq_len 0; padding tokens get position and slots -1).
            slot_mapping, index_slot_mapping: the engine's own slots (int [T]); derived from the
                block tables and positions when None.
        """
        cfg = self.config
        ql, sl = _host_ints("q_lens", q_lens), _host_ints("seq_lens", seq_lens)
        _host_int_or_none("pad_requests_to", pad_requests_to)
        _host_int_or_none("pad_tokens_to", pad_tokens_to)
        if len(ql) != len(sl):
            raise ValueError(f"q_lens and seq_lens must have one entry per request, got "
                             f"{len(ql)} and {len(sl)}")
        num_requests = pad_requests_to if pad_requests_to is not None else len(ql)
        num_tokens = pad_tokens_to if pad_tokens_to is not None else sum(ql)
        if not len(ql) <= num_requests <= self.max_requests:
            raise ValueError(f"{len(ql)} requests padded to {num_requests} must fit "
                             f"max_requests={self.max_requests}")
        if not sum(ql) <= num_tokens <= self.max_tokens:
            raise ValueError(f"{sum(ql)} tokens padded to {num_tokens} must fit "
                             f"max_tokens={self.max_tokens}")
        for r, (a, b) in enumerate(zip(ql, sl)):
            if a < 0 or a > b:
                raise ValueError(f"request {r}: need 0 <= q_len ({a}) <= seq_len ({b})")
            if -(-b // cfg.block_size) > self.max_blocks:
                raise ValueError(f"request {r}: seq_len {b} needs more than max_blocks="
                                 f"{self.max_blocks} blocks of {cfg.block_size}")
        tables = [("block_table", block_table, self._table)]
        tables.append(("index_block_table",
                       block_table if index_block_table is None else index_block_table,
                       self._index_table))
        for name, t, _ in tables:
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 2:
                raise TypeError(f"{name} must be an int32 [R, blocks] tensor")
            if t.shape[0] < len(ql) or t.shape[1] > self.max_blocks:
                raise ValueError(f"{name} must have >= {len(ql)} rows and <= max_blocks="
                                 f"{self.max_blocks} columns, got {tuple(t.shape)}")
            need = max([-(-b // cfg.block_size) for b in sl] + [0])
            if t.shape[1] < need:
                raise ValueError(f"{name} has {t.shape[1]} columns, the step needs {need}")

        cu = [0]
        for a in ql:
            cu.append(cu[-1] + a)
        cu += [cu[-1]] * (num_requests - len(ql))
        self._upload(self._cu[:num_requests + 1], cu)
        self._upload(self._seq_lens[:num_requests], sl + [0] * (num_requests - len(sl)))
        for _, t, buf in tables:
            rows = t[:len(ql)]
            if rows.device != self.device:
                self._upload(buf[:len(ql), :rows.shape[1]], rows)
            else:
                buf[:len(ql), :rows.shape[1]].copy_(rows)

        if self.cp_size > 1:
            self._index_table.masked_fill_(self._not_owned[None, :], -1)

        cu_d, sl_d = self._cu[:num_requests + 1], self._seq_lens[:num_requests]
        request, pos = token_layout(cu_d, sl_d, num_tokens)
        self._positions[:num_tokens].copy_(pos)
        table = self._table[:num_requests]
        index_table = self._index_table[:num_requests]
        for name, given, buf, tab in (
                ("slot_mapping", slot_mapping, self._slots, table),
                ("index_slot_mapping", index_slot_mapping, self._index_slots, index_table)):
            if given is not None:
                if not isinstance(given, torch.Tensor) or given.dtype not in (torch.int32,
                                                                              torch.int64):
                    raise TypeError(f"{name} must be an int32 or int64 tensor or None, got "
                                    f"{getattr(given, 'dtype', type(given).__name__)}")
                if given.shape != (num_tokens,):
                    raise ValueError(f"{name} must be [{num_tokens}], got "
                                     f"{tuple(given.shape)}")
                if given.device == self.device:
                    buf[:num_tokens].copy_(given)
                else:
                    self._upload(buf[:num_tokens], given.to(torch.int64))
            else:
                buf[:num_tokens].copy_(slots_from_table(request, pos, tab, cfg.block_size))
        if self.cp_size > 1 and index_slot_mapping is not None:
            # the engine's own index slots: kept only for tokens of this rank's blocks
            block = torch.div(pos.long(), cfg.block_size, rounding_mode="floor")
            mine = (pos >= 0) & (block % self.cp_size == self.cp_rank)
            self._index_slots[:num_tokens].masked_fill_(~mine, -1)
        return MSAMetadata(cu_d, sl_d, table, index_table, self._positions[:num_tokens],
                           self._slots[:num_tokens], self._index_slots[:num_tokens],
                           max_q_len=max(ql, default=0),
                           cp=(self.cp_size, self.cp_rank))
