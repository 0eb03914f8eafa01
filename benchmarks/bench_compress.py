"""Gradient compression (issue 23; benchmarks/README.md, P13): what each codec saves on the wire and costs in
step time at 2 ranks, and how fast its kernels are.

Part 1, codec throughput, in this process: encode + decode of ``--numel`` fp32 gradient elements (with error
feedback, chunks of 1M elements) by each codec, beside the memory-traffic probe of ``luwu bench optim``
(``luwu_rt/kernels/bench.py``: the bytes of a fused AdamW step moved with no arithmetic), in interleaved
rounds. A codec's figure is the bytes it must move (encode reads g and e, writes e and the payload; decode
reads the payload, writes the output) per second, over the probe's; target >= 0.5x for onebit and bf16.

Part 2, training at 2 ranks (gloo on loopback, one torch thread and one Numba thread per rank): ours under
``--strategy`` with each codec of ``--codecs`` beside torch ``DistributedDataParallel`` with its own
communication hooks (plain all-reduce, ``bf16_compress_hook``, PowerSGD of the same rank, in one bucket) on the same
model,
batches and AdamW, contestants in turn in every round, the order rotated. Per step the slower rank's time;
bytes sent per rank per step measured as each rank's socket writes (``wchar`` of /proc/self/io: gloo's TCP
transport writes with writev; nothing else of ours writes in the timed steps, every state being in memory).

The link: loopback moves GB/s, so communication would not matter as it does between servers. ``tc qdisc``
on ``lo`` needs root and would slow every process on the machine, so the rate limit is the benchmark's own:
every collective's completion (ours: the handle a plan's ``Wait`` completes; torch's: the future a comm
hook returns) is held until the bytes this rank has written to its sockets so far would have crossed a
``--link-gbps`` link (a token bucket over ``wchar``). Both sides pay the same link for the bytes they
really sent, with their own overlap of communication and compute. ``--link-gbps 0``: no limit.

Part 3 (``--part quality``, not in ``both``): what a codec costs in loss, and what a warm-up of uncompressed
steps buys back ([Note: compression warm-up] in luwu_rt/engine/engine.py): ours at 2 ranks, unthrottled, for
``--quality-steps`` seeded steps (peak learning rate 1e-3, 64 KiB storage chunks: the settings of
tests/dist/test_gloo_compressed.py), uncompressed and with ``--quality-codec`` after each ``--warmups`` count;
the mean loss of the last 20 steps against the uncompressed run's, and the bytes sent over the whole run.

    python benchmarks/bench_compress.py [--model gpt-tiny] [--batch-size 4] [--seq-len 64] [--link-gbps 0.1]
        [--codecs none,bf16,onebit,topk:0.01,powersgd:4] [--part both|codecs|training|quality] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import socket
import statistics
import threading
import time
from typing import Any

import torch
from report import cpu_model, emit  # benchmarks/report.py

RANKS = 2
THROUGHPUT_TARGET = 0.5
BYTES_TARGET = 10.0
_OPTIM = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2, "grad_clip": 1.0}
_PEERS = ("torch-ddp", "torch-ddp-bf16", "torch-ddp-powersgd")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--strategy", default="ddp", choices=("ddp", "zero1", "zero2"))
    p.add_argument("--codecs", default="none,bf16,onebit,topk:0.01,powersgd:4")
    p.add_argument("--powersgd-rank", type=int, default=4, help="rank of torch's PowerSGD hook")
    p.add_argument("--link-gbps", type=float, default=0.1, help="rate limit of each rank's link, GB/s (0: none)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per contestant per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contestant first")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--numel", type=int, default=16 << 20, help="elements of part 1's codec throughput")
    p.add_argument("--codec-rounds", type=int, default=5)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--quality-codec", default="topk:0.01", help="part 3: the codec whose warm-ups are compared")
    p.add_argument("--warmups", default="0,40,60,80,100,150", help="part 3: uncompressed steps before the codec")
    p.add_argument("--quality-steps", type=int, default=300, help="part 3: steps per run")
    p.add_argument("--part", default="both", choices=("both", "codecs", "training", "quality"),
                   help="part 1 (codec throughput), part 2 (training at 2 ranks), or both")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


# -- part 1: codec throughput -------------------------------------------------------------------------------

def _bytes_per_element(codec) -> float:
    """What encode + decode move per gradient element: g, e read, e written, payload written; payload read,
    output written."""
    return 16 + 2 * codec.payload_bytes(1 << 20) / (1 << 20)


def codec_throughput(args: argparse.Namespace) -> list[str]:
    from luwu_rt.compress import codec_for
    from luwu_rt.kernels.bench import (
        Contestant,
        OptimBench,
        OptimBenchConfig,
        run_rounds,
    )

    n = args.numel
    bench = OptimBench(OptimBenchConfig(numel=n, num_rounds=args.codec_rounds))
    contestants = bench.contestants(["probe"])
    grad = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-2
    codecs = {}
    for name in [c for c in args.codecs.split(",") if c != "none"]:
        codec = codecs[name] = codec_for(name, chunk_numel=1 << 20)
        residual, out = torch.zeros(n), torch.empty(n)
        payload = torch.empty(codec.payload_bytes(n), dtype=torch.uint8)

        def step(codec=codec, residual=residual, out=out, payload=payload) -> None:
            codec.encode(grad, residual, payload)
            codec.decode(payload, out)
        contestants.append(Contestant(name, step))
    results = run_rounds(contestants, numel=n, num_rounds=args.codec_rounds, num_reps=3, sync=lambda: None)
    probe_gbps = results.median("probe") * 1e6 * 28 / 1e9  # the probe moves a fp32 AdamW step's 28 B/param
    lines = [f"### Codec throughput: encode + decode of {n} fp32 elements (chunks of 1M, error feedback)", "",
             f"Probe: {probe_gbps:.1f} GB/s (luwu bench optim's memory-traffic probe, median of "
             f"{args.codec_rounds} rounds). A codec's GB/s: the bytes encode + decode must move per element "
             "times elements per second.", "",
             "| codec | M elements/s | bytes moved per element | GB/s | / probe | target |",
             "|---|---|---|---|---|---|"]
    for name, codec in codecs.items():
        per = _bytes_per_element(codec)
        gbps = results.median(name) * 1e6 * per / 1e9
        ratio = statistics.median(a * per / (b * 28) for a, b in zip(results.mparams_per_s[name],
                                                                      results.mparams_per_s["probe"]))
        target = THROUGHPUT_TARGET if codec.spec.family in ("onebit", "bf16") else None
        verdict = "" if target is None else f">= {target}x: {'met' if ratio >= target else 'NOT met'}"
        lines.append(f"| {name} | {results.median(name):.0f} | {per:.2f} | {gbps:.2f} | {ratio:.2f}x | {verdict} |")
    return lines


# -- part 2: training at 2 ranks ----------------------------------------------------------------------------

def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith("wchar"))


class Link:
    """This rank's rate limit: ``charge()`` holds the caller until every byte written so far would have crossed
    a ``gbps`` link (a token bucket over ``wchar``)."""

    def __init__(self, gbps: float) -> None:
        self.rate = gbps * 1e9
        self.lock = threading.Lock()
        self.seen = _wchar()
        self.free_at = time.perf_counter()

    def charge(self) -> None:
        if self.rate <= 0:
            return
        with self.lock:
            now, written = time.perf_counter(), _wchar()
            self.free_at = max(self.free_at, now) + (written - self.seen) / self.rate
            self.seen = written
            wait = self.free_at - now
        if wait > 0:
            time.sleep(wait)


def _throttled_group(link: Link):
    from luwu_rt.dist import TorchGroup
    from luwu_rt.exec import WaitAll

    class ThrottledGroup(TorchGroup):
        """``TorchGroup`` whose collectives complete no sooner than the link allows."""

        def all_reduce(self, tensor):
            return WaitAll([super().all_reduce(tensor)], link.charge)

        def reduce_scatter(self, output, inputs):
            return WaitAll([super().reduce_scatter(output, inputs)], link.charge)

        def all_gather(self, outputs, input):
            return WaitAll([super().all_gather(outputs, input)], link.charge)

        def all_to_all(self, output, input):
            return WaitAll([super().all_to_all(output, input)], link.charge)

    return ThrottledGroup


def _ours(args: argparse.Namespace, codec: str):
    from luwu_rt.config import from_mapping
    from luwu_rt.engine import Engine, TrainConfig

    config = from_mapping(TrainConfig, {
        "model": args.model, "strategy": args.strategy, "compress": codec, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "steps": 10_000, "eval_every": 0, "optim": dict(_OPTIM),
        "offload": {"params": "device", "grads": "device", "optimizer": "host", "device_mem": "2GiB",
                    "host_mem": "2GiB"}})
    engine = Engine(None, config)

    def step() -> float:
        return engine.train_step()["loss"]
    return step, engine


def _peer(args: argparse.Namespace, name: str, link: Link):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    from luwu_rt.data import BatchSampler, load_tokens
    from luwu_rt.models.gpt import build_gpt
    from luwu_rt.optim.schedule import lr_at

    chain = build_gpt(args.model, device="cpu", seed=0)
    # PowerSGD issues each bucket's second all-reduce from the first's callback, so with several buckets the
    # ranks may interleave the buckets' collectives differently, which gloo refuses (sizes mismatch): one
    # bucket for it (an explicit bucket_cap_mb caps the first bucket too); the others keep DDP's buckets.
    ddp = DistributedDataParallel(chain.model, bucket_cap_mb=4096 if name == "torch-ddp-powersgd" else None)
    hook, state = default_hooks.allreduce_hook, None
    if name == "torch-ddp-bf16":
        hook = default_hooks.bf16_compress_hook
    elif name == "torch-ddp-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        hook = powerSGD_hook.powerSGD_hook

    def throttled(state, bucket):
        return hook(state, bucket).then(lambda fut: (link.charge(), fut.value())[1])
    ddp.register_comm_hook(state, throttled)
    opt = torch.optim.AdamW(ddp.parameters(), lr=_OPTIM["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    sampler = BatchSampler(load_tokens(vocab_size=256).train, batch_size=args.batch_size * RANKS, seq_len=args.seq_len,
                           seed=0, vocab_size=256)
    rank, b, count = dist.get_rank(), args.batch_size, [0]

    def step() -> float:
        count[0] += 1
        x, y = sampler.batch(count[0] - 1)
        opt.zero_grad(set_to_none=True)
        loss = ddp(x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), _OPTIM["grad_clip"])
        for g in opt.param_groups:
            g["lr"] = lr_at(count[0], lr=_OPTIM["lr"], min_lr=_OPTIM["min_lr"], warmup_steps=_OPTIM["warmup_steps"],
                            total_steps=10_000)
        opt.step()
        return loss.item()
    return step, None


def _rank_env(rank: int, port: int) -> None:
    """This process as rank ``rank`` of ``RANKS`` on loopback, one torch thread and one Numba thread."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(RANKS),
                       "LOCAL_WORLD_SIZE": str(RANKS), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "NUMBA_NUM_THREADS": "1"})
    torch.set_num_threads(1)


def _rank(rank: int, args: argparse.Namespace, port: int, out: mp.Queue) -> None:
    _rank_env(rank, port)
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        link = Link(args.link_gbps)
        import luwu_rt.engine.engine as engine_module

        engine_module.TorchGroup = _throttled_group(link)  # the engine's collectives go through the link
        runs: dict[str, Any] = {}
        for codec in args.codecs.split(","):
            runs[f"ours-{codec}"] = _ours(args, codec)
        for name in _PEERS:
            runs[name] = _peer(args, name, link)
        names = list(runs)
        record = {n: {"times": [], "bytes": [], "losses": []} for n in names}
        for n in names:
            for _ in range(args.warmup):
                runs[n][0]()
        for r in range(args.rounds):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                dist.barrier()
                for _ in range(args.steps):
                    before, start = _wchar(), time.perf_counter()
                    loss = runs[n][0]()
                    record[n]["times"].append(time.perf_counter() - start)
                    record[n]["bytes"].append(_wchar() - before)
                    record[n]["losses"].append(loss)
        plan = {n: e.wire_bytes for n, (_, e) in runs.items() if e is not None}
        units = {n: list(e.strategy.compress) for n, (_, e) in runs.items() if e is not None}
        for _, engine in runs.values():
            if engine is not None:
                engine.close()
        out.put((rank, "ok", {"record": record, "plan": plan, "units": units}))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _quality_rank(rank: int, args: argparse.Namespace, port: int, out: mp.Queue) -> None:
    _rank_env(rank, port)
    try:
        from luwu_rt.config import from_mapping
        from luwu_rt.engine import Engine, TrainConfig

        runs = [("none", 0)] + [(args.quality_codec, int(w)) for w in args.warmups.split(",")]
        got = {}
        for codec, warmup in runs:
            config = from_mapping(TrainConfig, {
                "model": args.model, "strategy": args.strategy, "batch_size": args.batch_size, "seq_len": args.seq_len,
                "steps": args.quality_steps, "eval_every": 0, "optim": {"lr": 1e-3}, "offload": {"chunk_size": "64KiB"},
                "compress": codec, "compress_warmup": warmup})
            with Engine(None, config) as engine:
                metrics = [engine.train_step() for _ in range(args.quality_steps)]
            got[f"{codec} after {warmup}" if codec != "none" else "none"] = {
                "losses": [m["loss"] for m in metrics], "bytes": sum(m["wire_bytes"] for m in metrics)}
        out.put((rank, "ok", got))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def quality(args: argparse.Namespace) -> list[str]:
    got = _ranks(_quality_rank, args)[0]
    tail = min(20, args.quality_steps)
    base = got["none"]
    base_tail = statistics.mean(base["losses"][-tail:])
    lines = [f"### Quality at {RANKS} ranks: {args.model}, {args.strategy}, batch {args.batch_size} x seq "
             f"{args.seq_len} per rank, {args.quality_steps} seeded steps, peak lr 1e-3, 64 KiB chunks", "",
             f"| run | mean loss of the last {tail} steps | vs uncompressed | bytes sent per rank, whole run | "
             "fewer bytes |", "|---|---|---|---|---|"]
    for name, run in got.items():
        mean = statistics.mean(run["losses"][-tail:])
        lines.append(f"| {name} | {mean:.4f} | {100 * (mean / base_tail - 1):+.1f}% | {run['bytes'] / 1e6:.1f} MB | "
                     f"{base['bytes'] / max(run['bytes'], 1):.1f}x |")
    return lines


def _ranks(target, args: argparse.Namespace) -> dict:
    """What ``target(rank, args, port, out)`` of each of the ``RANKS`` processes put into ``out``, by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, args, port, out), daemon=True) for r in range(RANKS)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(RANKS):
            rank, status, value = out.get(timeout=args.timeout)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed: {value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return got


def training(args: argparse.Namespace) -> list[str]:
    return _training_report(args, _ranks(_rank, args))


def _training_report(args: argparse.Namespace, got: dict) -> list[str]:
    names = list(got[0]["record"])
    rows, base = {}, {}
    for n in names:
        times = [max(a, b) for a, b in zip(got[0]["record"][n]["times"], got[1]["record"][n]["times"])]
        sent = statistics.mean(statistics.median(got[r]["record"][n]["bytes"]) for r in range(RANKS))
        rows[n] = (statistics.median(times), sent, got[0]["record"][n]["losses"][-1])
    base["ours"], base["torch"] = rows.get("ours-none"), rows["torch-ddp"]
    link = (f"{args.link_gbps:g} GB/s per rank (the benchmark's own token bucket over wchar)" if args.link_gbps
            else "none")
    lines = [f"### Training at {RANKS} ranks: {args.model}, {args.strategy}, batch {args.batch_size} x seq "
             f"{args.seq_len} per rank; link limit {link}", "",
             f"{args.warmup} warm-up steps each, then {args.rounds} rounds x {args.steps} steps, contestants in turn "
             "(order rotated); step time = the slower rank's, median; bytes = socket writes per rank per step, median.",
             "", "| contestant | median step s | bytes sent per rank per step | plan's bytes | bytes vs uncompressed | "
             "step vs uncompressed | last loss |", "|---|---|---|---|---|---|---|"]
    for n in names:
        step_s, sent, loss = rows[n]
        ref = base["torch"] if n.startswith("torch") else base["ours"]
        plan = got[0]["plan"].get(n)
        ratio = f"{ref[1] / sent:.1f}x fewer" if ref and sent else "-"
        planned = "-" if plan is None else f"{plan / 1e3:.1f} kB"
        lines.append(f"| {n} | {step_s:.4f} | {sent / 1e3:.1f} kB | {planned} | "
                     f"{ratio} | {step_s / ref[0]:.2f}x | {loss:.4f} |" if ref else f"| {n} | {step_s:.4f} | - |")
    if "ours-onebit" in rows and "ours-none" in rows:
        fewer = rows["ours-none"][1] / max(rows["ours-onebit"][1], 1)
        verdict = "met" if fewer >= BYTES_TARGET else "NOT met"
        lines += ["", f"P13 verdict: onebit sends {fewer:.1f}x fewer bytes on the wire than uncompressed, measured "
                      f"(target >= {BYTES_TARGET:g}x): {verdict}"]
    chosen = {n: u for n, u in got[0]["units"].items() if u}
    if chosen:
        lines += ["", "Codecs per unit: " + "; ".join(f"{n}: {', '.join(u)}" for n, u in chosen.items())]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    load = os.getloadavg()
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# Gradient compression at {RANKS} ranks: P13 ({now:%Y-%m-%d %H:%M} UTC)",
             "", f"Machine: {cpu_model()}, {os.cpu_count()} cpus, torch {torch.__version__}, Python "
                 f"{platform.python_version()}.", "", "Command: `python benchmarks/bench_compress.py "
                 f"--model {args.model} --batch-size {args.batch_size} --seq-len {args.seq_len} "
                 f"--strategy {args.strategy} "
                 f"--codecs {args.codecs} --link-gbps {args.link_gbps:g} --steps {args.steps} --rounds {args.rounds} "
                 f"--numel {args.numel} --part {args.part}"
                 + (f" --quality-codec {args.quality_codec} --warmups {args.warmups} --quality-steps "
                    f"{args.quality_steps}" if args.part == "quality" else "") + "`", "",
             f"Load before: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}.", ""]
    if args.part in ("both", "codecs"):
        lines += codec_throughput(args) + [""]
    if args.part in ("both", "training"):
        lines += training(args)
    if args.part == "quality":
        lines += quality(args)
    load = os.getloadavg()
    lines += ["", f"Load after: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}; total {time.time() - started:.0f} s."]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
