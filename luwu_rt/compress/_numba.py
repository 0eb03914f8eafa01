"""Numba CPU kernels of the codecs: encode with error feedback and decode, one piece per call, parallel over
its chunks (or elements, for the casts), on numpy views of the torch tensors (no copies).

They compute exactly what ``torch_codecs`` computes ([Note: codecs on the wire] in plan/codec.py), which
``tests/compress`` checks: payloads byte for byte where the arithmetic is the same (casts, topk, the signs
of onebit), within rounding where it is not (onebit's scale sums |x| sequentially in float64 here,
pairwise there). A residual that is not finite (a gradient that overflowed: the step is skipped, [Note:
skipped steps] in exec/step.py) is set to 0, so one overflow does not poison every later step. Loop
bodies branch on nothing that varies per element except through selects, which LLVM vectorises.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from luwu_rt.kernels.numba_bits import KIND_BF16, KIND_F16, f32_to_half_bits, half_bits_to_f32

__all__ = ["bf16_decode", "bf16_encode", "fp16_decode", "fp16_encode", "onebit_decode", "onebit_encode",
           "topk_decode", "topk_encode"]

_ZERO = np.float32(0.0)


@njit(inline="always")
def _finite(r):
    return r if math.isfinite(r) else _ZERO


# -- casts: payload = the 16-bit values, element i at i --------------------------------------------------

@njit(parallel=True, cache=True)
def bf16_encode(g, e, out16):  # pragma: no cover - compiled
    for i in prange(g.size):
        x = g[i] + e[i]
        h = f32_to_half_bits(x, KIND_BF16)
        out16[i] = h
        e[i] = _finite(x - half_bits_to_f32(h, KIND_BF16))


@njit(parallel=True, cache=True)
def fp16_encode(g, e, out16):  # pragma: no cover - compiled
    for i in prange(g.size):
        x = g[i] + e[i]
        h = f32_to_half_bits(x, KIND_F16)
        out16[i] = h
        e[i] = _finite(x - half_bits_to_f32(h, KIND_F16))


@njit(parallel=True, cache=True)
def bf16_decode(in16, out, accumulate):  # pragma: no cover - compiled
    if accumulate:
        for i in prange(out.size):
            out[i] += half_bits_to_f32(in16[i], KIND_BF16)
    else:
        for i in prange(out.size):
            out[i] = half_bits_to_f32(in16[i], KIND_BF16)


@njit(parallel=True, cache=True)
def fp16_decode(in16, out, accumulate):  # pragma: no cover - compiled
    if accumulate:
        for i in prange(out.size):
            out[i] += half_bits_to_f32(in16[i], KIND_F16)
    else:
        for i in prange(out.size):
            out[i] = half_bits_to_f32(in16[i], KIND_F16)


# -- onebit: per chunk [scale f32][ceil(n / 32) words of sign bits, element 32w + k at bit k of word w] ---

@njit(parallel=True, cache=True)
def onebit_encode(g, e, words, chunk):  # pragma: no cover - compiled
    """``words``: the payload as uint32; chunk c starts at word c * (1 + chunk // 32)."""
    scales = words.view(np.float32)
    stride = 1 + chunk // 32
    for c in prange((g.size + chunk - 1) // chunk):
        a = c * chunk
        b = min(a + chunk, g.size)
        total = 0.0
        for i in range(a, b):
            x = g[i] + e[i]
            e[i] = x
            total += abs(x)
        scale = np.float32(total / (b - a))
        base = c * stride
        scales[base] = scale
        for w in range((b - a + 31) // 32):
            word = np.uint32(0)
            for k in range(min(32, b - a - 32 * w)):
                i = a + 32 * w + k
                x = e[i]
                positive = x >= 0
                word |= np.uint32(positive) << np.uint32(k)
                e[i] = _finite(x - scale if positive else x + scale)
            words[base + 1 + w] = word


@njit(parallel=True, cache=True)
def onebit_decode(words, out, chunk, accumulate):  # pragma: no cover - compiled
    scales = words.view(np.float32)
    stride = 1 + chunk // 32
    for c in prange((out.size + chunk - 1) // chunk):
        a = c * chunk
        b = min(a + chunk, out.size)
        base = c * stride
        scale = scales[base]
        for i in range(a, b):
            bit = (words[base + 1 + (i - a) // 32] >> np.uint32((i - a) % 32)) & np.uint32(1)
            value = scale if bit else -scale
            out[i] = out[i] + value if accumulate else value


# -- topk: per chunk [k int32 indices, ascending][k f32 values] -------------------------------------------

@njit(parallel=True, cache=True)
def topk_encode(g, e, words, chunk, k_full, k_last):  # pragma: no cover - compiled
    """``k_full`` values kept of a full chunk, ``k_last`` of a shorter last one; chunk c at word c * 2 k_full.
    The k largest |x| win; among equal magnitudes at the threshold the lowest indices do."""
    indices = words.view(np.int32)
    values = words.view(np.float32)
    nchunks = (g.size + chunk - 1) // chunk
    for c in prange(nchunks):
        a = c * chunk
        b = min(a + chunk, g.size)
        n = b - a
        k = k_full if n == chunk else k_last
        mags = np.empty(n, np.float32)
        for i in range(a, b):
            x = g[i] + e[i]
            e[i] = x
            mags[i - a] = abs(x)
        threshold = np.partition(mags, n - k)[n - k]
        above = 0
        for i in range(a, b):
            above += abs(e[i]) > threshold
        ties = k - above  # equal to the threshold, taken from the lowest index up
        base = c * 2 * k_full
        j = 0
        for i in range(a, b):
            x = e[i]
            m = abs(x)
            take = m > threshold
            if m == threshold and ties > 0:
                take = True
                ties -= 1
            if take:
                indices[base + j] = i - a
                values[base + k + j] = x
                j += 1
                e[i] = _ZERO
            else:
                e[i] = _finite(x)
        for jj in range(j, k):  # NaNs compare with nothing: pad with zeros at index 0 (adds nothing)
            indices[base + jj] = 0
            values[base + k + jj] = _ZERO


@njit(parallel=True, cache=True)
def topk_decode(words, out, chunk, k_full, k_last, accumulate):  # pragma: no cover - compiled
    indices = words.view(np.int32)
    values = words.view(np.float32)
    for c in prange((out.size + chunk - 1) // chunk):
        a = c * chunk
        b = min(a + chunk, out.size)
        k = k_full if b - a == chunk else k_last
        if not accumulate:
            for i in range(a, b):
                out[i] = _ZERO
        base = c * 2 * k_full
        for j in range(k):
            out[a + indices[base + j]] += values[base + k + j]
