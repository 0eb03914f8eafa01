"""Throughput of the optimizer step: our backends, the peers, and the memory
ceiling, measured side by side in interleaved rounds.

Used by ``luwu bench optim`` and benchmarks/bench_optim.py. Every contestant
updates ``numel`` fp32 parameters per call; results are M params/s. The
"probe" moves the same bytes as the fused step (reads p, g, m, v; writes
p, m, v and the copy-out) with no arithmetic: the physical limit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from luwu_rt.plan.dtypes import DTYPE_NAMES, LOW_PRECISION
from luwu_rt.kernels.dtypes import torch_dtype

__all__ = ["Contestant", "OptimBench", "OptimBenchConfig", "RoundResults", "run_rounds"]

_HP = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


@dataclass(kw_only=True, slots=True)
class OptimBenchConfig:
    """What to measure."""

    numel: int = 64 * 1024 * 1024
    """Parameters updated per call (one flat chunk)."""
    grad_dtype: str = "fp32"
    """Gradient dtype of our kernels: fp32, bf16 or fp16 (peers always take fp32 gradients)."""
    param_out: str | None = None
    """bf16/fp16 copy-out of the updated parameters, fused in ours, a separate cast after the peers."""
    device: str = "cpu"
    """Device of the tensors: cpu, or cuda for the GPU backends."""
    num_rounds: int = 5
    """Interleaved rounds; a ratio is the median of its per-round ratios."""
    num_reps: int = 3
    """Timed calls per contestant per round (the round keeps their median)."""

    def __post_init__(self) -> None:
        if self.numel < 1:
            raise ValueError(f"numel must be >= 1, got {self.numel}")
        if self.grad_dtype not in DTYPE_NAMES:
            raise ValueError(f"grad_dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.grad_dtype!r}")
        if self.param_out not in (None, *LOW_PRECISION):
            raise ValueError(f"param_out must be {', '.join(LOW_PRECISION)} or None, got {self.param_out!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda requested but torch sees no CUDA device")
        if self.num_rounds < 1 or self.num_reps < 1:
            raise ValueError("num_rounds and num_reps must be >= 1")


@dataclass(slots=True)
class Contestant:
    name: str
    fn: Callable[[], None]


@dataclass(slots=True)
class RoundResults:
    """Per-round M params/s of every contestant, and the ones that could not run."""

    mparams_per_s: dict[str, list[float]] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.mparams_per_s[name])

    def ratio(self, ours: str, peer: str) -> float:
        """Median over rounds of ours/peer measured in the same round."""
        pairs = zip(self.mparams_per_s[ours], self.mparams_per_s[peer])
        return statistics.median(a / b for a, b in pairs)


class OptimBench:
    """Owns one set of tensors and builds the contestants on it.

    Ours and the peers share the parameter and gradient memory (the peers'
    torch.nn.Parameter views), so every contestant streams the same arrays;
    each peer keeps its own optimizer state, as it would in use.
    """

    def __init__(self, config: OptimBenchConfig) -> None:
        self.config = config
        n, dev = config.numel, torch.device(config.device)
        gen = torch.Generator().manual_seed(0)
        self.param = torch.randn(n, generator=gen).to(dev)
        self.grad32 = (torch.randn(n, generator=gen) * 1e-2).to(dev)
        self.grad = self.grad32.to(torch_dtype(config.grad_dtype))
        self.exp_avg = torch.zeros(n, device=dev)
        self.exp_avg_sq = torch.zeros(n, device=dev)
        self.out = None if config.param_out is None else torch.empty(n, dtype=torch_dtype(config.param_out), device=dev)
        self._step = 0
        self._unavailable: dict[str, str] = {}

    def _sync(self) -> None:
        if self.config.device == "cuda":
            torch.cuda.synchronize()

    def _ours(self, backend: str) -> Callable[[], None]:
        import luwu_rt.kernels as K

        def fn() -> None:
            self._step += 1
            K.adamw_step(self.param, self.grad, self.exp_avg, self.exp_avg_sq, step=self._step, lr=_HP["lr"],
                         weight_decay=_HP["weight_decay"], param_out=self.out, backend=backend)
        return fn

    def _ours_chunked(self, backend: str, chunk_numel: int) -> Callable[[], None]:
        """The same step as chunk-sized calls, as the tiered store makes them:
        measures what the per-call overhead costs. The views are made once."""
        import luwu_rt.kernels as K

        def views(t: torch.Tensor | None) -> list:
            return [None] * len(range(0, self.config.numel, chunk_numel)) if t is None else list(t.split(chunk_numel))
        chunks = list(zip(*(views(t) for t in (self.param, self.grad, self.exp_avg, self.exp_avg_sq, self.out))))

        def fn() -> None:
            self._step += 1
            for p, g, m, v, out in chunks:
                K.adamw_step(p, g, m, v, step=self._step, lr=_HP["lr"], weight_decay=_HP["weight_decay"],
                             param_out=out, backend=backend)
        return fn

    def _peer(self, name: str) -> Callable[[], None] | None:
        p = torch.nn.Parameter(self.param)  # a view of the same memory
        p.grad = self.grad32
        if name == "torch-fused":
            opt = torch.optim.AdamW([p], fused=True, **_HP)
        elif name == "torch-foreach":
            opt = torch.optim.AdamW([p], foreach=True, **_HP)
        else:
            try:
                from deepspeed.ops.adam import DeepSpeedCPUAdam
            except Exception as exc:  # ImportError, or its op failing to build
                self._unavailable[name] = f"deepspeed not usable ({type(exc).__name__}: {exc}); pip install deepspeed"
                return None
            if self.config.device != "cpu":
                self._unavailable[name] = "DeepSpeedCPUAdam runs on CPU tensors only"
                return None
            opt = DeepSpeedCPUAdam([p], adamw_mode=True, **_HP)
        out = self.out

        def fn() -> None:
            opt.step()
            if out is not None:
                out.copy_(self.param)  # the peers have no fused copy-out: a separate cast pass
        return fn

    def _probe(self) -> Callable[[], None]:
        if self.config.device == "cpu":
            from luwu_rt.kernels import _cpp

            # Its own arrays: the probe scrambles what it touches.
            t = [x.clone() for x in (self.param, self.grad, self.exp_avg, self.exp_avg_sq)]
            out = None if self.out is None else self.out.clone()
            return lambda: _cpp.traffic_probe(t[0], t[1], t[2], t[3], out)
        # On a GPU: one device copy moving the same bytes (read half, write half).
        nbytes = self.config.numel * (16 + self.grad.element_size() - 4 + (0 if self.out is None else 2) + 12) // 2
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.config.device)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)

    def contestants(self, names: list[str]) -> list[Contestant]:
        """Builds the named contestants: "probe", backend names (and "<backend>-1MiB-chunks":
        the step as 1 MiB calls), "torch-fused", "torch-foreach", "deepspeed";
        unusable ones are recorded with a reason."""
        import luwu_rt.kernels as K

        status = K.available()
        built = []
        for name in names:
            if name == "probe":
                fn = self._probe()
            elif name.endswith("-1MiB-chunks"):
                fn = self._ours_chunked(name.removesuffix("-1MiB-chunks"), 1 << 18)
            elif name in status:
                reason = status[name]
                module = K._load(name) if reason is None else None
                if module is not None and (self.config.device not in module.DEVICES
                                           or getattr(module, "SIMULATOR", False)):
                    reason = f"runs on {sorted(module.DEVICES)} tensors, not {self.config.device}"
                if reason is not None:
                    self._unavailable[name] = reason
                    continue
                fn = self._ours(name)
            else:
                fn = self._peer(name)
                if fn is None:
                    continue
            built.append(Contestant(name, fn))
        return built

    def run(self, contestants: list[Contestant], *, log: Callable[[str], None] | None = None) -> RoundResults:
        results = run_rounds(contestants, numel=self.config.numel, num_rounds=self.config.num_rounds,
                             num_reps=self.config.num_reps, sync=self._sync, log=log)
        results.unavailable.update(self._unavailable)
        return results


def run_rounds(contestants: list[Contestant], *, numel: int, num_rounds: int, num_reps: int,
               sync: Callable[[], None], log: Callable[[str], None] | None = None) -> RoundResults:
    """Each round times every contestant in turn (order rotated per round, so
    none always runs right after the same neighbour); one untimed warm-up call each first."""
    results = RoundResults({c.name: [] for c in contestants})
    for c in contestants:
        c.fn()
    sync()
    for r in range(num_rounds):
        k = r % max(1, len(contestants))
        for c in contestants[k:] + contestants[:k]:
            times = []
            for _ in range(num_reps):
                t0 = time.perf_counter()
                c.fn()
                sync()
                times.append(time.perf_counter() - t0)
            results.mparams_per_s[c.name].append(numel / statistics.median(times) / 1e6)
        if log is not None:
            log(f"round {r + 1}/{num_rounds}: " + ", ".join(
                f"{name} {v[-1]:.0f}" for name, v in results.mparams_per_s.items()))
    return results
