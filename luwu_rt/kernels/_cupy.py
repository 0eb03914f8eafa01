"""CuPy backend: the fused kernels as CUDA C compiled by NVRTC, launched on
torch's current stream on the tensors' own memory (no copies)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from luwu_rt.kernels._checks import adam_scalars

DEVICES = frozenset({"cuda"})

# Mirrors csrc/optim/kernel_body.h; --fmad=false keeps every rounding where the
# source puts it (explicit fmaf only), as in the C++ kernels.
_SOURCE = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ float load_grad(const void* g, int kind, long long i) {
  if (kind == 1) return ((const float*)g)[i];
  const unsigned short h = ((const unsigned short*)g)[i];
  if (kind == 2) return __uint_as_float(((unsigned int)h) << 16);
  return __half2float(__ushort_as_half(h));
}

__device__ __forceinline__ void store_out(void* out, int kind, long long i, float x) {
  if (kind == 1) {
    ((float*)out)[i] = x;
    return;
  }
  unsigned short h;
  if (kind == 2) {
    const unsigned int u = __float_as_uint(x);
    h = isnan(x) ? 0xFFFFu : (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  } else {
    h = __half_as_ushort(__float2half_rn(x));
  }
  ((unsigned short*)out)[i] = h;
}

extern "C" __global__ void adam_kernel(float* p, const void* g, int gkind, float* m, float* v, void* out,
    int okind, long long n, float scale, int l2, float decay, float wd, float lerp_w, int small, float beta2,
    float omb2, float bc2s, float eps, float nss) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    float gi = load_grad(g, gkind, i) * scale;
    float pi = p[i];
    if (l2) gi = fmaf(pi, wd, gi); else pi = pi * decay;
    float mi = m[i];
    mi = fmaf(lerp_w, gi - mi, small ? mi : gi);
    float vi = v[i] * beta2;
    vi = fmaf(omb2 * gi, gi, vi);
    const float denom = sqrtf(vi) / bc2s + eps;
    pi = pi + (nss * mi) / denom;
    p[i] = pi; m[i] = mi; v[i] = vi;
    if (okind != 0) store_out(out, okind, i, pi);
  }
}

extern "C" __global__ void sgd_kernel(float* p, const void* g, int gkind, float* buf, void* out, int okind,
    long long n, float scale, int use_wd, float wd, int use_buf, int first, int nesterov, float mom, float omd,
    float nlr) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    float gi = load_grad(g, gkind, i) * scale;
    float pi = p[i];
    if (use_wd) gi = fmaf(pi, wd, gi);
    if (use_buf) {
      const float b = first ? gi : fmaf(gi, omd, buf[i] * mom);
      buf[i] = b;
      gi = nesterov ? fmaf(b, mom, gi) : b;
    }
    pi = fmaf(gi, nlr, pi);
    p[i] = pi;
    if (okind != 0) store_out(out, okind, i, pi);
  }
}
"""

_KINDS = {None: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_THREADS_PER_BLOCK = 256


@functools.cache
def unavailable_reason() -> str | None:
    try:
        import cupy
    except ImportError as exc:
        return f"cupy is not installed ({exc}); pip install cupy-cuda12x"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "cupy sees no CUDA device"
    except Exception as exc:  # CUDARuntimeError without a driver
        return f"cupy cannot reach a CUDA device ({exc})"
    if not torch.cuda.is_available():
        return "torch was built without CUDA, so there are no CUDA tensors to update"
    return None


@functools.cache
def _module():
    import cupy

    return cupy.RawModule(code=_SOURCE, options=("--fmad=false", "-std=c++14"),
                          name_expressions=None, backend="nvrtc",
                          translate_cucomplex=False)


def _launch(name: str, param: torch.Tensor, args: tuple) -> None:
    import cupy

    n = param.numel()
    blocks = min((n + _THREADS_PER_BLOCK - 1) // _THREADS_PER_BLOCK, 65536)
    kernel = _module().get_function(name)
    with cupy.cuda.Device(param.device.index or 0):
        current = torch.cuda.current_stream(param.device)
        # cupy >= 14 takes the stream through the CUDA stream protocol; older ones by its handle.
        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        try:
            stream = from_external(current) if from_external is not None else None
        except (TypeError, AttributeError, ValueError):  # a torch stream without the protocol
            stream = None
        if stream is None:
            stream = cupy.cuda.ExternalStream(current.cuda_stream)
        kernel((blocks,), (_THREADS_PER_BLOCK,), args, stream=stream)


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
         param_out: torch.Tensor | None, *, decoupled: bool, step: int, lr: float, beta1: float, beta2: float,
         eps: float, weight_decay: float, grad_scale: float) -> None:
    if param.numel() == 0:
        return
    neg_step_size, bc2_sqrt = adam_scalars(step=step, lr=lr, beta1=beta1, beta2=beta2)
    lerp_w = 1.0 - beta1
    small = lerp_w < 0.5
    f32, i32 = np.float32, np.int32
    args = (_ptr(param), _ptr(grad), i32(_KINDS[grad.dtype]), _ptr(exp_avg), _ptr(exp_avg_sq), _ptr(param_out),
            i32(_KINDS[None if param_out is None else param_out.dtype]), np.int64(param.numel()), f32(grad_scale),
            i32((not decoupled) and weight_decay != 0.0), f32(1.0 - lr * weight_decay) if decoupled else f32(1.0),
            f32(weight_decay), f32(lerp_w if small else lerp_w - 1.0), i32(small), f32(beta2), f32(1.0 - beta2),
            f32(bc2_sqrt), f32(eps), f32(neg_step_size))
    _launch("adam_kernel", param, args)


def sgd(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None,
        param_out: torch.Tensor | None, *, first_step: bool, nesterov: bool, lr: float, momentum: float,
        dampening: float, weight_decay: float, grad_scale: float) -> None:
    if param.numel() == 0:
        return
    f32, i32 = np.float32, np.int32
    buf = momentum_buffer if momentum != 0.0 else None
    args = (_ptr(param), _ptr(grad), i32(_KINDS[grad.dtype]), _ptr(buf), _ptr(param_out),
            i32(_KINDS[None if param_out is None else param_out.dtype]), np.int64(param.numel()), f32(grad_scale),
            i32(weight_decay != 0.0), f32(weight_decay), i32(buf is not None), i32(first_step), i32(nesterov),
            f32(momentum), f32(1.0 - dampening), f32(-lr))
    _launch("sgd_kernel", param, args)
