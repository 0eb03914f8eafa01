"""P3 (benchmarks/README.md): the IO engine vs DeepSpeed's async IO op vs fio.

One file of --size-mb (default 1 GiB) is written then read with O_DIRECT at the
same block size and queue depth by each contestant, in interleaved rounds so
that disk drift hits all of them alike. Per round we take the ratio ours/peer;
the figure reported is the median of those per-round ratios. fio runs with
io_uring (plain and with fixed buffers) and libaio; "best fio" is the setting
with the highest median throughput. Peers that are missing are reported as such.

    python benchmarks/bench_io.py --dir /var/tmp --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch

from luwu_rt.cli.bench_io import measure
from luwu_rt.io import aligned_empty

# fio settings tried at the same block size and queue depth; "best fio" is
# the best of them. fixedbufs/registerfiles pin fio's buffers once up front.
FIO_SETTINGS = {
    "io_uring": ("--ioengine=io_uring",),
    "io_uring-fixedbufs": ("--ioengine=io_uring", "--fixedbufs", "--registerfiles"),
    "libaio": ("--ioengine=libaio",),
}
Pair = tuple[float, float]  # (write GB/s, read GB/s)


def _scratch(directory: str, tag: str) -> str:
    return os.path.join(directory, f".bench-io-{tag}-{uuid.uuid4().hex}")


def make_deepspeed(block_bytes: int, queue_depth: int, num_threads: int) -> tuple[Callable | None, str]:
    """A runner for DeepSpeed's aio op, or None and the reason it is unavailable."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible():
            return None, "DeepSpeed AsyncIOBuilder is not compatible here (libaio-dev missing?)"
        aio = AsyncIOBuilder().load(verbose=False)
    except Exception as exc:  # a peer failing to build must not stop our own figures
        return None, f"DeepSpeed async IO unavailable: {type(exc).__name__}: {exc}"
    handle = aio.aio_handle(block_bytes, queue_depth, False, True, num_threads)
    buffers: dict[str, torch.Tensor] = {}

    def run(directory: str, source: torch.Tensor) -> Pair:
        if "w" not in buffers:  # DeepSpeed wants its own page-locked tensors
            for key in ("w", "r"):
                buffers[key] = handle.new_cpu_locked_tensor(source.numel(), torch.empty(0, dtype=torch.uint8))
            buffers["w"].copy_(source)
        path = _scratch(directory, "ds")
        try:
            start = time.perf_counter()
            handle.sync_pwrite(buffers["w"], path)
            write_s = time.perf_counter() - start
            start = time.perf_counter()
            handle.sync_pread(buffers["r"], path)
            read_s = time.perf_counter() - start
            if not torch.equal(buffers["r"], buffers["w"]):
                raise RuntimeError("DeepSpeed read back different bytes")
        finally:
            if os.path.exists(path):
                os.unlink(path)
        return source.numel() / write_s / 1e9, source.numel() / read_s / 1e9

    return run, (f"deepspeed {_version('deepspeed')} aio_handle(block {block_bytes}, depth {queue_depth}, "
                 f"threads {num_threads})")


def _fio(path: str, rw: str, size_bytes: int, block_bytes: int, queue_depth: int, setting: str) -> float:
    cmd = [
        "fio", "--name=p3", f"--filename={path}", f"--rw={rw}", f"--bs={block_bytes}", f"--size={size_bytes}",
        f"--iodepth={queue_depth}", *FIO_SETTINGS[setting], "--direct=1", "--numjobs=1", "--output-format=json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(out.stdout)["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def make_fio(size_bytes: int, block_bytes: int, queue_depth: int, setting: str) -> Callable:
    def run(directory: str, source: torch.Tensor) -> Pair:
        path = _scratch(directory, f"fio-{setting}")
        try:
            write = _fio(path, "write", size_bytes, block_bytes, queue_depth, setting)
            read = _fio(path, "read", size_bytes, block_bytes, queue_depth, setting)
        finally:
            if os.path.exists(path):
                os.unlink(path)
        return write, read

    return run


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "?"


def _fio_version() -> str:
    return subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/var/tmp", help="directory on the disk under test")
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--block-kb", type=int, default=1024)
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--ds-threads", type=int, default=2, help="DeepSpeed intra_op_parallelism")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="results markdown (default benchmarks/results/<today>-io.md)")
    args = parser.parse_args(argv)
    size, block, depth = args.size_mb << 20, args.block_kb << 10, args.queue_depth

    source = aligned_empty(size)
    source.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    read_back = aligned_empty(size)
    small_pages = (aligned_empty(size, huge_pages=False), aligned_empty(size, huge_pages=False))
    small_pages[0].copy_(source)
    contestants: dict[str, Callable] = {}
    notes = []
    no_uring = _io_uring_unavailable()
    for backend in ("threads",) if no_uring else ("io_uring", "threads"):
        contestants[f"ours-{backend}"] = lambda d, s, b=backend: _ours(d, s, read_back, block, depth, b)
    if no_uring:
        notes.append(no_uring)
    else:
        # The same engine on page-locked 4 KiB-page buffers, the kind DeepSpeed
        # allocates: separates the engine from the huge pages of aligned_empty.
        contestants["ours-io_uring-4k"] = lambda d, s: _ours(d, small_pages[0], small_pages[1], block, depth,
                                                             "io_uring")
    if args.ds_threads > 1 and not no_uring:
        # DeepSpeed keeps queue_depth IOs in flight per thread; this row gives
        # the engine the same total number in flight.
        total = depth * args.ds_threads
        contestants[f"ours-io_uring-qd{total}"] = lambda d, s: _ours(d, s, read_back, block, total, "io_uring")
    ds_run, ds_note = make_deepspeed(block, depth, args.ds_threads)
    notes.append(ds_note)
    if ds_run is not None:
        contestants["deepspeed-aio"] = ds_run
    if shutil.which("fio"):
        notes.append(_fio_version())
        for setting in FIO_SETTINGS:
            contestants[f"fio-{setting}"] = make_fio(size, block, depth, setting)
    else:
        notes.append("fio not installed: no fio figures")

    rows: dict[str, list[Pair]] = {name: [] for name in contestants}
    for rnd in range(args.rounds):
        # Rotate the order each round so no contestant always follows the same one.
        names = list(contestants)
        names = names[rnd % len(names):] + names[: rnd % len(names)]
        for name in names:
            rows[name].append(contestants[name](args.dir, source))
            w, r = rows[name][-1]
            print(f"round {rnd} {name:18s} write {w:6.2f} GB/s  read {r:6.2f} GB/s", flush=True)

    report = _report(rows, args, notes)
    print(report)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"{date.today().isoformat()}-io.md"
    out.write_text(report)
    print(f"saved {out}")
    return 0


def _io_uring_unavailable() -> str | None:
    """Why the engine's io_uring backend cannot run here (a container's seccomp, an old kernel), or None."""
    from luwu_rt.io import IOEngine

    try:
        with IOEngine(backend="io_uring", queue_depth=1, block_bytes=4096):
            return None
    except OSError as exc:
        return f"io_uring unavailable here ({exc}): the engine's threads backend only"


def _ours(directory: str, source: torch.Tensor, read_back: torch.Tensor, block: int, depth: int, backend: str) -> Pair:
    r = measure(directory, size_bytes=source.numel(), block_bytes=block, queue_depth=depth, backend=backend,
                buffer=source, read_buffer=read_back)
    return r.write_gbps, r.read_gbps


def _median_ratio(ours: list[Pair], peer: list[Pair], k: int) -> float:
    return statistics.median(o[k] / p[k] for o, p in zip(ours, peer))


def _report(rows: dict[str, list[Pair]], args: argparse.Namespace, notes: list[str]) -> str:
    lines = [
        f"# IO engine vs DeepSpeed aio vs fio (P3) — {date.today().isoformat()}",
        "",
        f"`python benchmarks/bench_io.py --dir {args.dir} --size-mb {args.size_mb} --block-kb {args.block_kb} "
        f"--queue-depth {args.queue_depth} --rounds {args.rounds}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}. File {args.size_mb} MiB, O_DIRECT, "
        f"block {args.block_kb} KiB, queue depth {args.queue_depth}.",
        "",
        *[f"- {n}" for n in notes],
        "",
        "`ours-io_uring` is what `IOEngine(backend=\"auto\")` picks here; `ours-threads` is the fallback backend"
        " (pread/pwrite pool, 8 threads per direction); both use `aligned_empty` buffers (2 MiB-aligned, huge-page"
        " advised). `ours-io_uring-4k` is the io_uring engine on mlocked 4 KiB-page buffers"
        " (`aligned_empty(..., huge_pages=False)`), the kind DeepSpeed allocates, to separate the engine from its"
        " buffers. `ours-io_uring-qdN` (when DeepSpeed runs N/queue-depth threads) gives the engine as many IOs"
        " in flight as DeepSpeed has: its queue depth is per thread.",
        "",
        "Why the peers differ (see csrc/io/ notes): DeepSpeed's aio op writes a new file from offset 0 without"
        " growing it first, and ext4 runs O_DIRECT writes that extend a file synchronously, so its pieces go one at"
        " a time; the engine fallocates first ([Note: extend before writing]). fio allocates its buffers with malloc"
        " (4 KiB pages); this machine's transparent huge pages are opt-in (madvise) and no hugetlbfs pages are"
        " reserved, so no fio setting can use huge pages without changing the system.",
        "",
        "## Raw throughput per round (GB/s, write / read)",
        "",
        "| contestant | " + " | ".join(f"round {i}" for i in range(args.rounds)) + " | median |",
        "|---|" + "---|" * (args.rounds + 1),
    ]
    for name, pairs in rows.items():
        cells = [f"{w:.2f} / {r:.2f}" for w, r in pairs]
        med = f"{statistics.median(p[0] for p in pairs):.2f} / {statistics.median(p[1] for p in pairs):.2f}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {med} |")
    lines += ["", "## Ratios (median of per-round ratios)", "", "| ours | peer | write | read | target |",
              "|---|---|---|---|---|"]
    fio_names = [n for n in rows if n.startswith("fio-")]
    best_fio = ({k: max(fio_names, key=lambda n: statistics.median(p[k] for p in rows[n])) for k in (0, 1)}
                if fio_names else {})
    verdicts = []
    for ours in [n for n in rows if n.startswith("ours-")]:
        if "deepspeed-aio" in rows:
            w, r = (_median_ratio(rows[ours], rows["deepspeed-aio"], k) for k in (0, 1))
            lines.append(f"| {ours} | deepspeed-aio | {w:.3f} | {r:.3f} | >= 1.0 |")
        for name in fio_names:
            w, r = (_median_ratio(rows[ours], rows[name], k) for k in (0, 1))
            best = ""
            if name in best_fio.values():
                which = ", ".join(d for d, k in (("write", 0), ("read", 1)) if best_fio[k] == name)
                best = f" (best fio: {which})"
            lines.append(f"| {ours} | {name}{best} | {w:.3f} | {r:.3f} | >= 0.95 vs best |")
        verdicts += _verdicts(ours, rows, best_fio)
    if not verdicts:  # no peer ran here: our figures stand alone, and the verdict says why there is none
        verdicts = ["no peer ran (DeepSpeed aio and fio unavailable, see above): our figures only, no ratio"]
    lines += ["", "## P3 verdict", "", *[f"- {v}" for v in verdicts]]
    return "\n".join(lines) + "\n"


def _verdicts(ours: str, rows: dict[str, list[Pair]], best_fio: dict[int, str]) -> list[str]:
    out = []
    for k, direction in ((0, "write"), (1, "read")):
        checks = []
        if "deepspeed-aio" in rows:
            checks.append(("DeepSpeed aio", _median_ratio(rows[ours], rows["deepspeed-aio"], k), 1.0))
        if best_fio:
            checks.append((f"best fio ({best_fio[k]})", _median_ratio(rows[ours], rows[best_fio[k]], k), 0.95))
        for peer, ratio, target in checks:
            status = "met" if ratio >= target else "NOT met"
            out.append(f"{ours} {direction} vs {peer}: {ratio:.3f} (target >= {target}) — {status}")
    return out


if __name__ == "__main__":
    sys.exit(main())
