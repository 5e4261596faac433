# SPDX-License-Identifier: Apache-2.0
"""openmsa's impls for vLLM's MiniMax-M3 layer, their metadata builders, and the selectors that
give them to the layers (or fall back, by name and with the reason, to vLLM's own impls).

Both impls take the whole step in one call: decode rows (uniform q_len, spec-decode verify
included) and chunked-prefill rows, packed decode-first as vLLM orders them. vLLM's stock
builders split the step into a decode part and a prefill part (prefill offsets rebased to 0);
the builders here keep that metadata and add the whole step's `cu_seqlens_q`, `block_table` and
longest q_len, from buffers vLLM already holds (nothing allocated per step, so CUDA-graph capture
sees stable addresses). With a stock metadata object (a vLLM that does not let an impl pick its
main backend: 0.24-0.26), `_whole_step` rebuilds the same three from the two parts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

import torch

from ... import nvfp4
from ...config import MSAConfig
from ...ops.attention.api import sparse_attention
from ...ops.indexer.api import select_blocks
from ...support import attention_unsupported_reason, indexer_unsupported_reason
from . import logger

# vLLM's index-cache dtype names (`--attention-config '{"indexer_kv_dtype": ...}'`) and KV
# cache dtype names (`--kv-cache-dtype`) as torch dtypes
INDEX_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                "fp8_e4m3": torch.float8_e4m3fn, "nvfp4": nvfp4.DTYPE}
KV_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "half": torch.float16,
             "float16": torch.float16, "fp16": torch.float16, "float32": torch.float32,
             "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}

_logged: set[str] = set()


def _log_once(message: str, *args) -> None:
    text = message % args
    if text not in _logged:
        _logged.add(text)
        logger.info(text)


def kv_views(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int,
             fp8_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) [P, B, Hkv, D] views (no copies) of vLLM's packed main cache
    [P, Hkv, B, 2 * D] (K in [..., :D], V in [..., D:]); a uint8 fp8 cache is viewed as
    `fp8_dtype`."""
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() != 4 or kv_cache.shape[1] != num_kv_heads \
            or kv_cache.shape[3] != 2 * head_size:
        raise ValueError(f"kv_cache must be vLLM's packed [pages, {num_kv_heads} kv heads, "
                         f"block, 2 * {head_size}] cache, got {list(kv_cache.shape)}")
    if fp8_dtype is not None and kv_cache.dtype != fp8_dtype:
        if kv_cache.element_size() != 1:
            raise TypeError(f"kv_cache: an fp8 KV cache must hold 1-byte elements, got "
                            f"{kv_cache.dtype}")
        kv_cache = kv_cache.view(fp8_dtype)
    k = kv_cache[..., :head_size].permute(0, 2, 1, 3)
    v = kv_cache[..., head_size:].permute(0, 2, 1, 3)
    return k, v


@dataclasses.dataclass
class WholeStep:
    """The whole step as openmsa's ops take it (int32 device tensors)."""
    cu_seqlens_q: torch.Tensor   # [R + 1]
    seq_lens: torch.Tensor       # [R]
    block_table: torch.Tensor    # [R, max_blocks]
    max_query_len: int


def _whole_step(md) -> WholeStep:
    """The step of a MiniMax-M3 metadata object, built by an openmsa builder or vLLM's own."""
    extra = getattr(md, "openmsa", None)
    if extra is not None:
        return extra
    # vLLM's split metadata: decode rows (uniform q_len) first, then prefill rows whose
    # cu_seqlens_q starts again at 0
    nd, d, p = md.num_decodes, md.decode, md.prefill
    cu, tables, q_max = [], [], 0
    device = md.seq_lens.device
    if nd:
        q = d.decode_query_len
        cu.append(torch.arange(0, nd * q + 1, q, dtype=torch.int32, device=device))
        tables.append(d.block_table)
        q_max = q
    if md.num_prefills:
        pre = p.cu_seqlens_q.to(torch.int32) + md.num_decode_tokens
        cu.append(pre[1:] if cu else pre)
        tables.append(p.block_table)
        q_max = max(q_max, int(p.max_query_len))
    if not cu:
        cu = [torch.zeros(1, dtype=torch.int32, device=device)]
    width = max((t.shape[1] for t in tables), default=0)
    tables = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in tables]
    table = torch.cat(tables) if tables else torch.empty(0, 0, dtype=torch.int32, device=device)
    return WholeStep(torch.cat(cu), md.seq_lens[:md.num_decodes + md.num_prefills].to(torch.int32),
                     table.to(torch.int32), q_max)


def _with_whole_step(md, common) -> object:
    """`md` (vLLM's metadata dataclass) with the whole step attached as `md.openmsa`."""
    r = common.num_reqs
    md.openmsa = WholeStep(common.query_start_loc[:r + 1], common.seq_lens[:r],
                           common.block_table_tensor[:r], int(common.max_query_len))
    return md


CP_ENV = "OPENMSA_VLLM_CP"


def cp_select_blocks(index_q, index_cache, cu_seqlens_q, seq_lens, block_table, *, group,
                     rank: int, world: int, out: torch.Tensor | None = None, **selection):
    """Context-parallel `select_blocks` over a TP group whose ranks each hold their own index
    heads (vLLM shards the index query's heads over TP) and a whole index cache: the ranks
    all-gather their index queries, each scores blocks b % world == rank for every head
    (`select_blocks(cp_group=group)`, one more all-gather of candidates), and each keeps its
    own heads' rows, bit-identical to `select_blocks` on its heads alone.

    Args:
        index_q: [T, H, Di], this rank's H heads (rank r holds heads r*H .. r*H + H - 1).
        out: optional int32 [T, H, topk] (any strides), written in place.
        selection: select_blocks' keywords (topk, init_blocks, local_blocks, block_size,
            max_q_len).
    Returns:
        int32 [T, H, topk].
    """
    import torch.distributed as dist

    t, h, di = index_q.shape
    # gathered as bytes: collectives of every backend move uint8 (fp8 ones not everywhere)
    mine = index_q.contiguous().view(torch.uint8)
    every = mine.new_empty((world * t, *mine.shape[1:]))  # ranks one after another
    dist.all_gather_into_tensor(every, mine, group=group)
    every = every.view(index_q.dtype).view(world, t, h, di).permute(1, 0, 2, 3)
    every = every.reshape(t, world * h, di)
    chosen = select_blocks(every, index_cache, cu_seqlens_q, seq_lens, block_table,
                           cp_group=group, **selection)
    mine = chosen[:, rank * h:(rank + 1) * h]
    if out is None:
        return mine.contiguous()
    out.copy_(mine)
    return out


def _cp_coordinator(num_index_heads: int):
    """vLLM's TP group coordinator when `OPENMSA_VLLM_CP=1` asks for context-parallel
    selection and TP > 1 (else None)."""
    value = os.environ.get(CP_ENV, "0").strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return None
    if value not in ("1", "true", "on", "yes"):
        raise ValueError(f"{CP_ENV} must be 0/1 (or false/true, off/on), got {value!r}")
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

    world = get_tensor_model_parallel_world_size()
    if world == 1:
        return None
    config = _msa_config()
    total = config.num_index_heads if config is not None else None
    if total is not None and total != num_index_heads * world:
        # TP wider than the index heads: vLLM replicates heads over ranks, so ranks' heads do
        # not tile the whole set
        _log_once("openmsa: %s=1 ignored: the %d index heads do not split evenly over TP %d",
                  CP_ENV, total, world)
        return None
    _log_once("openmsa: context-parallel block selection over the TP group (%d ranks)", world)
    return get_tp_group()


def _text_config():
    from vllm.config import get_current_vllm_config
    return get_current_vllm_config().model_config.hf_text_config


def _model_dtype() -> torch.dtype:
    from vllm.config import get_current_vllm_config
    return get_current_vllm_config().model_config.dtype


def _msa_config() -> MSAConfig | None:
    try:
        return MSAConfig.from_hf_config(_text_config())
    except (ValueError, TypeError, AttributeError, KeyError):
        return None


def _device():
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        return torch.device("cpu")
    if current_platform.is_cuda_alike() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(current_platform.device_type)


def _platform_reason() -> str | None:
    from vllm.platforms import current_platform
    if current_platform.is_rocm():
        # vLLM's ROCm M3 layer (amd/model.py) keeps its top-k buffer head-major and has other
        # impl hooks: never run with openmsa
        return "openmsa's vLLM plugin does not drive vLLM's ROCm MiniMax-M3 layer"
    return None


def indexer_reason(topk_blocks: int, indexer_kv_dtype: str) -> str | None:
    """Why openmsa cannot be this M3 layer's indexer (None: it can)."""
    reason = _platform_reason()
    if reason is not None:
        return reason
    dtype = INDEX_DTYPES.get(indexer_kv_dtype)
    if dtype is None:
        return f"openmsa takes bf16, fp8 (e4m3) or nvfp4 index caches, not {indexer_kv_dtype!r}"
    if dtype == nvfp4.DTYPE:
        return ("this vLLM's MiniMax-M3 index cache and cache-insert op hold bf16 or fp8 keys "
                "only (NVFP4 index pages need a vLLM that allocates them)")
    config = _msa_config()
    if config is None:
        return "the model config has no MiniMax-M3 sparse_attention_config openmsa can read"
    # (openmsa.unsupported_reason's index half: the main branch is judged by its own selector)
    return indexer_unsupported_reason(
        num_index_heads=config.num_index_heads, index_head_dim=config.index_head_dim,
        block_size=config.block_size, topk=topk_blocks, query_dtype=nvfp4.index_query_dtype(dtype),
        cache_dtype=dtype, device=_device())


def attention_reason(topk_blocks: int, kv_cache_dtype: str) -> str | None:
    """Why openmsa cannot be this M3 layer's sparse attention (None: it can)."""
    reason = _platform_reason()
    if reason is not None:
        return reason
    kv = _model_dtype() if kv_cache_dtype == "auto" else KV_DTYPES.get(kv_cache_dtype)
    if kv is None:
        return (f"openmsa's sparse attention takes bf16/fp16/fp8 e4m3 KV caches, not "
                f"kv_cache_dtype={kv_cache_dtype!r}")
    config = _msa_config()
    if config is None:
        return "the model config has no MiniMax-M3 sparse_attention_config openmsa can read"
    # (openmsa.unsupported_reason's attention half)
    return attention_unsupported_reason(
        head_dim=config.head_dim, block_size=config.block_size, group_size=config.group_size,
        query_dtype=_model_dtype(), kv_dtype=kv, topk=topk_blocks, device=_device())


def _impl_classes():
    """Define the impls on vLLM's base classes (imported on first use: vLLM's M3 package)."""
    from vllm.forward_context import get_forward_context
    from vllm.models.minimax_m3.common import indexer as vindexer
    from vllm.models.minimax_m3.common import sparse_attention as vsparse

    class OpenMSAIndexerBuilder(vindexer.MiniMaxM3IndexerTritonMetadataBuilder):
        """vLLM's indexer metadata plus the whole step (`md.openmsa`)."""

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            md = super().build(common_prefix_len, common_attn_metadata, fast_build)
            return _with_whole_step(md, common_attn_metadata)

    class OpenMSAIndexerBackend(vindexer.MiniMaxM3IndexerBackend):
        @staticmethod
        def get_impl_cls():
            return OpenMSAIndexerImpl

        @staticmethod
        def get_builder_cls():
            return OpenMSAIndexerBuilder

    class OpenMSAIndexerImpl(vindexer.MiniMaxM3IndexerImpl):
        """One `openmsa.select_blocks` call per layer over the whole step, into vLLM's shared
        token-major top-k buffer [T, H, topk] (ascending logical block ids, -1 padded)."""

        indexer_backend_cls: ClassVar[type] = OpenMSAIndexerBackend

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            if self.score_type != "max":
                raise ValueError(f"openmsa: score_type must be 'max', got {self.score_type!r}")
            if self.init_blocks + self.local_blocks > self.topk_blocks:
                raise ValueError(f"openmsa: init_blocks + local_blocks ({self.init_blocks} + "
                                 f"{self.local_blocks}) must be <= topk_blocks "
                                 f"({self.topk_blocks})")
            self._cp = _cp_coordinator(self.num_index_heads)
            buf = self.topk_indices_buffer
            if buf is not None and (buf.dim() != 3 or buf.shape[1] != self.num_index_heads
                                    or buf.shape[2] != self.topk_blocks
                                    or buf.dtype != torch.int32):
                raise ValueError(f"topk_indices_buffer must be int32 [tokens, "
                                 f"{self.num_index_heads}, {self.topk_blocks}], got "
                                 f"{buf.dtype} {list(buf.shape)}")

        def reserve_workspace(self, *args, **kwargs):
            return None

        def forward(self, index_query, **kwargs):
            attn_metadata = get_forward_context().attn_metadata
            if not isinstance(attn_metadata, dict):
                return None, None  # the profiling run: caches not bound yet
            md = attn_metadata[self.index_cache.prefix]
            step = _whole_step(md)
            t, nd = md.num_actual_tokens, md.num_decode_tokens
            iq = index_query[:t].view(t, self.num_index_heads, self.index_head_dim)
            buf = self.topk_indices_buffer
            out = None if buf is None else buf[:t]
            selection = dict(topk=self.topk_blocks, init_blocks=self.init_blocks,
                             local_blocks=self.local_blocks, block_size=self.block_size,
                             max_q_len=step.max_query_len or None)
            args = (iq, self.index_cache.kv_cache, step.cu_seqlens_q, step.seq_lens,
                    step.block_table)
            if self._cp is None:
                out = select_blocks(*args, out=out, **selection)
            else:
                cp = self._cp
                out = cp_select_blocks(*args, group=cp.device_group, rank=cp.rank_in_group,
                                       world=cp.world_size, out=out, **selection)
            # vLLM's impls return [H, tokens, topk] views of the decode and prefill rows
            htk = out.transpose(0, 1)
            return (htk[:, :nd] if md.num_decodes else None,
                    htk[:, nd:t] if md.num_prefills else None)

    class OpenMSASparseBuilder(vsparse.MiniMaxM3SparseMetadataBuilder):
        """vLLM's sparse-attention metadata plus the whole step (`md.openmsa`)."""

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            md = super().build(common_prefix_len, common_attn_metadata, fast_build)
            return _with_whole_step(md, common_attn_metadata)

    class OpenMSASparseBackend(vsparse.MiniMaxM3SparseBackend):
        @staticmethod
        def get_impl_cls():
            return OpenMSASparseImpl

        @staticmethod
        def get_builder_cls():
            return OpenMSASparseBuilder

    class OpenMSASparseImpl(vsparse.MiniMaxM3SparseImpl):
        """`openmsa.sparse_attention` over the whole step: vLLM's packed K|V pages as strided
        views, bf16 / fp16 / fp32 or fp8 e4m3 with the layer's k/v scales, written into vLLM's
        output buffer."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.use_fp8_kv and self.kv_cache_fp8_dtype not in (torch.float8_e4m3fn,
                                                                    torch.float8_e4m3fnuz):
                raise ValueError(f"openmsa: fp8 KV caches must be e4m3, got "
                                 f"kv_cache_dtype={self.kv_cache_dtype!r}")

        def forward(self, layer, query, kv_cache, output, **kwargs):
            attn_metadata = get_forward_context().attn_metadata
            if not isinstance(attn_metadata, dict):
                return output  # the profiling run: caches not bound yet
            md = attn_metadata[layer.layer_name]
            step = _whole_step(md)
            t, d = md.num_actual_tokens, self.head_size
            fp8 = self.kv_cache_fp8_dtype if self.use_fp8_kv else None
            k_cache, v_cache = kv_views(kv_cache, self.num_kv_heads, d, fp8)
            k_scale = getattr(layer, "_k_scale", None) if self.use_fp8_kv else None
            v_scale = getattr(layer, "_v_scale", None) if self.use_fp8_kv else None
            sparse_attention(query[:t].view(t, self.num_heads, d), k_cache, v_cache,
                             layer.topk_indices_buffer[:t], step.cu_seqlens_q, step.seq_lens,
                             step.block_table, scale=self.scale, block_size=self.block_size,
                             out=output[:t].view(t, self.num_heads, d), k_scale=k_scale,
                             v_scale=v_scale)
            return output

    return (OpenMSAIndexerImpl, OpenMSAIndexerBackend, OpenMSASparseImpl,
            OpenMSASparseBackend)


_CLASSES = None


def classes():
    """(OpenMSAIndexerImpl, its backend, OpenMSASparseImpl, its backend)."""
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _impl_classes()
    return _CLASSES


def make_indexer_selector(original):
    """vLLM's `select_indexer_impl_cls`, choosing openmsa where it can run the layer."""

    def select_indexer_impl_cls(*, topk_blocks: int, indexer_kv_dtype: str = "bf16", **kwargs):
        reason = indexer_reason(topk_blocks, indexer_kv_dtype)
        if reason is None:
            _log_once("openmsa: MiniMax-M3 indexer -> openmsa select_blocks (topk_blocks=%d, "
                      "index cache %s)", topk_blocks, indexer_kv_dtype)
            return classes()[0]
        cls = original(topk_blocks=topk_blocks, indexer_kv_dtype=indexer_kv_dtype, **kwargs)
        _log_once("openmsa: MiniMax-M3 indexer falls back to vLLM's %s: %s", cls.__name__,
                  reason)
        return cls

    select_indexer_impl_cls.openmsa_original = original
    return select_indexer_impl_cls


def make_main_selector(original, *, returns_backend: bool):
    """vLLM's main-branch selector (`select_main_backend_and_impl_cls`, returning (backend,
    impl), or 0.24-0.26's `select_main_impl_cls`, returning the impl), choosing openmsa where
    it can run the layer."""

    def select(*, topk_blocks: int, kv_cache_dtype: str, **kwargs):
        reason = attention_reason(topk_blocks, kv_cache_dtype)
        if reason is None:
            _log_once("openmsa: MiniMax-M3 sparse attention -> openmsa sparse_attention "
                      "(topk_blocks=%d, kv_cache_dtype=%s)", topk_blocks, kv_cache_dtype)
            _, _, impl, backend = classes()
            return (backend, impl) if returns_backend else impl
        chosen = original(topk_blocks=topk_blocks, kv_cache_dtype=kv_cache_dtype, **kwargs)
        impl = chosen[1] if returns_backend else chosen
        _log_once("openmsa: MiniMax-M3 sparse attention falls back to vLLM's %s: %s",
                  impl.__name__, reason)
        return chosen

    select.__name__ = original.__name__
    select.openmsa_original = original
    return select
