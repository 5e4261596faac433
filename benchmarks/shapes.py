# SPDX-License-Identifier: Apache-2.0
"""Named benchmark shapes, taken from MiniMax-M3's configuration (docs/spec.md) and the issues'
grids. Scripts read these; nothing else hard-codes a shape."""

from dataclasses import replace

from openmsa import MSAConfig

M3 = MSAConfig()
MODELS = {
    "m3-tp1": M3,           # 64 q / 4 kv / 4 index heads per rank
    "m3-tp4": M3.shard(4),  # 16 q / 1 kv / 1 index head per rank
    # 8 ranks share 4 KV heads: each rank holds 8 q heads and a copy of its group's KV head and
    # index head (the usual replication beyond TP = KV heads); shard(8) refuses that on purpose
    "m3-tp8": replace(M3, num_heads=8, num_kv_heads=1, num_index_heads=1),
}

K = 1024
INDEXER_DECODE = dict(batches=(1, 8, 32, 64, 128), contexts=(32 * K, 128 * K, 1024 * K),
                      q_lens=(1, 4), dtypes=("bf16", "fp8"),
                      # timed for openmsa alone (no peer reads it): NVFP4 keys, fp8 query
                      openmsa_only_dtypes=("nvfp4",))
# run.py --quick: a subset with benchmarks/plot.py's default panels (B = 1 and 32) and the
# bandwidth-bound B = 128, at 128K and 1M: 72 cases (2 models x 3 dtypes x 2 L x 3 B x 2 q_lens)
# against the full grid's 180, which runs as two device calls of a 540 s budget each
# (scripts/gpu_check.sh bench-part 1 and 2, 90 cases each)
INDEXER_DECODE_QUICK = dict(INDEXER_DECODE, batches=(1, 32, 128), contexts=(128 * K, 1024 * K))
# prefill chunks of 8192 tokens after 0, 120K and ~1M (1M - 8K, so the request ends at 1M)
INDEXER_PREFILL = dict(chunk=8192, contexts=(0, 120 * K, 1024 * K - 8192), dtypes=("fp8", "bf16"),
                       models=("m3-tp1",),
                       # timed for openmsa alone: NVFP4 keys (fp8 query) in both prefill forms,
                       # in-kernel dequantization and staged (IndexerConfig.nvfp4_prefill)
                       openmsa_only_dtypes=("nvfp4", "nvfp4-staged"))
# TP4 geometry (one index head) at short contexts: an 8K chunk with no context, after 8K, after
# 32K, where a call's fixed costs weigh most (issue 40)
INDEXER_PREFILL_SHORT = dict(chunk=8192, contexts=(0, 8 * K, 32 * K), dtypes=("fp8", "bf16"),
                             models=("m3-tp4",), openmsa_only_dtypes=("nvfp4", "nvfp4-staged"))
ATTENTION_DECODE = dict(batches=(1, 8, 64, 128), context=64 * K, q_lens=(1, 4),
                        dtypes=("bf16", "fp8"), models=("m3-tp1", "m3-tp4", "m3-tp8"))
ATTENTION_PREFILL = dict(chunk=8192, contexts=(8 * K, 128 * K), dtypes=("bf16", "fp8"),
                         models=("m3-tp1", "m3-tp4"))
# the attention part of one sparse layer (fused preparation + indexer + sparse attention) against
# the same layer with dense attention; prefill: one chunk of 8192 tokens after the context
LAYER_DECODE = dict(batches=(1, 8, 32), contexts=(32 * K, 128 * K, 512 * K, 1024 * K),
                    dtypes=("bf16", "fp8"),
                    models=("m3-tp1", "m3-tp4"),
                    # (model, B, L) rows also run with an NVFP4 index cache (fp8 K/V)
                    nvfp4_rows=(("m3-tp1", 32, 1024 * K),))
LAYER_PREFILL = dict(chunk=8192, contexts=(120 * K, 1024 * K - 8192), dtypes=("bf16", "fp8"),
                     models=("m3-tp1", "m3-tp4"))
