"""Compressed synchronisation in the planner: --compress none plans exactly as before; a compressed unit's
encode, payload exchange and decode are ops on their queues whose workspaces and residual are planned and
validated like any other; bytes on the wire follow [Note: codecs on the wire]; the cost model prices
encode and decode, and --compress auto compresses a unit only where it pays ([Note: selective
compression])."""

from __future__ import annotations

from dataclasses import replace

import pytest

from luwu_rt.plan import (
    Budgets,
    Collective,
    HardwareProfile,
    ModelSpec,
    Placement,
    Strategy,
    UnitSpec,
    estimate,
    plan_step,
    validate,
    validate_ranks,
)
from luwu_rt.plan.analysis import state_bytes, wire_bytes
from luwu_rt.plan.codec import parse_codec
from luwu_rt.plan.compression import choose_codecs, resolve_compression, unit_choices
from luwu_rt.plan.ops import Decode, Encode, ShardId

SIZES = (5000, 3001, 700_000, 2048)
CHUNK = 8192
BUDGETS = Budgets(device_bytes=64 << 20, host_bytes=64 << 20, nvme_bytes=1 << 34)
PLACEMENTS = [Placement(params="device", optimizer="device", grads="device"),
              Placement(params="host", optimizer="host", grads="host"),
              Placement(params="nvme", optimizer="nvme", grads="nvme")]


def _model(micro_batches: int = 1) -> ModelSpec:
    units = tuple(UnitSpec(name=f"u{i}", num_params=n, reads=(0,) if i == 3 else (), flops_per_token=2 * n)
                  for i, n in enumerate(SIZES))
    return ModelSpec(units=units, param_bytes=4, grad_bytes=4, chunk_bytes=CHUNK, tokens_per_step=64 * micro_batches,
                     num_micro_batches=micro_batches)


def _plan(name: str, codec: str, world: int = 4, placement: Placement = PLACEMENTS[1], micro_batches: int = 1):
    model = _model(micro_batches)
    strategy = resolve_compression(model, Strategy(name=name, world_size=world), codec)
    return model, plan_step(model, budgets=BUDGETS, placement=placement, strategy=strategy)


@pytest.mark.parametrize("name", ["local", "ddp", "zero1", "zero2", "zero3", "hsdp", "node"])
def test_compress_none_plans_exactly_as_before(name) -> None:
    model = _model(2)
    world = 1 if name == "local" else 4
    strategy = Strategy(name=name, world_size=world, group_size=2 if name == "hsdp" else 0)
    resolved = resolve_compression(model, strategy, "none")
    assert resolved == strategy and resolved.compress == ()
    placement = Placement(params="host", optimizer="host", grads="host")
    assert plan_step(model, budgets=BUDGETS, placement=placement, strategy=resolved) == \
        plan_step(model, budgets=BUDGETS, placement=placement, strategy=strategy)
    # Auto compression of a strategy that cannot compress leaves it as it was, too.
    if name not in ("ddp", "zero1", "zero2"):
        assert resolve_compression(model, strategy, "auto") == strategy


@pytest.mark.parametrize("codec", ["bf16", "onebit", "topk:0.01", "powersgd:2"])
@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.params)
def test_compressed_plans_validate_with_every_tier(name, codec, placement) -> None:
    _, plan = _plan(name, codec, placement=placement, micro_batches=2)
    validate_ranks([plan] * 4)
    encodes = [op for op in plan.ops if isinstance(op, Encode)]
    decodes = [op for op in plan.ops if isinstance(op, Decode)]
    per_unit = 2 if name == "zero2" else 1  # zero2 reduces each micro-batch
    assert len(encodes) == len(decodes) == per_unit * len(SIZES)
    assert {op.queue for op in encodes} == {"encode"} and {op.queue for op in decodes} == {"decode"}
    # The residual is persistent state at the optimizer's home; payloads are device workspaces.
    assert plan.homes["residual"] == placement.optimizer and plan.home_slots.keys() >= {ShardId(0, "residual", 0)}
    assert plan.homes["grad_code"] == plan.homes["grad_codes"] == "device"
    assert state_bytes(plan)["residual"] >= 4 * sum(SIZES)


@pytest.mark.parametrize("codec", ["bf16", "onebit", "topk:0.01", "powersgd:4"])
@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2"])
def test_bytes_on_the_wire_follow_the_note(name, codec) -> None:
    """(W - 1) P(N) per unit under ddp, (W - 1) P(S) under zero1/zero2 (per micro-batch for zero2), S = ceil(N / W)."""
    world, spec = 4, parse_codec(codec)
    _, plan = _plan(name, codec, world=world)
    sent = {op.unit: op.comm_bytes for op in plan.ops if isinstance(op, Collective) and op.queue == "reduce"
            and op.collective in ("all_gather", "all_to_all")}
    for u, n in enumerate(SIZES):
        piece = n if name == "ddp" else -(-n // world)
        assert sent[u] == (world - 1) * spec.payload_bytes(piece, CHUNK // 4), (u, sent[u])
    _, plain = _plan(name, "none", world=world)
    ratio = wire_bytes(plain) / wire_bytes(plan)
    if name == "ddp" and codec == "bf16":
        assert ratio == pytest.approx(1, rel=1e-5)  # all-gather of casts vs fp32 all-reduce: W / 4, even at W = 4
    else:
        assert ratio > 1  # zero1/2: the parameter all-gathers stay, uncompressed
    if codec == "onebit" and name == "ddp":
        assert ratio > 10  # ddp at W = 4: 2 (W - 1) / W 4N / ((W - 1) P(N)) = about 51.2 / W = 12.8


def test_encode_and_decode_cost_what_the_profile_says() -> None:
    _, plan = _plan("ddp", "onebit", world=2)
    slow = estimate(plan, HardwareProfile(onebit_encode_gbps=0.01, onebit_decode_gbps=0.01))
    fast = estimate(plan, HardwareProfile())
    assert slow.busy_s["encode"] == pytest.approx(4 * sum(SIZES) / 0.01e9)
    assert slow.busy_s["decode"] == pytest.approx(2 * 4 * sum(SIZES) / 0.01e9)  # two payloads per unit
    assert slow.predicted_step_s > fast.predicted_step_s


def test_auto_compresses_where_the_link_is_the_bottleneck() -> None:
    model = _model()
    strategy = Strategy(name="ddp", world_size=2)
    slow_link = HardwareProfile(net_gbps=0.1)
    fast_link = HardwareProfile(net_gbps=1000.0, net_latency_s=0.0)
    assert resolve_compression(model, strategy, "auto", profile=fast_link).compress == ()
    chosen = resolve_compression(model, strategy, "auto", profile=slow_link).compress
    assert chosen[2] == "onebit"  # the big unit
    # Each unit's choice is the fastest of none and the candidates, ties to none.
    for c in choose_codecs(model, strategy, candidates=("bf16", "onebit"), profile=slow_link):
        assert c.sync_s <= c.raw_s
        assert (c.codec == "none") == (c.sync_s == c.raw_s)
    topk = resolve_compression(model, strategy, "auto:topk:0.01", profile=slow_link).compress
    assert set(topk) <= {"none", "topk:0.01"}
    # And the plan made with the choice predicts a shorter step than the uncompressed one.
    auto = plan_step(model, budgets=BUDGETS, placement=PLACEMENTS[0],
                     strategy=resolve_compression(model, strategy, "auto", profile=slow_link))
    plain = plan_step(model, budgets=BUDGETS, placement=PLACEMENTS[0], strategy=strategy)
    assert estimate(auto, slow_link).predicted_step_s < estimate(plain, slow_link).predicted_step_s


def test_unit_choices_report_a_resolved_strategy() -> None:
    model = _model()
    strategy = resolve_compression(model, Strategy(name="zero1", world_size=2), "topk:0.01")
    for c in unit_choices(model, strategy, HardwareProfile()):
        assert c.codec == "topk:0.01" and c.wire_bytes < c.raw_bytes


def test_strategies_that_cannot_compress_say_so() -> None:
    for name in ("zero3", "hsdp"):
        with pytest.raises(ValueError, match="--compress applies to ddp, zero1, zero2"):
            Strategy(name=name, world_size=4, group_size=2 if name == "hsdp" else 0, compress=("onebit",) * 4)
    with pytest.raises(ValueError, match="node pushes compress with bf16, fp16, onebit or topk:RATIO, not powersgd"):
        Strategy(name="node", world_size=4, compress=("powersgd:2",) * 4)
    with pytest.raises(ValueError, match="node_shards=2 applies to strategy node"):
        Strategy(name="ddp", world_size=4, node_shards=2)
    # One rank has nothing to synchronise: a codec asked for is moot there.
    assert resolve_compression(_model(), Strategy(), "onebit") == Strategy()


def test_a_validator_catches_a_decode_that_reads_payloads_still_in_flight() -> None:
    _, plan = _plan("ddp", "onebit", world=2)
    i = next(i for i, op in enumerate(plan.ops) if isinstance(op, Decode))
    wait = max(plan.ops[i].deps)
    assert plan.ops[wait].kind == "Wait"
    broken = replace(plan, ops=plan.ops[:i] + (replace(plan.ops[i], deps=tuple(d for d in plan.ops[i].deps
                                                                              if d != wait)),) + plan.ops[i + 1:])
    with pytest.raises(ValueError, match="grad_codes.* may still be writing it"):
        validate(broken)


def test_luwu_plan_shows_each_units_codec_and_what_it_saves(capsys, tmp_path) -> None:
    import json

    from luwu_rt.cli.main import main

    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps({"net_gbps": 0.1}))
    argv = ["plan", "--model", "gpt-small", "--world-size", "4", "--strategy", "zero2", "--compress", "auto",
            "--profile", str(profile), "--nvme-size", "0", "--device-mem", "8GiB", "--host-mem", "8GiB"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    c = report["compression"]
    assert [u["name"] for u in c["units"]][:2] == ["embed", "block0"]
    assert {u["codec"] for u in c["units"]} <= {"none", "bf16", "onebit"} and c["units"][1]["codec"] == "onebit"
    assert c["wire_bytes_per_step"] < c["uncompressed_wire_bytes_per_step"] and c["saved_s"] > 0
    assert c["uncompressed_step_s"] == pytest.approx(report["predicted_step_s"] + c["saved_s"])
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "gradient compression (--compress auto)" in text and "block0     onebit" in text
    # Without --compress the report has no compression part, as before.
    assert main([a for a in argv if a not in ("--compress", "auto")] + ["--json"]) == 0
    assert "compression" not in json.loads(capsys.readouterr().out)


def test_luwu_plan_answers_for_a_compression_warm_up(capsys, tmp_path) -> None:
    """``--compress-warmup N`` is a flag of ``luwu plan`` too: it shows the uncompressed step the first N steps run,
    and the compressed step as the engine runs it beside a warm-up, without a double-buffered optimizer state."""
    import json

    from luwu_rt.cli.main import main

    argv = ["plan", "--model", "gpt-tiny", "--world-size", "2", "--strategy", "ddp", "--compress", "topk:0.01",
            "--grad-clip", "1.0", "--offload-optimizer", "nvme", "--nvme-dir", str(tmp_path), "--json"]
    assert main(argv) == 0
    cold = json.loads(capsys.readouterr().out)
    assert cold["updates"].startswith("speculative") and "warmup" not in cold["compression"]
    assert main([*argv, "--compress-warmup", "100"]) == 0
    warm = json.loads(capsys.readouterr().out)
    w = warm["compression"]["warmup"]
    assert w["steps"] == 100 and warm["updates"].startswith("after the step's gradient norm")
    assert w["wire_bytes_per_step"] == warm["compression"]["uncompressed_wire_bytes_per_step"]
    assert w["wire_bytes_per_step"] > 40 * warm["compression"]["wire_bytes_per_step"] and w["step_s"] > 0
    assert main(argv[:-1] + ["--compress-warmup", "100"]) == 0
    assert "steps 1..100 (--compress-warmup): uncompressed" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2"])
def test_encode_exchange_and_decode_overlap_the_backward_of_lower_units(name) -> None:
    """A unit's encode, transfer and decode depend on its own backward only: in the simulated step the last
    unit's decode ends while the first unit's backward is still to come."""
    from luwu_rt.plan import Compute, op_times

    _, plan = _plan(name, "onebit", world=2, placement=PLACEMENTS[0])
    times = op_times(plan, HardwareProfile(compute_flops=1e9))
    last = len(SIZES) - 1
    decode = next(i for i, op in enumerate(plan.ops) if isinstance(op, Decode) and op.unit == last)
    b0 = next(i for i, op in enumerate(plan.ops) if isinstance(op, Compute) and op.name == "B0")
    assert times[decode][1] < times[b0][0]


@pytest.mark.parametrize("codec", ["bf16", "onebit", "topk:0.01"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.params)
def test_compressed_node_pushes_encode_one_piece_per_node_shard(codec, placement) -> None:
    """[Note: compressed pushes] in codec.py: under node each unit is encoded (with its residual, on the host
    where Push reads) as one piece per node shard and Push sends those payloads, even from one worker; the
    node decodes, so the worker has no ``grad_codes``."""
    from luwu_rt.plan.sequence import codec_chunk_numel

    model = _model()
    for workers, shards in ((1, 1), (3, 2)):
        strategy = resolve_compression(model, Strategy(name="node", world_size=workers, node_shards=shards), codec)
        plan = plan_step(model, budgets=BUDGETS, placement=placement, strategy=strategy)
        validate(plan)
        spec = parse_codec(codec)
        for u, unit in enumerate(model.units):
            (encode,) = [op for op in plan.ops if isinstance(op, Encode) and op.unit == u]
            per = -(-unit.num_params // shards)
            assert (encode.pieces, encode.piece_numel) == (shards, per)
            assert {a.tier for a in encode.inputs + encode.outputs} == {"host"}
            sizes = [spec.payload_bytes(min(per, unit.num_params - j * per), codec_chunk_numel(model))
                     for j in range(shards)]
            (push,) = [op for op in plan.ops if op.kind == "Push" and op.unit == u]
            assert push.comm_bytes == sum(sizes) < 4 * unit.num_params
            assert {a.shard.state for a in push.inputs} == {"grad_code"}
        assert not any(s.state == "grad_codes" for s in plan.shards)
