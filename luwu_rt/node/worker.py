"""The engine's side of strategy ``node``: the plan's ``Push``/``Pull`` handlers and the HELLO.

[Note: the worker under strategy node]
A worker of strategy ``node`` holds only ``param`` and ``grad`` (plan/sequence.py):
its plan pushes each unit's fp32 gradient once backward made it final and pulls
the unit's updated parameters back ([Note: the node's step] in plan/node.py).
The master weights and moments the engine materialises (or loads from a
checkpoint) are not the worker's to keep: ``keep_initial`` takes them, worker 0
sends them to the node after its HELLO, and every worker drops them. The node
is joined on the first step, when the step to resume from is known. The loss
is scaled by 1 / (N x micro-batches) as for every data-parallel strategy, so
the node's sum of the N pushes is the global batch's gradient.

[Note: a node that restarts]
A node killed and restarted on its snapshot directory answers with a new epoch,
and every wait of the old connection raises ``NodeLost``. The workers must all
notice at the same step, or one would replay while another waits in the loss
all-reduce: so the step's loss all-reduce carries a "lost" flag too
(``finish_step``), and a worker whose executor failed contributes its flag to
that same all-reduce before it rejoins. Then each worker reconnects (a new
client, the HELLO of its first connect, no INIT), learns the snapshot's step s
from the WELCOME, pulls every unit's parameters after step s into its store,
and replays steps s+1 ... up to the one it was running. Batches are drawn by
step number and the node sums the pushes in rank order from the snapshot's
exact fp32 state, so the replayed steps compute the same losses bit for bit.
Batches given to ``train_step`` are kept for two of the node's snapshot
intervals (its WELCOME says ``snapshot_every``), so those steps replay too.

Where a gradient codec plugs in: ``_push`` hands the pieces to the client as
they are; a compressor would encode them here and the node decode them in
``Pushes.offer``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch

from .client import NodeClient, NodeError, NodeLost
from .protocol import INIT_STATES
from .shards import slice_of

__all__ = ["NodeWorker", "WORKER_STATES"]

WORKER_STATES = ("param", "grad")
"""What a worker of strategy node keeps in its store."""


class NodeWorker:
    """Connects one engine to its optimizer node; see [Note: the worker under strategy node]."""

    def __init__(self, engine: Any, *, address: str) -> None:
        self.engine = engine
        self.address = address
        self.addresses = [a.strip() for a in address.split(",")]
        """One per node shard, in shard order ([Note: node shards] in shards.py)."""
        if not all(self.addresses):
            raise ValueError(f"--node {address!r}: give the node shards' addresses separated by commas, in shard "
                             f"order, e.g. tcp://127.0.0.1:5555,tcp://127.0.0.1:5556")
        self.clients: list[NodeClient] = []
        self.slices = [[slice_of(u.num_params, j, len(self.addresses)) for j in range(len(self.addresses))]
                       for u in engine.model_spec.units]
        """unit -> shard -> (first element, elements) that shard keeps."""
        self.step = 0
        self._initial: dict[int, dict[str, torch.Tensor]] = {}
        self._manifest: dict[str, Any] | None = None
        """The HELLO of the first connect, sent again on a reconnect: the run is the same one."""
        self.grad_norm = 0.0
        """The global gradient norm of the last step, from the node's STATS."""
        self.replayed = 0
        """Steps run again after the node restarted ([Note: a node that restarts])."""
        self.rejoins = 0
        """Times this worker reconnected to a restarted node."""
        self._batches: dict[int, Any] = {}
        """Step -> the batch ``train_step`` was given, for replays ([Note: a node that restarts])."""
        self._snapshot_every = 0
        """The node's --snapshot-every, from its WELCOME."""
        self.shard_spans: list[list] = []
        """Every node shard's op spans of the run's last step, in shard order: their rows in ``--trace``."""

    def keep_initial(self, unit: int, states: dict[str, torch.Tensor]) -> None:
        """The optimizer states of a unit that the engine wrote: worker 0 keeps them for the node."""
        if self.engine.world.rank == 0:
            self._initial[unit] = {s: v.float().contiguous() for s, v in states.items() if s in INIT_STATES}

    def manifest(self) -> dict[str, Any]:
        """[Note: the manifest] in manifest.py."""
        e, c = self.engine, self.engine.config
        m = e.model_spec
        # Several shards: the addresses tell shard i > 0 where shard 0 takes the norms ([Note: node shards]).
        nodes = {"nodes": self.addresses} if len(self.addresses) > 1 else {}
        return {**nodes, "model": {"units": [{"name": u.name, "num_params": u.num_params, "reads": list(u.reads)} for u in m.units],
                          "param_bytes": m.param_bytes, "chunk_bytes": m.chunk_bytes,
                          "max_shards_per_state": m.max_shards_per_state,
                          "optimizer_waits_for_backward": m.optimizer_waits_for_backward},
                "optim": dataclasses.asdict(c.optim), "steps": c.steps, "dtype": c.dtype, "loss_scale": e.loss_scale,
                "num_workers": e.world.size, "start_step": e.step, "adam_step": e.adam_step}

    @property
    def client(self) -> NodeClient | None:
        """The link to the (first) node shard."""
        return self.clients[0] if self.clients else None

    def _client(self, address: str) -> NodeClient:
        e = self.engine
        return NodeClient(address, rank=e.world.rank, timeout_s=e.config.timeout_s,
                          chunk_bytes=e.model_spec.chunk_bytes, node_key=e.config.node_key)

    def begin(self, step: int) -> None:
        """Before running the plan of ``step``: joins the node shards on the first one (one after another:
        a shard welcomes once every worker joined it)."""
        if not self.clients:
            e = self.engine
            self._manifest = self.manifest()
            count = len(self.addresses)
            for j, address in enumerate(self.addresses):
                self.clients.append(self._client(address))
                initial = ((u, INIT_STATES.index(s), v[slice(*self._range(u, j))])
                           for u, states in sorted(self._initial.items()) for s, v in states.items()
                           if self.slices[u][j][1])
                welcome = self.clients[j].connect(self._manifest, initial)
                self._snapshot_every = int(welcome.get("snapshot_every", 0))
                if welcome.get("shard", [0, 1]) != [j, count]:
                    raise NodeError(f"--node lists {address} as node shard {j} of {count}, but it serves shard "
                                    f"{'/'.join(map(str, welcome.get('shard', [0, 1])))}: list the addresses in "
                                    f"shard order")
                if welcome["step"] != e.step:
                    raise RuntimeError(f"the optimizer node at {address} is at step {welcome['step']}, this worker "
                                       f"at step {e.step}: resume the workers from the node's step")
            self._initial.clear()
        self.step = step
        for c in self.clients:
            c.begin(step)

    def read_state(self, unit: int, state: str, out: torch.Tensor) -> torch.Tensor:
        """``unit``'s fp32 optimizer ``state`` after the last step, from the node shards (a checkpoint's)."""
        raw = out.view(torch.uint8)
        index = INIT_STATES.index(state)
        waits = []
        for j, c in enumerate(self.clients):
            lo, hi = (x * 4 for x in self._range(unit, j))
            if hi > lo:
                waits.append(c.read_state(self.engine.step, unit, index, [(0, raw[lo:hi])]))
        _All(waits).wait()
        return out

    def _range(self, unit: int, shard: int) -> tuple[int, int]:
        start, n = self.slices[unit][shard]
        return start, start + n

    def train_step(self, step_fn: Callable[[Any], dict[str, float]], batch: Any) -> dict[str, float]:
        """``step_fn(batch)`` (the engine's step), rejoining a restarted node and replaying the steps it
        lost ([Note: a node that restarts])."""
        e = self.engine
        target = e.step + 1
        if batch is not None:  # kept while a node restart may need the step again
            self._batches[target] = batch
            keep = 2 * self._snapshot_every  # a restart resumes at most two snapshot intervals back
            for old in [s for s in self._batches if s <= target - keep]:
                del self._batches[old]
        while True:
            try:
                if e.step + 1 >= target:
                    return step_fn(batch)
                step_fn(self._batches.get(e.step + 1))  # a replayed step: its loss was reported the first time
                self.replayed += 1
            except NodeLost as exc:
                if not getattr(exc, "agreed", False):
                    e.world.all_reduce([0.0, 1.0])  # pairs with the others' finish_step: all rejoin
                self._rejoin(target)
                missing = [s for s in range(e.step + 1, target) if batch is not None and s not in self._batches]
                if missing:
                    raise NodeError(f"{exc}; replaying steps {missing} needs their batches, which this worker no "
                                    f"longer has (it keeps 2 x the node's --snapshot-every)") from exc

    def finish_step(self, loss_part: float) -> float:
        """After the plan of a step: the node's STATS (the grad norm) and the loss all-reduce with the
        "lost" flag; raises ``NodeLost`` on every worker if any lost the node."""
        lost, every = None, []
        try:
            every = [c.stats(self.step) for c in self.clients]
        except NodeLost as exc:
            lost = exc
        stats = every[0] if every else None
        loss, flags = self.engine.world.all_reduce([loss_part, float(lost is not None)])
        if flags:
            err = lost or NodeLost(f"worker {self.engine.world.rank}: another worker lost the optimizer node")
            err.agreed = True
            raise err
        self.grad_norm = float(stats["grad_norm"])
        if "spans" in stats:
            from luwu_rt.exec import Span

            self.shard_spans = [[Span(*x) for x in st.get("spans", ())] for st in every]
        if stats["skipped"]:  # the node skipped the update (a non-finite norm): so does the worker's count
            self.engine._skip = True
            self.engine.adam_step -= 1
        return loss

    def _rejoin(self, target: int) -> None:
        """A new connection to the restarted node; the store gets the parameters of the node's step."""
        e = self.engine
        if len(self.clients) > 1:
            raise NodeError(f"worker {e.world.rank}: a node shard restarted; rejoining several node shards is not "
                            f"built yet (only a single node resumes from its snapshot): restart the run")
        self.clients[0].close(bye=False)
        self.clients[0] = self._client(self.address)
        welcome = self.client.connect(self._manifest, None, step=target)
        step = int(welcome["step"])
        if step >= target:
            raise NodeError(f"the optimizer node at {self.address} resumed at step {step}, past this worker's step "
                            f"{target}: its snapshot directory holds another run's snapshot")
        print(f"luwu worker {e.world.rank}: the optimizer node at {self.address} restarted at step {step}; "
              f"replaying steps {step + 1}..{target}", file=sys.stderr, flush=True)
        for unit, spec in enumerate(e.model_spec.units):
            buf = torch.empty(spec.num_params, dtype=e.param_dtype)
            self.client.pull(step, unit, [(0, buf)]).wait()
            e.store.write_state(unit, "param", buf)
        e.store.flush()
        e.step, e.adam_step = step, int(welcome["adam_step"])
        self.rejoins += 1

    def _pieces(self, views, unit: int, state: str, dtype: torch.dtype) -> list[list[tuple[int, torch.Tensor]]]:
        """Per node shard, the bytes of the unit's ``state`` in the store that the shard keeps: ``(byte offset
        in the shard's slice, uint8 view)``, in order."""
        shards, offsets = self.engine.plan.shards, self.engine.store.offsets
        ids = sorted((s for s in views if s.state == state), key=lambda s: s.chunk)
        whole = [(offsets[s] * dtype.itemsize, views[s].view(dtype)[: shards[s].numel].view(torch.uint8)) for s in ids]
        out = []
        for j in range(len(self.clients)):
            lo, hi = (x * dtype.itemsize for x in self._range(unit, j))
            out.append([(max(o, lo) - lo, t[max(o, lo) - o : min(o + t.numel(), hi) - o])
                        for o, t in whole if max(o, lo) < min(o + t.numel(), hi)])
        return out

    def _push(self, op, views):
        return _All([c.push(self.step, op.unit, p) for c, p in
                     zip(self.clients, self._pieces(views, op.unit, "grad", torch.float32)) if p])

    def _pull(self, op, views):
        return _All([c.pull(self.step, op.unit, p) for c, p in
                     zip(self.clients, self._pieces(views, op.unit, "param", self.engine.param_dtype)) if p])

    def handlers(self) -> dict:
        return {"Push": self._push, "Pull": self._pull}

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.clients = []


class _All:
    """The handle of one transfer split over the node shards: waits for every part."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def wait(self) -> None:
        for p in self.parts:
            p.wait()
