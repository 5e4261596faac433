# SPDX-License-Identifier: Apache-2.0
"""openmsa.nvfp4, the NVFP4 index-page format (docs/spec.md, NVFP4 index pages): the quantizer's
rules one by one with bytes computed by hand, the round trip, the page views and the cache
checks. The Triton writers are held to these bytes in tests/ops/test_cache.py."""

import pytest
import torch

import openmsa
from openmsa import nvfp4

pytestmark = pytest.mark.reference


def _key(group0, fill=0.0):
    """A [1, 128] key whose first 16 dims are `group0` and the rest `fill`."""
    k = torch.full((1, 128), fill)
    k[0, :len(group0)] = torch.tensor(group0)
    return k


def _codes(key):
    """The 128 4-bit codes of one key, in dim order (low nibble first)."""
    codes, scales = nvfp4.quantize_index_keys(key)
    c = codes[0].long()
    return torch.stack([c & 15, c >> 4], -1).flatten().tolist(), scales[0].tolist()


def test_sizes():
    assert (nvfp4.TOKEN_BYTES, nvfp4.PAGE_BYTES, nvfp4.SCALES_AT) == (72, 9216, 8192)
    assert openmsa.nvfp4 is nvfp4 and openmsa.dequantize_index_pages is \
        nvfp4.dequantize_index_pages


def test_byte_layout_low_nibble_first_and_scale_bytes():
    # amax 6 -> scale 1.0 = e4m3 0x38 (exponent 7, mantissa 0): codes are the values themselves
    codes, scales = nvfp4.quantize_index_keys(_key([0.5, -1.0] + [0.0] * 12 + [3.0, 6.0]))
    assert codes[0, 0].item() == 0xA1        # dim 0: +0.5 = code 1; dim 1: -1.0 = 8 | 2
    assert codes[0, 7].item() == 0x75        # dim 14: 3.0 = code 5; dim 15: 6.0 = code 7
    assert codes[0, 1:7].tolist() == [0] * 6 and codes[0, 8:].tolist() == [0] * 56
    # group 0's scale, then seven all-zero groups at the floor 2^-9 = e4m3 0x01 (subnormal)
    assert scales[0].tolist() == [0x38] + [0x01] * 7


def test_scale_is_e4m3_nearest_even_of_amax_over_6():
    # amax 9 -> 1.5 = 0x3C; amax 6.375 -> 1.0625 halfway between 1.0 and 1.125 -> even 1.0
    # (0x38); amax 6.4 -> 1.0667 -> 1.125 (0x39); amax 15 -> 2.5 = 0x42
    for amax, byte in ((9.0, 0x3C), (6.375, 0x38), (6.4, 0x39), (15.0, 0x42)):
        assert _codes(_key([amax]))[1][0] == byte, amax


def test_scale_floor_and_saturation():
    # amax / 6 below 2^-9 -> 2^-9 (0x01); the values are tiny against it -> code 0
    codes, scales = _codes(_key([1e-5, -2e-5]))
    assert scales[0] == 0x01 and codes[:2] == [0, 0]
    # amax / 6 = 3 * 2^-10 (halfway between subnormals 1 and 2 of 2^-9) -> even: 2 (0x02)
    assert _codes(_key([6 * 3 * 2.0 ** -10]))[1][0] == 0x02
    # huge: the scale saturates at 448 (0x7E) and every code at 6 (7, or 15 negative)
    codes, scales = _codes(_key([1e6, -3e4, 448.0 * 5.5, 448.0 * 4.9]))
    assert scales[0] == 0x7E and codes[:4] == [7, 15, 7, 6]


@pytest.mark.parametrize("value, code", [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4),
                                         (3.5, 6), (5.0, 6)])
def test_e2m1_ties_go_to_the_even_code(value, code):
    # scale 1.0 (amax 6 in dim 15): the product is the value itself, exactly a midpoint
    above = torch.nextafter(torch.tensor(value), torch.tensor(9.0)).item()
    below = torch.nextafter(torch.tensor(value), torch.tensor(0.0)).item()
    codes, _ = _codes(_key([value, -value, above, below] + [0.0] * 11 + [6.0]))
    lower = code if code % 2 == 0 and value in (0.25, 1.25, 2.5, 5.0) else code - 1
    assert codes[0] == code and codes[1] == (code | 8 if code else 0)
    assert codes[2] == lower + 1 and codes[3] == lower


def test_no_negative_zero():
    codes, _ = _codes(_key([-0.1, -0.25, -0.0, -1e-30] + [0.0] * 11 + [6.0]))
    assert codes[:4] == [0, 0, 0, 0]


def test_product_is_rounded_toward_zero():
    """Scale 7/256 (e4m3 0x0E, from amax 0.1640625): r = fp32(256/7) is a bit above 256/7, and
    x = 0x1.87fffep-5 makes x * r = 1.74999994..., whose nearest fp32 is the midpoint 1.75 (a
    tie that would go up to code 4 = 2.0); toward zero it stays below: code 3 (1.5). Likewise
    twice x -> 3.4999998... -> code 5 (3.0) instead of the tie's 6."""
    x = float.fromhex("0x1.87fffep-5")
    r = 1.0 / torch.tensor(7 / 256)
    exact = torch.tensor(x).double() * r.double()
    assert exact < 1.75 and (torch.tensor(x) * r).item() == 1.75  # the case is what it claims
    codes, scales = _codes(_key([0.1640625, x, -x, 2 * x]))
    assert scales[0] == 0x0E and codes[:4] == [7, 3, 11, 5]


def test_round_trip_is_exact_for_representable_keys():
    # keys that are code * scale with a 6 in every group: quantizing them gives back the bytes
    g = torch.Generator().manual_seed(0)
    n = 64
    codes = torch.randint(0, 16, (n, 128), generator=g)
    codes[codes == 8] = 0                                  # no negative zero
    codes[:, ::16] = 7 + 8 * torch.randint(0, 2, (n, 8), generator=g)  # |6| in every group
    scale_bytes = torch.randint(0x08, 0x7F, (n, 8), generator=g).to(torch.uint8)  # normals
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    keys = nvfp4.dequantize_index_keys(packed, scale_bytes)
    got_codes, got_scales = nvfp4.quantize_index_keys(keys)
    assert torch.equal(got_codes, packed) and torch.equal(got_scales, scale_bytes)


def test_dequantized_keys_are_within_one_scale():
    # normal scales (amax / 6 >= 2^-6) and below the 448 cap: |x / s| <= 6 * 17 / 16, so the
    # nearest code is at most one scale away (subnormal scales round coarsely: not this bound)
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(32, 128, generator=g) * torch.logspace(-1, 1.5, 32)[:, None]
    codes, scales = nvfp4.quantize_index_keys(keys)
    back = nvfp4.dequantize_index_keys(codes, scales)
    s = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
    assert ((back - keys).abs() <= s).all()
    assert nvfp4.quantize_index_keys(keys.bfloat16())[0].shape == (32, 64)


def _strided_cache(pages, stride=9216 + 64):
    buf = torch.zeros(pages * stride, dtype=torch.uint8)
    return buf, buf.as_strided((pages, 128, 72), (stride, 72, 1))


def test_page_parts_views_honour_the_page_stride():
    buf, cache = _strided_cache(3)
    codes, scales = nvfp4.page_parts(cache)
    codes[2, 5] = torch.arange(64, dtype=torch.uint8)
    scales[1, 127] = torch.arange(8, dtype=torch.uint8) + 100
    stride = 9216 + 64
    assert buf[2 * stride + 5 * 64:2 * stride + 6 * 64].tolist() == list(range(64))
    at = stride + 8192 + 127 * 8
    assert buf[at:at + 8].tolist() == list(range(100, 108))
    assert int((buf != 0).sum()) == 64 + 7  # nothing else written (code byte 0 is 0)


def test_dequantize_index_pages():
    g = torch.Generator().manual_seed(2)
    _, cache = _strided_cache(2)
    keys = torch.randn(256, 128, generator=g)
    codes, scales = nvfp4.quantize_index_keys(keys)
    cp, sp = nvfp4.page_parts(cache)
    cp.copy_(codes.view(2, 128, 64))
    sp.copy_(scales.view(2, 128, 8))
    want = nvfp4.dequantize_index_keys(codes, scales).view(2, 128, 128)
    assert torch.equal(openmsa.dequantize_index_pages(cache), want)
    with pytest.raises(TypeError, match="index_cache"):
        openmsa.dequantize_index_pages(torch.zeros(2, 128, 72, dtype=torch.float16))


@pytest.mark.parametrize("make, match", [
    (lambda: torch.zeros(2, 128, 64, dtype=torch.uint8), r"\[P, 128, 72\]"),
    (lambda: torch.zeros(2, 64, 72, dtype=torch.uint8), r"\[P, 128, 72\]"),
    (lambda: torch.zeros(2, 9216, dtype=torch.uint8), r"\[P, 128, 72\]"),
    (lambda: torch.zeros(2, 72, 128, dtype=torch.uint8).transpose(1, 2), "contiguous bytes"),
    (lambda: torch.zeros(2 * 9216).as_strided((2, 128, 72), (9000, 72, 1)).to(torch.uint8)
     .as_strided((2, 128, 72), (9000, 72, 1)), "page stride"),
    (lambda: torch.zeros(3 * 9224, dtype=torch.uint8).as_strided((2, 128, 72), (9224, 72, 1)),
     "multiple of 16"),
    (lambda: torch.zeros(2 * 9216 + 16, dtype=torch.uint8)[1:].as_strided(
        (2, 128, 72), (9216, 72, 1)), "aligned"),
])
def test_cache_checks_name_the_argument(make, match):
    with pytest.raises(ValueError, match=match) as e:
        nvfp4.check_nvfp4_cache("index_cache", make())
    assert str(e.value).startswith("index_cache")


def test_block_size_and_shape_helpers():
    with pytest.raises(ValueError, match="block_size must be 128"):
        nvfp4.check_nvfp4_cache("index_cache", torch.zeros(1, 128, 72, dtype=torch.uint8),
                                block_size=64)
    assert nvfp4.index_cache_shape(5, 128, 128, torch.uint8) == (5, 128, 72)
    assert nvfp4.index_cache_shape(5, 64, 32, torch.bfloat16) == (5, 64, 32)
    with pytest.raises(ValueError, match="index_head_dim == 128 and block_size == 128"):
        nvfp4.index_cache_shape(5, 64, 128, torch.uint8)
    assert nvfp4.index_query_dtype(torch.uint8) == torch.float8_e4m3fn
    assert nvfp4.index_query_dtype(torch.bfloat16) == torch.bfloat16
