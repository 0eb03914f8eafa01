"""P1 and P2 (benchmarks/README.md): the fused AdamW step against the memory-traffic
probe, DeepSpeedCPUAdam and torch's fused AdamW, in interleaved rounds; with
``--device cuda``, P8: the CuPy and Numba CUDA kernels against the device's
memory bandwidth (a device copy moving the same bytes) and torch's fused AdamW
on the GPU.

    python benchmarks/bench_optim.py [--device cpu|cuda] [--numel N] [--rounds R] [--out results.md]

Every ratio is the median over rounds of (ours / peer) measured in the same
round. Peers missing from the environment are reported as such; our own
figures are still measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import statistics
import sys

import torch
from report import cpu_model, emit  # benchmarks/report.py

from luwu_rt.kernels.bench import OptimBench, OptimBenchConfig, RoundResults

# (ours, peer, target ratio or None for an informative ratio) per figure; benchmarks/README.md's targets.
# P1: both peers already run near the memory limit, so fp32 is a tie at the limit (P2 is where fewer bytes win).
P1_TARGETS = [("cpp", "probe", 0.9), ("cpp", "deepspeed", 0.95), ("cpp", "torch-fused", 0.95),
              ("cpp-1MiB-chunks", "cpp", None)]  # no target: what chunk-sized calls cost
P2_TARGETS = [("cpp", "deepspeed", 1.3)]
P8_TARGETS = [("cupy", "probe", 0.9), ("numba-cuda", "probe", 0.9), ("cupy", "torch-fused", None),
              ("numba-cuda", "torch-fused", None), ("cupy-1MiB-chunks", "cupy", None)]
P8_LOW_TARGETS = [("cupy", "probe", 0.9), ("numba-cuda", "probe", 0.9), ("cupy", "torch-fused", None)]


def _gpu() -> str:
    props = torch.cuda.get_device_properties(0)
    return (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs, CUDA "
            f"{torch.version.cuda}")


def _machine() -> str:
    import os

    import luwu_rt.kernels._cpp as cpp

    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        import importlib.metadata

        deepspeed = f"deepspeed {importlib.metadata.version('deepspeed')}"
    except importlib.metadata.PackageNotFoundError:
        deepspeed = "deepspeed not installed"
    return (f"{cpu_model()}, {os.cpu_count()} CPUs, {mem_gib:.0f} GiB, {torch.get_num_threads()} threads, kernels ISA "
            f"{cpp.best_isa()}, torch {torch.__version__}, {deepspeed}, Python {platform.python_version()}; "
            f"load average at start {os.getloadavg()[0]:.1f}")


def _measure(config: OptimBenchConfig, names: list[str]) -> RoundResults:
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs on stdout
        bench = OptimBench(config)
        return bench.run(bench.contestants(names), log=lambda line: print(line, file=sys.stderr))


def _section(title: str, results: RoundResults, targets: list[tuple[str, str, float | None]]) -> list[str]:
    lines = [f"### {title}", "", "| contestant | M params/s per round | median |", "|---|---|---|"]
    for name, values in results.mparams_per_s.items():
        lines.append(f"| {name} | {', '.join(f'{v:.0f}' for v in values)} | {statistics.median(values):.0f} |")
    for name, reason in results.unavailable.items():
        lines.append(f"| {name} | unavailable: {reason} | |")
    lines += ["", "| ratio (median of per-round ratios) | measured | target | met |", "|---|---|---|---|"]
    for ours, peer, target in targets:
        missing = [name for name in (ours, peer) if name not in results.mparams_per_s]
        if missing:  # e.g. CuPy not installed on a GPU machine: the row says so, the others still count
            lines.append(f"| {ours} / {peer} | {' and '.join(missing)} unavailable | "
                         f"{'(none)' if target is None else f'>= {target}'} | n/a |")
            continue
        ratio = results.ratio(ours, peer)
        if target is None:
            lines.append(f"| {ours} / {peer} | {ratio:.3f} | (none) | n/a |")
        else:
            lines.append(f"| {ours} / {peer} | {ratio:.3f} | >= {target} | {'yes' if ratio >= target else 'NO'} |")
    return lines + [""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu: P1/P2 against the CPU peers; cuda: P8, the GPU kernels against the device's "
                             "memory bandwidth")
    parser.add_argument("--numel", type=int, default=None, help="parameters per step (default 64M; 256M on cuda)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    numel = args.numel or (256 if cuda else 64) * 1024 * 1024
    if cuda:
        first = _measure(OptimBenchConfig(numel=numel, num_rounds=args.rounds, device="cuda"),
                         ["probe", "cupy", "cupy-1MiB-chunks", "numba-cuda", "torch-fused"])
        second = _measure(OptimBenchConfig(numel=numel, grad_dtype="bf16", param_out="bf16", num_rounds=args.rounds,
                                           device="cuda"), ["probe", "cupy", "numba-cuda", "torch-fused"])
        title, machine = "P8: GPU AdamW kernels", f"{_gpu()}; host {_machine()}"
        sections = [*_section("P8: fp32 AdamW on the GPU (fp32 grads, no copy-out)", first, P8_TARGETS),
                    *_section("P8, low precision: bf16 grads in + bf16 param copy-out (torch: fp32 step + a "
                              "separate bf16 cast)", second, P8_LOW_TARGETS)]
    else:
        first = _measure(OptimBenchConfig(numel=numel, num_rounds=args.rounds),
                         ["probe", "cpp", "cpp-1MiB-chunks", "numba", "torch-fused", "torch-foreach", "deepspeed"])
        second = _measure(OptimBenchConfig(numel=numel, grad_dtype="bf16", param_out="bf16", num_rounds=args.rounds),
                          ["probe", "cpp", "numba", "torch-fused", "deepspeed"])
        title, machine = "P1 / P2", _machine()
        sections = [*_section("P1: fp32 AdamW (fp32 grads, no copy-out)", first, P1_TARGETS),
                    *_section("P2: bf16 grads in + bf16 param copy-out (peers: fp32 step + separate bf16 cast)",
                              second, P2_TARGETS)]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Fused AdamW step: {title} ({now})", "",
             f"Machine: {machine}.", "",
             f"{numel} fp32 parameters per step, {args.rounds} interleaved rounds (order rotated per round), "
             "each contestant timed 3 times per round (median kept). Command: "
             f"`python benchmarks/bench_optim.py --device {args.device} --numel {numel} --rounds {args.rounds}`.", "",
             *sections]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
