"""Reference backend: torch.optim's single-tensor steps, op for op.

It is the definition the fused backends are tested against, and the fallback
for any device. It allocates temporaries and makes one pass per op, which is
exactly what the fused kernels avoid.
"""

from __future__ import annotations

import torch

from luwu_rt.kernels._checks import adam_scalars

DEVICES = frozenset({"cpu", "cuda"})


def unavailable_reason() -> str | None:
    return None


def _scaled_grad(grad: torch.Tensor, grad_scale: float) -> torch.Tensor:
    return grad.to(torch.float32) * grad_scale


def adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
         param_out: torch.Tensor | None, *, decoupled: bool, step: int, lr: float, beta1: float, beta2: float,
         eps: float, weight_decay: float, grad_scale: float) -> None:
    g = _scaled_grad(grad, grad_scale)
    if weight_decay != 0.0:
        if decoupled:
            param.mul_(1.0 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    neg_step_size, bias_correction2_sqrt = adam_scalars(step=step, lr=lr, beta1=beta1, beta2=beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=neg_step_size)
    if param_out is not None:
        param_out.copy_(param)


def sgd(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None,
        param_out: torch.Tensor | None, *, first_step: bool, nesterov: bool, lr: float, momentum: float,
        dampening: float, weight_decay: float, grad_scale: float) -> None:
    g = _scaled_grad(grad, grad_scale)
    if weight_decay != 0.0:
        g = g.add(param, alpha=weight_decay)
    if momentum != 0.0:
        assert momentum_buffer is not None
        if first_step:
            momentum_buffer.copy_(g)
        else:
            momentum_buffer.mul_(momentum).add_(g, alpha=1.0 - dampening)
        g = g.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    param.add_(g, alpha=-lr)
    if param_out is not None:
        param_out.copy_(param)
