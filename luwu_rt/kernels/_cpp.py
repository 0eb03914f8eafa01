"""C++ backend (csrc/optim/): AVX-512 / AVX2 / scalar kernels picked at run
time, on a persistent pinned thread pool, GIL released."""

from __future__ import annotations

import torch

DEVICES = frozenset({"cpu"})

try:
    from luwu_rt import _C
except ImportError as exc:  # a source tree without the built extension
    _C = None
    _IMPORT_ERROR = f"native module luwu_rt._C is not built ({exc}); run pip install -e ."
else:
    _IMPORT_ERROR = ""
    _DTYPES = {torch.float32: _C.OptimDType.F32, torch.bfloat16: _C.OptimDType.BF16,
               torch.float16: _C.OptimDType.F16}
    _ISAS = {"avx512": _C.OptimIsa.AVX512, "avx2": _C.OptimIsa.AVX2, "scalar": _C.OptimIsa.SCALAR}
    _BEST_ISA = _C.optim_best_isa()


def unavailable_reason() -> str | None:
    return _IMPORT_ERROR or None


def best_isa() -> str:
    """Name of the instruction set the kernels use on this CPU."""
    return _BEST_ISA.name.lower()


def supported_isas() -> list[str]:
    return [name for name, isa in _ISAS.items() if _C.optim_isa_supported(isa)]


def _isa(isa: str | None):
    if isa is None:
        return _BEST_ISA
    if isa not in _ISAS:
        raise ValueError(f"isa must be one of {sorted(_ISAS)}, got {isa!r}")
    return _ISAS[isa]


def _threads(num_threads: int | None) -> int:
    # Honour torch's setting so one knob sizes both torch's ops and ours.
    n = torch.get_num_threads() if num_threads is None else num_threads
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ValueError(f"num_threads must be an integer >= 1, got {num_threads!r}")
    return int(n)


def _out(param_out: torch.Tensor | None) -> tuple[int, object]:
    if param_out is None:
        return 0, _C.OptimDType.NONE
    return param_out.data_ptr(), _DTYPES[param_out.dtype]


def adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
         param_out: torch.Tensor | None, *, decoupled: bool, step: int, lr: float, beta1: float, beta2: float,
         eps: float, weight_decay: float, grad_scale: float, num_threads: int | None = None,
         isa: str | None = None) -> None:
    out_ptr, out_type = _out(param_out)
    _C.optim_adam_step(
        param=param.data_ptr(), grad=grad.data_ptr(), exp_avg=exp_avg.data_ptr(),
        exp_avg_sq=exp_avg_sq.data_ptr(), param_out=out_ptr, numel=param.numel(),
        grad_type=_DTYPES[grad.dtype], out_type=out_type,
        decay=_C.AdamDecay.DECOUPLED if decoupled else _C.AdamDecay.L2, step=int(step), lr=lr, beta1=beta1,
        beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
        num_threads=_threads(num_threads), isa=_isa(isa))


def sgd(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None,
        param_out: torch.Tensor | None, *, first_step: bool, nesterov: bool, lr: float, momentum: float,
        dampening: float, weight_decay: float, grad_scale: float, num_threads: int | None = None,
        isa: str | None = None) -> None:
    out_ptr, out_type = _out(param_out)
    _C.optim_sgd_step(
        param=param.data_ptr(), grad=grad.data_ptr(),
        momentum_buffer=0 if momentum_buffer is None else momentum_buffer.data_ptr(), param_out=out_ptr,
        numel=param.numel(), grad_type=_DTYPES[grad.dtype], out_type=out_type, first_step=first_step,
        nesterov=nesterov, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
        grad_scale=grad_scale, num_threads=_threads(num_threads), isa=_isa(isa))


def traffic_probe(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  param_out: torch.Tensor | None, *, num_threads: int | None = None) -> None:
    """Moves the bytes of one adam() call with no arithmetic (it scrambles the
    tensors' contents): the memory-bandwidth ceiling the kernels are measured against."""
    out_ptr, out_type = _out(param_out)
    _C.optim_traffic_probe(
        param=param.data_ptr(), grad=grad.data_ptr(), exp_avg=exp_avg.data_ptr(),
        exp_avg_sq=exp_avg_sq.data_ptr(), param_out=out_ptr, numel=param.numel(),
        grad_type=_DTYPES[grad.dtype], out_type=out_type, num_threads=_threads(num_threads), isa=_BEST_ISA)
