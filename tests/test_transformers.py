# SPDX-License-Identifier: Apache-2.0
"""transformers' MiniMax-M3 on openmsa (openmsa.integrations.transformers), on the CPU: a tiny
random fp32 `MiniMaxM3VLForCausalLM` whose prompts span more than 16 blocks of 4 tokens (top-4
selection, so the sparse layers really choose), against transformers' own eager path on the same
weights; config and weight loading from transformers' layout. Skipped without transformers."""

import copy
import gc
import inspect

import pytest
import torch

pytest.importorskip("transformers.models.minimax_m3_vl")
import transformers  # noqa: E402
from transformers import (MiniMaxM3VLConfig, MiniMaxM3VLForCausalLM,  # noqa: E402
                          MiniMaxM3VLTextConfig)

import openmsa  # noqa: E402
from openmsa.integrations.transformers import use_openmsa  # noqa: E402

pytestmark = pytest.mark.reference
transformers.logging.set_verbosity_error()

BLOCK = 4
TEXT = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rotary_dim=8, partial_rotary_factor=0.5,
            index_n_heads=2, index_head_dim=16, index_block_size=BLOCK, index_topk_blocks=4,
            index_local_blocks=1,
            layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
            mlp_layer_types=["dense"] * 3, dense_intermediate_size=96, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)


def _text_config(**kw):
    cfg = MiniMaxM3VLTextConfig(**{**TEXT, **kw})
    cfg._attn_implementation = "eager"
    return cfg


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    model = MiniMaxM3VLForCausalLM(_text_config(**kw)).eval()
    with torch.no_grad():  # transformers zero-initialises the Gemma norms: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module")
def pair():
    """(transformers' eager model, an openmsa copy of it)."""
    ref = _model()
    return ref, use_openmsa(copy.deepcopy(ref))


def _prompt(n, seed):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed))


# the cache keyword: `cache` from transformers 5.2x on, `past_key_values` before
CACHE = "cache" if "cache" in inspect.signature(MiniMaxM3VLForCausalLM.forward).parameters \
    else "past_key_values"


def _cache_of(output):
    return getattr(output, "cache", None) or output.past_key_values


def _close(a, b):
    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_from_hf_config_reads_transformers_configs_and_their_dicts():
    text = _text_config()
    want = openmsa.MSAConfig(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
                             index_head_dim=16, block_size=BLOCK, topk_blocks=4, local_blocks=1,
                             rotary_dim=8, rope_theta=5e6, sparse_layers=(1, 2))
    vl = MiniMaxM3VLConfig(text_config=text.to_dict())
    for cfg in (text, text.to_dict(), vl, vl.to_dict()):
        assert openmsa.MSAConfig.from_hf_config(cfg) == want
    # the checkpoint's config.json layout gives the same
    ckpt = {"text_config": {
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rotary_dim": 8,
        "rope_theta": 5e6, "sparse_attention_config": {
            "sparse_num_index_heads": 2, "sparse_index_dim": 16, "sparse_block_size": BLOCK,
            "sparse_topk_blocks": 4, "sparse_init_block": 0, "sparse_local_block": 1,
            "sparse_score_type": "max", "sparse_attention_freq": [0, 1, 1]}}}
    assert openmsa.MSAConfig.from_hf_config(ckpt) == want
    # ... and transformers reads that layout into the same flat config
    assert openmsa.MSAConfig.from_hf_config(
        MiniMaxM3VLTextConfig(**ckpt["text_config"], partial_rotary_factor=0.5)) == want
    # YaRN from rope_parameters
    yarn = _text_config(rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                      "original_max_position_embeddings": 32})
    got = openmsa.MSAConfig.from_hf_config(yarn).rope_scaling
    assert (got.factor, got.original_max_position_embeddings) == (2.0, 32)


def test_public_name():
    assert openmsa.integrations.transformers.use_openmsa is use_openmsa


def test_from_hf_config_follows_the_width_transformers_rotates():
    # transformers rotates head_dim * partial_rotary_factor (1.0 when absent), not rotary_dim
    cfg = MiniMaxM3VLTextConfig(**{**TEXT, "partial_rotary_factor": 1.0})
    with pytest.warns(UserWarning, match="rotates 16 dims"):
        assert openmsa.MSAConfig.from_hf_config(cfg).rotary_dim == 16
    with pytest.raises(ValueError, match="sliding_attention"):
        openmsa.MSAConfig.from_hf_config({"layer_types": ["sliding_attention"]})
    with pytest.raises(ValueError, match="sparse_attention_config"):
        openmsa.MSAConfig.from_hf_config({"num_attention_heads": 4})


def test_load_checkpoint_takes_transformers_and_checkpoint_names(pair):
    ref, _ = pair
    attn = ref.model.layers[1].self_attn
    cfg = openmsa.MSAConfig.from_hf_config(ref.config)
    sd = {f"model.layers.1.self_attn.{k}": v for k, v in attn.state_dict().items()}
    a = openmsa.MSAAttention(cfg, 64, dtype=torch.float32)
    a.load_checkpoint(sd, prefix="model.layers.1.self_attn.")
    renamed = {k.replace("indexer.", "index_"): v for k, v in sd.items()}
    assert any("index_q_proj.weight" in k for k in renamed)
    b = openmsa.MSAAttention(cfg, 64, dtype=torch.float32)
    b.load_checkpoint(renamed, prefix="model.layers.1.self_attn.")
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)
    assert torch.equal(a.qkv_weight[-16:], attn.indexer.k_proj.weight)
    missing = {k: v for k, v in sd.items() if "indexer.q_norm" not in k}
    with pytest.raises(KeyError, match="indexer.q_norm.weight"):
        a.load_checkpoint(missing, prefix="model.layers.1.self_attn.")


def test_forward_and_decode_logits_equal_transformers_eager(pair):
    ref, m = pair
    ids = _prompt(83, 1)[None]  # 21 blocks of 4, top-4: most blocks are dropped
    with torch.no_grad():
        r = ref(ids[:, :80], use_cache=True)
        o = m(ids[:, :80], use_cache=True)
        _close(o.logits, r.logits)
        rc, oc = _cache_of(r), _cache_of(o)
        for t in range(80, 83):  # decode steps through the caches
            r = ref(ids[:, t:t + 1], **{CACHE: rc}, use_cache=True)
            o = m(ids[:, t:t + 1], **{CACHE: oc}, use_cache=True)
            _close(o.logits, r.logits)
        # the selection matters here: attending to every block gives other logits
        dense = _model(index_topk_blocks=64)
        assert (dense(ids).logits - ref(ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("local,topk", [(2, 4), (3, 5)])
def test_other_local_and_topk_equal_transformers_eager(local, topk):
    ref = _model(seed=8, index_local_blocks=local, index_topk_blocks=topk)
    m = use_openmsa(copy.deepcopy(ref))
    ids = _prompt(77, 18)[None]
    with torch.no_grad():
        _close(m(ids).logits, ref(ids).logits)


def test_greedy_and_sampled_generate_equal_transformers_eager(pair):
    ref, m = pair
    ids = _prompt(75, 2)[None]
    want = ref.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(m.generate(ids, max_new_tokens=12, do_sample=False), want)
    torch.manual_seed(7)
    want = ref.generate(ids, max_new_tokens=8, do_sample=True, top_k=20)
    torch.manual_seed(7)
    assert torch.equal(m.generate(ids, max_new_tokens=8, do_sample=True, top_k=20), want)


def test_generate_stops_at_eos(pair):
    _, m = pair
    ids = _prompt(70, 3)[None]
    free = m.generate(ids, max_new_tokens=8, do_sample=False)[0, 70:].tolist()
    eos = free[3]
    out = m.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=eos)
    assert out[0, 70:].tolist() == free[:free.index(eos) + 1]


def test_yarn_model_equals_transformers_eager():
    # YaRN from the config, positions past its original context of 32
    ref = _model(seed=3, rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                       "original_max_position_embeddings": 32})
    m = use_openmsa(copy.deepcopy(ref))
    ids = _prompt(72, 4)[None]
    with torch.no_grad():
        _close(m(ids).logits, ref(ids).logits)
    assert torch.equal(m.generate(ids, max_new_tokens=6, do_sample=False),
                       ref.generate(ids, max_new_tokens=6, do_sample=False))


def _padded(prompts, side="left"):
    n = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        sl = slice(n - len(p), n) if side == "left" else slice(0, len(p))
        ids[i, sl], mask[i, sl] = p, 1
    return ids, mask


@pytest.mark.parametrize("chunks", [None, dict(max_chunk_tokens=7, prefill_chunk_size=16)])
def test_batched_padded_prompts_equal_each_prompt_alone(pair, chunks):
    ref, m = pair
    if chunks is not None:
        m = use_openmsa(copy.deepcopy(ref), **chunks)
    prompts = [_prompt(70, 5), _prompt(45, 6), _prompt(66, 7)]
    ids, mask = _padded(prompts)
    n = ids.shape[1]
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        batched = m(ids, attention_mask=mask, position_ids=pos).logits
        for i, p in enumerate(prompts):
            _close(batched[i, n - len(p):], m(p[None]).logits[0])
    out = m.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    for i, p in enumerate(prompts):
        alone = m.generate(p[None], max_new_tokens=10, do_sample=False)
        assert out[i, n:].tolist() == alone[0, len(p):].tolist()


def test_all_sparse_model_without_transformers_mask():
    # every layer sparse: openmsa skips transformers' 4-D mask, padding still follows the rows
    ref = _model(seed=4, layer_types=["minimax_m3_sparse"] * 3)
    m = use_openmsa(copy.deepcopy(ref))
    prompts = [_prompt(69, 12), _prompt(50, 13)]
    ids, mask = _padded(prompts)
    with torch.no_grad():
        _close(m(prompts[0][None]).logits, ref(prompts[0][None]).logits)
        batched = m(ids, attention_mask=mask).logits
        _close(batched[1, ids.shape[1] - 50:], ref(prompts[1][None]).logits[0])
    out = m.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert out[1, ids.shape[1]:].tolist() == \
        ref.generate(prompts[1][None], max_new_tokens=5, do_sample=False)[0, 50:].tolist()


def test_bf16_model_and_exact_angles():
    ref = _model(seed=5)
    ids = _prompt(72, 14)[None]
    with torch.no_grad():
        want = ref(ids).logits
        # exact angles: the same numbers as transformers' fp32 ones at these small positions
        _close(use_openmsa(copy.deepcopy(ref), rope_angles="exact")(ids).logits, want)
        # a bf16 model (whose .to() also rounded the rotary frequencies) still converts and runs
        m = use_openmsa(copy.deepcopy(ref).to(torch.bfloat16))
        got = m(ids).logits.float()
    assert m._openmsa_state.kv_dtype == torch.bfloat16
    assert (got - want).abs().max() < 0.2


def test_generate_prefills_long_prompts_in_chunks(pair):
    ref, _ = pair
    m = use_openmsa(copy.deepcopy(ref), prefill_chunk_size=16)
    lengths = []
    m.model.register_forward_pre_hook(
        lambda mod, args, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    ids = _prompt(70, 15)[None]
    out = m.generate(ids, max_new_tokens=3, do_sample=False)
    assert lengths == [16, 16, 16, 16, 6, 1, 1]
    assert torch.equal(out, ref.generate(ids, max_new_tokens=3, do_sample=False))
    lengths.clear()
    m.generate(ids, max_new_tokens=1, do_sample=False, prefill_chunk_size=32)  # the call's own
    assert lengths == [32, 32, 6]
    lengths.clear()
    m.generate(ids, max_new_tokens=1, do_sample=False, prefill_chunk_size=None)  # none
    assert lengths == [70]


def test_fp8_and_bf16_caches():
    ref = _model(seed=1)
    ids = _prompt(80, 8)[None]
    with torch.no_grad():
        want = ref(ids).logits
        for kv, index in (("bf16", "bf16"), ("bf16", "fp8"), (torch.float8_e4m3fn, "fp8")):
            m = use_openmsa(copy.deepcopy(ref), kv_cache_dtype=kv, index_cache_dtype=index)
            state = m._openmsa_state
            got = m(ids).logits
            k, _, ic = state.caches[1]
            assert k.dtype == (torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn)
            assert ic.dtype == (torch.bfloat16 if index == "bf16" else torch.float8_e4m3fn)
            # lossy caches: near, not equal (and a near-tie may pick another block)
            assert (got - want).abs().max() < 0.2
            assert m.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 83)


def test_vl_wrapper_language_model_runs_openmsa():
    text = _text_config()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, patch_size=2, image_size=8)
    cfg = MiniMaxM3VLConfig(text_config=text.to_dict(), vision_config=vision,
                            projector_hidden_size=32)
    cfg.text_config._attn_implementation = "eager"
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = transformers.MiniMaxM3SparseForConditionalGeneration(cfg).eval()
    m = use_openmsa(copy.deepcopy(ref))
    assert type(m.model.language_model.layers[1].self_attn).__name__ == "OpenMSASparseAttention"
    ids = _prompt(70, 9)[None]
    with torch.no_grad():
        _close(m(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_refusals(pair):
    ref, m = pair
    ids = _prompt(20, 10)[None]
    with pytest.raises(ValueError, match="beam search"):
        m.generate(ids, num_beams=2, max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt-lookup"):
        m.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=2)
    with pytest.raises(ValueError, match="cache_implementation"):
        m.generate(ids, cache_implementation="static", max_new_tokens=2)
    with pytest.raises(ValueError, match="output_attentions"):
        m(ids, output_attentions=True)
    with pytest.raises(ValueError, match="attention_mask"):
        m(ids, attention_mask=torch.ones(1, 1, 20, 20))
    with pytest.raises(ValueError, match="cannot be saved"):
        m.save_pretrained("/nonexistent")
    with pytest.raises(ValueError, match="already applied"):
        use_openmsa(m)
    with pytest.raises(TypeError, match="MiniMax-M3"):
        use_openmsa(torch.nn.Linear(2, 2))
    fresh = copy.deepcopy(ref)
    for kw, match in ((dict(kv_cache_dtype="int8"), "kv_cache_dtype"),
                      (dict(index_cache_dtype=torch.int8), "index_cache_dtype"),
                      (dict(kv_cache_dtype="nvfp4"), "kv_cache_dtype"),  # index caches only
                      # NVFP4 pages need index_head_dim == block_size == 128
                      (dict(index_cache_dtype="nvfp4"), "index_cache_dtype: an NVFP4"),
                      (dict(ops="dense"), "ops"), (dict(rope_angles="bf16"), "rope_angles"),
                      (dict(max_chunk_tokens=0), "max_chunk_tokens"),
                      (dict(prefill_chunk_size=-1), "prefill_chunk_size"),
                      (dict(num_pages=1.5), "num_pages")):
        with pytest.raises((ValueError, TypeError), match=match):
            use_openmsa(fresh, **kw)
    no_sparse = _model(layer_types=["full_attention"] * 3)
    with pytest.raises(ValueError, match="no sparse layer"):
        use_openmsa(no_sparse)
    # a cache openmsa did not fill (here: transformers' own)
    with torch.no_grad():
        cache = _cache_of(ref(ids, use_cache=True))
        with pytest.raises(ValueError, match="cache holds 20 tokens"):
            m(ids[:, :1], **{CACHE: cache}, use_cache=True)


def test_pages_are_reused_when_caches_go():
    ref = _model(seed=2)
    m = use_openmsa(copy.deepcopy(ref), num_pages=64)
    state = m._openmsa_state
    ids = _prompt(60, 11)[None]
    for _ in range(3):
        m.generate(ids, max_new_tokens=4, do_sample=False)
        gc.collect()
        state.collect()  # (the next step does this too)
        assert len(state.free) == state.num_pages == 64 and not state.sessions
    with torch.no_grad():
        out = m(ids)  # a plain forward: its cache goes with its output, and its pages with it
        assert len(state.free) < 64
        del out
    gc.collect()
    state.collect()
    assert len(state.free) == state.num_pages == 64


GPU_TEXT = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64, rotary_dim=32,
                index_n_heads=2, index_head_dim=64, index_block_size=16)


@pytest.mark.gpu
def test_kernels_on_gpu_equal_transformers_when_every_block_is_selected():
    """On CUDA the sparse layers run the Triton kernels; with top-32 over 19 blocks every block
    is selected, so no near-tie can change a selection and the logits must be transformers'."""
    ref = _model(seed=6, index_topk_blocks=32, **GPU_TEXT).cuda()
    m = use_openmsa(copy.deepcopy(ref))
    ids = _prompt(300, 15)[None].cuda()
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, ref(ids).logits, atol=1e-2, rtol=1e-2)
    assert m._openmsa_state.caches[1][0].is_cuda


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,kv,index", [(torch.bfloat16, "bf16", "fp8"),
                                            (torch.bfloat16, "fp8", "fp8")])
def test_kernels_on_gpu_generate_padded_batches(dtype, kv, index):
    ref = _model(seed=7, index_topk_blocks=4, **GPU_TEXT)
    m = use_openmsa(ref.to(device="cuda", dtype=dtype), kv_cache_dtype=kv,
                    index_cache_dtype=index, max_chunk_tokens=128, prefill_chunk_size=256)
    prompts = [_prompt(300, 16), _prompt(170, 17)]
    ids, mask = _padded(prompts)
    out = m.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=8, do_sample=False)
    assert out.shape == (2, 308)
    with torch.no_grad():
        batched = m(ids.cuda(), attention_mask=mask.cuda()).logits[1, -1].float()
        alone = m(prompts[1][None].cuda()).logits[0, -1].float()
    # the same row through other chunk boundaries: equal up to bf16 rounding
    torch.testing.assert_close(batched, alone, atol=0.1, rtol=0.05)
