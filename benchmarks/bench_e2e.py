"""P10 and P11 (benchmarks/README.md): training end to end, ours beside the systems users would pick instead,
in one run, and the planner's predicted step beside each of ours.

Contestants, all on the same model (a GPT preset materialised from the same seed), the same global batch
(the embedded corpus, drawn as ``luwu train`` draws it, each rank its rows), the same AdamW settings
(lr 3e-3 with 20 warm-up steps and cosine decay, betas 0.9/0.95, eps 1e-8, weight decay 0.1, global-norm
clipping at 1.0), fp32:

- ours: ``luwu train`` through ``luwu bench e2e``'s machinery (luwu_rt/cli/bench_e2e.py): ``local`` with
  every state on the device tier (in memory, as the peers hold it) and ``--nproc`` ranks of ``ddp`` and
  ``zero3`` on the device tier, ``zero3`` with parameters and optimizer state on the host, and on NVMe;
- plain PyTorch in memory (one process, ``torch.optim.AdamW(fused=True)``);
- torch ``DistributedDataParallel``; FSDP2 ``fully_shard`` on a CPU gloo mesh, and with
  ``CPUOffloadPolicy(pin_memory=False)``;
- DeepSpeed ZeRO-3 through its CPU accelerator (``DS_ACCELERATOR=cpu``, gloo): ZeRO-Offload
  (``offload_optimizer`` and ``offload_param`` to cpu) and ZeRO-Infinity (to nvme, parameter prefetch off:
  ``stage3_prefetch_bucket_size`` 0 and ``stage3_max_reuse_distance`` 0, DeepSpeed issue 3062), both with
  ``DeepSpeedCPUAdam`` and ``pin_memory`` false.

Each contestant runs as processes of its own (``--nproc`` ranks, each pinned to its share of the cores as
ours are), ``--steps`` steps, the first one warm-up; rounds take turns, the order rotated; a contestant's
figure in a round is its median step (per step the slowest rank's), a ratio the median over rounds of the
ratio in that round. A peer that cannot run here is listed with its exact error, not dropped. Reported:
tokens/s, step time, peak resident memory of the largest process, the last loss (every contestant trains
the same thing), ours / peer per pair (P10: <= 0.8x ZeRO-Offload's step with state on the host and <= 0.8x
ZeRO-Infinity's with state on NVMe), and per configuration of ours the planner's predicted step and its error
(P11: within 10%).

    python benchmarks/bench_e2e.py [--model gpt-small] [--batch-size 8] [--seq-len 256] [--nproc 2]
        [--steps 4] [--rounds 3] [--nvme-dir DIR] [--profile FILE] [--out FILE] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from report import cpu_model, emit  # benchmarks/report.py

ROOT = Path(__file__).resolve().parents[1]
OPTIM = {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 20, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
         "grad_clip": 1.0}
"""TrainConfig's AdamW defaults, which ``luwu train`` runs with."""
PEERS = ("plain", "torch-ddp", "fsdp2", "fsdp2-offload", "ds-zero-offload", "ds-zero-infinity")
OURS = {"ours local device": ("local", "device"), "ours ddp device": ("ddp", "device"),
        "ours zero3 device": ("zero3", "device"), "ours zero3 host": ("zero3", "host"),
        "ours zero3 nvme": ("zero3", "nvme")}
PAIRS = (("ours local device", "plain", None), ("ours ddp device", "torch-ddp", None),
         ("ours zero3 device", "fsdp2", None), ("ours zero3 host", "fsdp2-offload", None),
         ("ours zero3 host", "ds-zero-offload", 0.8), ("ours zero3 nvme", "ds-zero-infinity", 0.8))
"""(ours, peer, P10 target or None): the same placement on both sides."""
_ONE_RANK = ("plain",)


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


# -- a peer's rank ---------------------------------------------------------------------------------

def _batches(args, *, rank: int, world: int, count: int):
    """The batches ``luwu train`` draws (embedded corpus, seed 0), this rank's rows of each."""
    from luwu_rt.data import BatchSampler, load_tokens
    from luwu_rt.models.presets import get_preset

    vocab = get_preset(args.model).vocab_size
    tokens = load_tokens(None, vocab_size=vocab)
    sampler = BatchSampler(tokens.train, batch_size=args.batch_size * world, seq_len=args.seq_len, seed=0,
                           vocab_size=vocab)
    b = args.batch_size
    return [tuple(t[rank * b:(rank + 1) * b] for t in sampler.batch(i)) for i in range(count)]


def _deepspeed(model, args, *, nvme: bool):
    import deepspeed

    from luwu_rt.io import BLOCK_BYTES, QUEUE_DEPTH

    offload = {"device": "nvme" if nvme else "cpu", "pin_memory": False}
    params = dict(offload)
    zero = {"stage": 3, "offload_optimizer": dict(offload), "offload_param": params}
    if nvme:
        path = os.path.join(args.nvme_dir, f"ds-rank{os.environ['RANK']}")
        os.makedirs(path, exist_ok=True)
        zero["offload_optimizer"]["nvme_path"] = params["nvme_path"] = path
        params.update(buffer_count=5, buffer_size=1 << 24)
        # DeepSpeed issue 3062: with parameter prefetch on, "Not enough buffers 0 for swapping 1".
        zero.update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    config = {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": 1,
              "gradient_clipping": OPTIM["grad_clip"], "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": OPTIM["lr"], "betas": list(OPTIM["betas"]),
                                                        "eps": OPTIM["eps"], "weight_decay": OPTIM["weight_decay"]}},
              # Its async IO at our IO engine's settings: the same pieces, as many in flight.
              "aio": {"block_size": BLOCK_BYTES, "queue_depth": QUEUE_DEPTH, "single_submit": False,
                      "overlap_events": True}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(x, y, lr):
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return step, f"deepspeed {deepspeed.__version__}, {type(engine.optimizer).__name__} with {type(optimizer).__name__}"


def _torch_optimizer(params):
    import torch

    errors = []
    for flavour in ("fused", "foreach"):
        try:
            opt = torch.optim.AdamW(params, lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"],
                                    weight_decay=OPTIM["weight_decay"], **{flavour: True})
            for p in params:
                p.grad = torch.zeros_like(p)
            for g in opt.param_groups:
                g["lr"], g["weight_decay"] = 0.0, 0.0
            opt.step()  # probe the flavour on the real tensors, moving nothing
            opt.state.clear()
            for g in opt.param_groups:
                g["weight_decay"] = OPTIM["weight_decay"]
            return opt, f"torch.optim.AdamW({flavour}=True)" + (f" [{'; '.join(errors)}]" if errors else "")
        except Exception as exc:  # noqa: BLE001 - the next flavour; the report says why
            errors.append(f"{flavour}: {type(exc).__name__}: {exc}")
        finally:
            for p in params:
                p.grad = None
    raise RuntimeError("; ".join(errors))


def _torch_peer(name: str, model, world: int):
    import torch

    if name == "torch-ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif name.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if name == "fsdp2-offload" else {}
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **policy)
        model = fully_shard(model, mesh=mesh, **policy)
    params = list(model.parameters())
    opt, kind = _torch_optimizer(params)

    def step(x, y, lr):
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, OPTIM["grad_clip"])
        opt.step()
        return loss

    return step, kind


def _peer_rank(args) -> None:
    """One rank of peer ``args.peer``: builds it, runs ``args.steps`` steps, writes its times and loss."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        from luwu_rt.dist.launch import pin_cores

        pin_cores(rank, world)
    import torch
    import torch.distributed as dist

    if args.peer.startswith("ds-"):
        import torch._dynamo  # noqa: F401 - before DeepSpeed patches modules (a signature-mismatch TypeError)
        import transformers  # noqa: F401
        import deepspeed

        deepspeed.init_distributed("gloo")
    elif args.peer != "plain":  # DDP and FSDP2 need a process group, one rank or more
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    from luwu_rt.models.gpt import build_gpt
    from luwu_rt.optim.schedule import lr_at

    model = build_gpt(args.model, device="cpu", seed=0).model
    if args.peer.startswith("ds-"):
        step, kind = _deepspeed(model, args, nvme=args.peer == "ds-zero-infinity")
    else:
        step, kind = _torch_peer(args.peer, model, world)
    times, losses = [], []
    for i, (x, y) in enumerate(_batches(args, rank=rank, world=world, count=args.steps)):
        lr = lr_at(i + 1, lr=OPTIM["lr"], min_lr=OPTIM["min_lr"], warmup_steps=OPTIM["warmup_steps"],
                   total_steps=args.steps)
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        loss = step(x, y, lr).detach()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= world
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    result = {"times": times, "losses": losses, "kind": kind}
    Path(f"{args.result}.rank{rank}").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error(stderr: str) -> str:
    """The exception a failed rank ended with: its last line that names one, else its last lines that are not
    a warning (a warning's line and the source line Python prints under it). The reports are committed: this
    machine's site-packages directory is shortened to ``<site-packages>``."""
    lines, warned = [], False
    for ln in (ln.strip() for ln in stderr.splitlines()):
        if ln and not warned and "Warning: " not in ln:
            lines.append(ln)
        warned = "Warning: " in ln
    named = [ln for ln in lines if ("Error" in ln or "Exception" in ln) and ":" in ln and not ln.startswith("File ")]
    text = named[-1] if named else " / ".join(lines[-3:])
    for where in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        text = text.replace(where, "<site-packages>")
    return text[:600]


def run_peer(name: str, args, workdir: str) -> dict:
    """``name`` on its ranks (``--nproc``, one for plain): per step the slowest rank's time, the peak RSS of
    the largest rank; ``{"error": ...}`` when it cannot run here."""
    from luwu_rt.cli.bench_e2e import peak_rss

    world = 1 if name in _ONE_RANK else args.nproc
    result = os.path.join(workdir, f"{name}.json")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                        os.environ.get("PYTHONPATH")]))}
    if name.startswith("ds-"):
        env["DS_ACCELERATOR"] = "cpu"
    cmd = [sys.executable, __file__, "--peer", name, "--result", result, "--model", args.model, "--batch-size",
           str(args.batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--nvme-dir",
           args.nvme_dir, "--timeout", str(args.timeout)]
    logs = [open(f"{result}.stderr{r}", "w+") for r in range(world)]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL,
                              stderr=logs[r]) for r in range(world)]
    # Peak memory sampled while the ranks run, as ours is ([Note: a child's peak memory]).
    deadline, rss = time.monotonic() + args.timeout, 0
    while any(p.poll() is None for p in procs):
        rss = peak_rss([p.pid for p in procs if p.poll() is None], rss)
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
                p.wait()
            return {"error": f"timed out after {args.timeout:.0f} s"}
        time.sleep(0.2)
    errs = []
    for log in logs:
        log.seek(0)
        errs.append(log.read())
        log.close()
    written = all(Path(f"{result}.rank{r}").exists() for r in range(world))
    exit_note = ""
    if any(p.returncode for p in procs):
        failed = next(i for i, p in enumerate(procs) if p.returncode)
        error = _error(errs[failed] or f"exit status {procs[failed].returncode}")
        if not written:
            return {"error": error}
        # Every rank wrote its times (after its last step) before one of them failed: DeepSpeed ZeRO-Offload's
        # ranks end with "terminate called without an active exception" as they exit, in some runs. The steps
        # were measured whole; the report says how the run ended.
        exit_note = f"rank {failed} exited with status {procs[failed].returncode} after writing its result: {error}"
    ranks = [json.loads(Path(f"{result}.rank{r}").read_text()) for r in range(world)]
    times = [max(r["times"][i] for r in ranks) for i in range(args.steps)]
    return {"step_s": statistics.median(times[1:]), "loss": ranks[0]["losses"][-1],
            "rss": rss, "kind": ranks[0]["kind"], "ranks": world, "exit_note": exit_note}


# -- the run --------------------------------------------------------------------------------------

def _ours(args):
    from luwu_rt.cli.bench_e2e import Config

    return {label: Config(model=args.model, strategy=s, nproc=1 if s == "local" else args.nproc, placement=p,
                          batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
                          device_mem=args.device_mem, host_mem=args.host_mem)
            for label, (s, p) in OURS.items()}


def _contest(args, workdir: str) -> tuple[dict, dict, dict]:
    """Rounds of every contestant: (per-round figures, errors, details), and our results with predictions."""
    from tqdm import tqdm

    from luwu_rt.cli.bench_e2e import model_profiles, predict, result_of, run_config

    ours = _ours(args)
    profiles = model_profiles(list(ours.values()), profile=args.profile, directory=workdir,
                              say=lambda line: print(line, file=sys.stderr))
    names = list(ours) + [p for p in args.peers]
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    runs: dict[str, list[dict]] = {n: [] for n in ours}
    errors: dict[str, str] = {}
    with tqdm(total=args.rounds * len(names), unit="run", file=sys.stderr, dynamic_ncols=True) as bar:
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                bar.set_description(f"round {r + 1}/{args.rounds}: {name}")
                if name in errors:
                    bar.update(1)
                    continue
                if name in ours:
                    c = ours[name]
                    got = run_config(c, workdir=os.path.join(workdir, f"{r}-{name.replace(' ', '_')}"),
                                     profile=profiles[c], nvme_dir=args.nvme_dir)
                    runs[name].append(got)
                    lines = got["lines"]
                    rounds[name].append({"step_s": statistics.median(x["step_s"] for x in lines[1:]),
                                         "loss": lines[-1]["loss"], "rss": got["peak_rss_bytes"],
                                         "ranks": c.nproc, "kind": "luwu_rt"})
                else:
                    got = run_peer(name, args, workdir)
                    if "error" in got:
                        errors[name] = got["error"]
                    else:
                        rounds[name].append(got)
                bar.update(1)
    predicted = [result_of(c, runs[name], [predict(c, profile=profiles[c], nvme_dir=args.nvme_dir)])
                 for name, c in ours.items() if runs[name]]
    return rounds, errors, {"ours": ours, "predicted": predicted}


def _tokens(args, ranks: int) -> int:
    return args.batch_size * args.seq_len * ranks


def report(args, rounds: dict, errors: dict, extra: dict, load_before: str) -> list[str]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# End to end: ours beside the peers (P10) and the planner's predictions (P11), {now}", "",
             f"Machine: {cpu_model()}, {os.cpu_count()} cpus. Load average before {load_before}; after {_load()}.", "",
             f"Command: `python benchmarks/bench_e2e.py {' '.join(sys.argv[1:])}`", "",
             f"{args.model}, fp32, batch {args.batch_size} x seq {args.seq_len} per rank, {args.nproc} ranks where "
             f"data parallel, {args.steps} steps per run (the first warm-up), {args.rounds} rounds.", "",
             "| contestant | ranks | tokens/s | step s per round | median step s | peak RSS MB | last loss | "
             "optimizer |", "|---|---|---|---|---|---|---|---|"]
    for name, runs in rounds.items():
        if name in errors:
            lines.append(f"| {name} | | unavailable: {errors[name]} | | | | | |")
            continue
        if not runs:
            continue
        step = statistics.median(x["step_s"] for x in runs)
        lines.append(f"| {name} | {runs[0]['ranks']} | {_tokens(args, runs[0]['ranks']) / step:,.0f} | "
                     f"{', '.join(format(x['step_s'], '.3f') for x in runs)} | {step:.3f} | "
                     f"{max(x['rss'] for x in runs) / 1e6:,.0f} | {runs[-1]['loss']:.4f} | {runs[0]['kind']} |")
    notes = [f"- {name}, round {i + 1}: {x['exit_note']}" for name, runs in rounds.items()
             for i, x in enumerate(runs) if x.get("exit_note")]
    if notes:
        lines += ["", "Runs that ended badly after every rank wrote its measured steps (their figures are kept):", "",
                  *notes]
    lines += ["", "Ours / peer, the same placement (median over rounds of the ratio in that round; range):", "",
              "| ours | peer | step ratio | range | peak RSS ratio | P10 target | verdict |",
              "|---|---|---|---|---|---|---|"]
    for ours, peer, target in PAIRS:
        if ours not in rounds or peer not in rounds:
            continue
        if peer in errors or not rounds[peer] or not rounds[ours]:
            lines.append(f"| {ours} | {peer} | n/a: {errors.get(peer, 'not run')} | | | {target or ''} | |")
            continue
        ratios = [a["step_s"] / b["step_s"] for a, b in zip(rounds[ours], rounds[peer])]
        mem = max(x["rss"] for x in rounds[ours]) / max(x["rss"] for x in rounds[peer])
        ratio = statistics.median(ratios)
        verdict = "" if target is None else ("met" if ratio <= target and mem <= target else "NOT met")
        lines.append(f"| {ours} | {peer} | {ratio:.2f}x | {min(ratios):.2f}-{max(ratios):.2f} | {mem:.2f}x | "
                     f"{f'<= {target}x' if target else ''} | {verdict} |")
    if extra["predicted"]:
        from luwu_rt.cli.bench_e2e import table

        lines += ["", "Ours, the planner's prediction beside each (the profile calibrated on this machine with the "
                      "model's compute rate; where the time went in the last round's last step):", ""] \
            + table(extra["predicted"])
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device-mem", default="auto")
    p.add_argument("--host-mem", default="auto")
    p.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS)
    p.add_argument("--nvme-dir", default=None, help="a directory on a real disk (default: under the system temp "
                                                     "directory)")
    p.add_argument("--profile", default="auto", help="the profile ours plans with (default auto)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a peer's run may take")
    p.add_argument("--out", default=None, help="also write the markdown report here")
    p.add_argument("--json-out", default=None, help="write the figures as JSON here (for tools/e2e_report.py)")
    p.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.peer:
        _peer_rank(args)
        return 0
    load_before = _load()
    with tempfile.TemporaryDirectory(prefix="luwu-bench-e2e-") as workdir:
        args.nvme_dir = args.nvme_dir or os.path.join(workdir, "nvme")
        os.makedirs(args.nvme_dir, exist_ok=True)
        rounds, errors, extra = _contest(args, workdir)
        lines = report(args, rounds, errors, extra, load_before)
    emit(lines, args.out)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items() if k not in ("peer", "result")},
            "load_average_before": load_before, "load_average_after": _load(), "rounds": rounds, "errors": errors,
            "predicted": [r.as_dict() for r in extra["predicted"]]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
