"""Numba CPU backend: the fused kernels as parallel prange loops."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from luwu_rt.kernels import _numba_common as nc

DEVICES = frozenset({"cpu"})

# Stand-ins for the operands a call does not use, so no call allocates.
_NO_F32 = np.empty(0, dtype=np.float32)
_NO_U16 = np.empty(0, dtype=np.uint16)


def unavailable_reason() -> str | None:
    return None


@njit(parallel=True, cache=True)
def _adam_kernel(p, g32, g16, gkind, m, v, out16, okind, scale, l2, decay, wd, lerp_w, small, beta2, omb2,
                 bc2s, eps, nss):  # pragma: no cover - compiled
    for i in prange(p.size):
        g = np.float32(g32[i] if gkind == 1 else nc.half_bits_to_f32(g16[i], gkind)) * scale
        pi, mi, vi = nc.adam_elem(p[i], g, m[i], v[i], l2, decay, wd, lerp_w, small, beta2, omb2, bc2s, eps, nss)
        p[i] = pi
        m[i] = mi
        v[i] = vi
        if okind != 0:
            out16[i] = nc.f32_to_half_bits(np.float32(pi), okind)


@njit(parallel=True, cache=True)
def _sgd_kernel(p, g32, g16, gkind, buf, out16, okind, scale, use_wd, wd, use_buf, first, nesterov, mom, omd,
                nlr):  # pragma: no cover - compiled
    for i in prange(p.size):
        g = np.float32(g32[i] if gkind == 1 else nc.half_bits_to_f32(g16[i], gkind)) * scale
        bi = buf[i] if use_buf else np.float32(0.0)
        pi, bi = nc.sgd_elem(p[i], g, bi, use_wd, wd, use_buf, first, nesterov, mom, omd, nlr)
        p[i] = pi
        if use_buf:
            buf[i] = bi
        if okind != 0:
            out16[i] = nc.f32_to_half_bits(np.float32(pi), okind)


def _f32(t: torch.Tensor | None) -> np.ndarray:
    return _NO_F32 if t is None else t.detach().view(-1).numpy()


def _u16(t: torch.Tensor | None) -> np.ndarray:
    return _NO_U16 if t is None else t.detach().view(-1).view(torch.int16).numpy().view(np.uint16)


def _grad(grad: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int]:
    kind = nc.KINDS[grad.dtype]
    if kind == nc.KIND_F32:
        return _f32(grad), _NO_U16, kind
    return _NO_F32, _u16(grad), kind


def _out(param_out: torch.Tensor | None) -> tuple[np.ndarray, int]:
    if param_out is None:
        return _NO_U16, nc.KIND_NONE
    return _u16(param_out), nc.KINDS[param_out.dtype]


def adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
         param_out: torch.Tensor | None, *, decoupled: bool, step: int, lr: float, beta1: float, beta2: float,
         eps: float, weight_decay: float, grad_scale: float) -> None:
    if param.numel() == 0:
        return
    g32, g16, gkind = _grad(grad)
    out16, okind = _out(param_out)
    scalars = nc.adam_scalar_args(decoupled=decoupled, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                  weight_decay=weight_decay, grad_scale=grad_scale)
    _adam_kernel(_f32(param), g32, g16, gkind, _f32(exp_avg), _f32(exp_avg_sq), out16, okind, *scalars)


def sgd(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None,
        param_out: torch.Tensor | None, *, first_step: bool, nesterov: bool, lr: float, momentum: float,
        dampening: float, weight_decay: float, grad_scale: float) -> None:
    if param.numel() == 0:
        return
    g32, g16, gkind = _grad(grad)
    out16, okind = _out(param_out)
    scalars = nc.sgd_scalar_args(first_step=first_step, nesterov=nesterov, lr=lr, momentum=momentum,
                                 dampening=dampening, weight_decay=weight_decay, grad_scale=grad_scale)
    buf = _f32(momentum_buffer) if momentum != 0.0 else _NO_F32
    _sgd_kernel(_f32(param), g32, g16, gkind, buf, out16, okind, *scalars)
