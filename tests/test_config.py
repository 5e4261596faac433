# SPDX-License-Identifier: Apache-2.0
import pytest

from openmsa import MSAConfig

pytestmark = pytest.mark.reference


def test_defaults_are_m3():
    c = MSAConfig()
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.num_index_heads, c.index_head_dim) == \
        (64, 4, 128, 4, 128)
    assert (c.block_size, c.topk_blocks, c.init_blocks, c.local_blocks) == (128, 16, 0, 1)
    assert c.score_type == "max" and c.rotary_dim == 64 and c.rope_theta == 5e6
    assert c.rms_norm_eps == 1e-6 and c.group_size == 16


M3_SPARSE = {"sparse_num_index_heads": 4, "sparse_index_dim": 128, "sparse_block_size": 128,
             "sparse_topk_blocks": 16, "sparse_init_block": 0, "sparse_local_block": 1,
             "sparse_score_type": "max", "sparse_attention_freq": [0, 0, 0] + [1] * 57}
M3_TEXT = {"num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
           "rotary_dim": 64, "rope_theta": 5e6, "rms_norm_eps": 1e-6,
           "sparse_attention_config": M3_SPARSE}


@pytest.mark.parametrize("wrap", ["top", "text_config", "object"])
def test_from_hf_config(wrap):
    if wrap == "top":
        cfg = M3_TEXT
    elif wrap == "text_config":
        cfg = {"model_type": "minimax_m3", "text_config": M3_TEXT}
    else:
        class Obj:
            pass
        cfg = Obj()
        for k, v in M3_TEXT.items():
            setattr(cfg, k, v)
    c = MSAConfig.from_hf_config(cfg)
    assert c.topk_blocks == 16 and c.num_kv_heads == 4 and c.block_size == 128
    assert c.sparse_layers == tuple(range(3, 60))
    assert not c.is_sparse_layer(2) and c.is_sparse_layer(3) and c.is_sparse_layer(59)


def test_from_hf_config_overrides_and_errors():
    cfg = dict(M3_TEXT, sparse_attention_config=dict(M3_SPARSE, sparse_topk_blocks=8,
                                                     sparse_block_size=64))
    c = MSAConfig.from_hf_config(cfg)
    assert c.topk_blocks == 8 and c.block_size == 64
    with pytest.raises(ValueError, match="sparse_attention_config"):
        MSAConfig.from_hf_config({"num_attention_heads": 8})
    with pytest.raises(ValueError, match="score_type"):
        MSAConfig.from_hf_config(dict(M3_TEXT, sparse_attention_config=dict(
            M3_SPARSE, sparse_score_type="mean")))
    with pytest.raises(ValueError, match="sparse_attention_freq"):
        MSAConfig.from_hf_config(dict(M3_TEXT, sparse_attention_config=dict(
            M3_SPARSE, sparse_attention_freq=3)))


@pytest.mark.parametrize("kw, match", [
    (dict(score_type="mean"), "score_type"),
    (dict(init_blocks=10, local_blocks=7), "init_blocks"),
    (dict(block_size=96), "block_size"),
    (dict(num_heads=60, num_kv_heads=8), "num_heads"),
    (dict(num_index_heads=3), "num_index_heads"),
    (dict(topk_blocks=0), "topk_blocks"),
    (dict(rotary_dim=63), "rotary_dim"),
])
def test_impossible_configs(kw, match):
    with pytest.raises(ValueError, match=match):
        MSAConfig(**kw)


def test_shard():
    c = MSAConfig().shard(4)
    assert (c.num_heads, c.num_kv_heads, c.num_index_heads, c.group_size) == (16, 1, 1, 16)
    with pytest.raises(ValueError, match="tp_size"):
        MSAConfig().shard(8)
