"""One chunking and one reassembly of payloads on the wire ([Note: wire chunks] in luwu_rt/node/chunks.py):
any split of a range into pieces round-trips through ``cut`` and ``Assembly`` in any order; a repeated chunk
is neither written nor counted twice; a chunk at a wrong offset or of a wrong length is refused before a byte
is written; and the node, sent worker 0's initial state with a chunk duplicated, still takes all of it."""

from __future__ import annotations

import random

import pytest
import torch

from luwu_rt.node.chunks import Assembly, cut
from luwu_rt.node.protocol import ProtocolError


def _split(data: torch.Tensor, rng: random.Random) -> list[tuple[int, torch.Tensor]]:
    bounds = sorted({0, data.numel(), *(rng.randrange(data.numel() + 1) for _ in range(rng.randrange(4)))})
    return [(a, data[a:b]) for a, b in zip(bounds, bounds[1:])]


def test_any_split_round_trips_in_any_order_and_duplicates_count_once() -> None:
    rng = random.Random(3)
    for _ in range(200):
        chunk = rng.choice([1, 7, 64, 4096])
        data = torch.randint(0, 256, (rng.randrange(1, 3 * chunk + 5),), dtype=torch.uint8)
        chunks = cut(_split(data, rng), chunk_bytes=chunk)
        assert [offset for offset, _ in chunks] == list(range(0, data.numel(), chunk))
        out = torch.zeros_like(data)
        assembly = Assembly(_split(out, rng), chunk_bytes=chunk)  # the receiver's pieces split elsewhere
        order = chunks + rng.sample(chunks, k=min(3, len(chunks)))  # some chunks arrive twice
        rng.shuffle(order)
        fresh = [assembly.put(offset, payload) for offset, payload in order]
        assert sum(fresh) == len(chunks) and assembly.complete
        assert torch.equal(out, data)


def test_a_chunk_out_of_place_is_refused_before_it_is_written() -> None:
    out = torch.zeros(10, dtype=torch.uint8)
    assembly = Assembly([(0, out)], chunk_bytes=4)
    for offset, payload in [(2, b"ab"), (4, b"abc"), (8, b"abc"), (12, b"ab"), (-4, b"abcd")]:
        with pytest.raises(ProtocolError) as info:
            assembly.put(offset, payload)
        assert info.value.reason == "range"
    assert not out.any() and not assembly.got
    assert assembly.put(8, b"ab") and not assembly.complete  # the short last chunk is whole


def test_a_duplicated_init_chunk_leaves_the_initial_state_whole() -> None:
    """Worker 0 sends unit 1's master (5 chunks) with chunk 1 sent twice: the node takes the state once it
    has every chunk (before, a repeat counted twice and the unit was taken one chunk short)."""
    from test_protocol import CHUNK, SIZES, manifest

    from luwu_rt.node.manifest import job_id, manifest_bytes
    from luwu_rt.node.protocol import DTYPE_CODES, F, Message, T, decode, encode
    from luwu_rt.node.service import NodeConfig, NodeService

    service = NodeService(NodeConfig(num_workers=2, host_mem="16MiB"), run_steps=False, log=lambda line: None)
    m = manifest()
    job = job_id(m)
    for rank in (0, 1):
        service.handle(b"w%d" % rank, encode(Message(T.HELLO, rank=rank, dtype=DTYPE_CODES["json"],
                                                     payload=manifest_bytes(m))))
    want = {u: torch.arange(n, dtype=torch.float32) + 100 * u for u, n in enumerate(SIZES)}
    for u, values in want.items():
        data = values.numpy().tobytes()
        offsets = list(range(0, len(data), CHUNK))
        if u == 1:
            offsets.insert(2, CHUNK)  # chunk 1 again
        for off in offsets:
            service.handle(b"w0", encode(Message(T.INIT, job=job, rank=0, unit=u, chunk=0, offset=off,
                                                 dtype=DTYPE_CODES["float32"], payload=data[off : off + CHUNK])))
    service.handle(b"w0", encode(Message(T.INIT, flags=F.LAST, job=job, rank=0)))
    assert service.welcomed and sum(service.rejects.values()) == 0, dict(service.rejects)
    acks = [decode(frames) for _, frames in service.protocol.outbox if decode(frames).type == T.ACK]
    assert sum(a.flags & F.DUPLICATE != 0 for a in acks) == 1, "the repeat is ACKed as a duplicate"
    for u, values in want.items():
        got = service.runner.store.read_state(u, "master", torch.empty(SIZES[u], dtype=torch.float32))
        assert torch.equal(got, values), f"unit {u}'s initial master"
