"""The node protocol's header checks, and the node's state machine driven directly (no sockets): a seeded
fuzz of thousands of malformed, stale, duplicate and unexpected messages leaves it alive, its state
unchanged and every reject counted; a refused HELLO names the difference; a missing worker is named."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from luwu_rt._C import crc32c
from luwu_rt.node.manifest import difference, job_id, manifest_bytes
from luwu_rt.node.protocol import (DTYPE_CODES, DTYPES, HEADER, MAGIC, MAX_PAYLOAD_BYTES, VERSION, F, Message,
                                   ProtocolError, T, decode, encode)
from luwu_rt.node.service import NodeConfig, NodeService

CHUNK = 4096
SIZES = (3000, 5000)  # fp32 gradients of 3 and 5 chunks


def manifest(**optim) -> dict:
    return {"model": {"units": [{"name": f"u{i}", "num_params": n, "reads": []} for i, n in enumerate(SIZES)],
                      "param_bytes": 4, "chunk_bytes": CHUNK, "max_shards_per_state": 2,
                      "optimizer_waits_for_backward": False},
            "optim": {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 0, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                      "weight_decay": 0.1, "grad_clip": 0.0, "schedule_steps": 3, **optim},
            "steps": 3, "dtype": "fp32", "loss_scale": 1.0, "num_workers": 2, "start_step": 0, "adam_step": 0,
            "compress": "none"}


def test_encode_decode_round_trip() -> None:
    msg = Message(T.PUSH_GRAD, flags=F.LAST, job=7, rank=1, step=9, unit=2, chunk=3, offset=4096 * 3,
                  dtype=DTYPE_CODES["float32"], epoch=5, payload=bytes(range(256)) * 16)
    got = decode(encode(msg))
    assert (got.type, got.flags, got.job, got.rank, got.step, got.unit, got.chunk, got.offset, got.dtype, got.epoch) \
        == (T.PUSH_GRAD, F.LAST, 7, 1, 9, 2, 3, 4096 * 3, DTYPE_CODES["float32"], 5)
    assert bytes(got.payload) == bytes(msg.payload) and HEADER.size == 56
    # Over CURVE (trusted) the CRC pass is skipped, the flag does not leak into the message.
    unchecked = decode(encode(msg, checksum=False), trusted=True)
    assert unchecked.flags == F.LAST and bytes(unchecked.payload) == bytes(msg.payload)


def _header(**f) -> bytes:
    v = dict(magic=MAGIC, version=VERSION, type=T.PUSH_GRAD, flags=0, job=0, rank=0, step=1, unit=0, chunk=0,
             offset=0, nbytes=8, dtype=1, epoch=0, checksum=crc32c(b"\0" * 8))
    v.update(f)
    return HEADER.pack(*v.values())


@pytest.mark.parametrize("frames, reason", [
    ([b"x" * 10], "header"), ([_header(magic=b"NOPE"), b"\0" * 8], "magic"),
    ([_header(version=VERSION + 1), b"\0" * 8], "version"), ([_header(type=99), b"\0" * 8], "type"),
    ([_header(flags=0x80), b"\0" * 8], "flags"), ([_header(dtype=77), b"\0" * 8], "dtype"),
    ([_header(nbytes=MAX_PAYLOAD_BYTES + 4)], "size"), ([_header(type=T.PULL_PARAM), b"\0" * 8], "payload"),
    ([_header()], "frames"), ([_header(), b"\0" * 4], "length"), ([_header(offset=2), b"\0" * 8], "alignment"),
    ([_header(checksum=1), b"\0" * 8], "checksum"), ([_header(), b"\0" * 8, b""], "frames"),
    ([_header(flags=F.UNCHECKED, checksum=0), b"\0" * 8], "checksum"),  # no CRC is for CURVE transports only
])
def test_decode_rejects_before_reading_the_payload(frames, reason) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.reason == reason


def test_wire_numbers_stay_those_older_peers_speak() -> None:
    """Message types and dtype codes are the wire's numbering: the names may move, the numbers never. Type 7
    (SNAPSHOT, reserved and never sent) has no name and decodes as an unknown type, its number unused."""
    assert {name: getattr(T, name) for name in T.NAMES.values()} == {
        "HELLO": 1, "WELCOME": 2, "PUSH_GRAD": 3, "PARAM": 4, "PULL_PARAM": 5, "HEARTBEAT": 6, "ERROR": 8,
        "ACK": 9, "INIT": 10, "STATS": 11, "NORM": 12, "BEGIN": 13, "GET_STATE": 14, "STATE": 15,
        "ROLLBACK": 16}
    assert not hasattr(T, "SNAPSHOT")
    with pytest.raises(ProtocolError) as info:
        decode([_header(type=7, nbytes=0, checksum=0)])
    assert info.value.reason == "type"
    assert DTYPES == {0: ("none", 1), 1: ("float32", 4), 2: ("bfloat16", 2), 3: ("float16", 2), 4: ("json", 1),
                      5: ("utf8", 1), 6: ("float64", 8), 7: ("uint8", 1)}


def _joined(service: NodeService) -> dict:
    """Two workers said HELLO, worker 0 sent initial masters: the node welcomed them (step 0)."""
    m = manifest()
    for rank in (0, 1):
        service.handle(b"w%d" % rank, encode(Message(T.HELLO, rank=rank, dtype=DTYPE_CODES["json"],
                                                     payload=manifest_bytes(m))))
    job = job_id(m)
    for u, n in enumerate(SIZES):
        data = torch.arange(n, dtype=torch.float32).numpy().tobytes()
        for off in range(0, len(data), CHUNK):
            service.handle(b"w0", encode(Message(T.INIT, job=job, rank=0, unit=u, chunk=0, offset=off,
                                                 dtype=DTYPE_CODES["float32"], payload=data[off : off + CHUNK])))
    service.handle(b"w0", encode(Message(T.INIT, flags=F.LAST, job=job, rank=0)))
    assert service.welcomed
    return m


def _state(service: NodeService):
    r = service.runner
    pushes = (tuple(r.pushes.applied), [{k: (v.clone(), sorted(a.got)) for k, (v, a) in p.items()}
                                        for p in r.pushes.parts])
    arenas = {t: a.buffer.clone() for t, a in r.store.arenas.items()}
    served = ([list(v) for v in r.served.versions], [tuple(b.clone() for b in pair) for pair in r.served.buffers])
    return pushes, arenas, served, dict(service.protocol.waiting)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):  # bit for bit: a receive buffer's unwritten bytes may hold NaN patterns
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_seeded_fuzz_leaves_the_node_alive_and_unchanged() -> None:
    service = NodeService(NodeConfig(num_workers=2, host_mem="16MiB"), run_steps=False, log=lambda line: None)
    m = _joined(service)
    job, epoch = job_id(m), service.epoch
    good = Message(T.PUSH_GRAD, job=job, rank=0, step=1, unit=1, chunk=0, offset=0, dtype=1, epoch=epoch,
                   payload=torch.ones(CHUNK // 4).numpy().tobytes())
    service.handle(b"w0", encode(good))  # one real push: the node has pending state to keep intact
    service.protocol.outbox.clear()
    before, rejects0, dups0 = _state(service), sum(service.rejects.values()), service.duplicates
    rng = random.Random(1234)
    other = manifest(lr=2e-2)

    def push(**f) -> list:
        v = dict(type=T.PUSH_GRAD, job=job, rank=0, step=1, unit=0, chunk=0, offset=0, dtype=1, epoch=epoch,
                 payload=rng.randbytes(CHUNK))
        v.update(f)
        return encode(Message(**v))

    cases = [
        lambda: (rng.randbytes(4), [rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(0, 4))]),
        lambda: (b"w0", [f[: rng.randrange(len(f))] if i == 0 else f for i, f in enumerate(push())]),  # truncated
        lambda: (b"w0", [_header(nbytes=MAX_PAYLOAD_BYTES + 8 * rng.randrange(1, 100))]),  # oversized
        lambda: (b"w0", [HEADER.pack(MAGIC, VERSION + rng.randrange(1, 9), *HEADER.unpack(push()[0])[2:]),
                         rng.randbytes(CHUNK)]),  # wrong version
        lambda: (b"w0", push(step=0)),  # stale: answered as a duplicate
        lambda: (b"w0", encode(good)),  # the same push again: a duplicate
        lambda: (b"w0", push(unit=1, payload=rng.randbytes(CHUNK))),  # a duplicate chunk with other bytes
        lambda: (b"w1", push(rank=1, step=rng.randrange(2, 1000))),  # a future step
        lambda: (b"w1", push(rank=1, unit=rng.choice([2, 99, -1]))),  # no such unit
        lambda: (b"w1", push(rank=1, offset=CHUNK * rng.randrange(3, 50))),  # past the unit's bytes
        lambda: (b"w1", push(rank=1, payload=rng.randbytes(8))),  # not a whole chunk
        lambda: (b"w1", push(rank=0)),  # another worker's rank
        lambda: (b"w1", push(rank=1, job=job ^ 1)),  # another run
        lambda: (b"w1", push(rank=1, epoch=epoch + 1)),  # an earlier node
        lambda: (b"intruder", push(rank=1)),  # never said HELLO
        lambda: (b"w1", encode(Message(T.PULL_PARAM, job=job, rank=1, step=rng.randrange(3, 100), unit=0,
                                       epoch=epoch))),  # a pull far ahead
        lambda: (b"w1", encode(Message(T.INIT, job=job, rank=1, unit=0, dtype=1, payload=b"\0" * 16))),
        lambda: (b"w1", encode(Message(T.WELCOME, job=job, rank=1, epoch=epoch))),  # a node's message
        lambda: (b"w1", encode(Message(T.HELLO, rank=1, dtype=4, payload=manifest_bytes(other)))),  # disagrees
        lambda: (b"w1", encode(Message(T.HELLO, rank=1, dtype=4, payload=b"{not json"))),
    ]
    duplicates = 0
    for i in range(4000):
        pick = rng.randrange(len(cases))
        duplicates += pick in (4, 5, 6)
        identity, frames = cases[pick]()
        service.handle(identity, frames)
    assert service.duplicates - dups0 == duplicates
    assert sum(service.rejects.values()) - rejects0 == 4000 - duplicates, dict(service.rejects)
    assert service.rejects["internal"] == 0
    assert _equal(_state(service), before), "a rejected or duplicate message changed the node's state"
    # The workers of the run are still served: worker 1 completes unit 1's push of step 1.
    for off in range(0, SIZES[1] * 4, CHUNK):
        n = min(CHUNK, SIZES[1] * 4 - off)
        service.handle(b"w1", push(rank=1, unit=1, chunk=off // CHUNK, offset=off, payload=b"\0" * n))
    assert service.runner.pushes.parts[1][1][1].got == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("cut", ["unit", "chunk"])
def test_an_initial_state_without_a_units_master_is_refused_by_name(cut) -> None:
    """Worker 0's LAST with a unit's master missing (or sent in part) is refused naming it: welcomed, the node
    would serve parameters nobody sent and the workers' pulls would wait forever. The whole state then joins."""
    service = NodeService(NodeConfig(num_workers=2, host_mem="16MiB"), run_steps=False, log=lambda line: None)
    m = manifest()
    for rank in (0, 1):
        service.handle(b"w%d" % rank, encode(Message(T.HELLO, rank=rank, dtype=DTYPE_CODES["json"],
                                                     payload=manifest_bytes(m))))
    job = job_id(m)

    def init(unit: int, chunks: int | None = None) -> None:
        data = torch.arange(SIZES[unit], dtype=torch.float32).numpy().tobytes()
        for off in list(range(0, len(data), CHUNK))[:chunks]:
            service.handle(b"w0", encode(Message(T.INIT, job=job, rank=0, unit=unit, chunk=0, offset=off,
                                                 dtype=DTYPE_CODES["float32"], payload=data[off : off + CHUNK])))

    init(0)
    if cut == "chunk":
        init(1, chunks=1)
    service.handle(b"w0", encode(Message(T.INIT, flags=F.LAST, job=job, rank=0)))
    identity, frames = service.protocol.outbox[-1]
    reply = decode(frames)
    text = bytes(reply.payload).decode()
    assert identity == b"w0" and reply.type == T.ERROR and not service.welcomed
    assert ("the master of unit(s) 1" in text) == (cut == "unit"), text
    assert ("the rest of unit 1 master" in text) == (cut == "chunk"), text
    init(1)
    service.handle(b"w0", encode(Message(T.INIT, flags=F.LAST, job=job, rank=0)))
    assert service.welcomed


def test_a_hello_that_disagrees_is_refused_naming_the_difference() -> None:
    """The node's log names both values; the peer, unauthenticated without CURVE, hears where its run differs
    and its own value, not the node's ([Note: who may join] in machine.py)."""
    lines: list[str] = []
    service = NodeService(NodeConfig(num_workers=2, host_mem="16MiB"), run_steps=False, log=lines.append)
    service.handle(b"w0", encode(Message(T.HELLO, rank=0, dtype=4, payload=manifest_bytes(manifest()))))
    service.handle(b"w1", encode(Message(T.HELLO, rank=1, dtype=4, payload=manifest_bytes(manifest(lr=0.5)))))
    identity, frames = service.protocol.outbox[-1]
    reply = decode(frames)
    text = bytes(reply.payload).decode()
    assert identity == b"w1" and reply.type == T.ERROR
    assert "at optim.lr (this worker's: 0.5" in text and "0.01" not in text, text
    assert any("optim.lr: 0.01 != 0.5" in line for line in lines), lines
    assert difference({"a": [1, {"b": 2}]}, {"a": [1, {"b": 3}]}) == "a[1].b: 2 != 3"
    assert json.loads(manifest_bytes(manifest()))["manifest_version"] == 1


def test_a_worker_with_another_codec_is_refused_naming_the_codec() -> None:
    """The run's codec is part of the manifest ([Note: compressed pushes] in plan/codec.py): a worker that
    compresses otherwise than the run the node serves is refused at ``compress``, and a codec the node cannot
    decode is refused before it binds the node to a run."""
    lines: list[str] = []
    service = NodeService(NodeConfig(num_workers=2, host_mem="16MiB"), run_steps=False, log=lines.append)
    service.handle(b"w0", encode(Message(T.HELLO, rank=0, dtype=4, payload=manifest_bytes({**manifest(),
                                                                                          "compress": "bf16"}))))
    service.handle(b"w1", encode(Message(T.HELLO, rank=1, dtype=4, payload=manifest_bytes({**manifest(),
                                                                                          "compress": "onebit"}))))
    identity, frames = service.protocol.outbox[-1]
    text = bytes(decode(frames).payload).decode()
    assert identity == b"w1" and "at compress (this worker's: 'onebit'" in text, text
    assert any("compress: 'bf16' != 'onebit'" in line for line in lines), lines
    assert service.runner.pushes.dtype == "uint8"
    for codec, error in (("powersgd:2", "a node decodes none, bf16, fp16, onebit, topk"), (4, "a codec's name"),
                         ("topk:7", "0 < RATIO <= 1")):
        fresh = NodeService(NodeConfig(num_workers=2, host_mem="16MiB"), run_steps=False, log=lines.append)
        fresh.handle(b"w0", encode(Message(T.HELLO, rank=0, dtype=4, payload=manifest_bytes({**manifest(),
                                                                                            "compress": codec}))))
        text = bytes(decode(fresh.protocol.outbox[-1][1]).payload).decode()
        assert "manifest.compress" in text and error in text and fresh.manifest is None, text


def test_an_older_workers_hello_is_refused_naming_both_versions() -> None:
    """A worker of protocol version 3 (no codec in its manifest) hears why in an ERROR of its own version, which
    its decode reads: its header layout and CRC-32C are this version's; the node's log names it too."""
    lines: list[str] = []
    service = NodeService(NodeConfig(num_workers=2, host_mem="16MiB"), run_steps=False, log=lines.append)
    old = {k: v for k, v in manifest().items() if k != "compress"}
    service.handle(b"w1", encode(Message(T.HELLO, rank=1, dtype=4, payload=manifest_bytes(old)), version=3))
    identity, frames = service.protocol.outbox[-1]
    fields = HEADER.unpack(frames[0])
    assert identity == b"w1" and fields[1] == 3 and fields[2] == T.ERROR
    assert fields[-1] == crc32c(frames[1])
    text = bytes(frames[1]).decode()
    assert f"worker 1 speaks node protocol version 3, this node version {VERSION}" in text, text
    assert any("worker 1 speaks node protocol version 3" in line for line in lines), lines
    assert service.rejects["version"] == 1 and service.manifest is None and not service.protocol.hellos
    # Anything else of another version is dropped unanswered, as before: a HELLO without its manifest too.
    service.handle(b"w1", encode(Message(T.HEARTBEAT, rank=1), version=3))
    service.handle(b"w2", encode(Message(T.HELLO, rank=2), version=3))
    assert len(service.protocol.outbox) == 1 and service.rejects["version"] == 3


def test_a_worker_that_never_pushes_is_named_after_the_timeout() -> None:
    service = NodeService(NodeConfig(num_workers=2, host_mem="16MiB", timeout=1.0), log=lambda line: None,
                          chaos=None)
    m = _joined(service)
    job = job_id(m)
    for u, n in enumerate(SIZES):  # worker 0 pushes everything of step 1; worker 1 nothing
        data = torch.zeros(n).numpy().tobytes()
        for off in range(0, len(data), CHUNK):
            service.handle(b"w0", encode(Message(T.PUSH_GRAD, job=job, rank=0, step=1, unit=u, chunk=off // CHUNK,
                                                 offset=off, dtype=1, epoch=service.epoch,
                                                 payload=data[off : off + CHUNK])))
    assert service.done_steps.wait(30)
    assert isinstance(service.error, TimeoutError)
    assert "from worker(s) [1] within 1s" in str(service.error) and "worker 1 never heard" in str(service.error)


def test_the_push_and_serve_buffers_count_in_the_host_budget() -> None:
    """2M fp32 parameters: two workers' pending pushes (16 MiB), the two served copies (16 MiB) and one
    unit's initial state (4 MiB) do not fit in 5 MiB of host memory: the node refuses the run and says how
    much its buffers take."""
    from luwu_rt.node.runner import NodeRunner

    m = manifest()
    m["model"]["units"] = [{"name": "u0", "num_params": 2**20, "reads": []}, {"name": "u1", "num_params": 2**20,
                                                                            "reads": []}]
    with pytest.raises(ValueError, match=r"push and serve buffers alone take 36.0 MiB .* raise --host-mem"):
        NodeRunner(m, num_workers=2, host_bytes=5 * 2**20, nvme_dir=None, timeout_s=1.0, on_served=lambda u, s: None,
                   chaos=None)


def test_a_node_without_the_runs_snapshot_refuses_a_rejoin() -> None:
    """Workers rejoining at step 3 a node restarted without its snapshot directory are told so, not left
    waiting for an initial state that no worker sends."""
    service = NodeService(NodeConfig(num_workers=2, host_mem="16MiB"), run_steps=False, log=lambda line: None)
    service.handle(b"w0", encode(Message(T.HELLO, rank=0, step=3, dtype=DTYPE_CODES["json"],
                                         payload=manifest_bytes(manifest()))))
    identity, frames = service.protocol.outbox[-1]
    reply = decode(frames)
    assert identity == b"w0" and reply.type == T.ERROR and service.manifest is None
    assert "holds no snapshot" in bytes(reply.payload).decode() and service.rejects["hello"] == 1


def test_a_client_keeps_at_most_its_credit_unacknowledged() -> None:
    """Byte-credit flow control ([Note: byte credits] in client.py): a push of 10 chunks sends CREDIT_CHUNKS of
    them, then one more per ACK; a duplicate ACK gives nothing back twice."""
    import threading

    from luwu_rt.node.client import NodeClient
    from luwu_rt.node.protocol import CREDIT_CHUNKS

    client = NodeClient("tcp://127.0.0.1:1", rank=0, timeout_s=30.0, chunk_bytes=CHUNK)
    sent: list[Message] = []
    try:
        client._send = lambda msg, flush=True: sent.append(msg)
        data = torch.zeros(10 * CHUNK // 4)
        pusher = threading.Thread(target=client.push, args=(1, 0, [(0, data)]), daemon=True)
        pusher.start()
        time.sleep(0.3)
        assert len(sent) == CREDIT_CHUNKS and pusher.is_alive()

        def ack(m: Message) -> None:
            client.last_heard = time.monotonic()
            client._receive(encode(Message(T.ACK, step=m.step, unit=m.unit, chunk=m.chunk, offset=m.offset)))

        ack(sent[0])
        ack(sent[0])  # a duplicate ACK
        time.sleep(0.3)
        assert len(sent) == CREDIT_CHUNKS + 1
        for i in range(1, 10):
            ack(sent[i])
            deadline = time.monotonic() + 5
            while len(sent) < min(10, i + 1 + CREDIT_CHUNKS) and time.monotonic() < deadline:
                time.sleep(0.01)
        pusher.join(5)
        assert not pusher.is_alive() and len(sent) == 10 and client._inflight == 0
    finally:
        client.close(bye=False)
