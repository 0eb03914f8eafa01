"""P7's clipping clause (benchmarks/README.md; issue 21 item 3): how often exact clipping redoes a step, what the
redos cost, and the step with clipping on beside the clipping-off step.

Each contestant trains the same model from the same seed on the same batches (by
default ``luwu train``'s run: gpt-tiny, the embedded standard-library corpus, 300
steps) with its optimizer state forced onto NVMe, so that a clipping run is
double-buffered and may update speculatively ([Note: when to speculate] in
luwu_rt/exec/speculate.py); ``--optimizer host`` forces it into host memory
instead, where nothing is double-buffered and every clipping contestant waits for
the norm (its plan column says why): what exact clipping costs there.

- ``clip off``: no clipping, so nothing waits for the norm: the baseline step;
- ``wait``: clipping 1.0, every update waits for the step's norm (``never``);
- ``adaptive``: clipping 1.0, the default: speculate unless the step before was clipped;
- ``always``: clipping 1.0, speculate every step (each clipped step is redone).

Per contestant: the step times, how the steps ended (``SpeculativeRuns.counts``:
committed, redone, skipped, waited), the cost of the redos (the seconds the redone
steps took beyond as many committed steps of the median) and the final loss; per
clipping contestant the ratio of its median step to the clipping-off one, over
all steps and over its committed steps only (target: <= 1.05x when no redo
happens). Step 1 of each engine is its warm-up: counted, not timed. Within a
round the contestants' engines are all alive and take turns every ``--interleave``
steps (the last step's tail of write-backs drained, untimed, before the next
turn), so that the drift of a shared machine hits all of them alike; with several
rounds each trains from scratch again, the order rotated, and each ratio is the
median of the rounds' ratios. wait, adaptive and always are all exact ``clip_grad_norm_``
+ AdamW: their losses must be the same at every step, or the script exits 1.

    python benchmarks/bench_speculate.py [--steps 300] [--rounds 1] [--interleave 10] [--optimizer nvme|host]
        [--nvme-dir DIR] --out FILE
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from report import cpu_model, emit  # benchmarks/report.py

from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig

TARGET = 1.05
"""P7: the clipping-on step <= 1.05x the clipping-off step when no redo happens."""
CONTESTANTS = {"clip off": (0.0, None), "wait": (1.0, "never"), "adaptive": (1.0, "adaptive"),
               "always": (1.0, "always")}
"""Name: (grad_clip, speculation; ``None`` where no norm is waited for)."""
EXACT = ("wait", "adaptive", "always")
"""Contestants that must agree bit for bit: each is exact clipping."""
ENDS = ("commit", "redo", "skip", "wait")


@dataclass(kw_only=True, slots=True)
class Run:
    """One contestant's run of a round."""

    name: str
    plan: str
    """How its updates ran: speculative (double-buffered), in place, or why not double-buffered."""
    placement: str
    times: list[float] = field(default_factory=list)
    """Wall seconds of each ``train_step``, step 1 included."""
    ends: list[str] = field(default_factory=list)
    """How each step ended (a key of ``SpeculativeRuns.counts``; without a double buffer "wait" where the updates
    waited for the norm, "" where they had none to wait for)."""
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def timed(self, end: str | None = None) -> list[float]:
        """Step times after the warm-up step, of the steps that ended so (all of them for ``None``)."""
        return [t for t, e in zip(self.times[1:], self.ends[1:]) if end is None or e == end]

    def median(self, end: str | None = None) -> float:
        times = self.timed(end)
        return statistics.median(times) if times else float("nan")

    def redo_cost(self, fallback: float) -> float:
        """Seconds the timed redone steps took beyond as many committed steps of the median (``fallback``, clip
        off's median step, where no timed step committed)."""
        base = self.median("commit")
        base = fallback if base != base else base
        return sum(t - base for t in self.timed("redo"))


def _config(args: argparse.Namespace, *, clip: float, nvme_dir: str) -> TrainConfig:
    offload = {"optimizer": args.optimizer, "nvme_dir": nvme_dir, "device_mem": args.device_mem,
               "host_mem": args.host_mem}
    return from_mapping(TrainConfig, {"model": args.model, "steps": args.steps, "batch_size": args.batch_size,
                                      "seq_len": args.seq_len, "seed": args.seed, "optim": {"grad_clip": clip},
                                      "offload": offload})


def _start(name: str, args: argparse.Namespace, scratch: Path) -> tuple[Engine, Run]:
    """A contestant's engine, built from scratch, and its empty record."""
    clip, mode = CONTESTANTS[name]
    engine = Engine(None, _config(args, clip=clip, nvme_dir=str(scratch / name.replace(" ", "-"))))
    if engine.speculation is not None:
        engine.speculation.step.speculation = mode
    plan = ("double-buffered" if engine.speculation is not None else "in place (no norm to wait for)"
            if mode is None else f"waits: {engine.why_updates_wait}")
    p = engine.placement
    engine.sampler()  # reads the corpus: not a step's time
    return engine, Run(name=name, plan=plan, placement=f"params {p.params}, optimizer {p.optimizer}, grads {p.grads}")


def _steps(engine: Engine, run: Run, count: int) -> None:
    """``count`` timed steps of ``engine`` on the configured (default) data, recorded in ``run``."""
    spec = engine.speculation
    for _ in range(count):
        start = time.perf_counter()
        m = engine.train_step()
        run.times.append(time.perf_counter() - start)
        run.ends.append(spec.last if spec is not None else "wait" if engine.why_updates_wait else "")
        run.losses.append(m["loss"])
        run.norms.append(m["grad_norm"])
    # The last step's tail of write-backs ([Note: steady state]) must not run on beside the next contestant's
    # turn: it ends here, untimed.
    engine.queues.drain()
    run.counts = dict(spec.counts) if spec is not None else {"wait": run.ends.count("wait")} if run.ends[-1] else {}


def _round(names: list[str], args: argparse.Namespace, scratch: Path) -> dict[str, Run]:
    """Every contestant trains from scratch for ``args.steps`` steps, taking turns every ``args.interleave`` steps
    (0: all of its steps in one turn), in the order of ``names``."""
    started: dict[str, tuple[Engine, Run]] = {}
    try:
        for name in names:
            started[name] = _start(name, args, scratch)
        turn = args.interleave or args.steps
        for done in range(0, args.steps, turn):
            for engine, run in started.values():
                _steps(engine, run, min(turn, args.steps - done))
    finally:
        for engine, _ in started.values():
            engine.close()
    return {name: run for name, (_, run) in started.items()}


def _warm_up(args: argparse.Namespace, scratch: Path) -> None:
    """A few untimed steps in this process first: thread pools, allocator caches, the corpus's page cache."""
    if args.warmup:
        _round(["always"], argparse.Namespace(**{**vars(args), "steps": args.warmup}), scratch / "warm-up")


def _fmt(x: float, digits: int = 3, unit: str = "") -> str:
    return "n/a" if x != x else f"{x:.{digits}f}{unit}"


def _mismatch(runs: dict[str, Run]) -> str | None:
    """Where the exact contestants' losses first differ, or ``None``."""
    ref = runs[EXACT[0]]
    for name in EXACT[1:]:
        for step, (a, b) in enumerate(zip(ref.losses, runs[name].losses), start=1):
            if a != b:
                return f"{name} differs from {ref.name} at step {step}: loss {b!r} vs {a!r}"
    return None


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                          cwd=Path(__file__).parent)
    return done.stdout.strip() or "unknown"


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def _ratio_lines(rounds: list[dict[str, Run]]) -> list[str]:
    """Each clipping contestant beside clip off: the median over rounds of each round's ratio."""
    lines = ["| contestant | median step / clip off | committed steps' median / clip off | total time / clip off "
             "| target (<= 1.05x, no redo) |", "|---|---|---|---|---|"]
    for name in EXACT:
        base = [r["clip off"] for r in rounds]
        all_steps = statistics.median(r[name].median() / b.median() for r, b in zip(rounds, base))
        total = statistics.median(sum(r[name].timed()) / sum(b.timed()) for r, b in zip(rounds, base))
        no_redo = [r[name].median("commit" if name != "wait" else "wait") / b.median() for r, b in zip(rounds, base)]
        committed = statistics.median(no_redo)
        verdict = ("reference: every update waits" if name == "wait" else "n/a (no committed step)"
                   if committed != committed else "met" if committed <= TARGET else "missed")
        lines.append(f"| {name} | {all_steps:.3f}x | {_fmt(committed, unit='x')}"
                     f"{' (waited steps)' if name == 'wait' else ''} | {total:.3f}x | {verdict} |")
    return lines


def _header(args: argparse.Namespace, rounds: list[dict[str, Run]], *, load_before: str, wall_s: float) -> list[str]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    clipped = sum(1 for n in rounds[0]["wait"].norms if n > 1.0)
    placements = "; ".join(sorted({r.placement for runs in rounds for r in runs.values()}))
    return [f"# Exact clipping with speculative updates: redo rate and cost ({now})", "",
            f"Machine: {cpu_model()}, {os.cpu_count()} cpus, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, Python {platform.python_version()}; load average {load_before} before, "
            f"{_load()} after; {wall_s:.0f} s in all. Commit {_commit()}.", "",
            f"Command: `python benchmarks/bench_speculate.py {' '.join(sys.argv[1:])}`", "",
            f"Run: {args.model}, batch {args.batch_size} x {args.seq_len} tokens, seed {args.seed}, {args.steps} "
            f"steps from scratch per contestant on the default corpus (`luwu train`'s), optimizer state forced onto "
            f"{'NVMe' if args.optimizer == 'nvme' else 'host memory'} ({placements}); "
            f"budgets device {args.device_mem}, host {args.host_mem}; {args.rounds} round(s), "
            f"the contestants taking turns every {args.interleave or args.steps} steps. "
            f"Step 1 of each engine is its warm-up: counted, not timed. The norm exceeds the clip threshold 1.0 in "
            f"{clipped} of {args.steps} steps.", ""]


def _table(rounds: list[dict[str, Run]]) -> list[str]:
    lines = ["| round | contestant | plan | median step s | mean step s | committed | redone | skipped | waited "
             "| median committed s | median redone s | median waited s | redo cost s | step 1 s | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, runs in enumerate(rounds, start=1):
        for name in CONTESTANTS:
            r = runs[name]
            counts = " | ".join(str(r.counts.get(e, "-")) for e in ENDS)
            cost = r.redo_cost(runs["clip off"].median())
            lines.append(f"| {i} | {name} | {r.plan} | {_fmt(r.median())} | {_fmt(statistics.fmean(r.timed()))} "
                         f"| {counts} | {_fmt(r.median('commit'))} | {_fmt(r.median('redo'))} "
                         f"| {_fmt(r.median('wait'))} | {_fmt(cost, 2)} | {_fmt(r.times[0])} | {r.losses[-1]:.4f} |")
    return lines


def _redo_lines(args: argparse.Namespace, rounds: list[dict[str, Run]]) -> list[str]:
    """How often each speculating contestant redid a step, and what the redos cost."""
    lines = []
    for name in ("adaptive", "always"):
        r = rounds[0][name]
        if r.plan != "double-buffered":
            lines.append(f"{name}: not double-buffered, every step waited ({r.plan}).")
            continue
        costs = [x[name].redo_cost(x["clip off"].median()) for x in rounds]
        timed = len(r.timed("redo"))
        per = statistics.median(c / max(len(x[name].timed("redo")), 1) for c, x in zip(costs, rounds))
        base = r.median("commit") if r.timed("commit") else rounds[0]["clip off"].median()
        lines.append(f"{name}: {r.counts['redo']} redo(s) in {args.steps} steps ({r.counts['redo'] - timed} in the "
                     f"untimed step 1), {r.counts['wait']} step(s) waited; the {timed} timed redo(s) cost "
                     f"{statistics.median(costs):.2f} s, {per:.3f} s each ({per / base:.2f}x a committed step).")
    return lines


def report(args: argparse.Namespace, rounds: list[dict[str, Run]], *, load_before: str, wall_s: float,
           mismatch: str | None) -> list[str]:
    lines = _header(args, rounds, load_before=load_before, wall_s=wall_s) + _table(rounds)
    lines += ["", "Redo cost: the seconds the timed redone steps took beyond as many committed steps of the median "
              "(clip off's median step where none committed; committed: the speculative run's norm needed no "
              "clipping). Ratios: the median over rounds of each round's ratio to clip off; the target applies where "
              "no redo happens, so to the committed steps' median (for wait, to its steps, all waited).", ""]
    lines += _ratio_lines(rounds) + [""] + _redo_lines(args, rounds)
    lines += ["", f"Exactness: {mismatch}." if mismatch else
              f"Exactness: wait, adaptive and always gave the same loss at every one of the {args.steps} steps "
              f"in every round (bit for bit).", ""]
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per contestant per round (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--batch-size", type=int, default=TrainConfig.__dataclass_fields__["batch_size"].default)
    parser.add_argument("--seq-len", type=int, default=TrainConfig.__dataclass_fields__["seq_len"].default)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device-mem", default="auto")
    parser.add_argument("--host-mem", default="auto")
    parser.add_argument("--interleave", type=int, default=10,
                        help="steps a contestant runs before the next takes its turn, all engines alive (0: all of "
                             "its steps in one turn; default %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of a throwaway engine first")
    parser.add_argument("--optimizer", choices=("nvme", "host"), default="nvme",
                        help="where the optimizer state is forced (default %(default)s: double-buffered under "
                             "clipping; host: every clipping contestant waits for the norm)")
    parser.add_argument("--nvme-dir", default=None, help="scratch directory for the NVMe tier (default: a temp dir)")
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.rounds < 1:
        parser.error("--steps must be >= 2 (step 1 is the warm-up) and --rounds >= 1")
    if args.optimizer == "host" and args.host_mem == "auto":
        parser.error("--optimizer host needs a --host-mem that holds the optimizer state (auto is luwu train's "
                     "budget, which keeps a small model out of core): e.g. --host-mem 1GiB")
    return args


def main() -> int:
    args = parse_args()
    load_before, start = _load(), time.perf_counter()
    if args.nvme_dir:
        os.makedirs(args.nvme_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="luwu-speculate-", dir=args.nvme_dir) as scratch:
        _warm_up(args, Path(scratch))
        rounds = []
        names = list(CONTESTANTS)
        for i in range(args.rounds):
            order = names[i % len(names):] + names[:i % len(names)]  # rotated: drift hits all alike
            runs = _round(order, args, Path(scratch) / f"round-{i}")
            for name, r in runs.items():
                print(f"round {i + 1} {name}: median {_fmt(r.median())} s, {r.counts or r.plan}", file=sys.stderr,
                      flush=True)
            rounds.append(runs)
    mismatch = next(filter(None, map(_mismatch, rounds)), None)
    emit(report(args, rounds, load_before=load_before, wall_s=time.perf_counter() - start, mismatch=mismatch),
         args.out)
    if mismatch:
        print(f"error: exact clipping is not exact: {mismatch}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
