"""P11 for the node strategy (benchmarks/README.md): `luwu plan --strategy node`'s predicted step time against
the measured one, 2 workers, on a profile of this machine measured in the same run.

The planner's default profile describes a GPU server and a 100 Gb/s optimizer node, so its prediction for
this box says nothing. This script measures the profile's keys that a node run on one CPU box depends on:
  compute_flops        a 1-process `local` run of the same per-worker batch (optimizer on the host): the
                       plan's FLOPs of a step over the measured median `compute_s`
  node_gbps, net_gbps  the node protocol's push+pull GB/s over loopback (bench_node.measure, --net-mib MiB)
  *_optim_params_per_s our fused C++ AdamW (`luwu bench optim --json`, --optim-numel parameters)
  *_mem_gbps, h2d/d2h  a streaming numpy add; the "device" is a CPU arena, so copies run at memory speed
  node_latency_s       half a ZeroMQ round trip of a 56-byte message
then asks `luwu plan --strategy node --world-size 2 --profile P --json` for the step time of the run it
then measures (`luwu train --strategy node --nproc 2 --spawn-node`, median of steps 3..), and prints the
error in %. Three processes share the 2 cores here, which the model (dedicated cores per process) does not
know: the error says how much that costs.

    python benchmarks/bench_node_predict.py [--steps 20] [--batch 4] [--seq 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from bench_node import TRAIN_FLAGS, measure, train_medians
from report import emit  # benchmarks/report.py


def _plan(flags: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "luwu_rt", "plan", *flags, "--json"], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def _step_flops(batch: int, seq: int) -> float:
    """FLOPs of one worker's step as the plan counts them: forward 1x, backward 3x each unit's per token."""
    from luwu_rt.engine.workload import train_model_spec
    from luwu_rt.models.gpt import build_gpt

    spec = train_model_spec(build_gpt("gpt-tiny"), batch_size=batch, seq_len=seq, chunk_bytes=4 * 2**20)
    return 4 * spec.tokens_per_step * sum(u.flops_per_token for u in spec.units)


def _mem_gbps() -> float:
    a, b = np.ones(2**24, np.float32), np.ones(2**24, np.float32)
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        np.add(a, b, out=a)
        best = max(best, 3 * a.nbytes / (time.perf_counter() - start) / 1e9)  # two reads, one write
    return best


def _latency_s() -> float:
    import zmq

    ctx = zmq.Context.instance()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client.connect(f"tcp://127.0.0.1:{port}")

    def echo() -> None:
        for _ in range(1001):
            server.send_multipart(server.recv_multipart())

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    client.send(b"x" * 56)
    client.recv()
    start = time.perf_counter()
    for _ in range(1000):
        client.send(b"x" * 56)
        client.recv()
    took = time.perf_counter() - start
    thread.join()
    server.close(0)
    client.close(0)
    return took / 1000 / 2


def _optim_params_per_s(numel: int) -> float:
    out = subprocess.run([sys.executable, "-m", "luwu_rt", "bench", "optim", "--numel", str(numel), "--no-torch-ref",
                          "--rounds", "3", "--json"], check=True, stdout=subprocess.PIPE, text=True)
    return next(r["mparams_per_s"] for r in json.loads(out.stdout)["results"] if r["name"] == "cpp") * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4, help="sequences per worker")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--net-mib", type=int, default=64, help="MiB pushed and pulled to measure the transport")
    ap.add_argument("--optim-numel", type=int, default=2**23, help="parameters per call measuring the optimizer")
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error(f"--steps {args.steps}: the median is taken over steps 3.., so pass --steps 3 or more")
    shape = ["--batch-size", str(args.batch), "--seq-len", str(args.seq)]
    plan_flags = [*shape, "--device-mem", "256MiB", "--host-mem", "256MiB", "--keep-graphs", "none"]
    assert set(plan_flags[4:]) <= set(TRAIN_FLAGS), "plan and train runs share their budgets"
    with tempfile.TemporaryDirectory() as tmp:
        # The optimizer on the host, so that the run's compute_s is the model's alone (on the CPU arena
        # the optimizer would share the compute queue).
        local = train_medians(tmp, "local", ["--offload-optimizer", "host"], steps=args.steps, batch=args.batch,
                              seq=args.seq)
        flops = _step_flops(args.batch, args.seq)
        mem, net = _mem_gbps(), measure(total=args.net_mib * 2**20, chunk=4 * 2**20, protocol=True, repeats=5)
        optim = _optim_params_per_s(args.optim_numel)
        profile = {"compute_flops": flops / local["compute_s"], "node_gbps": net, "net_gbps": net,
                   "node_latency_s": _latency_s(), "node_optim_params_per_s": optim, "host_optim_params_per_s": optim,
                   "device_optim_params_per_s": optim, "node_mem_gbps": mem, "host_mem_gbps": mem,
                   "device_mem_gbps": mem, "h2d_gbps": mem / 3 * 2, "d2h_gbps": mem / 3 * 2}
        path = os.path.join(tmp, "profile.json")
        with open(path, "w") as f:
            json.dump(profile, f)
        node_flags = ["--strategy", "node", "--world-size", "2", "--node-host-mem", "1GiB", *plan_flags]
        predicted = _plan([*node_flags, "--profile", path])["predicted_step_s"]
        default = _plan(node_flags)["predicted_step_s"]
        measured = train_medians(tmp, "node", ["--strategy", "node", "--nproc", "2", "--spawn-node"],
                                 steps=args.steps, batch=args.batch, seq=args.seq)
        # The same, with the compute rate the workers had in the node run (sharing the cores with the
        # node): what is left of the error is the model of the transfers and their overlap.
        with open(path, "w") as f:
            json.dump({**profile, "compute_flops": flops / measured["compute_s"]}, f)
        shared = _plan([*node_flags, "--profile", path])["predicted_step_s"]
    emit(["profile measured here: " + ", ".join(f"{k}={v:.3g}" for k, v in profile.items()), "",
          "| run | measured step | predicted (target within 10%) | with the shared cores' compute | default profile |",
          "|---|---|---|---|---|",
          (f"| gpt-tiny, 2 workers x batch {args.batch} x seq {args.seq} | measured {measured['step_s'] * 1e3:.1f} ms "
           f"(compute {measured['compute_s'] * 1e3:.1f}; alone {local['compute_s'] * 1e3:.1f}) | predicted "
           f"{predicted * 1e3:.1f} ms ({(predicted / measured['step_s'] - 1) * 100:+.0f}%) | with the shared cores' "
           f"compute {shared * 1e3:.1f} ms ({(shared / measured['step_s'] - 1) * 100:+.0f}%) | default profile "
           f"{default * 1e3:.2f} ms ({(default / measured['step_s'] - 1) * 100:+.0f}%) |")], args.out)


if __name__ == "__main__":
    main()
