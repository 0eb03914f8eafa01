"""Cost model: critical path with per-queue serialisation, IO bytes, bottleneck, profiles; collectives'
latency and bandwidth terms; the optimizer node simulated beside its workers."""

import dataclasses
import json

import pytest

from luwu_rt.models.presets import get_preset
from luwu_rt.plan import (GLOBAL_UNIT, Access, Budgets, Compute, Free, Gather, HardwareProfile, Load, NormReduce,
                          OptimStep, Placement, Pull, Push, Recv, Reduce, Serve, Store, Strategy, SwapPlan, Wait,
                          collective_seconds, estimate, gpt_model_spec, op_seconds, op_times, plan_node, plan_step,
                          validate)

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
    assert cost.predicted_step_s == pytest.approx(sum(op_seconds(op, PROFILE, plan=plan) for op in plan.ops))
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
    # Every rate doubled (this local plan pays no latency); an overlap and a factor, no rates, stay.
    fast = HardwareProfile(**{f.name: 2 * getattr(PROFILE, f.name) for f in dataclasses.fields(PROFILE)
                              if not f.name.endswith(("_overlap", "_factor"))})
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
    # [Note: an update in pieces]: a unit of 4 chunks updates in 4 ops, one chunk of every kind each.
    updates = [op for op in plan.ops if isinstance(op, OptimStep)]
    assert len(updates) == 6 * 4 and plan.count("Compute") == 0
    assert sum(op.num_params for op in updates) == 6 * numel
    cost = estimate(plan, PROFILE)
    state = 6 * 4 * numel
    # grad+master+moments in; params+master+moments out
    assert cost.io_bytes["nvme"] == {"read": 4 * state, "write": 4 * state}
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


@pytest.mark.parametrize("overlap", [0.0, 0.37, 1.0])
def test_a_disk_that_reads_and_writes_at_once_hides_part_of_the_shorter_direction(overlap):
    """[Note: one disk] with ``nvme_overlap``: the disk bound is the sum less that share of the shorter queue's
    busy time; with full overlap no bound beyond the queues themselves."""
    from luwu_rt.plan import ModelSpec, UnitSpec

    model = ModelSpec(units=tuple(UnitSpec(name=f"u{i}", num_params=2**20) for i in range(6)), param_bytes=4,
                      grad_bytes=4, chunk_bytes=2**20, optimizer_only=True)
    plan = plan_step(model, budgets=Budgets(device_bytes=0, host_bytes=2**30),
                     placement=Placement(params="nvme", optimizer="nvme", grads="nvme"))
    profile = HardwareProfile(nvme_read_gbps=0.5, nvme_write_gbps=0.4, host_optim_params_per_s=1e12,
                              nvme_overlap=overlap)
    cost = estimate(plan, profile)
    read_s, write_s = cost.busy_s["nvme_read"], cost.busy_s["nvme_write"]
    bound = read_s + write_s - overlap * min(read_s, write_s)
    if overlap < 1.0:
        assert cost.predicted_step_s == pytest.approx(bound) and cost.bottleneck == "nvme"
    else:  # the queues' own critical path, at least the busier queue
        assert max(read_s, write_s) <= cost.predicted_step_s < read_s + write_s and cost.bottleneck != "nvme"


def test_disk_overlap_from_a_read_and_a_write_alone_and_at_once():
    from luwu_rt.cli.probes import disk_overlap

    assert disk_overlap(1.10, 0.93, 1.69) == pytest.approx(0.34 / 0.93)
    assert disk_overlap(1.0, 1.0, 2.2) == 0.0 and disk_overlap(1.0, 1.0, 0.9) == 1.0  # clamped
    assert disk_overlap(1.0, 0.0, 1.0) == 0.0


# -- collectives: [Note: collective cost] ---------------------------------------------------------------


NET = dict(latency_s=10e-6, gbps=10.0)


def test_reduce_scatter_and_all_gather_take_p_minus_1_steps():
    m, p = 8e6, 8
    for kind in ("reduce_scatter", "all_gather"):
        got = collective_seconds(kind, nbytes=m, ranks=p, **NET)
        assert got == pytest.approx((p - 1) * 10e-6 + m * (p - 1) / p / 10e9)
    assert collective_seconds("all_gather", nbytes=m, ranks=1, **NET) == 0.0  # nobody to talk to


def test_all_reduce_takes_the_faster_of_ring_and_tree_and_they_cross_where_predicted():
    p, alpha, beta = 8, 10e-6, 1 / 10e9
    crossover = p * alpha * (p - 1 - 3) / beta  # ceil(log2 8) = 3: 3.2 MB

    def times(m):
        return {a: collective_seconds("all_reduce", nbytes=m, ranks=p, algorithm=a, **NET)
                for a in ("ring", "tree", "best")}

    small, large, at = times(crossover / 4), times(crossover * 4), times(crossover)
    assert small["tree"] < small["ring"] and small["best"] == small["tree"]
    assert large["ring"] < large["tree"] and large["best"] == large["ring"]
    assert at["ring"] == pytest.approx(at["tree"])
    assert large["ring"] == pytest.approx(2 * (p - 1) * alpha + 2 * crossover * 4 * (p - 1) / p * beta)
    # Two ranks: one step either way, and the ring moves less.
    for m in (8, 1e9):
        two = {a: collective_seconds("all_reduce", nbytes=m, ranks=2, algorithm=a, **NET) for a in ("ring", "tree")}
        assert two["ring"] <= two["tree"]
    with pytest.raises(ValueError, match="ring, tree or best"):
        collective_seconds("all_reduce", nbytes=1, ranks=4, algorithm="butterfly", **NET)


def test_latency_dominates_small_messages():
    """The norm's 8-byte all-reduce costs the latency of its steps, not its bytes; a large buffer the reverse."""
    norm = NormReduce(deps=(), queue="reduce", unit=GLOBAL_UNIT, collective="all_reduce", group="world", group_size=64,
                      comm_bytes=2 * (8 * 63 // 64))
    with_latency = op_seconds(norm, HardwareProfile())
    without = op_seconds(norm, HardwareProfile(net_latency_s=0.0))
    assert with_latency == pytest.approx(2 * 6 * 10e-6, rel=1e-3)  # the tree: 2 log2(64) steps
    assert without < with_latency / 1000
    big = Reduce(deps=(), queue="reduce", unit=0, collective="all_reduce", group="world", group_size=64,
                 comm_bytes=2 * (2**30 * 63 // 64))
    assert op_seconds(big, HardwareProfile(net_latency_s=0.0)) > 0.99 * op_seconds(big, HardwareProfile())


def test_each_group_uses_its_own_link():
    profile = HardwareProfile(net_gbps=1.0, group_gbps=100.0, net_latency_s=0, group_latency_s=0)
    gather = dict(deps=(), queue="gather", unit=0, collective="all_gather", group_size=8, comm_bytes=7 * 2**20)
    world = op_seconds(Gather(group="world", **gather), profile)
    shard = op_seconds(Gather(group="shard", **gather), profile)
    assert world == pytest.approx(7 * 2**20 / 1e9) and shard == pytest.approx(world / 100)


def test_waits_take_no_time_but_end_with_their_transfer():
    plan = plan_step(gpt_model_spec(get_preset("gpt-tiny"), chunk_bytes=64 * 1024),
                     budgets=Budgets(device_bytes=2**30, host_bytes=2**30),
                     placement=Placement(params="device", optimizer="device", grads="device"),
                     strategy=Strategy(name="zero3", world_size=4))
    times = op_times(plan, PROFILE)
    waits = [(i, op) for i, op in enumerate(plan.ops) if isinstance(op, Wait)]
    assert waits and all(op_seconds(op, PROFILE) == 0 for _, op in waits)
    for i, op in waits:
        transfer = op_seconds(plan.ops[op.start], PROFILE, plan=plan)
        assert times[i][1] == times[op.start][1] >= times[op.start][0] + transfer - 1e-15
    assert max(end for _, end in times) == pytest.approx(estimate(plan, PROFILE).predicted_step_s)


def _comm_bound_plan(strategy: Strategy):
    model = gpt_model_spec(get_preset("gpt-small"), batch_size=1, seq_len=128, chunk_bytes=1 << 20)
    plan = plan_step(model, budgets=Budgets(device_bytes=8 << 30, host_bytes=8 << 30), strategy=strategy,
                     placement=Placement(params="device", optimizer="device", grads="device"))
    validate(plan)
    return plan


def test_hsdp_is_cheaper_than_flat_zero3_when_the_group_link_is_faster():
    """Hierarchical: hsdp reduce-scatters and gathers inside the server and all-reduces only its slice across
    servers; flat zero3 runs every collective over the network between servers."""
    world = 16
    hsdp = _comm_bound_plan(Strategy(name="hsdp", world_size=world, group_size=8))
    zero3 = _comm_bound_plan(Strategy(name="zero3", world_size=world))
    fast_group = HardwareProfile(net_gbps=5.0, group_gbps=100.0)
    same_link = HardwareProfile(net_gbps=5.0, group_gbps=5.0, group_latency_s=HardwareProfile().net_latency_s)
    h_fast, h_same, z = (estimate(hsdp, fast_group), estimate(hsdp, same_link), estimate(zero3, fast_group))
    assert h_fast.predicted_step_s < z.predicted_step_s
    assert h_fast.predicted_step_s < h_same.predicted_step_s
    assert estimate(zero3, same_link).predicted_step_s == pytest.approx(z.predicted_step_s)  # zero3 never uses it
    assert h_fast.busy_s["reduce_cross"] > 0 and h_fast.busy_s["gather"] < z.busy_s["gather"] / 5


def test_profile_latencies_may_be_zero_but_not_negative():
    assert HardwareProfile.from_dict({"net_latency_s": 0, "node_gbps": "25"}).node_gbps == 25.0
    with pytest.raises(ValueError, match="net_latency_s must not be negative"):
        HardwareProfile(net_latency_s=-1e-6)
    with pytest.raises(ValueError, match="node_gbps must be positive"):
        HardwareProfile(node_gbps=0)


# -- the optimizer node beside its workers: [Note: worker and node together] -------------------------------

HOST = Placement(params="host", optimizer="host", grads="host")
NVME = Placement(params="host", optimizer="nvme", grads="host")
WORKERS = 4


def _node_pair(node_placement: Placement = HOST, *, num_shards: int = 1, clip: bool = False):
    model = dataclasses.replace(gpt_model_spec(get_preset("gpt-tiny"), chunk_bytes=64 * 1024),
                                optimizer_waits_for_backward=clip)
    worker = plan_step(model, budgets=Budgets(device_bytes=2**30, host_bytes=2**30), placement=HOST,
                       strategy=Strategy(name="node", world_size=WORKERS))
    node = plan_node(model, budgets=Budgets(device_bytes=0, host_bytes=2**30), placement=node_placement,
                     num_workers=WORKERS, num_shards=num_shards)
    validate(worker)
    validate(node)
    return worker, node


def _wait_of(plan: SwapPlan, kind: type) -> dict[int, int]:
    return {plan.ops[op.start].unit: i for i, op in enumerate(plan.ops)
            if isinstance(op, Wait) and isinstance(plan.ops[op.start], kind)}


def _node_times(worker, node, profile):
    """The node's op times of the coupled simulation (the public API gives the worker's)."""
    from luwu_rt.plan.cost import couple

    return couple(worker, node, profile)[1].times


@pytest.mark.parametrize("clip", [False, True])
def test_node_coupling_is_consistent(clip):
    worker, node = _node_pair(clip=clip)
    profile = HardwareProfile()
    alone = op_times(worker, profile)
    coupled = op_times(worker, profile, node=node)
    node_times = _node_times(worker, node, profile)
    # Coupling only adds bounds: no worker op runs earlier than without the node.
    assert all(c[0] >= a[0] - 1e-15 and c[1] >= a[1] - 1e-15 for a, c in zip(alone, coupled))
    push, pull = _wait_of(worker, Push), _wait_of(worker, Pull)
    recv, serve = _wait_of(node, Recv), _wait_of(node, Serve)
    for u in push:
        assert node_times[recv[u]][1] >= coupled[push[u]][1]  # the node has a unit once every worker pushed it
        assert coupled[pull[u]][1] >= node_times[serve[u]][1]  # a worker has it back once the node served it
    cost = estimate(worker, profile, node=node)
    assert cost.predicted_step_s >= max(e for _, e in coupled)
    assert cost.predicted_step_s >= max(cost.node_busy_s.values())
    assert set(cost.node_busy_s) >= {"push", "pull", "optim"} and cost.node_step_s == max(e for _, e in node_times)
    assert cost.node_io_bytes["nvme"] == {"read": 0, "write": 0}
    if clip:  # every update waits for the last push, so the first serve ends after the last push
        assert min(node_times[i][1] for i in serve.values()) >= max(coupled[i][1] for i in push.values())


@pytest.mark.parametrize("host_bytes", [1 << 20, 2 << 20])
def test_node_coupling_settles_with_the_workers_params_on_nvme(host_bytes):
    """With exact clipping the node serves nothing before the last push. A worker whose parameters live on NVMe
    once listed each pull right after its push: the pulled copy held host memory that a later backward's load
    reused once it was written back, so that load waited on the node, which waited on that backward's push
    (at 1 MiB of host; couple() never settled)."""
    model = dataclasses.replace(gpt_model_spec(get_preset("gpt-tiny"), chunk_bytes=64 * 1024),
                                optimizer_waits_for_backward=True)
    worker = plan_step(model, budgets=Budgets(device_bytes=2**30, host_bytes=host_bytes, nvme_bytes=2**30),
                       placement=Placement(params="nvme", optimizer="host", grads="host"),
                       strategy=Strategy(name="node", world_size=WORKERS))
    node = plan_node(model, budgets=Budgets(device_bytes=0, host_bytes=2**30), placement=HOST, num_workers=WORKERS)
    validate(worker)
    cost = estimate(worker, HardwareProfile(), node=node)
    assert 0 < cost.predicted_step_s < float("inf")
    assert cost.io_bytes["nvme"]["write"] > 0  # the pulled parameters went home to NVMe
    kinds = [type(worker.ops[op.start]) for op in worker.ops if isinstance(op, Wait)]
    assert kinds.index(Pull) > len(kinds) - 1 - kinds[::-1].index(Push)  # every pull after the last push


def test_a_slower_node_optimizer_lengthens_the_workers_step():
    worker, node = _node_pair()
    fast = estimate(worker, HardwareProfile(), node=node)
    slow_profile = HardwareProfile(node_optim_params_per_s=1e6)
    slow = estimate(worker, slow_profile, node=node)
    assert slow.predicted_step_s > fast.predicted_step_s + 0.5 * slow.node_busy_s["optim"]
    assert slow.bottleneck == "node:optim" and not fast.bottleneck.endswith("optim")
    # The worker alone does not see the node's optimizer at all.
    assert estimate(worker, slow_profile).predicted_step_s == estimate(worker, HardwareProfile()).predicted_step_s
    # Its last pull completes only after the slow node served the unit.
    assert max(e for _, e in op_times(worker, slow_profile, node=node)) > 0.9 * slow.node_busy_s["optim"]


def test_node_state_on_nvme_lengthens_the_workers_step():
    worker, in_memory = _node_pair(HOST)
    _, on_nvme = _node_pair(NVME)
    profile = HardwareProfile(node_nvme_read_gbps=0.5, node_nvme_write_gbps=0.5)
    host, nvme = estimate(worker, profile, node=in_memory), estimate(worker, profile, node=on_nvme)
    assert nvme.node_io_bytes["nvme"]["read"] > 0 and nvme.node_io_bytes["nvme"]["write"] > 0
    assert nvme.predicted_step_s > host.predicted_step_s
    assert nvme.bottleneck == "node:nvme"
    slower_disk = estimate(worker, HardwareProfile(node_nvme_read_gbps=0.25, node_nvme_write_gbps=0.25), node=on_nvme)
    assert slower_disk.predicted_step_s > nvme.predicted_step_s


def test_node_shards_share_the_traffic():
    worker, one = _node_pair(num_shards=1)
    _, two = _node_pair(num_shards=2)
    profile = HardwareProfile(node_gbps=1.0)  # the node's NIC is the bottleneck
    cost_one, cost_two = estimate(worker, profile, node=one), estimate(worker, profile, node=two)
    assert cost_one.bottleneck.startswith("node:") or cost_one.bottleneck in ("push", "pull")
    assert cost_two.predicted_step_s < 0.75 * cost_one.predicted_step_s


def test_coupling_rejects_mismatched_plans():
    worker, node = _node_pair()
    zero3 = plan_step(gpt_model_spec(get_preset("gpt-tiny")), budgets=Budgets(device_bytes=2**30, host_bytes=2**30),
                      placement=HOST, strategy=Strategy(name="zero3", world_size=WORKERS))
    with pytest.raises(ValueError, match="worker plan of strategy node"):
        estimate(zero3, HardwareProfile(), node=node)
    other = plan_node(gpt_model_spec(get_preset("gpt-small")), budgets=Budgets(device_bytes=0, host_bytes=2**31),
                      placement=HOST, num_workers=WORKERS)
    with pytest.raises(ValueError, match="same model"):
        estimate(worker, HardwareProfile(), node=other)
