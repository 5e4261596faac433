# SPDX-License-Identifier: Apache-2.0
"""Tier 2 (an H200): M3 shapes, 1M-token contexts, caches past 2^31 bytes/elements (int64
offsets), bf16 and kernel-side fp8, determinism and CUDA-graph replay."""

import pytest
import torch
import triton
import triton.language as tl

import openmsa
from openmsa import reference as ref
from helpers import assert_close, cuda_step, make_step, random_index_inputs

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
B = 128


@triton.jit
def _gather_kernel(x_ptr, out_ptr, n, stride, OFFSET: tl.constexpr, NP: tl.constexpr):
    i = tl.arange(0, NP)
    tl.store(out_ptr + i, tl.load(x_ptr + i * stride + OFFSET, mask=i < n, other=-1), mask=i < n)


def test_launcher_cache_keys_on_what_triton_specialises(monkeypatch):
    """Launcher's cached path runs a kernel only on arguments it was compiled for: a stride of
    1 (a constexpr to Triton), multiples of 16 and not, a 16-byte-aligned address and a
    misaligned view, each against torch; a repeated call skips JITFunction.run."""
    import triton.runtime.jit as tjit

    from openmsa.ops.common.launch import Launcher
    calls = []
    orig = tjit.JITFunction.run

    def counted(self, *args, **kwargs):
        calls.append(self)
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(tjit.JITFunction, "run", counted)
    launch = Launcher(_gather_kernel)
    base = torch.arange(4096, dtype=torch.int32, device="cuda")
    cases = [(base, 16, 5), (base, 1, 5), (base, 17, 9), (base[3:], 16, 5), (base[3:], 1, 1),
             (base, 16, 5), (base[3:], 17, 9), (base, 1, 16)]
    for trial in range(2):
        for x, stride, n in cases:
            out = torch.full((n,), -7, dtype=torch.int32, device="cuda")
            launch((1,), x, out, n, stride, OFFSET=2, NP=16, num_warps=1)
            want = x[2::stride][:n]
            assert torch.equal(out, want), (trial, x.data_ptr() % 16, stride, n)
        if trial == 0:
            first = len(calls)
    assert first <= len(cases) and len(calls) == first  # the second round: cached launches only


@pytest.mark.parametrize("verify", [True, False])
def test_attention_and_selection_repeated_with_misaligned_views(verify, monkeypatch):
    """The ops through their launchers: the same shapes called again with q, out and the index
    query at a 2-byte offset (not 16-byte aligned), against the reference each time; with the
    planned launches checked against Triton's key (as the rest of the suite) and as engines run
    them (unchecked)."""
    from openmsa.ops.common import launch as launch_mod
    monkeypatch.setattr(launch_mod, "VERIFY_PLAN_KEYS", verify)
    step = make_step([1, 1, 4], [3000, 700, 5000], block_size=B)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(step.num_pages, B, 1, 128, generator=g).bfloat16()
    v = torch.randn(step.num_pages, B, 1, 128, generator=g).bfloat16()
    iq, ic = random_index_inputs(step, num_heads=1, head_dim=128, block_size=B,
                                 q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16,
                                 integer=True)
    d = cuda_step(step)
    kc, vc, icc = k.cuda(), v.cuda(), ic.cuda()
    for offset in (0, 1, 0, 1):
        q = torch.randn(6, 16, 128, generator=g).bfloat16()
        qbuf = torch.empty(q.numel() + 8, dtype=torch.bfloat16, device="cuda")
        qc = qbuf[offset:offset + q.numel()].view(q.shape).copy_(q)
        ibuf = torch.empty(iq.numel() + 8, dtype=torch.bfloat16, device="cuda")
        iqc = ibuf[offset:offset + iq.numel()].view(iq.shape).copy_(iq)
        idx = openmsa.select_blocks(iqc, icc, d.cu_seqlens_q, d.seq_lens, d.block_table,
                                    block_size=B)
        want_idx = ref.select_blocks(iq, ic, step.cu_seqlens_q, step.seq_lens,
                                     step.block_table, block_size=B)
        assert torch.equal(idx.cpu(), want_idx), offset
        obuf = torch.empty(q.numel() + 8, dtype=torch.bfloat16, device="cuda")
        out = obuf[offset:offset + q.numel()].view(q.shape)
        openmsa.sparse_attention(qc, kc, vc, idx, d.cu_seqlens_q, d.seq_lens, d.block_table,
                                 out=out)
        want = ref.sparse_attention(q, k, v, want_idx, step.cu_seqlens_q, step.seq_lens,
                                    step.block_table)
        assert_close(out, want)
