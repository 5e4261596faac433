# SPDX-License-Identifier: Apache-2.0
"""One forward of the text model as openmsa runs it: hooks on the text model open and close the
step, the first sparse layer plans it for all of them (each row's real tokens appended to its
openmsa sequence, packed row after row and cut into chunks of at most `max_chunk_tokens`), and
every sparse layer reads that plan on its own device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...config import MSAConfig
from ...metadata import MSAPlanner
from .pages import PagedCaches
from .sessions import SessionStore, _Session


@dataclass
class _Step:
    """One forward of the text model, as its pre-hook saw it."""
    batch: int
    new_tokens: int
    past: int
    mask: torch.Tensor | None
    cache: Any
    chunks: list | None = None            # [(q_lens, seq_lens, table, start, end)] (host)
    index: torch.Tensor | None = None     # the real tokens' rows of [batch * new tokens]
    plans: dict = field(default_factory=dict)   # device -> (index, [(meta, start, end)])


def _check_mask(mask, batch: int, length: int) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError("use_openmsa: attention_mask must be a 2-D [batch, length] padding "
                         "mask or None (4-D or per-layer masks are not supported)")
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"use_openmsa: attention_mask must be [batch, past + new tokens] = "
                         f"[{batch}, {length}], got {list(mask.shape)}")


def _schedule_chunks(step: _Step, session: _Session, pages: PagedCaches,
                     max_chunk_tokens: int) -> None:
    """Append the step's real tokens to their rows (taking pages as the rows grow) and cut the
    packed tokens into chunks: sets `step.chunks` and `step.index`."""
    b, s = step.batch, step.new_tokens
    if step.mask is None:
        real = torch.ones(b, s, dtype=torch.bool)
    else:
        real = step.mask[:, step.past:].cpu() != 0
    counts = real.sum(1).tolist()
    bs = pages.block_size
    chunks = []
    # walk the packed tokens (row after row) in windows of max_chunk_tokens
    row, used = 0, 0  # tokens of `row` already planned
    start, total = 0, int(sum(counts))
    while start < total:
        end = min(start + max_chunk_tokens, total)
        q_lens, seq_lens, tables = [], [], []
        pos = start
        while pos < end:
            while counts[row] - used == 0:
                row, used = row + 1, 0
            take = min(counts[row] - used, end - pos)
            r = session.rows[row]
            r.length += take
            need = -(-r.length // bs) - len(r.pages)
            if need > 0:
                r.add_pages(pages.take(need))
            q_lens.append(take)
            seq_lens.append(r.length)
            # (later pages of the row land past this slice: it stays this chunk's table)
            tables.append(r.table[:len(r.pages)])
            used += take
            pos += take
        width = max(len(t) for t in tables)
        table = torch.full((len(tables), width), -1, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        chunks.append((q_lens, seq_lens, table, start, end))
        start = end
    session.columns += s
    step.index = real.reshape(-1).nonzero().squeeze(1)
    step.chunks = chunks


class _OpenMSAState(PagedCaches):
    """What the swapped layers and the text model's hooks share: the paged caches (this class's
    base), the sessions (one per live transformers cache) and the step in flight."""

    def __init__(self, config: MSAConfig, kv_dtype: torch.dtype, index_dtype: torch.dtype,
                 max_chunk_tokens: int, num_pages: int | None):
        super().__init__(config.block_size, kv_dtype, index_dtype, num_pages)
        self.config = config
        self.max_chunk_tokens = max_chunk_tokens
        self.sessions = SessionStore(self)
        self.step: _Step | None = None

    def collect(self) -> None:
        """Release the pages of the sessions whose transformers cache is gone."""
        self.sessions.collect()

    def begin_step(self, batch: int, new_tokens: int, mask, cache) -> None:
        self.end_step()
        self.collect()
        past = 0
        if cache is not None:
            past = int(cache.get_seq_length())
        _check_mask(mask, batch, past + new_tokens)
        self.step = _Step(batch, new_tokens, past, mask, cache)

    def end_step(self) -> None:
        self.sessions.release_temporary()
        self.step = None

    def plan(self, cache, device: torch.device) -> tuple:
        """(index of the real tokens, [(metadata, start, end)] per chunk) on `device`: planned
        once per step (the first sparse layer), the device metadata once per device."""
        step = self.step
        if step is None:
            raise RuntimeError("use_openmsa: a sparse layer ran outside its text model's forward")
        if step.chunks is None:
            step.cache = cache
            session = self.sessions.open(cache, step.batch, step.past)
            _schedule_chunks(step, session, self, self.max_chunk_tokens)
        elif step.cache is not cache:
            raise RuntimeError("use_openmsa: the sparse layers of one step saw different caches")
        plan = step.plans.get(device)
        if plan is None:
            plan = step.plans[device] = self._device_plan(step, device)
        return plan

    def _device_plan(self, step: _Step, device: torch.device) -> tuple:
        chunks = []
        for q_lens, seq_lens, table, start, end in step.chunks:
            planner = MSAPlanner(self.config, max_requests=len(q_lens), max_tokens=end - start,
                                 max_blocks=table.shape[1], device=device)
            # the host table: the planner uploads it pinned and non-blocking (a pageable
            # .to(device) here waited for the GPU, once per step)
            chunks.append((planner.plan(q_lens, seq_lens, table), start, end))
        index = step.index
        if device.type == "cuda":
            index = index.pin_memory().to(device, non_blocking=True)
        return index, chunks


def install_step_hooks(text_model, state: _OpenMSAState) -> None:
    """Hooks on the text model that open a step before its forward and close it after."""
    all_sparse = len(state.layers) == len(text_model.layers)

    def pre_hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        x = embeds if embeds is not None else ids
        if x is None:
            return None  # transformers raises its own error
        if kwargs.get("output_attentions"):
            raise ValueError("use_openmsa: output_attentions is not supported (the sparse "
                             "layers never form attention weights)")
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None and len(args) > 3:
            cache = args[3]
        state.begin_step(x.shape[0], x.shape[1], mask, cache)
        if all_sparse and "attention_mask" in kwargs and not isinstance(mask, dict):
            # no layer reads transformers' 4-D mask: skip building it ([B, 1, S, past + S])
            return args, {**kwargs, "attention_mask": {"openmsa": None}}
        return None

    def post_hook(module, args, output):
        state.end_step()

    text_model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    text_model.register_forward_hook(post_hook)
