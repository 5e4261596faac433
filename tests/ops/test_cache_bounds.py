# SPDX-License-Identifier: Apache-2.0
"""The cache writes on slots an engine did not check (docs/spec.md, "Bounds"): a slot outside
[0, P * B), negative or past the cache, writes nothing, on every path (write_index_cache into a
16-bit or an NVFP4 cache, write_kv_cache, fused_prepare's main and index caches). Each cache is
the middle of a buffer with a guard page of poison (NaN, or 0xAB bytes for NVFP4) before and
after: the reference's whole buffer equals the write with those slots set to -1 (tier 0), and the
kernels' whole buffer, guards included, equals the reference's (tier 1)."""

import pytest
import torch

import openmsa
from openmsa import reference as ref
from test_cache import CFG, CFG_NVFP4, NVFP4_STRIDE, POSITIONS, _close, _width

GUARD = 1
PAGES = 3
POISON = 0xAB  # NVFP4 pages' fill


def _hostile(num_slots, block, dtype, far=True):
    """Slots in the cache, P * B (the guard page's first), the guard page's last, -3, and (with
    `far`; without, a kernel writing there would crash the interpreter, not fail the test) far
    past the cache and far below 0 (int64: 2^40; int32: its extremes)."""
    big = 2 ** 40 if dtype == torch.int64 else 2 ** 31 - 1
    return torch.tensor([5, num_slots, -3, num_slots + block - 1, big if far else -3, 17,
                         -big - 1 if far else num_slots + 1, num_slots - 1], dtype=dtype)


def _in_cache(slots, num_slots):
    return torch.where((slots >= 0) & (slots < num_slots), slots, -1)


def _guarded(shape, dtype, device):
    """(buffer, cache): a [P, ...] cache of zeros between GUARD NaN pages."""
    buf = torch.full((shape[0] + 2 * GUARD, *shape[1:]), float("nan"))
    buf[GUARD:GUARD + shape[0]] = 0
    buf = buf.to(dtype).to(device)
    return buf, buf[GUARD:GUARD + shape[0]]


def _guarded_nvfp4(pages, device):
    """(buffer, cache): NVFP4 pages (uint8 [P, 128, 72] at NVFP4_STRIDE) between GUARD pages,
    every byte POISON."""
    buf = torch.full(((pages + 2 * GUARD) * NVFP4_STRIDE,), POISON, dtype=torch.uint8,
                     device=device)
    return buf, buf.as_strided((pages, 128, 72), (NVFP4_STRIDE, 72, 1), GUARD * NVFP4_STRIDE)


def _assert_guards_intact(buf):
    """Nothing written to the guard pages (and, where the cache is not NVFP4, something to the
    cache)."""
    if buf.dtype == torch.uint8:
        pages = buf.cpu().view(-1, NVFP4_STRIDE)
        assert (pages[:GUARD] == POISON).all() and (pages[-GUARD:] == POISON).all()
    else:
        b = buf.cpu().float()
        assert b[:GUARD].isnan().all() and b[-GUARD:].isnan().all()
        assert (b[GUARD:-GUARD] != 0).any()


def _bits(x):
    return x.cpu().contiguous().view(torch.uint8)


def _write(impl, kind, slot_dtype, device, clean=False, far=True):
    """impl's (openmsa's or the reference's) cache write of 8 tokens at hostile slots (`clean`:
    those outside the cache set to -1) into fresh guarded caches; returns the cache's buffer."""
    g = torch.Generator().manual_seed(0)
    if kind == "nvfp4":
        buf, cache = _guarded_nvfp4(1, device)
        block = 128
    elif kind == "index":
        buf, cache = _guarded((PAGES, 16, 32), torch.float16, device)
        block = 16
    else:
        # vLLM's packed [P, Hkv, B, 2D], seen as K and V views
        buf, packed = _guarded((PAGES, 2, 16, 64), torch.float16, device)
        block = 16
    num_slots = cache.shape[0] * block if kind != "kv" else PAGES * block
    slots = _hostile(num_slots, block, slot_dtype, far)
    if clean:
        slots = _in_cache(slots, num_slots)
    slots = slots.to(device)
    if kind == "kv":
        k, v = (torch.randn(8, 2, 32, generator=g).half().to(device) for _ in range(2))
        impl.write_kv_cache(k, v, packed[..., :32].permute(0, 2, 1, 3),
                            packed[..., 32:].permute(0, 2, 1, 3), slots)
    elif kind == "index":
        impl.write_index_cache(torch.randn(8, 32, generator=g).half().to(device), cache, slots)
    else:
        impl.write_index_cache((torch.randn(8, 128, generator=g) * 3).to(device), cache, slots)
    return buf


@pytest.mark.reference
@pytest.mark.parametrize("kind", ["index", "nvfp4", "kv"])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_reference_writes_nothing_outside_the_cache(kind, slot_dtype):
    got = _write(ref, kind, slot_dtype, "cpu")
    assert torch.equal(_bits(got), _bits(_write(ref, kind, slot_dtype, "cpu", clean=True)))
    _assert_guards_intact(got)


@pytest.mark.interpret
@pytest.mark.parametrize("kind", ["index", "nvfp4", "kv"])
@pytest.mark.parametrize("slot_dtype, far", [(torch.int64, True), (torch.int32, True),
                                             (torch.int64, False)])
def test_write_kernels_write_nothing_outside_the_cache(kernel_device, kind, slot_dtype, far):
    got = _write(openmsa, kind, slot_dtype, kernel_device, far=far)
    assert torch.equal(_bits(got), _bits(_write(ref, kind, slot_dtype, "cpu", far=far)))
    _assert_guards_intact(got)


def _prepare(impl, nvfp4, device, clean=False, far=True):
    """impl's fused_prepare of 8 tokens at hostile slots into guarded main and index caches (an
    NVFP4 index cache with `nvfp4`): (q, index_q, main buffer, index buffer)."""
    cfg = CFG_NVFP4 if nvfp4 else CFG
    block = cfg.block_size
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(len(POSITIONS), _width(cfg), generator=g) * 3).to(torch.bfloat16)
    w = [(torch.randn(n, generator=g) * 0.2).to(torch.bfloat16)
         for n in (cfg.head_dim, cfg.head_dim, cfg.index_head_dim, cfg.index_head_dim)]
    pages = 1 if nvfp4 else PAGES
    main, packed = _guarded((pages, cfg.num_kv_heads, block, 2 * cfg.head_dim), torch.bfloat16,
                            device)
    kc = packed[..., :cfg.head_dim].permute(0, 2, 1, 3)
    vc = packed[..., cfg.head_dim:].permute(0, 2, 1, 3)
    if nvfp4:
        index, ic = _guarded_nvfp4(pages, device)
    else:
        index, ic = _guarded((pages, block, cfg.index_head_dim), torch.bfloat16, device)
    slots = _hostile(pages * block, block, torch.int64, far)
    index_slots = slots.roll(3)
    if clean:
        slots, index_slots = _in_cache(slots, pages * block), _in_cache(index_slots,
                                                                        pages * block)
    q, iq = impl.fused_prepare(qkv.to(device), torch.tensor(POSITIONS, device=device), cfg,
                               *[x.to(device) for x in w], kc, vc, slots.to(device), ic,
                               index_slots.to(device))
    return q, iq, main, index


@pytest.mark.reference
@pytest.mark.parametrize("nvfp4", [False, True])
def test_reference_prepare_writes_nothing_outside_the_caches(nvfp4):
    got = _prepare(ref, nvfp4, "cpu")
    want = _prepare(ref, nvfp4, "cpu", clean=True)
    for a, b in zip(got, want):
        assert torch.equal(_bits(a), _bits(b))
    for buf in got[2:]:
        _assert_guards_intact(buf)


@pytest.mark.interpret
@pytest.mark.parametrize("nvfp4, far", [(False, True), (True, True), (False, False)])
def test_prepare_kernel_writes_nothing_outside_the_caches(kernel_device, nvfp4, far):
    q, iq, main, index = _prepare(openmsa, nvfp4, kernel_device, far=far)
    wq, wiq, want_main, want_index = _prepare(ref, nvfp4, "cpu", far=far)
    _close(q, wq, torch.bfloat16)
    _close(iq, wiq, iq.dtype)
    _close(main, want_main, torch.bfloat16)
    if nvfp4:
        assert torch.equal(index.cpu(), want_index)
    else:
        _close(index, want_index, torch.bfloat16)
    _assert_guards_intact(main)
    _assert_guards_intact(index)
