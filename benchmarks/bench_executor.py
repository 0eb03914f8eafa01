"""Issue 21 item 5 (benchmarks/README.md): the executor's cost per op, on a plan of many small ops.

A step of a real model spends milliseconds in each op, so what the executor adds per op (issuing on a queue
thread, waiting on dependencies' events, recording its own, timing it) hides there; a plan of many small
ops shows it. The plan is the planner's for a chain of ``--units`` small units with parameters, optimizer
state and gradients on the host tier and a device budget of a few units, so it holds every op kind of a
local step (loads, stores, frees, forward and backward, gradient norms, updates). Its handlers do no work
(a collective's completes at once);
its moves copy their few KiB.

Contestants, interleaved in every round:

- ``direct``: the same ops' work called in plan order by one thread, with no executor: the floor;
- ``serial``: ``Executor.run(overlap=False)``: each op issued and synchronised before the next;
- ``overlap``: ``Executor.run()``, the way a step runs.

Reported: wall time per run, ops/s, and the executor's overhead per op, (run - direct) / ops, each the
median over rounds.

    python benchmarks/bench_executor.py [--units 256] [--unit-params 4096] [--rounds 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch

from report import cpu_model, emit  # benchmarks/report.py


def _plan(units: int, unit_params: int):
    from luwu_rt.plan import Budgets, ModelSpec, Placement, UnitSpec, plan_step
    from luwu_rt.plan.spec import ALIGN_BYTES  # a chunk is whole O_DIRECT blocks

    unit_bytes = unit_params * 4
    model = ModelSpec(units=tuple(UnitSpec(name=f"u{i}", num_params=unit_params) for i in range(units)),
                      param_bytes=4, grad_bytes=4, chunk_bytes=-(-unit_bytes // ALIGN_BYTES) * ALIGN_BYTES)
    return plan_step(model, budgets=Budgets(device_bytes=8 * 2 * unit_bytes, host_bytes=64 * units * unit_bytes),
                     placement=Placement(params="host", optimizer="host", grads="host"))


def _store(plan):
    from luwu_rt.store import Arena, TieredStore

    return TieredStore(plan, arenas={t: Arena(n, tier=t) for t, n in plan.arena_bytes.items()}, nvme=None)


def _direct(plan, store, handlers) -> None:
    """The plan's work in plan order, no executor."""
    from luwu_rt.plan.ops import Free, Load, Store, Wait

    view = store.view
    for op in plan.ops:
        if isinstance(op, (Load, Store)):
            view(op.outputs[0]).copy_(view(op.inputs[0]))
        elif not isinstance(op, (Free, Wait)):
            views = {a.shard: view(a) for a in op.inputs}
            views.update({a.shard: view(a) for a in op.outputs})
            handlers[op.kind](op, views)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=256)
    parser.add_argument("--unit-params", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    args = parser.parse_args()

    from luwu_rt.exec import Executor
    from luwu_rt.exec.executor import DONE

    torch.set_num_threads(1)
    plan = _plan(args.units, args.unit_params)
    store = _store(plan)
    kinds = {op.kind for op in plan.ops}
    handlers = {k: (lambda op, views: DONE) for k in kinds - {"Load", "Store", "Free", "Wait"}}
    ops = len(plan.ops)
    walls: dict[str, list[float]] = {"direct": [], "serial": [], "overlap": []}
    with Executor(plan, store=store, handlers=handlers, chaos=None) as ex:
        runs = {"direct": lambda: _direct(plan, store, handlers), "serial": lambda: ex.run(overlap=False),
                "overlap": lambda: ex.run()}
        for fn in runs.values():  # warm-up: queue threads started, first-touch of the arenas
            fn()
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                start = time.perf_counter()
                runs[name]()
                walls[name].append(time.perf_counter() - start)

    med = {name: statistics.median(w) for name, w in walls.items()}
    by_kind: dict[str, int] = {}
    for op in plan.ops:
        by_kind[op.kind] = by_kind.get(op.kind, 0) + 1
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Executor cost per op: issue 21 item 5 ({now})", "",
             f"Machine: {cpu_model()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
             f"Python {platform.python_version()}; load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}.",
             "", f"Command: `python benchmarks/bench_executor.py --units {args.units} --unit-params {args.unit_params} "
             f"--rounds {args.rounds}`", "",
             f"Plan: {args.units} units of {args.unit_params} fp32 params, everything on the host tier, {ops} ops "
             f"({', '.join(f'{k} {n}' for k, n in sorted(by_kind.items()))}) on {len(ex._by_queue)} queues; "
             f"handlers do nothing, moves copy {args.unit_params * 4 // 1024} KiB each. Median of {args.rounds} "
             "interleaved rounds.", "",
             "| contestant | wall ms per run | ops/s | overhead us per op (vs direct) |", "|---|---|---|---|"]
    for name in walls:
        over = (med[name] - med["direct"]) / ops * 1e6
        lines.append(f"| {name} | {med[name] * 1e3:.2f} | {ops / med[name]:,.0f} | "
                     f"{'-' if name == 'direct' else f'{over:.1f}'} |")
    lines += ["", f"overlap / direct: {med['overlap'] / med['direct']:.2f}x; "
                  f"serial / direct: {med['serial'] / med['direct']:.2f}x"]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
