# SPDX-License-Identifier: Apache-2.0
"""The sparse layer: plan/run metadata, MSAAttention's checkpoint loading and tensor-parallel
shards, and the small model end to end (kernels vs reference, sparse with every block selected vs
dense attention); on a GPU, M3's geometry with long prompts, a 4-layer stack captured in a CUDA
graph, and the ops on another GPU than the current one."""

import dataclasses

import pytest
import torch

import openmsa
from openmsa.dense import DENSE_OPS
from openmsa.model import TinyMSAModel, ToyEngine, random_layer_checkpoint
from openmsa.metadata import MSAPlanner
from helpers import (assert_close, make_step, random_index_inputs, random_kv_cache)

FP8 = torch.float8_e4m3fn
CFG = openmsa.MSAConfig(num_heads=4, num_kv_heads=2, head_dim=64, num_index_heads=2,
                        index_head_dim=64, block_size=16, topk_blocks=2, init_blocks=0,
                        local_blocks=1, rotary_dim=32)


def _prompts(seed=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 128, (64,), generator=g).tolist(),
            torch.randint(0, 128, (64,), generator=g).tolist())


def _schedule(a, b):
    """Chunked prefill of A, then B's whole prompt joins next to A's second chunk, then a decode
    step and a speculative verify (3 draft tokens for A, 1 for B)."""
    return [[(0, a[:24])], [(0, a[24:48]), (1, b[:30])], [(0, a[48:49]), (1, b[30:31])],
            [(0, a[49:52]), (1, b[31:32])]]


def _run(cfg, ops, *, dtype, kv_dtype, index_dtype, device, steps, layers=2, engine=None,
         hidden_size=128):
    model = TinyMSAModel(cfg, ops=ops, dtype=dtype, device=device, num_layers=layers,
                         hidden_size=hidden_size)
    engine = ToyEngine(model, kv_dtype=kv_dtype, index_dtype=index_dtype, device=device,
                       **(engine or dict(num_pages=48)))
    return [engine.step(s).cpu() for s in steps]


def run_kernels_against_reference(cfg, *, dtype, kv_dtype, index_dtype, device, steps, pins,
                                  layers=2, engine=None, hidden_size=128):
    """The model with the public ops, then with the reference ops replaying the kernels'
    selections. A selection is discrete: in a model of random weights a near-tie between two
    blocks flips with any rounding difference (the attention kernel rounds P to bf16 like any
    flash kernel; the reference does not), and one flip changes the next layer's inputs. So
    each kernel selection is checked near-optimal against the reference's block scores of the
    same inputs, then the reference model reuses it: everything else is compared tightly."""
    from openmsa import layer as layer_mod
    from openmsa.batch import token_layout
    from helpers import assert_selection_near_optimal

    recorded = []
    kernel_select = layer_mod.KERNEL_OPS.select_blocks

    def record(index_q, index_cache, cu, sl, table, **kw):
        out = kernel_select(index_q, index_cache, cu, sl, table, **kw)
        scores = openmsa.reference.block_scores(index_q, index_cache, cu, sl, table,
                                                 block_size=kw["block_size"])
        _, pos = token_layout(cu, sl, index_q.shape[0])
        assert_selection_near_optimal(out, scores, pos, topk=kw["topk"],
                                      init_blocks=kw["init_blocks"],
                                      local_blocks=kw["local_blocks"],
                                      block_size=kw["block_size"])
        recorded.append(out.clone())
        return out

    kernel_fused = layer_mod.KERNEL_OPS.prepare_and_select

    def record_fused(*args, **kw):
        # (the layer's decode steps: the preparation inside the scoring launch)
        q, index_q, out = kernel_fused(*args, **kw)
        c = args[2]
        check = dict(topk=c.topk_blocks, init_blocks=c.init_blocks, local_blocks=c.local_blocks,
                     block_size=c.block_size)
        scores = openmsa.reference.block_scores(index_q, args[10], *args[12:15],
                                                 block_size=c.block_size)
        _, pos = token_layout(args[12], args[13], index_q.shape[0])
        assert_selection_near_optimal(out, scores, pos, **check)
        recorded.append(out.clone())
        return q, index_q, out

    kw = dict(dtype=dtype, kv_dtype=kv_dtype, index_dtype=index_dtype, device=device,
              steps=steps, layers=layers, engine=engine, hidden_size=hidden_size)
    pins.setattr(layer_mod.KERNEL_OPS, "select_blocks", record)
    pins.setattr(layer_mod.KERNEL_OPS, "prepare_and_select", record_fused)
    got = _run(cfg, "kernels", **kw)
    replay = iter(recorded)
    # the reference layer then runs its preparation and select_blocks apart, replaying
    pins.delattr(openmsa.reference, "prepare_and_select")
    pins.setattr(openmsa.reference, "select_blocks", lambda *a, **k: next(replay))
    want = _run(cfg, "reference", **kw)
    assert next(replay, None) is None
    return got, want


def _assert_logits_close(got, want, rel=2e-2):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and torch.isfinite(a).all()
        err = (a - b).abs().max() / b.abs().max()
        assert err < rel, f"step {i}: logits differ by {err:.3g} of their range"


@pytest.mark.reference
def test_plan_matches_make_step_and_pads():
    q_lens, seq_lens = [1, 3, 20, 0], [70, 45, 100, 9]
    step = make_step(q_lens, seq_lens, block_size=16)
    planner = MSAPlanner(CFG, max_requests=6, max_tokens=32, max_blocks=8, device="cpu")
    meta = planner.plan(q_lens, seq_lens, step.block_table, pad_requests_to=6, pad_tokens_to=30)
    assert meta.cu_seqlens_q.tolist() == [0, 1, 4, 24, 24, 24, 24]
    assert meta.seq_lens.tolist() == seq_lens + [0, 0]
    assert meta.slot_mapping[:24].tolist() == step.slot_mapping.tolist()
    assert meta.slot_mapping[24:].tolist() == [-1] * 6
    assert meta.positions.tolist() == [69, 42, 43, 44] + list(range(80, 100)) + [-1] * 6
    assert torch.equal(meta.index_slot_mapping, meta.slot_mapping)
    # a second plan reuses the same buffers (what a captured CUDA graph reads)
    again = planner.plan([1], [5], step.block_table[:1], pad_requests_to=6, pad_tokens_to=30)
    assert again.positions.data_ptr() == meta.positions.data_ptr()
    assert again.positions.tolist() == [4] + [-1] * 29


@pytest.mark.reference
def test_plan_rejects_what_does_not_fit():
    planner = MSAPlanner(CFG, max_requests=2, max_tokens=8, max_blocks=4, device="cpu")
    table = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_tokens"):
        planner.plan([9], [9], table)
    with pytest.raises(ValueError, match="max_requests"):
        planner.plan([1, 1, 1], [1, 1, 1], torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="q_len"):
        planner.plan([3], [2], table)
    with pytest.raises(ValueError, match="max_blocks"):
        planner.plan([1], [65], table)
    with pytest.raises(ValueError, match="columns"):
        planner.plan([1], [40], table[:, :2])
    with pytest.raises(TypeError, match="block_table"):
        planner.plan([1], [4], table.long())
    with pytest.raises(TypeError, match="q_lens"):
        planner.plan(3, [4], table)


@pytest.mark.reference
def test_checkpoint_loading_names_and_shapes():
    layer = openmsa.MSAAttention(CFG, 96, dtype=torch.float32)
    ckpt = random_layer_checkpoint(layer, torch.Generator().manual_seed(0))
    layer.load_checkpoint({"model.layers.3.self_attn." + k: v for k, v in ckpt.items()},
                          prefix="model.layers.3.self_attn.")
    assert torch.equal(layer.qkv_weight[:256], ckpt["q_proj.weight"])
    assert torch.equal(layer.qkv_weight[-64:], ckpt["index_k_proj.weight"])
    with pytest.raises(KeyError, match="index_k_norm.weight"):
        layer.load_checkpoint({k: v for k, v in ckpt.items() if k != "index_k_norm.weight"})
    bad = dict(ckpt, **{"o_proj.weight": ckpt["o_proj.weight"][:, :10]})
    with pytest.raises(ValueError, match="o_proj.weight"):
        layer.load_checkpoint(bad)
    with pytest.raises(ValueError, match="tp_size"):
        openmsa.MSAAttention(CFG, 96, tp_size=4)
    with pytest.raises(ValueError, match="ops"):
        openmsa.MSAAttention(CFG, 96, ops="fast")


@pytest.mark.reference
def test_tensor_parallel_shards_sum_to_the_whole_layer():
    """Two ranks (each 2 query heads, 1 KV head, 1 index head, the index key replicated) give
    partial o_proj outputs whose sum is the unsharded layer's output."""
    cfg = openmsa.MSAConfig(num_heads=4, num_kv_heads=2, head_dim=64, num_index_heads=2,
                            index_head_dim=64, block_size=16, topk_blocks=2, rotary_dim=32)
    whole = openmsa.MSAAttention(cfg, 96, ops="reference", dtype=torch.float32)
    ckpt = random_layer_checkpoint(whole, torch.Generator().manual_seed(1))
    whole.load_checkpoint(ckpt)
    q_lens, seq_lens = [1, 40], [50, 40]
    step = make_step(q_lens, seq_lens, block_size=16)
    hidden = torch.randn(41, 96, generator=torch.Generator().manual_seed(2))

    def run(layer):
        c = layer.config
        meta = MSAPlanner(c, max_requests=2, max_tokens=41, max_blocks=8,
                          device="cpu").plan(q_lens, seq_lens, step.block_table)
        kc = torch.zeros(step.num_pages, 16, c.num_kv_heads, 64)
        vc = torch.zeros_like(kc)
        ic = torch.zeros(step.num_pages, 16, 64)
        # the first request's 49 earlier tokens, prefilled as one chunk
        old = torch.randn(49, 96, generator=torch.Generator().manual_seed(3))
        old_meta = MSAPlanner(c, max_requests=1, max_tokens=49, max_blocks=8,
                              device="cpu").plan([49], [49], step.block_table[:1])
        layer(old, old_meta, (kc, vc), ic)
        return layer(hidden, meta, (kc, vc), ic)

    want = run(whole)
    parts = []
    for rank in range(2):
        shard = openmsa.MSAAttention(cfg, 96, tp_size=2, tp_rank=rank, ops="reference",
                                     dtype=torch.float32)
        shard.load_checkpoint(ckpt)
        assert shard.config.num_heads == 2 and shard.config.num_index_heads == 1
        parts.append(run(shard))
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-4, rtol=1e-4)


@pytest.mark.reference
def test_model_with_every_block_selected_equals_dense_reference():
    cfg = dataclasses.replace(CFG, topk_blocks=8)  # 8 x 16 >= 64 tokens
    steps = _schedule(*_prompts())
    kw = dict(dtype=torch.float32, kv_dtype=torch.float32, index_dtype=torch.float32,
              device="cpu", steps=steps)
    _assert_logits_close(_run(cfg, "reference", **kw), _run(cfg, DENSE_OPS, **kw), rel=1e-4)
    # and with the real topk the selection matters: sparse differs from dense
    sparse, dense = _run(CFG, "reference", **kw), _run(CFG, DENSE_OPS, **kw)
    assert (sparse[1] - dense[1]).abs().max() > 1e-2


def _kernel_dtypes(device):
    # bf16 attention is refused under Triton's interpreter (its elementwise bf16 arithmetic is
    # wrong, docs/design.md): fp16 on CPU, with fp8 caches there too (its casts are the GPU's)
    if device == "cuda":
        return [(torch.bfloat16, torch.bfloat16, FP8), (torch.bfloat16, FP8, torch.bfloat16)]
    return [(torch.float16, torch.float16, torch.float16), (torch.float16, FP8, FP8)]


@pytest.mark.interpret
def test_model_end_to_end_kernels_equal_reference(kernel_device, monkeypatch):
    steps = _schedule(*_prompts())
    for dtype, kv_dtype, index_dtype in _kernel_dtypes(kernel_device):
        got, want = run_kernels_against_reference(
            CFG, dtype=dtype, kv_dtype=kv_dtype, index_dtype=index_dtype, device=kernel_device,
            steps=steps, pins=monkeypatch)
        _assert_logits_close(got, want)
        monkeypatch.undo()


@pytest.mark.interpret
def test_model_end_to_end_every_block_selected_equals_dense(kernel_device):
    cfg = dataclasses.replace(CFG, topk_blocks=8)
    steps = _schedule(*_prompts(seed=6))
    dtype = torch.bfloat16 if kernel_device == "cuda" else torch.float16
    kw = dict(dtype=dtype, kv_dtype=dtype, index_dtype=dtype, steps=steps,
              device=kernel_device)
    _assert_logits_close(_run(cfg, "kernels", **kw), _run(cfg, DENSE_OPS, **kw))


def _m3_tiny_model(ops, layers, topk=16, index_query_dtype=None):
    from openmsa.model import TinyMSAModel
    cfg = dataclasses.replace(openmsa.MSAConfig().shard(4), topk_blocks=topk)  # 16 / 1 / 1 heads
    return TinyMSAModel(cfg, ops=ops, num_layers=layers, hidden_size=256, device="cuda",
                        index_query_dtype=index_query_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype, index_dtype", [(torch.bfloat16, FP8), (FP8, torch.bfloat16)])
def test_m3_layer_end_to_end_long_prompt(kv_dtype, index_dtype, monkeypatch):
    """M3's attention geometry (TP4 rank): two 6K-token prompts prefilled in 2K chunks next to
    each other, then decode and verify steps; kernels vs the reference ops on the same GPU, the
    reference replaying the kernels' (checked near-optimal) selections
    (run_kernels_against_reference says why)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 128, (6200,), generator=g).tolist()
    b = torch.randint(0, 128, (6100,), generator=g).tolist()
    steps = [[(0, a[:2048])], [(0, a[2048:4096]), (1, b[:3000])],
             [(0, a[4096:6000]), (1, b[3000:6000])], [(0, a[6000:6001]), (1, b[6000:6004])],
             [(0, a[6001:6005]), (1, b[6004:6005])]]
    cfg = openmsa.MSAConfig().shard(4)
    got, want = run_kernels_against_reference(
        cfg, dtype=torch.bfloat16, kv_dtype=kv_dtype, index_dtype=index_dtype, device="cuda",
        steps=steps, pins=monkeypatch, engine=dict(num_pages=120, max_tokens=6000,
                                                   max_blocks=64), hidden_size=256)
    _assert_logits_close(got, want)


@pytest.mark.gpu
def test_m3_every_block_selected_equals_dense_long_prompt():
    from openmsa.model import ToyEngine
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 128, (5000,), generator=g).tolist()
    steps = [[(0, a[:2500])], [(0, a[2500:4990])], [(0, a[4990:4991])], [(0, a[4991:4995])]]
    out = {}
    for name, ops in (("kernels", "kernels"), ("dense", DENSE_OPS)):
        model = _m3_tiny_model(ops, layers=2, topk=64)  # 64 blocks x 128 >= 5000 tokens
        eng = ToyEngine(model, num_pages=64, max_tokens=2500, max_blocks=64, device="cuda")
        out[name] = [eng.step(s) for s in steps]
    for i, (x, y) in enumerate(zip(out["kernels"], out["dense"])):
        err = float((x - y).norm() / y.norm())
        assert err < 2e-2, f"step {i}: relative error {err:.3g}"


@pytest.mark.gpu
def test_four_layer_decode_step_captured_in_a_cuda_graph():
    """plan/run: a 4-layer stack's decode step (8 request slots, 8 tokens) is captured once, then
    replayed for new tokens, new lengths, a verify request and padding; equal to eager runs."""
    from openmsa.model import ToyEngine
    model = _m3_tiny_model("kernels", layers=4)
    eng = ToyEngine(model, num_pages=200, max_requests=8, max_tokens=2048, max_blocks=64,
                    kv_dtype=torch.bfloat16, index_dtype=FP8, device="cuda")
    g = torch.Generator().manual_seed(2)
    lens = [3000, 130, 2049, 777]
    for rid, n in enumerate(lens):  # prompts, eagerly, in chunks of up to 2048
        toks = torch.randint(0, 128, (n,), generator=g).tolist()
        for s in range(0, n, 2048):
            eng.step([(rid, toks[s:s + 2048])])

    def tokens(n):
        return torch.randint(0, 128, (n,), generator=g).tolist()

    pad = dict(pad_requests_to=8, pad_tokens_to=8)
    meta, ids = eng.plan([(r, tokens(1)) for r in range(4)], **pad)
    static_ids = ids.clone()
    with torch.no_grad():
        model(static_ids, meta, eng.caches)  # compile, outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = model(static_ids, meta, eng.caches)
    schedules = [[(r, tokens(1)) for r in range(4)],
                 [(0, tokens(1)), (1, tokens(3)), (3, tokens(2))],   # verify rows, padding
                 [(2, tokens(1))]]
    for batch in schedules:
        m2, ids2 = eng.plan(batch, **pad)
        assert m2.positions.data_ptr() == meta.positions.data_ptr()
        static_ids.copy_(ids2)
        graph.replay()
        replayed = static_logits.clone()
        with torch.no_grad():
            eager = model(ids2, m2, eng.caches)  # rewrites the same keys: idempotent
        n = sum(len(t) for _, t in batch)
        assert torch.isfinite(replayed[:n]).all()
        torch.testing.assert_close(replayed[:n], eager[:n], atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ops_follow_their_tensors_to_another_gpu():
    """A process driving two GPUs calls the ops on tensors of cuda:1 while cuda:0 is current.
    Triton launches on the current device, so each op makes its first argument's device current
    for the call (as torch's own ops do) and leaves cuda:0 current after: the indexer, the
    attention and the page table against the reference, the cache writes exactly, and a
    two-layer model's prefill and decode steps (fused preparation, planner) equal to the same
    steps run with cuda:1 current."""
    from openmsa import reference as ref
    B = 128
    dev = torch.device("cuda:1")
    torch.cuda.set_device(0)
    step = make_step([1, 4, 40], [3000, 700, 1500], block_size=B, extra_columns=1)
    d = dataclasses.replace(step, **{name: getattr(step, name).to(dev) for name in (
        "cu_seqlens_q", "seq_lens", "block_table", "slot_mapping")})
    args, dargs = ((step.cu_seqlens_q, step.seq_lens, step.block_table),
                   (d.cu_seqlens_q, d.seq_lens, d.block_table))
    q, c = random_index_inputs(step, num_heads=4, head_dim=128, block_size=B, q_dtype=FP8,
                               cache_dtype=FP8, integer=True)
    idx = openmsa.select_blocks(q.to(dev), c.to(dev), *dargs, block_size=B)
    assert idx.device == dev and torch.cuda.current_device() == 0
    assert torch.equal(idx.cpu(), ref.select_blocks(q, c, *args, block_size=B))
    scores = openmsa.block_scores(q.to(dev), c.to(dev), *dargs, block_size=B)
    assert torch.equal(scores.cpu(), ref.block_scores(q, c, *args, block_size=B))
    k, v = random_kv_cache(step.num_pages, B, 4, 128, dtype=FP8)
    qa = torch.randn(step.num_tokens, 64, 128).bfloat16()
    got, lse = openmsa.sparse_attention(qa.to(dev), k.to(dev), v.to(dev), idx, *dargs,
                                        return_lse=True)
    want, want_lse = ref.sparse_attention(qa, k, v, idx.cpu(), *args, return_lse=True)
    assert_close(got, want)
    assert_close(lse, want_lse, torch.bfloat16)
    pages, lens = openmsa.sparse_page_table(idx, *dargs, num_kv_heads=4, block_size=B)
    want_pages, want_lens = ref.sparse_page_table(idx.cpu(), *args, num_kv_heads=4,
                                                  block_size=B)
    assert torch.equal(pages.cpu(), want_pages) and torch.equal(lens.cpu(), want_lens)
    slots = torch.tensor([5, -1, 300, 7000], dtype=torch.int64)
    x = torch.randn(4, 4, 128).bfloat16()
    kc, vc = (torch.zeros(60, B, 4, 128, dtype=torch.bfloat16) for _ in range(2))
    dkc, dvc = kc.to(dev), vc.to(dev)
    ref.write_kv_cache(x, -x, kc, vc, slots)
    openmsa.write_kv_cache(x.to(dev), -x.to(dev), dkc, dvc, slots.to(dev))
    assert torch.equal(dkc.cpu(), kc) and torch.equal(dvc.cpu(), vc)
    ic = torch.zeros(60, B, 128, dtype=torch.bfloat16)
    dic = ic.to(dev)
    ref.write_index_cache(x[:, 0], ic, slots)
    openmsa.write_index_cache(x[:, 0].to(dev), dic, slots.to(dev))
    assert torch.equal(dic.cpu(), ic)
    assert torch.cuda.current_device() == 0
    steps = [[(0, list(range(100)) * 3)], [(0, [5])], [(0, [6, 7, 8])]]
    kw = dict(dtype=torch.bfloat16, kv_dtype=FP8, index_dtype=FP8, steps=steps,
              engine=dict(num_pages=16, max_tokens=512, max_blocks=8), hidden_size=256)
    cfg = openmsa.MSAConfig().shard(4)
    other = _run(cfg, "kernels", device=dev, **kw)
    assert torch.cuda.current_device() == 0
    with torch.cuda.device(1):
        same = _run(cfg, "kernels", device=dev, **kw)
    assert all(torch.equal(a, b) for a, b in zip(other, same))


NVFP4_CFG = openmsa.MSAConfig(num_heads=4, num_kv_heads=2, head_dim=64, num_index_heads=2,
                              index_head_dim=128, block_size=128, topk_blocks=2, init_blocks=0,
                              local_blocks=1, rotary_dim=32)


def _nvfp4_steps():
    g = torch.Generator().manual_seed(7)
    a, b = (torch.randint(0, 128, (n,), generator=g).tolist() for n in (530, 420))
    return [[(0, a[:300])], [(0, a[300:520]), (1, b[:400])], [(0, a[520:521]), (1, b[400:401])],
            [(0, a[521:524]), (1, b[401:402])]]


class _Recording:
    """The reference ops with a selection hook: `select` scores what it is given; every
    selection is recorded."""

    def __init__(self, fused_prepare, select):
        from openmsa import reference as ref
        self.fused_prepare, self._select = fused_prepare, select
        self.sparse_attention = ref.sparse_attention
        self.selections = []

    def select_blocks(self, index_q, index_cache, *args, **kw):
        out = self._select(index_q, index_cache, *args, **kw)
        self.selections.append(out.clone())
        return out


@pytest.mark.reference
def test_layer_with_nvfp4_index_cache_selects_on_the_dequantized_keys():
    """A model whose layers write NVFP4 index pages (uint8 [P, 128, 72]) selects exactly the
    blocks that the reference selects on an fp32 index cache holding the same keys quantized and
    dequantized by openmsa.nvfp4 (and an fp8-rounded index query): logits equal too."""
    from openmsa import reference as ref
    from openmsa.nvfp4 import dequantize_index_keys, quantize_index_keys

    def on_pages(index_q, index_cache, *args, **kw):
        # the scores of NVFP4 pages are those of their dequantized keys (docs/spec.md)
        return ref.select_blocks(index_q.float(), openmsa.dequantize_index_pages(index_cache),
                                 *args, **kw)

    def prepare_quantized(*args, **kw):
        # the reference into an fp32 index cache, then the step's rows through NVFP4 and back
        q, index_q = ref.fused_prepare(*args, **kw)
        index_cache, slots = args[10], args[11].long()
        rows = index_cache.flatten(0, 1)[slots[slots >= 0]]
        back = dequantize_index_keys(*quantize_index_keys(rows))
        index_cache.flatten(0, 1)[slots[slots >= 0]] = back
        return q, index_q.to(FP8).float()

    runs = []
    for ops, index_dtype in ((_Recording(ref.fused_prepare, on_pages), torch.uint8),
                             (_Recording(prepare_quantized, ref.select_blocks), torch.float32)):
        model = TinyMSAModel(NVFP4_CFG, ops=ops, dtype=torch.float32, num_layers=2)
        engine = ToyEngine(model, num_pages=24, max_tokens=1024, kv_dtype=torch.float32,
                           index_dtype=index_dtype)
        if index_dtype == torch.uint8:
            assert engine.caches[0][2].shape == (24, 128, 72)
        logits = [engine.step(s) for s in _nvfp4_steps()]
        runs.append((ops.selections, logits, engine))
    (sel, logits, nv_engine), (want_sel, want_logits, fp_engine) = runs
    assert len(sel) == len(want_sel) == 8
    for got, want in zip(sel, want_sel):
        assert torch.equal(got, want)
    assert any((s[..., 0] != s[..., 1]).any() and (s >= 0).sum() > 0 for s in sel)
    for got, want in zip(logits, want_logits):
        assert torch.equal(got, want)
    # the pages hold exactly the keys the fp32 run dequantized
    deq = openmsa.dequantize_index_pages(nv_engine.caches[1][2])
    assert torch.equal(deq, fp_engine.caches[1][2])
