"""The worker's side of strategy ``node``: where its optimizer runs ([Note: where the optimizer runs] in
exec/place.py) is the optimizer node: the plan's ``Push``/``Pull`` handlers, the HELLO, the step's STATS.

[Note: the worker under strategy node]
A worker of strategy ``node`` holds only ``param`` and ``grad`` (plan/sequence.py):
its plan pushes each unit's fp32 gradient once backward made it final and pulls
the unit's updated parameters back ([Note: the node's step] in plan/node.py).
The master weights and moments the engine materialises (or loads from a
checkpoint) are not the worker's to keep: ``keep_initial`` takes them, worker 0
sends them to the node after its HELLO, and every worker drops them. The node
is joined on the first step, when the step to resume from is known. The worker
keeps the step's schedule and Adam's count through an ``OptimizerStep`` whose
update runs on the node; the node's STATS say the step's norm and whether it
skipped ([Note: skipped steps] in exec/step.py). The loss
is scaled by 1 / (N x micro-batches) as for every data-parallel strategy, so
the node's sum of the N pushes is the global batch's gradient.

[Note: a node that restarts]
A node killed and restarted on its snapshot directory answers with a new epoch,
and every wait of the old connection raises ``NodeLost``. The workers must all
notice at the same step, or one would replay while another waits in the loss
all-reduce: so the step's loss all-reduce carries a "lost" flag too
(``finish_step``), and a worker whose executor failed contributes its flag to
that same all-reduce before it rejoins (``run_step``). Then each worker
reconnects (a new client, the HELLO of its first connect, no INIT), learns the
snapshot's step s from the WELCOME, pulls every unit's parameters after step s
into its store, and replays steps s+1 ... up to the one it was running.
Batches are drawn by step number and the node sums the pushes in rank order
from the snapshot's exact fp32 state, so the replayed steps compute the same
losses bit for bit.
Batches given to ``train_step`` are kept for two of the node's snapshot
intervals (its WELCOME says ``snapshot_every``), so those steps replay too.
A compressed run's residuals (error feedback) are this worker's state, and
every step changes them: replayed with the residuals the worker holds now,
steps s+1 ... would encode their gradients with the error of steps the node
forgot (and a step the node lost mid-way would add its own error twice). So
after each step the node snapshots (a multiple of ``snapshot_every``; also
the step it joins at, which a node resumed from its own snapshot may return
to) the worker copies its residuals, keeps the newest ``KEEP_SNAPSHOTS`` as
the node keeps its snapshots, and a rejoin at step s writes step s's copy
back into the store before it replays: the replay is the run bit for bit.
The copies are host memory beside the store, outside ``--host-mem``: 4 bytes
per compressed parameter each, held only when the run compresses and the
node snapshots. A node back at a step whose copy the worker no longer holds
is refused, naming the steps it holds.

[Note: node shards that restart]
With k node shards, one that is killed and restarted comes back at its
snapshot's step s while the others hold the state of a later step, and a
replay needs every slice of every unit at step s. So after the workers agree
that a shard was lost (as above), each one reconnects to the shards whose new
incarnation answered it and learns their steps; every other shard, and a
restarted one that came back at a later step, is sent ROLLBACK to the lowest
of them, s. A shard told so waits for a snapshot it may be writing, then
``luwu node serve`` replaces its own process with the same command at the
same address and ``--resume-step s``: that is a kill and a restart, on the
shard's own snapshot of s, which it holds (all shards snapshot the same
steps, the newest two kept), and which the kernel, not the old process,
clears the way for (its threads, its sockets, its IO in flight). Each worker
waits until the shard answers as a new incarnation, reconnects, and, once
every shard welcomed it at s, pulls each unit's slices from their shards and
replays from s as above. A shard without that snapshot (or without
``--snapshot-dir``, or run inside another program that gave no way to
restart it) refuses the ROLLBACK by name, and the workers stop with its line.
Partial norms that the old incarnations left at shard 0 are dropped by their
epoch ([Note: node shards] in shards.py).

A compressed unit ([Note: compressed pushes] in plan/codec.py) is encoded by
the plan's ``Encode`` (the data-parallel strategies' handler, which the engine
gives this worker) into ``grad_code``, one piece per node shard, with the
unit's residual, which is this worker's store state (its own, not the node's:
``keep_initial`` and ``read_state`` take it to and from the store); ``_push``
sends piece j's payload to shard j, and the node decodes it in ``Pushes.take``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from luwu_rt.exec import (Handler, OptimizerStep, Span, StepFn, StepOutcome, StepResult, WaitAll, state_dtypes,
                          typed_views)
from luwu_rt.optim.config import OptimConfig
from luwu_rt.plan import ModelSpec, SwapPlan
from luwu_rt.plan.codec import parse_codec
from luwu_rt.store import TieredStore

from .client import NodeClient, NodeError, NodeLost, await_answer
from .config import check_address
from .protocol import INIT_STATES
from .shards import slice_of
from .snapshot import KEEP_SNAPSHOTS

__all__ = ["NodeWorker"]


class NodeWorker:
    """One worker's optimizer place: its optimizer node shards; see [Note: the worker under strategy node].

    ``address``: the node shards' addresses, comma-separated in shard order (``--node``). ``plan``,
    ``store``: the worker's (its ``param`` and ``grad``). ``rank``/``num_workers``/``all_reduce``: this
    worker's place in the run and the sum over the workers. ``model``, ``optim``, ``total_steps``,
    ``dtype``, ``loss_scale``: what the HELLO tells the node ([Note: the manifest] in manifest.py)."""

    def __init__(self, *, address: str, plan: SwapPlan, store: TieredStore, model: ModelSpec, optim: OptimConfig,
                 total_steps: int, dtype: str, param_dtype: torch.dtype, loss_scale: float, rank: int,
                 num_workers: int, all_reduce: Callable[[list[float]], list[float]], timeout_s: float,
                 node_key: str | None = None, compress: str = "none", encode: Handler | None = None) -> None:
        self.address = address
        self.addresses = [a.strip() for a in address.split(",")]
        """One per node shard, in shard order ([Note: node shards] in shards.py)."""
        if not all(self.addresses):
            raise ValueError(f"--node {address!r}: give the node shards' addresses separated by commas, in shard "
                             f"order, e.g. tcp://127.0.0.1:5555,tcp://127.0.0.1:5556")
        for one in self.addresses:
            check_address(one, flag="--node", bind=False)
        self.plan, self.store, self.model = plan, store, model
        self.optim, self.total_steps, self.dtype, self.loss_scale = optim, total_steps, dtype, loss_scale
        self.param_dtype = param_dtype
        self.rank, self.num_workers, self.all_reduce = rank, num_workers, all_reduce
        # ``{rank}`` in --node-key: each worker its own key (luwu node keygen --workers N, [Note: node keys]).
        self.timeout_s, self.node_key = timeout_s, node_key.replace("{rank}", str(rank)) if node_key else None
        self.dtypes = state_dtypes(param_dtype=param_dtype, grad_dtype=torch.float32)
        self.optimizer = OptimizerStep(plan.shards, optim=optim, total_steps=total_steps, loss_scale=loss_scale,
                                       param_dtype=param_dtype, grad_dtype=torch.float32)
        """The step's schedule and Adam's count; its update runs on the node."""
        self.compress, self.encode = compress, encode
        """The run's codec (the manifest's ``compress``) and the handler of the plan's ``Encode`` (with a codec)."""
        assert (compress == "none") == (encode is None), "a codec needs the Encode handler"
        self.clients: list[NodeClient] = []
        self.slices = [[slice_of(u.num_params, j, len(self.addresses)) for j in range(len(self.addresses))]
                       for u in model.units]
        """unit -> shard -> (first element, elements) that shard keeps."""
        self.step = 0
        """The step begun last (after it finished: the last step, whose state the node holds)."""
        self._initial: dict[int, dict[str, torch.Tensor]] = {}
        self._manifest: dict[str, Any] | None = None
        """The HELLO of the first connect, sent again on a reconnect: the run is the same one."""
        self._grad_norm = 0.0
        self.replayed = 0
        """Steps run again after the node restarted ([Note: a node that restarts])."""
        self.rejoins = 0
        """Times this worker reconnected to a restarted node."""
        self._batches: dict[int, Any] = {}
        """Step -> the batch ``run_step`` was given, for replays ([Note: a node that restarts])."""
        self._snapshot_every = 0
        """The node's --snapshot-every, from its WELCOME."""
        self._residuals: dict[int, dict[int, torch.Tensor]] = {}
        """Step -> unit -> this worker's residual after that step, at the node's snapshot steps (a compressed
        run's replay starts from them: [Note: a node that restarts])."""
        self.shard_spans: list[list[Span]] = []
        """Every node shard's op spans of the run's last step, in shard order: their rows in ``--trace``."""

    # -- the optimizer place ([Note: where the optimizer runs] in exec/place.py) -------------------

    @property
    def adam_step(self) -> int:
        return self.optimizer.adam_step

    @property
    def grad_norm(self) -> float:
        """The global gradient norm of the last step, from the node's STATS."""
        return self._grad_norm

    def handlers(self) -> dict[str, Handler]:
        return {"Push": self._push, "Pull": self._pull, **({"Encode": self.encode} if self.encode else {})}

    def start_at(self, *, step: int, adam_step: int) -> None:
        self.step = step
        self.optimizer.start_at(adam_step=adam_step)

    def keep_initial(self, unit: int, states: Mapping[str, torch.Tensor]) -> None:
        """The optimizer states of a unit: worker 0 keeps them for the node, the others drop them; a residual is
        every worker's own, in its store (the caller flushes it). A call sets the states it names and keeps
        the others: a resume gives the moments first and each residual after, in a call of its own."""
        if "residual" in states:
            self.store.write_state(unit, "residual", states["residual"])
        if self.rank == 0:
            self._initial.setdefault(unit, {}).update(
                {s: v.float().contiguous() for s, v in states.items() if s in INIT_STATES})

    def describe(self) -> tuple[str, ...]:
        return ("optimizer state on the optimizer node",)

    def trace_rows(self) -> list[tuple[str, list[Span]]]:
        shards = [s for s in self.shard_spans if s]
        names = ["optimizer node"] if len(shards) == 1 else [f"optimizer node {i}/{len(shards)}"
                                                              for i in range(len(shards))]
        return list(zip(names, shards))

    def manifest(self, *, start_step: int) -> dict[str, Any]:
        """[Note: the manifest] in manifest.py."""
        m = self.model
        # Several shards: the addresses tell shard i > 0 where shard 0 takes the norms ([Note: node shards]).
        nodes = {"nodes": self.addresses} if len(self.addresses) > 1 else {}
        units = [{"name": u.name, "num_params": u.num_params, "reads": list(u.reads)} for u in m.units]
        return {**nodes, "model": {"units": units,
                          "param_bytes": m.param_bytes, "chunk_bytes": m.chunk_bytes,
                          "max_shards_per_state": m.max_shards_per_state,
                          "optimizer_waits_for_backward": m.optimizer_waits_for_backward},
                "optim": dataclasses.asdict(self.optim), "steps": self.total_steps, "dtype": self.dtype,
                "loss_scale": self.loss_scale, "num_workers": self.num_workers, "start_step": start_step,
                "adam_step": self.adam_step, "compress": self.compress}

    @property
    def client(self) -> NodeClient | None:
        """The link to the (first) node shard."""
        return self.clients[0] if self.clients else None

    def _client(self, address: str) -> NodeClient:
        return NodeClient(address, rank=self.rank, timeout_s=self.timeout_s, chunk_bytes=self.model.chunk_bytes,
                          node_key=self.node_key)

    def begin_step(self, step: int) -> None:
        """Before running the plan of ``step``: joins the node shards on the first one (one after another:
        a shard welcomes once every worker joined it)."""
        if not self.clients:
            self._manifest = self.manifest(start_step=step - 1)
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
                if welcome["step"] != step - 1:
                    raise NodeError(f"the optimizer node at {address} is at step {welcome['step']}, this worker "
                                       f"at step {step - 1}: resume the workers from the node's step")
            self._initial.clear()
            self._keep_residuals(step - 1)
        self.step = step
        self.optimizer.begin(step)  # the node updates; this reports the step's lr
        for c in self.clients:
            c.begin(step)

    def read_state(self, unit: int, state: str, out: torch.Tensor) -> torch.Tensor:
        """``unit``'s fp32 optimizer ``state`` after the last step, from the node shards (a checkpoint's); a
        residual from this worker's store."""
        if state == "residual":
            return self.store.read_state(unit, state, out)
        raw = out.view(torch.uint8)
        index = INIT_STATES.index(state)
        waits = []
        for j, c in enumerate(self.clients):
            lo, hi = (x * 4 for x in self._range(unit, j))
            if hi > lo:
                waits.append(c.read_state(self.step, unit, index, [(0, raw[lo:hi])]))
        WaitAll(waits).wait()
        return out

    def _range(self, unit: int, shard: int) -> tuple[int, int]:
        start, n = self.slices[unit][shard]
        return start, start + n

    def run_step(self, step_fn: StepFn, batch: Any, *, step: int) -> Any:
        """``step_fn(step, batch)``, first rejoining a restarted node and replaying the steps it lost
        ([Note: a node that restarts])."""
        if batch is not None:  # kept while a node restart may need the step again
            self._batches[step] = batch
            keep = 2 * self._snapshot_every  # a restart resumes at most two snapshot intervals back
            for old in [s for s in self._batches if s <= step - keep]:
                del self._batches[old]
        at = step  # the next step to run
        while True:
            try:
                if at >= step:
                    return step_fn(step, batch)
                step_fn(at, self._batches.get(at))  # a replayed step: its loss was reported the first time
                self.replayed += 1
                at += 1
            except NodeLost as exc:
                if not getattr(exc, "agreed", False):
                    self.all_reduce([0.0, 1.0])  # pairs with the others' finish_step: all rejoin
                at = self._rejoin(step) + 1
                missing = [s for s in range(at, step) if batch is not None and s not in self._batches]
                if missing:
                    raise NodeError(f"{exc}; replaying steps {missing} needs their batches, which this worker no "
                                    f"longer has (it keeps 2 x the node's --snapshot-every)") from exc

    def finish_step(self, loss_part: float) -> StepResult:
        """After the plan of a step: the node's STATS (the grad norm, the skip) and the loss all-reduce with the
        "lost" flag; raises ``NodeLost`` on every worker if any lost the node."""
        lost, every = None, []
        try:
            every = [c.stats(self.step) for c in self.clients]
        except NodeLost as exc:
            lost = exc
        loss, flags = self.all_reduce([loss_part, float(lost is not None)])
        if flags:
            err = lost or NodeLost(f"worker {self.rank}: another worker lost the optimizer node")
            err.agreed = True
            raise err
        stats = every[0]
        self._grad_norm = float(stats["grad_norm"])
        if "spans" in stats:
            self.shard_spans = [[Span(*x) for x in st.get("spans", ())] for st in every]
        # The node skipped the update (a non-finite norm) or applied it: so counts the worker's Adam step.
        result = self.optimizer.finish(outcome=StepOutcome(grad_norm=self._grad_norm, skipped=bool(stats["skipped"])))
        self._keep_residuals(self.step)
        return dataclasses.replace(result, loss=loss)

    def _keep_residuals(self, step: int) -> None:
        """After ``step``: a copy of every residual when the node snapshots that step, the newest
        ``KEEP_SNAPSHOTS`` kept ([Note: a node that restarts])."""
        every = self._snapshot_every
        if self.compress == "none" or not every or step <= 0 or step % every:
            return
        units = sorted(s.unit for s in self.plan.shards if s.state == "residual")
        self._residuals[step] = {u: self.store.read_state(u, "residual", torch.empty(self.model.units[u].num_params))
                                 for u in units}
        for old in sorted(self._residuals)[:-KEEP_SNAPSHOTS]:
            del self._residuals[old]

    def _rejoin(self, target: int) -> int:
        """New connections to the node shards, all at the step of the snapshot a restarted one resumed from
        ([Note: node shards that restart]); the store gets the parameters of that step, which it returns (the
        run resumes after it, Adam's count where the snapshots had it)."""
        at = {j: self._reconnect(j, target) for j in self._restarted()}  # shard -> (step, Adam step) it welcomed at
        for _ in range(2 * len(self.clients)):  # each round leaves fewer shards elsewhere, or raises
            step = min(s for s, _ in at.values())
            behind = [j for j in range(len(self.clients)) if at.get(j, (None,))[0] != step]
            if not behind:
                break
            for j in behind:
                if self.clients[j].lost is None:  # this worker's connection is to a live incarnation
                    self.clients[j].rollback(step)
                at[j] = self._reconnect(j, target)
        else:
            raise NodeError(f"worker {self.rank}: the node shards did not come back at one step (at {at}): see their "
                            f"logs")
        if self.compress != "none" and step not in self._residuals:
            raise NodeError(f"the optimizer node at {self.address} resumed at step {step}, but this worker keeps its "
                            f"residuals (--compress {self.compress}) of steps {sorted(self._residuals)} only, so a "
                            f"replay would not be the run's: restart the node on an empty --snapshot-dir and resume "
                            f"the workers from their last checkpoint (luwu train --resume)")
        what = "the optimizer node" if len(self.clients) == 1 else f"the {len(self.clients)} optimizer node shards"
        print(f"luwu worker {self.rank}: {what} at {self.address} came back at step {step}; replaying steps "
              f"{step + 1}..{target}", file=sys.stderr, flush=True)
        for unit, spec in enumerate(self.model.units):
            buf = torch.empty(spec.num_params, dtype=self.param_dtype)
            raw, size = buf.view(torch.uint8), buf.element_size()
            WaitAll([c.pull(step, unit, [(0, raw[lo * size:hi * size])]) for j, c in enumerate(self.clients)
                     for lo, hi in [self._range(unit, j)] if hi > lo]).wait()
            self.store.write_state(unit, "param", buf)
        for unit, residual in self._residuals.get(step, {}).items():  # the error feedback of step ``step``
            self.store.write_state(unit, "residual", residual)
        self.store.flush()
        self.start_at(step=step, adam_step=at[0][1])
        self.rejoins += 1
        return step

    def _restarted(self) -> list[int]:
        """The shards whose new incarnation answered this worker, once one has: the other workers' "lost" flag
        may have come before this worker heard of it itself."""
        await_answer(lambda: any(c.lost is not None for c in self.clients), self.clients, self.timeout_s,
                     f"worker {self.rank}: another worker lost an optimizer node shard, but none of {self.address} "
                     f"answered this worker as a new incarnation within {self.timeout_s:g}s; raise --timeout to "
                     f"wait longer")
        return [j for j, c in enumerate(self.clients) if c.lost is not None]

    def _reconnect(self, shard: int, target: int) -> tuple[int, int]:
        """A new connection to node shard ``shard`` (a HELLO of a rejoin at ``target``, no INIT); returns the step
        and Adam step of the snapshot its incarnation resumed from."""
        address = self.addresses[shard]
        self.clients[shard].close(bye=False)
        self.clients[shard] = self._client(address)
        welcome = self.clients[shard].connect(self._manifest, None, step=target)
        step = int(welcome["step"])
        if step >= target:
            raise NodeError(f"the optimizer node at {address} resumed at step {step}, past this worker's step "
                            f"{target}: its snapshot directory holds another run's snapshot")
        return step, int(welcome["adam_step"])

    # -- the plan's handlers ------------------------------------------------------------------------

    def _pieces(self, views, unit: int, state: str) -> list[list[tuple[int, torch.Tensor]]]:
        """Per node shard, the bytes of the unit's ``state`` in the store that the shard keeps: ``(byte offset
        in the shard's slice, uint8 view)``, in order."""
        whole, pos = [], 0
        for view in typed_views(views, self.plan.shards, self.dtypes, states=(state,))[state]:
            whole.append((pos, view.view(torch.uint8)))
            pos += view.numel() * view.element_size()
        assert pos == self.model.units[unit].num_params * self.dtypes[state].itemsize, "a transfer is a whole unit"
        out = []
        for j in range(len(self.clients)):
            lo, hi = (x * self.dtypes[state].itemsize for x in self._range(unit, j))
            out.append([(max(o, lo) - lo, t[max(o, lo) - o : min(o + t.numel(), hi) - o])
                        for o, t in whole if max(o, lo) < min(o + t.numel(), hi)])
        return out

    def _push(self, op, views) -> WaitAll:
        if self.compress != "none":
            return self._push_code(op, views)
        pieces = self._pieces(views, op.unit, "grad")
        return WaitAll([c.push(self.step, op.unit, p) for c, p in zip(self.clients, pieces) if p])

    def _push_code(self, op, views) -> WaitAll:
        """Piece j of the unit's ``grad_code`` (one shard, a piece per node shard at j x the size of a full
        one, as ``Encode`` wrote them) to shard j ([Note: compressed pushes] in plan/codec.py)."""
        (code_id,) = [a.shard for a in op.inputs if a.shard.state == "grad_code"]
        code = views[code_id].view(torch.uint8)[: self.plan.shards[code_id].numel]
        spec, chunk = parse_codec(self.compress), self.model.chunk_bytes // 4
        full = spec.payload_bytes(self.slices[op.unit][0][1], chunk)  # shard 0's slice is a full piece
        waits = []
        for j, c in enumerate(self.clients):
            size = spec.payload_bytes(self.slices[op.unit][j][1], chunk)
            if size:
                waits.append(c.push(self.step, op.unit, [(0, code[j * full : j * full + size])], dtype="uint8"))
        return WaitAll(waits)

    def _pull(self, op, views) -> WaitAll:
        pieces = self._pieces(views, op.unit, "param")
        return WaitAll([c.pull(self.step, op.unit, p) for c, p in zip(self.clients, pieces) if p])

    def close(self) -> None:
        """Says BYE to the node shards."""
        for c in self.clients:
            c.close()
        self.clients = []
