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

__all__ = ["NodeWorker", "WORKER_STATES"]

WORKER_STATES = ("param", "grad")
"""What a worker of strategy node keeps in its store."""


class NodeWorker:
    """Connects one engine to its optimizer node; see [Note: the worker under strategy node]."""

    def __init__(self, engine: Any, *, address: str) -> None:
        self.engine = engine
        self.address = address
        self.client: NodeClient | None = None
        self.step = 0
        self._initial: dict[int, dict[str, torch.Tensor]] = {}
        self._manifest: dict[str, Any] | None = None
        """The HELLO of the first connect, sent again on a reconnect: the run is the same one."""
        self.grad_norm = 0.0
        """The global gradient norm of the last step, from the node's STATS."""
        self.replayed = 0
        """Steps run again after the node restarted ([Note: a node that restarts])."""
        self.rejoins = 0
        self.node_spans: list = []
        """The node's op spans of the run's last step: its own process row in ``--trace``."""
        """Times this worker reconnected to a restarted node."""

    def keep_initial(self, unit: int, states: dict[str, torch.Tensor]) -> None:
        """The optimizer states of a unit that the engine wrote: worker 0 keeps them for the node."""
        if self.engine.world.rank == 0:
            self._initial[unit] = {s: v.float().contiguous() for s, v in states.items() if s in INIT_STATES}

    def manifest(self) -> dict[str, Any]:
        """[Note: the manifest] in manifest.py."""
        e, c = self.engine, self.engine.config
        m = e.model_spec
        return {"model": {"units": [{"name": u.name, "num_params": u.num_params, "reads": list(u.reads)} for u in m.units],
                          "param_bytes": m.param_bytes, "chunk_bytes": m.chunk_bytes,
                          "max_shards_per_state": m.max_shards_per_state,
                          "optimizer_waits_for_backward": m.optimizer_waits_for_backward},
                "optim": dataclasses.asdict(c.optim), "steps": c.steps, "dtype": c.dtype, "loss_scale": e.loss_scale,
                "num_workers": e.world.size, "start_step": e.step, "adam_step": e.adam_step}

    def begin(self, step: int) -> None:
        """Before running the plan of ``step``: joins the node on the first one."""
        if self.client is None:
            e = self.engine
            self.client = NodeClient(self.address, rank=e.world.rank, timeout_s=e.config.timeout,
                                     chunk_bytes=e.model_spec.chunk_bytes, node_key=e.config.node_key)
            initial = ((u, INIT_STATES.index(s), v) for u, states in sorted(self._initial.items())
                       for s, v in states.items())
            self._manifest = self.manifest()
            welcome = self.client.connect(self._manifest, initial)
            self._initial.clear()
            if welcome["step"] != e.step:
                raise RuntimeError(f"the optimizer node at {self.address} is at step {welcome['step']}, this worker "
                                   f"at step {e.step}: resume the workers from the node's step")
        self.step = step

    def train_step(self, step_fn: Callable[[Any], dict[str, float]], batch: Any) -> dict[str, float]:
        """``step_fn(batch)`` (the engine's step), rejoining a restarted node and replaying the steps it
        lost ([Note: a node that restarts])."""
        e = self.engine
        target = e.step + 1
        while True:
            try:
                if e.step + 1 >= target:
                    return step_fn(batch)
                step_fn(None)  # a replayed step: its loss was reported the first time
                self.replayed += 1
            except NodeLost as exc:
                if not getattr(exc, "agreed", False):
                    e.world.all_reduce([0.0, 1.0])  # pairs with the others' finish_step: all rejoin
                if batch is not None:
                    raise NodeError(f"{exc}; replaying steps needs batches the engine draws by step number "
                                    f"(train_step() without a batch)") from exc
                self._rejoin(target)

    def finish_step(self, loss_part: float) -> float:
        """After the plan of a step: the node's STATS (the grad norm) and the loss all-reduce with the
        "lost" flag; raises ``NodeLost`` on every worker if any lost the node."""
        lost = None
        try:
            stats = self.client.stats(self.step)
        except NodeLost as exc:
            lost = exc
        loss, flags = self.engine.world.all_reduce([loss_part, float(lost is not None)])
        if flags:
            err = lost or NodeLost(f"worker {self.engine.world.rank}: another worker lost the optimizer node")
            err.agreed = True
            raise err
        self.grad_norm = float(stats["grad_norm"])
        if "spans" in stats:
            from luwu_rt.exec import Span

            self.node_spans = [Span(*x) for x in stats["spans"]]
        if stats["skipped"]:  # the node skipped the update (a non-finite norm): so does the worker's count
            self.engine._skip = True
            self.engine.adam_step -= 1
        return loss

    def _rejoin(self, target: int) -> None:
        """A new connection to the restarted node; the store gets the parameters of the node's step."""
        e = self.engine
        self.client.close(bye=False)
        self.client = NodeClient(self.address, rank=e.world.rank, timeout_s=e.config.timeout,
                                 chunk_bytes=e.model_spec.chunk_bytes, node_key=e.config.node_key)
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

    def _pieces(self, views, state: str, dtype: torch.dtype) -> list[tuple[int, torch.Tensor]]:
        shards, offsets = self.engine.plan.shards, self.engine.store.offsets
        ids = sorted((s for s in views if s.state == state), key=lambda s: s.chunk)
        return [(offsets[s] * dtype.itemsize, views[s].view(dtype)[: shards[s].numel]) for s in ids]

    def _push(self, op, views):
        return self.client.push(self.step, op.unit, self._pieces(views, "grad", torch.float32))

    def _pull(self, op, views):
        return self.client.pull(self.step, op.unit, self._pieces(views, "param", self.engine.param_dtype))

    def handlers(self) -> dict:
        return {"Push": self._push, "Pull": self._pull}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
