# SPDX-License-Identifier: Apache-2.0
"""What the interpreter tier rests on: under TRITON_INTERPRET=1 a kernel's float casts and bf16
dots give the GPU's values (openmsa._interpreter replaces Triton 3.6's interpreter conversion,
which truncated fp32 -> bf16, dropped the carry of fp32 -> e4m3 rounding and turned NaN into
384), so bf16 and fp8 on CPU tensors are computed, not approximated. The ops built on them are
checked bit for bit against the reference in tests/ops (bf16 index scores, fp8 cache writes); here the
casts themselves, over every e4m3 byte and random fp32 values around every rounding boundary.
On a GPU the same kernels check the hardware's conversions against torch's."""

import os

import pytest
import torch
import triton
import triton.language as tl

# (imported before any launch: under the interpreter it puts in exact casts, _interpreter.py)
import openmsa

pytestmark = pytest.mark.interpret

FP8 = torch.float8_e4m3fn
FNUZ = torch.float8_e4m3fnuz
ON_FNUZ = pytest.mark.skipif(torch.cuda.is_available() and torch.version.hip is None,
                             reason="e4m3fnuz is AMD gfx942's fp8; NVIDIA GPUs have none")


@triton.jit
def _cast_kernel(x_ptr, y_ptr, N: tl.constexpr, SATURATE: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    if SATURATE:
        # as the cache writes' saturate_to: a compare keeps NaN
        big = 240.0 if y_ptr.dtype.element_ty == tl.float8e4b8 else 448.0
        x = tl.where(x > big, big, tl.where(x < -big, -big, x))
    tl.store(y_ptr + i, x.to(y_ptr.dtype.element_ty))


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    m = tl.arange(0, M)[:, None]
    k = tl.arange(0, K)
    n = tl.arange(0, N)[None, :]
    a = tl.load(a_ptr + m * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n)
    tl.store(c_ptr + m * N + n, tl.dot(a, b))


def _cast(x, dtype, device, saturate=False):
    y = torch.empty(x.shape, dtype=dtype, device=device)
    _cast_kernel[(1,)](x.to(device), y, x.numel(), saturate)
    return y.cpu()


def _same(got, want):
    """Equal bits, or both NaN (a GPU writes its own NaN pattern)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    both_nan = got.float().isnan() & want.float().isnan()
    return bool(((got.view(bits) == want.view(bits)) | both_nan).all())


def _fp32_values(seed=0):
    """Random fp32 over many binades, the midpoints between neighbouring e4m3 and bf16 values and
    one ulp either side (where a rounding decides), and the edges: +-0, subnormals, the largest
    values, +-inf and NaN. 4096 of them (a power of two: one tl.arange)."""
    g = torch.Generator().manual_seed(seed)
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    near = torch.cat([mids, mids.nextafter(torch.full_like(mids, 1e9)),
                      mids.nextafter(torch.zeros_like(mids))])
    edges = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 2.0 ** -10, 240.0, 248.0, 448.0, 464.0,
                          1e30, -1e30, 3.4e38, float("inf"), float("-inf"), float("nan")])
    random = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-20, 20, (4096,),
                                                                       generator=g).float())
    x = torch.cat([near, -near, edges, random])[:4096]
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, FP8,
                                   pytest.param(FNUZ, marks=ON_FNUZ)])
def test_fp32_casts_round_to_nearest_even(kernel_device, dtype):
    x = _fp32_values()
    saturate = dtype in (FP8, FNUZ)
    if saturate:
        big = torch.finfo(dtype).max
        want = torch.where(x.isnan(), x, x.clamp(-big, big)).to(dtype)
    else:
        want = x.to(dtype)
    assert _same(_cast(x, dtype, kernel_device, saturate), want)


@pytest.mark.parametrize("src", [FP8, pytest.param(FNUZ, marks=ON_FNUZ), torch.bfloat16])
@pytest.mark.parametrize("dst", [torch.float32, torch.float16, torch.bfloat16])
def test_narrow_types_widen_exactly(kernel_device, src, dst):
    """Every e4m3 byte (the NaN bytes as NaN, not 480), and bf16 values, converted up."""
    if src == dst:
        pytest.skip("no conversion")
    if src == torch.bfloat16:
        x = _fp32_values(1).to(torch.bfloat16)
    else:
        x = torch.arange(256, dtype=torch.uint8).view(src)
    assert _same(_cast(x, dst, kernel_device), x.to(dst))


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8, torch.float16])
def test_dots_of_narrow_types(kernel_device, dtype):
    """A dot of integer-valued tiles is exact in any order of summation: it must equal the fp32
    product (bf16 tiles were multiplied as their uint16 bits, ~1e10)."""
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-8, 9, (16, 32), generator=g).float()
    b = torch.randint(-8, 9, (32, 16), generator=g).float()
    c = torch.empty(16, 16, device=kernel_device)
    _dot_kernel[(1,)](a.to(dtype).to(kernel_device), b.to(dtype).to(kernel_device), c,
                      16, 32, 16)
    assert torch.equal(c.cpu(), a @ b)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                    reason="the refusal is the interpreter's (bf16 attention runs on GPUs)")
def test_bf16_attention_is_refused_by_name():
    """Elementwise bf16 arithmetic is still the interpreter's own (wrong): the attention
    kernels refuse bf16 CPU tensors by name, before any launch, and fp16 runs."""
    from helpers import make_step
    step = make_step([1, 2], [40, 20], block_size=16)
    k = torch.randn(step.num_pages, 16, 2, 64)
    args = (k, k.clone(), torch.zeros(3, 2, 4, dtype=torch.int32), step.cu_seqlens_q,
            step.seq_lens, step.block_table)
    q = torch.randn(3, 8, 64)
    assert openmsa.sparse_attention(q.half(), *(a.half() if a.is_floating_point() else a
                                                for a in args), block_size=16).isfinite().all()
    for q_dtype, kv_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16)):
        with pytest.raises(ValueError, match="interpreter computes the attention kernel "
                                             "wrongly in bf16"):
            openmsa.sparse_attention(q.to(q_dtype), k.to(kv_dtype), k.to(kv_dtype), *args[2:],
                                     block_size=16)
