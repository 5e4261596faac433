# SPDX-License-Identifier: Apache-2.0
"""Tiers 1 and 2: every kernel against the reference, on the kernel device (the CPU through
Triton's interpreter, or a GPU). Shapes stay tiny so the interpreter runs them in seconds."""

import pytest
import torch
import triton
import triton.language as tl

import openmsa
from openmsa import reference as ref
from helpers import assert_close, make_step, random_index_inputs, random_kv_cache
from openmsa.ops.common.triton_utils import find_request, split_e4m3_pairs

pytestmark = pytest.mark.interpret

B = 16
# decode, 3-token verify, q_len 0, a 20-token prefill chunk (the tile launch), decode in the
# first block, seq_len 0, and 2 padding tokens after cu_seqlens_q[R]
Q_LENS = [1, 3, 0, 20, 1, 0]
SEQ_LENS = [70, 45, 9, 100, 5, 0]
FP8 = torch.float8_e4m3fn
def _to(step, device):
    for name in ("cu_seqlens_q", "seq_lens", "block_table", "slot_mapping"):
        setattr(step, name, getattr(step, name).to(device))
    return step




@pytest.mark.parametrize("block, index_dim, head_dim", [(32, 64, 128), (64, 256, 256)])
def test_other_block_sizes_and_head_dims(kernel_device, block, index_dim, head_dim):
    """Block sizes and head dims besides the 16/32/64 of the cases above: exact selection on
    integer inputs, attention within tolerance, one step with a decode, a verify and a chunk."""
    q_lens, seq_lens = [1, 3, 18], [5 * block + 3, 2 * block, 4 * block - 1]
    step = make_step(q_lens, seq_lens, block_size=block, extra_columns=1)
    d = _to(make_step(q_lens, seq_lens, block_size=block, extra_columns=1), kernel_device)
    qi, ci = random_index_inputs(step, num_heads=2, head_dim=index_dim, block_size=block,
                                 q_dtype=torch.float16, cache_dtype=torch.float16, integer=True)
    want = ref.select_blocks(qi, ci, step.cu_seqlens_q, step.seq_lens, step.block_table, topk=3,
                             block_size=block)
    got = openmsa.select_blocks(qi.to(kernel_device), ci.to(kernel_device), d.cu_seqlens_q,
                                d.seq_lens, d.block_table, topk=3, block_size=block)
    assert torch.equal(got.cpu(), want)
    k, v = random_kv_cache(step.num_pages, block, 1, head_dim, dtype=torch.float16)
    q = torch.randn(step.num_tokens, 2, head_dim).half()
    want = ref.sparse_attention(q, k, v, want, step.cu_seqlens_q, step.seq_lens,
                                step.block_table, block_size=block)
    out = openmsa.sparse_attention(q.to(kernel_device), k.to(kernel_device), v.to(kernel_device),
                                   got, d.cu_seqlens_q, d.seq_lens, d.block_table,
                                   block_size=block)
    assert_close(out, want)


@triton.jit
def _split_pairs_kernel(x_ptr, lo_ptr, hi_ptr, PTX: tl.constexpr, N: tl.constexpr):
    i = tl.program_id(0) * N + tl.arange(0, N)
    lo, hi = split_e4m3_pairs(tl.load(x_ptr.to(tl.pointer_type(tl.uint16)) + i), PTX)
    tl.store(lo_ptr + i, lo)
    tl.store(hi_ptr + i, hi)


def test_fp8_byte_pairs_split_exactly_on_every_pattern(kernel_device):
    """split_e4m3_pairs (the attention's fp8 V path) on all 65536 16-bit patterns: low and high
    bytes as fp16 bit for bit as torch converts them, signed zeros, subnormals, the extremes
    (+-448) and NaN included; the PTX path on the GPU, the casts under the interpreter."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    lo = torch.empty(65536, dtype=torch.float16, device=kernel_device)
    hi = torch.empty_like(lo)
    _split_pairs_kernel[(64,)](x.to(kernel_device), lo, hi, PTX=kernel_device == "cuda", N=1024)
    # little-endian: element bits 0-7 are its first byte
    raw = x.view(torch.uint8).view(-1, 2)
    for got, byte in ((lo, raw[:, 0]), (hi, raw[:, 1])):
        want = byte.contiguous().view(FP8).to(torch.float16)
        got = got.cpu()
        assert torch.equal(got.isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16))


@triton.jit
def _find_request_kernel(cu_ptr, guess_ptr, out_ptr, num_requests):
    t = tl.program_id(0)
    tl.store(out_ptr + t, find_request(cu_ptr, num_requests, t, tl.load(guess_ptr + t)))


def test_find_request_with_any_guess(kernel_device):
    """find_request's guess (one check of cu[g] <= t < cu[g+1] before the binary search) gives
    the search's answer for every guess: right ones, wrong ones, -1, out of range; on layouts
    with zero-length requests, padding tokens past cu[R] and equal q_len (where t * R // T is
    always right)."""
    g = torch.Generator().manual_seed(11)
    layouts = [[1] * 8, [4] * 5, [0, 3, 0, 0, 2, 5, 0], [1, 3, 0, 20, 1, 0], [7], [0, 0, 2]]
    for q_lens in layouts:
        cu = torch.tensor([0] + q_lens).cumsum(0).int()
        num_tokens = int(cu[-1]) + 3  # 3 padding tokens
        r = len(q_lens)
        t = torch.arange(num_tokens)
        want = torch.searchsorted(cu[1:], t, right=True).clamp(max=r).int()
        guesses = [t * r // num_tokens, want.long(), torch.full_like(t, -1),
                   torch.full_like(t, r + 2), torch.randint(0, r, (num_tokens,), generator=g)]
        for guess in guesses:
            out = torch.full((num_tokens,), -7, dtype=torch.int32, device=kernel_device)
            _find_request_kernel[(num_tokens,)](cu.to(kernel_device),
                                                guess.int().to(kernel_device), out, r)
            assert torch.equal(out.cpu(), want), (q_lens, guess)

