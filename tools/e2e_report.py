"""The end-to-end report in one command: calibrate this machine, run ours beside the peers, check the planner
against measurement on a grid of configurations, put the LuWu paper's testbed on paper, and write a dated
markdown report with its plots under benchmarks/results/.

    python tools/e2e_report.py [--quick] [--nvme-dir DIR] [--results benchmarks/results] [--rounds 3]
    python tools/e2e_report.py --render DIR/figures.json   # the report again from saved figures (no runs)

Steps (each figure with the load average beside it; the machine may be shared):
1. ``luwu calibrate --no-cache --out <report dir>/profile.json``;
2. ``benchmarks/bench_e2e.py``: ours beside plain PyTorch, torch DDP, FSDP2 (with and without
   CPUOffloadPolicy) and DeepSpeed ZeRO-Offload / ZeRO-Infinity (P10), at the benchmark's batch (compute
   bound on a CPU) and again at batch 1 x 64 per rank (``SMALL``), where the runtime's own work is the step;
3. the planner's truth (P11): ``luwu bench e2e``'s machinery on a grid of configurations (placements device,
   host, NVMe; two model sizes and two batches; clipping on and off; local, ddp, zero1-3 and node at 2 ranks),
   each predicted on the calibrated profile with the model's own compute rate, and ``--strategy auto``'s pick
   beside the measured fastest strategy of each group;
4. the LuWu testbed (benchmarks/profiles/luwu-testbed.json): ``luwu plan`` for gpt-175b under ``node`` and
   ``zero3`` on 8 workers, and the simulated scale-out to 64 and 256 workers, with the node shards ``node``
   needs to keep up;
5. plots: tokens/s per contestant, one step's timeline per queue, predicted against measured step time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TESTBED = ROOT / "benchmarks" / "profiles" / "luwu-testbed.json"
PAPER = {"node_tokens_per_s": 134.0, "speedup_over_zero_infinity": 3.98}
"""The LuWu paper's published figures: 175B on 8 workers with the in-network optimizer node, and its speed-up
over 8-worker ZeRO-Infinity."""
TESTBED_FLAGS = ["--model", "gpt-175b", "--seq-len", "2048", "--dtype", "bf16", "--device-mem", "40GiB",
                 "--nvme-size", "3840GB", "--chunk-size", "64MiB"]
"""A worker of the testbed: one A100-40GB, one 3.84 TB NVMe SSD (assumed, for ZeRO-Infinity's offload);
GPT-3's 2048-token sequences. Its host memory (256 GB in the paper) and its sequences per step (one,
assumed) are each row's ``--host-mem`` and ``--batch-size``."""
SMALL = {"batch_size": 1, "seq_len": 64}
"""The small-batch regime: on 2 CPU cores a step at the benchmark's batch is the model's compute for every
contestant alike; at this batch it is the runtime's own work (gathers, copies, IO, the optimizer)."""
NODE_FLAGS = ["--node-host-mem", "512GiB", "--node-nvme-size", "46TB"]
"""The optimizer node: 512 GiB of host memory (assumed) and 12 x 3.84 TB NVMe SSDs."""


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _say(line: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S} load {_load()[0]:.2f}] {line}", file=sys.stderr, flush=True)


def _luwu(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "luwu_rt", *args], capture_output=True, text=True, check=check,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


# -- measuring -------------------------------------------------------------------------------------

def truth_configs(quick: bool) -> list:
    """The grid of P11 (and the groups of ``--strategy auto``'s check)."""
    from luwu_rt.cli.bench_e2e import Config

    if quick:
        tiny = dict(model="gpt-tiny", batch_size=2, seq_len=32, steps=3, device_mem="256MiB", host_mem="256MiB")
        return [Config(strategy="local", placement="host", **tiny),
                Config(strategy="ddp", nproc=2, placement="device", **tiny),
                Config(strategy="zero3", nproc=2, placement="device", **tiny)]
    small = dict(model="gpt-small", batch_size=4, seq_len=256, steps=4, device_mem="4GiB", host_mem="4GiB")
    tiny = dict(model="gpt-tiny", batch_size=8, seq_len=128, steps=6, device_mem="512MiB", host_mem="512MiB")
    out = [Config(strategy="local", placement=p, grad_clip=c, **small)
           for p, c in (("device", 1.0), ("host", 1.0), ("host", 0.0), ("nvme", 1.0), ("nvme", 0.0))]
    out += [Config(strategy=s, nproc=2, placement="host", **small) for s in ("ddp", "zero1", "zero2", "zero3", "node")]
    out += [Config(strategy="local", placement=p, **tiny) for p in ("device", "host", "nvme")]
    out += [Config(strategy=s, nproc=2, placement="device", **tiny) for s in ("ddp", "zero1", "zero2", "zero3")]
    out += [Config(strategy="node", nproc=2, placement="host", **tiny)]
    small_batch = {**small, **SMALL}
    out += [Config(strategy=s, nproc=1 if s == "local" else 2, placement="device", **small_batch)
            for s in ("local", "ddp", "zero1", "zero2", "zero3")]  # all four: a group for auto's check
    out += [Config(strategy="zero3", nproc=2, placement=p, **small_batch) for p in ("host", "nvme")]
    return out


def auto_picks(results: list[dict], profile: str, nvme_dir: str) -> list[dict]:
    """For each group of 2-rank configurations differing only in strategy: ``luwu plan --strategy auto``'s pick
    beside the measured fastest (``node`` is never auto's: it needs a node process)."""
    from luwu_rt.cli.bench_e2e import Config

    groups: dict[tuple, list[dict]] = {}
    for r in results:
        c = r["config"]
        if c["nproc"] > 1 and c["strategy"] != "node":
            key = tuple((k, v) for k, v in c.items() if k != "strategy")
            groups.setdefault(key, []).append(r)
    out = []
    for key, rows in groups.items():
        if len(rows) < 2:
            continue
        c = Config(**{**dict(key), "strategy": "auto", "extra": tuple(dict(key)["extra"])})
        planned = json.loads(_luwu("plan", *c.flags(nvme_dir=nvme_dir), "--world-size", str(c.nproc), "--profile",
                                   profile, "--json").stdout)
        fastest = sorted(rows, key=lambda r: r["step_s"])
        gap = fastest[1]["step_s"] / fastest[0]["step_s"] - 1
        picked = next((r for r in rows if r["config"]["strategy"] == planned["strategy"]), None)
        out.append({"group": f"{c.model} x{c.nproc} {c.placement} {'clip' if c.grad_clip else 'no-clip'}",
                    "auto": planned["strategy"], "measured_fastest": fastest[0]["config"]["strategy"],
                    "gap": gap, "picked_vs_fastest": picked["step_s"] / fastest[0]["step_s"] - 1 if picked else None,
                    "measured": {r["config"]["strategy"]: r["step_s"] for r in rows}})
    return out


def _plan_testbed(strategy: str, world: int, *, shards: int = 1, batch: int = 1, host_mem: str = "256GiB") -> dict:
    """``luwu plan --simulate --json`` on the testbed profile; ``{"error": ...}`` when luwu plan refuses."""
    flags = [*TESTBED_FLAGS, "--batch-size", str(batch), "--host-mem", host_mem]
    extra = NODE_FLAGS + ["--node-shards", str(shards)] if strategy == "node" else []
    done = _luwu("plan", *flags, "--profile", str(TESTBED), "--strategy", strategy, "--world-size", str(world), *extra,
                 "--simulate", "--json", check=False)
    if done.returncode not in (0, 1):
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}",
                "command": "luwu plan " + " ".join(flags + ["--strategy", strategy, "--world-size", str(world)]
                                                   + extra)}
    out = json.loads(done.stdout)
    out["command"] = "luwu plan " + " ".join(flags + ["--strategy", strategy, "--world-size", str(world)] + extra)
    return out


def testbed() -> dict:
    """``luwu plan`` on the LuWu testbed: 8 workers under node and zero3 (and node shards), and the simulated
    scale-out to 64 and 256 workers with the node shards node needs to keep up with zero3."""
    out: dict = {"paper": PAPER, "eight": [], "scale": []}
    for batch in (1, 8):
        for strategy, host in (("zero3", "256GiB"), ("node", "256GiB"), ("node", "512GiB")):
            for shards in ((1, 2, 4, 8) if strategy == "node" and host == "512GiB" else (1,)):
                _say(f"testbed: {strategy} x8, batch {batch}, host {host}, {shards} node shard(s)")
                out["eight"].append({"strategy": strategy, "batch": batch, "host_mem": host, "shards": shards,
                                     **_plan_testbed(strategy, 8, shards=shards, batch=batch, host_mem=host)})
    for world in (64, 256):
        _say(f"testbed: scale-out to {world} workers")
        z3 = _plan_testbed("zero3", world, host_mem="512GiB")
        row = {"world": world, "zero3": z3, "node": {}}
        for shards in (1, 4, 16, 64):
            n = row["node"][shards] = _plan_testbed("node", world, shards=shards, host_mem="512GiB")
            if "error" not in n and "error" not in z3 and n.get("fits") and z3.get("fits") \
                    and n["simulated"]["step_s"] <= z3["simulated"]["step_s"]:
                break  # node keeps up with zero3 from here on
        out["scale"].append(row)
    return out


def measure(args, outdir: Path) -> dict:
    from luwu_rt.cli.bench_e2e import measure as measure_configs

    start = time.monotonic()
    figures: dict = {"date": args.date, "machine": _machine(), "load_average_start": _load(),
                     "command": "python tools/e2e_report.py" + (" --quick" if args.quick else "")
                     + f" --rounds {args.rounds}" + (" --nvme-dir DIR" if args.nvme_dir else "")}
    profile = str(outdir / "profile.json")
    _say("calibrating")
    cal = ["calibrate", "--no-cache", "--out", profile, "--json"]
    if args.quick:
        cal += ["--model", "gpt-tiny", "--batch-size", "2", "--seq-len", "32", "--nvme-mb", "8", "--net-mib", "1",
                "--optim-numel", str(1 << 16)]
    if args.nvme_dir:
        cal += ["--nvme-dir", args.nvme_dir]
    figures["calibrate_command"] = "luwu " + " ".join(cal[:-1])
    figures["profile"] = json.loads(_luwu(*cal).stdout)
    for key, batch in (("peers", {}), ("peers_small", SMALL)):
        _say("ours beside the peers" + (f" at batch {batch['batch_size']} x {batch['seq_len']}" if batch else ""))
        figures[f"{key}_command"], figures[key] = _peers(args, outdir, key, profile, batch)
    _say("the planner's truth")
    nvme = args.nvme_dir or tempfile.mkdtemp(prefix="luwu-e2e-report-")
    configs = truth_configs(args.quick)
    traces = outdir / "traces"
    traces.mkdir(exist_ok=True)
    load = _load()
    results = measure_configs(configs, profile=profile, nvme_dir=nvme, rounds=1 if args.quick else args.rounds,
                              trace_dir=str(traces), profile_dir=str(outdir))
    figures["truth"] = {"load_average": [load, _load()], "results": [r.as_dict() for r in results]}
    figures["auto"] = auto_picks(figures["truth"]["results"], profile, nvme)
    _say("the LuWu testbed on paper")
    figures["testbed"] = testbed()
    figures["load_average_end"] = _load()
    figures["minutes"] = round((time.monotonic() - start) / 60)
    _unpath_files(outdir)
    return _repo_relative(figures)


def _peers(args, outdir: Path, key: str, profile: str, batch: dict) -> tuple[str, dict]:
    """``benchmarks/bench_e2e.py`` at ``batch`` (its own default when empty): the command run, and its figures."""
    out = outdir / f"{key}.json"
    bench = [sys.executable, str(ROOT / "benchmarks" / "bench_e2e.py"), "--profile", profile, "--rounds",
             str(args.rounds), "--json-out", str(out), "--out", str(outdir / f"{key}.md")]
    if args.quick:
        bench += ["--model", "gpt-tiny", "--batch-size", "2", "--seq-len", "32", "--steps", "3", "--device-mem",
                  "256MiB", "--host-mem", "256MiB", "--peers", "plain", "torch-ddp"]
    for flag, value in batch.items():
        bench += [f"--{flag.replace('_', '-')}", str(value)]
    if args.nvme_dir:
        bench += ["--nvme-dir", args.nvme_dir]
    subprocess.run(bench, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    command = "python " + " ".join(os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a for a in bench[1:])
    return command, json.loads(out.read_text())


def _repo_relative(figures: dict) -> dict:
    """The figures with this checkout's and the temporary directory's paths left out: the report is
    committed, and names no path of the machine that made it (trace files are read back from the repo root)."""
    return json.loads(_unpathed(json.dumps(figures)))


_TMP = "$TMPDIR/"
"""What ``_unpathed`` writes for the temporary directory, and ``_repathed`` reads back."""


def _unpathed(text: str) -> str:
    return text.replace(str(ROOT) + os.sep, "").replace(tempfile.gettempdir() + os.sep, _TMP)


def _repathed(path: str) -> str:
    """A path ``_unpathed`` wrote, on this machine again (a report written outside the repo, as ``--quick``'s test
    runs, has its traces under the temp directory)."""
    return os.path.join(tempfile.gettempdir(), path[len(_TMP):]) if path.startswith(_TMP) else str(ROOT / path)


def _unpath_files(outdir: Path) -> None:
    """The same for the files the measuring wrote beside the figures (profiles, the peers' report)."""
    for path in outdir.rglob("*"):
        if path.suffix in (".json", ".md") and path.is_file():
            text = path.read_text()
            if _unpathed(text) != text:
                path.write_text(_unpathed(text))


def _machine() -> dict:
    from luwu_rt.engine.hwprofile import machine_identity

    import torch

    return {**machine_identity(), "torch": torch.__version__, "python": sys.version.split()[0]}


# -- plotting --------------------------------------------------------------------------------------

def plot_tokens(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = figures["peers"]
    a = peers["args"]
    names, values, colors = [], [], []
    for name, runs in peers["rounds"].items():
        if runs:
            step = statistics.median(r["step_s"] for r in runs)
            names.append(name)
            values.append(a["batch_size"] * a["seq_len"] * runs[0]["ranks"] / step)
            colors.append("tab:blue" if name.startswith("ours") else "tab:gray")
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.5))
    ax.barh(names[::-1], values[::-1], color=colors[::-1])
    ax.set_xlabel("tokens/s (all ranks)")
    ax.set_title(f"{a['model']}, batch {a['batch_size']} x {a['seq_len']} per rank: ours (blue) and the peers")
    for name in peers["errors"]:
        ax.text(0, -1, "")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(trace: str, path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from luwu_rt.cli.bench_e2e import read_trace

    rows = read_trace(trace)
    events = rows[0]
    queues = sorted({e["tid"] for e in events}, key=lambda q: (q != "compute", q))
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(queues) + 1.5))
    cmap = plt.get_cmap("tab10")
    for i, q in enumerate(queues):
        spans = [(e["ts"] / 1e3, e["dur"] / 1e3) for e in events if e["tid"] == q]
        ax.broken_barh(spans, (i - 0.4, 0.8), color=cmap(i % 10))
    ax.set_yticks(range(len(queues)), queues)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's start (rank 0)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_truth(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 7))
    xs = [r["step_s"] for r in results]
    ys = [r["predicted_step_s"] for r in results]
    for r, x, y in zip(results, xs, ys):
        ok = abs(r["error"]) <= 0.10
        ax.scatter([x], [y], color="tab:green" if ok else "tab:red")
        ax.annotate(r["label"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    lo, hi = min(xs + ys) * 0.7, max(xs + ys) * 1.4
    ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="y = x")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="tab:green", alpha=0.1,
                    label="within 10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step s")
    ax.set_ylabel("predicted step s")
    ax.set_title("The planner on the calibrated profile (green: within 10%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the report ------------------------------------------------------------------------------------

def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def render(figures: dict, outdir: Path, md: Path) -> None:
    from luwu_rt.cli.bench_e2e import table

    rel = os.path.relpath(outdir, md.parent)
    plot_tokens(figures, outdir / "tokens.png")
    truth = figures["truth"]["results"]
    plot_truth(truth, outdir / "predicted-vs-measured.png")
    traced = next((r for r in truth if r.get("trace") and r["config"]["strategy"] == "zero3"), None) \
        or next((r for r in truth if r.get("trace")), None)
    if traced:
        plot_timeline(_repathed(traced["trace"]), outdir / "timeline.png",
                      title=f"one step of {traced['label']}, per queue")
    m = figures["machine"]
    p = figures["profile"]
    lines = [f"# End to end: luwu_rt beside the peers, the planner against measurement, the LuWu testbed on paper "
             f"({figures['date']})", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, "
             f"GPUs: {', '.join(m['gpus']) or 'none'}; "
             f"torch {m['torch']}, Python {m['python']}. Load average (1, 5, 15 min) at the start "
             f"{figures['load_average_start']}, at the end {figures['load_average_end']}: the machine was "
             f"{'shared' if figures['load_average_start'][0] > 1.5 else 'quiet'}; every figure below is a ratio "
             f"or a median of interleaved rounds, with the load beside it.", "",
             f"Regenerate everything: `{figures.get('command', 'python tools/e2e_report.py')}` "
             f"({figures.get('minutes', 'about 60')} minutes here); the report alone from the saved figures: "
             f"`python tools/e2e_report.py --render {os.path.relpath(outdir / 'figures.json', ROOT)}`.",
             "", "## 1. The calibrated profile", "",
             f"`{figures['calibrate_command']}` ({p['_measured']['seconds']:.0f} s, load average "
             f"{p['_measured']['load_average_before']} before, {p['_measured']['load_average_after']} after):", "",
             "| key | value | key | value |", "|---|---|---|---|"]
    keys = [k for k in p if not k.startswith("_")]
    for a, b in zip(keys[::2], keys[1::2] + [""]):
        lines.append(f"| {a} | {p[a]:.4g} | {b} | {p[b]:.4g} |" if b else f"| {a} | {p[a]:.4g} | | |")
    nv = p["_measured"]["nvme"]
    lines += ["", f"NVMe sweep: best read {nv['best']['read']['read_gbps']:.2f} GB/s at "
                  f"{nv['best']['read']['block_kib']} KiB x {nv['best']['read']['queue_depth']}, best write "
                  f"{nv['best']['write']['write_gbps']:.2f} GB/s at {nv['best']['write']['block_kib']} KiB x "
                  f"{nv['best']['write']['queue_depth']}; the IO engine's own settings "
                  f"({nv['engine_settings']['block_kib']} KiB x {nv['engine_settings']['queue_depth']}) read "
                  f"{nv['engine_settings']['read_gbps']:.2f} and write {nv['engine_settings']['write_gbps']:.2f}; "
                  f"read and write at once {nv['mixed_gbps']:.2f} GB/s together, "
                  f"{nv['mixed_over_one_disk']:.2f}x what the one-disk rule of the cost model predicts. Shared cores: "
                  "a matmul, the optimizer and a copy alone "
                  f"{', '.join(f'{k} {v:.3f} s' for k, v in p['_measured']['overlap']['alone_s'].items())}, "
                  f"together {p['_measured']['overlap']['together_s']:.3f} s: cpu_overlap "
                  f"{p['cpu_overlap']:.2f}.", ""]
    lines += _peers_section(figures, rel, "peers", "## 2. Ours beside the peers (P10)")
    if "peers_small" in figures:  # reports before 2026-12-07 ran the benchmark's batch only
        lines += _peers_section(figures, rel, "peers_small", "### 2b. The same at batch "
                                f"{figures['peers_small']['args']['batch_size']} x "
                                f"{figures['peers_small']['args']['seq_len']} per rank, where the runtime's own "
                                "work is the step")
    lines += ["## 3. The planner against measurement (P11)", "",
              f"Load average {figures['truth']['load_average'][0]} before, {figures['truth']['load_average'][1]} "
              f"after. Each configuration predicted by `luwu plan` on the calibrated profile with the model's own "
              f"compute rate ([Note: the compute rate of the model at hand] in luwu_rt/cli/bench_e2e.py), measured "
              f"by `luwu train` (median step over rounds).", ""]
    results = [_result(r) for r in truth]
    lines += table(results)
    within = sum(abs(r["error"]) <= 0.10 for r in truth)
    lines += ["", f"**{within} of {len(truth)} configurations within 10%** (P11: every one).", "",
              f"![predicted against measured]({rel}/predicted-vs-measured.png)", ""]
    if traced:
        lines += [f"One step of {traced['label']} from its trace, per queue (overlap shows as bars at the same "
                  f"time on different rows):", "", f"![timeline]({rel}/timeline.png)", ""]
    lines += ["`--strategy auto` against the measured fastest strategy of each group (a pick that matters where "
              "the measured gap between the two fastest is above 10%):", "",
              "| group | auto picks | measured fastest | gap to the next | auto's pick vs the fastest "
              "| measured step s |",
              "|---|---|---|---|---|---|"]
    for a in figures["auto"]:
        vs = "n/a" if a["picked_vs_fastest"] is None else _pct(a["picked_vs_fastest"])
        steps = ", ".join(f"{k} {v:.3f}" for k, v in sorted(a["measured"].items(), key=lambda kv: kv[1]))
        lines.append(f"| {a['group']} | {a['auto']} | {a['measured_fastest']} | {_pct(a['gap'])} | {vs} | {steps} |")
    lines += [""] + _testbed_section(figures["testbed"])
    md.write_text("\n".join(lines) + "\n")
    (outdir / "figures.json").write_text(json.dumps(figures, indent=2))


def _result(d: dict):
    from luwu_rt.cli.bench_e2e import Config, Result

    c = d["config"]
    fields = {k: v for k, v in d.items() if k not in ("label", "config")}
    return Result(config=Config(**{**c, "extra": tuple(c["extra"])}), **fields)


def _peers_section(figures: dict, rel: str, key: str, heading: str) -> list[str]:
    peers = figures[key]
    a = peers["args"]
    lines = [heading, "", f"`{figures[f'{key}_command']}`, load average "
             f"{peers['load_average_before']} before, {peers['load_average_after']} after.", "",
             "| contestant | ranks | tokens/s | step s per round | median step s | peak RSS MB | last loss |",
             "|---|---|---|---|---|---|---|"]
    for name, runs in peers["rounds"].items():
        if name in peers["errors"]:
            lines.append(f"| {name} | | unavailable: {peers['errors'][name]} | | | | |")
        elif runs:
            step = statistics.median(r["step_s"] for r in runs)
            tokens = a["batch_size"] * a["seq_len"] * runs[0]["ranks"]
            lines.append(f"| {name} | {runs[0]['ranks']} | {tokens / step:,.0f} | "
                         f"{', '.join(format(r['step_s'], '.3f') for r in runs)} | {step:.3f} | "
                         f"{max(r['rss'] for r in runs) / 1e6:,.0f} | {runs[-1]['loss']:.4f} |")
    lines += ["", "Ours / peer on the same placement, median over rounds of the ratio in that round:", "",
              "| ours | peer | step ratio (range) | peak RSS ratio | P10 target |", "|---|---|---|---|---|"]
    for ours, peer, target in _pairs():
        r1, r2 = peers["rounds"].get(ours) or [], peers["rounds"].get(peer) or []
        if not r1 or not r2:
            lines.append(f"| {ours} | {peer} | n/a: {peers['errors'].get(peer, 'not run')} | | {target or ''} |")
            continue
        ratios = [x["step_s"] / y["step_s"] for x, y in zip(r1, r2)]
        mem = max(x["rss"] for x in r1) / max(y["rss"] for y in r2)
        verdict = "" if not target else (" met" if statistics.median(ratios) <= target and mem <= target else
                                         " NOT met")
        lines.append(f"| {ours} | {peer} | {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
                     f"{mem:.2f}x | {f'<= {target}x:{verdict}' if target else ''} |")
    if key == "peers":
        lines += ["", f"![tokens/s per contestant]({rel}/tokens.png)"]
    lines.append("")
    predicted = peers.get("predicted") or []
    if predicted:
        from luwu_rt.cli.bench_e2e import table

        lines += ["Where our time went, and the planner beside each of ours (last round's last step):", ""]
        lines += table([_result(r) for r in predicted]) + [""]
    return lines


def _pairs():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_e2e_script", ROOT / "benchmarks" / "bench_e2e.py")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PAIRS


def _tokens_per_s(r: dict, world: int) -> float:
    return r["tokens_per_step"] * world / r["predicted_step_s"]


def _why_not(r: dict) -> str:
    """Why ``luwu plan`` refused a testbed configuration, in one short cell."""
    why = r.get("error") or r.get("reason") or "does not fit"
    return why.removeprefix("luwu: error: ").removeprefix("does not fit: ")[:160]


def _testbed_section(t: dict) -> list[str]:
    command = next((r["command"] for r in t["eight"] if "command" in r), "luwu plan ...")
    lines = ["## 4. The LuWu testbed on paper", "",
             "Profile: `benchmarks/profiles/luwu-testbed.json` (each figure's source in its `_sources`). Each row is "
             f"`{command}` with the row's strategy, batch, worker host memory and node shards:", "",
             "| strategy | batch per worker | worker host mem | node shards | predicted step s | tokens/s (8 workers) "
             "| bottleneck | node's own step s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in t["eight"]:
        head = f"| {r['strategy']} | {r['batch']} | {r['host_mem']} | {r['shards'] if r['strategy'] == 'node' else ''}"
        if "error" in r or not r.get("fits"):
            lines.append(f"{head} | not planned: {_why_not(r)} | | | |")
            continue
        own = f"{r['node']['step_s']:.1f}" if r.get("node") else ""
        lines.append(f"{head} | {r['predicted_step_s']:.1f} | {_tokens_per_s(r, 8):.1f} | {r['bottleneck']} | {own} |")
    lines += ["", "Scale-out, simulated (`luwu plan --simulate`, luwu_rt.testing.simulate) on the same profile with "
                  "512 GiB of host memory per worker, one worker per data-parallel rank; node shards raised until "
                  "node's step is no slower than zero3's:", "",
              "| workers | zero3 step s | zero3 tokens/s | node shards | node step s | node's own step s "
              "| node tokens/s | zero3 / node step |", "|---|---|---|---|---|---|---|---|"]
    for row in t["scale"]:
        z = row["zero3"]
        zs = z["simulated"]["step_s"] if "error" not in z and z.get("fits") else None
        zcell = f"{zs:.2f} | {z['tokens_per_step'] * row['world'] / zs:,.0f}" if zs else f"not planned: {_why_not(z)} |"
        for shards, n in row["node"].items():
            if "error" in n or not n.get("fits"):
                lines.append(f"| {row['world']} | {zcell} | {shards} | not planned: {_why_not(n)} | | | |")
                continue
            ns = n["simulated"]["step_s"]
            tok = n["tokens_per_step"] * row["world"]
            ratio = f"{zs / ns:.2f}x" if zs else ""
            lines.append(f"| {row['world']} | {zcell} | {shards} | {ns:.2f} | {n['node']['step_s']:.2f} | "
                         f"{tok / ns:,.0f} | {ratio} |")
    lines += ["", testbed_paragraph(t)]
    return lines


def testbed_paragraph(t: dict) -> str:
    """Where the model agrees with the paper and why it differs, from the figures at hand."""
    paper = t["paper"]
    planned = {(r["strategy"], r["batch"], r["shards"]): r for r in t["eight"]
               if "error" not in r and r.get("fits") and r["host_mem"] == "256GiB"}
    z3, node = planned.get(("zero3", 1, 1)), planned.get(("node", 1, 1))
    out = [f"**Against the paper.** The paper reports {paper['node_tokens_per_s']:.0f} tokens/s for gpt-175b on 8 "
           f"workers with the in-network optimizer node, {paper['speedup_over_zero_infinity']}x its 8-worker "
           f"ZeRO-Infinity (so about {paper['node_tokens_per_s'] / paper['speedup_over_zero_infinity']:.0f} tokens/s "
           "for ZeRO-Infinity)."]
    if z3:
        zt = _tokens_per_s(z3, 8)
        out.append(f"Our planner puts zero3 with NVMe offload at {zt:.1f} tokens/s ({z3['bottleneck']}-bound), "
                   f"{zt / (paper['node_tokens_per_s'] / paper['speedup_over_zero_infinity']):.1f}x the paper's "
                   "ZeRO-Infinity: our zero3 plan is the planner's best schedule of the same bytes (every load "
                   "planned ahead, the IO queues kept full), where the paper measured DeepSpeed's prefetcher, so "
                   "the gap is what a planned schedule would gain over it on that hardware, not a measurement.")
    else:
        out.append("zero3 was not planned on this profile (see the table).")
    nodes = sorted((r for r in t["eight"] if r["strategy"] == "node" and r["batch"] == 1 and "error" not in r
                    and r.get("fits")), key=lambda r: (r["host_mem"] != "256GiB", r["shards"]))
    node = node or (nodes[0] if nodes else None)
    if node:
        nt = _tokens_per_s(node, 8)
        out.append(f"The node strategy ({node['shards']} node shard(s), {node['host_mem']} per worker) is predicted at "
                   f"{nt:.1f} tokens/s ({nt / paper['node_tokens_per_s'] - 1:+.0%} against the paper), "
                   f"{node['bottleneck']}-bound"
                   + (f", node / zero3 = {nt / _tokens_per_s(z3, 8):.2f}x against the paper's "
                      f"{paper['speedup_over_zero_infinity']}x" if z3 else "") + ".")
        if node["bottleneck"] == "push":
            out.append("Push-bound means the node's network link: every worker pushes its whole gradient to the "
                       "node each step, so one node's ingress carries eight workers' gradients, where zero3's "
                       "reduce-scatter spreads the same bytes over every worker's link; node shards split that "
                       "ingress" + (f": with {nodes[-1]['shards']} shards node is predicted at "
                                    f"{_tokens_per_s(nodes[-1], 8):.1f} tokens/s" if len(nodes) > 1 else "") + ".")
    else:
        refused = next((r for r in t["eight"] if r["strategy"] == "node"), None)
        out.append("The node strategy was not planned on this profile"
                   + (f" ({_why_not(refused)})" if refused else "") + ".")
    out.append("The paper's node speed-up rests on two things the model has only as profile figures: the workers' "
               "gradients and parameters crossing a 100 Gbps network at line rate, and the node's 12 SSDs striped "
               "at their rated bandwidth; where a figure is an assumption its `_sources` entry says so, and the "
               "predictions move with it.")
    return " ".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny settings (minutes): a check that it all runs")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="where the report goes")
    ap.add_argument("--nvme-dir", default=None, help="a directory on a real disk for the NVMe tier")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--render", default=None, metavar="FIGURES_JSON", help="rewrite the report from saved figures")
    ap.add_argument("--replan-testbed", action="store_true",
                    help="with --render: plan the LuWu testbed again (minutes; no training runs) before rewriting")
    args = ap.parse_args()
    if args.replan_testbed and not args.render:
        ap.error("--replan-testbed goes with --render FIGURES_JSON (a full run plans the testbed anyway)")
    name = f"{args.date}-e2e" + ("-quick" if args.quick else "")
    if args.render:
        figures = json.loads(Path(args.render).read_text())
        if args.replan_testbed:
            figures = _repo_relative({**figures, "testbed": testbed()})
            Path(args.render).write_text(json.dumps(figures, indent=2))
        outdir = Path(args.render).parent
        md = outdir.parent / f"{outdir.name}.md"
    else:
        outdir = Path(args.results) / name
        outdir.mkdir(parents=True, exist_ok=True)
        md = Path(args.results) / f"{name}.md"
        figures = measure(args, outdir)
        (outdir / "figures.json").write_text(json.dumps(figures, indent=2))
    render(figures, outdir, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
