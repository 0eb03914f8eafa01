"""Which data-parallel strategy a run uses, and its plan.

One process runs ``local``. With N ranks, ``TrainConfig.strategy`` names one
of ``DATA_PARALLEL`` (plan/spec.py: ``ddp``, ``zero1``, ``zero2``, ``zero3``,
``hsdp``), ``node``, or ``auto``: the planner
plans each candidate (resolving ``auto`` placements too) and the shortest
predicted step that fits wins, as it does for placements. Every rank plans
from the same inputs and picks the same plan (the budgets are agreed first;
``plan_digest`` then proves it).
"""

from __future__ import annotations

import hashlib

from dataclasses import replace

from luwu_rt.plan import Budgets, HardwareProfile, ModelSpec, Placement, SwapPlan, plan_auto
from luwu_rt.plan.codec import COMPRESSING_STRATEGIES, parse_request
from luwu_rt.plan.compression import resolve_compression
from luwu_rt.plan.ops import Collective
from luwu_rt.plan.search import PlanResult, speculate_or_wait
from luwu_rt.plan.spec import DATA_PARALLEL, Strategy

__all__ = ["candidate_strategies", "choose_plan", "double_buffered_or_why", "plan_digest", "warmup_steps"]


def warmup_steps(compress_warmup: int, strategy: Strategy) -> int:
    """Steps that synchronise uncompressed before the codec starts ([Note: compression warm-up] in engine.py):
    ``--compress-warmup`` where ``strategy`` compresses, else none. Such a run has one plan per step kind: no
    double-buffered optimizer state. The engine and ``luwu plan`` both ask this."""
    return compress_warmup if strategy.compresses else 0


def double_buffered_or_why(model: ModelSpec, *, warmup: int, budgets: Budgets, placement: Placement,
                           strategy: Strategy, policy: str = "belady") -> dict[str, tuple[SwapPlan, SwapPlan]] | str:
    """``speculate_or_wait`` for a run with ``warmup`` steps of compression warm-up (``warmup_steps``): such a run
    has one plan per step kind, so one half of the optimizer state (two warm-up halves are not built), and its
    updates wait where they would speculate. The engine and ``luwu plan`` both ask this."""
    if warmup and model.optimizer_waits_for_backward:
        return "a run with a compression warm-up (--compress-warmup) has one half of the optimizer state"
    return speculate_or_wait(model, budgets=budgets, placement=placement, strategy=strategy, policy=policy)


def candidate_strategies(name: str, *, world_size: int, shard_group_size: int = 0,
                         compress: str = "none", node_shards: int = 1) -> list[Strategy]:
    """The strategies a run of ``world_size`` ranks may use under ``TrainConfig.strategy == name``; under
    ``auto`` with a codec named by ``compress``, only those that compress (``auto`` compression keeps all).
    ``node_shards``: strategy node's node shards (``--node``'s addresses)."""
    out = _candidates(name, world_size=world_size, shard_group_size=shard_group_size)
    if name == "node":
        out = [replace(s, node_shards=node_shards) for s in out]
    auto, codecs = parse_request(compress)
    if name == "auto" and not auto and codecs != ("none",):
        out = [s for s in out if s.name in COMPRESSING_STRATEGIES]
    return out


def _candidates(name: str, *, world_size: int, shard_group_size: int) -> list[Strategy]:
    if name == "node":  # never chosen by auto: it needs an optimizer node process
        return [Strategy(name="node", world_size=world_size)]
    if world_size == 1:
        return [Strategy()]  # every data-parallel strategy is ``local`` on one rank
    if name == "local":
        raise ValueError(f"strategy local runs one process, but this run has {world_size} ranks: choose "
                         f"{', '.join(DATA_PARALLEL)} or auto")
    if shard_group_size and world_size % shard_group_size:
        raise ValueError(f"--shard-group-size {shard_group_size} does not divide the {world_size} ranks; "
                         f"choose a divisor of {world_size}")
    if name == "hsdp" and shard_group_size == 1:
        # Groups of one shard nothing and replicate everything: that is ddp, whose one all-reduce per unit beats
        # hsdp's plan of 1-rank collectives plus a cross-group all-reduce (measured 1.28x ddp's step, bench_dist).
        name = "ddp"
    if name != "auto":
        return [Strategy(name=name, world_size=world_size, group_size=shard_group_size if name == "hsdp" else 0)]
    out = [Strategy(name=n, world_size=world_size) for n in DATA_PARALLEL if n != "hsdp"]
    if 1 < shard_group_size < world_size:  # hsdp with G = N is zero3, with G = 1 ddp
        out.append(Strategy(name="hsdp", world_size=world_size, group_size=shard_group_size))
    return out


def choose_plan(model: ModelSpec, *, strategies: list[Strategy], budgets: Budgets, placement: Placement,
                profile: HardwareProfile = HardwareProfile(), compress: str = "none",
                explain: bool = True) -> tuple[Strategy, PlanResult]:
    """The candidate strategy whose fastest fitting placement predicts the shortest step (the first of
    equals), each with the codecs ``compress`` (a ``--compress`` value) resolves to for it. Raises the most
    memory-frugal candidate's ``DoesNotFit`` when none fits (``explain``: as ``plan_auto``)."""
    best: tuple[Strategy, PlanResult] | None = None
    error: ValueError | None = None
    for strategy in strategies:
        strategy = resolve_compression(model, replace(strategy, compress=()), compress, profile=profile)
        try:
            result = plan_auto(model, budgets=budgets, placement=placement, strategy=strategy, profile=profile,
                               explain=explain)
        except ValueError as exc:
            error = exc
            continue
        if best is None or result.cost.predicted_step_s < best[1].cost.predicted_step_s:
            best = (strategy, result)
    if best is None:
        assert error is not None
        raise error
    return best


def plan_digest(result: PlanResult) -> str:
    """A digest of what every rank must agree on: the placement, and each queue's collectives in order
    (their kind, unit and bytes). Ranks compare digests before the first step, so a rank that planned
    differently is an error before any collective could mismatch."""
    plan = result.plan
    h = hashlib.sha256(repr((result.placement, plan.strategy, sorted(plan.comm_groups.items()))).encode())
    for op in plan.ops:
        if isinstance(op, Collective):
            h.update(f"{type(op).__name__}:{op.queue}:{op.unit}:{op.collective}:{op.comm_bytes};".encode())
    return h.hexdigest()[:16]
