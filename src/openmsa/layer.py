# SPDX-License-Identifier: Apache-2.0
"""MSAAttention: one MiniMax-M3 sparse attention layer as a torch.nn.Module.

    hidden [T, hidden] -> fused projection [q | k | v | index_q | index_k]
        -> fused_prepare (norms, RoPE, casts, main + index cache insertion; one launch)
        -> select_blocks (index branch) -> sparse_attention (main branch) -> o_proj

(the first two as prepare_and_select, which runs a decode step's preparation inside the
scoring launch, when the ops have it).

Tensor parallelism: a rank holds a slice of the query, KV and index heads (index head h serves
KV head h) and the whole one-head index key; its o_proj output is a partial sum that the engine
all-reduces across ranks, as for any row-parallel projection.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from . import reference
from ._checks import check_process_group
from .config import MSAConfig
from .ops.attention.api import sparse_attention
from .ops.cache.api import fused_prepare
from .ops.cache.geometry import projection_widths
from .ops.indexer.api import prepare_and_select, select_blocks
from .metadata import MSAMetadata

__all__ = ["MSAAttention"]

_NORMS = ("q_norm", "k_norm", "index_q_norm", "index_k_norm")
# transformers' MiniMax-M3 names of the index branch's tensors (its `indexer` submodule)
TRANSFORMERS_NAMES = {"index_q_proj.weight": "indexer.q_proj.weight",
                      "index_k_proj.weight": "indexer.k_proj.weight",
                      "index_q_norm.weight": "indexer.q_norm.weight",
                      "index_k_norm.weight": "indexer.k_norm.weight"}


# the public ops (Triton on CUDA, or on CPU under the interpreter); `reference` has the same names
KERNEL_OPS = SimpleNamespace(fused_prepare=fused_prepare, select_blocks=select_blocks,
                             sparse_attention=sparse_attention,
                             prepare_and_select=prepare_and_select)
_OP_NAMES = ("fused_prepare", "select_blocks", "sparse_attention")


def _resolve_ops(ops):
    if isinstance(ops, str):
        if ops == "kernels":
            return KERNEL_OPS
        if ops == "reference":
            return reference
    elif all(callable(getattr(ops, name, None)) for name in _OP_NAMES):
        return ops
    raise ValueError(f"ops must be 'kernels', 'reference' or an object with "
                     f"{', '.join(_OP_NAMES)}, got {ops!r}")


class MSAAttention(nn.Module):
    """One sparse layer for one tensor-parallel rank.

    Args:
        config: the whole model's MSAConfig (head counts before sharding).
        hidden_size: the model's hidden size.
        tp_size, tp_rank: this rank's slice of the heads.
        ops: "kernels" (the public ops: Triton on CUDA), "reference" (openmsa.reference, the
            spec in PyTorch), or any object with `fused_prepare`, `select_blocks` and
            `sparse_attention` taking the public ops' arguments (the tests plug in dense
            attention this way).
        index_query_dtype: the index query's dtype (None: the index cache's, or fp8 e4m3
            against NVFP4 pages; a 16-bit type against an fp8 or NVFP4 cache is allowed).
        cp_group: a torch.distributed process group (usually the TP group) for
            context-parallel selection (select_blocks(cp_group=...)): rank r of the group scores
            only the logical blocks b % W == r, for every index head, and the group exchanges
            candidates. The layer then projects the index query of every index head (the
            index-query rows of all heads are loaded on every rank: H * Di more rows of the
            fused projection, 512 of M3's ~7.7K at TP4), selects for all heads, and attends
            with its own heads' rows as without it. With a sharded index cache, plan with
            MSAPlanner(cp_size=W, cp_rank=the rank in this group). Needs ops that
            take cp_group ("kernels" or "reference").

    The index cache is passed to `forward`; its dtype picks the format: bf16/fp16/fp8 pages
    [P, B, Di], or NVFP4 pages (torch.uint8 [P, 128, 72], 72 bytes a token, Di = B = 128; see
    `openmsa.nvfp4.index_cache_shape`).
    """

    def __init__(self, config: MSAConfig, hidden_size: int, *, tp_size: int = 1,
                 tp_rank: int = 0, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, ops: str = "kernels",
                 index_query_dtype: torch.dtype | None = None, cp_group=None):
        super().__init__()
        if not isinstance(config, MSAConfig):
            raise TypeError(f"config must be an MSAConfig, got {type(config).__name__}")
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) \
                or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be an int in [0, tp_size={tp_size}), got "
                             f"{tp_rank!r}")
        self._ops = _resolve_ops(ops)
        self.full_config = config
        self.config = cfg = config.shard(tp_size)
        self.tp_size, self.tp_rank, self.hidden_size = tp_size, tp_rank, hidden_size
        self.ops = ops
        self.index_query_dtype = index_query_dtype
        d, di = cfg.head_dim, cfg.index_head_dim
        self.q_size = cfg.num_heads * d
        self.kv_size = cfg.num_kv_heads * d
        self.cp_group = cp_group
        # (size, this rank) of the group, which a step's sharded index table must match
        self._cp = (1, 0)
        if cp_group is not None:
            import torch.distributed as dist
            check_process_group("cp_group", cp_group)
            self._cp = (dist.get_world_size(cp_group), dist.get_rank(cp_group))
        # the index heads this rank projects: all of them under context-parallel selection
        self._iq_heads = config.num_index_heads if cp_group is not None \
            else cfg.num_index_heads
        self._prepare_config = cfg if cp_group is None else dataclasses.replace(
            cfg, num_index_heads=config.num_index_heads)
        self.iq_size = self._iq_heads * di
        width = sum(projection_widths(self._prepare_config))
        kw = dict(dtype=dtype, device=device)
        # one fused projection weight: a single GEMM per step instead of five
        self.qkv_weight = nn.Parameter(torch.empty(width, hidden_size, **kw), requires_grad=False)
        self.o_weight = nn.Parameter(torch.empty(hidden_size, self.q_size, **kw),
                                     requires_grad=False)
        for name, n in zip(_NORMS, (d, d, di, di)):
            setattr(self, name, nn.Parameter(torch.zeros(n, **kw), requires_grad=False))

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """The whole (unsharded) layer's checkpoint tensors, by parameter name."""
        c, h = self.full_config, self.hidden_size
        return {"q_proj.weight": (c.num_heads * c.head_dim, h),
                "k_proj.weight": (c.num_kv_heads * c.head_dim, h),
                "v_proj.weight": (c.num_kv_heads * c.head_dim, h),
                "index_q_proj.weight": (c.num_index_heads * c.index_head_dim, h),
                "index_k_proj.weight": (c.index_head_dim, h),
                "o_proj.weight": (h, c.num_heads * c.head_dim),
                "q_norm.weight": (c.head_dim,), "k_norm.weight": (c.head_dim,),
                "index_q_norm.weight": (c.index_head_dim,),
                "index_k_norm.weight": (c.index_head_dim,)}

    @torch.no_grad()
    def load_checkpoint(self, state_dict: Mapping[str, torch.Tensor], prefix: str = "") -> None:
        """Load this rank's slice from a layer's unsharded checkpoint tensors, named as in the
        checkpoint (`q_proj.weight`, ..., `index_q_proj.weight`, `index_k_norm.weight`, after
        `prefix`) or as in transformers' MiniMax-M3 (`indexer.q_proj.weight`, ...,
        `indexer.k_norm.weight` for the index branch)."""
        shapes = self.checkpoint_shapes()
        w = {}
        for name, shape in shapes.items():
            key = prefix + name
            if key not in state_dict:
                alt = TRANSFORMERS_NAMES.get(name)
                if alt is None or prefix + alt not in state_dict:
                    also = f" (nor {prefix + alt!r})" if alt is not None else ""
                    raise KeyError(f"checkpoint has no {key!r}{also}")
                key = prefix + alt
            t = state_dict[key]
            if tuple(t.shape) != shape:
                raise ValueError(f"{key} must be {shape}, got {tuple(t.shape)}")
            w[name] = t
        r = self.tp_rank

        def rows(t, size):
            return t[r * size:(r + 1) * size]

        fused = torch.cat([rows(w["q_proj.weight"], self.q_size),
                           rows(w["k_proj.weight"], self.kv_size),
                           rows(w["v_proj.weight"], self.kv_size),
                           w["index_q_proj.weight"] if self.cp_group is not None
                           else rows(w["index_q_proj.weight"], self.iq_size),
                           w["index_k_proj.weight"]])  # the one index-key head: replicated
        self.qkv_weight.copy_(fused)
        self.o_weight.copy_(w["o_proj.weight"][:, r * self.q_size:(r + 1) * self.q_size])
        for name in _NORMS:
            getattr(self, name).copy_(w[name + ".weight"])

    def _check_inputs(self, hidden, meta, kv_cache, index_cache) -> None:
        """forward's own arguments, by name (the ops check the caches' shapes and the step's
        tensors; no device values are read)."""
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [tokens, hidden_size={self.hidden_size}], got "
                             f"shape {tuple(hidden.shape)}")
        weight = self.qkv_weight
        if hidden.dtype != weight.dtype or hidden.device != weight.device:
            raise ValueError(f"hidden must be {weight.dtype} on {weight.device} like the "
                             f"layer's weights, got {hidden.dtype} on {hidden.device}")
        if not isinstance(meta, MSAMetadata):
            raise TypeError(f"meta must be an MSAMetadata (MSAPlanner.plan's result), got "
                            f"{type(meta).__name__}")
        if hidden.shape[0] != meta.num_tokens:
            raise ValueError(f"hidden must have a row per token of meta ({meta.num_tokens}), got "
                             f"{hidden.shape[0]}")
        if not (isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2
                and all(isinstance(c, torch.Tensor) for c in kv_cache)):
            got = f"a {type(kv_cache).__name__} of {len(kv_cache)}" \
                if isinstance(kv_cache, (tuple, list)) else type(kv_cache).__name__
            raise TypeError(f"kv_cache must be a (k_cache, v_cache) pair of tensors, got {got}")
        if not isinstance(index_cache, torch.Tensor):
            raise TypeError(f"index_cache must be a torch.Tensor, got "
                            f"{type(index_cache).__name__}")

    def forward(self, hidden: torch.Tensor, meta: MSAMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], index_cache: torch.Tensor, *,
                k_scale=None, v_scale=None) -> torch.Tensor:
        """hidden [T, hidden] -> this rank's o_proj partial output [T, hidden].

        kv_cache: (k_cache, v_cache) viewed [P, B, Hkv_rank, D] (any strides); index_cache
        [P, B, Di], or NVFP4 pages (uint8 [P, 128, 72]). The step's keys are written into the
        caches before attention reads them.
        """
        self._check_inputs(hidden, meta, kv_cache, index_cache)
        cfg = self.config
        ops = self._ops
        k_cache, v_cache = kv_cache
        num_tokens = hidden.shape[0]
        qkv = F.linear(hidden, self.qkv_weight)
        iq_out = None
        if self.index_query_dtype is not None and self.index_query_dtype != index_cache.dtype:
            iq_out = torch.empty(num_tokens, self._iq_heads, cfg.index_head_dim,
                                 dtype=self.index_query_dtype, device=hidden.device)
        # a whole (replicated) index table serves any group; a sharded one only its own rank
        if meta.cp != (1, 0) and meta.cp != self._cp:
            raise ValueError(f"meta's index cache is sharded as (cp_size, cp_rank) = "
                             f"{meta.cp}, but this layer's cp_group is "
                             f"{self._cp} (size, rank): plan with MSAPlanner(cp_size="
                             f"{self._cp[0]}, cp_rank={self._cp[1]})")
        prepare = (qkv, meta.positions, self._prepare_config, self.q_norm, self.k_norm,
                   self.index_q_norm, self.index_k_norm, k_cache, v_cache, meta.slot_mapping,
                   index_cache, meta.index_slot_mapping)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        fused = getattr(ops, "prepare_and_select", None)
        if fused is not None and self.cp_group is None:
            # the preparation inside the scoring launch where the step allows it (decode)
            q, index_q, indices = fused(
                *prepare, meta.cu_seqlens_q, meta.seq_lens, meta.index_block_table,
                max_q_len=meta.max_q_len, index_q_out=iq_out, **scales)
        else:
            q, index_q = ops.fused_prepare(*prepare, index_q_out=iq_out, **scales)
            cp = {} if self.cp_group is None else dict(cp_group=self.cp_group)
            indices = ops.select_blocks(
                index_q, index_cache, meta.cu_seqlens_q, meta.seq_lens, meta.index_block_table,
                topk=cfg.topk_blocks, init_blocks=cfg.init_blocks,
                local_blocks=cfg.local_blocks, block_size=cfg.block_size,
                max_q_len=meta.max_q_len, **cp)
        if self.cp_group is not None:
            # every head's selection came back: this rank attends with its own heads'
            h = cfg.num_index_heads
            indices = indices[:, self.tp_rank * h:(self.tp_rank + 1) * h].contiguous()
        out = ops.sparse_attention(q, k_cache, v_cache, indices, meta.cu_seqlens_q,
                                   meta.seq_lens, meta.block_table, block_size=cfg.block_size,
                                   k_scale=k_scale, v_scale=v_scale)
        return F.linear(out.reshape(num_tokens, self.q_size), self.o_weight)

