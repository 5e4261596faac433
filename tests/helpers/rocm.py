# SPDX-License-Identifier: Apache-2.0
"""AMD Instinct devices as plans see them, and the step shapes whose plans the ROCm tests build:
decode, verify (a few tokens per request) and prefill chunks at M3's shapes, 16-bit and fp8
caches. tests/plans/test_rocm_plan.py checks what the plans pick there; tests/test_compile_rocm.py
compiles every Triton launch they pick for gfx942 and gfx950 (no GPU needed)."""

import torch

from openmsa.ops.attention.plan import AttentionShape
from openmsa.ops.common.plan import DeviceFacts
from openmsa.ops.indexer.plan import IndexerShape

# torch on ROCm reports gfx942 as capability 9.4 and gfx950 as 9.5; CU counts of an MI300X and
# an MI355X
MI300X = DeviceFacts(kind="cuda", num_sms=304, capability=(9, 4), gluon_hopper=False, hip=True)
MI355X = DeviceFacts(kind="cuda", num_sms=256, capability=(9, 5), gluon_hopper=False, hip=True)
# a ROCm build whose Triton has Gluon: still no Hopper kernels
MI300X_GLUON = DeviceFacts(kind="cuda", num_sms=304, capability=(9, 0), gluon_hopper=True,
                           hip=True)
DEVICES = {"gfx942": MI300X, "gfx950": MI355X}

FP8 = torch.float8_e4m3fn
FNUZ = torch.float8_e4m3fnuz
BF16 = torch.bfloat16
# each target's fp8: e4m3fnuz on gfx942, OCP e4m3 on gfx950 (support.py's ROCM_FP8)
FP8_OF = {MI300X: FNUZ, MI355X: FP8, MI300X_GLUON: FNUZ}

# (name, tokens, requests, blocks per request): decode at small and large batch, verify (4
# tokens per request), a prefill chunk (one request) and a mixed step of several requests
STEPS = [("decode-b1", 1, 1, 1024), ("decode-b128", 128, 128, 256), ("verify-b8", 32, 8, 512),
         ("prefill-8k", 8192, 1, 1024), ("prefill-mixed", 2048, 4, 256)]
# (query heads, KV heads): TP1 and TP8 of M3
HEADS = [(64, 4), (8, 1)]


def attention_shape(tokens, heads=64, kv_heads=4, kv_dtype=BF16, **kw) -> AttentionShape:
    """An M3 step of the attention: head dim 128, topk 16, 128-key blocks."""
    return AttentionShape(num_tokens=tokens, num_heads=heads, num_kv_heads=kv_heads,
                          head_dim=128, num_index_heads=kv_heads, topk=16, block_size=128,
                          q_dtype=BF16, kv_dtype=kv_dtype, **kw)


def indexer_shape(tokens, requests, blocks, heads=4, dtype=FP8, cache_dtype=None, **kw):
    """An M3 step of the index branch (index head dim 128, 128-key blocks, topk 16)."""
    return IndexerShape(num_tokens=tokens, num_heads=heads, head_dim=128, num_requests=requests,
                        max_blocks=blocks, block_size=128, q_dtype=dtype,
                        cache_dtype=cache_dtype or dtype, max_q_len=None, tma_rows=True, topk=16,
                        **kw)


def plans(device):
    """(label, op, plan) for every STEPS x HEADS x dtype case of both ops on `device`: bf16, and
    the device's fp8 (the H200's: OCP e4m3)."""
    from openmsa.ops.attention.plan import DEFAULT as ADEFAULT, plan as aplan
    from openmsa.ops.indexer.plan import plan as iplan
    fp8 = FP8_OF.get(device, FP8)
    out = []
    for name, tokens, requests, blocks in STEPS:
        for dname, dtype in (("bf16", BF16), ("fp8", fp8)):
            for heads, kv_heads in HEADS:
                label = f"{name}-{dname}-{heads}x{kv_heads}"
                out.append((label, "attention",
                            aplan(attention_shape(tokens, heads, kv_heads, dtype), device,
                                  ADEFAULT)))
                out.append((label, "indexer",
                            iplan(indexer_shape(tokens, requests, blocks, kv_heads, dtype),
                                  device)))
            out.append((f"{name}-{dname}q-fp8cache", "indexer",
                        iplan(indexer_shape(tokens, requests, blocks, 4, BF16, fp8), device)))
    return out
