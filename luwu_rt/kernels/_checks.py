"""Argument checks shared by every backend, and the scalars of a step.

Each check raises ValueError naming the argument and the fix, so a caller that
hands in a wrong chunk learns which tensor is wrong before any memory is touched.
"""

from __future__ import annotations

import math

import torch

from luwu_rt.kernels.dtypes import COMPUTE_DTYPES, LOW_PRECISION_DTYPES

GRAD_DTYPES = tuple(COMPUTE_DTYPES.values())
OUT_DTYPES = (torch.float32, *LOW_PRECISION_DTYPES)
"""An fp32 copy-out is the compute copy of fp32 training, written in the update's pass over memory."""


def _check_tensor(name: str, t: object, param: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {allowed}")
    if t.device != param.device:
        raise ValueError(f"{name} is on {t.device} but param is on {param.device}; move it to {param.device}")
    if t.shape != param.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but param has shape {tuple(param.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass {name}.contiguous() (the kernels run on flat memory)")


def check_param(param: object) -> torch.Tensor:
    if not isinstance(param, torch.Tensor):
        raise ValueError(f"param must be a torch.Tensor, got {type(param).__name__}")
    if param.dtype != torch.float32:
        raise ValueError(f"param has dtype {param.dtype}; the master parameters must be float32")
    if not param.is_contiguous():
        raise ValueError("param is not contiguous; pass param.contiguous() (the kernels run on flat memory)")
    return param


def check_adam_tensors(param: object, grad: object, exp_avg: object, exp_avg_sq: object,
                       param_out: object) -> None:
    p = check_param(param)
    _check_tensor("grad", grad, p, GRAD_DTYPES)
    _check_tensor("exp_avg", exp_avg, p, (torch.float32,))
    _check_tensor("exp_avg_sq", exp_avg_sq, p, (torch.float32,))
    if param_out is not None:
        _check_tensor("param_out", param_out, p, OUT_DTYPES)


def check_sgd_tensors(param: object, grad: object, momentum_buffer: object, param_out: object,
                      *, momentum: float) -> None:
    p = check_param(param)
    _check_tensor("grad", grad, p, GRAD_DTYPES)
    if momentum != 0.0:
        if momentum_buffer is None:
            raise ValueError("momentum_buffer is None but momentum != 0; pass a float32 buffer shaped like param")
        _check_tensor("momentum_buffer", momentum_buffer, p, (torch.float32,))
    if param_out is not None:
        _check_tensor("param_out", param_out, p, OUT_DTYPES)


def _finite(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_step_lr(step: int, lr: float) -> None:
    if isinstance(step, bool) or int(step) != step or step < 1:
        raise ValueError(f"step must be an integer >= 1 (the count including this step), got {step!r}")
    if _finite("lr", lr) < 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")


def check_adam_hparams(*, step: int, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, grad_scale: float) -> None:
    _check_step_lr(step, lr)
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= _finite(name, beta) < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}")
    if _finite("eps", eps) < 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if _finite("weight_decay", weight_decay) < 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    _finite("grad_scale", grad_scale)


def check_sgd_hparams(*, step: int, lr: float, momentum: float, dampening: float, nesterov: bool,
                      weight_decay: float, grad_scale: float) -> None:
    _check_step_lr(step, lr)
    if _finite("momentum", momentum) < 0.0:
        raise ValueError(f"momentum must be >= 0, got {momentum}")
    _finite("dampening", dampening)
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError("nesterov requires momentum > 0 and dampening == 0 (as in torch.optim.SGD)")
    if _finite("weight_decay", weight_decay) < 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    _finite("grad_scale", grad_scale)


def adam_scalars(*, step: int, lr: float, beta1: float, beta2: float) -> tuple[float, float]:
    """(-step_size, sqrt(bias_correction2)) formed in double exactly as torch.optim does."""
    bias_correction1 = 1.0 - beta1 ** float(step)
    bias_correction2 = 1.0 - beta2 ** float(step)
    return -(lr / bias_correction1), bias_correction2 ** 0.5
