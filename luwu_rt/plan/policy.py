"""Eviction and prefetch policies: the planner's two choices, as plug-ins.

[Note: policies]
The planner (planner.py, [Note: how the planner works]) decides everything a
plan must do to be correct: which copies a step needs where, the moves that
bring them there, write-backs, frees and every dependency. It leaves two
choices to a ``Policy``, neither of which can make a plan wrong:

* ``victim``: when a tier's arena has no room, which copy to drop. The planner
  offers only copies that may go (not a home copy, not one the current step
  uses): the clean ones first, whose eviction costs no IO; when there are none,
  or the policy declines them all (``None``), the dirty ones, which it writes
  back first. Declining those too means the step does not fit (``OutOfBudget``).
* ``prefetch_depth``: how early a load toward the device may be issued. By
  default (``None``) a load depends only on its source copy and on the ``Free``
  of the bytes it fills, so an executor issues it as soon as the budget has
  room; a depth ``d`` also holds it until the step ``d + 1`` steps before the
  one that reads it has finished (0: no prefetch at all).

``Belady`` (furthest next use first, optimal for equal sizes) and ``LRU`` (least
recently used, kept for comparison) are the built-ins, by the names ``belady``
and ``lru``. A policy of one's own is a subclass with a ``name`` and the
methods it changes; ``plan_step(..., policy=MyPolicy())`` plans with it, and
``validate`` and ``luwu_rt.testing.simulate`` check the result like any other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, Sequence

from .ops import ShardId

__all__ = ["POLICIES", "LRU", "Belady", "Policy", "PolicyView", "as_policy"]


class PolicyView(Protocol):
    """What a policy sees of the plan being made, at the step where it is asked."""

    @property
    def tier(self) -> str:
        """The tier that needs room (``victim``) or that the load fills (``prefetch_depth``)."""

    @property
    def pos(self) -> int:
        """Position of the step being planned in the step's access sequence (``num_steps`` in all)."""

    @property
    def num_steps(self) -> int:
        """Logical steps in the sequence (forward, backward, collectives, updates)."""

    def next_use(self, shard: ShardId) -> float:
        """Position of the next step after ``pos`` that reads ``shard`` on ``tier`` (a device read counts
        on the host too, whose copy feeds it); ``inf`` when none does."""

    def last_use(self, shard: ShardId) -> int:
        """Position of the last step that used the copy of ``shard`` on ``tier`` (-1: none yet)."""

    def nbytes(self, shard: ShardId) -> int:
        """Bytes of the shard."""


class Policy(ABC):
    """How the planner chooses what to evict and how early to load ([Note: policies])."""

    name: str = ""
    """Recorded in ``SwapPlan.policy``; set it in a subclass."""

    @abstractmethod
    def victim(self, candidates: Sequence[ShardId], view: PolicyView) -> ShardId | None:
        """One of ``candidates`` (shards whose copy on ``view.tier`` may go, never empty) to evict, or
        ``None`` to evict none of them: after the clean copies the planner offers the dirty ones, and after
        those the step does not fit."""

    def prefetch_depth(self, shard: ShardId, view: PolicyView) -> int | None:
        """Steps before its reader that a load of ``shard`` into ``view.tier`` may run (the reader is the
        step at ``view.pos``); ``None``: as early as the budget allows."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class Belady(Policy):
    """Evict the copy whose next use is furthest away; among equals the larger one, which frees more."""

    name = "belady"

    def victim(self, candidates: Sequence[ShardId], view: PolicyView) -> ShardId | None:
        return max(candidates, key=lambda s: (view.next_use(s), view.nbytes(s)))


class LRU(Policy):
    """Evict the least recently used copy (kept to compare against Belady)."""

    name = "lru"

    def victim(self, candidates: Sequence[ShardId], view: PolicyView) -> ShardId | None:
        return min(candidates, key=view.last_use)


_BUILTIN = {"belady": Belady(), "lru": LRU()}
POLICIES = tuple(_BUILTIN)
"""Names of the built-in policies, which ``plan_step(policy=...)`` and ``luwu plan --policy`` take."""


def as_policy(policy: str | Policy) -> Policy:
    """``policy`` itself, or the built-in of that name; ``ValueError`` naming the choices otherwise."""
    if isinstance(policy, Policy):
        if not isinstance(policy.name, str) or not policy.name:
            raise ValueError(f"policy {type(policy).__name__} has no name: set the class attribute `name`")
        return policy
    if isinstance(policy, str) and policy in _BUILTIN:
        return _BUILTIN[policy]
    raise ValueError(f"unknown eviction policy {policy!r}; choose one of {', '.join(POLICIES)}, "
                     f"or pass a luwu_rt.plan.Policy")
