"""P6 (benchmarks/README.md): push+pull throughput of the node protocol against raw pyzmq moving the same
bytes over the same transport, in one run.

Both sides run a DEALER (the worker) against a ROUTER on a thread (the node) over TCP loopback. Per round
the worker pushes ``--mib`` MiB in chunks of ``--chunk`` and pulls the same amount back:
  raw       multipart ``[payload]``; the server copies each push into its buffer and answers a 1-byte ack,
            and answers each pull request with a chunk of its buffer;
  protocol  the same through ``luwu_rt.node.protocol``: every message encoded with its 56-byte header and
            the payload's CRC-32C (not over CURVE, whose MAC guards each frame, as the node does), every
            received one validated by ``decode`` before its payload is copied
            (the node's ``Pushes.offer`` and the worker's PARAM copy do the same copies).
Reported: GB/s of payload moved (pushed + pulled) per mode, best of ``--repeats``, and the ratio (the issue's
bar: >= 0.8x); ``--curve`` runs both over CURVE (encrypted and authenticated, as ``--auth-keys`` does).

    python benchmarks/bench_node.py [--mib 64] [--chunk 4MiB] [--repeats 5] [--curve] [--out FILE]

``--train``: instead, 2-worker ``node`` (with a spawned node) against 2-worker ``zero3`` step times on
gpt-tiny, the same global batch: the median ``step_s`` of steps 3.. from each run's ``--json-log``.

    python benchmarks/bench_node.py --train [--steps 20] [--batch 4] [--seq 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import zmq
from report import emit  # benchmarks/report.py

from luwu_rt.node.protocol import DTYPE_CODES, Message, T, decode, encode
from luwu_rt.plan.sizes import parse_size

PULL, PUSH, STOP = b"p", b"P", b"s"
SERVER_KEYS = zmq.curve_keypair()
CLIENT_KEYS = zmq.curve_keypair()


def _server(address_box: list, ready: threading.Event, total: int, chunk: int, protocol: bool, curve: bool) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    if curve:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = SERVER_KEYS
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    address_box.append(f"tcp://127.0.0.1:{port}")
    ready.set()
    store = np.zeros(total, dtype=np.uint8)
    view = memoryview(store)
    while True:
        frames = sock.recv_multipart(copy=False)
        ident, body = frames[0], frames[1:]
        if protocol:
            msg = decode(body, trusted=curve)
            if msg.type == T.HEARTBEAT:
                break
            if msg.type == T.PUSH_GRAD:
                store[msg.offset : msg.offset + msg.nbytes] = np.frombuffer(msg.payload, np.uint8)
                ack = Message(T.ACK, step=msg.step, unit=msg.unit, offset=msg.offset)
                sock.send_multipart([ident, *encode(ack, checksum=not curve)])
            else:
                for off in range(0, total, chunk):
                    param = Message(T.PARAM, offset=off, dtype=DTYPE_CODES["float32"], payload=view[off : off + chunk])
                    sock.send_multipart([ident, *encode(param, checksum=not curve)], copy=False)
        else:
            kind = body[0].bytes[:1]
            if kind == STOP:
                break
            if kind == PUSH:
                off = int.from_bytes(body[0].bytes[1:9], "little")
                store[off : off + len(body[1])] = np.frombuffer(body[1].buffer, np.uint8)
                sock.send_multipart([ident, b"a"])
            else:
                for off in range(0, total, chunk):
                    sock.send_multipart([ident, off.to_bytes(8, "little"), view[off : off + chunk]], copy=False)
    sock.close(0)


def _round(sock, data: np.ndarray, out: np.ndarray, chunk: int, protocol: bool, curve: bool) -> None:
    total, view = data.size, memoryview(data)
    n = -(-total // chunk)
    for i, off in enumerate(range(0, total, chunk)):
        if protocol:
            sock.send_multipart(encode(Message(T.PUSH_GRAD, step=1, chunk=i, offset=off, dtype=DTYPE_CODES["float32"],
                                               payload=view[off : off + chunk]), checksum=not curve), copy=False)
        else:
            sock.send_multipart([PUSH + off.to_bytes(8, "little"), view[off : off + chunk]], copy=False)
    for _ in range(n):  # acks
        frames = sock.recv_multipart(copy=False)
        if protocol:
            decode(frames, trusted=curve)
    sock.send_multipart(encode(Message(T.PULL_PARAM, step=1), checksum=not curve) if protocol else [PULL])
    for _ in range(n):
        frames = sock.recv_multipart(copy=False)
        if protocol:
            msg = decode(frames, trusted=curve)
            out[msg.offset : msg.offset + msg.nbytes] = np.frombuffer(msg.payload, np.uint8)
        else:
            off = int.from_bytes(frames[0].bytes, "little")
            out[off : off + len(frames[1])] = np.frombuffer(frames[1].buffer, np.uint8)


def measure(*, total: int, chunk: int, protocol: bool, repeats: int, curve: bool = False) -> float:
    """Best GB/s of payload (pushed + pulled) over ``repeats`` rounds."""
    box, ready = [], threading.Event()
    thread = threading.Thread(target=_server, args=(box, ready, total, chunk, protocol, curve), daemon=True)
    thread.start()
    ready.wait()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    if curve:
        sock.curve_publickey, sock.curve_secretkey = CLIENT_KEYS
        sock.curve_serverkey = SERVER_KEYS[0]
    sock.connect(box[0])
    data = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    out = np.zeros_like(data)
    _round(sock, data, out, chunk, protocol, curve)  # warm-up: connection, buffers
    assert np.array_equal(out, data)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        _round(sock, data, out, chunk, protocol, curve)
        best = max(best, 2 * total / (time.perf_counter() - start) / 1e9)
    sock.send_multipart(encode(Message(T.HEARTBEAT), checksum=not curve) if protocol else [STOP])
    thread.join()
    sock.close(0)
    return best


TRAIN_FLAGS = ["--eval-every", "0", "--quiet", "--device-mem", "256MiB", "--host-mem", "256MiB", "--keep-graphs",
               "none"]
"""Budgets and flags every training run of this script shares (and ``luwu plan`` is given in bench_node_predict)."""


def train_medians(tmp: str, name: str, flags: list[str], *, steps: int, batch: int, seq: int) -> dict[str, float]:
    """Runs ``luwu train FLAGS`` in ``tmp``; the medians of its ``--json-log`` metrics over steps 3.."""
    import json
    import os
    import statistics
    import subprocess
    import sys

    log = os.path.join(tmp, f"{name}.jsonl")
    subprocess.run([sys.executable, "-m", "luwu_rt", "train", *flags, "--steps", str(steps), "--batch-size",
                    str(batch), "--seq-len", str(seq), *TRAIN_FLAGS, "--json-log", log], check=True, cwd=tmp,
                   stdout=subprocess.DEVNULL)  # stderr passes through: a failing run shows its error
    lines = [x for x in map(json.loads, open(log)) if "step_s" in x and x["step"] > 2]
    return {k: statistics.median(x[k] for x in lines) for k in ("step_s", "compute_s")}


def compare_train(*, steps: int = 20, batch: int = 4, seq: int = 128) -> list[str]:
    """The report's lines: the median step of a 2-worker ``zero3`` run and of a 2-worker ``node`` run."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        medians = {name: train_medians(tmp, name, ["--strategy", name, "--nproc", "2", *extra], steps=steps,
                                       batch=batch, seq=seq)["step_s"]
                   for name, extra in (("zero3", []), ("node", ["--spawn-node"]))}
    return ["| run | zero3 step | node step | node / zero3 (target <= 1.0) |", "|---|---|---|---|",
            (f"| gpt-tiny, 2 workers x batch {batch} x seq {seq} | zero3 {medians['zero3'] * 1e3:.0f} ms | "
             f"node {medians['node'] * 1e3:.0f} ms | node/zero3 {medians['node'] / medians['zero3']:.2f} |")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="MiB pushed and pulled per round (default 64)")
    ap.add_argument("--chunk", default="4MiB", help="message chunk (default 4MiB)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--curve", action="store_true", help="both over CURVE")
    ap.add_argument("--train", action="store_true", help="node vs zero3 step time instead (2 workers)")
    ap.add_argument("--steps", type=int, default=20, help="--train: steps of each run; steps 3.. are measured")
    ap.add_argument("--batch", type=int, default=4, help="--train: sequences per worker")
    ap.add_argument("--seq", type=int, default=128, help="--train: tokens per sequence")
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    args = ap.parse_args()
    if args.train:
        if args.steps < 3:
            ap.error(f"--steps {args.steps}: the median is taken over steps 3.., so pass --steps 3 or more")
        emit(compare_train(steps=args.steps, batch=args.batch, seq=args.seq), args.out)
        return
    total, chunk = args.mib * 2**20, parse_size(args.chunk)
    raw = measure(total=total, chunk=chunk, protocol=False, repeats=args.repeats, curve=args.curve)
    ours = measure(total=total, chunk=chunk, protocol=True, repeats=args.repeats, curve=args.curve)
    emit(["| transport | per round | chunk | raw pyzmq GB/s | protocol GB/s | ratio (target >= 0.8x) |",
          "|---|---|---|---|---|---|",
          (f"| {'CURVE' if args.curve else 'plain'} | {args.mib} MiB | {args.chunk} | {raw:.2f} | {ours:.2f} | "
           f"{ours / raw:.2f}x |")], args.out)


if __name__ == "__main__":
    main()
