"""`luwu bench offload-step`: one real AdamW step with master weights and moments on NVMe.

The step runs through a plan (planner -> validator -> executor) over N
parameters whose optimizer state lives on NVMe and whose bf16 parameters and
fp32 gradients live in host memory (an optimizer-only plan: the gradients wait at
home as after a backward pass). Beside the measured step time it prints
the IO lower bound: the time the same IO engine takes, in the same run, to read
and write the same number of bytes to the same disk at once with nothing else to
do (no optimizer, no checksums, no dependencies). The disk serves reads and
writes concurrently, so neither their sum nor the longer of the two alone is the
bound; measuring the mixed transfer is. Then the planner's prediction from
profile figures measured in the same run. Target P4 (benchmarks/README.md): step time <= 1.05 x the IO lower bound.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

__all__ = ["add_arguments", "run"]


def _parse_count(text: str) -> int:
    """``"256M"`` -> 256_000_000; plain integers and K/M/G/B suffixes (powers of 1000)."""
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}
    t = text.strip().lower()
    suffix = t[-1] if t and t[-1].isalpha() else ""
    try:
        value = float(t[: len(t) - len(suffix)]) * scale[suffix]
    except (KeyError, ValueError):
        raise ValueError(f"cannot read parameter count {text!r}: write e.g. 64M, 1.5G or 1000000") from None
    if value < 1:
        raise ValueError(f"parameter count must be >= 1, got {text!r}")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="64M", help="parameters to update, e.g. 256M or 1.5G (default 64M)")
    parser.add_argument("--host-mem", default="1GiB", help="pinned host memory budget for staging (default 1GiB)")
    parser.add_argument("--nvme-dir", required=True,
                        help="directory on the disk that holds the optimizer state; created if missing, and then "
                             "removed at exit")
    parser.add_argument("--unit-params", default="16M", help="parameters per unit (default 16M)")
    parser.add_argument("--chunk-size", default="16MiB", help="storage chunk size, a multiple of 4KiB (default 16MiB)")
    parser.add_argument("--steps", type=int, default=3, help="steps to run; the median is reported (default 3)")
    parser.add_argument("--block-kb", type=int, default=1024, help="IO piece size in KiB (default 1024)")
    parser.add_argument("--queue-depth", type=int, default=None,
                        help="IO pieces in flight per direction (default: the IO engine's, luwu_rt.io.QUEUE_DEPTH)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="write the last step's spans as Chrome trace JSON")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _model_spec(num_params: int, unit_params: int, chunk_bytes: int):
    from luwu_rt.plan import ModelSpec, UnitSpec

    sizes = [unit_params] * (num_params // unit_params)
    if num_params % unit_params:
        sizes.append(num_params % unit_params)
    return ModelSpec(units=tuple(UnitSpec(name=f"u{i}", num_params=n) for i, n in enumerate(sizes)),
                     param_bytes=2, grad_bytes=4, chunk_bytes=chunk_bytes, optimizer_only=True)


def _measure_profile(directory: str, *, state_bytes: int, block_bytes: int, queue_depth: int):
    """Disk, copy and optimizer speeds of this machine, measured now; the disk's ``nvme_overlap`` from the same
    bytes read and written at once ([Note: one disk] in plan/cost.py)."""
    import torch

    from luwu_rt.cli.bench_io import measure
    from luwu_rt.cli.probes import disk_overlap, mixed_io_seconds
    from luwu_rt.kernels import adamw_step
    from luwu_rt.plan import HardwareProfile

    size = min(state_bytes, 1 << 30) // 4096 * 4096 or 4096
    disk = measure(directory, size_bytes=size, block_bytes=block_bytes, queue_depth=queue_depth)
    both_s = mixed_io_seconds(directory, read_bytes=size, write_bytes=size, block_bytes=block_bytes,
                              queue_depth=queue_depth)
    overlap = disk_overlap(size / (disk.read_gbps * 1e9), size / (disk.write_gbps * 1e9), both_s)
    a, b = torch.empty(32 << 20, dtype=torch.uint8), torch.ones(32 << 20, dtype=torch.uint8)
    start = time.perf_counter()
    a.copy_(b)
    copy_gbps = a.numel() / (time.perf_counter() - start) / 1e9
    n = 4 << 20
    p, g, m, v = (torch.rand(n) for _ in range(4))
    adamw_step(p, g, m, v, step=1, lr=1e-3)  # warm-up: thread pool, page faults
    start = time.perf_counter()
    adamw_step(p, g, m, v, step=2, lr=1e-3)
    optim_rate = n / (time.perf_counter() - start)
    return disk, HardwareProfile(nvme_read_gbps=disk.read_gbps, nvme_write_gbps=disk.write_gbps,
                                 nvme_overlap=overlap, h2d_gbps=copy_gbps, d2h_gbps=copy_gbps,
                                 host_optim_params_per_s=optim_rate)


def _host_too_small(model, budgets, placement, args: argparse.Namespace) -> str:
    """The planner's does-not-fit, in this command's terms: its placement is fixed (params and grads on
    the host, optimizer state on NVMe), so the remedies are its own flags, with the smallest --host-mem
    that plans: found and planned with by ``fitting_budgets`` ([Note: suggesting budgets] in plan/search.py)."""
    from luwu_rt.plan import Strategy, flag_size, plan_step
    from luwu_rt.plan.planner import lower_bounds
    from luwu_rt.plan.search import fitting_budgets

    fits = fitting_budgets(budgets, bounds=lower_bounds(model, placement=placement, strategy=Strategy()),
                           plan=lambda b: plan_step(model, budgets=b, placement=placement))
    advice = f"pass --host-mem {flag_size(fits.host_bytes)} or more, or " if fits is not None else ""
    return (f"--host-mem {args.host_mem} is too small for {args.params} params: the host holds every unit's bf16 "
            f"params and fp32 grads plus the optimizer state of the units being updated; {advice}fewer --params "
            f"or a smaller --unit-params")


def run(args: argparse.Namespace) -> int:
    from luwu_rt.cli.dirs import created_dir
    from luwu_rt.io import QUEUE_DEPTH
    from luwu_rt.plan import Budgets, Placement, parse_size, plan_step, validate

    args.queue_depth = QUEUE_DEPTH if args.queue_depth is None else args.queue_depth
    num_params, unit_params = _parse_count(args.params), _parse_count(args.unit_params)
    chunk_bytes = parse_size(args.chunk_size)
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    model = _model_spec(num_params, min(unit_params, num_params), chunk_bytes)
    # Optimizer-only plan: gradients wait at their home (host) as after a backward pass.
    budgets = Budgets(device_bytes=0, host_bytes=parse_size(args.host_mem))
    placement = Placement(params="host", optimizer="nvme", grads="host")
    try:
        plan = plan_step(model, budgets=budgets, placement=placement)
    except ValueError:
        raise ValueError(_host_too_small(model, budgets, placement, args)) from None
    validate(plan)
    # As luwu train treats --nvme-dir ([Note: missing directories]); made only once the plan is known to fit.
    with created_dir(args.nvme_dir, flag="--nvme-dir"):
        return _measure(args, model=model, plan=plan, num_params=num_params, chunk_bytes=chunk_bytes)


def _measure(args: argparse.Namespace, *, model, plan, num_params: int, chunk_bytes: int) -> int:
    """Runs the plan's steps over a fresh NVMe tier in ``--nvme-dir`` and prints them beside the IO bound."""
    import torch

    from luwu_rt.cli.probes import mixed_io_seconds
    from luwu_rt.exec import AdamWHandler, Executor, write_chrome_trace
    from luwu_rt.io import IOEngine
    from luwu_rt.plan import estimate
    from luwu_rt.store import Arena, NvmeTier, TieredStore, nvme_regions

    workdir = tempfile.mkdtemp(prefix="luwu-offload-", dir=args.nvme_dir)
    try:
        disk, profile = _measure_profile(workdir, state_bytes=12 * num_params, block_bytes=args.block_kb << 10,
                                         queue_depth=args.queue_depth)
        cost = estimate(plan, profile, steady=True)
        with IOEngine(block_bytes=args.block_kb << 10, queue_depth=args.queue_depth) as engine:
            nvme = NvmeTier(workdir, regions=nvme_regions(plan), chunk_bytes=chunk_bytes, engine=engine)
            arenas = {t: Arena(n, tier=t) for t, n in plan.arena_bytes.items()}
            handler = AdamWHandler(plan.shards, param_dtype=torch.bfloat16, grad_dtype=torch.float32)

            store = TieredStore(plan, arenas=arenas, nvme=nvme)
            ex = Executor(plan, store=store, handlers={"OptimStep": handler})
            for u, unit in enumerate(model.units):
                master = torch.linspace(-1, 1, unit.num_params)
                store.write_state(u, "master", master)
                store.write_state(u, "param", master.to(torch.bfloat16))
                store.write_state(u, "grad", torch.full((unit.num_params,), 1e-3 * (u + 1)))
                for state in ("exp_avg", "exp_avg_sq"):
                    store.write_state(u, state, torch.zeros(unit.num_params))
            # Steps as training runs them: each beside the previous one's tail of write-backs ([Note: steady
            # state] in plan/steady.py). A step's time is from its start to its return, when all but its tail is
            # done; the first starts cold, the others beside a tail: their median is the step in steady state.
            times = []
            for step in range(1, args.steps + 1):
                handler.step = step
                start = time.perf_counter()
                spans = ex.run(pipeline=True)
                times.append(time.perf_counter() - start)
            ex.queues.drain()
            # The same plan with every op run one after another: what the overlap buys.
            handler.step = args.steps + 1
            start = time.perf_counter()
            ex.run(overlap=False)
            serial_s = time.perf_counter() - start
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.trace:
        write_chrome_trace(spans, args.trace)

    nvme_io = cost.io_bytes["nvme"]
    io_bound_s = mixed_io_seconds(args.nvme_dir, read_bytes=nvme_io["read"], write_bytes=nvme_io["write"],
                                 block_bytes=args.block_kb << 10, queue_depth=args.queue_depth)
    step_s = statistics.median(times[1:] or times)  # in steady state: the first step starts cold
    result = {
        "params": num_params, "units": len(model.units), "chunk_bytes": chunk_bytes,
        "step_s": step_s, "step_times_s": times, "io_bound_s": io_bound_s, "predicted_s": cost.predicted_step_s,
        "serial_step_s": serial_s,
        "ratio_to_io_bound": step_s / io_bound_s if io_bound_s else None,
        "nvme_read_bytes": nvme_io["read"], "nvme_write_bytes": nvme_io["write"],
        "disk_read_gbps": disk.read_gbps, "disk_write_gbps": disk.write_gbps,
        "optim_params_per_s": profile.host_optim_params_per_s, "bottleneck": cost.bottleneck,
        "io_backend": disk.backend,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{num_params / 1e6:.0f}M params in {len(model.units)} units, optimizer state on NVMe ({disk.backend})")
        print(f"disk: read {disk.read_gbps:.2f} GB/s, write {disk.write_gbps:.2f} GB/s; "
              f"moved {nvme_io['read'] / 1e9:.2f} GB in, {nvme_io['write'] / 1e9:.2f} GB out per step "
              f"(raw, at once: {io_bound_s:.3f} s)")
        print(f"step {step_s:.3f} s (median of {max(len(times) - 1, 1)} in steady state; the first, cold: "
              f"{times[0]:.3f} s), IO lower bound {io_bound_s:.3f} s "
              f"-> {result['ratio_to_io_bound']:.2f}x; planner predicted {cost.predicted_step_s:.3f} s "
              f"(bottleneck {cost.bottleneck}); the same plan serialised: {serial_s:.3f} s")
    return 0
