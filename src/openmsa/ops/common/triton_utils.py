# SPDX-License-Identifier: Apache-2.0
"""Shared @triton.jit helpers: the step's layout looked up on device, packed sort keys, and fp8
byte pairs split into fp16 tiles."""

import triton
import triton.language as tl

# a packed key below every real one (a block that does not exist)
EMPTY_KEY = tl.constexpr(-(2 ** 63))
# the score half of a forced block's key: above +inf's (0x7F800000); NaN never reaches a key
FORCED_SCORE_KEY = tl.constexpr(0x7FFFFFFF)


@triton.jit
def find_request(cu_seqlens_ptr, num_requests, token, guess=-1):
    """The request holding packed token `token`: the smallest r with cu[r+1] > token (R if none).
    A binary search over the R+1 offsets, so no token->request map is built on the host.

    `guess` (a request index, or -1): checked first with two loads issued together. When
    cu[guess] <= token < cu[guess+1] it is the answer (every earlier r has cu[r+1] <= token) and
    the search's log2(R) dependent loads are skipped: with equal q_len per request (decode,
    verify), token * R // T always holds, so a program's first K/V load waits on one round trip
    to cu_seqlens instead of up to 8 at R = 128."""
    lo = 0
    hi = num_requests
    if (guess >= 0) & (guess < num_requests):
        begin = tl.load(cu_seqlens_ptr + guess)
        end = tl.load(cu_seqlens_ptr + guess + 1)
        if (begin <= token) & (token < end):
            lo = guess
            hi = guess
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_ptr + mid + 1) > token:
            hi = mid
        else:
            lo = mid + 1
    return lo


@triton.jit
def step_well_formed(cu_seqlens_ptr, num_requests, num_tokens):
    """Whether the step's cu_seqlens_q is well formed: it starts at 0, never decreases and ends
    at most at num_tokens. A step failing this is padding as a whole (docs/spec.md, "Bounds"):
    otherwise two requests could claim one token, and per-request and per-token launches would
    disagree on it. Reads the R + 1 offsets a warp's 32 at a time: a wider chunk is reduced
    across warps, which keeps more registers live in the decode attention kernel's prologue
    (docs/performance.md, "The bounds checks' cost")."""
    CHUNK: tl.constexpr = 32
    ok = (tl.load(cu_seqlens_ptr) == 0) & (tl.load(cu_seqlens_ptr + num_requests) <= num_tokens)
    for i in range(0, num_requests, CHUNK):
        r = i + tl.arange(0, CHUNK)
        m = r < num_requests
        a = tl.load(cu_seqlens_ptr + r, mask=m, other=0)
        b = tl.load(cu_seqlens_ptr + r + 1, mask=m, other=0)
        ok = ok & (tl.sum((m & (b < a)).to(tl.int32), axis=0) == 0)
    return ok


@triton.jit
def request_ok(q_len, seq_len, table_width, BLOCK: tl.constexpr):
    """Whether a request's tokens can have positions: q_len <= seq_len, and a table column for
    each of its ceil(seq_len / BLOCK) blocks (docs/spec.md, "Bounds"; seq_len >= q_len >= 1 for
    a request holding a token, so (seq_len - 1) // BLOCK is its last block)."""
    return (seq_len >= q_len) & ((seq_len - 1) // BLOCK < table_width)


@triton.jit
def token_position(cu_seqlens_ptr, seq_lens_ptr, num_requests, num_tokens, table_width, token,
                   guess, BLOCK: tl.constexpr):
    """(request, position) of packed token `token`, right-aligned in its request. The position is
    -1 for padding: a token past cu[R], any token of a request failing `request_ok`, and every
    token of a step failing `step_well_formed`. `guess`: see find_request (-1 for none)."""
    r = find_request(cu_seqlens_ptr, num_requests, token, guess)
    pos = -1
    if r < num_requests:
        t_req = tl.load(cu_seqlens_ptr + r)
        q_len = tl.load(cu_seqlens_ptr + r + 1) - t_req
        seq_len = tl.load(seq_lens_ptr + r)
        ok = (request_ok(q_len, seq_len, table_width, BLOCK) & (token >= t_req)
              & step_well_formed(cu_seqlens_ptr, num_requests, num_tokens))
        pos = tl.where(ok, seq_len - q_len + (token - t_req), -1)
    return r, pos


@triton.jit
def tile_position(cu_seqlens_ptr, seq_lens_ptr, num_requests, num_tokens, table_width, t0,
                  QT: tl.constexpr, BLOCK: tl.constexpr):
    """(request, position of packed token t0, whole) for a tile of tokens [t0, t0 + QT): whole
    when they all lie in one request whose positions are valid (token_position's rules); the
    request is clamped to R - 1 and the position computed as if valid either way (callers mask
    with `whole`)."""
    r = find_request(cu_seqlens_ptr, num_requests, t0)
    real = r < num_requests
    # (R = 0: no request to read, and seq_lens may have no element at all)
    r_safe = tl.maximum(tl.minimum(r, num_requests - 1), 0)
    t_req = tl.load(cu_seqlens_ptr + r_safe, mask=real, other=0)
    t_next = tl.load(cu_seqlens_ptr + r_safe + 1, mask=real, other=0)
    seq_len = tl.load(seq_lens_ptr + r_safe, mask=real, other=0)
    whole = (real & (t0 >= t_req) & (t0 + QT <= t_next)
             & request_ok(t_next - t_req, seq_len, table_width, BLOCK)
             & step_well_formed(cu_seqlens_ptr, num_requests, num_tokens))
    return r_safe, seq_len - (t_next - t_req) + (t0 - t_req), whole


@triton.jit
def score_key(score):
    """An int32 per score whose integer order is the score's order: NaN ranks as -inf, -0.0 as 0,
    and -inf's key (0x807FFFFF) stays above -2**31, which callers keep for absent blocks."""
    s = tl.where(score != score, float("-inf"), score)
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    # flip the magnitude bits of negatives so that int order is float order
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def pack_key(key, block):
    """One int64 per (int32 key, block): larger means a better key, then a lower block, so every
    packed key is distinct and a plain max/sort applies MSA's tie rule."""
    return (key.to(tl.int64) << 32) + (0xFFFFFFFF - block.to(tl.int64))


@triton.jit
def unpack_block(key):
    return (0xFFFFFFFF - (key & 0xFFFFFFFF)).to(tl.int32)


@triton.jit
def split_e4m3_pairs(pairs, PTX: tl.constexpr):
    """fp16 tiles (low bytes, high bytes) of a uint16 tile whose bytes are two fp8 e4m3 values.

    With PTX (CUDA): two 16-bit elements share a 32-bit register; one byte permute gathers their
    low bytes and their high bytes, and two conversions turn each byte pair into fp16x2 (3
    instructions per 4 values; Triton's own casts went through shifts and masks per element).
    Without (the interpreter), the same values by casts, with e4m3's NaN (S.1111.111) put back:
    the interpreter's conversion turns it into +-480."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t;
            .reg .b16 lo, hi;
            prmt.b32 t, $2, 0, 0x3120;
            mov.b32 {lo, hi}, t;
            cvt.rn.f16x2.e4m3x2 $0, lo;
            cvt.rn.f16x2.e4m3x2 $1, hi;
            }""",
            constraints="=r,=r,r", args=[pairs], dtype=(tl.float16, tl.float16), is_pure=True,
            pack=2)
    else:
        lo = (pairs & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        hi = (pairs >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        lo = tl.where((pairs & 0x7F) == 0x7F, float("nan"), lo)
        hi = tl.where(((pairs >> 8) & 0x7F) == 0x7F, float("nan"), hi)
        return lo, hi
