"""Per-element Adam/SGD math shared by the Numba CPU and Numba CUDA backends.

The functions are plain @njit functions on scalars, inlined at Numba-IR level
(inline="always": a call per element stops LLVM from vectorising the loop and
costs ~4x) into the CPU kernel's prange loop and the CUDA kernels, and under the
CUDA simulator they run as compiled CPU code called from the simulated threads
(which is why arrays are indexed in the kernels, not here).
They mirror csrc/optim/kernel_body.h op for op, in float32.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# Operand kinds: a gradient arrives as float32 values or as the uint16 bits of
# a bf16/fp16 value (Numba has no bf16 type); the copy-out is stored as bits.
KIND_NONE, KIND_F32, KIND_BF16, KIND_F16 = 0, 1, 2, 3
KINDS = {torch.float32: KIND_F32, torch.bfloat16: KIND_BF16, torch.float16: KIND_F16}


@intrinsic
def bits_as_f32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        value, width = args[0], args[0].type.width
        if width > 32:
            value = builder.trunc(value, ir.IntType(32))
        elif width < 32:
            value = builder.zext(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def f32_bits(typingctx, x):
    """The bits of a float32, zero-extended to int64 (room for carries)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(x), codegen


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c with one rounding (llvm.fma.f32: vfmadd on x86, fma.rn on CUDA)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        return builder.fma(*args)

    return types.float32(a, b, c), codegen


@njit(cache=True, inline="always")
def f16_bits_to_f32(h):
    w = np.int64(h) << 16
    sign = w & 0x80000000
    two_w = (w + w) & 0xFFFFFFFF
    normalized = bits_as_f32((two_w >> 4) + (0xE0 << 23)) * bits_as_f32(0x7800000)
    denormalized = bits_as_f32((two_w >> 17) | (126 << 23)) - np.float32(0.5)
    body = f32_bits(denormalized) if two_w < (1 << 27) else f32_bits(normalized)
    return bits_as_f32(sign | body)


@njit(cache=True, inline="always")
def f32_to_f16_bits(x):
    base = (abs(x) * bits_as_f32(0x77800000)) * bits_as_f32(0x08800000)
    w = f32_bits(x)
    shl1_w = (w + w) & 0xFFFFFFFF
    sign = w & 0x80000000
    bias = max(shl1_w & 0xFF000000, 0x71000000)
    base = bits_as_f32((bias >> 1) + 0x07800000) + base
    bits = f32_bits(base)
    nonsign = ((bits >> 13) & 0x7C00) + (bits & 0xFFF)
    return (sign >> 16) | (0x7E00 if shl1_w > 0xFF000000 else nonsign)


@njit(cache=True, inline="always")
def f32_to_bf16_bits(x):
    if x != x:
        return 0xFFFF  # torch's encoding of every NaN
    u = f32_bits(x)
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


@njit(cache=True, inline="always")
def half_bits_to_f32(h, kind):
    """bf16 (kind 2) or fp16 (kind 3) bits to float32."""
    if kind == 2:
        return bits_as_f32(np.int64(h) << 16)
    return f16_bits_to_f32(h)


@njit(cache=True, inline="always")
def f32_to_half_bits(x, kind):
    """float32 to bf16 (kind 2) or fp16 (kind 3) bits, round to nearest even."""
    if kind == 2:
        return np.uint16(f32_to_bf16_bits(x))
    return np.uint16(f32_to_f16_bits(x))


@njit(cache=True, inline="always")
def adam_elem(p, g, m, v, l2, decay, wd, lerp_w, small, beta2, omb2, bc2s, eps, nss):
    if l2:
        g = fma32(p, wd, g)
    else:
        p = p * decay
    m = fma32(lerp_w, g - m, m if small else g)
    v = v * beta2
    v = fma32(omb2 * g, g, v)  # torch's addcmul is fmadd(value * t1, t2, self)
    # math.sqrt, not np.sqrt: numba's CUDA target reaches np.sqrt through its ufunc table, which some
    # numba-cuda/numpy pairs lack (KeyError: <ufunc 'sqrt'>, seen on an H200 image). sqrt taken in double and
    # rounded to float32 is the correctly rounded float32 sqrt, bit for bit what np.sqrt gives.
    denom = np.float32(math.sqrt(v)) / bc2s + eps
    p = p + (nss * m) / denom
    return p, m, v


@njit(cache=True, inline="always")
def sgd_elem(p, g, buf, use_wd, wd, use_buf, first, nesterov, mom, omd, nlr):
    if use_wd:
        g = fma32(p, wd, g)
    if use_buf:
        buf = g if first else fma32(g, omd, buf * mom)
        g = fma32(buf, mom, g) if nesterov else buf
    return fma32(g, nlr, p), buf


def adam_scalar_args(*, decoupled: bool, step: int, lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float, grad_scale: float) -> tuple:
    """The kernels' scalar arguments, rounded to float32 once as torch does."""
    from luwu_rt.kernels._checks import adam_scalars

    neg_step_size, bc2_sqrt = adam_scalars(step=step, lr=lr, beta1=beta1, beta2=beta2)
    f32 = np.float32
    lerp_w = 1.0 - beta1
    small = lerp_w < 0.5
    return (f32(grad_scale), (not decoupled) and weight_decay != 0.0,
            f32(1.0 - lr * weight_decay) if decoupled else f32(1.0), f32(weight_decay),
            f32(lerp_w if small else lerp_w - 1.0), small, f32(beta2), f32(1.0 - beta2), f32(bc2_sqrt), f32(eps),
            f32(neg_step_size))


def sgd_scalar_args(*, first_step: bool, nesterov: bool, lr: float, momentum: float, dampening: float,
                    weight_decay: float, grad_scale: float) -> tuple:
    f32 = np.float32
    return (f32(grad_scale), weight_decay != 0.0, f32(weight_decay), momentum != 0.0, bool(first_step),
            bool(nesterov), f32(momentum), f32(1.0 - dampening), f32(-lr))
