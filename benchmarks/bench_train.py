"""P5 and P7 (benchmarks/README.md): training steps of the engine beside their peers, in the same run.

P5: a model that fits in memory. The engine with parameters and optimizer state
offloaded to host memory (and, for reference, everything on the device tier)
against a plain PyTorch loop on the same model and batches: the whole model in
memory, autograd, ``torch.optim.AdamW(fused=True)``, the same clipping. FSDP2
``fully_shard`` with ``CPUOffloadPolicy`` on a 1-process gloo group is tried as a
second peer; where it cannot run here the report says why. Contestants take
turns in every round (order rotated); each round's figure is the median step
time of its steps, and every ratio is the median over rounds of the ratio
measured in that round. Target: ours <= 1.15x the plain step.

P7: a model whose fp32 training state is >= 3x the host budget trains a few
steps with its state on NVMe. Per step: the step time, the compute queue's busy
time, and the IO time: the seconds the same IO engine takes, right after that
step, to read and write the step's NVMe bytes at once with nothing else to do
(timed on a sample of at most 1 GiB with the same read/write mix, scaled). Target:
step <= 1.05x max(compute time, IO time). Also the planner's prediction, with
its default profile and with a profile measured in this run. The device budget
is the model's activation reserve, measured as the engine measures it
(``engine/workload.py``, ``device_budget``), plus ``--p7-device-arena`` for the
shards, unless ``--p7-device-mem`` sets the whole budget.

    python benchmarks/bench_train.py [--part p5|p7|both] [--out FILE] [--nvme-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from report import cpu_model, emit  # benchmarks/report.py

from luwu_rt.config import from_mapping
from luwu_rt.io import BLOCK_BYTES, QUEUE_DEPTH
from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.engine.workload import device_budget
from luwu_rt.exec.trace import moved_by_tier
from luwu_rt.models.gpt import build_gpt
from luwu_rt.optim.schedule import lr_at
from luwu_rt.plan import format_size, parse_size

P5_TARGET = 1.15
P7_TARGET = 1.05
_OPTIM = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2, "grad_clip": 1.0}
_GB = 1e9
_TOTAL_STEPS = 10_000  # the schedule's horizon: a benchmark's few steps stay in warm-up and early decay


def _machine() -> str:
    model = cpu_model()
    return (f"{model}, {os.cpu_count()} cpus, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def _load() -> str:
    """The load average now: other processes share these cores."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} at {time.strftime('%H:%M:%S', time.gmtime())} UTC"


def _config(model: str, *, batch_size: int, seq_len: int, steps: int, offload: dict, **extra) -> TrainConfig:
    optim = {**_OPTIM, **extra.pop("optim", {})}
    return from_mapping(TrainConfig, {"model": model, "batch_size": batch_size, "seq_len": seq_len, "steps": steps,
                                      "seed": 0, "optim": optim, "offload": offload, **extra})


def _batches(vocab: int, *, batch_size: int, seq_len: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, vocab, (count, batch_size, seq_len + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


# -- P5 contestants: each is a callable (batch) -> loss -----------------------------------------------

def _plain(model: str) -> Callable:
    """The whole model in memory, autograd, torch's fused AdamW, the same clipping as ours."""
    chain = build_gpt(model, device="cpu", seed=0)
    params = list(chain.model.parameters())
    opt = torch.optim.AdamW(params, lr=_OPTIM["lr"], betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    return _torch_step(chain.forward, params, opt)


def _torch_step(forward: Callable, params: list[torch.Tensor], opt: torch.optim.Optimizer) -> Callable:
    """A plain training step of ``forward(inputs, targets) -> loss`` with the engine's learning-rate schedule
    and clipping."""
    count = 0

    def step(batch) -> float:
        nonlocal count
        count += 1
        for group in opt.param_groups:
            group["lr"] = lr_at(count, lr=_OPTIM["lr"], min_lr=_OPTIM["min_lr"], warmup_steps=_OPTIM["warmup_steps"],
                                total_steps=_TOTAL_STEPS)
        opt.zero_grad(set_to_none=True)
        loss = forward(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, _OPTIM["grad_clip"])
        opt.step()
        return float(loss.detach())

    return step


def _free_port() -> int:
    """A port no one listens on now (a fixed one would collide with a second run on the machine)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp2(model: str) -> Callable:
    """FSDP2 ``fully_shard`` with ``CPUOffloadPolicy(pin_memory=False)`` on a 1-process gloo group (raises
    where unsupported)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    chain = build_gpt(model, device="cpu", seed=0)
    mesh = init_device_mesh("cpu", (1,))
    # pin_memory=False: pinning asks for an accelerator ("Cannot access accelerator device"), and on a CPU
    # mesh there is no copy for it to speed up.
    for block in chain.model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(chain.model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    params = list(chain.model.parameters())
    opt = torch.optim.AdamW(params, lr=_OPTIM["lr"], betas=(0.9, 0.95), weight_decay=0.1)

    # The root module's own forward: its FSDP hooks unshard the parameters it holds (the embeddings), which
    # the chain's unit-by-unit forward would bypass.
    step = _torch_step(chain.model, params, opt)
    step(_batches(256, batch_size=1, seq_len=8, count=1)[0])  # fails here when FSDP2 cannot run on this machine
    return step


class _Ours:
    """The engine under one placement; keeps each step's metrics for the time breakdown."""

    def __init__(self, config: TrainConfig) -> None:
        self.engine = Engine(None, config)
        self.metrics: list[dict] = []

    def __call__(self, batch) -> float:
        self.metrics.append(self.engine.train_step(batch))
        return self.metrics[-1]["loss"]


def _p5_contestants(args) -> tuple[dict[str, Callable], dict[str, str]]:
    def ours(placement: str, device_mem: str, keep: str) -> _Ours:
        off = {"params": placement, "optimizer": placement, "grads": placement, "device_mem": device_mem,
               "host_mem": args.p5_host_mem, "chunk_size": "4MiB"}
        return _Ours(_config(args.p5_model, batch_size=args.p5_batch_size, seq_len=args.p5_seq_len,
                             steps=_TOTAL_STEPS, offload=off, keep_graphs=keep))

    contestants: dict[str, Callable] = {"plain": _plain(args.p5_model)}
    unavailable: dict[str, str] = {}
    try:
        contestants["fsdp2-cpu-offload"] = _fsdp2(args.p5_model)
    except Exception as exc:  # noqa: BLE001 - any failure means the peer does not run here; say why
        unavailable["fsdp2-cpu-offload"] = f"{type(exc).__name__}: {exc}"
    contestants["ours-host"] = ours("host", args.p5_device_mem, "auto")
    contestants["ours-host-recompute"] = ours("host", args.p5_device_mem, "none")
    contestants["ours-device"] = ours("device", args.p5_host_mem, "auto")
    return contestants, unavailable


def _p5(args) -> list[str]:
    load_before = _load()
    contestants, unavailable = _p5_contestants(args)
    tokens = args.p5_batch_size * args.p5_seq_len
    batches = _batches(256, batch_size=args.p5_batch_size, seq_len=args.p5_seq_len,
                       count=args.p5_warmup + args.p5_rounds * args.p5_steps)
    names = list(contestants)
    losses: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.p5_warmup):
        for name in names:
            losses[name].append(contestants[name](batches[i]))
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.p5_rounds):
        chunk = batches[args.p5_warmup + r * args.p5_steps:][: args.p5_steps]
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate who goes first
            times = []
            for batch in chunk:
                start = time.perf_counter()
                losses[name].append(contestants[name](batch))
                times.append(time.perf_counter() - start)
            per_round[name].append(statistics.median(times))
        print(f"P5 round {r}: " + ", ".join(f"{n} {per_round[n][-1]:.3f}s" for n in names), file=sys.stderr)
    return _p5_report(args, per_round, losses, contestants, unavailable, tokens, load_before)


def _p5_report(args, per_round, losses, contestants, unavailable, tokens, load_before) -> list[str]:
    lines = ["## P5: a model that fits in memory", "",
             f"{args.p5_model} ({build_gpt(args.p5_model).num_params / 1e6:.1f}M params), fp32, batch "
             f"{args.p5_batch_size} x seq {args.p5_seq_len} = {tokens} tokens per step, AdamW, clipping "
             f"{_OPTIM['grad_clip']}; ours: device budget {args.p5_device_mem} (offloaded) / {args.p5_host_mem} "
             f"(all on device), host budget {args.p5_host_mem}. {args.p5_warmup} warm-up steps each, then "
             f"{args.p5_rounds} rounds x {args.p5_steps} steps; round figure = median step time.", "",
             f"Load: before {load_before}; after {_load()}.", "",
             "| contestant | step s per round | median step s | tokens/s | ratio vs plain (median of per-round) "
             "| loss after all steps |", "|---|---|---|---|---|---|"]
    plain = per_round["plain"]
    for name, times in per_round.items():
        ratios = [t / p for t, p in zip(times, plain)]
        lines.append(f"| {name} | {', '.join(f'{t:.3f}' for t in times)} | {statistics.median(times):.3f} | "
                     f"{tokens / statistics.median(times):,.0f} | {statistics.median(ratios):.3f}x | "
                     f"{losses[name][-1]:.4f} |")
    for name, reason in unavailable.items():
        lines.append(f"| {name} | unavailable: {reason} | | | | |")
    lines += ["", "Where our step time goes (median over measured steps; compute = compute queue busy, "
              "wait = step minus compute: the compute queue idle on IO or the optimizer, optim = optimizer "
              "queue busy, kept = activations held by kept graphs):", "",
              "| contestant | step s | compute s | wait s | optim s | io s | kept MB |",
              "|---|---|---|---|---|---|---|"]
    for name, c in contestants.items():
        if isinstance(c, _Ours):
            ms = c.metrics[args.p5_warmup:]
            med = {k: statistics.median(m[k] for m in ms) for k in ("step_s", "compute_s", "wait_s", "optim_s",
                                                                    "io_s", "kept_bytes")}
            lines.append(f"| {name} | {med['step_s']:.3f} | {med['compute_s']:.3f} | {med['wait_s']:.3f} | "
                         f"{med['optim_s']:.3f} | {med['io_s']:.3f} | {med['kept_bytes'] / 1e6:.0f} |")
    ratio = statistics.median(t / p for t, p in zip(per_round["ours-host"], plain))
    lines += ["", f"P5 verdict: ours-host / plain = {ratio:.3f}x (target <= {P5_TARGET}x): "
              f"{'met' if ratio <= P5_TARGET else 'NOT met'}.", ""]
    return lines


# -- P7 ---------------------------------------------------------------------------------------------

def _raw_io_seconds(directory: str, *, read_bytes: int, write_bytes: int) -> float:
    """Seconds for the IO engine to read ``read_bytes`` while writing ``write_bytes`` on this disk, nothing
    else running: timed on at most 1 GiB of reads with the same read/write mix, scaled linearly."""
    from luwu_rt.cli.probes import mixed_io_seconds as timed_mix

    scale = max(read_bytes, write_bytes) / (1 << 30)
    scale = max(scale, 1.0)
    sample_r = int(read_bytes / scale) // 4096 * 4096 or 4096
    sample_w = int(write_bytes / scale) // 4096 * 4096 or 4096
    seconds = timed_mix(directory, read_bytes=sample_r, write_bytes=sample_w, block_bytes=BLOCK_BYTES,
                        queue_depth=QUEUE_DEPTH)
    return seconds * max(read_bytes / sample_r, write_bytes / sample_w)


def p7_config(args) -> TrainConfig:
    """P7's run: its state placed by the planner (``auto``) over device, host and NVMe. The device budget is
    ``--p7-device-mem``, or else the model's measured activation reserve plus ``--p7-device-arena``: the
    engine counts activations in the device budget, so a fixed budget fits one model and batch only."""
    def config(device_mem: int | str) -> TrainConfig:
        off = {"params": "auto", "optimizer": "auto", "grads": "auto", "device_mem": device_mem,
               "host_mem": args.p7_host_mem, "chunk_size": "16MiB", "nvme_dir": args.nvme_dir}
        return _config(args.p7_model, batch_size=args.p7_batch_size, seq_len=args.p7_seq_len, steps=_TOTAL_STEPS,
                       offload=off, dtype="bf16", optim={"grad_clip": args.p7_grad_clip})

    if args.p7_device_mem is not None:
        return config(args.p7_device_mem)
    arena = parse_size(args.p7_device_arena)
    return config(device_budget(config(arena), arena_bytes=arena))


def _p7_engine(args) -> tuple[Engine, float]:
    config = p7_config(args)
    start = time.perf_counter()
    engine = Engine(None, config)
    return engine, time.perf_counter() - start


def _measured_profile(engine: Engine, workdir: str, spans):
    """The planner's hardware profile from figures measured in this run: disk, copies and optimizer from
    ``luwu bench offload-step``'s probes, compute FLOP/s from the last step's compute spans."""
    import dataclasses

    from luwu_rt.cli.bench_offload import _measure_profile
    from luwu_rt.plan import estimate

    # The disk is timed on the step's NVMe bytes, at most 1 GiB (as for the IO time above).
    nvme = engine.predicted.io_bytes.get("nvme", {"read": 0, "write": 0})
    state_bytes = min(max(nvme["read"], nvme["write"], 1 << 20), 1 << 30)
    _disk, profile = _measure_profile(workdir, state_bytes=state_bytes, block_bytes=BLOCK_BYTES,
                                      queue_depth=QUEUE_DEPTH)
    flops = sum(getattr(op, "flops", 0) for op in engine.plan.ops if op.kind == "Compute")
    compute_s = sum(s.end_s - s.start_s for s in spans if s.queue == "compute")
    profile = dataclasses.replace(profile, compute_flops=flops / compute_s)
    return estimate(engine.plan, profile).predicted_step_s


def _p7(args) -> list[str]:
    load_before = _load()
    os.makedirs(args.nvme_dir, exist_ok=True)
    free_before = shutil.disk_usage(args.nvme_dir).free
    engine, setup_s = _p7_engine(args)
    try:
        batches = _batches(engine.chain.shape.vocab_size, batch_size=args.p7_batch_size, seq_len=args.p7_seq_len,
                           count=args.p7_steps + 1)
        rows = []
        for i, batch in enumerate(batches):
            m = engine.train_step(batch)
            # The bound is the IO of the bytes this step moved to and from NVMe, not the plan's count of them.
            nvme = moved_by_tier((s.name, s.nbytes) for s in engine.last_spans)["nvme"]
            io_s = _raw_io_seconds(args.nvme_dir, read_bytes=nvme["read"], write_bytes=nvme["write"])
            # How the updates ran: in place, or with a double-buffered state committed, redone or waited for the norm.
            update = engine.speculation.last if engine.speculation is not None else "in place"
            rows.append({**m, "raw_io_s": io_s, "nvme_read": nvme["read"], "nvme_write": nvme["write"],
                         "update": update})
            print(f"P7 step {i}: {m['step_s']:.1f}s, compute {m['compute_s']:.1f}s, optim {m['optim_s']:.1f}s, "
                  f"raw IO {io_s:.1f}s, loss {m['loss']:.3f}", file=sys.stderr)
        if args.trace:
            from luwu_rt.exec import write_chrome_trace

            write_chrome_trace(engine.last_spans, args.trace)
        measured_pred = _measured_profile(engine, args.nvme_dir, engine.last_spans)
        lines = _p7_report(args, engine, rows[1:], setup_s, measured_pred, free_before, load_before)
    finally:
        nvme_root = os.path.join(args.nvme_dir, "luwu_state")
        del engine
        shutil.rmtree(nvme_root, ignore_errors=True)
    return lines


def _p7_report(args, engine: Engine, rows, setup_s, measured_pred, free_before, load_before) -> list[str]:
    n = engine.chain.num_params
    count = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    state = n * 12  # fp32 master + two moments; the bf16 params and grads come on top
    host = engine.plan.budgets.host_bytes
    activations = engine.model_spec.activation_bytes
    io = engine.predicted.io_bytes
    moved = ", ".join(f"{t}: {v['read'] / _GB:.2f} GB out / {v['write'] / _GB:.2f} GB in" for t, v in io.items())
    tokens = args.p7_batch_size * args.p7_seq_len
    lines = ["## P7: fp32 training state >= 3x the host budget, through NVMe", "",
             f"{args.p7_model} ({count} params), bf16 compute with fp32 master weights and moments, "
             f"gradient clipping {args.p7_grad_clip or 'off'}, batch "
             f"{args.p7_batch_size} x seq {args.p7_seq_len}. fp32 state (master + moments) {format_size(state)} "
             f"= {state / host:.1f}x the host budget of {format_size(host)}; device budget "
             f"{format_size(engine.plan.budgets.device_bytes)}, of which {format_size(activations)} are the "
             f"activation reserve (a CPU arena here). Placement chosen by the "
             f"planner: params={engine.placement.params}, optimizer={engine.placement.optimizer}, "
             f"grads={engine.placement.grads}. NVMe dir {args.nvme_dir} (ext4; {free_before / 2**30:.0f} GiB free "
             f"before). Engine setup incl. materialising the model onto NVMe: {setup_s:.0f} s.", "",
             f"Load: before {load_before}; after {_load()}.", "",
             f"Bytes moved per step (plan): {moved}.", "",
             "| step | step s | tokens/s | compute s | optim s | wait s | NVMe GB read / written (executed) | "
             "IO time s (raw, same bytes) | step / max(compute, IO) | step / max(compute + optim, IO) | grad norm | "
             "updates | loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, start=1):
        bound = max(r["compute_s"], r["raw_io_s"])
        cpu_bound = max(r["compute_s"] + r["optim_s"], r["raw_io_s"])
        lines.append(f"| {i} | {r['step_s']:.2f} | {tokens / r['step_s']:.1f} | {r['compute_s']:.2f} | "
                     f"{r['optim_s']:.2f} | {r['wait_s']:.2f} | {r['nvme_read'] / _GB:.2f} / "
                     f"{r['nvme_write'] / _GB:.2f} | {r['raw_io_s']:.2f} | {r['step_s'] / bound:.2f}x | "
                     f"{r['step_s'] / cpu_bound:.2f}x | {r['grad_norm']:.3g} | {r['update']} | {r['loss']:.3f} |")
    ratio = statistics.median(r["step_s"] / max(r["compute_s"], r["raw_io_s"]) for r in rows)
    step_s = statistics.median(r["step_s"] for r in rows)
    lines += ["", f"Median step {step_s:.2f} s = {tokens / step_s:.1f} tokens/s. Planner's prediction: "
              f"{engine.predicted.predicted_step_s:.2f} s with its default (GPU server) profile, "
              f"{measured_pred:.2f} s with a profile measured in this run (bottleneck "
              f"{engine.predicted.bottleneck} by default).", "",
              f"P7 verdict: steps complete with state {state / host:.1f}x the host budget. Step / max(compute, IO) "
              f"= {ratio:.2f}x (target <= {P7_TARGET}x): {'met' if ratio <= P7_TARGET else 'NOT met'}.", ""]
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's settings (``argv`` defaults to ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("p5", "p7", "both"), default="both")
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    parser.add_argument("--p5-model", default="gpt-small")
    parser.add_argument("--p5-batch-size", type=int, default=4)
    parser.add_argument("--p5-seq-len", type=int, default=64)
    parser.add_argument("--p5-device-mem", default="512MiB", help="device budget of the offloaded placement")
    parser.add_argument("--p5-host-mem", default="1GiB")
    parser.add_argument("--p5-rounds", type=int, default=7)
    parser.add_argument("--p5-steps", type=int, default=3, help="steps per contestant per round")
    parser.add_argument("--p5-warmup", type=int, default=2)
    parser.add_argument("--p7-model", default="gpt-1.3b")
    parser.add_argument("--p7-batch-size", type=int, default=1)
    parser.add_argument("--p7-seq-len", type=int, default=128)
    parser.add_argument("--p7-host-mem", default="4GiB")
    parser.add_argument("--p7-device-mem", default=None,
                        help="the whole device budget, activations included (default: the model's measured "
                             "activation reserve plus --p7-device-arena)")
    parser.add_argument("--p7-device-arena", default="2GiB",
                        help="device bytes for shards beside the activations, when --p7-device-mem is not given")
    parser.add_argument("--p7-steps", type=int, default=3, help="measured steps after one warm-up step")
    parser.add_argument("--p7-grad-clip", type=float, default=0.0,
                        help="0 lets each unit's update (and its state IO) overlap the backward; exact clipping "
                             "makes every update wait for the whole backward (exec/step.py, [Note: clipping])")
    parser.add_argument("--nvme-dir", default=os.path.join(tempfile.gettempdir(), "luwu-bench-nvme"),
                        help="a directory on a real disk (not tmpfs); default under the system temp directory")
    parser.add_argument("--trace", default=None, help="write P7's last step as Chrome trace JSON")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Training step: P5 / P7 ({now})", "", f"Machine: {_machine()}.", "",
             f"Command: `python benchmarks/bench_train.py {' '.join(sys.argv[1:])}`", ""]
    if args.part in ("p5", "both"):
        lines += _p5(args)
    if args.part in ("p7", "both"):
        lines += _p7(args)
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
