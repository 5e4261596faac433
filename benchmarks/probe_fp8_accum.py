# SPDX-License-Identifier: Apache-2.0
"""How exact is S = q . k on Hopper's fp8 tensor cores when q is split into e4m3 hi + lo parts
(the attention tiles' fp8 S = Q K^T form, since deleted)?   python3 benchmarks/probe_fp8_accum.py

q: bf16 [M, 128] rows of three magnitudes (0.25, 1, 3: heads differ), k: e4m3 [N, 128]. Each q
row is scaled by a power of two (largest magnitude <= 224) and split as the kernel does; the
parts times k go through cuBLAS's fp8 GEMM (`torch._scaled_mm`, fp32 output) with Hopper's fast
accumulation and without it, over the whole head dim at once and as four 32-wide slices summed
in fp32 (one MMA instruction's K each). Printed: the largest |S - S_exact| relative to each
row's largest |S_exact|, and the share of hi + lo equal to q. If the slices are as wrong as the
whole, the error is inside one instruction (the products' alignment), not in the chained
accumulation, and no split of the accumulation removes it.
"""

import torch


def split_rows(q):
    """q (fp32) as per-row power-of-two scale, e4m3 hi, e4m3 lo (as that form did)."""
    amax = q.abs().amax(dim=1, keepdim=True)
    e = torch.floor(torch.log2(224.0 / amax)).clamp(-126, 126)
    qs = q * torch.exp2(e)
    hi = qs.to(torch.float8_e4m3fn)
    lo = (qs - hi.float()).to(torch.float8_e4m3fn)
    return torch.exp2(-e), hi, lo


def gemm(a, b, fast):
    one = torch.ones((), device=a.device)
    return torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                            use_fast_accum=fast)


def main():
    torch.manual_seed(0)
    m, n, d = 4096, 4096, 128
    scale = torch.tensor([0.25, 1.0, 3.0]).repeat(m)[:m, None]
    q = (torch.randn(m, d) * scale).to(torch.bfloat16).cuda()
    k = torch.randn(n, d).to(torch.float8_e4m3fn).cuda()
    exact = q.double() @ k.double().t()
    f, hi, lo = split_rows(q.float())
    print(f"hi + lo == q on {((hi.float() + lo.float()) * f == q.float()).float().mean():.4%}"
          " of elements")
    row_max = exact.abs().amax(dim=1, keepdim=True)
    for fast in (True, False):
        whole = (gemm(hi, k, fast) + gemm(lo, k, fast)).double() * f.double()
        sliced = sum(gemm(p[:, i:i + 32].contiguous(), k[:, i:i + 32].contiguous(), fast)
                     for p in (hi, lo) for i in range(0, d, 32)).double() * f.double()
        for name, s in (("K = 128", whole), ("4 x K = 32", sliced)):
            err = ((s - exact).abs() / row_max).amax().item()
            mean = ((s - exact).abs() / row_max).mean().item()
            print(f"fast_accum={fast!s:5} {name:10}: max |dS| / row max |S| {err:.2e}, "
                  f"mean {mean:.2e}")
    # the fp16 path (prefill.py's F16_COMPUTE) for comparison: q rounded to fp16 (there after
    # the softmax scale), exact products, fp32 sums (TF32 off: torch's default)
    s16 = (q.half().float() @ k.float().t()).double()
    print(f"q as fp16, fp32 sums   : max |dS| / row max |S| "
          f"{((s16 - exact).abs() / row_max).amax().item():.2e}")


if __name__ == "__main__":
    main()
