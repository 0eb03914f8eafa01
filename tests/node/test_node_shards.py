"""Node shards ([Note: node shards] in luwu_rt/node/shards.py): two worker processes and two node shards on
loopback train gpt-tiny with exact clipping for 10 steps; their losses equal the single-process run on the
global batch within 1e-5 relative, plainly and with every process drawing chaos delays over CURVE; so do
three workers with two shards. Also:
the slices, a push whose message chunks span two store pieces, the norm hub, and the refusals of a
worker that lists the shards wrongly."""

from __future__ import annotations

import threading

import pytest
import torch

import node_jobs
from ranks import run_ranks

from luwu_rt.exec.chaos import CHAOS_ENV, Chaos
from luwu_rt.node.auth import keygen
from luwu_rt.node.service import NodeConfig, NodeService
from luwu_rt.node.shards import NormHub, slice_of

WORKERS = 2
SHARDS = 2


class Shards:
    """``SHARDS`` node services on loopback ports, each loop on a thread of the test process."""

    def __init__(self, *, chaos_seed: int | None, auth_keys: str | None = None, workers: int = WORKERS) -> None:
        self.services, self.threads, self.codes = [], [], []
        for i in range(SHARDS):
            chaos = Chaos(seed=chaos_seed + i, rank=1 << 16) if chaos_seed is not None else None
            service = NodeService(NodeConfig(bind="tcp://127.0.0.1:*", num_workers=workers, host_mem="64MiB",
                                             timeout=120.0, auth_keys=auth_keys, shard=f"{i}/{SHARDS}"),
                                  chaos=chaos, log=lambda line: None)
            ready = threading.Event()
            thread = threading.Thread(target=lambda s=service, r=ready: self.codes.append(s.serve(ready=r)),
                                      daemon=True)
            thread.start()
            assert ready.wait(30)
            self.services.append(service)
            self.threads.append(thread)

    @property
    def address(self) -> str:
        return ",".join(s.address for s in self.services)

    def finish(self) -> list[int]:
        for t in self.threads:
            t.join(60)
            assert not t.is_alive(), "a node shard did not stop after every worker said BYE"
        return self.codes


def _local(workers: int) -> list[float]:
    from luwu_rt.engine import Engine

    with pytest.MonkeyPatch.context() as m:
        m.delenv(CHAOS_ENV, raising=False)
        with Engine(None, node_jobs.config(batch_size=2 * workers, optim={"grad_clip": 0.5})) as engine:
            return [engine.train_step()["loss"] for _ in range(node_jobs.STEPS)]


def _close(got: list[float], want: list[float], what: str) -> None:
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert len(got) == len(want) and worst <= 1e-5, (what, worst, got, want)


@pytest.fixture(scope="module")
def local_losses():
    return _local(WORKERS)


def test_two_workers_and_two_node_shards_equal_the_single_process_run(local_losses, tmp_path):
    keygen(tmp_path / "keys")
    plain = Shards(chaos_seed=None)
    chaotic = Shards(chaos_seed=31, auth_keys=str(tmp_path / "keys"))
    clip = {"optim": {"grad_clip": 0.5}}  # exact clipping: the updates wait for the shards' summed norm
    runs = [("plain", {"strategy": "node", "node": plain.address, **clip}, ""),
            ("chaos", {"strategy": "node", "node": chaotic.address, **clip,
                       "node_key": str(tmp_path / "keys" / "worker.key_secret")}, "29")]
    results = run_ranks(node_jobs.train, WORKERS, runs, env={CHAOS_ENV: ""})
    assert plain.finish() == [0, 0] and chaotic.finish() == [0, 0]
    for key in ("plain", "chaos"):
        _close(results[0][key], local_losses, key)
        assert results[1][key] == results[0][key], "every worker reports the global loss"
    for shards in (plain, chaotic):
        # Each shard kept half of every unit, and both summed the same norms.
        numels = [s.runner.numels for s in shards.services]
        assert all(a > 0 and b > 0 and abs(a - b) <= 1 for a, b in zip(*numels)), numels
        assert all(sum(s.rejects.values()) == 0 for s in shards.services), [dict(s.rejects) for s in shards.services]
        assert shards.services[0].runner.optimizer.norms.total_sq == shards.services[1].runner.optimizer.norms.total_sq


def test_three_workers_and_two_node_shards_equal_the_single_process_run() -> None:
    shards = Shards(chaos_seed=None, workers=3)
    runs = [("plain", {"strategy": "node", "node": shards.address, "optim": {"grad_clip": 0.5}}, "")]
    results = run_ranks(node_jobs.train, 3, runs, env={CHAOS_ENV: ""})
    assert shards.finish() == [0, 0]
    _close(results[0]["plain"], _local(3), "3 workers")
    assert results[1]["plain"] == results[2]["plain"] == results[0]["plain"]


def test_workers_with_their_params_on_nvme_equal_the_single_process_run(local_losses, tmp_path) -> None:
    """With exact clipping the shards serve nothing before the last push, and in 1 MiB of host the workers reuse
    the memory of pulled parameters written back to NVMe: planned with each pull right after its push, a
    backward's load waited on a pull, the node on that backward's push, and the step hung."""
    shards = Shards(chaos_seed=None)
    offload = {"params": "nvme", "host_mem": "1MiB", "nvme_dir": str(tmp_path / "nvme")}
    runs = [("nvme", {"strategy": "node", "node": shards.address, "optim": {"grad_clip": 0.5}, "offload": offload}, "")]
    results = run_ranks(node_jobs.train, WORKERS, runs, env={CHAOS_ENV: ""})
    assert shards.finish() == [0, 0]
    _close(results[0]["nvme"], local_losses, "params on nvme")
    assert results[1]["nvme"] == results[0]["nvme"]


def test_slices_cover_every_element_once() -> None:
    for numel in (1, 2, 7, 4096, 10_001):
        for count in (1, 2, 3, 5):
            got = [slice_of(numel, i, count) for i in range(count)]
            assert sum(n for _, n in got) == numel
            assert all(s + n == t or n == 0 for (s, n), (t, _) in zip(got, got[1:]))


def test_a_push_whose_chunks_span_two_pieces_is_sent_whole() -> None:
    """A shard's slice starts anywhere in the worker's store pieces: the message chunks are cut from the
    slice, copying only where one spans two pieces."""
    from luwu_rt.node.client import NodeClient

    client = NodeClient("tcp://127.0.0.1:1", rank=0, timeout_s=1.0, chunk_bytes=4096)
    try:
        sent = []
        client._send = lambda msg, flush=True: sent.append(msg)
        data = torch.arange(3000, dtype=torch.float32)
        pieces = [(0, data[:700]), (2800, data[700:1900]), (7600, data[1900:])]
        client.push(1, 0, pieces)
        assert [m.offset for m in sent] == [0, 4096, 8192]
        assert b"".join(bytes(m.payload) for m in sent) == data.numpy().tobytes()
    finally:
        client.close(bye=False)


def test_the_norm_hub_answers_every_shard_in_shard_order() -> None:
    done = []
    hub = NormHub(3, timeout_s=5.0, on_complete=done.append)
    hub.offer(7, 2, 4.0, b"two")
    hub.offer(7, 1, 2.0, b"one")
    assert hub.replies(7) == [] and not done
    threading.Timer(0.05, lambda: None).start()
    assert hub.exchange(7, 1.0) == [1.0, 2.0, 4.0] and done == [7]
    assert sorted(hub.replies(7)) == [(b"one", [1.0, 2.0, 4.0]), (b"two", [1.0, 2.0, 4.0])]
    hub.offer(7, 1, 9.0, b"one")  # a repeat changes nothing, it is answered again
    assert hub.replies(7)[0][1] == [1.0, 2.0, 4.0] and done == [7, 7]


def test_a_partial_of_a_shards_earlier_incarnation_is_dropped() -> None:
    """Shard 1's old incarnation left its partial of step 6 at shard 0 before it went back to step 4 ([Note: node
    shards that restart] in node/worker.py); once its new incarnation is heard from, step 6 waits for the new
    one's partial and never sums the old."""
    done = []
    hub = NormHub(2, timeout_s=5.0, on_complete=done.append)
    hub.offer(6, 1, 111.0, b"old", epoch=5)
    hub.offer(5, 1, 1.0, b"new", epoch=7)
    hub.offer(5, 0, 2.0)
    assert hub.answers[5] == [2.0, 1.0] and done == [5]
    hub.offer(6, 0, 3.0)
    assert 6 not in hub.answers, "the old incarnation's partial was summed"
    hub.offer(6, 1, 4.0, b"new", epoch=7)
    assert hub.answers[6] == [3.0, 4.0] and done == [5, 6]


def test_a_worker_naming_the_wrong_number_of_shards_is_refused() -> None:
    from test_protocol import manifest

    from luwu_rt.node.manifest import manifest_bytes
    from luwu_rt.node.protocol import DTYPE_CODES, Message, T, decode, encode

    service = NodeService(NodeConfig(num_workers=2, shard="1/2"), run_steps=False, log=lambda line: None)
    m = manifest()
    service.handle(b"w0", encode(Message(T.HELLO, rank=0, dtype=DTYPE_CODES["json"],
                                         payload=manifest_bytes(m))))  # a whole manifest, as a worker sends
    (identity, frames), = service.protocol.outbox
    reply = decode(frames)
    assert reply.type == T.ERROR and "names 1 node address(es)" in bytes(reply.payload).decode()
    assert service.manifest is None and service.rejects["hello"] == 1
