"""P9 (benchmarks/README.md): the data-parallel strategies on 2 ranks (gloo on loopback) beside torch's own.

One pair of rank processes (spawned with torchrun's environment, one torch thread each) builds every
contestant once in the same world: the engine under ``ddp``, ``zero1``, ``zero2``, ``zero3`` and ``hsdp``
with G=1 (hsdp with G=2 on 2 ranks *is* zero3), then the peers on the same model (the gpt preset as a plain
``nn.Module`` materialised on the CPU from the same seed), the same global batch split the same way, the
same schedule and clipping: torch ``DistributedDataParallel`` and FSDP2 ``fully_shard`` on a CPU gloo mesh,
each with ``torch.optim.AdamW`` (fused where it runs, else foreach). For reference also ``ddp-dev`` and
``zero3-dev``: every state on the device tier (one CPU arena), as the peers hold it. Contestants take turns
in every round; a round runs each contestant for a block of steps between two barriers, the contestants a
target compares back to back (ours ddp, torch DDP, ddp-dev; ours zero3, FSDP2, zero3-dev), the groups and
the order inside each rotated from round to round. Reported:

- step time: per step the slower rank's time, the round's figure the median over its steps, every ratio the
  median over rounds of the ratio measured in that round; targets ours ddp <= 1.05x torch DDP and ours
  zero3 <= 1.0x FSDP2;
- bytes sent per rank per step, measured: the loopback interface's ``tx_bytes`` (/proc/net/dev, ``lo``) read
  by rank 0 around each block, divided by the ranks and steps (both ranks, and nothing of ours else, talk
  on ``lo``; other processes of the machine may, so an idle interval is measured too), and each rank's own
  socket writes (``wchar`` of /proc/self/io: gloo's TCP transport writes with ``writev``); against the
  plan's ``Collective.comm_bytes`` and the textbook ring volume. A calibration of gloo's primitives on one
  16 MiB buffer shows what each moves on the wire;
- peak host memory per rank, in a fresh pair of rank processes per contestant (so one contestant's memory
  does not hide another's), ours with the host budget its plan peaks at: the plan's host peak; the host
  arena's resident bytes (mincore); and the whole process: the peak of RssAnon (sampled) less RssAnon after
  imports and joining the world, and VmHWM. Also ``ddp-lean`` / ``zero3-lean`` (recompute instead of kept
  graphs, smallest device budget). Target: zero3 <= 0.55x ddp.

The ranks take one core each; other processes on the machine add noise, so the report gives each
ratio's range over rounds, the CPU seconds per step beside the wall time, and the load average.

    python benchmarks/bench_dist.py [--out FILE] [--model gpt-small] [--batch-size 2] [--seq-len 64]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import multiprocessing as mp
import os
import platform
import resource
import socket
import statistics
import sys
import time
import traceback
from typing import Any

import torch

from report import cpu_model, emit  # benchmarks/report.py

RANKS = 2
DDP_TARGET = 1.05
ZERO3_TARGET = 1.0
BYTES_TOLERANCE = 0.05
HOST_TARGET = 0.55
_OPTIM = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2, "grad_clip": 1.0}
_TOTAL_STEPS = 10_000  # the schedule's horizon: a benchmark's few steps stay in warm-up and early decay
_OURS = ("ddp", "zero1", "zero2", "zero3", "hsdp-g1", "ddp-dev", "zero3-dev")
"""``-dev``: every state on the device tier (one CPU arena here, not pinned): the peers' arrangement, to tell
the cost of the host tier's copies from the cost of the strategy (timing only)."""
_PEERS = ("torch-ddp", "fsdp2")
_GROUPS = (("ddp", "torch-ddp", "ddp-dev"), ("zero3", "fsdp2", "zero3-dev"))
_MB = 1e6


# -- the machine ----------------------------------------------------------------------------------

def _machine() -> str:
    model = cpu_model()
    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        mem = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:")), 0)
    return (f"{model}, {os.cpu_count()} cpus, {mem / 2**30:.0f} GiB RAM, {RANKS} ranks x 1 torch thread, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def _revision() -> str:
    """The commit measured, and whether the working tree differs from it."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "luwu_rt"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"
    return f"commit {head}" + (" with uncommitted changes under luwu_rt/" if dirty else "")


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} at {time.strftime('%H:%M:%S', time.gmtime())} UTC"


def _lo_tx() -> int:
    """Bytes the loopback interface has sent (both ranks' traffic, headers included)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    raise RuntimeError("no lo interface in /proc/net/dev")


def _io() -> tuple[int, int]:
    """This process's (wchar, rchar): bytes passed to write-family / read-family syscalls, sockets included."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(":") for line in f)
    return int(fields["wchar"]), int(fields["rchar"])


def _status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _resident(t: torch.Tensor | None) -> int:
    """Bytes of ``t``'s memory resident in RAM (mincore over its pages)."""
    if t is None or t.numel() == 0:
        return 0
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.untyped_storage().nbytes() - start
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in bytes(vec)) * page


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# -- rank processes -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank: int, port: int, args: argparse.Namespace, extra: tuple, out) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(RANKS),
                       "LOCAL_WORLD_SIZE": str(RANKS), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        torch.set_num_threads(1)  # 2 ranks on 2 cores
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        out.put((rank, "ok", fn(rank, args, *extra)))
    except BaseException as exc:  # reported to the parent with its traceback
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _spawn(fn, args: argparse.Namespace, *extra: Any) -> list[Any]:
    """``[fn(0, args, *extra), fn(1, args, *extra)]``, each in a fresh process of a 2-rank gloo world."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, port, args, extra, out), daemon=True) for r in range(RANKS)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for _ in range(RANKS):
            rank, status, value = out.get(timeout=args.timeout * 4)
            (results if status == "ok" else errors)[rank] = value
            if errors:
                break
    finally:
        for p in procs:
            p.join(10 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} failed: {errors[rank]}")
    return [results[r] for r in range(RANKS)]


# -- contestants (inside a rank) ------------------------------------------------------------------

def _batches(vocab: int, args, count: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows [r*b, (r+1)*b) of each global batch of N*b sequences (the same for every contestant)."""
    g = torch.Generator().manual_seed(1)
    b = args.batch_size
    data = torch.randint(0, vocab, (count, RANKS * b, args.seq_len + 1), generator=g)[:, rank * b : (rank + 1) * b]
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


_LEAN = ("ddp-lean", "zero3-lean")
"""Memory runs only: recomputation instead of kept graphs (keep_graphs none) and the smallest device budget
the planner accepts, so that the activations and the device arena (host RAM here) weigh least."""


def _strategy_of(name: str) -> tuple[str, dict]:
    """(strategy, extra config) of one of our contestants."""
    base = name.removesuffix("-lean").removesuffix("-dev")
    return ("hsdp", {"shard_group_size": 1}) if base == "hsdp-g1" else (base, {})


def _config(name: str, args, *, host_mem: int | str | None = None, device_mem: int | str | None = None):
    from luwu_rt.config import from_mapping
    from luwu_rt.engine import TrainConfig

    strategy, extra = _strategy_of(name)
    fit = getattr(args, "fit", {}).get(name, {})
    tier = "device" if name.endswith("-dev") else "host"
    offload = {"params": tier, "optimizer": tier, "grads": tier, "chunk_size": args.chunk_size,
               "device_mem": device_mem or fit.get("device_mem",
                                                   args.dev_device_mem if tier == "device" else args.device_mem),
               "host_mem": host_mem or fit.get("host_mem", args.host_mem)}
    return from_mapping(TrainConfig, {
        "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": _TOTAL_STEPS,
        "seed": 0, "eval_every": 0, "strategy": strategy, "timeout": args.timeout, "optim": dict(_OPTIM),
        "keep_graphs": "none" if name.endswith("-lean") else "auto", "offload": offload, **extra})


def _plan_peak(name: str, args, *, host_mem, device_mem) -> dict[str, int]:
    """The plan's peak bytes per tier for one of our contestants, planned here as every rank will plan it."""
    from luwu_rt.engine.hwprofile import choose_profile, per_rank
    from luwu_rt.engine.kept import plan_kept
    from luwu_rt.engine.strategy import candidate_strategies, choose_plan
    from luwu_rt.models.adapt import as_unit_chain
    from luwu_rt.plan import Budgets, Placement

    config = _config(name, args, host_mem=host_mem, device_mem=device_mem)
    off = config.offload
    strategies = candidate_strategies(config.strategy, world_size=RANKS, shard_group_size=config.shard_group_size)
    budgets = Budgets(device_bytes=off.device_mem_bytes, host_bytes=off.host_mem_bytes, nvme_bytes=0)
    placement = Placement(params=off.params, optimizer=off.optimizer, grads=off.grads)
    # The profile the engine plans with: the kept graphs, and so the peak, are chosen by predicted time.
    profile = per_rank(choose_profile(config.profile), local_ranks=RANKS)
    kept = plan_kept(as_unit_chain(config.model), config, world_size=RANKS,
                     plan=lambda spec, explain: choose_plan(spec, strategies=strategies, budgets=budgets,
                                                            placement=placement, profile=profile, explain=explain))
    return dict(kept.result.plan.peak_bytes)


def _fit(name: str, args) -> dict[str, int]:
    """Budgets of one contestant: the host budget its plan peaks at under ``--host-mem`` (rounded up to
    MiB, or the next MiB that plans; the host arena is pinned at its whole budget, so a generous budget would
    hide what the strategy needs); for the lean runs also the smallest device budget that plans (MiB, by bisection)."""
    from luwu_rt.plan.sizes import parse_size

    mib = 2**20
    device = parse_size(args.dev_device_mem if name.endswith("-dev") else args.device_mem)
    if name in _LEAN:
        lo, hi = 1, device // mib  # the smallest budget in [lo, hi] that plans; hi does (the timing runs use it)
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                _plan_peak(name, args, host_mem=args.host_mem, device_mem=mid * mib)
                hi = mid
            except ValueError:
                lo = mid + 1
        device = hi * mib
    peak = _plan_peak(name, args, host_mem=args.host_mem, device_mem=device)["host"]
    host = max(-(-peak // mib), 1) * mib
    # The arena's layout may need a little more than the peak of live bytes (holes between shards): the
    # smallest whole MiB from the peak up that plans (zero2 of gpt-small peaks at 352.3 MiB and plans at 354).
    while host < parse_size(args.host_mem):
        try:
            _plan_peak(name, args, host_mem=host, device_mem=device)
            break
        except ValueError:
            host += mib
    return {"host_mem": host, "device_mem": device}


class _Ours:
    """The engine under one strategy; keeps each step's metrics."""

    kind = "ours"

    def __init__(self, name: str, args) -> None:
        from luwu_rt.engine import Engine

        self.engine = Engine(None, _config(name, args))
        self.metrics: list[dict] = []
        self.optimizer_kind = "luwu fused AdamW"

    def __call__(self, batch) -> float:
        self.metrics.append(self.engine.train_step(batch))
        return self.metrics[-1]["loss"]

    def busy(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.engine.last_spans:
            out[s.queue] = out.get(s.queue, 0.0) + (s.end_s - s.start_s)
        return out

    def plan_info(self) -> dict[str, Any]:
        from luwu_rt.plan.ops import Collective

        plan = self.engine.plan
        by_kind: dict[str, int] = {}
        for op in plan.ops:
            if isinstance(op, Collective) and op.comm_bytes:
                key = f"{op.collective}/{op.group}"
                by_kind[key] = by_kind.get(key, 0) + op.comm_bytes
        return {"comm_bytes": sum(by_kind.values()), "comm_by_kind": by_kind,
                "host_peak": plan.peak_bytes.get("host", 0), "device_peak": plan.peak_bytes.get("device", 0),
                "host_arena": plan.arena_bytes.get("host", 0), "device_arena": plan.arena_bytes.get("device", 0),
                "placement": str(self.engine.placement), "strategy": str(self.engine.strategy.name),
                "num_params": self.engine.chain.num_params, "host_mem": self.engine.config.offload.host_mem_bytes,
                "device_mem": self.engine.config.offload.device_mem_bytes,
                "kept": self.engine.compute.kept_bytes, "snapshot": self.engine.compute.snapshot_bytes}


class _Peer:
    """A plain ``nn.Module`` GPT under torch DDP or FSDP2; its step: the engine's learning-rate schedule,
    forward, backward, global-norm clipping, AdamW, and the loss averaged over the ranks (as ours reports)."""

    kind = "peer"

    def __init__(self, name: str, args) -> None:
        import torch.distributed as dist
        from torch import nn

        from luwu_rt.models.gpt import build_gpt

        self.name = name
        model = build_gpt(args.model, device="cpu", seed=0).model
        self.num_params = sum(p.numel() for p in model.parameters())
        if name == "torch-ddp":
            self.module: nn.Module = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (RANKS,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            self.module = fully_shard(model, mesh=mesh)
        self.params = [p for p in self.module.parameters()]
        self.opt, self.optimizer_kind = self._adamw()
        self.count = 0
        self.dist = dist

    def _adamw(self) -> tuple[torch.optim.Optimizer, str]:
        errors = []
        for flavour in ("fused", "foreach"):
            opt = torch.optim.AdamW(self.params, lr=_OPTIM["lr"], betas=(0.9, 0.95), weight_decay=0.1,
                                    **{flavour: True})
            try:  # a zero-gradient step on a copy would move nothing; probe on the real tensors with lr 0
                for p in self.params:
                    p.grad = torch.zeros_like(p)
                for group in opt.param_groups:
                    group["lr"] = 0.0
                    group["weight_decay"] = 0.0
                opt.step()
                opt.state.clear()
                for group in opt.param_groups:
                    group["weight_decay"] = 0.1
                return opt, f"torch.optim.AdamW({flavour}=True)" + (f" [{'; '.join(errors)}]" if errors else "")
            except Exception as exc:  # noqa: BLE001 - fall back to the next flavour, say why
                errors.append(f"{flavour}: {type(exc).__name__}: {exc}")
            finally:
                for p in self.params:
                    p.grad = None
        raise RuntimeError("; ".join(errors))

    def __call__(self, batch) -> float:
        from luwu_rt.optim.schedule import lr_at

        self.count += 1
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.count, lr=_OPTIM["lr"], min_lr=_OPTIM["min_lr"],
                                warmup_steps=_OPTIM["warmup_steps"], total_steps=_TOTAL_STEPS)
        self.opt.zero_grad(set_to_none=True)
        loss = self.module(*batch)
        loss.backward()
        if _OPTIM["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(self.params, _OPTIM["grad_clip"])
        self.opt.step()
        total = loss.detach().reshape(1).double() / RANKS
        self.dist.all_reduce(total)
        return float(total)


def _build(name: str, args):
    return _Peer(name, args) if name in _PEERS else _Ours(name, args)


def _together(group, fn) -> tuple[Any, str | None]:
    """``fn()`` on both ranks; (its result, None), or (None, the first rank's error) on both when any failed."""
    import torch.distributed as dist

    try:
        mine, error = fn(), None
    except Exception as exc:  # noqa: BLE001 - reported, the contestant is listed with it
        mine, error = None, f"{type(exc).__name__}: {exc}".strip()
        traceback.print_exc()
    errors: list[Any] = [None] * RANKS
    dist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e is not None), None)
    return (None, first) if first is not None else (mine, None)


# -- calibration: what gloo's primitives put on the wire ---------------------------------------------

def _all_to_all(full: torch.Tensor) -> torch.Tensor:
    """Rank r receives every rank's piece r: (ranks, n / ranks)."""
    import torch.distributed as dist

    out = torch.empty_like(full)
    dist.all_to_all_single(out, full)
    return out.view(RANKS, -1)


def _calibrate(group, args) -> list[dict]:
    """Each primitive our handlers and the peers call, on one fp32 buffer of ``calib_mib`` MiB (the full
    buffer; reduce-scatter / all-gather pieces are 1/N of it): bytes each rank sent, time."""
    import torch.distributed as dist

    from luwu_rt.dist import TorchGroup

    n = args.calib_mib * 2**20 // 4
    full = torch.ones(n)
    piece = torch.ones(n // RANKS)
    pieces = [torch.ones(n // RANKS) for _ in range(RANKS)]
    ours = TorchGroup(None)  # [Note: collectives on gloo] in luwu_rt/dist/collectives.py
    cases = {
        "all_reduce (ours, peers)": (lambda: dist.all_reduce(full), 2 * (RANKS - 1) / RANKS),
        "TorchGroup.reduce_scatter (ours: point to point)": (
            lambda: ours.reduce_scatter(piece, list(full.chunk(RANKS))).wait(), (RANKS - 1) / RANKS),
        "TorchGroup.all_gather (ours: point to point)": (
            lambda: ours.all_gather(list(full.chunk(RANKS)), piece).wait(), (RANKS - 1) / RANKS),
        "reduce_scatter (list)": (lambda: dist.reduce_scatter(piece, list(full.chunk(RANKS))), (RANKS - 1) / RANKS),
        "reduce_scatter_tensor (FSDP2)": (lambda: dist.reduce_scatter_tensor(piece, full), (RANKS - 1) / RANKS),
        "all_to_all_single + local sum (a reduce-scatter)": (lambda: torch.sum(_all_to_all(full), 0, out=piece),
                                                             (RANKS - 1) / RANKS),
        "all_gather (list)": (lambda: dist.all_gather(pieces, piece), (RANKS - 1) / RANKS),
        "all_gather_into_tensor (FSDP2)": (lambda: dist.all_gather_into_tensor(full, piece), (RANKS - 1) / RANKS),
    }
    rows = []
    reps = 3
    for name, (call, ring) in cases.items():
        try:
            call()  # warm-up (connections, buffers)
        except Exception as exc:  # noqa: BLE001
            rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"})
            dist.barrier(group=group)
            continue
        dist.barrier(group=group)
        lo0, (w0, _), t0 = _lo_tx(), _io(), time.perf_counter()
        for _ in range(reps):
            call()
        dist.barrier(group=group)
        seconds = (time.perf_counter() - t0) / reps
        lo1, (w1, _) = _lo_tx(), _io()
        rows.append({"name": name, "sent": (w1 - w0) / reps, "lo": (lo1 - lo0) / reps, "ring": ring * n * 4,
                     "full": n * 4, "s": seconds})
    return rows


# -- the timing run ---------------------------------------------------------------------------------

def _timing_rank(rank: int, args) -> dict[str, Any]:
    import torch.distributed as dist

    bench = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.timeout))
    out: dict[str, Any] = {"calibration": _calibrate(bench, args)}
    # Background on lo: what the machine's other processes send while we idle.
    dist.barrier(group=bench)
    lo0, t0 = _lo_tx(), time.perf_counter()
    time.sleep(args.idle_s)
    out["idle_lo_per_s"] = (_lo_tx() - lo0) / (time.perf_counter() - t0)

    from luwu_rt.models.presets import get_preset

    vocab = get_preset(args.model).vocab_size
    count = args.warmup + args.rounds * args.steps
    batches = _batches(vocab, args, count, rank)
    contestants: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    first_loss: dict[str, float] = {}
    losses: dict[str, list[float]] = {}
    build_s: dict[str, float] = {}
    names = [n for n in (*_OURS, *_PEERS) if n not in args.skip]
    for name in names:
        start = time.perf_counter()
        # A contestant that cannot be built or cannot take its first step is listed with the error.
        c, error = _together(bench, lambda: _build(name, args))
        if error is None:
            loss, error = _together(bench, lambda: c(batches[0]))
        if error is not None:
            unavailable[name] = error
            continue
        contestants[name], first_loss[name], losses[name] = c, loss, [loss]
        build_s[name] = time.perf_counter() - start
        print(f"rank {rank}: built {name} in {build_s[name]:.1f}s, step-1 loss {loss:.6f}", file=sys.stderr)
    names = list(contestants)
    for i in range(1, args.warmup):
        for name in names:
            losses[name].append(contestants[name](batches[i]))

    rounds: dict[str, list[dict]] = {n: [] for n in names}
    # Contestants compared by a ratio run back to back (other processes' load drifts within a round);
    # the groups rotate from round to round and so does the order inside each group.
    groups = [[n for n in g if n in contestants] for g in _GROUPS]
    groups = [g for g in groups if g] + [[n] for n in names if not any(n in g for g in _GROUPS)]
    for r in range(args.rounds):
        chunk = batches[args.warmup + r * args.steps:][: args.steps]
        order = [n for g in groups[r % len(groups):] + groups[: r % len(groups)]
                 for n in g[r % len(g):] + g[: r % len(g)]]
        for name in order:
            c = contestants[name]
            dist.barrier(group=bench)
            lo0, (w0, r0), cpu0 = _lo_tx(), _io(), _cpu_s()
            times, busy = [], []
            for batch in chunk:
                t = time.perf_counter()
                losses[name].append(c(batch))
                times.append(time.perf_counter() - t)
                if isinstance(c, _Ours):
                    busy.append(c.busy())
            dist.barrier(group=bench)
            lo1, (w1, r1), cpu1 = _lo_tx(), _io(), _cpu_s()
            rounds[name].append({"times": times, "lo": lo1 - lo0, "wchar": w1 - w0, "rchar": r1 - r0,
                                 "cpu": cpu1 - cpu0, "busy": busy})
        if rank == 0:
            print(f"round {r}: " + ", ".join(f"{n} {statistics.median(rounds[n][-1]['times']):.3f}s" for n in names),
                  file=sys.stderr)
    out.update(rounds=rounds, unavailable=unavailable, first_loss=first_loss, losses=losses, build_s=build_s,
               plans={n: c.plan_info() for n, c in contestants.items() if isinstance(c, _Ours)},
               optimizers={n: c.optimizer_kind for n, c in contestants.items()},
               num_params=get_preset(args.model).num_params)
    for c in contestants.values():
        if isinstance(c, _Ours):
            c.engine.close()
    return out


# -- the memory runs: one fresh pair of processes per contestant -------------------------------------

class _AnonPeak:
    """Samples RssAnon every ``interval_s`` on a thread: the kernel keeps the peak of the whole resident
    set (VmHWM, shared libraries' file pages included) but not of the anonymous memory alone."""

    def __init__(self, interval_s: float = 0.002) -> None:
        import threading

        self.peak = _status()["RssAnon"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.peak = max(self.peak, _status()["RssAnon"])

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status()["RssAnon"])


def _memory_rank(rank: int, args, name: str) -> dict[str, Any]:
    import torch.distributed as dist

    # Imports of everything a contestant uses, before the baseline.
    import luwu_rt.engine  # noqa: F401
    import luwu_rt.models.gpt  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    bench = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.timeout))
    dist.barrier(group=bench)
    from luwu_rt.models.presets import get_preset

    batches = _batches(get_preset(args.model).vocab_size, args, args.memory_steps, rank)
    base = _status()
    sampler = _AnonPeak()
    c, error = _together(bench, lambda: _build(name, args))
    if error is not None:
        sampler.stop()
        return {"error": error}
    built = _status()
    for batch in batches:
        c(batch)
    dist.barrier(group=bench)
    out = {"base": base, "built": built, "after": _status(), "anon_peak": sampler.stop()}
    if isinstance(c, _Ours):
        out["plan"] = c.plan_info()
        arenas = c.engine.store.arenas
        # Arena pages stay resident once touched (the host arena is mlocked whole): now = their peak.
        out["arena"] = {t: _resident(a.buffer) for t, a in arenas.items()}
        c.engine.close()
    return out


# -- the report -------------------------------------------------------------------------------------

def _textbook(name: str, params: int) -> tuple[float, str]:
    """Bytes one rank sends per step by the ring algorithm, fp32 (4-byte) gradients and parameters."""
    n, p = RANKS, params * 4
    name = name.removesuffix("-dev")
    rs = ag = (n - 1) / n * p
    if name in ("ddp", "hsdp-g1", "torch-ddp"):
        return 2 * (n - 1) / n * p, "all-reduce 2(N-1)/N*4P"
    if name in ("zero1", "zero2"):
        return rs + ag, "reduce-scatter + all-gather (N-1)/N*4P each"
    return rs + 2 * ag, "2 all-gathers + reduce-scatter (N-1)/N*4P each"


def _step_rows(timing) -> dict[str, dict[str, Any]]:
    """Per contestant: per-round figure (median over steps of the slower rank's step), bytes and CPU."""
    names = list(timing[0]["rounds"])
    out = {}
    for name in names:
        per_round, lo, sent, cpu = [], [], [], []
        for r, blocks in enumerate(zip(*(t["rounds"][name] for t in timing))):
            slow = [max(ts) for ts in zip(*(b["times"] for b in blocks))]
            steps = len(slow)
            per_round.append(statistics.median(slow))
            lo.append(blocks[0]["lo"] / RANKS / steps)
            sent.append([b["wchar"] / steps for b in blocks])
            cpu.append(sum(b["cpu"] for b in blocks) / RANKS / steps)
        out[name] = {"per_round": per_round, "lo": statistics.median(lo),
                     "sent": [statistics.median(s[r] for s in sent) for r in range(RANKS)],
                     "cpu": statistics.median(cpu), "cpu_rounds": cpu}
    return out


def _ratio(rows, ours: str, peer: str, key: str = "per_round") -> float | None:
    if ours not in rows or peer not in rows:
        return None
    return statistics.median(a / b for a, b in zip(rows[ours][key], rows[peer][key]))


def _spread(rows, ours: str, peer: str) -> str:
    ratios = sorted(a / b for a, b in zip(rows[ours]["per_round"], rows[peer]["per_round"]))
    return f"{ratios[0]:.2f}-{ratios[-1]:.2f}"


def _report(args, timing, memory, load_before, load_mid, elapsed) -> list[str]:
    t0 = timing[0]
    params = t0["num_params"]
    rows = _step_rows(timing)
    tokens = RANKS * args.batch_size * args.seq_len
    lines = [f"{args.model} ({params / 1e6:.1f}M params, {params * 4 / _MB:.1f} MB fp32), fp32 compute, global batch "
             f"{RANKS} ranks x {args.batch_size} x seq {args.seq_len} = {tokens} tokens per step; AdamW "
             f"lr {_OPTIM['lr']} (warm-up {_OPTIM['warmup_steps']}, cosine), betas 0.9/0.95, decay 0.1, global-norm "
             f"clipping {_OPTIM['grad_clip']} for every contestant. Ours: params, optimizer state and gradients on the "
             f"host tier (host budget: what each plan peaks at under {args.host_mem}, listed below; device budget "
             f"{args.device_mem} — a CPU arena here; chunk {args.chunk_size}), keep_graphs auto (as many as fit "
             f"the device budget). "
             f"Peers: the whole model in process memory. {args.warmup} warm-up steps each, then "
             f"{args.rounds} rounds x {args.steps} steps (ours ddp, torch DDP and ddp-dev back to back in every round, "
             f"and ours zero3, FSDP2 and zero3-dev; groups and order rotated); each step's time is the slower "
             f"rank's, a round's figure the median over its steps, ratios the median of per-round ratios.", "",
             f"Load: before {load_before}; after the timing run {load_mid}; at the end {_load()}. "
             f"Total {elapsed:.0f} s.", ""]

    lines += ["### Step time", "",
              "| contestant | optimizer | step s per round | median step s | tokens/s | CPU s per rank-step "
              "| vs ours ddp | step-1 loss |", "|---|---|---|---|---|---|---|---|"]
    ref = "ddp" if "ddp" in rows else None
    for name, row in rows.items():
        med = statistics.median(row["per_round"])
        vs = f"{_ratio(rows, name, ref):.3f}x" if ref else ""
        lines.append(f"| {name} | {t0['optimizers'][name]} | {', '.join(f'{x:.3f}' for x in row['per_round'])} | "
                     f"{med:.3f} | {tokens / med:,.0f} | {row['cpu']:.3f} | {vs} | {t0['first_loss'][name]:.6f} |")
    for name, error in t0["unavailable"].items():
        lines.append(f"| {name} | unavailable: `{error}` | | | | | | |")
    lines.append("")
    base = t0["first_loss"].get("ddp")
    if base is not None:
        worst = max(abs(t0["first_loss"][n] - base) / abs(base) for n in t0["first_loss"] if n in _OURS)
        peers = {n: abs(t0["first_loss"][n] - base) / abs(base) for n in t0["first_loss"] if n in _PEERS}
        lines.append(f"Step-1 losses: ours agree within {worst:.1e} relative; peers differ from ours ddp by "
                     + (", ".join(f"{n} {d:.1e}" for n, d in peers.items()) or "n/a")
                     + " relative (same init: the peers' modules are materialised from the same seed).")
        last = {n: v[-1] for n, v in t0["losses"].items()}
        lines += ["", "Loss after all steps: " + ", ".join(f"{n} {v:.4f}" for n, v in last.items()) + ".", ""]

    lines += ["Where our step time goes (rank 0, median over measured steps; queue busy seconds; "
              "`gather`/`reduce`/`reduce_cross` are the communication queues, their busy time includes waiting "
              "for the peer rank):", "",
              "| contestant | step s | compute | optim | reduce | reduce_cross | gather | h2d "
              "| d2h |", "|---|---|---|---|---|---|---|---|---|"]
    for name in rows:
        if name not in _OURS:
            continue
        busy = [b for blk in t0["rounds"][name] for b in blk["busy"]]
        steps = [s for blk in t0["rounds"][name] for s in blk["times"]]
        med = {q: statistics.median(b.get(q, 0.0) for b in busy) for q in
               ("compute", "optim", "reduce", "reduce_cross", "gather", "h2d", "d2h")}
        lines.append(f"| {name} | {statistics.median(steps):.3f} | "
                     + " | ".join(f"{v:.3f}" for v in med.values()) + " |")
    lines.append("")

    ddp_ratio, z3_ratio = _ratio(rows, "ddp", "torch-ddp"), _ratio(rows, "zero3", "fsdp2")
    lines += ["### Ratios ours / peer (median of per-round ratios)", "",
              "Step time is the target's measure; the CPU seconds (user + sys of both ranks per step) are less "
              "sensitive to other processes' load and show where a contestant spends more work.", "",
              "| ours | peer | step-time ratio | per-round range | CPU-time ratio | target | verdict |",
              "|---|---|---|---|---|---|---|"]
    for ours, peer, ratio, target in (("ddp", "torch-ddp", ddp_ratio, DDP_TARGET),
                                      ("zero3", "fsdp2", z3_ratio, ZERO3_TARGET),
                                      ("ddp-dev", "torch-ddp", _ratio(rows, "ddp-dev", "torch-ddp"), None),
                                      ("zero3-dev", "fsdp2", _ratio(rows, "zero3-dev", "fsdp2"), None),
                                      ("zero1", "torch-ddp", _ratio(rows, "zero1", "torch-ddp"), None),
                                      ("zero2", "torch-ddp", _ratio(rows, "zero2", "torch-ddp"), None),
                                      ("zero3", "torch-ddp", _ratio(rows, "zero3", "torch-ddp"), None)):
        if ratio is None:
            lines.append(f"| {ours} | {peer} | n/a (unavailable) | | | {f'<= {target}x' if target else ''} | |")
        else:
            verdict = ("met" if ratio <= target else "NOT met") if target else "(reference)"
            lines.append(f"| {ours} | {peer} | {ratio:.3f}x | {_spread(rows, ours, peer)} | "
                         f"{_ratio(rows, ours, peer, 'cpu_rounds'):.3f}x | {f'<= {target}x' if target else ''} | "
                         f"{verdict} |")
    lines.append("")

    idle = t0["idle_lo_per_s"]
    lines += ["### Bytes sent per rank per step", "",
              f"Measured two ways around each block of steps: `lo` = the loopback interface's tx_bytes "
              f"(/proc/net/dev; both ranks' traffic plus TCP/IP headers and ACKs, plus anything else on this "
              f"machine using loopback — {idle / 1e3:.1f} kB/s while the ranks idled) divided by {RANKS} ranks; "
              f"`wchar` = each rank's own write syscalls (/proc/self/io; gloo's TCP pairs write with writev, so "
              f"this is its payload plus gloo's framing, without TCP/IP headers). Textbook: the ring volume "
              f"for {params / 1e6:.2f}M fp32 elements; plan: the sum of the plan's Collective comm_bytes. "
              "Median over rounds.", "",
              "| contestant | textbook MB | plan MB | lo MB / rank | wchar MB rank 0 / rank 1 | lo / textbook "
              "| wchar / textbook | wchar / plan | textbook |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        book, what = _textbook(name, params)
        info = t0["plans"].get(name)
        sent = statistics.mean(row["sent"])
        cells = [name, f"{book / _MB:.2f}", f"{info['comm_bytes'] / _MB:.2f}" if info else "n/a",
                 f"{row['lo'] / _MB:.2f}",
                 " / ".join(f"{x / _MB:.2f}" for x in row["sent"]), f"{row['lo'] / book:.3f}", f"{sent / book:.3f}"]
        cells.append(f"{sent / info['comm_bytes']:.3f}" if info else "")
        lines.append("| " + " | ".join(cells + [what]) + " |")
    lines += ["", "The plans' collectives (bytes this rank sends per step, by kind/group):", ""]
    for name, info in t0["plans"].items():
        kinds = ", ".join(f"{k} {v / _MB:.2f} MB" for k, v in info["comm_by_kind"].items())
        lines.append(f"- {name} ({info['strategy']}, {info['placement']}, host budget "
                     f"{info['host_mem'] / 2**20:.0f} MiB): "
                     f"{kinds}")
    lines += ["", f"Calibration: gloo's primitives on one {args.calib_mib} MiB fp32 buffer (reduce-scatter input and "
              "all-gather output; each piece 1/N of it), bytes each rank writes (wchar, mean of the ranks):", "",
              "| primitive | ring MB | wchar MB | wchar / ring | lo MB / rank | s | algbw GB/s |",
              "|---|---|---|---|---|---|---|"]
    for r0, r1 in zip(timing[0]["calibration"], timing[1]["calibration"]):
        if "error" in r0:
            lines.append(f"| {r0['name']} | unavailable: `{r0['error']}` | | | | | |")
            continue
        sent = (r0["sent"] + r1["sent"]) / 2
        lines.append(f"| {r0['name']} | {r0['ring'] / _MB:.2f} | {sent / _MB:.2f} | {sent / r0['ring']:.3f} | "
                     f"{r0['lo'] / RANKS / _MB:.2f} | {max(r0['s'], r1['s']):.3f} | "
                     f"{r0['full'] / max(r0['s'], r1['s']) / 1e9:.2f} |")
    lines.append("")

    bases = sorted({m["base"]["RssAnon"] for mem in memory.values() for m in mem if "base" in m})
    lines += [] if not memory else ["### Peak host memory per rank", "",
              "Each contestant alone in a fresh pair of rank processes: built, then "
              f"{args.memory_steps} steps. Ours run with the host budget their plan peaks at (rounded up to MiB, "
              "or the next MiB that plans): "
              "the host arena is one mmap of the whole budget, mlocked (these ranks run as root, so mlock succeeds "
              "whatever RLIMIT_MEMLOCK says) and so resident in full from the start, whatever the plan uses. "
              "`-lean` runs: keep_graphs none (recompute, no kept activations) and the smallest device budget that "
              "plans. The device tier is a CPU arena here, i.e. host RAM too (not locked: resident as touched). "
              "Measured: `arena resident` = the arena's pages in RAM after the steps (mincore; arena pages are "
              "never released, so this is their peak) — the host tier's bytes; `peak - base` = the most anonymous "
              "resident memory (RssAnon, sampled every 2 ms from building to the last step) less RssAnon after "
              f"imports and joining the world (base: {', '.join(f'{b / _MB:.0f}' for b in bases)} MB) — the whole "
              "contestant: arenas, kept graphs, autograd's gradients, collective temporaries, the allocator's "
              "retained free memory; `outside arenas` = peak - base less both arenas; `VmHWM - base VmRSS` = the "
              "kernel's peak of the whole resident set less its size at the base (shared-library pages loaded "
              "later count too). kept / snapshot = bytes held by kept graphs at the last step and, of them, copies "
              "of parameters out of the device arena ([Note: kept graphs in the engine]). Figures rank 0 / rank 1; "
              "ratios of the rank means against ddp (the lean runs against ddp-lean).", "",
              "| contestant | host / device budget MiB | plan host / device peak MB | kept / snapshot MB "
              "| host arena resident MB | device arena resident MB | peak - base MB | outside arenas MB "
              "| VmHWM - base VmRSS MB | host arena vs ddp | plan host peak vs ddp | peak - base vs ddp |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def peak_of(mem) -> float:
        return statistics.mean(m["anon_peak"] - m["base"]["RssAnon"] for m in mem)

    def host_of(mem) -> float:
        return statistics.mean(m["arena"].get("host", 0) for m in mem)

    def ok(name) -> bool:
        return name in memory and "error" not in memory[name][0]

    def both(values) -> str:
        return " / ".join(f"{v / _MB:.0f}" for v in values)

    for name, mem in memory.items():
        if "error" in mem[0]:
            lines.append(f"| {name} | unavailable: `{mem[0]['error']}` | | | | | | | | | | |")
            continue
        ref = "ddp-lean" if name in _LEAN else "ddp"
        plan = mem[0].get("plan")
        peak = [m["anon_peak"] - m["base"]["RssAnon"] for m in mem]
        cells = [name]
        if plan:
            arena = [m["arena"] for m in mem]
            cells += [f"{plan['host_mem'] / 2**20:.0f} / {plan['device_mem'] / 2**20:.0f}",
                      f"{plan['host_peak'] / _MB:.1f} / {plan['device_peak'] / _MB:.1f}",
                      f"{plan['kept'] / _MB:.0f} / {plan['snapshot'] / _MB:.0f}",
                      both(a.get("host", 0) for a in arena), both(a.get("device", 0) for a in arena), both(peak),
                      both(p - sum(a.values()) for p, a in zip(peak, arena))]
        else:
            cells += ["n/a (whole model in process memory)", "", "", "", "", both(peak), ""]
        cells += [both(m["after"]["VmHWM"] - m["base"]["VmRSS"] for m in mem),
                  f"{host_of(mem) / host_of(memory[ref]):.3f}x" if plan and ok(ref) else "",
                  f"{plan['host_peak'] / memory[ref][0]['plan']['host_peak']:.3f}x" if plan and ok(ref) else "",
                  f"{peak_of(mem) / peak_of(memory[ref]):.3f}x" if ok(ref) else ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")

    verdicts = [f"ours ddp / torch DDP = {ddp_ratio:.3f}x (target <= {DDP_TARGET}x): "
                f"{'met' if ddp_ratio <= DDP_TARGET else 'NOT met'}" if ddp_ratio is not None else
                "ours ddp / torch DDP: peer unavailable",
                f"ours zero3 / FSDP2 = {z3_ratio:.3f}x (target <= {ZERO3_TARGET}x): "
                f"{'met' if z3_ratio <= ZERO3_TARGET else 'NOT met'}" if z3_ratio is not None else
                "ours zero3 / FSDP2: peer unavailable"]
    for what, ref in (("plan", lambda n: t0["plans"][n]["comm_bytes"]),
                      ("textbook", lambda n: _textbook(n, params)[0])):
        off = {n: statistics.mean(rows[n]["sent"]) / ref(n) - 1 for n in rows if n in t0["plans"]}
        bad = {n: v for n, v in off.items() if abs(v) > BYTES_TOLERANCE}
        verdicts.append(f"bytes sent (wchar) within {BYTES_TOLERANCE:.0%} of the {what}: "
                        + ("met for all" if not bad else
                           "NOT met for " + ", ".join(f"{n} {v:+.1%}" for n, v in bad.items())))
    for z3, ddp in (("zero3", "ddp"), ("zero3-lean", "ddp-lean")):
        if ok(z3) and ok(ddp):
            plan = memory[z3][0]["plan"]["host_peak"] / memory[ddp][0]["plan"]["host_peak"]
            host = host_of(memory[z3]) / host_of(memory[ddp])
            whole = peak_of(memory[z3]) / peak_of(memory[ddp])
            verdicts.append(f"{z3} / {ddp} peak host-tier bytes (target <= {HOST_TARGET}x): plan {plan:.3f}x "
                            f"{'met' if plan <= HOST_TARGET else 'NOT met'}, measured host arena {host:.3f}x "
                            f"{'met' if host <= HOST_TARGET else 'NOT met'}; the whole process (peak - base) "
                            f"{whole:.3f}x {'met' if whole <= HOST_TARGET else 'NOT met'}")
    lines += ["P9 verdicts: " + "; ".join(verdicts) + ".", ""]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--host-mem", default="1GiB")
    parser.add_argument("--device-mem", default="256MiB")
    parser.add_argument("--chunk-size", default="4MiB")
    parser.add_argument("--dev-device-mem", default="1GiB", help="device budget of the -dev contestants")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="steps per contestant per round")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per contestant (the first is step 1)")
    parser.add_argument("--memory-steps", type=int, default=3, help="steps of each memory run")
    parser.add_argument("--calib-mib", type=int, default=16)
    parser.add_argument("--idle-s", type=float, default=2.0, help="idle interval measuring others' loopback traffic")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--skip", nargs="*", default=[], help="contestants to leave out")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-contestant memory runs")
    parser.add_argument("--memory-contestants", nargs="*", default=None, metavar="NAME",
                        help="the contestants of the memory runs (default: all but the -dev ones; the ratios "
                             "compare against ddp and ddp-lean where they ran)")
    args = parser.parse_args()
    memory_names = [n for n in (*_OURS, *_LEAN, *_PEERS) if not n.endswith("-dev")]
    if args.memory_contestants is not None and set(args.memory_contestants) - set(memory_names):
        parser.error(f"--memory-contestants {' '.join(sorted(set(args.memory_contestants) - set(memory_names)))}: "
                     f"choose among {', '.join(memory_names)}")

    started = time.perf_counter()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = _load()
    revision = _revision()
    args.fit = {}
    args.fit = {name: _fit(name, args) for name in (*_OURS, *_LEAN) if name not in args.skip}
    timing = _spawn(_timing_rank, args)
    load_mid = _load()
    memory: dict[str, Any] = {}
    if not args.no_memory:
        for name in memory_names:
            if name in args.skip or (args.memory_contestants is not None and name not in args.memory_contestants):
                continue
            try:
                memory[name] = _spawn(_memory_rank, args, name)
            except RuntimeError as exc:
                memory[name] = [{"error": str(exc).splitlines()[0]}]
            print(f"memory {name}: done", file=sys.stderr)
    lines = [f"# Data-parallel strategies on {RANKS} ranks: P9 ({now})", "", f"Machine: {_machine()}.", "",
             f"Code: {revision}.", "",
             f"Command: `python benchmarks/bench_dist.py {' '.join(sys.argv[1:])}`", ""]
    lines += _report(args, timing, memory, load_before, load_mid, time.perf_counter() - started)
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
