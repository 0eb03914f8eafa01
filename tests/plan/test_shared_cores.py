"""The cost model's calibrated corrections (issue 22): queues that share the host's cores ([Note: shared
cores] in cost.py), and gloo's reduce-scatter and all-gather against the ring model; neither changes a
prediction at its default."""

import dataclasses

import pytest

from luwu_rt.models.presets import get_preset
from luwu_rt.plan import Budgets, HardwareProfile, Placement, Strategy, estimate, gpt_model_spec, plan_step
from luwu_rt.plan.cost import SHARED_CORE_QUEUES, steady_seconds
from luwu_rt.testing import simulate

PROFILE = HardwareProfile(compute_flops=2e9, h2d_gbps=0.5, d2h_gbps=0.5, host_optim_params_per_s=2e6,
                          net_gbps=0.5)


def _plan(strategy: Strategy = Strategy(), grad_clip: bool = False):
    model = dataclasses.replace(gpt_model_spec(get_preset("gpt-tiny"), batch_size=2, seq_len=64, chunk_bytes=1 << 16),
                                optimizer_waits_for_backward=grad_clip)
    return plan_step(model, budgets=Budgets(device_bytes=64 << 20, host_bytes=64 << 20),
                     placement=Placement(params="host", optimizer="host", grads="host"), strategy=strategy)


def test_shared_cores_bound_the_step_between_the_busiest_queue_and_the_sum():
    plan = _plan()
    free = estimate(plan, PROFILE)
    shared = [free.busy_s.get(q, 0.0) for q in SHARED_CORE_QUEUES]
    serial = estimate(plan, dataclasses.replace(PROFILE, cpu_overlap=0.0))
    assert serial.predicted_step_s == pytest.approx(max(free.predicted_step_s, sum(shared)))
    assert serial.predicted_step_s > free.predicted_step_s, "overlapping queues that share cores cost time"
    assert serial.bottleneck == "cores"
    half = estimate(plan, dataclasses.replace(PROFILE, cpu_overlap=0.5)).predicted_step_s
    assert free.predicted_step_s <= half <= serial.predicted_step_s
    # The simulation is the same model of time: it agrees to the bit.
    assert simulate(plan, dataclasses.replace(PROFILE, cpu_overlap=0.0)).step_s == serial.predicted_step_s


def test_full_overlap_is_the_model_as_it_was():
    plan = _plan(grad_clip=True)
    assert HardwareProfile().cpu_overlap == 1.0 and HardwareProfile().shard_collective_factor == 1.0
    cost = estimate(plan, PROFILE)
    assert cost.bottleneck != "cores"
    assert cost.predicted_step_s == max(max(t for t in simulate(plan, PROFILE).ranks[0].timeline.done), 0.0)


def test_gloo_reduce_scatter_and_all_gather_take_the_factor():
    plan = _plan(Strategy(name="zero3", world_size=2))
    slow = dataclasses.replace(PROFILE, shard_collective_factor=2.0)
    busy, busier = estimate(plan, PROFILE).busy_s, estimate(plan, slow).busy_s
    assert busier["gather"] == pytest.approx(2 * busy["gather"])
    assert busier["reduce"] > busy["reduce"]  # the reduce-scatters; the norm's all-reduce is not scaled
    ddp = _plan(Strategy(name="ddp", world_size=2))
    assert estimate(ddp, slow).busy_s["reduce"] == pytest.approx(estimate(ddp, PROFILE).busy_s["reduce"])


def test_a_step_in_steady_state_still_needs_its_shared_cores():
    """The pipeline across steps hides the write-backs of the tail, not the work of the queues sharing the
    cores: a steady step is shorter than a cold one only down to that bound (it once fell to the critical path)."""
    plan = _plan(Strategy(name="zero3", world_size=2))
    assert plan.wrap_deps
    serial = dataclasses.replace(PROFILE, cpu_overlap=0.0)
    steady = estimate(plan, serial, steady=True)
    shared = sum(steady.busy_s.get(q, 0.0) for q in SHARED_CORE_QUEUES)
    assert steady_seconds(plan, serial) < shared, "a case where the bound matters"
    assert steady.predicted_step_s == pytest.approx(shared)
    assert estimate(plan, PROFILE, steady=True).predicted_step_s == steady_seconds(plan, PROFILE)


def test_the_disks_traffic_takes_its_share_of_the_cores():
    """``nvme_core_s_per_gb``: the checksums and the kernel's work of each GB moved to or from the disk count among
    the queues that share the cores; at 0 (the default) the bound is what it was."""
    model = gpt_model_spec(get_preset("gpt-tiny"), batch_size=2, seq_len=64, chunk_bytes=1 << 16)
    plan = plan_step(model, budgets=Budgets(device_bytes=64 << 20, host_bytes=8 << 20),
                     placement=Placement(params="nvme", optimizer="nvme", grads="host"))
    serial = dataclasses.replace(PROFILE, cpu_overlap=0.0)
    before = estimate(plan, serial)
    disk_gb = sum(before.io_bytes["nvme"].values()) / 1e9
    shared = sum(before.busy_s.get(q, 0.0) for q in SHARED_CORE_QUEUES)
    assert disk_gb > 0 and before.predicted_step_s >= shared
    after = estimate(plan, dataclasses.replace(serial, nvme_core_s_per_gb=10.0))
    assert after.predicted_step_s == pytest.approx(shared + 10.0 * disk_gb) and after.bottleneck == "cores"
    assert estimate(plan, dataclasses.replace(serial, nvme_core_s_per_gb=10.0), steady=True).predicted_step_s \
        == pytest.approx(after.predicted_step_s)
    # Queues with cores of their own (cpu_overlap 1, a GPU server's default) have no such bound.
    assert estimate(plan, dataclasses.replace(PROFILE, nvme_core_s_per_gb=10.0)).predicted_step_s \
        == estimate(plan, PROFILE).predicted_step_s
    with pytest.raises(ValueError, match="nvme_core_s_per_gb must not be negative"):
        HardwareProfile(nvme_core_s_per_gb=-1.0)
