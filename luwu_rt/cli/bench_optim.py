"""`luwu bench optim`: every available optimizer backend and the peers, side by
side with the memory-traffic probe, in M params/s."""

from __future__ import annotations

import argparse
import json

from luwu_rt.plan.dtypes import DTYPE_NAMES, LOW_PRECISION

__all__ = ["add_arguments", "run"]

BACKEND_NAMES = ["cpp", "numba", "numba-cuda", "cupy", "torch"]
PEER_NAMES = ["torch-fused", "torch-foreach", "deepspeed"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--numel", type=int, default=64 * 1024 * 1024, help="parameters per step (default 64Mi)")
    parser.add_argument("--grad-dtype", choices=tuple(DTYPE_NAMES), default="fp32",
                        help="gradient dtype of our kernels (peers take fp32)")
    parser.add_argument("--param-out", choices=LOW_PRECISION, default=None,
                        help="also write a low-precision copy of the parameters (a separate cast for peers)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the tensors live: cpu, or cuda for the GPU backends (default cpu)")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="threads for torch, numba and our kernels (DeepSpeed follows OMP_NUM_THREADS)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--no-torch-ref", action="store_true", help="skip the slow torch reference backend")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    import contextlib
    import sys

    import torch

    from luwu_rt.kernels.bench import OptimBench, OptimBenchConfig

    if args.num_threads is not None:
        if args.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {args.num_threads}")
        import numba

        torch.set_num_threads(args.num_threads)
        numba.set_num_threads(min(args.num_threads, numba.config.NUMBA_NUM_THREADS))
    config = OptimBenchConfig(numel=args.numel, grad_dtype=args.grad_dtype, param_out=args.param_out,
                              device=args.device, num_rounds=args.rounds)
    backends = [b for b in BACKEND_NAMES if not (args.no_torch_ref and b == "torch")]
    # Peers log to stdout (DeepSpeed does, from its import on); keep stdout for our output.
    with contextlib.redirect_stdout(sys.stderr):
        bench = OptimBench(config)
        contestants = bench.contestants(["probe", *backends, *PEER_NAMES])
        results = bench.run(contestants, log=None if args.json else (lambda line: print(line, file=sys.stderr)))
    probe = results.median("probe")
    rows = [{"name": c.name, "mparams_per_s": round(results.median(c.name), 1),
             "ratio_to_probe": round(results.ratio(c.name, "probe"), 3)} for c in contestants if c.name != "probe"]
    if args.json:
        print(json.dumps({"numel": config.numel, "grad_dtype": config.grad_dtype, "param_out": config.param_out,
                          "device": config.device, "num_threads": torch.get_num_threads(),
                          "probe_mparams_per_s": round(probe, 1), "results": rows,
                          "unavailable": results.unavailable}, indent=2))
        return 0
    print(f"AdamW step, {config.numel} params, grads {config.grad_dtype}, copy-out {config.param_out or 'none'}, "
          f"{config.device}, {torch.get_num_threads()} threads, median of {config.num_rounds} rounds")
    print(f"{'probe (memory ceiling)':<24}{probe:>10.0f} M params/s")
    for row in rows:
        print(f"{row['name']:<24}{row['mparams_per_s']:>10.0f} M params/s  {row['ratio_to_probe']:>6.2f} x probe")
    for name, reason in results.unavailable.items():
        print(f"{name:<24}unavailable: {reason}")
    return 0
