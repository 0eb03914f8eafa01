"""`luwu bench e2e`: training steps end to end, each configuration beside the planner's prediction for it.

Each configuration (model, strategy and ranks, placement, clipping) runs a few steps of ``luwu train`` as a
user runs it (a process of its own; ``--nproc`` ranks; strategy node with ``--spawn-node``), with
``--json-log`` and ``--trace``; ``luwu plan --json`` with the same flags and the same ``--profile`` predicts
its step. Reported per configuration: tokens/s, the step time and where it went, bytes moved per tier,
peak memory per tier, and the predicted step beside the measured one with the error in %.

[Note: where a step's time goes]
From the last step's trace (every rank's, the slowest rank's row): ``compute`` is the compute queue's busy
time; each instant the compute queue is idle within the step goes to the first of the other queues busy
then, in the order communication (gather, reduce, push, pull), IO (NVMe, copies between tiers), optimizer;
an instant when nothing runs is ``stall`` (the executor's own time, Python, waits on peers outside any op).
The five parts sum to the step. Bytes moved per tier are the executed moves' bytes, as the plan's
``io_bytes`` counts them; peak memory per tier is the plan's peak per tier (the arenas are allocated as
planned) beside the largest process's measured peak resident memory ([Note: a child's peak memory]).

[Note: a child's peak memory]
A child's ``ru_maxrss`` is no measure of it on Linux: a forked child starts with a copy of its parent's
address space, and ``execve`` keeps that copy's high-water mark in ``ru_maxrss``. Children of a process that
had 1.5 GB resident reported 1.5 GB after exec while their own image's peak (``VmHWM``) was 9 MB, so every
small contestant of the end-to-end report read as its parent's 1.9 GB. ``VmHWM`` counts the process's
current image only; ``peak_rss`` samples it over a process and its descendants while they run (every 0.2 s;
a high-water mark, so only growth in a process's last 0.2 s can be missed), and ours and the peers are
measured alike.

With ``--rounds R`` the configurations take turns R times (order rotated per round); a configuration's
figure is the median over rounds of its median step (steps after the first of each run).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Config", "Result", "add_arguments", "breakdown", "measure", "model_profiles", "predict", "read_trace",
           "result_of", "run",
           "run_config", "table"]

PLACEMENTS = {"device": ("device", "device", "device"), "host": ("host", "host", "host"),
              "nvme": ("nvme", "nvme", "host"), "auto": ("auto", "auto", "auto")}
"""Placement name -> (params, optimizer, grads). ``nvme``: parameters and optimizer state on NVMe, as
ZeRO-Infinity offloads them; gradients on the host."""
_COMM = ("gather", "reduce", "reduce_cross", "push", "pull")
_IO = ("nvme_read", "nvme_write", "h2d", "d2h")
_PARTS = ("compute", "communication", "io_wait", "optimizer", "stall")


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """One configuration of ``luwu train``."""

    model: str = "gpt-small"
    """Preset."""
    strategy: str = "local"
    """``local`` (one rank) or a data-parallel strategy; ``node`` with a spawned optimizer node."""
    nproc: int = 1
    """Ranks (workers for ``node``)."""
    placement: str = "host"
    """A key of ``PLACEMENTS``."""
    grad_clip: float = 1.0
    """0: clipping off, each unit's update overlapping the backward."""
    batch_size: int = 8
    """Sequences per rank."""
    seq_len: int = 256
    """Tokens per sequence."""
    dtype: str = "fp32"
    """Compute dtype."""
    steps: int = 4
    """Steps per run; the first is warm-up."""
    device_mem: str = "auto"
    """``--device-mem``."""
    host_mem: str = "auto"
    """``--host-mem``."""
    node_host_mem: str = "4GiB"
    """Strategy node: the optimizer node's ``--host-mem`` (a node started here, ``luwu node serve``)."""
    extra: tuple[str, ...] = ()
    """More ``luwu train`` flags (e.g. ``--keep-graphs none``)."""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement {self.placement!r}: choose one of {', '.join(PLACEMENTS)}")
        if self.strategy == "local" and self.nproc != 1:
            raise ValueError(f"strategy local runs one rank, not {self.nproc}")
        if self.steps < 2 or self.nproc < 1:
            raise ValueError(f"steps must be >= 2 (the first is warm-up) and nproc >= 1, "
                             f"got {self.steps}, {self.nproc}")

    @property
    def label(self) -> str:
        """What runs, batch included: a report may measure one configuration at two batches, and its trace file is
        named by the label."""
        ranks = f" x{self.nproc}" if self.nproc > 1 else ""
        clip = "clip" if self.grad_clip else "no-clip"
        return f"{self.model} {self.strategy}{ranks} {self.placement} {clip} {self.batch_size}x{self.seq_len}"

    def flags(self, *, nvme_dir: str) -> list[str]:
        """The flags ``luwu train`` and ``luwu plan`` share for this configuration."""
        params, optimizer, grads = PLACEMENTS[self.placement]
        return ["--model", self.model, "--batch-size", str(self.batch_size), "--seq-len", str(self.seq_len),
                "--dtype", self.dtype, "--grad-clip", str(self.grad_clip), "--strategy", self.strategy,
                "--offload-params", params, "--offload-optimizer", optimizer, "--offload-grads", grads,
                "--device-mem", self.device_mem, "--host-mem", self.host_mem, "--nvme-dir", nvme_dir, *self.extra]


@dataclass(kw_only=True, slots=True)
class Result:
    """One configuration measured (medians over rounds) and predicted."""

    config: Config
    step_s: float
    """Median step time, seconds."""
    step_s_rounds: list[float]
    """Each round's median step."""
    tokens_per_s: float
    """Tokens of all ranks per second."""
    loss: float
    """Loss of the last step (a check that every contestant trains the same thing)."""
    parts_s: dict[str, float]
    """[Note: where a step's time goes], the last step of the last round."""
    busy_s: dict[str, float]
    """Busy seconds per queue, that step."""
    moved_bytes: dict[str, dict[str, int]]
    """tier -> {"read", "write"} per step (the slowest rank's)."""
    peak_bytes: dict[str, int]
    """The plan's peak per tier."""
    peak_rss_bytes: int
    """The largest process's peak resident memory, any round."""
    predicted_step_s: float
    """``luwu plan``'s prediction (median over rounds)."""
    predicted_step_s_rounds: list[float]
    """Each round's prediction (on that round's profile)."""
    error: float
    """(predicted - measured) / measured: the median over rounds of that round's."""
    bottleneck: str
    """The plan's bottleneck."""
    placement: dict[str, str]
    """The plan's resolved placement."""
    profile: str
    """The profile the prediction used, as its first line says."""
    trace: str | None = None
    """The last round's trace file, when kept."""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        return {"label": self.config.label, "config": dataclasses.asdict(self.config), **out}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt-small", help="preset (default gpt-small)")
    parser.add_argument("--strategies", nargs="+", default=["local", "ddp", "zero3", "node"], metavar="S",
                        help="strategies to run; local on one rank, the others on --nproc (default local ddp zero3 "
                             "node)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the data-parallel strategies (default 2)")
    parser.add_argument("--placements", nargs="+", default=["host"], choices=tuple(PLACEMENTS), metavar="P",
                        help=f"state placements, each of {', '.join(PLACEMENTS)} (default host)")
    parser.add_argument("--grad-clip", type=float, nargs="+", default=[1.0], metavar="C",
                        help="clipping settings to run, 0 off (default 1.0)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank (default 8)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--steps", type=int, default=4, help="steps per run, the first warm-up (default 4)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1)")
    parser.add_argument("--device-mem", default="auto", help="device budget (default auto)")
    parser.add_argument("--host-mem", default="auto", help="host budget (default auto)")
    parser.add_argument("--nvme-dir", default=None, metavar="DIR",
                        help="NVMe tier directory (default: a scratch directory under the system temp directory)")
    parser.add_argument("--profile", default="auto", metavar="FILE|auto|builtin",
                        help="the profile the runs plan with and the predictions use (default auto: this machine's "
                             "calibration, else builtin)")
    parser.add_argument("--trace-dir", default=None, metavar="DIR", help="keep each configuration's trace here")
    parser.add_argument("--no-model-compute", dest="model_compute", action="store_false",
                        help="predict with the calibration's compute rate as it is, not remeasured on each model "
                             "(the rate of the model luwu calibrate measured)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _luwu(*args: str) -> list[str]:
    return [sys.executable, "-m", "luwu_rt", *args]


def predict(config: Config, *, profile: str, nvme_dir: str) -> dict[str, Any]:
    """``luwu plan --json`` of ``config`` on ``profile``."""
    extra = ["--node-host-mem", config.node_host_mem] if config.strategy == "node" else []
    out = subprocess.run(_luwu("plan", *config.flags(nvme_dir=nvme_dir), "--world-size", str(config.nproc),
                               "--profile", profile, *extra, "--json"), capture_output=True, text=True, check=False)
    if out.returncode not in (0, 1) or not out.stdout.strip():
        raise RuntimeError(f"luwu plan for {config.label} failed: {out.stderr.strip()[-2000:]}")
    planned = json.loads(out.stdout)
    if not planned["fits"]:
        raise ValueError(f"{config.label} does not fit: {planned['reason']}")
    return planned


def read_trace(path: str) -> list[list[dict]]:
    """The trace's complete events per process row (ranks first, then the node's rows)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    rows: dict[int, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X":
            rows.setdefault(e["pid"], []).append(e)
    return [rows[k] for k in sorted(rows)]


def breakdown(events: list[dict], *, step_s: float = 0.0) -> tuple[dict[str, float], dict[str, float]]:
    """[Note: where a step's time goes] of one rank's trace events, over ``[0, step_s]`` (the step's time from
    its log, whose start is the trace's zero) or the events' span if longer: (parts, busy per queue), seconds."""
    from luwu_rt.exec.trace import covered_s

    spans: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        # The previous step's tail runs on beside this step ([Note: steady state] in plan/steady.py), and its
        # spans come with this step's trace, from before its start: only their part inside this step counts.
        a, b = max(0.0, e["ts"] * 1e-6), (e["ts"] + e["dur"]) * 1e-6
        if b >= a:
            spans.setdefault(e["tid"], []).append((a, b))
    busy = {q: covered_s(s) for q, s in spans.items()}  # reads in flight together count once
    if not spans:
        return dict.fromkeys(_PARTS, 0.0), busy
    start = 0.0
    end = max(step_s, *(b for s in spans.values() for _, b in s))
    cuts = sorted({start, end, *(t for s in spans.values() for span in s for t in span)})
    groups = (("communication", _COMM), ("io_wait", _IO), ("optimizer", ("optim",)))
    parts = dict.fromkeys(_PARTS, 0.0)
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        running = {q for q, s in spans.items() if any(x <= mid < y for x, y in s)}
        name = "compute" if "compute" in running else next(
            (part for part, queues in groups if running & set(queues)), "stall")
        parts[name] += b - a
    return parts, busy


def _hwm_bytes(pid: int) -> int:
    """``pid``'s ``VmHWM`` in bytes; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
    except (OSError, ValueError):
        return 0


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (the ``children`` of each of its threads)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:  # gone meanwhile
            continue
    return out


def peak_rss(pids: list[int], seen: int = 0) -> int:
    """The largest peak resident memory among ``pids`` and their descendants, and ``seen`` (the last
    sample): [Note: a child's peak memory]."""
    return max([seen] + [_hwm_bytes(p) for pid in pids for p in _descendants(pid)])


def _read_log(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip() and "val_loss" not in line]


def run_config(config: Config, *, workdir: str, profile: str, nvme_dir: str, trace: str | None = None,
               on_step=None) -> dict[str, Any]:
    """One run of ``config``: its step lines, the trace path and the peak RSS of its largest process.
    ``on_step(n)`` is called as the log grows (a progress bar)."""
    os.makedirs(workdir, exist_ok=True)
    log = os.path.join(workdir, "log.jsonl")
    trace = trace or os.path.join(workdir, "trace.json")
    for path in (log, trace):
        if os.path.exists(path):
            os.unlink(path)
    # --timeout: a rank left waiting (for a peer, for the node) exits within it naming what it waited for.
    cmd = _luwu("train", *config.flags(nvme_dir=nvme_dir), "--steps", str(config.steps), "--eval-every", "0",
                "--quiet", "--profile", profile, "--json-log", log, "--trace", trace, "--timeout", "120")
    if config.nproc > 1:
        cmd += ["--nproc", str(config.nproc)]
    with contextlib.ExitStack() as stack, open(os.path.join(workdir, "stderr.txt"), "w") as err:
        if config.strategy == "node":  # a node of our own: --spawn-node gives it a fixed 1 GiB
            from luwu_rt.node.spawn import spawned_node

            cmd += ["--node", stack.enter_context(spawned_node(num_workers=config.nproc, host_mem=config.node_host_mem,
                                                               log_file=os.path.join(workdir, "node.log")))]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        seen = peak = 0
        while True:
            peak = peak_rss(_descendants(os.getpid())[1:], peak)  # the run's processes and its node's
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
            if pid:
                break
            if on_step is not None and os.path.exists(log):
                n = len(_read_log(log))
                if n > seen:
                    on_step(n - seen)
                    seen = n
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        with open(os.path.join(workdir, "stderr.txt")) as f:
            raise RuntimeError(f"luwu train for {config.label} exited {proc.returncode}: {f.read()[-3000:]}")
    lines = _read_log(log)
    if on_step is not None and len(lines) > seen:
        on_step(len(lines) - seen)
    with open(os.path.join(workdir, "stderr.txt")) as f:
        first = f.readline().strip()
    return {"lines": lines, "trace": trace, "events": read_trace(trace), "peak_rss_bytes": peak,
            "first_line": first}


def model_profiles(configs: list[Config], *, profile: str, directory: str,
                   say=lambda line: None) -> dict[Config, str]:
    """[Note: the compute rate of the model at hand]
    A calibration's ``compute_flops`` is the rate of the model it measured (``luwu calibrate --model``): a
    small model's step is mostly per-op overhead and runs at a fraction of a large one's FLOP rate. So each
    model of ``configs`` gets a profile of its own in ``directory``: the calibration with ``compute_flops``
    measured on that model, batch and sequence (``probes.compute_rate``), as ``luwu calibrate --model`` would,
    and for ranks that share the CPU by that many ranks side by side ([Note: the compute rate of ranks side by
    side] in probes.py). A profile that is no calibration of this machine (no ``_machine`` note: ``builtin``,
    a testbed's) is used as it is.

    Where ranks run side by side, the network between them is measured again too (``probes.collectives``, a
    few seconds), for the same reason: a report's calibration is taken once, before half an hour of runs, and
    one slow probe then moved a third of its grid. On 2026-12-07 a calibration measured gloo at 0.81 GB/s
    where the afternoon's had 1.45, and every 2-rank configuration at batch 1 x 64 without NVMe was
    over-predicted by 9-27% (within -6% to +10.4% replanned with the afternoon's figures)."""
    from luwu_rt.cli import probes
    from luwu_rt.engine.hwprofile import choose_profile

    choice = choose_profile(profile)
    if "_machine" not in choice.notes:
        return {c: profile for c in configs}
    with open(choice.path) as f:
        base = json.load(f)
    out: dict[Config, str] = {}
    done: dict[tuple, str] = {}
    on_cpu = base.get("_machine", {}).get("device") == "cpu"
    if any(c.nproc > 1 for c in configs):
        say("collectives between 2 ranks ...")
        coll = probes.collectives()
        base.update(probes.collective_keys(coll))
        base.setdefault("_measured", {})["collectives"] = coll
    for c in configs:
        # Ranks that share the CPU measure it side by side ([Note: the compute rate of ranks side by side]).
        ranks = c.nproc if on_cpu else 1
        key = (c.model, c.batch_size, c.seq_len, c.dtype) + ((f"x{ranks}",) if ranks > 1 else ())
        if key not in done:
            say(f"compute rate of {c.model} (batch {c.batch_size} x {c.seq_len}, {c.dtype}"
                f"{f', {ranks} ranks side by side' if ranks > 1 else ''}) ...")
            shape = dict(batch_size=c.batch_size, seq_len=c.seq_len, dtype=c.dtype, ranks=ranks)
            one = probes.compute_rate(c.model, **shape)
            values = json.loads(json.dumps(base))
            values["compute_flops"] = one["flops"]
            values.setdefault("_measured", {})["compute"] = one
            path = os.path.join(directory, f"profile-{_slug('-'.join(map(str, key)))}.json")
            with open(path, "w") as f:
                json.dump(values, f, indent=2)
            done[key] = path
        out[c] = done[key]
    return out


def measure(configs: list[Config], *, profile: str, nvme_dir: str, rounds: int = 1, trace_dir: str | None = None,
            progress: bool = True, model_compute: bool = True, profile_dir: str | None = None) -> list[Result]:
    """Every configuration run ``rounds`` times, interleaved, and predicted ([Note: where a step's time goes]);
    with ``model_compute``, on a profile with each model's own compute rate ([Note: the compute rate of the
    model at hand]), measured again at the start of each round and kept in ``profile_dir`` when given: a
    prediction is compared with the runs of its own round (the machine's load drifts between rounds)."""
    from tqdm import tqdm

    say = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else (lambda line: None)
    runs: dict[Config, list[dict]] = {c: [] for c in configs}
    planned: dict[Config, list[dict]] = {c: [] for c in configs}
    total = rounds * sum(c.steps for c in configs)
    with tempfile.TemporaryDirectory(prefix="luwu-e2e-") as tmp, \
            tqdm(total=total, disable=not progress, unit="step", dynamic_ncols=True, file=sys.stderr) as bar:
        for r in range(rounds):
            where = os.path.join(profile_dir or tmp, f"round-{r + 1}")
            os.makedirs(where, exist_ok=True)
            profiles = model_profiles(configs, profile=profile, directory=where, say=bar.write if progress else say) \
                if model_compute else {c: profile for c in configs}
            order = configs[r % len(configs):] + configs[: r % len(configs)]  # rotate who goes first
            for i, c in enumerate(order):
                bar.set_description(f"round {r + 1}/{rounds}: {c.label}")
                planned[c].append(predict(c, profile=profiles[c], nvme_dir=nvme_dir))
                trace = os.path.join(trace_dir, f"{_slug(c.label)}.json") if trace_dir else None
                runs[c].append(_run_twice(c, workdir=os.path.join(tmp, f"{r}-{i}"), profile=profiles[c],
                                          nvme_dir=nvme_dir, trace=trace, on_step=bar.update, say=bar.write))
    return [result_of(c, runs[c], planned[c], keep_trace=trace_dir is not None) for c in configs]


def _run_twice(config: Config, *, say, **kwargs) -> dict:
    """``run_config``, once more when it fails (a rank that timed out on a loaded machine); the second failure
    is the error."""
    try:
        return run_config(config, **kwargs)
    except RuntimeError as exc:
        say(f"{config.label} failed, running it again: {str(exc).splitlines()[-1][:300]}")
        return run_config(config, **kwargs)


def _slug(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in label)


def result_of(config: Config, runs: list[dict], planned: list[dict], *, keep_trace: bool = False) -> Result:
    """``config``'s ``Result`` from its runs (``run_config``'s, one per round) and its plans (``predict``'s: one,
    or one per round); the error is the median over rounds of the error in that round."""
    from luwu_rt.exec.trace import moved_by_tier

    per_round = [statistics.median(line["step_s"] for line in run["lines"][1:]) for run in runs]
    step_s = statistics.median(per_round)
    planned_by_round = planned * len(runs) if len(planned) == 1 else planned
    predicted = [statistics.median(_predicted(p, line) for line in run["lines"][1:])
                 for p, run in zip(planned_by_round, runs)]
    errors = [p / m - 1 for p, m in zip(predicted, per_round)]
    planned = planned[-1]
    last = runs[-1]
    rows = last["events"]
    ranks = rows[: config.nproc] or [[]]
    parted = [breakdown(row, step_s=last["lines"][-1]["step_s"]) for row in ranks]
    slowest = max(range(len(ranks)), key=lambda k: sum(parted[k][0].values()))
    parts, busy = parted[slowest]
    tokens = config.batch_size * config.seq_len * config.nproc
    return Result(config=config, step_s=step_s, step_s_rounds=per_round, tokens_per_s=tokens / step_s,
                  loss=last["lines"][-1]["loss"], parts_s=parts, busy_s=busy, moved_bytes=moved_by_tier(
                      (e["name"], e["args"]["bytes"]) for e in ranks[slowest]),
                  peak_bytes=planned["peak_bytes"], peak_rss_bytes=max(run["peak_rss_bytes"] for run in runs),
                  predicted_step_s=statistics.median(predicted), predicted_step_s_rounds=predicted,
                  error=statistics.median(errors), bottleneck=planned["bottleneck"],
                  placement=planned["placement"], profile=planned["profile"]["described"],
                  trace=last["trace"] if keep_trace else None)


def _predicted(planned: dict, line: dict) -> float:
    """The prediction for one measured step: that of the plans it ran. A double-buffered optimizer state's step
    speculates, waits or is redone by its norms ([Note: when to speculate] in exec/speculate.py); early in a run
    clipping persists, and its steps wait."""
    return planned.get("predicted_by_updates", {}).get(line.get("updates"), planned["predicted_step_s"])


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f}"


def table(results: list[Result]) -> list[str]:
    """Markdown tables of ``results``: steps and predictions, where the time went, bytes and memory."""
    lines = ["| configuration | tokens/s | step s (per round) | predicted s (per round) | error | bottleneck (plan) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        rounds = ", ".join(f"{s:.3f}" for s in r.step_s_rounds)
        predicted = ", ".join(f"{s:.3f}" for s in r.predicted_step_s_rounds)
        lines.append(f"| {r.config.label} | {r.tokens_per_s:,.0f} | {r.step_s:.3f} ({rounds}) | "
                     f"{r.predicted_step_s:.3f} ({predicted}) | {r.error * 100:+.1f}% | {r.bottleneck} |")
    lines += ["", "| configuration | " + " | ".join(f"{p} s" for p in _PARTS) + " | busy s per queue |",
              "|---|" + "---|" * (len(_PARTS) + 1)]
    for r in results:
        busy = ", ".join(f"{q} {s:.3f}" for q, s in sorted(r.busy_s.items(), key=lambda kv: -kv[1]))
        lines.append(f"| {r.config.label} | " + " | ".join(f"{r.parts_s[p]:.3f}" for p in _PARTS) + f" | {busy} |")
    lines += ["", "| configuration | moved MB per step (read / write): device, host, nvme | plan peak MB: device, "
              "host, nvme | peak RSS MB (largest process) |", "|---|---|---|---|"]
    for r in results:
        moved = ", ".join(f"{_mb(r.moved_bytes[t]['read'])} / {_mb(r.moved_bytes[t]['write'])}"
                          for t in ("device", "host", "nvme"))
        peaks = ", ".join(_mb(r.peak_bytes.get(t) or 0) for t in ("device", "host", "nvme"))
        lines.append(f"| {r.config.label} | {moved} | {peaks} | {_mb(r.peak_rss_bytes)} |")
    return lines


def run(args: argparse.Namespace) -> int:
    from luwu_rt.cli.dirs import created_dir

    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    common = dict(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype,
                  steps=args.steps, device_mem=args.device_mem, host_mem=args.host_mem)
    configs = [Config(strategy=s, nproc=1 if s == "local" else args.nproc, placement=p, grad_clip=c, **common)
               for s in args.strategies for p in args.placements for c in args.grad_clip]
    nvme_dir = args.nvme_dir or os.path.join(tempfile.gettempdir(), f"luwu-e2e-nvme-{os.getpid()}")
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    load = os.getloadavg()
    with created_dir(nvme_dir, flag="--nvme-dir"):
        results = measure(configs, profile=args.profile, nvme_dir=nvme_dir, rounds=args.rounds,
                          trace_dir=args.trace_dir, progress=not args.json, model_compute=args.model_compute)
    after = os.getloadavg()
    if args.json:
        print(json.dumps({"load_average": [list(load), list(after)], "results": [r.as_dict() for r in results]},
                         indent=2))
        return 0
    print(f"{results[0].profile}; load average {load[0]:.2f} before, {after[0]:.2f} after")
    print("\n".join(table(results)))
    return 0
