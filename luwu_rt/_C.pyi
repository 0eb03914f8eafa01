"""Type stub for the native module luwu_rt._C (csrc/bindings.cpp)."""

# ---- IO engine (csrc/io/) ----

# ---- optimizer kernels (csrc/optim/) ----
# Tensors are passed as data pointers (tensor.data_ptr()); luwu_rt.kernels checks
# them first. All functions release the GIL.

import enum

class OptimDType(enum.Enum):
    NONE = 0
    F32 = 1
    BF16 = 2
    F16 = 3

class OptimIsa(enum.Enum):
    SCALAR = 0
    AVX2 = 1
    AVX512 = 2

class AdamDecay(enum.Enum):
    DECOUPLED = 0
    L2 = 1

def optim_best_isa() -> OptimIsa: ...
def optim_isa_supported(isa: OptimIsa) -> bool: ...
def optim_set_spin_micros(micros: int) -> None: ...
def optim_adam_step(*, param: int, grad: int, exp_avg: int, exp_avg_sq: int, param_out: int, numel: int,
                    grad_type: OptimDType, out_type: OptimDType, decay: AdamDecay, step: int, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float,
                    num_threads: int, isa: OptimIsa) -> None: ...
def optim_sgd_step(*, param: int, grad: int, momentum_buffer: int, param_out: int, numel: int,
                   grad_type: OptimDType, out_type: OptimDType, first_step: bool, nesterov: bool, lr: float,
                   momentum: float, dampening: float, weight_decay: float, grad_scale: float, num_threads: int,
                   isa: OptimIsa) -> None: ...
def optim_traffic_probe(*, param: int, grad: int, exp_avg: int, exp_avg_sq: int, param_out: int, numel: int,
                        grad_type: OptimDType, out_type: OptimDType, num_threads: int, isa: OptimIsa) -> None: ...
