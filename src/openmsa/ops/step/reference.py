# SPDX-License-Identifier: Apache-2.0
"""decode_step in pure PyTorch: the preparation and selection (prepare_and_select), then the
attention, as the separate reference ops compute them."""

from ..attention.reference import sparse_attention
from ..indexer.reference import prepare_and_select


def decode_step(qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
                index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache,
                index_slot_mapping, cu_seqlens_q, seq_lens, index_block_table, block_table, *,
                max_q_len=None, k_scale=None, v_scale=None, index_q_out=None, out=None,
                cache_config=None, indexer_config=None, attention_config=None,
                step_config=None, trace=None):
    """(q, index_q, indices, out): see ops/step/api.py. (No launch here to trace.)"""
    if trace is not None:
        raise ValueError("trace records the one launch's programs on a GPU; this step runs "
                         "the PyTorch reference")
    q, index_q, indices = prepare_and_select(
        qkv, positions, config, q_norm_weight, k_norm_weight, index_q_norm_weight,
        index_k_norm_weight, k_cache, v_cache, slot_mapping, index_cache, index_slot_mapping,
        cu_seqlens_q, seq_lens, index_block_table, max_q_len=max_q_len, k_scale=k_scale,
        v_scale=v_scale, index_q_out=index_q_out, cache_config=cache_config,
        indexer_config=indexer_config)
    out = sparse_attention(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens, block_table,
                           block_size=config.block_size, out=out, k_scale=k_scale,
                           v_scale=v_scale)
    return q, index_q, indices, out
