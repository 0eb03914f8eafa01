"""The swap planner: from a step's access sequence to a ``SwapPlan``.

[Note: how the planner works]
It walks the logical steps of ``sequence.build_steps`` once, keeping for every
shard the copies that exist on each tier, their version and the ops that wrote
and read them. Before a step it makes each input resident on the tier the step
needs, moving it one tier at a time from the nearest up-to-date copy; every
copy gets an arena slot, and when a slot does not fit the eviction policy picks
a victim among the evictable copies of that tier: not a home copy, not used by
the current step, and not the only up-to-date copy ([Note: policies] in
policy.py). Under ``belady`` the victim is the copy whose next use is furthest
away (optimal for equal sizes); under ``lru`` the least recently used one (kept
for comparison). Evicting a clean
copy needs no IO: dirty data never waits for eviction because right after a
step writes a shard away from its home, the planner writes it back toward its
home one tier at a time - unless the next access of the shard is another write
on the same tier (a tied embedding's gradient accumulating across backward ops,
grads between backward and their all-reduce), in which case the copy stays put,
dirty. Dirty copies are evicted only when no clean one is left, by writing them
back first.

Prefetch is not a separate mechanism: a load depends only on its source copy
and on the ``Free`` of whatever occupied its slot, so an executor can issue it
as soon as the budget has room, however early that is - unless the policy
bounds its depth (``Policy.prefetch_depth``).

[Note: plan granularity]
A shard is the planning unit, and a plan shard groups whole storage chunks: a
unit's buffer of one state kind is planned as at most ``max_shards_per_state``
shards (``ModelSpec``). With the default 4 a 175B model has about 2,000 shards
and a step about 10,000 ops, which plans in seconds, while the executor still
does IO chunk by chunk inside each shard. Finer planning only matters when a
budget is within a few chunks of the working set.

[Note: step boundaries]
A plan starts and ends with every persistent shard at its home slot and nothing
else resident, so the same plan runs step after step. The cost is that the
first units of the next forward are not prefetched across the boundary.
"""

from __future__ import annotations

import bisect
from typing import Callable, Iterable

from .arena import Arena
from .ops import Access, Collective, Free, Load, Op, ShardId, ShardInfo, Store, SwapPlan, Wait
from .policy import POLICIES, Policy, as_policy
from .sequence import Step, build_layout, build_restore_steps, build_steps, comm_groups, home_of
from .sizes import format_size
from .spec import TIERS, Budgets, ModelSpec, Placement, Strategy
from .steady import steady

__all__ = ["plan_step", "plan_restore", "walk_steps", "lower_bounds", "effective_placement", "OutOfBudget", "POLICIES"]

_QUEUE = {("nvme", "host"): "nvme_read", ("host", "nvme"): "nvme_write", ("host", "device"): "h2d",
          ("device", "host"): "d2h"}
_NEVER = float("inf")


class _Copy:
    """One copy of a shard on one tier, as the walk goes."""

    __slots__ = ("version", "slot", "ready", "readers", "last_use")

    def __init__(self, *, version: int, slot: int | None, ready: int) -> None:
        self.version = version
        self.slot = slot
        self.ready = ready
        """Op that wrote this version here; -1 for a home copy present before the step."""
        self.readers: list[int] = []
        """Ops that read this version here since it was written."""
        self.last_use = -1


class _View:
    """The ``PolicyView`` of a walk at one step, for one tier ([Note: policies] in policy.py)."""

    __slots__ = ("_walk", "tier", "pos")

    def __init__(self, walk: "_Walk", tier: str, pos: int) -> None:
        self._walk, self.tier, self.pos = walk, tier, pos

    @property
    def num_steps(self) -> int:
        return len(self._walk.steps)

    def next_use(self, shard: ShardId) -> float:
        return self._walk._next_use(shard, self.tier, self.pos)

    def last_use(self, shard: ShardId) -> int:
        copy = self._walk.copies[shard].get(self.tier)
        return -1 if copy is None else copy.last_use

    def nbytes(self, shard: ShardId) -> int:
        return self._walk.layout[shard].nbytes


class _Walk:
    def __init__(self, steps: list[Step], layout: dict[ShardId, ShardInfo], placement: Placement,
                 budgets: Budgets, reserve_bytes: int, policy: Policy, initial_kinds: frozenset[str], *,
                 pushes: bool = False) -> None:
        self.steps, self.layout, self.placement, self.budgets, self.policy = steps, layout, placement, budgets, policy
        self.pushes = pushes
        """A ``node`` worker's plan: ``home_of``'s ``pushes``."""
        # Asking a policy that keeps the default costs a call per load: only ask one that bounds prefetch.
        self.bounds_prefetch = type(policy).prefetch_depth is not Policy.prefetch_depth
        self.initial_kinds = initial_kinds
        self.ops: list[Op] = []
        self.step_op: list[int] = []
        self.copies: dict[ShardId, dict[str, _Copy]] = {s: {} for s in layout}
        self.latest: dict[ShardId, int] = dict.fromkeys(layout, 0)
        self.resident: dict[str, dict[ShardId, None]] = {t: {} for t in TIERS}
        self.reserve_bytes = reserve_bytes
        capacity = {"device": budgets.device_bytes - reserve_bytes, "host": budgets.host_bytes}
        self.arenas = {t: Arena(n if budgets.arena_limit(t) is None else min(n, budgets.arena_limit(t)))
                       for t, n in capacity.items()}
        self.used = dict.fromkeys(TIERS, 0)
        self.peak = dict.fromkeys(TIERS, 0)
        self.peak["device"] = reserve_bytes
        self._index_uses()

    # -- set-up ------------------------------------------------------------------------------
    def _index_uses(self) -> None:
        # Positions where each shard must be readable on a tier. The host copy also serves
        # every device read (it is the device's source), so those count as host uses too.
        self.uses: dict[tuple[ShardId, str], list[int]] = {}
        self.accesses: dict[ShardId, list[tuple[int, str, str]]] = {s: [] for s in self.layout}
        for pos, step in enumerate(self.steps):
            for need in step.needs:
                self.accesses[need.shard].append((pos, need.tier, need.mode))
                if "r" in need.mode:
                    for tier in TIERS[TIERS.index(need.tier):2]:
                        self.uses.setdefault((need.shard, tier), []).append(pos)

    def place_homes(self) -> dict[ShardId, int | None]:
        """Allocate every persistent shard's home copy before any step, so the homes pack at
        the bottom of their arenas and never fragment them."""
        slots: dict[ShardId, int | None] = {}
        for shard in self.layout:
            if shard.state in self.initial_kinds:
                tier = self._home(shard)
                slot, _ = self._alloc(shard, tier, -1, frozenset())
                self._add_copy(shard, tier, _Copy(version=0, slot=slot, ready=-1))
                slots[shard] = slot
        return slots

    # -- bookkeeping --------------------------------------------------------------------------
    def _emit(self, op: Op) -> int:
        assert all(0 <= d < len(self.ops) for d in op.deps), op
        self.ops.append(op)
        return len(self.ops) - 1

    def _add_copy(self, shard: ShardId, tier: str, copy: _Copy) -> None:
        self.copies[shard][tier] = copy
        self.resident[tier][shard] = None

    def _home(self, shard: ShardId) -> str:
        return home_of(shard.state, self.placement, pushes=self.pushes)

    def _is_clean(self, shard: ShardId, tier: str) -> bool:
        """Dropping this copy loses nothing: it is stale, or another tier holds the latest version."""
        latest, copies = self.latest[shard], self.copies[shard]
        return copies[tier].version < latest or any(t != tier and c.version == latest for t, c in copies.items())

    def _evictable(self, shard: ShardId, tier: str, pinned: frozenset, *, dirty: bool) -> bool:
        if (shard, tier) in pinned or tier == self._home(shard):
            return False
        if self._is_clean(shard, tier):
            return not dirty
        # A dirty copy may be evicted by writing it back first, but only toward a slower home:
        # write-back then allocates on slower tiers only, so evictions cannot chase each other.
        return dirty and TIERS.index(self._home(shard)) > TIERS.index(tier)

    def _next_use(self, shard: ShardId, tier: str, pos: int) -> float:
        uses = self.uses.get((shard, tier), ())
        i = bisect.bisect_right(uses, pos)
        return uses[i] if i < len(uses) else _NEVER

    def _victim(self, tier: str, pos: int, pinned: frozenset) -> ShardId | None:
        """Clean copies first (evicting them costs no IO), dirty ones when there are none or the policy
        declines every clean one ([Note: policies] in policy.py)."""
        view = _View(self, tier, pos)
        for dirty in (False, True):
            candidates = [s for s in self.resident[tier] if self._evictable(s, tier, pinned, dirty=dirty)]
            victim = self.policy.victim(candidates, view) if candidates else None
            if victim is not None:
                if victim not in candidates:
                    raise ValueError(f"policy {self.policy.name!r} chose {victim} to evict from {tier}, which is "
                                     f"not one of the candidates it was offered")
                return victim
        return None

    # -- memory --------------------------------------------------------------------------------
    def _alloc(self, shard: ShardId, tier: str, pos: int, pinned: frozenset) -> tuple[int | None, tuple[int, ...]]:
        nbytes = self.layout[shard].nbytes
        cap = self.budgets.of(tier)
        if tier == "nvme":
            if cap is not None and self.used[tier] + nbytes > cap:
                raise OutOfBudget(tier)
            self._account(tier, nbytes)
            return None, ()
        arena = self.arenas[tier]
        while (got := arena.alloc(nbytes)) is None:
            victim = self._victim(tier, pos, pinned)
            if victim is None:
                raise OutOfBudget(tier)
            if not self._is_clean(victim, tier):
                self.write_back(victim, tier, pos, pinned)  # still protecting what the caller pinned
            self.free_copy(victim, tier)
        self._account(tier, nbytes)
        return got

    def _account(self, tier: str, nbytes: int) -> None:
        self.used[tier] += nbytes
        extra = self.reserve_bytes if tier == "device" else 0
        self.peak[tier] = max(self.peak[tier], self.used[tier] + extra)

    def free_copy(self, shard: ShardId, tier: str) -> None:
        copy = self.copies[shard].pop(tier)
        del self.resident[tier][shard]
        deps = tuple(sorted(set(copy.readers) | ({copy.ready} if copy.ready >= 0 else set())))
        idx = self._emit(Free(deps=deps, queue="mem", shard=shard, tier=tier, slot=copy.slot))
        nbytes = self.layout[shard].nbytes
        self.used[tier] -= nbytes
        if tier != "nvme":
            self.arenas[tier].free(copy.slot, nbytes, free_op=idx)

    # -- moves ---------------------------------------------------------------------------------
    def _target(self, shard: ShardId, tier: str, pos: int, pinned: frozenset) -> tuple[_Copy, set[int]]:
        """The copy on ``tier`` that an op is about to overwrite (allocated if missing) and the
        ops the write must wait for: readers of the old version, its writer, the slot's frees."""
        copy = self.copies[shard].get(tier)
        if copy is None:
            slot, frees = self._alloc(shard, tier, pos, pinned | {(shard, tier)})
            copy = _Copy(version=-1, slot=slot, ready=-1)
            self._add_copy(shard, tier, copy)
            return copy, set(frees)
        return copy, set(copy.readers) | ({copy.ready} if copy.ready >= 0 else set())

    def move(self, shard: ShardId, src: str, dst: str, pos: int, pinned: frozenset) -> None:
        source = self.copies[shard][src]
        target, deps = self._target(shard, dst, pos, pinned | {(shard, src)})
        if source.ready >= 0:
            deps.add(source.ready)
        cls = Load if TIERS.index(dst) < TIERS.index(src) else Store
        if cls is Load:
            deps.update(self._prefetch_bound(shard, dst, pos))
        idx = self._emit(cls(deps=tuple(sorted(deps)), queue=_QUEUE[(src, dst)], nbytes=self.layout[shard].nbytes,
                             inputs=(Access(shard, src, source.slot),), outputs=(Access(shard, dst, target.slot),)))
        source.readers.append(idx)
        source.last_use = target.last_use = pos
        target.version, target.ready, target.readers = source.version, idx, []

    def _prefetch_bound(self, shard: ShardId, tier: str, pos: int) -> tuple[int, ...]:
        """The step a load for step ``pos`` must wait for under the policy's prefetch depth, if any."""
        if not self.bounds_prefetch:
            return ()
        depth = self.policy.prefetch_depth(shard, _View(self, tier, pos))
        if depth is None:
            return ()
        if not isinstance(depth, int) or depth < 0:
            raise ValueError(f"policy {self.policy.name!r}: prefetch_depth must be None or a non-negative int, "
                             f"got {depth!r}")
        before = pos - depth - 1
        return (self.step_op[before],) if before >= 0 else ()

    def _path(self, src: str, dst: str) -> list[tuple[str, str]]:
        i, j = TIERS.index(src), TIERS.index(dst)
        step = 1 if j > i else -1
        return [(TIERS[k], TIERS[k + step]) for k in range(i, j, step)]

    def ensure(self, shard: ShardId, tier: str, pos: int, pinned: frozenset) -> _Copy:
        """Make the latest version of ``shard`` resident on ``tier``, from the nearest tier."""
        copies, latest = self.copies[shard], self.latest[shard]
        if tier in copies and copies[tier].version == latest:
            return copies[tier]
        sources = [t for t, c in copies.items() if c.version == latest]
        assert sources, f"no up-to-date copy of {shard}"
        src = min(sources, key=lambda t: abs(TIERS.index(t) - TIERS.index(tier)))
        for a, b in self._path(src, tier):
            self.move(shard, a, b, pos, pinned)
        return copies[tier]

    def write_back(self, shard: ShardId, tier: str, pos: int, pinned: frozenset = frozenset()) -> None:
        pinned = pinned | {(shard, t) for t in TIERS}
        for a, b in self._path(tier, self._home(shard)):
            self.move(shard, a, b, pos, pinned)

    # -- the walk ------------------------------------------------------------------------------
    def run_step(self, pos: int, step: Step) -> None:
        # Copies this step reads may not be evicted to make room for its other shards; a copy it
        # only overwrites is pinned once allocated (until then any old version may go).
        pinned = {(n.shard, n.tier) for n in step.needs if "r" in n.mode}
        deps: set[int] = {self.step_op[a] for a in step.after}
        inputs, outputs, targets, consumes = [], [], [], []
        # Largest shards first: placing big copies while the arena is least fragmented lets a
        # step fit within a few percent of its lower bound. Copies written into an input's bytes come
        # last, once that input is resident ([Note: taking over a copy] in ops.py).
        for need in sorted(step.needs, key=lambda n: (n.into is not None, -self.layout[n.shard].nbytes)):
            if need.into is not None:
                copy, wait, taken = self._take_over(need, pinned)
                deps |= wait
                consumes.append(taken)
                targets.append((need, copy))
                outputs.append(Access(need.shard, need.tier, copy.slot))
                continue
            if "r" in need.mode:
                copy = self.ensure(need.shard, need.tier, pos, frozenset(pinned))
                deps.update([copy.ready] if copy.ready >= 0 else [])
                inputs.append(Access(need.shard, need.tier, copy.slot))
            if "w" in need.mode:
                copy, wait = self._target(need.shard, need.tier, pos, frozenset(pinned))
                pinned.add((need.shard, need.tier))
                deps |= wait
                targets.append((need, copy))
                outputs.append(Access(need.shard, need.tier, copy.slot))
        op = step.op_type(deps=tuple(sorted(deps)), queue=step.queue, inputs=tuple(inputs), outputs=tuple(outputs),
                          consumes=tuple(consumes), **step.fields)
        idx = self._record(op, targets, pos)
        if isinstance(op, Collective):  # [Note: collectives as start and wait] in ops.py
            idx = self._record(Wait(deps=(idx,), queue=op.queue, inputs=op.inputs, outputs=op.outputs, start=idx),
                               targets, pos)
        self.step_op.append(idx)
        written = frozenset(pinned)  # one output's write-back must not evict another output
        for need, _ in targets:
            self._after_write(need.shard, need.tier, pos, written)
        for shard in dict.fromkeys(n.shard for n in step.needs):  # need order: plans are deterministic
            if self._dead(shard, pos):
                for tier in list(self.copies[shard]):
                    self.free_copy(shard, tier)

    def _take_over(self, need, pinned: set) -> tuple[_Copy, set[int], Access]:
        """The copy of ``need.shard`` made in the bytes of ``need.into``'s copy on the same tier, which the step
        reads and consumes ([Note: taking over a copy] in ops.py); the ops the write waits for; the consumed
        access."""
        source, tier = need.into, need.tier
        old = self.copies[source][tier]
        assert tier != self._home(source) and self._is_clean(source, tier), f"cannot consume {source} on {tier}"
        assert self.layout[source].nbytes == self.layout[need.shard].nbytes, (source, need.shard)
        if tier in self.copies[need.shard]:  # a stale copy of the output: its bytes are of no use
            self.free_copy(need.shard, tier)
        del self.copies[source][tier], self.resident[tier][source]
        copy = _Copy(version=-1, slot=old.slot, ready=-1)
        self._add_copy(need.shard, tier, copy)
        pinned.add((need.shard, tier))
        wait = set(old.readers) | ({old.ready} if old.ready >= 0 else set())
        return copy, wait, Access(source, tier, old.slot)

    def _record(self, op: Op, targets: list, pos: int) -> int:
        """Emits ``op``: it reads its inputs and makes each output copy in ``targets`` the latest version."""
        idx = self._emit(op)
        for acc in op.inputs:
            if acc in op.consumes:
                continue  # gone: its bytes are an output's now
            copy = self.copies[acc.shard][acc.tier]
            copy.readers.append(idx)
            copy.last_use = pos
        for need, copy in targets:
            self.latest[need.shard] += 1
            copy.version, copy.ready, copy.readers, copy.last_use = self.latest[need.shard], idx, [], pos
        return idx

    def _dead(self, shard: ShardId, pos: int) -> bool:
        """A transient shard (gradients, workspaces) whose value nothing reads any more: no later access,
        or only one that overwrites it (a workspace gathered again for the next use)."""
        if shard.state in self.initial_kinds:
            return False
        nxt = self._next_access(shard, pos)
        return nxt is None or nxt[2] == "w"

    def _after_write(self, shard: ShardId, tier: str, pos: int, pinned: frozenset) -> None:
        """Drop the now stale cache copies and write the new version back toward its home."""
        for stale in [t for t in self.copies[shard] if t != tier and t != self._home(shard)]:
            self.free_copy(shard, stale)  # stale cache copies only waste budget
        nxt = self._next_access(shard, pos)
        if self._dead(shard, pos):
            return
        if tier != self._home(shard) and not (nxt is not None and nxt[1] == tier and "w" in nxt[2]):
            self.write_back(shard, tier, pos, pinned)

    def _next_access(self, shard: ShardId, pos: int) -> tuple[int, str, str] | None:
        acc = self.accesses[shard]
        i = bisect.bisect_right(acc, (pos, "~", "~"))
        return acc[i] if i < len(acc) else None

    def finish(self) -> None:
        for shard, copies in self.copies.items():
            for tier in [t for t in copies if t != self._home(shard)]:
                self.free_copy(shard, tier)
            assert shard.state not in self.initial_kinds or copies[self._home(shard)].version == self.latest[shard]


class OutOfBudget(ValueError):
    """A tier's budget cannot hold what the steps need at some point; ``tier`` names it."""

    def __init__(self, tier: str, message: str | None = None) -> None:
        super().__init__(message or f"the {tier} budget is too small for this plan")
        self.tier = tier


def lower_bounds(model: ModelSpec, *, placement: Placement, strategy: Strategy) -> dict[str, int]:
    """Bytes each tier needs at the very least under ``placement``: its home copies, plus the
    largest set of non-home shards one step reads or writes there at once (on the host at
    least one staged shard when params or grads live on NVMe), plus the device reserve.
    Every plan that exists peaks at or above these; the planner may need a little more
    (fragmentation, shards kept dirty between two writes)."""
    placement = effective_placement(placement, strategy)
    layout = build_layout(model, strategy)
    steps = build_steps(model, strategy, placement, layout)
    # Persistent kinds hold their home bytes all step long, and so do an optimizer-only step's gradients, given
    # anew before every step ([Note: steady state] in steady.py).
    kept = model.initial_kinds
    pushes = strategy.name == "node"
    home = {t: sum(i.nbytes for s, i in layout.items()
                   if s.state in kept and home_of(s.state, placement, pushes=pushes) == t) for t in TIERS}
    working = dict.fromkeys(TIERS, 0)
    for step in steps:
        for tier in TIERS:
            nbytes = sum(layout[n.shard].nbytes for n in _distinct(step.needs, tier) if n.into is None  # shares bytes
                         and not (n.shard.state in kept and home_of(n.shard.state, placement, pushes=pushes) == tier))
            working[tier] = max(working[tier], nbytes)
    # Params and grads travel between the device and NVMe through a host staging copy.
    staged = [i.nbytes for s, i in layout.items() if placement.home(s.state) == "nvme" and s.state in ("param", "grad")]
    working["host"] = max([working["host"], *staged])
    bounds = {t: home[t] + working[t] for t in TIERS}
    bounds["device"] += model.activation_bytes
    return bounds


def _distinct(needs: Iterable, tier: str) -> list:
    seen, out = set(), []
    for n in needs:
        if n.tier == tier and n.shard not in seen:
            seen.add(n.shard)
            out.append(n)
    return out


def effective_placement(placement: Placement, strategy: Strategy) -> Placement:
    """Workers of the ``node`` strategy hold no optimizer state: its placement is moot."""
    if strategy.name == "node" and placement.optimizer != "host":
        return Placement(params=placement.params, grads=placement.grads, optimizer="host")
    return placement


def plan_step(model: ModelSpec, *, budgets: Budgets, placement: Placement, strategy: Strategy = Strategy(),
              policy: str | Policy = "belady") -> SwapPlan:
    """Plan one training step of one rank under a resolved placement (no ``auto``; see
    ``search.plan_auto``), evicting and prefetching as ``policy`` (a name of ``POLICIES`` or a ``Policy``)
    chooses. Raises ``OutOfBudget`` (a ``ValueError``) naming the tier and the bytes it needs when a
    budget is too small."""
    policy = as_policy(policy)
    if not placement.is_resolved:
        raise ValueError(f"plan_step needs a resolved placement, got {placement}; use plan_auto for 'auto'")
    placement = effective_placement(placement, strategy)
    reserve = model.activation_bytes
    if reserve > budgets.device_bytes:
        raise OutOfBudget("device", f"device budget {format_size(budgets.device_bytes)} is smaller than the "
                         f"{format_size(reserve)} that activations need; "
                         f"raise it or lower the batch size / sequence length")
    layout = build_layout(model, strategy)
    try:
        plan = walk_steps(build_steps(model, strategy, placement, layout), layout, model=model, budgets=budgets,
                          placement=placement, strategy=strategy, policy=policy,
                          comm_groups=comm_groups(model, strategy))
    except OutOfBudget as exc:  # the same exception, now saying what the tier needs
        raise OutOfBudget(exc.tier, _budget_message(exc.tier, model, budgets, placement, strategy)) from None
    # A training step is one period of a pipeline ([Note: steady state] in steady.py); evaluation runs alone.
    return plan if model.forward_only else steady(plan)


def plan_restore(model: ModelSpec, *, budgets: Budgets, placement: Placement, strategy: Strategy = Strategy(),
                 policy: str | Policy = "belady") -> SwapPlan:
    """The plan that puts back the parameters a speculative update overwrote ([Note: speculative updates] in
    sequence.py): the compute copy of every unit from the current half (``model.state_half``) of its master
    weights, over the layout of ``model``'s training plan. Its ``OptimStep`` ops read only the master weights
    and write only the parameters."""
    placement = effective_placement(placement, strategy)
    layout = build_layout(model, strategy)
    steps = build_restore_steps(model, strategy, placement, layout)
    return walk_steps(steps, layout, model=model, budgets=budgets, placement=placement, strategy=strategy,
                      policy=policy, comm_groups=comm_groups(model, strategy))


def walk_steps(steps: list[Step], layout: dict[ShardId, ShardInfo], *, model: ModelSpec, budgets: Budgets,
               placement: Placement, strategy: Strategy, policy: str | Policy, comm_groups: dict[str, str],
               role: str = "worker") -> SwapPlan:
    """The planner's core ([Note: how the planner works]): places ``steps`` (from ``build_steps``, or the
    optimizer node's own sequence) over ``layout``. Raises ``OutOfBudget`` naming the tier that ran out."""
    reserve = model.activation_bytes
    policy = as_policy(policy)
    walk = _Walk(steps, layout, placement, budgets, reserve, policy, model.initial_kinds,
                 pushes=strategy.name == "node")
    home_slots = walk.place_homes()
    for pos, step in enumerate(walk.steps):
        walk.run_step(pos, step)
    walk.finish()
    return SwapPlan(ops=tuple(walk.ops), shards=layout, chunk_bytes=model.chunk_bytes,
                    homes={s: home_of(s, placement, pushes=walk.pushes) for s in _kinds(layout)},
                    comm_groups=comm_groups, role=role,
                    budgets=budgets, arena_bytes={t: a.high_water_bytes for t, a in walk.arenas.items()},
                    device_reserve_bytes=reserve, strategy=strategy, policy=policy.name, home_slots=home_slots,
                    peak_bytes=walk.peak)


def _kinds(layout: dict[ShardId, ShardInfo]) -> list[str]:
    return sorted({s.state for s in layout})


def _budget_message(tier: str, model: ModelSpec, budgets: Budgets, placement: Placement, strategy: Strategy) -> str:
    bounds = lower_bounds(model, placement=placement, strategy=strategy)
    streamed = Placement(params="nvme", optimizer="nvme", grads="nvme")
    return budget_message(tier, need=bounds[tier], have=budgets.of(tier), placement=placement,
                          streamed=lambda: lower_bounds(model, placement=streamed, strategy=strategy))


def budget_message(tier: str, *, need: int, have: int | None, placement: Placement,
                   streamed: Callable[[], dict[str, int]], who: str = "") -> str:
    """Why a plan ran out of ``tier`` (budget ``have``, lower bound ``need``): too small, with the NVMe
    alternative (``streamed()``: the bounds with every state on NVMe) when host memory ran out; or a
    lower bound that fits while the schedule did not (fragmentation, shards kept between uses)."""
    have = have or 0
    where = f"with params on {placement.params}, optimizer state on {placement.optimizer}, grads on {placement.grads}"
    if need > have:
        message = (f"{who}{tier} budget {format_size(have)} is too small {where}: "
                   f"needs at least {format_size(need)} of {tier} {'memory' if tier != 'nvme' else 'space'}")
        if tier == "host" and placement != Placement(params="nvme", optimizer="nvme", grads="nvme"):
            alt = streamed()
            message += (f", or {format_size(alt['nvme'])} of NVMe with {format_size(alt['host'])} of host memory "
                        f"when every state lives on NVMe")
        return message
    return (f"{who}{tier} budget {format_size(have)} is too small {where}: the largest working set "
            f"({format_size(need)}) fits, but shards kept between uses and arena fragmentation need more; "
            f"give {tier} more room or use smaller chunks")
