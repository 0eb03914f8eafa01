"""Type stub for the native module luwu_rt._C (csrc/bindings.cpp)."""

# ---- IO engine (csrc/io/) ----
# Wrapped by luwu_rt.io (validation, tickets, OSError with the path); call that instead.

from collections.abc import Callable
import enum

class IOOp(enum.Enum):
    READ = 0
    WRITE = 1

class IOEngine:
    def __init__(
        self, *, backend: str, queue_depth: int, block_bytes: int, num_threads: int, num_cached_files: int
    ) -> None:
        """backend: "io_uring" or "threads". Raises OSError when io_uring cannot be set up."""
    @property
    def backend(self) -> str: ...
    def submit(
        self, *, op: IOOp, path: str, fd: int, buf: int, offset: int, nbytes: int, durable: bool
    ) -> int:
        """Ticket > 0; OSError(errno, message) when the file cannot be opened. fd >= 0 overrides path."""
    def wait(self, ticket: int) -> tuple[int, str]:
        """(0, "") on success, (errno, message) on failure, (-1, ...) for an unknown ticket."""
    def done(self, ticket: int) -> bool: ...
    def num_pending(self) -> int: ...
    def forget(self, path: str) -> None:
        """Drops cached descriptors of path ("" drops all)."""
    def close(self) -> None: ...

class AlignedBuffer:
    """Page-aligned anonymous memory exporting the buffer protocol (uint8, 1-D)."""
    def __init__(self, nbytes: int, *, lock: bool, huge_pages: bool) -> None: ...
    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def locked(self) -> bool: ...
    def set_release_hook(self, hook: Callable[[], object]) -> None:
        """Called just before the memory is unmapped."""
    def __buffer__(self, flags: int) -> memoryview: ...


# ---- optimizer kernels (csrc/optim/) ----
# Tensors are passed as data pointers (tensor.data_ptr()); luwu_rt.kernels checks
# them first. All functions release the GIL.


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

# ---- checksums (csrc/store/) ----
def crc32c(data: object, value: int = 0) -> int:
    """CRC-32C of a C-contiguous buffer, continuing from ``value``. Releases the GIL."""
