"""Numba CUDA backend: the same per-element math as the Numba CPU backend, as
grid-stride CUDA kernels.

With NUMBA_ENABLE_CUDASIM=1 (set before numba is first imported) the kernels run
in Numba's CUDA simulator on CPU tensors; that is how they are tested on
machines without a GPU. The simulator runs every thread in Python, so it is
for small arrays only.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import config, cuda

from luwu_rt.kernels import _numba_common as nc

SIMULATOR = bool(config.ENABLE_CUDASIM)
# Under the simulator the "device" arrays are host memory.
DEVICES = frozenset({"cpu"}) if SIMULATOR else frozenset({"cuda"})
_THREADS_PER_BLOCK = 32 if SIMULATOR else 256


@functools.cache
def unavailable_reason() -> str | None:
    if SIMULATOR:
        return None
    if not cuda.is_available():
        return "no CUDA GPU/driver visible to numba (set NUMBA_ENABLE_CUDASIM=1 to run in the simulator)"
    try:
        # What compiling a kernel with fp16/bf16 loads; numba-cuda <= 0.30 fails here under numpy >= 2.5
        # (np.row_stack is gone), which would otherwise surface only at the first step.
        import numba.cuda.fp16  # noqa: F401
    except Exception as exc:
        import numba

        return (f"numba's CUDA target does not load here ({type(exc).__name__}: {exc}; numba {numba.__version__}, "
                f"numpy {np.__version__}): install a numpy that this numba-cuda supports")
    return None


# Module-level kernels: the simulator swaps the module-global `cuda` for its
# fake while a kernel runs. cuda.jit compiles on first launch only. The
# np.float32() wrappers are no-ops when compiled; in the simulator they keep
# values that cross an @njit call boundary (boxed as Python floats) in float32.
@cuda.jit
def adam_kernel(p, g32, g16, gkind, m, v, out32, out16, okind, scale, l2, decay, wd, lerp_w, small, beta2, omb2,
                bc2s, eps, nss):  # pragma: no cover - compiled
    i = cuda.grid(1)
    while i < p.size:
        g = np.float32(g32[i] if gkind == 1 else nc.half_bits_to_f32(g16[i], gkind)) * scale
        pi, mi, vi = nc.adam_elem(p[i], g, m[i], v[i], l2, decay, wd, lerp_w, small, beta2, omb2, bc2s, eps,
                                  nss)
        p[i] = pi
        m[i] = mi
        v[i] = vi
        if okind == 1:
            out32[i] = pi
        elif okind != 0:
            out16[i] = nc.f32_to_half_bits(np.float32(pi), okind)
        i += cuda.gridsize(1)


@cuda.jit
def sgd_kernel(p, g32, g16, gkind, buf, out32, out16, okind, scale, use_wd, wd, use_buf, first, nesterov, mom, omd,
               nlr):  # pragma: no cover - compiled
    i = cuda.grid(1)
    while i < p.size:
        g = np.float32(g32[i] if gkind == 1 else nc.half_bits_to_f32(g16[i], gkind)) * scale
        bi = buf[i] if use_buf else np.float32(0.0)
        pi, bi = nc.sgd_elem(p[i], g, bi, use_wd, wd, use_buf, first, nesterov, mom, omd, nlr)
        p[i] = pi
        if use_buf:
            buf[i] = bi
        if okind == 1:
            out32[i] = pi
        elif okind != 0:
            out16[i] = nc.f32_to_half_bits(np.float32(pi), okind)
        i += cuda.gridsize(1)


def _as_array(t: torch.Tensor | None, dtype: type) -> object:
    if t is None:
        t = _placeholder(dtype)
    else:
        t = t.detach().view(-1)
        if dtype is np.uint16:
            t = t.view(torch.int16)
    if SIMULATOR:
        arr = t.numpy()
    else:
        arr = cuda.as_cuda_array(t)  # zero-copy view through __cuda_array_interface__
    return arr.view(np.uint16) if dtype is np.uint16 else arr


@functools.cache
def _placeholder(dtype: type) -> torch.Tensor:
    device = "cpu" if SIMULATOR else "cuda"
    return torch.empty(1, dtype=torch.float32 if dtype is np.float32 else torch.int16, device=device)


def _grid(numel: int) -> tuple[int, int]:
    blocks = (numel + _THREADS_PER_BLOCK - 1) // _THREADS_PER_BLOCK
    # Grid-stride loop: a few waves of blocks cover any size without a huge grid.
    return min(blocks, 1 if SIMULATOR else 65536), _THREADS_PER_BLOCK


def _grad_args(grad: torch.Tensor) -> tuple[object, object, int]:
    kind = nc.KINDS[grad.dtype]
    if kind == nc.KIND_F32:
        return _as_array(grad, np.float32), _as_array(None, np.uint16), kind
    return _as_array(None, np.float32), _as_array(grad, np.uint16), kind


def _out_args(param_out: torch.Tensor | None) -> tuple[object, object, int]:
    kind = nc.KIND_NONE if param_out is None else nc.KINDS[param_out.dtype]
    if kind == nc.KIND_F32:
        return _as_array(param_out, np.float32), _as_array(None, np.uint16), kind
    return _as_array(None, np.float32), _as_array(param_out, np.uint16), kind


def adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
         param_out: torch.Tensor | None, *, decoupled: bool, step: int, lr: float, beta1: float, beta2: float,
         eps: float, weight_decay: float, grad_scale: float) -> None:
    if param.numel() == 0:
        return
    blocks, threads = _grid(param.numel())
    scalars = nc.adam_scalar_args(decoupled=decoupled, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                  weight_decay=weight_decay, grad_scale=grad_scale)
    adam_kernel[blocks, threads](_as_array(param, np.float32), *_grad_args(grad),
                                   _as_array(exp_avg, np.float32), _as_array(exp_avg_sq, np.float32),
                                   *_out_args(param_out), *scalars)


def sgd(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None,
        param_out: torch.Tensor | None, *, first_step: bool, nesterov: bool, lr: float, momentum: float,
        dampening: float, weight_decay: float, grad_scale: float) -> None:
    if param.numel() == 0:
        return
    blocks, threads = _grid(param.numel())
    scalars = nc.sgd_scalar_args(first_step=first_step, nesterov=nesterov, lr=lr, momentum=momentum,
                                 dampening=dampening, weight_decay=weight_decay, grad_scale=grad_scale)
    buf = momentum_buffer if momentum != 0.0 else None
    sgd_kernel[blocks, threads](_as_array(param, np.float32), *_grad_args(grad), _as_array(buf, np.float32),
                                   *_out_args(param_out), *scalars)
