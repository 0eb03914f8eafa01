"""Fused optimizer steps on flat, contiguous chunks: one API, several backends.

``adamw_step``, ``adam_step`` and ``sgd_step`` update ``param`` and the states
in place with torch.optim's semantics, folding gradient unscaling
(``grad_scale``), weight decay and an optional bf16/fp16 copy of the updated
parameter (``param_out``) into the same pass over memory.

Backends: ``cpp`` (AVX-512/AVX2/scalar chosen at run time, multithreaded),
``numba`` (CPU, parallel), ``numba-cuda``, ``cupy`` (GPU) and ``torch`` (the
reference). ``backend="auto"`` takes the fastest one available for the
tensors' device; ``available()`` says which are usable and why not.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from luwu_rt.kernels import _checks

__all__ = ["BACKENDS", "adam_step", "adamw_step", "available", "resolve_backend", "sgd_step"]

# Backend name -> implementing module, in order of preference for "auto".
BACKENDS: dict[str, str] = {
    "cpp": "luwu_rt.kernels._cpp",
    "cupy": "luwu_rt.kernels._cupy",
    "numba": "luwu_rt.kernels._numba_cpu",
    "numba-cuda": "luwu_rt.kernels._numba_cuda",
    "torch": "luwu_rt.kernels._torch",
}

_loaded: dict[str, ModuleType | str] = {}  # module, or why it is unavailable
_auto: dict[str, ModuleType] = {}  # device type -> module chosen by "auto"


def _load(name: str) -> ModuleType | str:
    found = _loaded.get(name)
    if found is None:
        try:
            module = importlib.import_module(BACKENDS[name])
            reason = module.unavailable_reason()
        except ImportError as exc:
            reason = f"cannot import {BACKENDS[name]}: {exc}"
        found = reason if reason else module
        _loaded[name] = found
    return found


def available() -> dict[str, str | None]:
    """Every backend mapped to None when usable, else the reason it is not."""
    return {name: (None if isinstance(m, ModuleType) else m) for name, m in ((n, _load(n)) for n in BACKENDS)}


def resolve_backend(backend: str, device: torch.device) -> ModuleType:
    """The module that runs ``backend`` for tensors on ``device``."""
    kind = device.type
    if backend == "auto":
        module = _auto.get(kind)
        if module is None:
            for name in BACKENDS:
                candidate = _load(name)
                # The CUDA simulator serves CPU tensors but is for tests, never for "auto".
                if (isinstance(candidate, ModuleType) and kind in candidate.DEVICES
                        and not getattr(candidate, "SIMULATOR", False)):
                    module = candidate
                    break
            assert module is not None, "the torch backend serves every device"
            _auto[kind] = module
        return module
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    module = _load(backend)
    if not isinstance(module, ModuleType):
        raise ValueError(f"backend {backend!r} is unavailable: {module}")
    if kind not in module.DEVICES:
        raise ValueError(f"backend {backend!r} runs on {sorted(module.DEVICES)} tensors, but param is on {device}")
    return module


def _adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
          decoupled: bool, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
          grad_scale: float, param_out: torch.Tensor | None, backend: str) -> None:
    _checks.check_adam_tensors(param, grad, exp_avg, exp_avg_sq, param_out)
    _checks.check_adam_hparams(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                               grad_scale=grad_scale)
    resolve_backend(backend, param.device).adam(
        param, grad, exp_avg, exp_avg_sq, param_out, decoupled=decoupled, step=int(step), lr=float(lr),
        beta1=float(beta1), beta2=float(beta2), eps=float(eps), weight_decay=float(weight_decay),
        grad_scale=float(grad_scale))


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
               weight_decay: float = 0.0, grad_scale: float = 1.0, param_out: torch.Tensor | None = None,
               backend: str = "auto") -> None:
    """One torch.optim.AdamW step (decoupled weight decay), in place.

    ``param``, ``exp_avg``, ``exp_avg_sq``: float32, contiguous, same shape and
    device; ``grad``: float32, bfloat16 or float16, multiplied by ``grad_scale``
    first; ``step``: the step count including this one (1 on the first step);
    ``param_out``: optional float32/bfloat16/float16 tensor that receives the
    updated parameter, rounded to nearest even exactly like ``param.to(dtype)``.
    """
    _adam(param, grad, exp_avg, exp_avg_sq, decoupled=True, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
          weight_decay=weight_decay, grad_scale=grad_scale, param_out=param_out, backend=backend)


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
              step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
              weight_decay: float = 0.0, grad_scale: float = 1.0, param_out: torch.Tensor | None = None,
              backend: str = "auto") -> None:
    """One torch.optim.Adam step (L2 weight decay added to the gradient), in
    place; arguments as in :func:`adamw_step`."""
    _adam(param, grad, exp_avg, exp_avg_sq, decoupled=False, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
          weight_decay=weight_decay, grad_scale=grad_scale, param_out=param_out, backend=backend)


def sgd_step(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None = None, *, step: int,
             lr: float, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
             weight_decay: float = 0.0, grad_scale: float = 1.0, param_out: torch.Tensor | None = None,
             backend: str = "auto") -> None:
    """One torch.optim.SGD step, in place.

    ``momentum_buffer`` (float32, like ``param``) is required when ``momentum``
    is non-zero; on ``step == 1`` it is set to the gradient, as torch does
    when it creates the buffer. Other arguments as in :func:`adamw_step`.
    """
    _checks.check_sgd_tensors(param, grad, momentum_buffer, param_out, momentum=momentum)
    _checks.check_sgd_hparams(step=step, lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
                              weight_decay=weight_decay, grad_scale=grad_scale)
    resolve_backend(backend, param.device).sgd(
        param, grad, momentum_buffer, param_out, first_step=step == 1, nesterov=bool(nesterov), lr=float(lr),
        momentum=float(momentum), dampening=float(dampening), weight_decay=float(weight_decay),
        grad_scale=float(grad_scale))
