"""Compressed pushes to the optimizer node ([Note: compressed pushes] in plan/codec.py): two workers and a node
on loopback train gpt-tiny for 3 steps with bf16 and with onebit, plainly and with every process (the node too)
drawing chaos delays; each run equals ddp on the same two ranks with the same codec, whose ranks sum the same
decoded payloads in the same order, and its workers push fewer bytes. With two node shards a run equals zero1
on two ranks with the same codec instead (the same pieces, norms and sums). A compressed run checkpointed and
resumed against a fresh node, plainly and in the chaos mode, is the uninterrupted run bit for bit: losses, the
node's master weights and moments, and every worker's residuals. The HELLO carries the codec: a worker with
another codec, and one of an older protocol version, are refused by name (tests/node/test_protocol.py)."""

from __future__ import annotations

import numpy as np
import pytest

import node_jobs
from ranks import run_ranks
from test_node_shards import Shards
from test_node_training import Node

from luwu_rt.ckpt.format import CheckpointReader
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


def test_compressed_pushes_to_two_node_shards_equal_zero1_with_the_same_codec():
    """Two workers and two node shards: each worker encodes a unit as two pieces of S = ceil(N / 2) elements,
    piece j for shard j, as a zero1 rank of two encodes piece s for rank s; shard j sums the decoded pieces in
    rank order as zero1's rank j does, and the shards' norm is the sum of their slices' in shard order, as
    zero1's is of its ranks' (default clipping at 1.0 clips these steps: the norm's bits reach the losses). Not
    ddp's bits: ddp encodes each unit whole, and onebit's blocks of 128 then start elsewhere in gpt-tiny's
    blocks (S = 99136 is not a multiple of 128)."""
    shards = {(codec, chaos): Shards(chaos_seed=37 if chaos else None)
              for codec, chaos in (("bf16", ""), ("onebit", ""), ("onebit", "31"))}
    runs = [(f"zero1 {codec}", {"strategy": "zero1", "compress": codec, "steps": STEPS}, "") for codec in CODECS]
    runs += [(f"node {codec} {chaos}", {"strategy": "node", "node": node.address, "compress": codec, "steps": STEPS},
              chaos) for (codec, chaos), node in shards.items()]
    results = run_ranks(node_jobs.train_any, 2, runs, STEPS, env={CHAOS_ENV: ""})
    assert all(s.finish() == [0, 0] for s in shards.values())
    got = results[0]
    for codec, chaos in shards:
        run, want = got[f"node {codec} {chaos}"], got[f"zero1 {codec}"]
        assert run["loss"] == want["loss"], (codec, chaos, run, want)
        assert run["grad_norm"] == want["grad_norm"], (codec, chaos, run, want)
        assert results[1][f"node {codec} {chaos}"]["loss"] == run["loss"], "every worker reports the global loss"
    assert got["zero1 bf16"]["loss"] != got["zero1 onebit"]["loss"]  # the codec changed the run


def test_a_compressed_node_run_resumes_exactly_with_its_residuals(tmp_path):
    """4 steps with a checkpoint after step 2, resumed against a fresh node: bf16 plainly, onebit with the
    resumed run's workers and node in the chaos mode. The residuals are each worker's (none on the node):
    the checkpoint holds them per rank, and a resume that lost them would not end where the uninterrupted run
    does. (Loading them once cost worker 0 the weights it keeps for the fresh node: the node then served
    units it never got and the resumed run hung.)"""
    steps, save_at = 4, 2
    nodes = {codec: [Node(chaos=None), Node(chaos=Chaos(seed=53, rank=1 << 16) if chaos else None)]
             for codec, chaos in (("bf16", ""), ("onebit", "59"))}
    runs = [(codec, [n.address for n in pair], str(tmp_path / codec), "59" if codec == "onebit" else "")
            for codec, pair in nodes.items()]
    results = run_ranks(node_jobs.compressed_resume, 2, runs, steps, save_at, env={CHAOS_ENV: ""})
    assert all(n.finish() == 0 for pair in nodes.values() for n in pair)
    for codec in nodes:
        reader = CheckpointReader(results[0][codec]["path"])
        residuals = sorted(k for k in reader.tensors if ".residual." in k)
        assert {k.rsplit(".", 1)[1] for k in residuals} == {"rank0of2", "rank1of2"}, residuals
        assert all(reader.read(k).abs().sum() > 0 for k in residuals)
        for rank in range(2):
            full, resumed = results[rank][codec]["full"], results[rank][codec]["resumed"]
            assert resumed["loss"] == full["loss"][save_at:], (codec, rank, full["loss"], resumed["loss"])
            for state in ("master", "exp_avg", "exp_avg_sq", "residual"):
                assert np.array_equal(resumed[state], full[state]), (codec, rank, state)
        # Each worker's own: the two ranks' residuals differ.
        assert not np.array_equal(results[0][codec]["full"]["residual"], results[1][codec]["full"]["residual"])
