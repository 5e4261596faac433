# SPDX-License-Identifier: Apache-2.0
"""The NVFP4 index-cache format (docs/spec.md, "NVFP4 index pages"), in pure PyTorch: the page
layout, the quantizer every writer must match bit for bit, and the dequantizer the reference
scores with.

A page holds 128 tokens' index keys (Di = 128) in 9216 bytes, viewed as uint8 [128, 72]: first the
E2M1 codes of all 128 tokens (64 bytes each, dim 2j in the low nibble of byte j, dim 2j + 1 in the
high nibble), then their E4M3 scales (8 bytes each, scale g covering dims 16g..16g+15). A key
value is code * scale, exact in fp32, bf16 and fp16. No global scale.
"""

from __future__ import annotations

import torch

__all__ = ["PAGE_TOKENS", "HEAD_DIM", "TOKEN_BYTES", "CODE_BYTES", "SCALE_BYTES", "PAGE_BYTES",
           "GROUP", "quantize_index_keys", "dequantize_index_keys", "page_parts",
           "dequantize_index_pages", "is_nvfp4_cache", "check_nvfp4_cache", "DTYPE",
           "QUERY_DTYPE", "index_query_dtype", "index_cache_shape", "requirement_reason"]

PAGE_TOKENS = 128   # tokens per page (the index block size)
HEAD_DIM = 128      # index head dim
GROUP = 16          # dims per E4M3 scale
CODE_BYTES = HEAD_DIM // 2          # 64: two E2M1 codes per byte
SCALE_BYTES = HEAD_DIM // GROUP     # 8
TOKEN_BYTES = CODE_BYTES + SCALE_BYTES  # 72
PAGE_BYTES = PAGE_TOKENS * TOKEN_BYTES  # 9216
SCALES_AT = PAGE_TOKENS * CODE_BYTES    # 8192: where a page's scales start
# what the kernels need of a page's base address (vector loads of a token's codes)
ALIGN = 16

# an index cache of this dtype is an NVFP4 one; its index query is fp8 e4m3 by default (vLLM's
# "Q8KV4" pairing; a 16-bit query is accepted too)
DTYPE = torch.uint8
QUERY_DTYPE = torch.float8_e4m3fn

# E2M1 magnitudes of codes 0..7
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# E4M3's largest finite value (satfinite), and the floor under amax / 6
_E4M3_MAX = 448.0
_SCALE_FLOOR = 2.0 ** -9


def _e2m1_table(device) -> torch.Tensor:
    """fp32 [16]: the value of each 4-bit code (bit 3: sign)."""
    mag = torch.tensor(_E2M1, dtype=torch.float32, device=device)
    return torch.cat([mag, -mag])


def _round_toward_zero(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp32 x * r rounded toward zero: the product is exact in fp64 (24 + 24 bits), and its
    nearest fp32 is stepped one ulp toward zero where rounding moved it away from zero."""
    exact = x.double() * r.double()
    near = exact.float()
    away = near.double().abs() > exact.abs()
    return torch.where(away, torch.nextafter(near, torch.zeros_like(near)), near)


def _e2m1_codes(p: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (ties to the even code, saturating at 6) of fp32 p, sign in bit 3, and
    no negative zero. int64 of p's shape."""
    m = p.abs()
    # the midpoints between magnitudes; a tie goes to the even code (mantissa bit 0), so the
    # comparison is <= where the lower neighbour is even and < where it is odd
    code = torch.full_like(m, 7, dtype=torch.int64)
    for c, (mid, lower_even) in reversed(list(enumerate(
            ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True),
             (3.5, False), (5.0, True))))):
        below = m <= mid if lower_even else m < mid
        code = torch.where(below & (code > c), torch.full_like(code, c), code)
    negative = (p < 0) & (code != 0)
    return code | (negative.long() << 3)


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 codes and scales of index keys, exactly as vLLM's fused insert kernel stores them.

    Args:
        keys: [N, 128] (any float dtype; quantized from its fp32 value).

    Returns:
        (codes uint8 [N, 64], scales uint8 [N, 8]): a token's 72 bytes, codes first.

    Per group of 16 dims: s = e4m3(max(amax / 6, 2^-9)) (nearest even, saturating at 448);
    r = 1 / s in fp32; each x * r rounded toward zero in fp32, then to the nearest E2M1 (ties to
    even, saturating at 6); a zero code has sign 0. A group holding a NaN gets the NaN scale
    (byte 0x7F) and codes 7, so it dequantizes to NaN (openmsa's rule: whether vLLM's writer,
    whose maximum may skip NaN, does the same is not known); infinities saturate.
    """
    if keys.dim() != 2 or keys.shape[1] != HEAD_DIM:
        raise ValueError(f"keys must be [N, {HEAD_DIM}], got shape {tuple(keys.shape)}")
    x = keys.float().reshape(-1, SCALE_BYTES, GROUP)
    amax = x.abs().amax(-1, keepdim=True)
    s = torch.clamp(torch.clamp(amax / 6.0, min=_SCALE_FLOOR), max=_E4M3_MAX)
    s8 = s.to(torch.float8_e4m3fn)
    r = 1.0 / s8.float()
    code = _e2m1_codes(_round_toward_zero(x, r)).reshape(-1, HEAD_DIM)
    codes = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    scales = s8.reshape(-1, SCALE_BYTES).view(torch.uint8)
    return codes, scales


def dequantize_index_keys(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [..., 128] keys of uint8 codes [..., 64] and scales [..., 8] (exact)."""
    table = _e2m1_table(codes.device)
    c = codes.long()
    values = torch.stack([table[c & 15], table[c >> 4]], dim=-1).flatten(-2)  # [..., 128]
    s = scales.contiguous().view(torch.float8_e4m3fn).float()
    return (values.unflatten(-1, (SCALE_BYTES, GROUP)) * s[..., None]).flatten(-2)


def index_query_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    """The index query's default dtype for an index cache of `cache_dtype`: the cache's own,
    except fp8 e4m3 against NVFP4 pages (uint8 holds no query)."""
    return QUERY_DTYPE if cache_dtype == DTYPE else cache_dtype


def requirement_reason(index_head_dim: int, block_size: int) -> str | None:
    """Why a layer cannot use NVFP4 index pages, in one sentence (None: it can): the format
    fixes both the index head dim and the page size at 128."""
    if index_head_dim != HEAD_DIM or block_size != PAGE_TOKENS:
        return (f"an NVFP4 index cache needs index_head_dim == {HEAD_DIM} and block_size == "
                f"{PAGE_TOKENS} (72-byte tokens in 9216-byte pages), got index_head_dim "
                f"{index_head_dim} and block_size {block_size}")
    return None


def index_cache_shape(num_pages: int, block_size: int, index_head_dim: int,
                      dtype: torch.dtype) -> tuple[int, int, int]:
    """The shape of an index cache of `dtype`: [P, B, Di], or [P, 128, 72] bytes for NVFP4
    (which needs B == Di == 128: ValueError otherwise)."""
    if dtype != DTYPE:
        return num_pages, block_size, index_head_dim
    reason = requirement_reason(index_head_dim, block_size)
    if reason is not None:
        raise ValueError(reason)
    return num_pages, PAGE_TOKENS, TOKEN_BYTES


def is_nvfp4_cache(index_cache) -> bool:
    """Whether an index cache is an NVFP4 one: the uint8 dtype says so (a uint8 cache is never
    read as anything else)."""
    return isinstance(index_cache, torch.Tensor) and index_cache.dtype == DTYPE


def check_nvfp4_cache(name: str, index_cache: torch.Tensor, *, block_size: int | None = None,
                      head_dim: tuple[str, int] | None = None) -> None:
    """A uint8 index cache must be [P, 128, 72] pages, each page 9216 contiguous bytes at a page
    stride that keeps every page 16-byte aligned; raises ValueError naming the argument.
    head_dim: (where it comes from, its value) of the index keys read or written: 128."""
    if head_dim is not None and head_dim[1] != HEAD_DIM:
        raise ValueError(f"{head_dim[0]}: an NVFP4 index cache holds {HEAD_DIM}-dim index keys, "
                         f"got index head dim {head_dim[1]}")
    if index_cache.dim() != 3 or tuple(index_cache.shape[1:]) != (PAGE_TOKENS, TOKEN_BYTES):
        raise ValueError(f"{name}: an NVFP4 index cache (uint8) must be [P, {PAGE_TOKENS}, "
                         f"{TOKEN_BYTES}] pages, got shape {tuple(index_cache.shape)}")
    if block_size is not None and block_size != PAGE_TOKENS:
        raise ValueError(f"{name}: an NVFP4 index cache holds {PAGE_TOKENS}-token pages; "
                         f"block_size must be {PAGE_TOKENS}, got {block_size}")
    if index_cache.stride(1) != TOKEN_BYTES or index_cache.stride(2) != 1:
        raise ValueError(f"{name}: each NVFP4 page must be {PAGE_BYTES} contiguous bytes "
                         f"(strides (*, {TOKEN_BYTES}, 1)), got strides "
                         f"{tuple(index_cache.stride())}")
    page_stride = index_cache.stride(0)
    if index_cache.shape[0] > 1 and (page_stride < PAGE_BYTES or page_stride % ALIGN):
        raise ValueError(f"{name}: NVFP4 pages must not overlap and must sit {ALIGN}-byte "
                         f"aligned: the page stride must be a multiple of {ALIGN} and at least "
                         f"{PAGE_BYTES}, got {page_stride}")
    if index_cache.data_ptr() % ALIGN:
        raise ValueError(f"{name}: an NVFP4 index cache must start {ALIGN}-byte aligned, got "
                         f"address {index_cache.data_ptr():#x}")


def page_parts(index_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a checked NVFP4 cache's codes, uint8 [P, 128, 64], and scales, [P, 128, 8]
    (the same storage: writing them writes the cache)."""
    pages = index_cache.shape[0]
    stride = index_cache.stride(0)
    offset = index_cache.storage_offset()
    codes = index_cache.as_strided((pages, PAGE_TOKENS, CODE_BYTES), (stride, CODE_BYTES, 1),
                                   offset)
    scales = index_cache.as_strided((pages, PAGE_TOKENS, SCALE_BYTES),
                                    (stride, SCALE_BYTES, 1), offset + SCALES_AT)
    return codes, scales


def dequantize_index_pages(index_cache: torch.Tensor) -> torch.Tensor:
    """fp32 [P, 128, 128]: the index keys an NVFP4 cache ([P, 128, 72] uint8) holds, exactly
    (for tests, and for engines that want to inspect their pages)."""
    if not is_nvfp4_cache(index_cache):
        raise TypeError(f"index_cache must be an NVFP4 cache (uint8), got {index_cache.dtype}")
    check_nvfp4_cache("index_cache", index_cache)
    codes, scales = page_parts(index_cache)
    return dequantize_index_keys(codes, scales)
