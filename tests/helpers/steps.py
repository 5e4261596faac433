# SPDX-License-Identifier: Apache-2.0
"""Random steps in an engine's layout (packed tokens, scattered pages) and their inputs."""

from __future__ import annotations

from dataclasses import dataclass

import dataclasses

import torch

from openmsa.ops.cache.reference import to_cache_dtype

__all__ = ["Step", "make_step", "random_index_inputs", "random_kv_cache", "to_device",
           "nan_poison", "cuda_step", "compact_pages"]


@dataclass
class Step:
    """One forward step in an engine's layout (all int32 on `device`)."""
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_pages: int
    num_tokens: int
    slot_mapping: torch.Tensor  # int64 [T]: the slot of each query token's own key, -1 padding

    @property
    def q_lens(self) -> list[int]:
        cu = self.cu_seqlens_q.tolist()
        return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


def make_step(q_lens, seq_lens, *, block_size: int, device="cpu", extra_columns: int = 0,
              pad_tokens: int = 0, spare_pages: int = 3, generator: torch.Generator | None = None,
              ) -> Step:
    """A step whose requests own scattered physical pages (a random permutation), with
    `extra_columns` unused block-table columns (filled with -1 garbage ids) and `pad_tokens`
    tokens after cu_seqlens_q[R] that belong to no request."""
    g = generator or torch.Generator().manual_seed(0)
    assert len(q_lens) == len(seq_lens)
    blocks = [-(-s // block_size) for s in seq_lens]
    width = max(blocks + [1]) + extra_columns
    num_pages = sum(blocks) + spare_pages
    perm = torch.randperm(num_pages, generator=g)
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(blocks):
        table[r, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    num_tokens = int(cu[-1]) + pad_tokens
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        for i in range(ql):
            pos = sl - ql + i
            if pos >= 0:
                slots[int(cu[r]) + i] = int(table[r, pos // block_size]) * block_size \
                    + pos % block_size
    return Step(cu.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                table.to(device), num_pages, num_tokens, slots.to(device))


def random_index_inputs(step: Step, *, num_heads: int, head_dim: int, block_size: int,
                        q_dtype: torch.dtype, cache_dtype: torch.dtype, integer: bool = False,
                        device="cpu", generator: torch.Generator | None = None):
    """index_q [T, H, Di] and index_cache [P, B, Di]. With `integer`, values are small integers,
    so every dot product is exact in fp32 and ties between blocks are frequent (the tie rule
    decides them)."""
    g = generator or torch.Generator().manual_seed(1)
    shape_q = (step.num_tokens, num_heads, head_dim)
    shape_c = (step.num_pages, block_size, head_dim)
    if integer:
        q = torch.randint(-2, 3, shape_q, generator=g).float()
        c = torch.randint(-2, 3, shape_c, generator=g).float()
    else:
        q = torch.randn(shape_q, generator=g)
        c = torch.randn(shape_c, generator=g)
    return to_cache_dtype(q, q_dtype).to(device), to_cache_dtype(c, cache_dtype).to(device)


def random_kv_cache(num_pages: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                    dtype: torch.dtype, layout: str = "flash", device="cpu",
                    generator: torch.Generator | None = None):
    """(k_cache, v_cache) viewed [P, B, Hkv, D]. layout 'flash' is two contiguous tensors;
    'vllm' is one packed [P, Hkv, B, 2*D] tensor (K first) seen through permuted views; 'odd' is
    'vllm' with one unused byte between K and V (rows of 2*D + 1 elements): odd strides and an odd
    V offset, which kernels reading fp8 in byte pairs must detect and read byte by byte."""
    g = generator or torch.Generator().manual_seed(2)
    if layout == "flash":
        k = torch.randn(num_pages, block_size, num_kv_heads, head_dim, generator=g)
        v = torch.randn(num_pages, block_size, num_kv_heads, head_dim, generator=g)
        return to_cache_dtype(k, dtype).to(device), to_cache_dtype(v, dtype).to(device)
    if layout == "vllm":
        packed = to_cache_dtype(torch.randn(num_pages, num_kv_heads, block_size, 2 * head_dim,
                                            generator=g), dtype).to(device)
        return (packed[..., :head_dim].permute(0, 2, 1, 3),
                packed[..., head_dim:].permute(0, 2, 1, 3))
    if layout == "odd":
        packed = to_cache_dtype(torch.randn(num_pages, num_kv_heads, block_size, 2 * head_dim + 1,
                                            generator=g), dtype).to(device)
        return (packed[..., :head_dim].permute(0, 2, 1, 3),
                packed[..., head_dim + 1:].permute(0, 2, 1, 3))
    raise ValueError(f"layout must be 'flash', 'vllm' or 'odd', got {layout!r}")


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """x on `device` as the same view (strides and storage offset) of a copy of its whole storage.
    Tensor.to makes a non-dense view (the packed layouts above) contiguous, which would test a
    different layout on the GPU than on the CPU."""
    if torch.device(device) == x.device:
        return x
    raw = torch.empty(0, dtype=torch.uint8).set_(x.untyped_storage()).to(device)
    return raw.view(x.dtype).as_strided(x.shape, x.stride(), x.storage_offset())


def nan_poison(shape, dtype, device) -> torch.Tensor:
    """An output buffer full of NaN (or -7 for integer dtypes): unwritten entries stay visible."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -7, dtype=dtype, device=device)


def cuda_step(step):
    """A copy of the step with its tensors on the GPU (the CPU original feeds the reference)."""
    return dataclasses.replace(step, **{name: getattr(step, name).cuda() for name in (
        "cu_seqlens_q", "seq_lens", "block_table", "slot_mapping")})


def compact_pages(cache, step):
    """The pages a step uses, copied to a small CPU cache with a renumbered table: the
    reference then runs on CPU against a cache of any size on the GPU."""
    used = step.block_table[step.block_table >= 0].unique()
    remap = torch.full((cache.shape[0],), -1, dtype=torch.int32)
    remap[used.long().cpu()] = torch.arange(len(used), dtype=torch.int32)
    table = torch.where(step.block_table.cpu() >= 0,
                        remap[step.block_table.cpu().clamp(min=0).long()],
                        -1)
    return cache[used.long()].cpu(), table
