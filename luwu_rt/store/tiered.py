"""``TieredStore``: the bytes of every shard copy a plan places, and whole-unit access to them.

The plan says where each copy lives (a slot in the device or host arena, or a
region of the NVMe tier); the store owns those bytes. The executor reaches
them per op through ``view``; everything outside a step - materialising a
model, writing and reading checkpoints, exporting - goes through
``read_state`` / ``write_state``, which address a unit's whole flat buffer of
one state kind at its home, wherever that is. Several plans (a training step,
an evaluation pass) run over one store as long as they agree on the layout
(``check_plan``). A double-buffered optimizer state ([Note: speculative
updates] in plan/sequence.py) has two halves, of which ``half`` is current:
``read_state`` and ``write_state`` of ``master`` address that one, so that
checkpoints, exports and tests read the state as it is whichever half holds it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from luwu_rt.io import aligned_empty
from luwu_rt.plan.ops import Access, ShardId, ShardInfo, SwapPlan
from luwu_rt.plan.spec import SECOND_HALF, half_kind
from luwu_rt.store.arena import Arena
from luwu_rt.store.nvme import NvmeTier

__all__ = ["TieredStore", "element_offsets", "nvme_regions"]


def element_offsets(shards: Mapping[ShardId, ShardInfo]) -> dict[ShardId, int]:
    """First element of each shard within its unit's flat buffer of its state kind."""
    out: dict[ShardId, int] = {}
    pos: dict[tuple[int, str], int] = {}
    for sid in sorted(shards, key=lambda s: (s.unit, s.state, s.chunk)):
        key = (sid.unit, sid.state)
        out[sid] = pos.get(key, 0)
        pos[key] = out[sid] + shards[sid].numel
    return out


def nvme_regions(plan: SwapPlan) -> dict[tuple[int, str], int]:
    """Bytes of every (unit, state) buffer that has a copy on NVMe at some point of the plan:
    the regions an ``NvmeTier`` for this plan must hold."""
    on_nvme = {s.state for s in plan.shards if plan.homes.get(s.state) == "nvme"}
    on_nvme |= {a.shard.state for op in plan.ops for a in op.inputs + op.outputs if a.tier == "nvme"}
    regions: dict[tuple[int, str], int] = {}
    for sid, info in plan.shards.items():
        if sid.state in on_nvme:
            regions[(sid.unit, sid.state)] = regions.get((sid.unit, sid.state), 0) + info.nbytes
    return regions


class TieredStore:
    """Device and host arenas plus the NVMe tier, laid out for ``plan``.

    ``arenas`` maps ``"device"``/``"host"`` to an ``Arena`` at least as large as the plan's;
    ``nvme`` holds every region ``nvme_regions(plan)`` names (``None`` when there are none).
    """

    def __init__(self, plan: SwapPlan, *, arenas: Mapping[str, Arena], nvme: NvmeTier | None) -> None:
        self.shards = plan.shards
        self.homes = plan.homes
        self.home_slots = plan.home_slots
        self.arenas = dict(arenas)
        self.nvme = nvme
        self.offsets = element_offsets(plan.shards)
        self.double_buffered = any(s.state in SECOND_HALF.values() for s in plan.shards)
        """Whether the optimizer state has two halves ([Note: speculative updates] in plan/sequence.py)."""
        self.half = 0
        """The half of a double-buffered optimizer state that holds its current version."""
        self.settle: Callable[[], None] | None = None
        """Called before a whole-unit read or write: waits until no run is still writing the tiers (the tail of a
        step in a pipeline, [Note: steady state] in plan/steady.py)."""
        self._io = None
        self._lock = None  # of the NVMe directory, when create() made the tier
        self._scratch: Path | None = None  # the tier's directory, removed by close() (create(scratch=True))
        self.check_plan(plan)

    @classmethod
    def create(cls, plan: SwapPlan, *, device: torch.device, nvme_root: str | Path | None = None,
               io_backend: str = "auto", also: Sequence[SwapPlan] = (), scratch: bool = False,
               queue_depth: int | None = None) -> "TieredStore":
        """Allocates the arenas and, when the plan touches NVMe, a fresh NVMe tier under ``nvme_root``.
        ``also``: other plans that will run over this store (evaluation); the arenas fit every plan.
        ``scratch``: ``close`` removes ``nvme_root`` (before it drops the lock, so that no other run is
        using the directory while it goes). ``queue_depth``: the IO engine's pieces in flight per direction
        (default ``QUEUE_DEPTH``; ranks sharing a disk pass ``rank_queue_depth``).

        The NVMe tier is scratch space: the checkpoint, not these files, survives a crash. It is
        rebuilt from scratch so that a previous run's layout never blocks this one."""
        sizes = {t: max(p.arena_bytes.get(t, 0) for p in (plan, *also)) for t in plan.arena_bytes}
        arenas = {t: Arena(n, tier=t, device=device if t == "device" else None) for t, n in sizes.items()}
        regions = nvme_regions(plan)
        if not regions:
            return cls(plan, arenas=arenas, nvme=None)
        if nvme_root is None:
            raise ValueError("the plan keeps state on NVMe but no NVMe directory was given; pass --nvme-dir")
        from luwu_rt.io import QUEUE_DEPTH, IOEngine

        from luwu_rt.fs import lock_dir

        root = Path(nvme_root)
        # Before the tier is wiped: another run's live state must not go ([Note: directory locks]).
        lock = lock_dir(root.parent, flag="--nvme-dir")
        try:
            io = IOEngine(backend=io_backend, queue_depth=queue_depth or QUEUE_DEPTH)
            if root.exists():
                shutil.rmtree(root)
            nvme = NvmeTier(root, regions=regions, chunk_bytes=plan.chunk_bytes, engine=io)
            store = cls(plan, arenas=arenas, nvme=nvme)
        except BaseException:
            lock.release()
            raise
        store._io, store._lock = io, lock
        store._scratch = root if scratch else None
        return store

    def check_plan(self, plan: SwapPlan) -> None:
        """Raises ``ValueError`` unless ``plan`` runs over this store: the same shards at the same homes
        and home slots, arenas at least as large as it needs, and its NVMe regions present."""
        if dict(plan.shards) != dict(self.shards) or dict(plan.homes) != dict(self.homes) \
                or dict(plan.home_slots) != dict(self.home_slots):
            raise ValueError("the plan lays out its shards differently from the store it runs on; "
                             "plan it with the same model, placement and budgets")
        for tier, nbytes in plan.arena_bytes.items():
            if tier not in self.arenas or self.arenas[tier].nbytes < nbytes:
                raise ValueError(f"the plan needs a {tier} arena of {nbytes} bytes")
        regions = nvme_regions(plan)
        if regions and (self.nvme is None or any(k not in self.nvme.regions for k in regions)):
            raise ValueError("the plan keeps state on NVMe but the store has no NVMe tier for it")

    # -- per op (the executor) ---------------------------------------------------------------

    def view(self, access: Access) -> torch.Tensor:
        """The bytes of one shard copy in an arena, as a flat uint8 tensor."""
        return self.arenas[access.tier].view(access.slot, self.shards[access.shard].nbytes)

    def home_view(self, shard: ShardId) -> torch.Tensor:
        """The home copy of a shard kept in an arena (its state before and after a step)."""
        return self.view(Access(shard, self.homes[shard.state], self.home_slots[shard]))

    # -- whole units (materialisation, checkpoints, export) ------------------------------------

    def swap_halves(self) -> None:
        """After a step that updated a double-buffered optimizer state: the half it wrote is the current one."""
        assert self.double_buffered, "the store has one half of the optimizer state"
        self.half ^= 1

    def _unit_shards(self, unit: int, state: str) -> list[ShardId]:
        state = half_kind(state, self.half) if self.double_buffered else state
        shards = [s for s in self.shards if s.unit == unit and s.state == state]
        if not shards:
            raise KeyError(f"the store has no {state!r} shards for unit {unit}")
        return shards

    def _settled(self) -> None:
        if self.settle is not None:
            self.settle()

    def write_state(self, unit: int, state: str, values: torch.Tensor) -> None:
        """Sets the home copy of a unit's whole flat buffer of ``state`` (a persistent kind, or the
        gradients of an optimizer-only plan; the current half of a double-buffered one). Call ``flush()`` after
        the last."""
        self._settled()
        for sid in self._unit_shards(unit, state):
            info, start = self.shards[sid], self.offsets[sid]
            part = values[start : start + info.numel]
            if self.homes[sid.state] == "nvme":
                staging = aligned_empty(info.nbytes)
                staging.view(values.dtype)[: info.numel].copy_(part)
                self.nvme.wait(self.nvme.submit_write(unit, sid.state, first_chunk=info.first_chunk, buffer=staging))
            else:
                self.home_view(sid).view(values.dtype)[: info.numel].copy_(part)

    def read_state(self, unit: int, state: str, out: torch.Tensor) -> torch.Tensor:
        """Copies the home copy of a unit's flat buffer of ``state`` (the current half of a double-buffered one)
        into ``out``; returns ``out``."""
        self._settled()
        for sid in self._unit_shards(unit, state):
            info, start = self.shards[sid], self.offsets[sid]
            if self.homes[sid.state] == "nvme":
                staging = aligned_empty(info.nbytes)
                self.nvme.wait(self.nvme.submit_read(unit, sid.state, first_chunk=info.first_chunk, buffer=staging))
            else:
                staging = self.home_view(sid)
            out[start : start + info.numel].copy_(staging.view(out.dtype)[: info.numel])
        return out

    def flush(self) -> None:
        """Makes every completed NVMe write durable (a no-op without an NVMe tier)."""
        self._settled()
        if self.nvme is not None:
            self.nvme.flush()

    def discard(self) -> None:
        """What ``close`` removes (the NVMe tier's files, unless kept) and its lock, without closing the IO
        engine: for a process that ends at once after a failure, whose threads may still be inside it. Files
        still open are gone from the directory at once, their space freed when the process ends."""
        if self._scratch is not None:
            # Under the lock, so no other run uses it now. Best effort: this also runs after a failed step,
            # whose error must not be hidden by one about scratch files the next run rebuilds anyway.
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def close(self) -> None:
        """Releases the IO engine this store created (arenas are freed with the object)."""
        if self._io is not None:
            self._io.close()  # closes the tier's files before they are removed
            self._io = None
        self.discard()

