"""The swap-schedule testing kit: test an offload policy or a hand-written plan in a unit test, on simulated
tiers in virtual time - no GPU, no NVMe drive, no torch.

A stable, public API (docs/testing-swap-schedules.md walks through it):

* ``simulate(plan, profile, *, chaos_seed=None, faults=None)`` runs any plan - the planner's, or ops built by
  hand - on simulated tiers: each queue a stream, bandwidths, latencies and FLOP/s from a ``HardwareProfile``,
  the plan's own budgets and arena slots, collectives across simulated ranks. It returns a ``SimResult``: the
  step time (``estimate``'s exactly, without chaos or faults: one model of time), work and stalls per queue,
  peak and moved bytes per tier, the critical path, a one-screen ``summary()`` and ``write_trace(path)`` in the
  Chrome trace format of ``luwu train --trace``. Chaos delays must never change which bytes an op reads: a read
  before its write, or an overwrite while another op still reads, raises ``RaceError`` naming both ops.
* Faults (``SlowTier``, ``ShardIOError``, ``StallRank``): what the plan's dependencies make of them - a delay,
  or a failed op and every op that depends on it; never a wrong read.
* Policies (``Policy``, ``Belady``, ``LRU``): the planner's eviction and prefetch choices as plug-ins; a policy
  of one's own plans, validates and simulates like the built-ins.
* Helpers for a test suite: ``plan_for``, ``hand_plan`` (ops built by hand), ``assert_valid``, ``assert_faster``.
"""

from luwu_rt.plan.policy import LRU, Belady, Policy, PolicyView
from luwu_rt.testing.faults import Fault, ShardIOError, SlowTier, StallRank
from luwu_rt.testing.helpers import assert_faster, assert_valid, hand_plan, plan_for
from luwu_rt.testing.replay import RaceError
from luwu_rt.testing.simulate import RankResult, SimResult, simulate

__all__ = ["Belady", "Fault", "LRU", "Policy", "PolicyView", "RaceError", "RankResult", "ShardIOError", "SimResult",
           "SlowTier", "StallRank", "assert_faster", "assert_valid", "hand_plan", "plan_for", "simulate"]
