"""Compressed ddp, zero1 and zero2: every rank's plan run together (ranks as threads, in-process groups), bit
for bit the single process that sends the same gradients through the same codec with error feedback
(``dist_sim.compressed_sum``): the optimizer state, the parameters and every rank's residual. Also with
gradient accumulation, every tier, and under chaos (random delays on every queue of every rank)."""

from dataclasses import replace

import pytest
import torch
from dist_sim import SIZES, build_ranks, model_spec, read_full, reference, run_step

from luwu_rt.exec import Executor
from luwu_rt.io import IOEngine
from luwu_rt.plan import Budgets, Placement, Strategy, plan_step, validate_ranks
from luwu_rt.plan.compression import resolve_compression

CODECS = ["bf16", "fp16", "onebit", "topk:0.01", "powersgd:2"]
OPTIM = ("master", "exp_avg", "exp_avg_sq")
HOST = Placement(params="host", optimizer="host", grads="host")


@pytest.fixture
def io():
    with IOEngine(block_bytes=4096, queue_depth=4) as engine:
        yield engine


def _run(tmp_path, io, name, codec, *, world=2, micro_batches=1, placement=HOST, steps=2, warmup=0,
         budgets=Budgets(device_bytes=1 << 20, host_bytes=1 << 20)):
    model = model_spec(micro_batches=micro_batches)
    strategy = resolve_compression(model, Strategy(name=name, world_size=world), codec)
    history = reference(world=world, micro_batches=micro_batches, steps=steps, clip=False, compress=(codec, name),
                        warmup=warmup)
    ranks = build_ranks(strategy, placement, budgets, model, tmp_path, io)
    validate_ranks([r.plan for r in ranks])
    compressed = [r.executor for r in ranks]
    # A warm-up's steps (--compress-warmup): the uncompressed step planned over the same store, same handlers.
    warm = [Executor(plan_step(replace(model, uncompressed=True), budgets=budgets, placement=placement,
                               strategy=strategy), store=r.store, handlers=r.executor.handlers,
                     chaos=r.executor.chaos) for r in ranks] if warmup else compressed
    if warmup:
        validate_ranks([w.plan for w in warm])
    for step in range(1, steps + 1):
        for r, executor in zip(ranks, warm if step <= warmup else compressed):
            r.executor = executor
        run_step(ranks, step, {u: history[step - 1][u]["master"] for u in range(len(SIZES))})
    expect = history[-1]
    for u in range(len(SIZES)):
        for state in OPTIM:
            assert torch.equal(read_full(ranks, strategy, u, state), expect[u][state]), (name, codec, u, state)
        assert torch.equal(read_full(ranks, strategy, u, "param"), expect[u]["master"]), (name, codec, u, "param")
        for r in ranks:
            got = r.store.read_state(u, "residual", torch.empty(SIZES[u]))
            assert torch.equal(got, expect[u][f"residual{r.rank}"]), (name, codec, u, "residual", r.rank)
    return ranks, history


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2"])
def test_compressed_strategies_equal_the_single_process_codec(tmp_path, io, name, codec) -> None:
    ranks, history = _run(tmp_path, io, name, codec)
    plan = ranks[0].plan
    assert plan.count("Encode") == plan.count("Decode") == len(SIZES)
    assert all(op.collective in ("all_gather", "all_to_all", "all_reduce") for op in plan.ops if op.kind == "Reduce")
    if codec not in ("bf16", "fp16"):  # the test's gradients (multiples of 1/32) are exact in a cast
        # The codec changed the update: not the uncompressed result (a codec doing nothing would pass above).
        plain = reference(world=2, micro_batches=1, steps=2, clip=False)
        assert not torch.equal(history[-1][0]["master"], plain[-1][0]["master"])


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2"])
def test_compressed_with_accumulation_on_four_ranks_and_every_tier(tmp_path, io, name) -> None:
    for placement in (Placement(params="device", optimizer="device", grads="device"),
                      Placement(params="nvme", optimizer="nvme", grads="nvme")):
        _run(tmp_path / placement.optimizer, io, name, "onebit", world=4, micro_batches=3, placement=placement,
             budgets=Budgets(device_bytes=1 << 20, host_bytes=600_000, nvme_bytes=1 << 30))


@pytest.mark.parametrize("codec", ["onebit", "topk:0.01"])
@pytest.mark.parametrize("name", ["ddp", "zero2"])
def test_compressed_strategies_stay_bit_exact_under_chaos(tmp_path, io, chaos, name, codec) -> None:
    _run(tmp_path, io, name, codec, world=4, micro_batches=2,
         placement=Placement(params="host", optimizer="nvme", grads="host"),
         budgets=Budgets(device_bytes=1 << 20, host_bytes=1 << 20, nvme_bytes=1 << 30))


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2"])
def test_a_warm_up_synchronises_uncompressed_and_then_encodes_from_zero_residuals(tmp_path, io, chaos, name) -> None:
    """--compress-warmup 2: steps 1 and 2 are the uncompressed strategy's (the residuals stay zero), step 3 and
    on send through the codec, each bit for bit the single process that does the same, also under chaos."""
    ranks, history = _run(tmp_path, io, name, "topk:0.01", world=2, micro_batches=2, steps=4, warmup=2)
    plain = reference(world=2, micro_batches=2, steps=2, clip=False)
    for u in range(len(SIZES)):  # the warm-up's two steps are the uncompressed run's
        assert torch.equal(history[2][u]["master"], plain[2][u]["master"])
    uncompressed = plan_step(replace(model_spec(micro_batches=2), uncompressed=True), placement=HOST,
                             budgets=Budgets(device_bytes=1 << 20, host_bytes=1 << 20), strategy=ranks[0].plan.strategy)
    assert uncompressed.count("Encode") == uncompressed.count("Decode") == 0
    assert dict(uncompressed.shards) == dict(ranks[0].plan.shards)  # the codec's shards laid out: one store


def test_trace_shows_encode_and_decode_spans_on_their_queues(tmp_path, io) -> None:
    """--trace's Chrome trace has each compressed unit's encode and decode, named by codec and unit, on tracks
    of their own beside the reduce queue's exchange."""
    import json

    from luwu_rt.exec import write_rank_traces

    ranks, _ = _run(tmp_path, io, "zero1", "onebit", steps=1)
    write_rank_traces([r.spans for r in ranks], tmp_path / "trace.json")
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    for queue, kind in (("encode", "Encode"), ("decode", "Decode")):
        names = sorted(e["name"] for e in events if e["tid"] == queue and e["pid"] == 0)
        assert names == sorted(f"{kind} onebit u{u}" for u in range(len(SIZES))), names
    assert any(e["tid"] == "reduce" and e["args"]["bytes"] > 0 for e in events)
