"""Cost model: critical path with per-queue serialisation, IO bytes, bottleneck, profiles."""

import dataclasses
import json

import pytest

from luwu_rt.models.presets import get_preset
from luwu_rt.plan import (Access, Budgets, Compute, Free, HardwareProfile, Load, Placement, Store, estimate,
                          gpt_model_spec, op_seconds, plan_step, validate)

from test_validate import DEV_P, N, P, Q, load, plan_of

PROFILE = HardwareProfile(h2d_gbps=1.0, d2h_gbps=2.0, nvme_read_gbps=0.5, nvme_write_gbps=0.25,
                          compute_flops=1e12, host_optim_params_per_s=1e6, device_optim_params_per_s=1e9, net_gbps=1.0)


def test_dependent_ops_add_and_independent_queues_overlap():
    flops = 3e6
    ops = (load(P, 0),  # 4096 B at 1 GB/s
           Compute(deps=(0,), queue="compute", name="F0", unit=0, flops=int(flops), inputs=(DEV_P,)),
           Store(deps=(), queue="d2h", nbytes=N, inputs=(Access(Q, "host", N),), outputs=(Access(Q, "device", 0),)))
    cost = estimate(plan_of(*ops, shards=(P, Q)), PROFILE)
    assert cost.predicted_step_s == pytest.approx(N / 1e9 + flops / 1e12)
    assert cost.busy_s["d2h"] == pytest.approx(N / 2e9)
    assert cost.bottleneck == "h2d"


def test_one_queue_runs_one_op_at_a_time():
    ops = (load(P, 0), load(Q, N, src=("host", N)))
    cost = estimate(plan_of(*ops, shards=(P, Q)), PROFILE)
    assert cost.predicted_step_s == pytest.approx(2 * N / 1e9)


def test_frees_take_no_time():
    assert op_seconds(Free(deps=(), queue="mem", shard=P, tier="device", slot=0), PROFILE) == 0


def tiny_plan(placement: Placement):
    model = gpt_model_spec(get_preset("gpt-tiny"), chunk_bytes=64 * 1024)
    plan = plan_step(model, budgets=Budgets(device_bytes=2**30, host_bytes=2**30), placement=placement)
    validate(plan)
    return plan


def test_all_on_device_is_the_sum_of_compute():
    plan = tiny_plan(Placement(params="device", optimizer="device", grads="device"))
    cost = estimate(plan, PROFILE)
    assert set(cost.busy_s) == {"compute"}
    assert cost.predicted_step_s == pytest.approx(sum(op_seconds(op, PROFILE) for op in plan.ops))
    assert all(v == {"read": 0, "write": 0} for v in cost.io_bytes.values())


def test_offloaded_plan_io_bytes_and_bounds():
    plan = tiny_plan(Placement(params="nvme", optimizer="nvme", grads="host"))
    cost = estimate(plan, PROFILE)
    moves = [op for op in plan.ops if isinstance(op, (Load, Store))]
    assert cost.io_bytes["nvme"]["read"] == sum(op.nbytes for op in moves if op.src == "nvme")
    assert cost.io_bytes["nvme"]["write"] == sum(op.nbytes for op in moves if op.dst == "nvme")
    assert cost.io_bytes["device"]["write"] == sum(op.nbytes for op in moves if op.dst == "device")
    # Optimizer state is read and written back once per step.
    optim_state = sum(i.nbytes for s, i in plan.shards.items() if s.state in ("master", "exp_avg", "exp_avg_sq"))
    assert cost.io_bytes["nvme"]["write"] >= optim_state
    busy = cost.busy_s
    assert max(busy.values()) <= cost.predicted_step_s * (1 + 1e-9) <= sum(busy.values()) * (1 + 1e-9)
    assert cost.bottleneck == max(busy, key=busy.get)


def test_twice_as_fast_hardware_halves_the_step():
    plan = tiny_plan(Placement(params="host", optimizer="nvme", grads="host"))
    fast = HardwareProfile(**{f.name: 2 * getattr(PROFILE, f.name) for f in dataclasses.fields(PROFILE)})
    assert estimate(plan, fast).predicted_step_s == pytest.approx(estimate(plan, PROFILE).predicted_step_s / 2)


def test_profile_from_json(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"nvme_read_gbps": 7.5, "compute_flops": 1e14}))
    profile = HardwareProfile.from_json(path)
    assert profile.nvme_read_gbps == 7.5 and profile.h2d_gbps == HardwareProfile().h2d_gbps
    path.write_text(json.dumps({"nvme_speed": 1}))
    with pytest.raises(ValueError, match="unknown hardware profile key.*nvme_read_gbps"):
        HardwareProfile.from_json(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        HardwareProfile.from_json(path)
    with pytest.raises(ValueError, match="must be positive"):
        HardwareProfile(h2d_gbps=0)


def test_optimizer_only_plan_streams_state_once_and_overlaps_reads_with_writes():
    """The out-of-core optimizer step on its own: every state read once from NVMe, written once."""
    from luwu_rt.plan import ModelSpec, Strategy, UnitSpec, lower_bounds

    numel = 2**20
    model = ModelSpec(units=tuple(UnitSpec(name=f"u{i}", num_params=numel) for i in range(6)), param_bytes=4,
                      grad_bytes=4, chunk_bytes=2**20, optimizer_only=True)
    placement = Placement(params="nvme", optimizer="nvme", grads="nvme")
    host = 2 * lower_bounds(model, placement=placement, strategy=Strategy())["host"]
    plan = plan_step(model, budgets=Budgets(device_bytes=0, host_bytes=host), placement=placement)
    validate(plan)
    assert plan.count("OptimStep") == 6 and plan.count("Compute") == 0
    cost = estimate(plan, PROFILE)
    state = 6 * 4 * numel
    assert cost.io_bytes["nvme"] == {"read": 4 * state, "write": 4 * state}  # grad+master+moments in; params+master+moments out
    read_s, write_s = 4 * state / 0.5e9, 4 * state / 0.25e9
    optim_s = 6 * numel / PROFILE.host_optim_params_per_s
    assert max(read_s, write_s, optim_s) <= cost.predicted_step_s < read_s + write_s + optim_s
    # [Note: one disk]: reads and writes share the device's time however well they overlap.
    assert cost.predicted_step_s >= read_s + write_s - 1e-9


def test_reads_and_writes_share_one_disk():
    from luwu_rt.plan import ModelSpec, UnitSpec

    model = ModelSpec(units=tuple(UnitSpec(name=f"u{i}", num_params=2**20) for i in range(6)), param_bytes=4,
                      grad_bytes=4, chunk_bytes=2**20, optimizer_only=True)
    plan = plan_step(model, budgets=Budgets(device_bytes=0, host_bytes=2**30),
                     placement=Placement(params="nvme", optimizer="nvme", grads="nvme"))
    fast_optimizer = HardwareProfile(nvme_read_gbps=0.5, nvme_write_gbps=0.5, host_optim_params_per_s=1e12)
    cost = estimate(plan, fast_optimizer)
    disk_s = cost.busy_s["nvme_read"] + cost.busy_s["nvme_write"]
    assert cost.predicted_step_s == pytest.approx(disk_s) and cost.bottleneck == "nvme"
