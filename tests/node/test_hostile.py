"""The optimizer node under a hostile local peer (issue 20, items 1, 3, 4): a HELLO is checked whole before it
changes anything and the node binds a run only to a valid one; every wait on both sides ends within --timeout;
a stranger's flood costs the node no memory beyond its bound; a rank that joined is not taken over."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from luwu_rt.node.auth import client_keys, keygen
from luwu_rt.node.client import NodeClient, NodeError
from luwu_rt.node.manifest import MAX_UNITS, manifest_bytes
from luwu_rt.node.protocol import CREDIT_CHUNKS, DTYPE_CODES, F, Message, T, decode, encode
from luwu_rt.node.service import NodeConfig, NodeService

from test_protocol import CHUNK, SIZES, manifest


def _hello(service: NodeService, identity: bytes, rank: int, payload: bytes) -> None:
    service.handle(identity, encode(Message(T.HELLO, rank=rank, dtype=DTYPE_CODES["json"], payload=payload)))


def _init(service: NodeService, identity: bytes, m: dict, *, duplicate: bool = False) -> None:
    job = service.protocol.job
    for u, n in enumerate(SIZES):
        data = torch.arange(n, dtype=torch.float32).numpy().tobytes()
        for off in range(0, len(data), CHUNK):
            for _ in range(2 if duplicate else 1):
                service.handle(identity, encode(Message(T.INIT, job=job, rank=0, unit=u, chunk=0, offset=off,
                                                        dtype=DTYPE_CODES["float32"], payload=data[off : off + CHUNK])))
    service.handle(identity, encode(Message(T.INIT, flags=F.LAST, job=job, rank=0)))


def _malformed() -> list[tuple[str, bytes]]:
    good = json.loads(manifest_bytes(manifest()))
    cases = [("partial", json.dumps({"num_workers": 2}).encode()),
             ("dtype", json.dumps({**good, "dtype": "xx"}).encode()),
             ("bool for an int", json.dumps({**good, "steps": True}).encode()),
             ("NaN", manifest_bytes(manifest()).replace(b'"loss_scale":1.0', b'"loss_scale":NaN')),
             ("negative size", json.dumps({**good, "model": {**good["model"], "units": [
                 {"name": "u0", "num_params": -5, "reads": []}]}}).encode()),
             ("reads itself", json.dumps({**good, "model": {**good["model"], "units": [
                 {"name": "u0", "num_params": 5, "reads": [0]}]}}).encode()),
             ("unknown key", json.dumps({**good, "extra": 1}).encode()),
             ("nested deep", b"[" * 100_000 + b"]" * 100_000),
             ("not json", b"{not json")]
    assert b'"loss_scale":NaN' in cases[3][1]
    return cases


def test_a_malformed_hello_binds_nothing_and_the_valid_run_then_joins() -> None:
    """A partial manifest used to bind the node to itself (KeyError inside, the real workers then refused
    at adam_step, the node never exiting); `dtype: "xx"` bound it too. Now each is refused whole, nothing
    changes, and the real workers join - worker 0's initial state sent with every chunk twice."""
    lines: list[str] = []
    service = NodeService(NodeConfig(num_workers=2, host_mem="16MiB"), run_steps=False, log=lines.append)
    for name, payload in _malformed():
        _hello(service, b"evil", 0, payload)
        assert service.manifest is None and service.runner is None and not service.peers, name
        reply = decode(service.protocol.outbox[-1][1])
        assert reply.type == T.ERROR, name
    assert service.rejects["hello"] == len(_malformed()) and service.rejects["internal"] == 0, dict(service.rejects)
    m = manifest()
    for rank in (0, 1):
        _hello(service, b"w%d" % rank, rank, manifest_bytes(m))
    _init(service, b"w0", m, duplicate=True)
    assert service.welcomed and service.rejects["internal"] == 0, (dict(service.rejects), lines)


def test_a_hello_of_too_many_units_is_refused_at_once() -> None:
    """A HELLO declaring 20,000 units froze the node's one loop in planning for minutes: the size is capped,
    and checking it is linear."""
    service = NodeService(NodeConfig(num_workers=2, host_mem="16MiB"), run_steps=False, log=lambda line: None)
    m = manifest()
    m["model"]["units"] = [{"name": f"u{i}", "num_params": 1024, "reads": []} for i in range(20_000)]
    start = time.monotonic()
    _hello(service, b"evil", 0, manifest_bytes(m)[:250_000])  # within the HELLO cap: a truncated manifest
    m["model"]["units"] = m["model"]["units"][: MAX_UNITS + 1]
    _hello(service, b"evil", 0, manifest_bytes(m))
    m["model"]["units"][0]["reads"] = list(range(1, 30_000))  # a long list, checked in linear time
    _hello(service, b"evil2", 0, manifest_bytes(m)[:250_000])
    assert time.monotonic() - start < 5 and service.manifest is None and service.rejects["hello"] == 3


class _Node:
    """A node service on a loopback port, its loop on a thread; its lines kept."""

    def __init__(self, **config) -> None:
        self.lines: list[str] = []
        self.service = NodeService(NodeConfig(bind="tcp://127.0.0.1:*", host_mem="16MiB", **config),
                                   log=self.lines.append, chaos=None)
        ready = threading.Event()
        self.status: list[int] = []
        self.thread = threading.Thread(target=lambda: self.status.append(self.service.serve(ready=ready)), daemon=True)
        self.thread.start()
        assert ready.wait(20)

    def stop(self) -> None:
        self.service.stop()
        self.thread.join(20)
        assert not self.thread.is_alive()


def _raw(ctx, address: str, frames: list, keys=None):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
    sock.connect(address)
    sock.send_multipart(frames)
    return sock


def _join(address: str, m: dict, ranks=(0, 1), *, keys=None, timeout_s: float = 20.0) -> dict:
    """Workers ``ranks`` join with ``m`` (worker 0 sends an initial state); rank -> WELCOME or the error."""
    out: dict = {}

    def one(rank: int) -> None:
        client = NodeClient(address, rank=rank, timeout_s=timeout_s, chunk_bytes=CHUNK,
                            node_key=keys[rank] if keys else None)
        initial = [(u, 0, torch.zeros(n)) for u, n in enumerate(SIZES)] if rank == 0 else None
        try:
            out[rank] = client.connect(m, initial)
        except NodeError as exc:
            out[rank] = exc
        finally:
            client.close(bye=False)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return out


def test_over_sockets_a_partial_hello_does_not_lock_the_node() -> None:
    node = _Node(num_workers=2, timeout=20.0)
    ctx = zmq.Context()
    try:
        bad = _raw(ctx, node.service.address, encode(Message(T.HELLO, rank=0, dtype=4,
                                                             payload=json.dumps({"num_workers": 2}).encode())))
        assert bad.poll(10_000) and decode(bad.recv_multipart()).type == T.ERROR
        joined = _join(node.service.address, manifest())
        assert all(isinstance(w, dict) and w["step"] == 0 for w in joined.values()), joined
    finally:
        ctx.destroy(0)
        node.stop()


def test_a_node_that_no_worker_joins_exits_within_its_timeout(tmp_path) -> None:
    """`luwu node serve --timeout 3` and no workers: it exits 1 naming what it waited for (it ran forever)."""
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "luwu_rt", "node", "serve", "--num-workers", "2", "--timeout", "3",
                        "--bind", "tcp://127.0.0.1:*"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert "no run began within 3s without progress: waited for any worker's HELLO (of 2)" in r.stderr, r.stderr
    assert time.monotonic() - start < 30 and "Traceback" not in r.stderr


def test_a_node_left_waiting_for_a_worker_tells_the_one_that_came() -> None:
    node = _Node(num_workers=2, timeout=3.0)
    try:
        joined = _join(node.service.address, manifest(), ranks=(0,), timeout_s=60.0)
        assert isinstance(joined[0], NodeError) and "waited for the HELLO of worker(s) [1]" in str(joined[0]), joined
        node.thread.join(20)
        assert node.status == [1] and any("error: no run began within 3s" in line for line in node.lines), node.lines
    finally:
        node.stop()


def test_connect_ends_within_its_timeout_when_the_node_takes_no_initial_state() -> None:
    """A node that answers heartbeats but never ACKs worker 0's INIT (as one locked to another run did): the
    join ends within --timeout, saying what it waited for; it waited forever for its credit before."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def answer_heartbeats() -> None:
        while not stop.is_set():
            if router.poll(100):
                identity, *frames = router.recv_multipart()
                if decode(frames).type == T.HEARTBEAT:
                    router.send_multipart([identity, *encode(Message(T.HEARTBEAT, epoch=1))])

    thread = threading.Thread(target=answer_heartbeats, daemon=True)
    thread.start()
    client = NodeClient(f"tcp://127.0.0.1:{port}", rank=0, timeout_s=3.0, chunk_bytes=CHUNK)
    start = time.monotonic()
    try:
        with pytest.raises(NodeError, match="worker 0 sending the initial state of unit 0: the optimizer node .* "
                                            "answered nothing but heartbeats"):
            client.connect(manifest(), [(0, 0, torch.zeros((CREDIT_CHUNKS + 2) * CHUNK // 4))])
        assert time.monotonic() - start < 10
    finally:
        client.close(bye=False)
        stop.set()
        thread.join(5)
        router.close()
        ctx.term()


def test_a_rank_that_joined_is_not_taken_over() -> None:
    """A second connection saying HELLO as rank 1 mid-run took rank 1 over; now it is refused and logged, and
    the workers of the run keep their ranks."""
    lines: list[str] = []
    service = NodeService(NodeConfig(num_workers=2, host_mem="16MiB"), run_steps=False, log=lines.append)
    m = manifest()
    for rank in (0, 1):
        _hello(service, b"w%d" % rank, rank, manifest_bytes(m))
    _init(service, b"w0", m)
    assert service.welcomed
    _hello(service, b"intruder", 1, manifest_bytes(m))
    assert service.protocol.hellos == {0: b"w0", 1: b"w1"} and b"intruder" not in service.peers
    assert decode(service.protocol.outbox[-1][1]).type == T.ERROR
    assert any("a second connection claims worker rank 1" in line for line in lines), lines
    _hello(service, b"w0", 1, manifest_bytes(m))  # nor does a worker's connection take another rank
    assert service.protocol.hellos == {0: b"w0", 1: b"w1"} and service.peers[b"w0"] == 0
    # Refusals do not tell an unauthenticated peer the node's values: here its worker count.
    _hello(service, b"other", 0, manifest_bytes({**m, "num_workers": 3}))
    text = bytes(decode(service.protocol.outbox[-1][1]).payload).decode()
    assert "another number of workers" in text and "--num-workers 2" not in text, text


def test_with_per_worker_keys_a_takeover_is_logged_with_both_keys(tmp_path) -> None:
    keys = tmp_path / "keys"
    keygen(keys, workers=2)
    node = _Node(num_workers=2, timeout=30.0, auth_keys=str(keys))
    ctx = zmq.Context()
    try:
        joined = _join(node.service.address, manifest(),
                       keys={r: str(keys / f"worker{r}.key_secret") for r in (0, 1)})
        assert all(isinstance(w, dict) for w in joined.values()), joined
        assert any("worker 1 joined (key worker1)" in line for line in node.lines), node.lines
        intruder = _raw(ctx, node.service.address, encode(Message(T.HELLO, rank=1, dtype=4,
                                                                  payload=manifest_bytes(manifest())), checksum=False),
                        keys=client_keys(keys / "worker0.key_secret"))
        assert intruder.poll(10_000)
        assert decode(intruder.recv_multipart(), trusted=True).type == T.ERROR
        assert any("a second connection claims worker rank 1 (key worker0), which joined already (key worker1)"
                   in line for line in node.lines), node.lines
        assert node.service.protocol.keys == {0: "worker0", 1: "worker1"}
    finally:
        ctx.destroy(0)
        node.stop()


def test_keygen_makes_a_key_per_worker_never_readable_by_others(tmp_path, monkeypatch) -> None:
    """Secret keys are created 0600 (they were created under the umask and chmod'ed afterwards: readable by
    others in between); with --workers N one pair per worker, each in the allow-list."""
    import zmq.auth

    monkeypatch.setattr(os, "chmod", lambda *a, **k: None)  # what a crash between create and chmod leaves
    old = os.umask(0o022)
    try:
        written = keygen(tmp_path / "k", workers=3)
    finally:
        os.umask(old)
    secrets = sorted(p.name for p in written if p.name.endswith(".key_secret"))
    assert secrets == ["node.key_secret", "worker0.key_secret", "worker1.key_secret", "worker2.key_secret"]
    for p in written:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o600 if p.name.endswith("_secret") else 0o644), (p, oct(mode))
    allowed = zmq.auth.load_certificates(str(tmp_path / "k" / "clients"))
    assert len(allowed) == 3 and client_keys(tmp_path / "k" / "worker2.key_secret")[0] in allowed
    with pytest.raises(ValueError, match="exists already"):
        keygen(tmp_path / "k", workers=2)


_FLOOD = """
import sys, time, zmq
from luwu_rt.node.protocol import HEADER, MAGIC, VERSION, T
address, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
payload = bytes(16 * 2**20)
header = HEADER.pack(MAGIC, VERSION, T.PUSH_GRAD, 0, 0, 0, 1, 0, 0, 0, len(payload), 1, 0, 12345)  # a wrong CRC
ctx = zmq.Context()
socks = [ctx.socket(zmq.DEALER) for _ in range(count)]
for s in socks:
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 8)
    s.connect(address)
end, sent = time.monotonic() + seconds, 0
while time.monotonic() < end:
    for s in socks:
        try:
            s.send_multipart([header, payload], flags=zmq.NOBLOCK, copy=False)
            sent += 1
        except zmq.Again:
            pass
    time.sleep(0.002)
print(sent)
ctx.destroy(0)
"""


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_a_flood_of_large_messages_from_strangers_keeps_the_node_within_host_mem(tmp_path) -> None:
    """32 connections sending 16 MiB PUSH_GRAD frames with a wrong CRC on loopback, for 6 s, to a node with
    --host-mem 256MiB: its memory grows by less than that (it grew by GBs: each message checked in full
    and 68 of them waiting per connection)."""
    ready = tmp_path / "address"
    node = subprocess.Popen([sys.executable, "-m", "luwu_rt", "node", "serve", "--num-workers", "1", "--host-mem",
                             "256MiB", "--timeout", "60", "--bind", "tcp://127.0.0.1:*", "--ready-file", str(ready)],
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    flood = None
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert node.poll() is None and time.monotonic() < deadline, node.stderr.read() if node.poll() else "slow"
            time.sleep(0.05)
        time.sleep(0.5)
        before = _rss(node.pid)
        flood = subprocess.Popen([sys.executable, "-c", _FLOOD, ready.read_text(), "32", "6"], stdout=subprocess.PIPE,
                                 text=True)
        peak = before
        while flood.poll() is None:
            peak = max(peak, _rss(node.pid))
            if peak - before > 1.5 * 2**30:  # no need to watch it take the machine's memory
                break
            time.sleep(0.05)
        sent = int(flood.communicate(timeout=30)[0] or 0) if flood.poll() is not None else -1
        assert node.poll() is None, "the node died under the flood"
        assert peak - before < 256 * 2**20, f"node RSS grew by {(peak - before) / 2**20:.0f} MiB ({sent} messages)"
        assert sent > 100, f"the flood sent only {sent} messages"
    finally:
        for proc in (flood, node):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
