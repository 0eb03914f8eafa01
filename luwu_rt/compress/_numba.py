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

from luwu_rt.kernels.numba_bits import (
    KIND_BF16,
    KIND_F16,
    f32_to_half_bits,
    half_bits_to_f32,
)

__all__ = ["bf16_decode", "bf16_encode", "fp16_decode", "fp16_encode", "onebit_decode", "onebit_encode",
           "topk_decode", "topk_encode"]

_ZERO = np.float32(0.0)


@njit(inline="always")
def _finite(r):
    return r if math.isfinite(r) else _ZERO


# -- casts: payload = the 16-bit values, element i at i ----------------------------------------------------
# In blocks of views indexed from 0, like the chunks below (vectorised: 1.4x encode, 1.8x decode).

_BLOCK = 4096


def _cast_kernels(kind: int):
    """Encode and decode of one half type; ``kind`` is a constant of the compiled code, so the branches of the
    rounding on it fold away (a kind passed per call costs 2x)."""

    @njit(parallel=True, cache=True)
    def encode(g, e, out16):  # pragma: no cover - compiled
        for c in prange((g.size + _BLOCK - 1) // _BLOCK):
            a = c * _BLOCK
            b = min(a + _BLOCK, g.size)
            gg, ee, oo = g[a:b], e[a:b], out16[a:b]
            for i in range(gg.size):
                x = gg[i] + ee[i]
                h = f32_to_half_bits(x, kind)
                oo[i] = h
                ee[i] = _finite(x - half_bits_to_f32(h, kind))

    @njit(parallel=True, cache=True)
    def decode(in16, out, accumulate):  # pragma: no cover - compiled
        for c in prange((out.size + _BLOCK - 1) // _BLOCK):
            a = c * _BLOCK
            b = min(a + _BLOCK, out.size)
            hh, oo = in16[a:b], out[a:b]
            if accumulate:
                for i in range(oo.size):
                    oo[i] += half_bits_to_f32(hh[i], kind)
            else:
                for i in range(oo.size):
                    oo[i] = half_bits_to_f32(hh[i], kind)

    return encode, decode


bf16_encode, bf16_decode = _cast_kernels(KIND_BF16)
fp16_encode, fp16_decode = _cast_kernels(KIND_F16)


# -- onebit: per chunk [scale f32][ceil(n / 32) words of sign bits, element 32w + k at bit k of word w] ---
# Loops index views of one chunk from 0 (``g[a:b]``): with indices running from ``a`` LLVM does not vectorise
# them (measured 5x slower). ``reassoc`` lets it vectorise the float64 sum of |x| (its order then follows
# the vector width: a rank's own encode, deterministic on its machine; every rank decodes the same bytes).

@njit(parallel=True, cache=True, fastmath={"reassoc"})
def onebit_encode(g, e, words, chunk):  # pragma: no cover - compiled
    """``words``: the payload as uint32; chunk c starts at word c * (1 + chunk // 32). Signs are of
    x = g + e, so they and the sum of |x| come in one pass, the residual in a second."""
    scales = words.view(np.float32)
    stride = 1 + chunk // 32
    for c in prange((g.size + chunk - 1) // chunk):
        a = c * chunk
        b = min(a + chunk, g.size)
        base = c * stride
        total = 0.0
        for w in range((b - a + 31) // 32):
            lo = a + 32 * w
            gs = g[lo : min(lo + 32, b)]
            es = e[lo : min(lo + 32, b)]
            word = np.uint32(0)
            for k in range(gs.size):
                x = gs[k] + es[k]
                es[k] = x
                total += abs(x)
                word |= np.uint32(x >= _ZERO) << np.uint32(k)
            words[base + 1 + w] = word
        scale = np.float32(total / (b - a))
        scales[base] = scale
        ee = e[a:b]
        for i in range(ee.size):
            x = ee[i]
            ee[i] = _finite(x - (scale if x >= _ZERO else -scale))


@njit(parallel=True, cache=True)
def onebit_decode(words, out, chunk, accumulate):  # pragma: no cover - compiled
    scales = words.view(np.float32)
    stride = 1 + chunk // 32
    for c in prange((out.size + chunk - 1) // chunk):
        a = c * chunk
        b = min(a + chunk, out.size)
        base = c * stride
        scale = scales[base]
        for w in range((b - a + 31) // 32):
            seg = out[a + 32 * w : min(a + 32 * w + 32, b)]
            word = words[base + 1 + w]
            if accumulate:
                for k in range(seg.size):
                    seg[k] += scale if (word >> np.uint32(k)) & np.uint32(1) else -scale
            else:
                for k in range(seg.size):
                    seg[k] = scale if (word >> np.uint32(k)) & np.uint32(1) else -scale


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
        gg = g[a:b]
        ee = e[a:b]
        mags = np.empty(n, np.float32)
        for i in range(n):
            x = gg[i] + ee[i]
            ee[i] = x
            mags[i] = abs(x)
        threshold = np.partition(mags, n - k)[n - k]
        above = 0
        for i in range(n):
            above += abs(ee[i]) > threshold
        ties = k - above  # equal to the threshold, taken from the lowest index up
        base = c * 2 * k_full
        j = 0
        for i in range(n):
            x = ee[i]
            m = abs(x)
            take = m > threshold
            if m == threshold and ties > 0:
                take = True
                ties -= 1
            if take:
                indices[base + j] = i
                values[base + k + j] = x
                j += 1
                ee[i] = _ZERO
            else:
                ee[i] = _finite(x)
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
            out[a:b] = _ZERO
        base = c * 2 * k_full
        for j in range(k):
            out[a + indices[base + j]] += values[base + k + j]
