"""The optimizer node's own plan (strategy ``node``): the node side of the workers' pushes and pulls.

Workers of strategy ``node`` keep no optimizer state: after backward makes a
unit's gradients final they push them (Push, queue ``push``) and pull the
unit's updated parameters back (Pull, queue ``pull``) - see sequence.py. The
node's step is planned by the same planner core (``planner.walk_steps``) over a
step list built here, and checked by the same validator.

[Note: the node's step]
Per unit, in the order the workers push them:
  Recv(u)      queue push, group workers: every worker's gradients of the unit's
               slice, summed in fp32 into the node's ``grad`` (N x the slice's
               gradient bytes in)
  GradNorm(u)  the slice's squared norm into ``norm`` (queue optim)
  OptimStep(u) reads the fp32 ``grad``, updates ``master``/``exp_avg``/``exp_avg_sq``
               and writes the compute-dtype ``param`` slice it serves (queue optim)
  Serve(u)     queue pull, group workers: the updated slice to every worker
and once per step NormReduce: the step's squared norm from every unit's, an
all-reduce over group ``nodes`` (queue reduce) when several node processes split
the chunks, else local. Without exact clipping a unit's update and serve follow
its norm at once, and NormReduce (for the report) runs last; with it
(``ModelSpec.optimizer_waits_for_backward``) every Recv and GradNorm comes
first, then NormReduce, then the updates, which read its total. With its
optimizer state double-buffered on NVMe (``ModelSpec.double_buffer`` without
the wait: [Note: speculative updates] in sequence.py) each update follows its
unit's norm at once, into the other half, and only the serves wait for
NormReduce: they read its total, and the runner serves nothing of a step whose
norm needed clipping but runs it again, waiting (node/runner.py).

Units are received, updated and served in the order the workers push them:
backward's final order (``final_points``: the head first, the embedding last),
``push_order``. It is also the order in which a worker's pull queue waits for
them, so both sides of the group issue their transfers in the same sequence
([Note: collectives as start and wait] in ops.py); and since a worker's plan
ends with every pull done ([Note: step boundaries] in planner.py), serving in
the next forward's order instead would not let it start any earlier. Reading
the optimizer state ahead from NVMe is the planner's prefetch: each load waits
only for its slot, so it runs as early as the host budget allows, in this
order - during the workers' forward for the first units.

[Note: node layout]
A node process holds, per unit, the slice of its node shard: node shard ``i`` of
``k`` owns elements ``[i S, (i+1) S)`` with ``S = ceil(numel / k)``. Every shard
allocates ``S`` elements (the last one's tail is padding), so the shards' plans
differ only in the element counts of their updates and transfers. States:
``param`` (the served copy, compute dtype), ``master``, ``exp_avg``,
``exp_avg_sq`` and ``grad`` (fp32: the sum of N pushes), placed over host and
NVMe by the node's own ``Placement`` and ``Budgets``; a node has no device tier.
"""

from __future__ import annotations

import dataclasses

from .ops import GLOBAL_UNIT, GradNorm, NormReduce, OptimStep, Recv, Serve, ShardId, ShardInfo, SwapPlan
from .planner import OutOfBudget, budget_message, walk_steps
from .policy import Policy, as_policy
# Package-internal helpers of the worker's sequence: one way to cut buffers into shards and to
# count ring bytes (DESIGN.md style 11).
from .sequence import (NORM_BYTES, Need, Step, _cut, _ring, element_bytes, final_points, home_of, update_needs,
                       update_pieces)
from .sizes import format_size
from .spec import (OPTIMIZER_KINDS, PERSISTENT_KINDS, SECOND_HALF, TIERS, Budgets, ModelSpec, Placement, Strategy,
                   align_up, ceil_div)

__all__ = ["NODE_TIERS", "node_comm_groups", "node_layout", "node_lower_bounds", "node_steps", "plan_node",
           "push_order"]

NODE_TIERS = ("host", "nvme")
"""Where a node's states may live: it has no device tier."""
_NODE_STATES = ("param", "grad") + OPTIMIZER_KINDS


def push_order(model: ModelSpec) -> tuple[int, ...]:
    """Units in the order the workers push their gradients, and the node receives, updates and serves
    them ([Note: the node's step]): backward's order of final gradients."""
    finals = final_points(tuple(u.reads for u in model.units))
    return tuple(u for k in reversed(range(len(model.units))) for u in finals[k])


def _node_model(model: ModelSpec) -> ModelSpec:
    """The node's view of ``model``: fp32 gradients (the sum of the pushes), no activations, one pass."""
    return dataclasses.replace(model, grad_bytes=4, activation_bytes=0, tokens_per_step=0, num_micro_batches=1)


def node_layout(model: ModelSpec, *, shard_index: int = 0, num_shards: int = 1) -> dict[ShardId, ShardInfo]:
    """Every shard of node process ``shard_index`` of ``num_shards`` ([Note: node layout])."""
    node_model = _node_model(model)
    layout: dict[ShardId, ShardInfo] = {}
    states = _NODE_STATES + (tuple(SECOND_HALF.values()) if model.double_buffer else ())
    for u, unit in enumerate(model.units):
        part = ceil_div(unit.num_params, num_shards)
        mine = max(0, min(part, unit.num_params - shard_index * part))
        for state in states:
            elem = element_bytes(node_model, state)
            _cut(layout, ShardId(u, state, 0), numel=mine, total=align_up(part * elem), elem=elem,
                 chunk=model.chunk_bytes, max_shards=model.max_shards_per_state)
        layout[ShardId(u, "norm", 0)] = ShardInfo(align_up(NORM_BYTES), 1, 0, 1)
    layout[ShardId(GLOBAL_UNIT, "norm", 0)] = ShardInfo(align_up(NORM_BYTES), 1, 0, 1)
    return layout


def node_comm_groups(num_shards: int) -> dict[str, str]:
    """The process group each communication queue of a node owns."""
    groups = {"push": "workers", "pull": "workers"}
    if num_shards > 1:
        groups["reduce"] = "nodes"
    return groups


def node_steps(model: ModelSpec, layout: dict[ShardId, ShardInfo], *, num_workers: int,
               num_shards: int = 1, streamed: bool = False) -> list[Step]:
    """The node's logical ops of one step, in order ([Note: the node's step]); ``streamed``: the optimizer
    state streams from NVMe, and each update runs in pieces ([Note: an update in pieces] in sequence.py)."""
    shards_of: dict[tuple[int, str], list[ShardId]] = {}
    for sid in layout:
        shards_of.setdefault((sid.unit, sid.state), []).append(sid)

    def needs(u: int, state: str, mode: str) -> tuple[Need, ...]:
        return tuple(Need(s, "host", mode) for s in shards_of[(u, state)])

    def numel(u: int) -> int:
        return sum(layout[s].numel for s in shards_of[(u, "master")])

    def transfer(op_type: type, u: int, elem_bytes: int, state_needs: tuple[Need, ...]) -> Step:
        fields = dict(unit=u, collective="recv" if op_type is Recv else "send", group="workers",
                      group_size=num_workers, comm_bytes=num_workers * numel(u) * elem_bytes)
        return Step(op_type, "push" if op_type is Recv else "pull", fields, state_needs)

    clip = model.optimizer_waits_for_backward
    speculate = model.double_buffer and not clip
    order = push_order(model)
    steps: list[Step] = []
    updates: list[Step] = []
    for u in order:
        steps.append(transfer(Recv, u, model.grad_bytes, needs(u, "grad", "w")))
        steps.append(Step(GradNorm, "optim", dict(unit=u, num_params=numel(u), tier="host"),
                          needs(u, "grad", "r") + needs(u, "norm", "w")))
        norm = needs(GLOBAL_UNIT, "norm", "r") if clip else ()
        for piece in update_pieces(model, layout, shards_of, u, ("grad", "param"), streamed=streamed):
            update = update_needs(model, piece, "host", grad="grad", param="param") + norm
            num_params = sum(layout[s].numel for s in piece["master"])
            (updates if clip else steps).append(Step(OptimStep, "optim", dict(unit=u, num_params=num_params,
                                                                              tier="host"), update))
        serve = needs(u, "param", "r") + (needs(GLOBAL_UNIT, "norm", "r") if speculate else ())
        (updates if clip or speculate else steps).append(transfer(Serve, u, model.param_bytes, serve))
    norms = tuple(n for u in order for n in needs(u, "norm", "r")) + needs(GLOBAL_UNIT, "norm", "w")
    across = num_shards > 1
    steps.append(Step(NormReduce, "reduce" if across else "optim",
                      dict(unit=GLOBAL_UNIT, collective="all_reduce" if across else "local",
                           group="nodes" if across else "", group_size=num_shards if across else 1,
                           comm_bytes=_ring(NORM_BYTES, num_shards, "all_reduce") if across else NORM_BYTES),
                      norms))
    return steps + updates


def _check(model: ModelSpec, placement: Placement, *, num_workers: int, shard_index: int, num_shards: int) -> None:
    if model.optimizer_only or model.forward_only:
        raise ValueError("an optimizer node plans a training step: the model must be neither optimizer_only "
                         "nor forward_only")
    if num_workers < 1 or num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(f"node shard {shard_index} of {num_shards} with {num_workers} workers: need at least one "
                         f"worker and one shard, and 0 <= shard_index < num_shards")
    if model.double_buffer and placement.optimizer != "nvme":
        raise ValueError(f"a double-buffered optimizer state lives on NVMe, not on {placement.optimizer}")
    for name in ("params", "optimizer", "grads"):
        if getattr(placement, name) not in NODE_TIERS:
            raise ValueError(f"node placement {name}={getattr(placement, name)!r}: an optimizer node keeps its "
                             f"states on {' or '.join(NODE_TIERS)} (it has no device tier; resolve auto with "
                             f"plan_node_auto)")


def node_lower_bounds(model: ModelSpec, *, placement: Placement, num_shards: int = 1,
                      shard_index: int = 0) -> dict[str, int]:
    """Bytes each tier of node process ``shard_index`` needs at the very least: the home copies of its
    persistent states, the gradients and norms that live at home from their write to their last read (with
    exact clipping every unit's gradient at once), and the largest set of other shards one step touches on
    the host (at least one staged shard when params or grads live on NVMe). The planner may need a little
    more (fragmentation). Process 0 holds the most ([Note: node layout]): its bounds hold for every process."""
    layout = node_layout(model, shard_index=shard_index, num_shards=num_shards)
    steps = node_steps(model, layout, num_workers=1, num_shards=num_shards, streamed=placement.optimizer == "nvme")
    home = {s: home_of(s.state, placement) for s in layout}
    span: dict[ShardId, list[int]] = {}
    for pos, step in enumerate(steps):
        for need in step.needs:
            span.setdefault(need.shard, [pos, pos])[1] = pos
    bounds = dict.fromkeys(TIERS, 0)
    for tier in TIERS:
        fixed = sum(i.nbytes for s, i in layout.items() if s.state in PERSISTENT_KINDS and home[s] == tier)
        at_home = {s for s in span if s.state not in PERSISTENT_KINDS and home[s] == tier}
        peak = 0
        for pos, step in enumerate(steps):
            live = sum(layout[s].nbytes for s in at_home if span[s][0] <= pos <= span[s][1])
            touched = {n.shard for n in step.needs if n.tier == tier and n.shard not in at_home
                       and not (n.shard.state in PERSISTENT_KINDS and home[n.shard] == tier)}
            peak = max(peak, live + sum(layout[s].nbytes for s in touched))
        bounds[tier] = fixed + peak
    staged = [i.nbytes for s, i in layout.items() if s.state in ("param", "grad") and home[s] == "nvme"]
    bounds["host"] = max([bounds["host"], *staged])
    return bounds


def plan_node(model: ModelSpec, *, budgets: Budgets, placement: Placement, num_workers: int, shard_index: int = 0,
              num_shards: int = 1, policy: str | Policy = "belady") -> SwapPlan:
    """Plan one step of optimizer node process ``shard_index`` of ``num_shards`` serving ``num_workers``
    workers ([Note: the node's step]): a ``SwapPlan`` with role ``node``, over the node's own ``budgets``
    (device 0) and ``placement`` (host or nvme for each state). Raises ``ValueError`` naming the tier and
    the bytes it needs when a budget is too small."""
    policy = as_policy(policy)
    _check(model, placement, num_workers=num_workers, shard_index=shard_index, num_shards=num_shards)
    if budgets.device_bytes:
        raise ValueError(f"an optimizer node has no device tier: give it device_bytes=0, not "
                         f"{format_size(budgets.device_bytes)}")
    layout = node_layout(model, shard_index=shard_index, num_shards=num_shards)
    steps = node_steps(model, layout, num_workers=num_workers, num_shards=num_shards,
                       streamed=placement.optimizer == "nvme")
    try:
        return walk_steps(steps, layout, model=_node_model(model), budgets=budgets, placement=placement,
                          strategy=Strategy(name="node", world_size=num_workers), policy=policy,
                          comm_groups=node_comm_groups(num_shards), role="node")
    except OutOfBudget as exc:
        raise ValueError(_budget_message(exc.tier, model, budgets, placement, num_shards)) from None


def _budget_message(tier: str, model: ModelSpec, budgets: Budgets, placement: Placement, num_shards: int) -> str:
    streamed = Placement(params="nvme", optimizer="nvme", grads="nvme")
    need = node_lower_bounds(model, placement=placement, num_shards=num_shards)[tier]
    message = budget_message(tier, need=need, have=budgets.of(tier), placement=placement, who="node ",
                             streamed=lambda: node_lower_bounds(model, placement=streamed, num_shards=num_shards))
    if need > (budgets.of(tier) or 0) and num_shards == 1:
        message += "; or split the state over several node processes (num_shards)"
    return message
