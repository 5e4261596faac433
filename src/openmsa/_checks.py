# SPDX-License-Identifier: Apache-2.0
"""Argument validation shared by the public ops: shapes, dtypes and devices only, never values,
so nothing here synchronises with the GPU (value checks live in `openmsa.validate_batch`)."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from .nvfp4 import DTYPE as NVFP4_DTYPE

FP8 = torch.float8_e4m3fn
# AMD gfx942's (MI300X/MI325X) fp8: e4m3 without negative zero or infinities, NaN 0x80, max 240
FP8_FNUZ = torch.float8_e4m3fnuz
FP8_TYPES = (FP8, FP8_FNUZ)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 e4m3 type: 448 (OCP), 240 (fnuz)."""
    return 240.0 if dtype == FP8_FNUZ else 448.0
HALF = (torch.bfloat16, torch.float16)
INT_TYPES = (torch.int32,)
# the most blocks a selection row holds (topk), on every device: the selection kernels keep a
# row's best K in registers and the attention kernels deduplicate a row with a [K, K] compare.
# The reference could take more, but a layer that runs on CPU must run on the GPU too
MAX_TOPK = 64


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return "/".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, ndim: int, dtypes: Iterable[torch.dtype] | None = None,
                 device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got "
                            f"{str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {t.device}")


def check_int_tensor(name: str, t, *, ndim: int, device: torch.device | None = None) -> None:
    check_tensor(name, t, ndim=ndim, dtypes=INT_TYPES, device=device)


def check_unit_stride(name: str, t: torch.Tensor) -> None:
    """A 1-D tensor the kernels read as a plain array (a strided view would be read wrongly)."""
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous (stride 1), got stride {t.stride(0)}")


def check_block_size(block_size) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 \
            or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a positive power of two, got {block_size!r}")


def check_step(cu_seqlens_q, seq_lens, block_table, device: torch.device) -> int:
    """The step's metadata tensors; returns the request count R."""
    check_int_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, device=device)
    check_int_tensor("seq_lens", seq_lens, ndim=1, device=device)
    check_int_tensor("block_table", block_table, ndim=2, device=device)
    num_requests = seq_lens.shape[0]
    check_unit_stride("cu_seqlens_q", cu_seqlens_q)
    check_unit_stride("seq_lens", seq_lens)
    if cu_seqlens_q.shape[0] != num_requests + 1:
        raise ValueError(f"cu_seqlens_q must have len(seq_lens) + 1 = {num_requests + 1} entries, "
                         f"got {cu_seqlens_q.shape[0]}")
    if block_table.shape[0] < num_requests:
        raise ValueError(f"block_table must have a row per request ({num_requests}), got "
                         f"{block_table.shape[0]} rows")
    return num_requests


def check_out(name: str, out, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{name} must have dtype {_dtype_names([dtype])}, got "
                        f"{str(out.dtype).replace('torch.', '')}")
    if out.device != device:
        raise ValueError(f"{name} must be on {device}, got {out.device}")


def check_index_dtypes(index_q: torch.Tensor, index_cache: torch.Tensor) -> None:
    """docs/spec.md, Caches and layouts: both fp8; a 16-bit query against the same 16-bit or an
    fp8 cache; fp32 with fp32 (the reference's own precision, for tests). Against NVFP4 pages
    (uint8): an fp8 e4m3fn, 16-bit or fp32 query."""
    q, c = index_q.dtype, index_cache.dtype
    if c == NVFP4_DTYPE:
        if q not in (FP8, *HALF, torch.float32):
            raise TypeError(f"index_q against an NVFP4 index cache (uint8) must be float8_e4m3fn, "
                            f"bfloat16, float16 or float32, got {str(q).replace('torch.', '')}")
        return
    ok = (q == c and q in (*HALF, *FP8_TYPES, torch.float32)) or (q in HALF and c in FP8_TYPES)
    if not ok:
        raise TypeError(f"index_q ({str(q).replace('torch.', '')}) and index_cache "
                        f"({str(c).replace('torch.', '')}) must be both fp8 e4m3 (fn or fnuz), both the same "
                        f"16-bit type, a 16-bit query against an fp8 cache, or both float32")


def check_positive_int(name: str, v, *, minimum: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")


def check_topk(name: str, topk) -> None:
    """A selection width: an int in [1, MAX_TOPK]."""
    check_positive_int(name, topk)
    if topk > MAX_TOPK:
        raise ValueError(f"{name} must be <= {MAX_TOPK} (the kernels' bound, on every device), "
                         f"got {topk}")


def check_scale_arg(name, value, device) -> None:
    """A dequantisation scale: None, a finite nonzero number (checked here: a NaN or infinite
    scale turns every output into NaN, and the cache writes divide by it, silently), or a
    one-element fp32 tensor on the device (its value is the caller's: reading it would
    synchronise). A negative scale is consistent math (stored x / s, read back x * s) and the
    tests use one to catch a scale applied in the wrong place."""
    if value is None:
        return
    if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
        if not (math.isfinite(value) and value != 0):
            raise ValueError(f"{name} must be a finite nonzero number, got {value!r}")
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a float, a one-element fp32 tensor or None, got "
                        f"{type(value).__name__}")
    if value.numel() != 1 or value.dtype != torch.float32 or value.device != device:
        raise ValueError(f"{name} must be a one-element float32 tensor on {device}, got "
                         f"{tuple(value.shape)} {value.dtype} on {value.device}")


def check_cp_shape(cp_size, cp_rank, *,
                   names: tuple[str, str] = ("cp_size", "cp_rank")) -> None:
    """A context-parallel (size, rank): a positive int size and an int rank in [0, size), the
    errors naming the arguments `names` (the ops' cp_size / cp_rank, MSAPlanner's
    cp_size / cp_rank)."""
    size_name, rank_name = names
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"{size_name} must be a positive int, got {cp_size!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"{rank_name} must be in [0, {size_name}={cp_size}), got {cp_rank!r}")


def check_process_group(name: str, group) -> None:
    """A torch.distributed process group (context-parallel selection's cp_group)."""
    import torch.distributed as dist
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup or None, got "
                        f"{type(group).__name__}")
