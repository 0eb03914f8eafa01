"""How many units keep their forward graph: ``TrainConfig.keep_graphs`` planned against the budgets.

[Note: kept graphs chosen by the budget]
A unit whose forward keeps its autograd graph ([Note: kept graphs in the
engine] in compute.py) is not run again in backward: the step saves that
unit's forward, and pays with the graph's activations, held on the device from
F(k) to B(k) inside the reserve the planner keeps beside its arena ([Note:
activation estimate] in workload.py). ``all``, ``none`` and N are planned as
asked, and a run that does not fit with them is refused. ``auto`` keeps the
most graphs with which the step still plans:

- Which units: the last N before the last unit, the ones ``--keep-graphs N``
  names. Backward runs in reverse, so their graphs are held the shortest
  (unit L-2's from F(L-2) to B(L-2), across the head alone), and the
  embedding, whose forward multiplies nothing (keeping it saves no FLOPs),
  comes last. Blocks of one model are alike, so at the turn from forward to
  backward, where all kept graphs are live at once, any N of them hold the
  same bytes.
- How many: each count is put to the planner as the run plans (its
  strategies, placement, budgets and profile); a fitting plan is the test,
  not an estimate. All of them are tried first, so a run with room to spare
  (the demo) plans once, as with ``all``. Then none: when recomputing every
  unit does not fit either, the run is refused with that plan's reasons and
  the budgets that would plan it. Otherwise the largest count that plans lies
  in between; the reserve grows about linearly with the count, so the first
  try is where the line through the two reserves measured meets the room the
  device's lower bound leaves under the no-graph plan's placement, then its
  neighbour, then bisection (175B on a 40 GiB device: four counts). Should
  a count fit where a smaller one did not (a placement chosen differently),
  the answer is still a count that planned, with the next one not.
- The same on a CPU and a GPU: the device is the GPU's memory or the CPU
  arena, its budget ``--device-mem`` either way. The answer depends on the
  config and the budgets alone, which every rank agrees on before planning, so
  all ranks keep the same graphs and make the same plan.

The rule keeps what fits and does not weigh a graph's forward against what
its reserve takes from the arena (fewer prefetched shards): the cost model
prices every backward as a recompute and a backward, kept graph or not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from luwu_rt.engine.workload import config_model_spec, kept_units
from luwu_rt.models.units import UnitChain
from luwu_rt.plan import DoesNotFit, ModelSpec, lower_bounds
from luwu_rt.plan.search import PlanResult
from luwu_rt.plan.spec import Strategy

if TYPE_CHECKING:
    from luwu_rt.engine.config import TrainConfig

__all__ = ["KeptPlan", "PlanFn", "fewest_kept", "plan_kept"]

PlanFn = Callable[[ModelSpec, bool], tuple[Strategy, PlanResult]]
"""Plans a run's step for a ``ModelSpec`` as the run plans it, ``explain`` as ``plan_auto`` takes it; raises
``DoesNotFit`` when it does not fit."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KeptPlan:
    """A run's kept graphs and the plan made with their reserve."""

    units: frozenset[int]
    """The units whose forward keeps its graph until their backward."""
    model: ModelSpec
    """The run's ``ModelSpec``: its activation reserve is that of ``units``' graphs."""
    strategy: Strategy
    result: PlanResult
    """The plan of ``model``, from the ``PlanFn``."""


def fewest_kept(keep_graphs: int | str, *, num_units: int) -> frozenset[int]:
    """The units that keep their graph in a run of ``keep_graphs`` whose budgets are tight: those it asks for,
    none under ``auto``. A run that does not fit with these is refused."""
    return frozenset() if keep_graphs == "auto" else kept_units(keep_graphs, num_units=num_units)


def plan_kept(chain: UnitChain, config: "TrainConfig", *, plan: PlanFn, world_size: int = 1) -> KeptPlan:
    """The kept graphs of a run of ``config`` on ``world_size`` ranks, and its plan: as ``keep_graphs`` asks,
    or under ``auto`` the most units that still let ``plan`` fit ([Note: kept graphs chosen by the budget]).
    Raises the ``DoesNotFit`` of ``fewest_kept``, explained."""
    num_units = chain.num_units
    models: dict[int, ModelSpec] = {}
    plans: dict[int, tuple[Strategy, PlanResult]] = {}

    def fits(count: int, *, explain: bool = False) -> bool:
        models[count] = config_model_spec(chain, config, world_size=world_size,
                                          keep_graph=kept_units(count, num_units=num_units))
        try:
            plans[count] = plan(models[count], explain)
        except DoesNotFit:
            if explain:
                raise
            return False
        return True

    def done(count: int) -> KeptPlan:
        strategy, result = plans[count]
        return KeptPlan(units=kept_units(count, num_units=num_units), model=models[count], strategy=strategy,
                        result=result)

    low = len(fewest_kept(config.keep_graphs, num_units=num_units))
    high = len(kept_units(config.keep_graphs, num_units=num_units))
    if high > low and fits(high):
        return done(high)
    fits(low, explain=True)
    if high == low:
        return done(low)
    grown = models[high].activation_bytes - models[low].activation_bytes
    guess = low + _more(models[low], *plans[low], grown=grown, more=high - low)
    return done(_largest(fits, low=low, high=high, guess=guess))


def _more(model: ModelSpec, strategy: Strategy, result: PlanResult, *, grown: int, more: int) -> int:
    """How many graphs more fit beside the device's lower bound under ``result``'s placement (the plan's own
    peak says little: prefetching fills the budget), when ``more`` graphs more grow the reserve by ``grown``
    bytes, taken to grow linearly."""
    need = lower_bounds(model, placement=result.placement, strategy=strategy)["device"]
    room = result.plan.budgets.device_bytes - need
    return int(room // max(grown / more, 1.0))


def _largest(fits: Callable[[int], bool], *, low: int, high: int, guess: int) -> int:
    """The largest count between ``low``, which fits, and ``high``, which does not, that fits: ``guess``, then
    its neighbour on the side it points to, then bisection."""
    probe, near = guess, True
    while high - low > 1:
        count = probe if low < probe < high else (low + high) // 2
        if fits(count):
            low, probe = count, count + 1
        else:
            high, probe = count, count - 1
        if not near:
            probe = low  # out of range: bisect
        near = False
    return low
