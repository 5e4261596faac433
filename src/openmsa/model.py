# SPDX-License-Identifier: Apache-2.0
"""A small random-weight model with MiniMax-M3's attention (sparse layers, no MoE) and a toy
engine that runs it through paged caches: chunked prefill, decode and speculative verify, the
way an inference engine drives MSAAttention. It exists to test the layer end to end (kernels vs
reference, sparse with topk covering every block vs dense) and for `python -m openmsa demo`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import nvfp4
from .config import MSAConfig
from .layer import MSAAttention
from .ops.cache.reference import rms_norm
from .metadata import MSAMetadata, MSAPlanner

__all__ = ["TinyMSAModel", "ToyEngine", "random_layer_checkpoint"]


def random_layer_checkpoint(layer: MSAAttention, generator: torch.Generator,
                            ) -> dict[str, torch.Tensor]:
    """Random unsharded checkpoint tensors for one layer (fp32, on the CPU)."""
    ckpt = {}
    for name, shape in layer.checkpoint_shapes().items():
        if name.endswith("norm.weight"):
            ckpt[name] = torch.randn(shape, generator=generator) * 0.1
        else:
            ckpt[name] = torch.randn(shape, generator=generator) * shape[-1] ** -0.5
    return ckpt


class TinyMSAModel(nn.Module):
    """Embedding -> num_layers x (RMSNorm, MSAAttention, residual, RMSNorm, SwiGLU MLP, residual)
    -> RMSNorm -> LM head. The same seed gives the same weights whatever `ops` is."""

    def __init__(self, config: MSAConfig, *, vocab_size: int = 128, hidden_size: int = 128,
                 num_layers: int = 2, intermediate_size: int = 256,
                 dtype: torch.dtype = torch.bfloat16, device="cpu", ops: str = "kernels",
                 index_query_dtype: torch.dtype | None = None, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.config, self.dtype = config, dtype
        kw = dict(dtype=dtype, device=device)

        def param(*shape, std):
            return nn.Parameter((torch.randn(*shape, generator=g) * std).to(**kw),
                                requires_grad=False)

        self.embed = param(vocab_size, hidden_size, std=1.0)
        self.layers = nn.ModuleList()
        for _ in range(num_layers):
            blk = nn.Module()
            blk.attn = MSAAttention(config, hidden_size, dtype=dtype, device=device, ops=ops,
                                    index_query_dtype=index_query_dtype)
            blk.attn.load_checkpoint(random_layer_checkpoint(blk.attn, g))
            blk.input_norm = param(hidden_size, std=0.1)
            blk.post_norm = param(hidden_size, std=0.1)
            blk.gate_up = param(2 * intermediate_size, hidden_size, std=hidden_size ** -0.5)
            blk.down = param(hidden_size, intermediate_size, std=intermediate_size ** -0.5)
            self.layers.append(blk)
        self.final_norm = param(hidden_size, std=0.1)
        self.lm_head = param(vocab_size, hidden_size, std=hidden_size ** -0.5)

    def _norm(self, x, w):
        return rms_norm(x, w, self.config.rms_norm_eps).to(self.dtype)

    def forward(self, input_ids: torch.Tensor, meta: MSAMetadata, caches) -> torch.Tensor:
        """input_ids int [T] -> fp32 logits [T, vocab]. caches: per layer
        (k_cache, v_cache, index_cache)."""
        h = self.embed[input_ids]
        for blk, (kc, vc, ic) in zip(self.layers, caches):
            h = h + blk.attn(self._norm(h, blk.input_norm), meta, (kc, vc), ic)
            gate, up = F.linear(self._norm(h, blk.post_norm), blk.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, blk.down)
        return F.linear(self._norm(h, self.final_norm), self.lm_head).float()


class ToyEngine:
    """Paged caches (vLLM's packed [P, Hkv, B, 2D] main cache seen as K/V views, a separate
    index cache with its own block table), pages handed out in a scrambled order, and a step
    function that plans and runs the model for any mix of prefill chunks, decodes and verifies."""

    def __init__(self, model: TinyMSAModel, *, num_pages: int, max_requests: int = 8,
                 max_tokens: int = 256, max_blocks: int = 64, kv_dtype=torch.bfloat16,
                 index_dtype=torch.bfloat16, device="cpu", seed: int = 0):
        cfg = model.config
        self.model, self.cfg, self.device = model, cfg, torch.device(device)
        b, hkv, d = cfg.block_size, cfg.num_kv_heads, cfg.head_dim
        self.caches = []
        for _ in model.layers:
            packed = torch.zeros(num_pages, hkv, b, 2 * d, dtype=kv_dtype, device=device)
            kc, vc = packed[..., :d].permute(0, 2, 1, 3), packed[..., d:].permute(0, 2, 1, 3)
            # uint8: NVFP4 pages, [P, 128, 72] bytes
            ic = torch.zeros(nvfp4.index_cache_shape(num_pages, b, cfg.index_head_dim,
                                                     index_dtype), dtype=index_dtype,
                             device=device)
            self.caches.append((kc, vc, ic))
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_pages, generator=g).tolist()
        # the index cache's pages follow another permutation: its own block table
        self.index_map = torch.randperm(num_pages, generator=g)
        self.pages: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}
        self.max_blocks = max_blocks
        self.planner = MSAPlanner(cfg, max_requests=max_requests, max_tokens=max_tokens,
                                  max_blocks=max_blocks, device=device)

    def plan(self, batch: list[tuple[int, list[int]]], *, pad_requests_to=None,
             pad_tokens_to=None) -> tuple[MSAMetadata, torch.Tensor]:
        """Allocate pages for this step's tokens and plan; returns (metadata, input ids)."""
        b = self.cfg.block_size
        q_lens, seq_lens, rows, ids = [], [], [], []
        for rid, tokens in batch:
            n = self.seq_lens.get(rid, 0) + len(tokens)
            pages = self.pages.setdefault(rid, [])
            while len(pages) * b < n:
                pages.append(self.free.pop())
            self.seq_lens[rid] = n
            q_lens.append(len(tokens))
            seq_lens.append(n)
            rows.append(pages + [-1] * (self.max_blocks - len(pages)))
            ids += tokens
        table = torch.tensor(rows, dtype=torch.int32)
        index_table = torch.where(table >= 0, self.index_map[table.clamp(min=0).long()].int(),
                                  table)
        pad_t = pad_tokens_to or len(ids)
        meta = self.planner.plan(q_lens, seq_lens, table, index_table,
                                 pad_requests_to=pad_requests_to, pad_tokens_to=pad_t)
        ids = torch.tensor(ids + [0] * (pad_t - len(ids)), dtype=torch.long, device=self.device)
        return meta, ids

    @torch.no_grad()
    def step(self, batch: list[tuple[int, list[int]]]) -> torch.Tensor:
        """batch: (request id, new tokens) per request -> fp32 logits [T, vocab]."""
        meta, ids = self.plan(batch)
        return self.model(ids, meta, self.caches)
