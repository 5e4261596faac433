# SPDX-License-Identifier: Apache-2.0
"""What the Triton kernels support, said in one sentence when they do not.

Engines call `unsupported_reason` when they choose a back end; the public ops call it before a
kernel launch and raise ValueError with the same sentence, so CUDA tensors never fall back to the
slow reference silently.
"""

from __future__ import annotations


import torch

from . import nvfp4
from ._checks import FP8, FP8_FNUZ, FP8_TYPES, HALF, MAX_TOPK
from ._interpreter import INTERPRET
from ._device import capability
from .config import MSAConfig

__all__ = ["unsupported_reason", "indexer_unsupported_reason", "attention_unsupported_reason"]

MAX_INDEX_HEADS = 64
BLOCK_RANGE = (16, 128)
INDEX_DIM_RANGE = (16, 256)
HEAD_DIMS = (64, 128, 256)


# the AMD GPUs the Triton kernels are built for (tests/test_compile_rocm.py), and each one's fp8
ROCM_FP8 = {"gfx942": FP8_FNUZ, "gfx950": FP8}


def _rocm_arch(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]


def _rocm_reason(arch: str, fp8: torch.dtype | None) -> str | None:
    """Why the kernels cannot run on the AMD GPU `arch` with fp8 type `fp8` (None: no fp8)."""
    if arch not in ROCM_FP8:
        return f"openmsa's Triton kernels are built for AMD gfx942 and gfx950 only, this GPU " \
               f"is {arch}"
    if fp8 is not None and fp8 != ROCM_FP8[arch]:
        want = str(ROCM_FP8[arch]).replace("torch.", "")
        return f"{arch}'s fp8 is {want}, got {str(fp8).replace('torch.', '')} inputs"
    return None


def _device_reason(device, needs_fp8: bool | torch.dtype) -> str | None:
    if device is None:
        return None
    device = torch.device(device)
    fp8 = needs_fp8 if isinstance(needs_fp8, torch.dtype) else FP8 if needs_fp8 else None
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"openmsa's kernels run on CUDA or ROCm GPUs (or the CPU through Triton's " \
               f"interpreter), not on {device.type}"
    if torch.version.hip is not None:
        return _rocm_reason(_rocm_arch(device), fp8)
    if fp8 == FP8_FNUZ:
        return "NVIDIA GPUs have no e4m3fnuz fp8 (AMD gfx942's): use torch.float8_e4m3fn"
    major, minor = capability(device)
    if (major, minor) < (8, 0):
        return f"openmsa's kernels need compute capability 8.0 or newer, this GPU has " \
               f"{major}.{minor}"
    if needs_fp8 and (major, minor) < (8, 9):
        return f"fp8 e4m3 inputs need compute capability 8.9 or newer (Ada/Hopper), this GPU " \
               f"has {major}.{minor}"
    return None


def indexer_unsupported_reason(*, num_index_heads: int, index_head_dim: int, block_size: int,
                               topk: int | None, query_dtype: torch.dtype,
                               cache_dtype: torch.dtype, device=None) -> str | None:
    lo, hi = BLOCK_RANGE
    if not lo <= block_size <= hi:
        return f"the indexer kernels take block sizes {lo}-{hi}, got {block_size}"
    if not INDEX_DIM_RANGE[0] <= index_head_dim <= INDEX_DIM_RANGE[1]:
        return f"the indexer kernels take index head dims {INDEX_DIM_RANGE[0]}-" \
               f"{INDEX_DIM_RANGE[1]}, got {index_head_dim}"
    if num_index_heads > MAX_INDEX_HEADS:
        return f"the indexer kernels take at most {MAX_INDEX_HEADS} index heads, got " \
               f"{num_index_heads}"
    if topk is not None and topk > MAX_TOPK:
        return f"the selection kernel takes topk up to {MAX_TOPK}, got {topk}"
    if cache_dtype == nvfp4.DTYPE:
        return _nvfp4_reason(index_head_dim, block_size, query_dtype, device)
    ok = (query_dtype == cache_dtype and query_dtype in (*HALF, *FP8_TYPES, torch.float32)) or \
        (query_dtype in HALF and cache_dtype in FP8_TYPES)
    if not ok:
        return f"the indexer kernels take a {query_dtype} query only against a cache of the same " \
               f"type or fp8, got a {cache_dtype} cache"
    return _device_reason(device, cache_dtype if cache_dtype in FP8_TYPES else False)


def _nvfp4_reason(index_head_dim, block_size, query_dtype, device) -> str | None:
    """An NVFP4 index cache (uint8, openmsa.nvfp4): 128-token pages of 128-dim keys, an fp8
    e4m3 or 16-bit query; the kernels turn the codes into e4m3 bytes and convert those with the
    hardware's e4m3 conversion, so they need fp8 hardware (compute capability 8.9)."""
    reason = nvfp4.requirement_reason(index_head_dim, block_size)
    if reason is not None:
        return reason
    if query_dtype not in (FP8, *HALF):
        return f"an NVFP4 index cache takes a float8_e4m3fn, bfloat16 or float16 index query, " \
               f"got {str(query_dtype).replace('torch.', '')}"
    return _device_reason(device, FP8)


def attention_unsupported_reason(*, head_dim: int, block_size: int, group_size: int,
                                 query_dtype: torch.dtype, kv_dtype: torch.dtype,
                                 topk: int | None = None, device=None) -> str | None:
    lo, hi = BLOCK_RANGE
    if topk is not None and topk > MAX_TOPK:
        # the kernel deduplicates a selection row with a [K, K] compare in registers
        return f"the attention kernels take selections of up to {MAX_TOPK} blocks per row, " \
               f"got {topk}"

    if not lo <= block_size <= hi:
        return f"the attention kernels take block sizes {lo}-{hi}, got {block_size}"
    if head_dim not in HEAD_DIMS:
        return f"the attention kernels take head dims {HEAD_DIMS}, got {head_dim}"
    if group_size > 128:
        return f"the attention kernels take at most 128 query heads per KV head, got {group_size}"
    if query_dtype not in (*HALF, torch.float32):
        return f"the attention kernels take bf16/fp16 queries, got {query_dtype}"
    if kv_dtype not in (*HALF, *FP8_TYPES, torch.float32):
        return f"the attention kernels take bf16/fp16/fp8 e4m3 (fn or fnuz) K/V, got {kv_dtype}"
    if INTERPRET and device is not None and torch.device(device).type == "cpu" \
            and torch.bfloat16 in (query_dtype, kv_dtype):
        # Triton 3.6's interpreter returns garbage (~1e9) from the attention kernel's bf16 dots;
        # fp16 and fp32 are exact
        return "Triton's interpreter computes the attention kernel wrongly in bf16: use fp16 " \
               "or fp32 CPU tensors under TRITON_INTERPRET=1 (bf16 runs on the GPU)"
    return _device_reason(device, kv_dtype if kv_dtype in FP8_TYPES else False)


def unsupported_reason(config: MSAConfig | None = None, *, index_dtype: torch.dtype = FP8,
                       index_query_dtype: torch.dtype | None = None,
                       query_dtype: torch.dtype = torch.bfloat16,
                       kv_dtype: torch.dtype = torch.bfloat16, device=None) -> str | None:
    """Why openmsa's kernels cannot run a layer of `config` with these dtypes on `device`, in
    one sentence; None when they can.

    Args:
        config: the layer (M3's defaults when None).
        index_dtype: dtype of the index cache; torch.uint8 for NVFP4 index pages (72 bytes per
            token; needs index_head_dim == block_size == 128).
        index_query_dtype: dtype of the index query (the index cache's when None; fp8 e4m3
            against NVFP4 pages).
        query_dtype: dtype of the main branch's q.
        kv_dtype: dtype of the main K/V cache.
        device: the target device; None skips the device checks.
    """
    config = config or MSAConfig()
    reason = indexer_unsupported_reason(
        num_index_heads=config.num_index_heads, index_head_dim=config.index_head_dim,
        block_size=config.block_size, topk=config.topk_blocks,
        query_dtype=index_query_dtype or nvfp4.index_query_dtype(index_dtype),
        cache_dtype=index_dtype, device=device)
    if reason is not None:
        return reason
    return attention_unsupported_reason(
        head_dim=config.head_dim, block_size=config.block_size, group_size=config.group_size,
        query_dtype=query_dtype, kv_dtype=kv_dtype, topk=config.topk_blocks, device=device)
