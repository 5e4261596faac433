# SPDX-License-Identifier: Apache-2.0
"""Tier 0: the main-branch reference against dense attention and docs/spec.md's rules."""

import pytest
import torch

from openmsa import reference as ref
from openmsa.batch import token_layout
from openmsa.dense import dense_paged_attention
from helpers import make_step, random_kv_cache

from brute import positions

pytestmark = pytest.mark.reference

B = 16
Q_LENS = [1, 3, 0, 20, 1, 0]
SEQ_LENS = [70, 45, 9, 100, 5, 0]


def _step():
    return make_step(Q_LENS, SEQ_LENS, block_size=B, extra_columns=2, pad_tokens=2)


def _all_blocks(step, num_index_heads, topk):
    """indices selecting every causal block (topk >= every request's block count)."""
    _, pos = positions(step.cu_seqlens_q.tolist(), step.seq_lens.tolist(), step.num_tokens)
    idx = torch.full((step.num_tokens, num_index_heads, topk), -1, dtype=torch.int32)
    for t, p in enumerate(pos):
        if p >= 0:
            n = p // B + 1
            idx[t, :, :n] = torch.arange(n, dtype=torch.int32)
    return idx


@pytest.mark.parametrize("hq, hkv, h", [(8, 2, 2), (4, 4, 1), (6, 3, 3), (8, 2, 4)])
def test_all_blocks_equals_dense_sdpa(hq, hkv, h):
    step = _step()
    k, v = random_kv_cache(step.num_pages, B, hkv, 32, dtype=torch.float32)
    q = torch.randn(step.num_tokens, hq, 32, generator=torch.Generator().manual_seed(3))
    idx = _all_blocks(step, h, topk=8)
    out, lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                    step.block_table, block_size=B, return_lse=True)
    want = dense_paged_attention(q, k, v, step.cu_seqlens_q, step.seq_lens, step.block_table,
                                 block_size=B)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    pad = torch.tensor([p < 0 for p in positions(step.cu_seqlens_q.tolist(),
                                                 step.seq_lens.tolist(), step.num_tokens)[1]])
    assert (out[pad] == 0).all() and torch.isneginf(lse[pad]).all()
    assert torch.isfinite(lse[~pad]).all()


def test_selection_restricts_keys_and_lse_is_natural_log():
    step = make_step([2], [5 * B], block_size=B)
    k, v = random_kv_cache(step.num_pages, B, 1, 16, dtype=torch.float32)
    q = torch.randn(2, 2, 16)
    idx = torch.tensor([[[1, 4]], [[4, 3]]], dtype=torch.int32)  # token 0 at position 5B-2
    out, lse = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens,
                                    step.block_table, block_size=B, scale=0.3, return_lse=True)
    pages = step.block_table[0].long()
    for t, blocks in enumerate([[1, 4], [3, 4]]):
        p = 5 * B - 2 + t
        keys = [b * B + o for b in blocks for o in range(B) if b * B + o <= p]
        kk = torch.stack([k[pages[j // B], j % B, 0] for j in keys])
        vv = torch.stack([v[pages[j // B], j % B, 0] for j in keys])
        logits = q[t] @ kk.T * 0.3
        torch.testing.assert_close(lse[t], torch.logsumexp(logits, -1))
        torch.testing.assert_close(out[t], torch.softmax(logits, -1) @ vv)


def test_invalid_and_repeated_entries():
    step = make_step([1], [3 * B], block_size=B)
    k, v = random_kv_cache(step.num_pages, B, 1, 16, dtype=torch.float32)
    q = torch.randn(1, 1, 16)
    args = (step.cu_seqlens_q, step.seq_lens, step.block_table)
    base = ref.sparse_attention(q, k, v, torch.tensor([[[0, 2, -1, -1]]], dtype=torch.int32),
                                *args, block_size=B)
    # -1, ids >= n and repeats add nothing (J is a set)
    noisy = torch.tensor([[[2, 0, 7, 2, -5, 0, 3]]], dtype=torch.int32)
    torch.testing.assert_close(ref.sparse_attention(q, k, v, noisy, *args, block_size=B), base)
    empty = torch.tensor([[[-1, 5]]], dtype=torch.int32)
    out, lse = ref.sparse_attention(q, k, v, empty, *args, block_size=B, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_unwritten_nan_slots_never_leak():
    step = make_step([1], [B + 3], block_size=B)  # own block holds 3 written keys
    k, v = random_kv_cache(step.num_pages, B, 1, 16, dtype=torch.float32)
    own = int(step.block_table[0, 1])
    k[own, 3:] = float("nan")
    v[own, 3:] = float("nan")
    idx = torch.tensor([[[0, 1]]], dtype=torch.int32)
    out = ref.sparse_attention(torch.randn(1, 1, 16), k, v, idx, step.cu_seqlens_q,
                               step.seq_lens, step.block_table, block_size=B)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_vllm_packed_layout_equals_flash_layout(dtype):
    step = _step()
    k, v = random_kv_cache(step.num_pages, B, 2, 32, dtype=dtype, layout="vllm")
    assert not k.is_contiguous()
    kf, vf = k.contiguous(), v.contiguous()
    q = torch.randn(step.num_tokens, 4, 32).bfloat16()
    idx = _all_blocks(step, 2, topk=8)
    args = (idx, step.cu_seqlens_q, step.seq_lens, step.block_table)
    a = ref.sparse_attention(q, k, v, *args, block_size=B)
    b = ref.sparse_attention(q, kf, vf, *args, block_size=B)
    assert torch.equal(a, b)


def test_fp8_scales_dequantise():
    step = _step()
    k, v = random_kv_cache(step.num_pages, B, 2, 32, dtype=torch.float8_e4m3fn)
    q = torch.randn(step.num_tokens, 4, 32).bfloat16()
    idx = _all_blocks(step, 2, topk=8)
    args = (idx, step.cu_seqlens_q, step.seq_lens, step.block_table)
    a = ref.sparse_attention(q, k, v, *args, block_size=B, k_scale=0.5, v_scale=2.0)
    b = ref.sparse_attention(q, k.float() * 0.5, v.float() * 2.0, *args, block_size=B)
    assert torch.equal(a, b.to(a.dtype))


def _paged_decode(q, k_sub, v_sub, pages, lens, num_kv_heads, scale):
    """A plain paged-attention kernel's semantics: row t*Hkv+g attends the first lens[row] tokens
    of its sub-pages with the query heads of group g (what engines' decode kernels compute)."""
    num_tokens, hq, d = q.shape
    group = hq // num_kv_heads
    out = torch.zeros(num_tokens, hq, d)
    sub = k_sub.shape[1]
    for t in range(num_tokens):
        for g in range(num_kv_heads):
            row = t * num_kv_heads + g
            n = int(lens[row])
            if n == 0:
                continue
            ids = pages[row, :-(-n // sub)].long()
            k = k_sub[ids, :, g].reshape(-1, d)[:n]
            v = v_sub[ids, :, g].reshape(-1, d)[:n]
            qq = q[t, g * group:(g + 1) * group]
            out[t, g * group:(g + 1) * group] = torch.softmax(qq @ k.T * scale, -1) @ v
    return out


@pytest.mark.parametrize("sub_page_size", [16, 4])
def test_page_table_drives_a_plain_paged_kernel(sub_page_size):
    step = _step()
    k, v = random_kv_cache(step.num_pages, B, 2, 32, dtype=torch.float32)
    q = torch.randn(step.num_tokens, 8, 32, generator=torch.Generator().manual_seed(9))
    idx = _all_blocks(step, 2, topk=8)
    # thin the selections so that they are sparse, and add noise the table must drop
    idx[:, 0, 1] = -1
    idx[:, 1, 2] = idx[:, 1, 0]
    idx[:, 0, 7] = 50
    pages, lens = ref.sparse_page_table(idx, step.cu_seqlens_q, step.seq_lens, step.block_table,
                                        num_kv_heads=2, block_size=B,
                                        sub_page_size=sub_page_size)
    assert pages.shape == (step.num_tokens * 2, 8 * B // sub_page_size)
    per = B // sub_page_size
    k_sub = k.reshape(step.num_pages * per, sub_page_size, 2, 32)
    v_sub = v.reshape(step.num_pages * per, sub_page_size, 2, 32)
    got = _paged_decode(q, k_sub, v_sub, pages, lens, 2, 32 ** -0.5)
    want = ref.sparse_attention(q, k, v, idx, step.cu_seqlens_q, step.seq_lens, step.block_table,
                                block_size=B)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    _, pos = token_layout(step.cu_seqlens_q, step.seq_lens, step.num_tokens)
    assert (lens.view(-1, 2)[pos < 0] == 0).all()


def test_dense_and_gather_paths_agree(monkeypatch):
    """The reference attends short contexts densely under a selection mask and gathers blocks
    for long ones; both must compute the same J, repeats and bad ids included."""
    from openmsa.ops.attention import reference as attention_ref
    step = _step()
    k, v = random_kv_cache(step.num_pages, B, 2, 32, dtype=torch.float32)
    q = torch.randn(step.num_tokens, 4, 32)
    g = torch.Generator().manual_seed(4)
    idx = torch.randint(-2, 9, (step.num_tokens, 2, 5), generator=g).int()
    idx[:, :, 4] = idx[:, :, 1]  # repeats
    args = (q, k, v, idx, step.cu_seqlens_q, step.seq_lens, step.block_table)
    monkeypatch.setattr(attention_ref, "_DENSE_BLOCKS_PER_TOPK", 100)
    dense, dense_lse = ref.sparse_attention(*args, block_size=B, return_lse=True)
    monkeypatch.setattr(attention_ref, "_DENSE_BLOCKS_PER_TOPK", 0)
    gather, gather_lse = ref.sparse_attention(*args, block_size=B, return_lse=True)
    torch.testing.assert_close(dense, gather, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense_lse, gather_lse, atol=1e-5, rtol=1e-5)
