"""Numba CPU backend: the fused kernels as parallel prange loops."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange
from numba.core import types
from numba.extending import overload

from luwu_rt.kernels import _numba_common as nc

DEVICES = frozenset({"cpu"})

# Stand-ins for the operands a call does not use, so no call allocates.
_NO_F32 = np.empty(0, dtype=np.float32)
_NO_OUT = np.empty(0, dtype=np.uint8)


def unavailable_reason() -> str | None:
    return None


def _load_grad(grad, i):  # pragma: no cover - replaced by the overload in compiled code
    raise NotImplementedError


def _store_out(out, i, x):  # pragma: no cover - replaced by the overload in compiled code
    raise NotImplementedError


# [Note: kinds in the array types] The operands' element kinds travel in the
# arrays' dtypes (float32 = fp32, uint16 = bf16 bits, int16 = fp16 bits,
# uint8 = no copy-out), so each combination compiles to its own loop with no
# branch on them: a run-time branch in the prange body keeps LLVM from
# vectorising it and costs ~5x.
@overload(_load_grad, inline="always")
def _load_grad_impl(grad, i):
    if grad.dtype == types.float32:
        return lambda grad, i: grad[i]
    if grad.dtype == types.uint16:
        return lambda grad, i: nc.half_bits_to_f32(grad[i], nc.KIND_BF16)
    if grad.dtype == types.int16:
        return lambda grad, i: nc.half_bits_to_f32(np.int64(grad[i]) & 0xFFFF, nc.KIND_F16)
    return None


@overload(_store_out, inline="always")
def _store_out_impl(out, i, x):
    if out.dtype == types.uint8:
        return lambda out, i, x: None
    if out.dtype == types.float32:
        def store_f32(out, i, x):
            out[i] = x
        return store_f32
    if out.dtype == types.uint16:
        def store_bf16(out, i, x):
            out[i] = nc.f32_to_half_bits(x, nc.KIND_BF16)
        return store_bf16
    if out.dtype == types.int16:
        def store_f16(out, i, x):
            out[i] = np.int16(np.int64(nc.f32_to_half_bits(x, nc.KIND_F16)))
        return store_f16
    return None


@njit(parallel=True, cache=True)
def _adam_kernel(p, grad, m, v, out, scale, l2, decay, wd, lerp_w, small, beta2, omb2, bc2s, eps,
                 nss):  # pragma: no cover - compiled
    for i in prange(p.size):
        g = _load_grad(grad, i) * scale
        pi, mi, vi = nc.adam_elem(p[i], g, m[i], v[i], l2, decay, wd, lerp_w, small, beta2, omb2, bc2s, eps, nss)
        p[i] = pi
        m[i] = mi
        v[i] = vi
        _store_out(out, i, pi)


@njit(parallel=True, cache=True)
def _sgd_kernel(p, grad, buf, out, scale, use_wd, wd, use_buf, first, nesterov, mom, omd,
                nlr):  # pragma: no cover - compiled
    for i in prange(p.size):
        g = _load_grad(grad, i) * scale
        bi = buf[i] if use_buf else np.float32(0.0)
        pi, bi = nc.sgd_elem(p[i], g, bi, use_wd, wd, use_buf, first, nesterov, mom, omd, nlr)
        p[i] = pi
        if use_buf:
            buf[i] = bi
        _store_out(out, i, pi)


_NUMPY_VIEW = {torch.float32: (torch.float32, np.float32), torch.bfloat16: (torch.int16, np.uint16),
               torch.float16: (torch.int16, np.int16)}
def _array(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view whose dtype encodes the element kind (see the Note above)."""
    as_torch, as_numpy = _NUMPY_VIEW[t.dtype]
    return t.detach().view(-1).view(as_torch).numpy().view(as_numpy)


def adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
         param_out: torch.Tensor | None, *, decoupled: bool, step: int, lr: float, beta1: float, beta2: float,
         eps: float, weight_decay: float, grad_scale: float) -> None:
    if param.numel() == 0:
        return
    scalars = nc.adam_scalar_args(decoupled=decoupled, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                  weight_decay=weight_decay, grad_scale=grad_scale)
    out = _NO_OUT if param_out is None else _array(param_out)
    _adam_kernel(_array(param), _array(grad), _array(exp_avg), _array(exp_avg_sq), out, *scalars)


def sgd(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None,
        param_out: torch.Tensor | None, *, first_step: bool, nesterov: bool, lr: float, momentum: float,
        dampening: float, weight_decay: float, grad_scale: float) -> None:
    if param.numel() == 0:
        return
    scalars = nc.sgd_scalar_args(first_step=first_step, nesterov=nesterov, lr=lr, momentum=momentum,
                                 dampening=dampening, weight_decay=weight_decay, grad_scale=grad_scale)
    buf = _array(momentum_buffer) if momentum != 0.0 else _NO_F32
    out = _NO_OUT if param_out is None else _array(param_out)
    _sgd_kernel(_array(param), _array(grad), buf, out, *scalars)
