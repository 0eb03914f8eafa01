"""torch.optim.Optimizer subclasses on the fused kernels of luwu_rt.kernels.

Drop-in for torch.optim.AdamW / Adam / SGD: same constructor arguments, same
param-group keys and same per-parameter state (``step``, ``exp_avg``,
``exp_avg_sq``; ``momentum_buffer``), so a state_dict moves between these and
torch's classes in either direction. Options the fused kernels do not
implement (amsgrad, maximize, capturable, differentiable, foreach/fused
variants) are refused at construction rather than silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

import luwu_rt.kernels as K

__all__ = ["SGD", "Adam", "AdamW"]

# Accepted only at their torch defaults (they exist so torch's state_dicts load).
_UNSUPPORTED_DEFAULTS = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False,
                         "foreach": None, "fused": None}


def _refuse_unsupported(options: dict[str, Any]) -> None:
    for name, default in _UNSUPPORTED_DEFAULTS.items():
        if name in options and options[name] not in (default, False):
            raise ValueError(f"{name}={options[name]!r} is not supported by the fused kernels; leave it at {default!r}")


def _check_param(p: torch.Tensor) -> None:
    if p.grad.is_sparse:
        raise ValueError("sparse gradients are not supported by the fused kernels")



def _run_closure(closure: Callable[[], float] | None) -> float | None:
    """torch.optim's closure protocol: re-evaluate the loss with grad enabled."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()

class Adam(torch.optim.Optimizer):
    """torch.optim.Adam on the fused kernels (L2 weight decay unless
    ``decoupled_weight_decay``). ``backend`` selects the kernel backend
    (see luwu_rt.kernels); ``step(grad_scale=s)`` multiplies every gradient by
    s inside the kernel (loss-scale removal and clipping in one factor)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False, backend: str = "auto") -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad,
                    "maximize": maximize, "foreach": foreach, "capturable": capturable,
                    "differentiable": differentiable, "fused": fused,
                    "decoupled_weight_decay": decoupled_weight_decay}
        _refuse_unsupported(defaults)
        K._checks.check_adam_hparams(step=1, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                                     weight_decay=weight_decay, grad_scale=1.0)
        self.backend = backend
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *, grad_scale: float = 1.0) -> float | None:
        loss = _run_closure(closure)
        for group in self.param_groups:
            _refuse_unsupported(group)
            fn = K.adamw_step if group.get("decoupled_weight_decay", False) else K.adam_step
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check_param(p)
                state = self.state[p]
                if len(state) == 0:
                    # Same layout as torch: a float32 CPU scalar step and fp32 moments like p.
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                fn(p, p.grad, state["exp_avg"], state["exp_avg_sq"], step=int(state["step"].item()),
                   lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=group["eps"],
                   weight_decay=group["weight_decay"], grad_scale=grad_scale, backend=self.backend)
        return loss


class AdamW(Adam):
    """torch.optim.AdamW (decoupled weight decay, default 0.01) on the fused kernels."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, backend: str = "auto") -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, backend=backend)


class SGD(torch.optim.Optimizer):
    """torch.optim.SGD (momentum, dampening, Nesterov, weight decay) on the fused kernels."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None,
                 backend: str = "auto") -> None:
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay,
                    "nesterov": nesterov, "maximize": maximize, "foreach": foreach,
                    "differentiable": differentiable, "fused": fused}
        _refuse_unsupported(defaults)
        K._checks.check_sgd_hparams(step=1, lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
                                    weight_decay=weight_decay, grad_scale=1.0)
        self.backend = backend
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *, grad_scale: float = 1.0) -> float | None:
        loss = _run_closure(closure)
        for group in self.param_groups:
            _refuse_unsupported(group)
            momentum = float(group["momentum"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check_param(p)
                # Like torch, keep no state at all without momentum.
                state = self.state[p] if momentum != 0.0 else {}
                buf = state.get("momentum_buffer")
                # torch creates the buffer (as a copy of the gradient) on its first use;
                # step=1 tells the kernel to initialise it the same way.
                first = buf is None
                if momentum != 0.0 and first:
                    buf = state["momentum_buffer"] = torch.empty_like(p, memory_format=torch.preserve_format)
                K.sgd_step(p, p.grad, buf if momentum != 0.0 else None, step=1 if first else 2,
                           lr=float(group["lr"]), momentum=momentum, dampening=float(group["dampening"]),
                           nesterov=bool(group["nesterov"]), weight_decay=float(group["weight_decay"]),
                           grad_scale=grad_scale, backend=self.backend)
        return loss
