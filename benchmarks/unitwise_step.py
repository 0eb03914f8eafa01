"""Cost of the unit-wise step against a plain autograd step on the same model (benchmarks/README.md).

The execution model recomputes every unit's forward in backward so that a
unit's parameters are resident only during its F and B. This measures what
that costs in compute, in memory, with nothing offloaded: the ratio is the
floor that any out-of-core step built on the unit-wise step starts from (no
target of its own; it explains part of P5).

    python benchmarks/unitwise_step.py [--model gpt-small] [--batch-size 8] [--seq-len 256] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from report import emit  # benchmarks/report.py

from luwu_rt.engine.unitwise import UnitwiseConfig, unitwise_step
from luwu_rt.models.gpt import build_gpt


def _plain(chain, inputs, targets) -> None:
    loss = chain.model(inputs, targets)
    loss.backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast for both")
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    args = parser.parse_args()

    chain = build_gpt(args.model, device="cpu", seed=0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, chain.shape.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    dtype = torch.bfloat16 if args.bf16 else None

    def plain() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            _plain(chain, inputs, targets)
        chain.model.zero_grad(set_to_none=True)

    def recompute() -> None:
        unitwise_step(chain, inputs, targets, config=UnitwiseConfig(autocast_dtype=dtype))
        chain.model.zero_grad(set_to_none=True)

    variants = {"plain autograd": plain, "unit-wise, recompute all": recompute}
    keep_all = frozenset(range(chain.num_units))
    if "keep_graph" in UnitwiseConfig.__dataclass_fields__:
        def keep() -> None:
            unitwise_step(chain, inputs, targets, config=UnitwiseConfig(autocast_dtype=dtype, keep_graph=keep_all))
            chain.model.zero_grad(set_to_none=True)
        variants["unit-wise, keep graphs"] = keep

    load_before = os.getloadavg()[0]
    # Interleave the variants' repeats so drift (thermal, neighbours) hits all alike.
    results: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up: allocator, autocast caches, lazy init
    for _ in range(args.repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            results[name].append(time.perf_counter() - start)

    base = statistics.median(results["plain autograd"])
    base_min = min(results["plain autograd"])
    tokens_per_step = args.batch_size * args.seq_len
    lines = [(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
              f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
              f"load average before/after {load_before:.2f}/{os.getloadavg()[0]:.2f}"), "",
             (f"model {args.model} ({chain.num_params / 1e6:.1f}M params), "
              f"batch {args.batch_size} x seq {args.seq_len}, "
              f"{'bf16 autocast' if dtype else 'fp32'}, median of {args.repeats}"), "",
             # The box may be shared: the min is the least disturbed run, so its ratio is printed too.
             "| variant | step s (median) | min | max | tokens/s (median) | ratio vs plain (median) | ratio (min) |",
             "|---|---|---|---|---|---|---|"]
    for name, times in results.items():
        med = statistics.median(times)
        lines.append(f"| {name} | {med:.3f} | {min(times):.3f} | {max(times):.3f} | {tokens_per_step / med:,.0f} | "
                     f"{med / base:.2f}x | {min(times) / base_min:.2f}x |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
