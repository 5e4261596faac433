# SPDX-License-Identifier: Apache-2.0
"""transformers' MiniMax-M3 on openmsa: `use_openmsa(model)` swaps the attention of every sparse
layer (`layer_types[i] == "minimax_m3_sparse"`) of a `MiniMaxM3VLForCausalLM`, or of the VL
wrapper's language model, for an `MSAAttention` over paged caches this module manages; the rest
of the model (embeddings, full-attention layers, MLPs, the LM head, `generate`) stays
transformers'.

How a step runs. A forward pre-hook on the text model reads the step's 2-D attention mask (or
None) and how many tokens the transformers cache already holds. The first sparse layer of the
step then plans it once for all sparse layers: the step's real tokens (mask 1) of each batch row
are appended to that row's openmsa sequence, so a row's blocks follow its own content positions
whatever padding surrounds them (left padding gives the same blocks as the prompt alone); padding
tokens are neither written nor attended and get a zero attention output. Tokens are packed row
after row and cut into chunks of at most `max_chunk_tokens`, each planned with `MSAPlanner` and run
through `MSAAttention` (fused_prepare, select_blocks, sparse_attention), in order. The
transformers cache keeps, for a sparse layer, a one-element-per-token placeholder only, so that
its length bookkeeping (positions, masks of the full-attention layers) goes on as before.

The openmsa caches of a generation belong to the transformers cache object that `generate` (or
the caller) passes; they are released when that object is garbage collected, or reused when a
step starts again from an empty cache.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from .. import nvfp4
from ..config import MSAConfig
from ..layer import MSAAttention
from ..plan import MSAPlanner
from ..rope import ROPE_ANGLES, attention_factor, inv_freq

__all__ = ["use_openmsa", "OpenMSASparseAttention"]

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32,
           "float8_e4m3fn": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn}
_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
# the index cache may also hold NVFP4 pages (openmsa.nvfp4): uint8, 72 bytes a token
_INDEX_DTYPES = {**_DTYPES, "nvfp4": nvfp4.DTYPE, "uint8": nvfp4.DTYPE}


def _modeling():
    try:
        from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m
    except ImportError as e:  # pragma: no cover - exercised only without transformers
        raise ImportError("openmsa.integrations.transformers needs transformers with MiniMax-M3 "
                          "(pip install 'openmsa[transformers]')") from e
    return m


def _cache_dtype(name: str, value, default: torch.dtype, *, index: bool = False
                 ) -> torch.dtype:
    """A cache dtype by name or dtype; `index`: the index cache's, which may be NVFP4."""
    names = _INDEX_DTYPES if index else _DTYPES
    if value is None:
        return default
    if isinstance(value, str):
        if value not in names:
            raise ValueError(f"{name} must be one of {sorted(names)} or a torch.dtype, got "
                             f"{value!r}")
        value = names[value]
    allowed = _CACHE_DTYPES + ((nvfp4.DTYPE,) if index else ())
    if not isinstance(value, torch.dtype) or value not in allowed:
        also = ", float8_e4m3fn or uint8 (NVFP4)" if index else " or float8_e4m3fn"
        raise TypeError(f"{name} must be bfloat16, float16, float32{also}, got {value!r}")
    return value


def _positive_int(name: str, value, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, got "
                         f"{value!r}")


# ------------------------------------------------------------------------------ state
@dataclass
class _Row:
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


@dataclass
class _Session:
    """The openmsa side of one transformers cache: a row per batch row."""
    rows: list[_Row]
    columns: int = 0                      # tokens (padding included) the cache has seen


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


class _OpenMSAState:
    """Paged caches shared by the sparse layers (one page table for all), the sessions (one per
    live transformers cache) and the current step's plan."""

    def __init__(self, config: MSAConfig, device: torch.device, kv_dtype: torch.dtype,
                 index_dtype: torch.dtype, max_chunk_tokens: int, num_pages: int | None):
        self.config, self.device = config, device
        self.kv_dtype, self.index_dtype = kv_dtype, index_dtype
        self.max_chunk_tokens = max_chunk_tokens
        self.initial_pages = num_pages
        self.layers: dict[int, MSAAttention] = {}
        self.caches: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.num_pages = 0
        self.free: list[int] = []
        self.sessions: dict[int, tuple[weakref.ref, _Session]] = {}
        self.step: _Step | None = None
        self._temporary: _Session | None = None
        # sessions whose cache was garbage collected; released at the next step or collect(),
        # never inside the callback (which may run in the middle of a page allocation)
        self._dead: list[int] = []

    # -------------------------------------------------------------- pages
    def _allocate(self, layer: int, pages: int):
        c, b = self.layers[layer].config, self.config.block_size
        kw = dict(device=self.layers[layer].qkv_weight.device)  # the layer's own GPU
        k = torch.zeros(pages, b, c.num_kv_heads, c.head_dim, dtype=self.kv_dtype, **kw)
        v = torch.zeros_like(k)
        ic = torch.zeros(nvfp4.index_cache_shape(pages, b, c.index_head_dim, self.index_dtype),
                         dtype=self.index_dtype, **kw)
        return k, v, ic

    def _grow(self, need: int) -> None:
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

    def _take_pages(self, n: int) -> list[int]:
        if len(self.free) < n:
            self._grow(n - len(self.free))
        taken = self.free[-n:] if n else []
        del self.free[len(self.free) - n:]
        return taken

    def _release(self, session: _Session) -> None:
        for row in session.rows:
            self.free.extend(reversed(row.pages))
            row.pages = []
            row.table = torch.empty(0, dtype=torch.int32)

    def _drop_session(self, key: int) -> None:
        entry = self.sessions.pop(key, None)
        if entry is not None:
            self._release(entry[1])

    def collect(self) -> None:
        """Release the pages of the sessions whose transformers cache is gone."""
        while self._dead:
            key = self._dead.pop()
            entry = self.sessions.get(key)
            if entry is not None and entry[0]() is None:
                self._drop_session(key)

    # -------------------------------------------------------------- steps
    def begin_step(self, batch: int, new_tokens: int, mask, cache) -> None:
        self.end_step()
        self.collect()
        past = 0
        if cache is not None:
            past = int(cache.get_seq_length())
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
                raise ValueError("use_openmsa: attention_mask must be a 2-D [batch, length] "
                                 "padding mask or None (4-D or per-layer masks are not "
                                 "supported)")
            if tuple(mask.shape) != (batch, past + new_tokens):
                raise ValueError(f"use_openmsa: attention_mask must be [batch, past + new "
                                 f"tokens] = [{batch}, {past + new_tokens}], got "
                                 f"{list(mask.shape)}")
        self.step = _Step(batch, new_tokens, past, mask, cache)

    def end_step(self) -> None:
        if self._temporary is not None:
            self._release(self._temporary)
            self._temporary = None
        self.step = None

    def _session(self, step: _Step, cache) -> _Session:
        if cache is None:
            if step.past:
                raise ValueError("use_openmsa: a step after cached tokens needs the cache")
            self._temporary = _Session([_Row() for _ in range(step.batch)])
            return self._temporary
        key = id(cache)
        entry = self.sessions.get(key)
        session = entry[1] if entry is not None and entry[0]() is cache else None
        if step.past == 0:
            if entry is not None:
                self._drop_session(key)
            session = _Session([_Row() for _ in range(step.batch)])
            self.sessions[key] = (weakref.ref(cache, lambda _, k=key: self._dead.append(k)),
                                  session)
        elif session is None or session.columns != step.past:
            have = "none" if session is None else session.columns
            raise ValueError(f"use_openmsa: the cache holds {step.past} tokens but openmsa wrote "
                             f"{have} for it (a cache filled before use_openmsa, cropped, or "
                             f"reordered, as beam search or assisted decoding do, is not "
                             f"supported)")
        if len(session.rows) != step.batch:
            raise ValueError(f"use_openmsa: the batch has {step.batch} rows but its cache was "
                             f"started with {len(session.rows)}")
        return session

    def plan(self, cache, device: torch.device) -> tuple:
        """(index of the real tokens, [(metadata, start, end)] per chunk) on `device`: planned
        once per step (the first sparse layer), the device metadata once per device."""
        step = self.step
        if step is None:
            raise RuntimeError("use_openmsa: a sparse layer ran outside its text model's forward")
        if step.chunks is None:
            self._plan_host(step, cache)
        elif step.cache is not cache:
            raise RuntimeError("use_openmsa: the sparse layers of one step saw different caches")
        plan = step.plans.get(device)
        if plan is None:
            chunks = []
            for q_lens, seq_lens, table, start, end in step.chunks:
                planner = MSAPlanner(self.config, max_requests=len(q_lens),
                                     max_tokens=end - start, max_blocks=table.shape[1],
                                     device=device)
                # the host table: the planner uploads it pinned and non-blocking (a pageable
                # .to(device) here waited for the GPU, once per step)
                chunks.append((planner.plan(q_lens, seq_lens, table), start, end))
            index = step.index
            if device.type == "cuda":
                index = index.pin_memory().to(device, non_blocking=True)
            plan = step.plans[device] = (index, chunks)
        return plan

    def _plan_host(self, step: _Step, cache) -> None:
        step.cache = cache
        session = self._session(step, cache)
        b, s = step.batch, step.new_tokens
        if step.mask is None:
            real = torch.ones(b, s, dtype=torch.bool)
        else:
            real = step.mask[:, step.past:].cpu() != 0
        counts = real.sum(1).tolist()
        bs = self.config.block_size
        chunks = []
        # walk the packed tokens (row after row) in windows of max_chunk_tokens
        row, used = 0, 0  # tokens of `row` already planned
        start, total = 0, int(sum(counts))
        while start < total:
            end = min(start + self.max_chunk_tokens, total)
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
                    r.add_pages(self._take_pages(need))
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


# ------------------------------------------------------------------------------ the layer
class OpenMSASparseAttention(nn.Module):
    """Stands in for a sparse layer's `MiniMaxM3VLAttention`: same call, openmsa inside."""

    def __init__(self, msa: MSAAttention, layer_idx: int, state: _OpenMSAState):
        super().__init__()
        self.msa = msa
        self.layer_idx = layer_idx
        self._state = [state]  # a list: not a submodule, not a parameter

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                cache=None, past_key_values=None, **kwargs):
        state = self._state[0]
        cache = cache if cache is not None else past_key_values
        b, s, hidden = hidden_states.shape
        index, chunks = state.plan(cache, hidden_states.device)
        flat = hidden_states.reshape(b * s, hidden)
        x = flat.index_select(0, index)
        out = torch.zeros_like(flat)
        if chunks:
            k_cache, v_cache, index_cache = state.caches[self.layer_idx]
            parts = [self.msa(x[a:e], meta, (k_cache, v_cache), index_cache)
                     for meta, a, e in chunks]
            out.index_copy_(0, index, torch.cat(parts).to(out.dtype))
        if cache is not None:
            # length bookkeeping only: one element per token, the keys live in openmsa's pages
            mark = hidden_states.new_zeros(b, 1, s, 1)
            cache.update(mark, mark, self.layer_idx)
        return out.reshape(b, s, hidden), None


# ------------------------------------------------------------------------------ use_openmsa
def _text_models(model) -> list:
    m = _modeling()
    found = [mod for mod in model.modules() if isinstance(mod, m.MiniMaxM3VLTextModel)]
    if not found:
        raise TypeError(f"model must be a transformers MiniMax-M3 model (MiniMaxM3VLForCausalLM, "
                        f"MiniMaxM3SparseForConditionalGeneration or their base models), got "
                        f"{type(model).__name__}")
    return found


def _check_rope(config: MSAConfig, text_model) -> MSAConfig:
    """The rotary width and frequencies openmsa will use must be the model's own."""
    rot = getattr(text_model, "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        return config
    theirs = rot.inv_freq.detach().float().cpu()
    if 2 * theirs.numel() != config.rotary_dim:
        config = replace(config, rotary_dim=2 * theirs.numel())
    ours = inv_freq(config, angles="fp32")
    # `model.to(torch.bfloat16)` also casts the buffer: then it holds rounded frequencies
    # (transformers rotates its full-attention layers with those; openmsa keeps the config's)
    if not torch.allclose(ours, theirs, rtol=torch.finfo(rot.inv_freq.dtype).eps, atol=0) \
            or abs(attention_factor(config) - float(rot.attention_scaling)) > 1e-6:
        raise ValueError("use_openmsa: the model's rotary embedding (inverse frequencies or "
                         "attention factor) is not the one its config describes to openmsa")
    return config


def _guard_generate(model, state: _OpenMSAState, prefill_chunk_size: int | None) -> None:
    generate = model.generate

    @functools.wraps(generate)
    def guarded(*args, **kwargs):
        gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)

        def opt(name, default=None):
            if name in kwargs:
                return kwargs[name]
            return getattr(gc, name, default) if gc is not None else default

        if (opt("num_beams", 1) or 1) > 1:
            raise ValueError(f"use_openmsa: beam search (num_beams={opt('num_beams')}) is not "
                             f"supported (it reorders the cache)")
        if kwargs.get("assistant_model") is not None or opt("prompt_lookup_num_tokens"):
            raise ValueError("use_openmsa: assisted / prompt-lookup decoding is not supported "
                             "(it crops the cache)")
        if opt("penalty_alpha"):
            raise ValueError("use_openmsa: contrastive search (penalty_alpha) is not supported")
        if opt("cache_implementation") not in (None, "dynamic"):
            raise ValueError(f"use_openmsa: cache_implementation="
                             f"{opt('cache_implementation')!r} is not supported (the sparse "
                             f"layers keep their own paged caches; use the default dynamic "
                             f"cache)")
        if kwargs.get("custom_generate") is not None:
            raise ValueError("use_openmsa: custom_generate is not supported")
        if prefill_chunk_size is not None and "prefill_chunk_size" not in kwargs \
                and getattr(gc, "prefill_chunk_size", None) is None:
            kwargs["prefill_chunk_size"] = prefill_chunk_size  # (None in the call: no chunks)
        return generate(*args, **kwargs)

    model.generate = guarded


def _refuse_save(*args, **kwargs):
    raise ValueError("use_openmsa: a model whose sparse layers run openmsa cannot be saved (its "
                     "attention weights are fused); save the model before use_openmsa")


def use_openmsa(model, *, kv_cache_dtype=None, index_cache_dtype=None, ops: str = "kernels",
                rope_angles: str = "fp32", max_chunk_tokens: int = 8192,
                prefill_chunk_size: int | None = 8192, num_pages: int | None = None,
                index_query_dtype=None):
    """Run the sparse layers of a transformers MiniMax-M3 model on openmsa; returns the model.

    Args:
        model: `MiniMaxM3VLForCausalLM`, `MiniMaxM3SparseForConditionalGeneration` (its
            language model) or one of their base models, changed in place.
        kv_cache_dtype, index_cache_dtype: the paged caches' dtypes (bfloat16, float16,
            float32 or float8_e4m3fn, or "bf16" / "fp8" / ...); None: the model's dtype. The
            index cache may also be "nvfp4" (torch.uint8): NVFP4 pages of 72 bytes a token
            (docs/spec.md), for index_head_dim == block_size == 128.
        ops: "kernels" (openmsa's public ops: Triton on CUDA, the reference on CPU) or
            "reference" (the pure-PyTorch reference everywhere).
        rope_angles: "fp32" (default: angles as transformers forms them, so the sparse layers
            rotate as the model's full-attention layers do) or "exact" (float64 angles).
        max_chunk_tokens: the most tokens one openmsa step takes; longer inputs run in chunks.
        prefill_chunk_size: `generate` prefills a longer prompt through the whole model in
            chunks of this many tokens (transformers' own `prefill_chunk_size`, so that the
            full-attention layers and MLPs hold one chunk at a time too), unless the call or the
            generation config sets one; None: no chunking unless asked for.
        num_pages: pages of `block_size` tokens to allocate up front (the caches grow by
            doubling past that).
        index_query_dtype: the index query's dtype (None: the index cache's; fp8 e4m3 with
            an NVFP4 index cache).

    Refused with ValueError: beam search, assisted or prompt-lookup decoding, contrastive
    search, static / offloaded / quantized caches, 4-D attention masks, output_attentions,
    saving the model afterwards.
    """
    if getattr(model, "_openmsa_state", None) is not None:
        raise ValueError("use_openmsa was already applied to this model")
    if ops not in ("kernels", "reference"):
        raise ValueError(f"ops must be 'kernels' or 'reference', got {ops!r}")
    if rope_angles not in ROPE_ANGLES:
        raise ValueError(f"rope_angles must be one of {ROPE_ANGLES}, got {rope_angles!r}")
    _positive_int("max_chunk_tokens", max_chunk_tokens)
    _positive_int("prefill_chunk_size", prefill_chunk_size, optional=True)
    _positive_int("num_pages", num_pages, optional=True)
    text_models = _text_models(model)
    if len(text_models) != 1:
        raise ValueError(f"use_openmsa: expected one MiniMax-M3 text model, found "
                         f"{len(text_models)}")
    text = text_models[0]
    weight = text.embed_tokens.weight
    dtype, device = weight.dtype, weight.device
    kv_dtype = _cache_dtype("kv_cache_dtype", kv_cache_dtype, dtype)
    index_dtype = _cache_dtype("index_cache_dtype", index_cache_dtype, dtype, index=True)
    iq_dtype = None if index_query_dtype is None else _cache_dtype("index_query_dtype",
                                                                   index_query_dtype, dtype)
    with warnings.catch_warnings():
        # a `rotary_dim` that disagrees with transformers' rotation: the model's own rotary
        # embedding decides (checked in _check_rope)
        warnings.simplefilter("ignore")
        config = MSAConfig.from_hf_config(text.config)
    config = _check_rope(replace(config, rope_angles=rope_angles), text)
    if index_dtype == nvfp4.DTYPE:
        reason = nvfp4.requirement_reason(config.index_head_dim, config.block_size)
        if reason is not None:
            raise ValueError(f"index_cache_dtype: {reason}")
    state = _OpenMSAState(config, device, kv_dtype, index_dtype, max_chunk_tokens, num_pages)
    m = _modeling()
    for i, layer in enumerate(text.layers):
        attn = layer.self_attn
        if not config.is_sparse_layer(i):
            continue
        if not isinstance(attn, m.MiniMaxM3VLAttention) or attn.indexer is None:
            raise ValueError(f"use_openmsa: layer {i} is sparse in the config but its attention "
                             f"is {type(attn).__name__} without an indexer")
        w = attn.q_proj.weight
        if type(w).__name__ == "DTensor":
            raise ValueError("use_openmsa: tensor-parallel models (transformers' tp_plan) are not "
                             "supported; openmsa's layer shards by itself (MSAAttention tp_size)")
        msa = MSAAttention(config, text.config.hidden_size, dtype=w.dtype, device=w.device,
                           ops=ops, index_query_dtype=iq_dtype)
        msa.load_checkpoint(attn.state_dict())
        state.layers[i] = msa
        layer.self_attn = OpenMSASparseAttention(msa, i, state)
    if not state.layers:
        raise ValueError("use_openmsa: the model has no sparse layer (layer_types has no "
                         "'minimax_m3_sparse')")
    if num_pages:
        state._grow(num_pages)
    all_sparse = len(state.layers) == len(text.layers)

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

    text.register_forward_pre_hook(pre_hook, with_kwargs=True)
    text.register_forward_hook(post_hook)
    if hasattr(model, "generate"):
        _guard_generate(model, state, prefill_chunk_size)
    model.save_pretrained = _refuse_save
    model._openmsa_state = state
    return model
