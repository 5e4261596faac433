# SPDX-License-Identifier: Apache-2.0
"""How often an NVFP4 index cache selects the blocks a bf16 one selects (issue 41's quality
figure), next to the same figure for fp8, on CPU with the reference.

    python benchmarks/nvfp4_recall.py [--context 32768] [--tokens 64] [--seeds 3] [--out FILE]

For each key distribution, the same index queries and keys are selected three ways:
bf16 query x bf16 keys (the baseline), fp8 query x fp8 keys, and fp8 query x NVFP4 keys (what
vLLM pairs with NVFP4). Recall is the fraction of the baseline's selected blocks, forced blocks
excluded (every format selects those), that the other format also selects. Scores of NVFP4 keys
are defined on the dequantized keys (docs/spec.md), so the NVFP4 selection is the reference's
selection over an fp32 cache holding the dequantized keys.

Key distributions (no trained MiniMax-M3 weights are at hand, so these are synthetic; each key is
RMS-normalised as the model's index keys are):
* "iid": Gaussian keys and queries: block maxima differ little, the hardest case for any
  low-precision format.
* "outliers": 8 of 128 channels 8x larger, as in trained key projections.
* "topical": each block has a latent direction that queries share with some blocks, so a few
  blocks score clearly higher (closer to what the index branch is trained to find).
* "model-uniform", "model-topical": the index queries and keys of openmsa's small model's
  layer (openmsa.model: random weights at MiniMax-M3's TP1 geometry, MSAConfig()) over a token
  stream, through the layer's own index projection, per-head RMSNorm and partial RoPE
  (`openmsa.reference.prepare_index_qk`): tokens uniform over a 4096-token vocabulary, or each
  block's tokens drawn half from a 32-token topic of its own and the queries' tokens from the
  topics of 8 earlier blocks. The weights are random, so these are the model's activations in
  form (norms, rotation, the projection's mixing), not a trained model's.
"""

from __future__ import annotations

import argparse
import json

import torch

import openmsa
from openmsa import nvfp4

BLOCK = 128
HEADS = 4
DIM = 128
FP8 = torch.float8_e4m3fn


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _inputs(kind: str, context: int, tokens: int, gen: torch.Generator):
    keys = torch.randn(context, DIM, generator=gen)
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    if kind == "outliers":
        scale = torch.ones(DIM)
        scale[torch.randperm(DIM, generator=gen)[:8]] = 8.0
        keys, q = keys * scale, q * scale
    elif kind == "topical":
        blocks = context // BLOCK
        topics = torch.randn(blocks, DIM, generator=gen)
        keys = keys + 2.0 * topics.repeat_interleave(BLOCK, 0)
        # each (token, head) query leans towards the topics of 8 random blocks
        pick = torch.randint(0, blocks, (tokens, HEADS, 8), generator=gen)
        q = q + topics[pick].sum(2)
    return _rms(q), _rms(keys)


VOCAB, TOPIC, HIDDEN = 4096, 32, 256


def _model_inputs(kind: str, context: int, tokens: int, gen: torch.Generator):
    """The small model's index queries [tokens, H, Di] (the last `tokens` positions) and keys
    [context, Di] (every position), fp32, for a token stream of `kind` ("model-uniform" or
    "model-topical")."""
    from openmsa.model import random_layer_checkpoint
    cfg = openmsa.MSAConfig()
    layer = openmsa.MSAAttention(cfg, HIDDEN, ops="reference", dtype=torch.float32)
    layer.load_checkpoint(random_layer_checkpoint(layer, gen))
    if kind == "model-topical":
        blocks = context // BLOCK
        topics = torch.randint(0, VOCAB, (blocks, TOPIC), generator=gen)
        own = topics.repeat_interleave(BLOCK, 0)[torch.arange(context),
                                                 torch.randint(0, TOPIC, (context,),
                                                               generator=gen)]
        ids = torch.where(torch.rand(context, generator=gen) < 0.5, own,
                          torch.randint(0, VOCAB, (context,), generator=gen))
        # the queries' tokens: from the topics of 8 blocks (drawn with replacement) before the
        # queries' own
        pick = topics[torch.randint(0, max(blocks - 1, 1), (8,), generator=gen)].flatten()
        ids[-tokens:] = pick[torch.randint(0, len(pick), (tokens,), generator=gen)]
    else:
        ids = torch.randint(0, VOCAB, (context,), generator=gen)
    hidden = _rms(torch.randn(VOCAB, HIDDEN, generator=gen)[ids])
    h, di = cfg.num_index_heads, cfg.index_head_dim
    proj = torch.nn.functional.linear(hidden, layer.qkv_weight[-(h + 1) * di:])
    iq, ik = proj[:, :h * di].reshape(context, h, di), proj[:, h * di:]
    q, k = openmsa.reference.prepare_index_qk(
        iq, ik, layer.index_q_norm, layer.index_k_norm, torch.arange(context),
        rotary_dim=cfg.rotary_dim, rope_theta=cfg.rope_theta, eps=cfg.rms_norm_eps,
        cache_dtype=torch.float32)
    return q[-tokens:].float(), k.float()


def _select(q, keys, context, tokens):
    """The reference selection of `tokens` decode-like tokens at the end of one request of
    `context` tokens (a q_len = tokens verify step), keys held in a [pages, 128, 128] cache."""
    pages = context // BLOCK
    cache = keys.reshape(pages, BLOCK, DIM)
    table = torch.arange(pages, dtype=torch.int32)[None]
    return openmsa.reference.select_blocks(
        q, cache, torch.tensor([0, tokens], dtype=torch.int32),
        torch.tensor([context], dtype=torch.int32), table, topk=16, block_size=BLOCK)


def _recall(sel, base, context, tokens) -> float:
    """Fraction of the baseline's non-forced selected blocks also in `sel`."""
    own = (context - tokens + torch.arange(tokens)) // BLOCK  # each token's forced local block
    hit = total = 0
    for t in range(tokens):
        for h in range(HEADS):
            b = set(base[t, h].tolist()) - {-1, int(own[t])}
            s = set(sel[t, h].tolist())
            hit += len(b & s)
            total += len(b)
    return hit / max(total, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for kind in ("iid", "outliers", "topical", "model-uniform", "model-topical"):
        fp8_r, fp4_r = [], []
        for seed in range(args.seeds):
            gen = torch.Generator().manual_seed(seed)
            q, keys = (_model_inputs if kind.startswith("model") else _inputs)(
                kind, args.context, args.tokens, gen)
            base = _select(q.bfloat16().float(), keys.bfloat16().float(), args.context,
                           args.tokens)
            q8 = q.to(FP8).float()
            sel8 = _select(q8, keys.to(FP8).float(), args.context, args.tokens)
            codes, scales = nvfp4.quantize_index_keys(keys)
            sel4 = _select(q8, nvfp4.dequantize_index_keys(codes, scales), args.context,
                           args.tokens)
            fp8_r.append(_recall(sel8, base, args.context, args.tokens))
            fp4_r.append(_recall(sel4, base, args.context, args.tokens))
        rows.append(dict(keys=kind, context=args.context, tokens=args.tokens,
                         seeds=args.seeds, fp8_recall=round(sum(fp8_r) / len(fp8_r), 4),
                         nvfp4_recall=round(sum(fp4_r) / len(fp4_r), 4)))
    print("| keys | context | fp8 recall | NVFP4 recall |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['keys']} | {r['context']} | {r['fp8_recall']:.3f} | "
              f"{r['nvfp4_recall']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
