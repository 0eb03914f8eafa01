"""Pure swap planner: where every shard lives at every moment of a training step.

Frozen inputs (``ModelSpec``, ``Placement``, ``Budgets``, ``HardwareProfile``,
``Strategy``) go in; an immutable ``SwapPlan`` of ops with explicit dependencies
comes out (``plan_step`` for a fixed placement, ``plan_auto`` to pick the
fastest placement that fits); ``validate`` checks a plan's invariants and
``estimate`` predicts its step time and IO (``op_times`` when each op runs).
The optimizer node of strategy ``node`` has a plan of its own (``plan_node``,
``plan_node_auto``), which ``estimate(worker_plan, profile, node=node_plan)``
simulates beside the workers'. Standard library only: no torch,
no native code, so users can unit-test their own schedules against it.

    from luwu_rt.plan import (Budgets, HardwareProfile, Placement, estimate, gpt_model_spec,
                              plan_step, validate)
    from luwu_rt.models.presets import get_preset

    model = gpt_model_spec(get_preset("gpt-1.3b"), batch_size=8, seq_len=1024)
    plan = plan_step(model, budgets=Budgets(device_bytes=8 << 30, host_bytes=16 << 30),
                     placement=Placement(params="host", optimizer="nvme", grads="host"))
    validate(plan)
    print(estimate(plan, HardwareProfile()).predicted_step_s)  # seconds
"""

from .cost import StepCost, collective_seconds, estimate, op_seconds, op_times
from .ops import (COMM_QUEUES, GLOBAL_UNIT, QUEUES, WORKSPACE_KINDS, Access, Collective, Compute, Free, Gather,
                  GradNorm, Load, NormReduce, Op, OptimStep, Pull, Push, Recv, Reduce, Serve, ShardId, ShardInfo, Store,
                  SwapPlan, Wait, format_ops)
from .node import node_lower_bounds, plan_node, push_order
from .planner import lower_bounds, plan_step
from .policy import LRU, POLICIES, Belady, Policy, PolicyView, as_policy
from .search import DoesNotFit, PlanResult, Remedy, fitting_budgets, plan_auto, plan_node_auto
from .sizes import flag_size, format_size, parse_size
from .gpt import gpt_model_spec
from .spec import (DATA_PARALLEL, STATE_KINDS, STRATEGIES, TIERS, Budgets, HardwareProfile, ModelSpec, Placement,
                   Strategy, UnitSpec, forward_flops_per_token)
from .validate import PlanError, validate, validate_ranks

__all__ = [
    "COMM_QUEUES", "Collective", "GLOBAL_UNIT", "GradNorm", "NormReduce", "Recv", "Serve", "WORKSPACE_KINDS", "Wait",
    "Access", "Belady", "LRU", "Policy", "PolicyView", "as_policy", "Budgets", "Compute", "DoesNotFit", "Free",
    "Gather", "HardwareProfile", "Load", "ModelSpec", "Op",
    "OptimStep", "POLICIES", "PlanError", "PlanResult", "Placement", "Pull", "Push", "QUEUES", "Reduce", "Remedy",
    "DATA_PARALLEL", "STATE_KINDS", "STRATEGIES", "ShardId", "ShardInfo", "StepCost", "Store", "Strategy",
    "SwapPlan", "TIERS",
    "UnitSpec", "collective_seconds", "estimate", "fitting_budgets", "flag_size", "format_ops", "format_size",
    "forward_flops_per_token", "gpt_model_spec", "lower_bounds", "node_lower_bounds", "op_seconds", "op_times",
    "parse_size", "plan_auto", "plan_node", "plan_node_auto", "plan_step",
    "push_order", "validate", "validate_ranks",
]
