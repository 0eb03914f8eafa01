"""``auto`` placement: the fastest placement that fits, or why nothing does.

Every way of resolving the ``auto`` fields of a ``Placement`` is a candidate.
Candidates whose lower bounds (``planner.lower_bounds``) exceed a budget are
dropped without planning; the rest are planned fastest tiers first, and a
candidate is skipped once a planned one keeps every state on a tier at least as
fast (it could only move more bytes). The survivor with the smallest predicted
step time wins. ``plan_node_auto`` does the same for an optimizer node's
placement, over the node's tiers (host and NVMe) and its step time on its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from .cost import StepCost, estimate
from .node import NODE_TIERS, node_lower_bounds, plan_node
from .ops import SwapPlan
from .planner import effective_placement, lower_bounds, plan_step
from .sizes import format_size
from .spec import TIERS, Budgets, HardwareProfile, ModelSpec, Placement, Strategy

__all__ = ["DoesNotFit", "PlanResult", "plan_auto", "plan_node_auto"]

_FIELDS = ("params", "optimizer", "grads")


class DoesNotFit(ValueError):
    """No placement fits the budgets. ``needs`` maps each remedy to the bytes it takes."""

    def __init__(self, message: str, *, needs: dict[str, int]) -> None:
        super().__init__(message)
        self.needs = needs


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanResult:
    plan: SwapPlan
    cost: StepCost
    placement: Placement
    """The placement planned, ``auto`` fields resolved."""


def _candidates(placement: Placement, strategy: Strategy, tiers: tuple[str, ...] = TIERS) -> list[Placement]:
    options = [tiers if getattr(placement, f) == "auto" else (getattr(placement, f),) for f in _FIELDS]
    out = {effective_placement(Placement(**dict(zip(_FIELDS, combo))), strategy): None
           for combo in itertools.product(*options)}
    return sorted(out, key=_rank)


def _rank(p: Placement) -> tuple[int, ...]:
    ranks = tuple(TIERS.index(getattr(p, f)) for f in _FIELDS)
    return (sum(ranks),) + ranks


def _dominates(a: Placement, b: Placement) -> bool:
    return all(TIERS.index(getattr(a, f)) <= TIERS.index(getattr(b, f)) for f in _FIELDS)


def _fits(bounds: dict[str, int], budgets: Budgets) -> bool:
    return all(budgets.of(t) is None or bounds[t] <= budgets.of(t) for t in TIERS)


def plan_auto(model: ModelSpec, *, budgets: Budgets, placement: Placement = Placement(),
              strategy: Strategy = Strategy(), profile: HardwareProfile = HardwareProfile(),
              policy: str = "belady") -> PlanResult:
    """Plan one step, resolving ``auto`` placements to the fastest that fits.

    Raises ``DoesNotFit`` (a ``ValueError``) stating the memory that would make it fit."""
    errors: list[str] = []
    best = _fastest(_candidates(placement, strategy), budgets=budgets, profile=profile, errors=errors,
                    bounds=lambda c: lower_bounds(model, placement=c, strategy=strategy),
                    plan=lambda c: plan_step(model, budgets=budgets, placement=c, strategy=strategy, policy=policy))
    if best is None:
        raise _does_not_fit(model, budgets=budgets, placement=placement, strategy=strategy, errors=errors)
    return best


def _fastest(candidates: list[Placement], *, budgets: Budgets, profile: HardwareProfile, errors: list[str],
             bounds: Callable[[Placement], dict[str, int]], plan: Callable[[Placement], SwapPlan]) -> PlanResult | None:
    """The candidate with the shortest predicted step, planned fastest tiers first; a candidate whose lower
    bounds exceed a budget is not planned, nor one that a planned candidate dominates. Planning errors
    are appended to ``errors``."""
    best: PlanResult | None = None
    planned: list[Placement] = []
    for cand in candidates:
        if any(_dominates(p, cand) for p in planned) or not _fits(bounds(cand), budgets):
            continue
        try:
            result = plan(cand)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        planned.append(cand)
        cost = estimate(result, profile)
        if best is None or cost.predicted_step_s < best.cost.predicted_step_s:
            best = PlanResult(plan=result, cost=cost, placement=cand)
    return best


def _does_not_fit(model: ModelSpec, *, budgets: Budgets, placement: Placement, strategy: Strategy,
                  errors: list[str]) -> DoesNotFit:
    """The two remedies: enough host memory for the fastest host-only placement, or NVMe for
    every state with the host memory that NVMe streaming needs."""
    candidates = _candidates(placement, strategy)
    bounds = {c: lower_bounds(model, placement=c, strategy=strategy) for c in candidates}
    device_ok = [c for c in candidates if bounds[c]["device"] <= budgets.device_bytes]
    if not device_ok:
        need = min(b["device"] for b in bounds.values())
        return DoesNotFit(f"does not fit: needs at least {format_size(need)} of device memory "
                          f"(budget {format_size(budgets.device_bytes)})", needs={"device_bytes": need})
    in_memory = [c for c in device_ok if "nvme" not in (c.params, c.optimizer, c.grads)]
    # Gradients on NVMe alone save no memory between steps; the remedy is persistent state there.
    on_nvme = [c for c in device_ok if "nvme" in (c.params, c.optimizer)]
    needs: dict[str, int] = {}
    parts = []
    if in_memory:
        needs["host_bytes"] = min(bounds[c]["host"] for c in in_memory)
        parts.append(f"{format_size(needs['host_bytes'])} of host memory")
    if on_nvme:
        best = min(on_nvme, key=lambda c: (bounds[c]["host"], bounds[c]["nvme"]))
        needs["nvme_bytes"], needs["nvme_host_bytes"] = bounds[best]["nvme"], bounds[best]["host"]
        parts.append(f"{format_size(needs['nvme_bytes'])} of NVMe (with {format_size(needs['nvme_host_bytes'])} "
                     f"of host memory)")
    if errors and needs.get("host_bytes", budgets.host_bytes + 1) <= budgets.host_bytes:
        # Every tier's lower bound fits the fastest placements, yet no schedule did: say why the fastest
        # failed (its tier, and that fragmentation or shards kept between uses need the room).
        return DoesNotFit(f"does not fit: {errors[0]}", needs=needs)
    message = "does not fit: needs at least " + " or ".join(parts)
    if errors:
        message += f" [closest attempt: {errors[-1]}]"
    return DoesNotFit(message, needs=needs)


def plan_node_auto(model: ModelSpec, *, budgets: Budgets, num_workers: int, placement: Placement = Placement(),
                   num_shards: int = 1, shard_index: int = 0, profile: HardwareProfile = HardwareProfile(),
                   policy: str = "belady") -> PlanResult:
    """Plan one optimizer node process's step (``node.plan_node``), resolving ``auto`` fields of ``placement``
    to host or NVMe: the candidate with the shortest step of the node on its own wins.

    Raises ``DoesNotFit`` (a ``ValueError``) stating the node memory that would make it fit."""
    bad = [f"{f}={getattr(placement, f)}" for f in _FIELDS if getattr(placement, f) not in NODE_TIERS + ("auto",)]
    if bad:
        raise ValueError(f"node placement {', '.join(bad)}: an optimizer node keeps its states on host or nvme")
    errors: list[str] = []
    candidates = _candidates(placement, Strategy(), NODE_TIERS)
    best = _fastest(candidates, budgets=budgets, profile=profile, errors=errors,
                    bounds=lambda c: node_lower_bounds(model, placement=c, num_shards=num_shards),
                    plan=lambda c: plan_node(model, budgets=budgets, placement=c, num_workers=num_workers,
                                             shard_index=shard_index, num_shards=num_shards, policy=policy))
    if best is not None:
        return best
    bounds = {c: node_lower_bounds(model, placement=c, num_shards=num_shards) for c in candidates}
    needs: dict[str, int] = {}
    parts = []
    in_memory = [c for c in candidates if "nvme" not in (c.params, c.optimizer, c.grads)]
    if in_memory:
        needs["node_host_bytes"] = min(bounds[c]["host"] for c in in_memory)
        parts.append(f"{format_size(needs['node_host_bytes'])} of host memory")
    on_nvme = [c for c in candidates if "nvme" in (c.params, c.optimizer)]
    if on_nvme:
        c = min(on_nvme, key=lambda c: (bounds[c]["host"], bounds[c]["nvme"]))
        needs["node_nvme_bytes"], needs["node_nvme_host_bytes"] = bounds[c]["nvme"], bounds[c]["host"]
        parts.append(f"{format_size(needs['node_nvme_bytes'])} of NVMe (with "
                     f"{format_size(needs['node_nvme_host_bytes'])} of host memory)")
    each = f"each of {num_shards} optimizer node processes" if num_shards > 1 else "the optimizer node"
    message = f"{each} does not fit: needs at least " + " or ".join(parts)
    if errors:
        message += f" [closest attempt: {errors[-1]}]"
    raise DoesNotFit(message, needs=needs)
