"""`luwu calibrate`: measure this machine in about a minute and write the hardware profile the planner uses.

Every figure of ``HardwareProfile`` that one machine can measure of itself (probes.py): the IO engine's NVMe
read, write and mixed bandwidth on ``--nvme-dir``'s disk (block size and queue depth swept, the best kept); host
<-> device copies; the fused optimizer; the compute rate of a model's units as the engine runs them; gloo
collectives between two local ranks (latency and bandwidth); the node protocol over ZeroMQ; host memory
bandwidth; the gradient codecs' encode and decode (on one rank's share of the cores); and how the queues that
share the host's cores slow each other (``cpu_overlap``), as the disk's reads and writes do (``nvme_overlap``),
and the cores' time the store's checksums of the disk's traffic take (``nvme_core_s_per_gb``). On one machine
the optimizer node's figures are the host's own. The profile goes to this machine's cache, where ``luwu plan``,
``luwu train`` and ``--strategy auto`` find it by default ([Note: which profile] in engine/hwprofile.py), and to
``--out FILE``. Its notes (``_machine``, ``_measured``) say what was measured, where, and under what load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "calibrate", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nvme-dir", default=None, metavar="DIR",
                        help="directory on the disk of the NVMe tier (created if missing and then removed; default: "
                             "a scratch directory ./luwu-scratch-* here, as luwu train makes)")
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="also write the profile here (it always goes to this machine's cache, which --profile "
                             "auto reads)")
    parser.add_argument("--no-cache", action="store_true", help="write only --out, not this machine's cache")
    parser.add_argument("--model", default="gpt-small", metavar="PRESET",
                        help="model whose units' compute rate becomes compute_flops (default gpt-small)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step of that model (default 4)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                        help="compute dtype (default fp32)")
    parser.add_argument("--ranks", type=int, default=1,
                        help="on the CPU: measure that model's compute with this many ranks side by side, as "
                             "luwu train --nproc N runs them (default 1)")
    parser.add_argument("--nvme-mb", type=int, default=128, help="MiB per NVMe measurement (default 128)")
    parser.add_argument("--net-mib", type=int, default=16, help="MiB per collective and per node-protocol "
                                                                "transfer (default 16)")
    parser.add_argument("--optim-numel", type=int, default=1 << 23,
                        help="parameters per fused optimizer step measured (default 8388608)")
    parser.add_argument("--codec-numel", type=int, default=1 << 22,
                        help="gradient elements each codec encodes and decodes when measured (default 4194304)")
    parser.add_argument("--json", action="store_true", help="print the profile with its notes as one JSON object")


def _say(args: argparse.Namespace, line: str) -> None:
    if not args.json:
        print(line, file=sys.stderr, flush=True)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def calibrate(args: argparse.Namespace, nvme_dir: str) -> dict[str, Any]:
    """The profile's keys measured now, with its notes ``_machine`` and ``_measured``."""
    import torch

    from luwu_rt.cli import probes
    from luwu_rt.engine.hwprofile import machine_identity

    device = "cuda" if torch.cuda.is_available() else "cpu"
    started, load_before = time.perf_counter(), _load()
    took: dict[str, float] = {}

    def timed(name: str, fn, *a, **kw):
        _say(args, f"calibrate: {name} ...")
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        took[name] = round(time.perf_counter() - t0, 2)
        return out

    disk = timed("nvme", probes.nvme, nvme_dir, size_bytes=args.nvme_mb << 20,
                 log=lambda line: _say(args, "  " + line))
    h2d, d2h = timed("copies", probes.copy_gbps, device)
    mem = timed("memory", probes.mem_gbps)
    host_optim = timed("optimizer", probes.optimizer_rate, numel=args.optim_numel)
    dev_optim = host_optim if device == "cpu" else timed("device optimizer", probes.optimizer_rate,
                                                         numel=args.optim_numel, device=device)
    dev_mem = mem if device == "cpu" else timed("device memory", probes.mem_gbps, device=device, numel=1 << 27)
    matmul = timed("matmul", probes.matmul_flops, device=device, dtype=args.dtype)
    compute = timed("compute", probes.compute_rate, args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                    dtype=args.dtype, ranks=args.ranks if device == "cpu" else 1)
    shared = timed("overlap", probes.overlap, device=device)
    # A rank of a run on this machine shares its cores with the others: on the CPU the codecs are timed on
    # one rank's share (two ranks, the common local run), on a GPU on the device.
    codec_threads = max(1, (os.cpu_count() or 1) // 2)
    codecs = timed("codecs", probes.codec_rates, numel=args.codec_numel, device=device, threads=codec_threads)
    coll = timed("collectives", probes.collectives, mib=args.net_mib)
    zmq_gbps = timed("node protocol", probes.zmq_protocol_gbps, total=args.net_mib << 20,
                     chunk=min(4 << 20, args.net_mib << 20))
    zmq_latency = timed("node latency", probes.zmq_latency_s)
    profile = {
        "nvme_read_gbps": disk["read_gbps"], "nvme_write_gbps": disk["write_gbps"],
        "h2d_gbps": h2d, "d2h_gbps": d2h,
        "host_optim_params_per_s": host_optim, "device_optim_params_per_s": dev_optim,
        "compute_flops": compute["flops"],
        **probes.collective_keys(coll),
        "host_mem_gbps": mem, "device_mem_gbps": dev_mem,
        # The optimizer node of a local run is a process of this machine: its figures are the host's.
        "node_gbps": zmq_gbps, "node_latency_s": zmq_latency, "node_optim_params_per_s": host_optim,
        "node_mem_gbps": mem, "node_nvme_read_gbps": disk["read_gbps"], "node_nvme_write_gbps": disk["write_gbps"],
        "cpu_overlap": shared["cpu_overlap"], "nvme_overlap": disk["overlap"],
        "nvme_core_s_per_gb": disk["core_s_per_gb"],
        **codecs,
    }
    measured = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_before": load_before, "load_average_after": _load(),
        "seconds": round(time.perf_counter() - started, 1), "seconds_per_probe": took,
        "nvme_dir": os.path.abspath(nvme_dir), "nvme": disk, "matmul_flops": matmul, "compute": compute,
        "overlap": shared, "collectives": coll,
        "codecs": {"names": probes.CODEC_PROBES, "numel": args.codec_numel, "threads": codec_threads},
        "torch_threads": torch.get_num_threads(),
    }
    return {**profile, "_machine": machine_identity(), "_measured": measured}


def _write(path: Path, values: dict[str, Any]) -> None:
    from luwu_rt.plan.spec import HardwareProfile

    HardwareProfile.from_dict(values)  # never write what --profile would refuse
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(values, indent=2) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file


def run(args: argparse.Namespace) -> int:
    from luwu_rt.cli.dirs import created_dir, scratch_dir
    from luwu_rt.engine.hwprofile import cached_profile_path

    for name in ("batch_size", "seq_len", "ranks", "nvme_mb", "net_mib", "optim_numel", "codec_numel"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.no_cache and not args.out:
        raise ValueError("--no-cache writes the profile nowhere: give --out FILE")
    if args.nvme_dir is not None:
        with created_dir(args.nvme_dir, flag="--nvme-dir"):
            values = calibrate(args, args.nvme_dir)
    else:
        with scratch_dir(flag="--nvme-dir") as scratch:
            values = calibrate(args, str(scratch.path))
    targets = [] if args.no_cache else [cached_profile_path(values["_machine"])]
    targets += [Path(args.out)] if args.out else []
    for path in targets:
        _write(path, values)
    if args.json:
        print(json.dumps(values, indent=2))
        return 0
    m = values["_measured"]
    print(f"calibrated in {m['seconds']:.0f} s (load average {m['load_average_before']} before, "
          f"{m['load_average_after']} after):")
    for key, value in values.items():
        if not key.startswith("_"):
            print(f"  {key:<26} {value:.4g}")
    for path in targets:
        print(f"wrote {path}")
    if not args.no_cache:
        print("luwu plan, luwu train and --strategy auto use it on this machine unless given --profile")
    return 0
