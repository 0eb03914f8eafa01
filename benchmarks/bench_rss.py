"""P10's memory clause (benchmarks/README.md): where a run's peak resident memory goes, phase by phase.

One configuration of ``luwu train`` (its flags), or benchmarks/bench_e2e.py's plain PyTorch peer (``--peer
plain``), runs as processes of its own (``--nproc`` ranks, each pinned to its share of the cores as ``luwu train``
pins them); each process marks its phases - the interpreter, ``import torch``, our imports, the engine built (plan,
arenas, queue threads), the first weights materialised, the data loaded, every step - with its resident memory
(``VmRSS``) and its peak within the phase (``VmHWM``, reset after each mark through ``/proc/self/clear_refs``), and
glibc's malloc figures (``mallinfo2``, sampled every 20 ms from the engine on): the bytes in use and the bytes the
heap holds, their difference memory that freed tensors left resident ([Note: the C heap under CPU tensors] in
luwu_rt/heap.py). Beside it the plan's arenas: their span (what the store allocates) and the most bytes live in
them at once.

    python benchmarks/bench_rss.py [--model gpt-small] [--batch-size 8] [--seq-len 256] [--strategy local]
        [--placement device] [--nproc 1] [--steps 4] [--device-mem auto] [--host-mem auto] [--peer plain]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from report import cpu_model, emit  # benchmarks/report.py

ROOT = Path(__file__).resolve().parents[1]
PLACEMENTS = {"device": ("device", "device", "device"), "host": ("host", "host", "host"),
              "nvme": ("nvme", "nvme", "host")}
"""As ``luwu bench e2e``'s: (params, optimizer, grads)."""


class _Phases:
    """This process's marks: (phase, VmRSS, VmHWM since the last mark, malloc in use, malloc held), MiB."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int, int, int, int]] = []
        self.peak = {"used": 0, "held": 0}
        self._mallinfo = None
        self._reset()

    def _status(self) -> dict[str, int]:
        with open("/proc/self/status") as f:
            return {k: int(v.split()[0]) >> 10 for k, v in (line.split(":", 1) for line in f)
                    if k in ("VmRSS", "VmHWM")}

    def _reset(self) -> None:
        self.peak = {"used": 0, "held": 0}
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM starts again from VmRSS

    def watch_malloc(self) -> None:
        """Samples glibc's malloc figures from now on (a thread: started once the run's own threads share the
        main arena, so that it adds none of its own)."""
        import ctypes

        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]

        libc = ctypes.CDLL(None)
        if not hasattr(libc, "mallinfo2"):
            return
        libc.mallinfo2.restype = Info
        self._mallinfo = libc.mallinfo2

        def sample() -> None:
            while True:
                self._sample()
                time.sleep(0.02)

        threading.Thread(target=sample, daemon=True, name="rss-sampler").start()

    def _sample(self) -> None:
        m = self._mallinfo()
        self.peak["used"] = max(self.peak["used"], m.uordblks + m.hblkhd)
        self.peak["held"] = max(self.peak["held"], m.arena + m.hblkhd)

    def mark(self, phase: str) -> None:
        if self._mallinfo is not None:
            self._sample()  # a phase shorter than the sampling period has its figures too
        s = self._status()
        self.rows.append((phase, s["VmRSS"], s["VmHWM"], self.peak["used"] >> 20, self.peak["held"] >> 20))
        self._reset()


def _ours(args, phases: _Phases) -> dict:
    from luwu_rt import heap

    heap.share_one_arena()  # as `luwu train` does first thing
    import torch  # noqa: F401

    phases.mark("import torch")
    from luwu_rt.engine import Engine, TrainConfig
    from luwu_rt.config import from_mapping
    from luwu_rt.plan.analysis import live_bytes

    phases.mark("import luwu_rt (engine, config)")
    params, optimizer, grads = PLACEMENTS[args.placement]
    config = from_mapping(TrainConfig, {
        "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "dtype": args.dtype,
        "strategy": args.strategy, "steps": args.steps, "optim": {"grad_clip": 1.0}, "profile": args.profile,
        "offload": {"params": params, "optimizer": optimizer, "grads": grads, "nvme_dir": args.nvme_dir,
                    "device_mem": args.device_mem, "host_mem": args.host_mem}})
    engine = Engine(None, config, materialize=False)
    phases.mark("engine built (plan, arenas, queues)")
    phases.watch_malloc()
    engine._materialize()
    phases.mark("first weights materialised")
    engine.sampler()
    phases.mark("data (corpus, sampler)")
    kept = 0
    for i in range(args.steps):
        kept = engine.train_step()["kept_bytes"]
        engine.queues.drain()
        phases.mark(f"step {i + 1}")
    plans = [engine.plan, engine.eval_plan]
    arenas = {t: {"span": a.nbytes >> 20, "live": max(live_bytes(p, t) for p in plans) >> 20}
              for t, a in engine.store.arenas.items() if a.nbytes}
    engine.close()
    return {"arenas": arenas, "kept_mib": kept >> 20}


def _plain(args, phases: _Phases) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    import torch  # noqa: F401

    phases.mark("import torch")
    import bench_e2e
    from luwu_rt.models.gpt import build_gpt

    phases.mark("import bench_e2e, luwu_rt.models")
    model = build_gpt(args.model, device="cpu", seed=0).model
    phases.mark("model built (on meta, then materialised)")
    phases.watch_malloc()
    step, kind = bench_e2e._torch_peer("plain", model, 1)
    phases.mark(f"optimizer ({kind})")
    batches = bench_e2e._batches(args, rank=0, world=1, count=args.steps)
    phases.mark("data (corpus, sampler)")
    for i, (x, y) in enumerate(batches):
        step(x, y, 3e-3)
        phases.mark(f"step {i + 1}")
    return {}


def _rank(args) -> None:
    phases = _Phases()
    phases.mark("python")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        from luwu_rt.dist.launch import pin_cores

        pin_cores(rank, world)
    extra = _plain(args, phases) if args.peer == "plain" else _ours(args, phases)
    Path(f"{args.result}.rank{rank}").write_text(json.dumps({"rows": phases.rows, **extra}))
    if world > 1:
        os._exit(0)  # as luwu's ranks end (dist/launch.py run_rank): gloo's threads are not joined at exit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args, workdir: str) -> list[dict]:
    world = 1 if args.peer == "plain" else args.nproc
    result = os.path.join(workdir, "phases")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world)}
    cmd = [sys.executable, __file__, *sys.argv[1:], "--result", result, "--nvme-dir", args.nvme_dir]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world)]
    if any(p.wait() for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    return [json.loads(Path(f"{result}.rank{r}").read_text()) for r in range(world)]


def report(args, ranks: list[dict]) -> list[str]:
    who = "plain PyTorch (bench_e2e.py's peer)" if args.peer == "plain" else \
        f"ours, strategy {args.strategy} on {args.nproc} rank(s), state on {args.placement}"
    lines = [f"# Peak RSS by phase: {args.model}, {who}", "",
             f"Machine: {cpu_model()}, {os.cpu_count()} cpus. Command: `python benchmarks/bench_rss.py "
             f"{' '.join(sys.argv[1:])}`. Batch {args.batch_size} x {args.seq_len} per rank, {args.dtype}, "
             f"{args.steps} steps.", "",
             "| phase | " + " | ".join(f"rank {r}: RSS / peak MiB, malloc in use / held" for r in range(len(ranks)))
             + " |", "|---|" + "---|" * len(ranks)]
    for i, row in enumerate(ranks[0]["rows"]):
        cells = []
        for rank in ranks:
            _, rss, hwm, used, held = rank["rows"][i]
            cells.append(f"{rss:,} / {hwm:,}" + (f", {used:,} / {held:,}" if held else ""))
        lines.append(f"| {row[0]} | " + " | ".join(cells) + " |")
    peaks = [max(r[2] for r in rank["rows"]) for rank in ranks]
    lines += ["", f"Peak RSS (VmHWM) per rank: {', '.join(f'{p:,} MiB' for p in peaks)}; the largest "
                  f"{max(peaks) * 2**20 / 1e6:,.0f} MB."]
    if ranks[0].get("arenas"):
        arenas = "; ".join(f"{t} spans {a['span']:,} MiB, at most {a['live']:,} MiB live"
                           for t, a in ranks[0]["arenas"].items())
        lines.append(f"Rank 0's arenas: {arenas}; kept graphs {ranks[0]['kept_mib']:,} MiB.")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--strategy", default="local")
    p.add_argument("--placement", default="device", choices=tuple(PLACEMENTS))
    p.add_argument("--nproc", type=int, default=1, help="ranks of a data-parallel strategy (default 1)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--profile", default="auto", help="the profile ours plans with (default auto)")
    p.add_argument("--device-mem", default="auto", help="ours: the device budget (default auto)")
    p.add_argument("--host-mem", default="auto", help="ours: the host budget (default auto)")
    p.add_argument("--peer", default=None, choices=("plain",), help="the plain PyTorch peer instead of ours")
    p.add_argument("--nvme-dir", default=None, help="the NVMe tier's directory (default: a scratch directory)")
    p.add_argument("--out", default=None, help="also write the markdown report here")
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.result:
        _rank(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="luwu-bench-rss-") as workdir:
        args.nvme_dir = args.nvme_dir or os.path.join(workdir, "nvme")
        emit(report(args, _launch(args, workdir)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
