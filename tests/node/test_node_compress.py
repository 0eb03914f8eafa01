"""Compressed pushes to the optimizer node ([Note: compressed pushes] in plan/codec.py): two workers and a node
on loopback train gpt-tiny for 3 steps with bf16 and with onebit, plainly and with every process (the node too)
drawing chaos delays; each run equals ddp on the same two ranks with the same codec, whose ranks sum the same
decoded payloads in the same order, and its workers push fewer bytes. The HELLO carries the codec: a worker with
another codec, and one of an older protocol version, are refused by name."""

from __future__ import annotations

import pytest

import node_jobs
from ranks import run_ranks
from test_node_training import Node

from luwu_rt.exec.chaos import CHAOS_ENV, Chaos

STEPS = 3
CODECS = ("bf16", "onebit")


def test_compressed_pushes_equal_ddp_with_the_same_codec():
    nodes = {(codec, chaos): Node(chaos=Chaos(seed=11, rank=1 << 16) if chaos else None)
             for codec in ("none", *CODECS) for chaos in ("", "29") if codec != "none" or not chaos}
    runs = [(f"ddp {codec}", {"strategy": "ddp", "compress": codec, "steps": STEPS}, "")
            for codec in ("none", *CODECS)]
    runs += [(f"node {codec} {chaos}", {"strategy": "node", "node": node.address, "compress": codec, "steps": STEPS},
              chaos) for (codec, chaos), node in nodes.items()]
    results = run_ranks(node_jobs.train_any, 2, runs, STEPS, env={CHAOS_ENV: ""})
    assert all(node.finish() == 0 for node in nodes.values())
    got = results[0]
    for codec in CODECS:
        want = got[f"ddp {codec}"]
        for chaos in ("", "29"):
            run = got[f"node {codec} {chaos}"]
            assert run["grad_norm"] == want["grad_norm"], (codec, chaos, run, want)
            assert run["loss"] == want["loss"], (codec, chaos, run, want)
            assert results[1][f"node {codec} {chaos}"]["loss"] == run["loss"], "every worker reports the global loss"
            assert run["encode_s"] > 0
        # The codec changed the gradients: not the uncompressed run's (a codec doing nothing would pass above).
        assert want["grad_norm"][0] != got["ddp none"]["grad_norm"][0]
    plain = got["node none "]
    assert plain["grad_norm"] == got["ddp none"]["grad_norm"] and plain["encode_s"] == 0
    assert plain["push_bytes"] / got["node bf16 "]["push_bytes"] == pytest.approx(2, rel=1e-3)
    assert plain["push_bytes"] / got["node onebit "]["push_bytes"] == pytest.approx(25.6, rel=1e-2)
    onebit = got["node onebit "]
    assert plain["wire_bytes"] - plain["push_bytes"] == onebit["wire_bytes"] - onebit["push_bytes"]  # pulls unchanged
