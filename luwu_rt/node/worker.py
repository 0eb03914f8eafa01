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

Where a gradient codec plugs in: ``_push`` hands the pieces to the client as
they are; a compressor would encode them here and the node decode them in
``Pushes.offer``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .client import NodeClient
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
            welcome = self.client.connect(self.manifest(), initial)
            self._initial.clear()
            if welcome["step"] != e.step:
                raise RuntimeError(f"the optimizer node at {self.address} is at step {welcome['step']}, this worker "
                                   f"at step {e.step}: resume the workers from the node's step")
        self.step = step

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
