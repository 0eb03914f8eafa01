"""The node's step: its own plan (``plan_node``) run by our executor over its own store, and the two
hand-offs between that plan and the network: pushed gradients in, served parameters out.

[Note: pushes and the node's Recv]
``Pushes`` keeps, per unit, the last step whose gradients the plan received
(``applied``) and the pushes of the next one: one fp32 buffer and a set of
received chunks per rank, so a repeated chunk overwrites the same bytes with
the same bytes (idempotent) and the sum is taken once, in rank order, when the
plan's ``Recv`` waits for it. A push for a step already applied is stale and
answered as a duplicate; one for a later step than the next is impossible
(a worker pushes step s only after it pulled every unit of step s - 1) and
rejected. A node that speculates keeps each unit's sum until the step is decided
(``keep``): a step run again reads it a second time, then ``release`` drops it.
Under a codec ([Note: compressed pushes] in plan/codec.py) a rank's buffer holds
its payload, and ``take`` decodes the payloads in rank order into the sum, the
first written and the others added, as a ddp rank sums its all-gathered ones.
Workers scale their loss by 1 / (N x micro-batches)
([Note: data parallelism in the engine]), so the sum is the gradient of the
global batch's mean loss, as a single-process run computes it.

[Note: double-buffered parameters]
``Served`` keeps two buffers per unit, tagged with the step whose update they
hold. ``Serve(u)`` of step s copies the plan's updated ``param`` into the
buffer holding the older step and only then tags it s, under the lock, so a
pull never reads a half-written unit and a late pull of step s - 1 (a worker
that reconnected) can still be answered from the other buffer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from luwu_rt.compress import codec_for
from luwu_rt.config import from_mapping
from luwu_rt.exec import (Executor, OptimizerStep, SpeculativeRuns, WaitAll, busy_by_queue, state_dtypes,
                          typed_views)
from luwu_rt.exec.chaos import Chaos
from luwu_rt.kernels.dtypes import torch_dtype
from luwu_rt.optim.config import OptimConfig
from luwu_rt.plan import GLOBAL_UNIT, Budgets, Placement, ShardId, plan_node_auto, validate
from luwu_rt.plan.search import plan_node_speculative
from luwu_rt.store import TieredStore

from .chunks import Assembly, chunk_index
from .manifest import model_spec
from .protocol import CREDIT_CHUNKS, INIT_STATES, ProtocolError
from .shards import slice_of

__all__ = ["NodeRunner", "Pushes", "Served"]

_NORM = ShardId(GLOBAL_UNIT, "norm", 0)
NODE_CHAOS_RANK = 1 << 16
"""The node draws chaos delays of its own, not those of any worker rank."""


class Pushes:
    """Gradients pushed by the workers, per unit ([Note: pushes and the node's Recv])."""

    def __init__(self, numels: list[int], *, num_workers: int, chunk_bytes: int, applied: int = 0,
                 keep: bool = False, codec: str = "none") -> None:
        self.numels, self.num_workers, self.chunk_bytes = numels, num_workers, chunk_bytes
        self.codec = None if codec == "none" else codec_for(codec, chunk_numel=chunk_bytes // 4)
        """The workers' codec, or None: fp32 pushes."""
        self.dtype = "float32" if self.codec is None else "uint8"
        """What a push message carries: fp32 gradients, or a codec's payload bytes."""
        self.nbytes = [4 * n if self.codec is None else self.codec.payload_bytes(n) for n in numels]
        """Bytes each worker pushes of each unit."""
        self.applied = [applied] * len(numels)
        self.keep = keep
        self.kept: dict[int, torch.Tensor] = {}
        """Unit -> the sum taken for the step not yet decided (``keep``): what a step run again reads."""
        self.parts: list[dict[int, tuple[torch.Tensor, Assembly]]] = [{} for _ in numels]
        """Per unit: rank -> its pushed fp32 gradient of the next step, and the chunks that arrived
        ([Note: wire chunks] in chunks.py)."""
        self.cond = threading.Condition()
        self.heard: dict[int, float] = {}
        """Rank -> when the node last heard from it (for timeout messages)."""

    def offer(self, *, rank: int, step: int, unit: int, offset: int, payload: memoryview) -> bool:
        """Stores one pushed chunk; True if new, False for a duplicate or a stale step (not applied).
        Raises ``ProtocolError`` for a unit, rank, step or byte range the node does not expect."""
        if not 0 <= unit < len(self.numels) or not 0 <= rank < self.num_workers:
            raise ProtocolError("range", f"unit {unit} / rank {rank} out of range")
        chunk_index(offset, len(payload), total=self.nbytes[unit], chunk_bytes=self.chunk_bytes)
        with self.cond:
            if step <= self.applied[unit]:
                return False
            if step != self.applied[unit] + 1:
                raise ProtocolError("future", f"push of unit {unit} for step {step}; the node waits for step "
                                              f"{self.applied[unit] + 1}")
            part = self.parts[unit].get(rank)
            if part is None:
                buf = torch.empty(self.nbytes[unit] // (4 if self.codec is None else 1),
                                  dtype=torch.float32 if self.codec is None else torch.uint8)
                part = self.parts[unit][rank] = (buf, Assembly([(0, buf)], chunk_bytes=self.chunk_bytes))
            if not part[1].put(offset, payload):
                return False
            self.cond.notify_all()
            return True

    def _complete(self, unit: int) -> bool:
        parts = self.parts[unit]
        # A slice of no elements (a unit smaller than the node shards) is never pushed: complete as it is.
        return self.numels[unit] == 0 or len(parts) == self.num_workers and all(a.complete for _, a in parts.values())

    def take(self, *, step: int, unit: int, out: list[torch.Tensor], timeout_s: float) -> None:
        """Waits until every worker pushed all of ``unit`` for ``step``, then writes their sum (in rank
        order) into the pieces ``out`` (the plan's fp32 ``grad`` shards, in element order)."""
        if unit in self.kept and self.applied[unit] == step:  # the step runs again: the same sum
            _scatter(self.kept[unit], out)
            return
        deadline = time.monotonic() + timeout_s
        with self.cond:
            assert self.applied[unit] == step - 1, (unit, step, self.applied[unit])
            while not self._complete(unit):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(self._missing(step, unit, timeout_s))
                self.cond.wait(min(left, 1.0))
            parts, self.parts[unit] = self.parts[unit], {}
            self.applied[unit] = step
        if not parts:
            return
        if self.codec is None:
            total = parts[0][0]
            for r in range(1, self.num_workers):
                total += parts[r][0]
        else:  # rank order: the bits of a ddp rank's sum of the same payloads
            total = torch.empty(self.numels[unit], dtype=torch.float32)
            for r in range(self.num_workers):
                self.codec.decode(parts[r][0], total, accumulate=r > 0)
        _scatter(total, out)
        if self.keep:
            self.kept[unit] = total

    def release(self, unit: int) -> None:
        """The step is decided and ``unit`` served: the sum kept for running it again goes."""
        self.kept.pop(unit, None)

    def _missing(self, step: int, unit: int, timeout_s: float) -> str:
        parts = self.parts[unit]
        missing = [r for r in range(self.num_workers) if r not in parts or not parts[r][1].complete]
        now = time.monotonic()
        ages = ", ".join(f"worker {r} last heard {now - self.heard[r]:.1f}s ago" if r in self.heard
                         else f"worker {r} never heard" for r in missing)
        return (f"optimizer node: step {step}: no gradients of unit {unit} from worker(s) {missing} within "
                f"{timeout_s:g}s ({ages}); a worker died or hung - see its log, or raise --timeout")


def _scatter(total: torch.Tensor, out: list[torch.Tensor]) -> None:
    start = 0
    for piece in out:
        piece.copy_(total[start : start + piece.numel()])
        start += piece.numel()


class Served:
    """The parameters the node serves, double-buffered per unit ([Note: double-buffered parameters])."""

    def __init__(self, nbytes: list[int]) -> None:
        self.buffers = [(torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)) for n in nbytes]
        self.versions = [[0, -1] for _ in nbytes]
        self.lock = threading.Lock()

    def publish(self, unit: int, step: int, pieces: list[torch.Tensor]) -> None:
        with self.lock:
            older = 0 if self.versions[unit][0] < self.versions[unit][1] else 1
            self.versions[unit][older] = -1  # not readable while it is written
        buf, start = self.buffers[unit][older], 0
        for piece in pieces:
            flat = piece.view(torch.uint8)
            buf[start : start + flat.numel()].copy_(flat)
            start += flat.numel()
        with self.lock:
            self.versions[unit][older] = step

    def get(self, unit: int, step: int) -> torch.Tensor | None:
        """The unit's parameters after ``step``'s update, or None while they are not served yet."""
        with self.lock:
            for i in (0, 1):
                if self.versions[unit][i] == step:
                    return self.buffers[unit][i]
        return None

    def newest(self, unit: int) -> int:
        with self.lock:
            return max(self.versions[unit])


class NodeRunner:
    """The node's plan, store, executor and handlers for the run a manifest describes."""

    def __init__(self, manifest: dict[str, Any], *, num_workers: int, host_bytes: int, nvme_dir: str | None,
                 timeout_s: float, on_served: Callable[[int, int], None], io_backend: str = "auto",
                 chaos: Chaos | str | None = "env", start_step: int | None = None,
                 adam_step: int | None = None, shard_index: int = 0, num_shards: int = 1,
                 exchange_norms: Callable[[int, float], list[float]] | None = None) -> None:
        # ``start_step``/``adam_step``: where a node resumed from its snapshot; else the manifest's.
        # ``shard_index``/``num_shards``: the slice of every unit this process owns, and
        # ``exchange_norms(step, partial)`` every shard's partial norm ([Note: node shards] in shards.py).
        start_step = int(manifest["start_step"]) if start_step is None else start_step
        adam_step = int(manifest["adam_step"]) if adam_step is None else adam_step
        self.manifest = manifest
        self.model = model_spec(manifest)
        self.param_dtype = torch_dtype(manifest["dtype"])
        self.timeout_s = timeout_s
        nvme_bytes = None
        if nvme_dir:
            Path(nvme_dir).mkdir(parents=True, exist_ok=True)
        placement = Placement() if nvme_dir else Placement(params="host", optimizer="host", grads="host")
        # Outside the plan but in host memory all the same: the served parameters (two copies), at worst
        # one pending step of every worker's pushes for every unit ([Note: pushes and the node's Recv]),
        # at the start the one unit's initial state that worker 0's INITs fill (they come in order), and
        # each worker's credit of messages waiting in the node's socket (CREDIT_CHUNKS in protocol.py).
        self.slices = [slice_of(u.num_params, shard_index, num_shards) for u in self.model.units]
        self.numels = [n for _, n in self.slices]
        """Elements of each unit this node shard holds, pushed, updated and served."""
        total = sum(self.numels)
        codec = str(manifest["compress"])
        pushed = sum(self.numels) * 4 if codec == "none" else sum(
            codec_for(codec, chunk_numel=self.model.chunk_bytes // 4).payload_bytes(n) for n in self.numels)
        # A codec's payloads wait instead of fp32 gradients; the sum is decoded into one unit's fp32 buffer.
        self.buffer_bytes = (total * 2 * self.param_dtype.itemsize + pushed * num_workers
                             + 4 * max(self.numels, default=0) * (1 + (codec != "none"))
                             + num_workers * CREDIT_CHUNKS * self.model.chunk_bytes)
        if self.buffer_bytes >= host_bytes:
            raise ValueError(f"the node's push and serve buffers alone take {self.buffer_bytes / 2**20:.1f} MiB "
                             f"({num_workers} worker(s) x pushed gradients + 2 x the parameters + one unit's initial "
                             f"state + the workers' credit), more than its host memory of "
                             f"{host_bytes / 2**20:.1f} MiB: raise --host-mem")
        host_bytes -= self.buffer_bytes
        result = plan_node_auto(self.model, budgets=Budgets(device_bytes=0, host_bytes=host_bytes,
                                                            nvme_bytes=nvme_bytes), num_workers=num_workers,
                                placement=placement, shard_index=shard_index, num_shards=num_shards)
        validate(result.plan)
        self.plan, self.placement = result.plan, result.placement
        # Exact clipping with the state on NVMe: updates speculate ([Note: when to speculate] in exec/speculate.py).
        halves = plan_node_speculative(self.model, budgets=Budgets(device_bytes=0, host_bytes=host_bytes,
                                                                   nvme_bytes=nvme_bytes), placement=self.placement,
                                       num_workers=num_workers, shard_index=shard_index, num_shards=num_shards)
        if halves is not None:
            self.plan = halves["speculate"][0]
        plans = [p for pair in (halves or {}).values() for p in pair]
        for plan in plans:
            validate(plan)
        self.store = TieredStore.create(self.plan, device=torch.device("cpu"),
                                        nvme_root=Path(nvme_dir) / "luwu_node" if nvme_dir else None,
                                        io_backend=io_backend, also=plans)
        self.pushes = Pushes(self.numels, num_workers=num_workers, chunk_bytes=self.model.chunk_bytes,
                             applied=start_step, keep=halves is not None, codec=codec)
        self.served = Served([n * self.param_dtype.itemsize for n in self.numels])
        # The step the workers' engines would take ([Note: clipping] in exec/step.py), from their HELLO.
        self.optimizer = OptimizerStep(
            self.plan.shards, optim=from_mapping(OptimConfig, manifest["optim"], where="HELLO manifest optim"),
            total_steps=int(manifest["steps"]), loss_scale=float(manifest["loss_scale"]),
            param_dtype=self.param_dtype, grad_dtype=torch.float32, adam_step=adam_step)
        self.dtypes = state_dtypes(param_dtype=self.param_dtype, grad_dtype=torch.float32)
        self.on_served = on_served
        self.exchange_norms = exchange_norms
        if (num_shards > 1) != (exchange_norms is not None):
            raise ValueError("node shards exchange their norms: exchange_norms is needed exactly when num_shards > 1")
        handlers = {"Recv": self._recv, "Serve": self._serve, **self.optimizer.handlers()}
        if exchange_norms:
            handlers["NormReduce"] = self._norm_across
        chaos = Chaos.from_env(rank=NODE_CHAOS_RANK) if chaos == "env" else chaos
        self.executor = Executor(self.plan, store=self.store, handlers=handlers, chaos=chaos)
        self.speculation: SpeculativeRuns | None = None
        if halves is not None:
            runs = {name: [self.executor if p is self.plan else Executor(p, store=self.store, handlers=handlers,
                                                                          queues=self.executor.queues, chaos=chaos)
                           for p in pair] for name, pair in halves.items()}
            self.speculation = SpeculativeRuns(self.optimizer, self.store, **runs)
        self.step = start_step
        self.metrics: dict[str, float] = {}

    def close(self) -> None:
        self.executor.close()
        self.store.close()

    # -- initial state ([Note: the manifest]) ----------------------------------------------------

    def write_initial(self, unit: int, state: str, values: torch.Tensor) -> None:
        """Sets a unit's whole fp32 ``state``; the master also sets the served parameters of the start step."""
        self.store.write_state(unit, state, values)
        if state == "master":
            param = values.to(self.param_dtype)
            self.store.write_state(unit, "param", param)
            self.served.publish(unit, self.step, [param])
        self.store.flush()

    def read_states(self) -> Iterator[tuple[tuple[int, str], torch.Tensor]]:
        """Every unit's fp32 master and moments, one state at a time (a snapshot holds one in memory at
        once, not the node's whole state); between steps, when the store is quiet."""
        for u, n in enumerate(self.numels):
            for s in INIT_STATES:
                yield (u, s), self.store.read_state(u, s, torch.empty(n, dtype=torch.float32))

    @property
    def adam_step(self) -> int:
        """Updates applied (skipped steps do not count), Adam's ``t`` of the last step."""
        return self.optimizer.adam_step

    # -- handlers ---------------------------------------------------------------------------------

    def _pieces(self, views, state: str) -> list[torch.Tensor]:
        return typed_views(views, self.plan.shards, self.dtypes, states=(state,))[state]

    def _recv(self, op, views) -> WaitAll:
        step, out = self.step, self._pieces(views, "grad")
        return WaitAll(then=lambda: self.pushes.take(step=step, unit=op.unit, out=out, timeout_s=self.timeout_s))

    def _serve(self, op, views) -> WaitAll:
        if _NORM in views and self.optimizer.verdict() != "commit":
            return WaitAll()  # a speculative step's updates are wrong: it runs again and serves then
        self.served.publish(op.unit, self.step, self._pieces(views, "param"))
        self.pushes.release(op.unit)
        self.on_served(op.unit, self.step)
        return WaitAll()

    def _norm_across(self, op, views) -> WaitAll:
        """NormReduce over the node shards: this shard's sum, then every shard's partial from shard 0, summed
        in shard order, so every shard holds the same bits ([Note: node shards] in shards.py)."""
        norms = self.optimizer.norms
        step, out = self.step, norms.local_sum(op, views)
        partial = float(out[0])

        def finish() -> None:
            total = sum(self.exchange_norms(step, partial))
            out[0] = total
            norms.total_sq = total

        return WaitAll(then=finish)

    def run_step(self) -> dict[str, float]:
        """Runs the node's plan for the next step; returns its metrics (seconds busy per queue)."""
        self.step += 1
        self.optimizer.begin(self.step)
        start = time.perf_counter()
        if self.speculation is None:
            spans = self.executor.run()
        else:
            spans = self.speculation.run(lambda: self.optimizer.begin(self.step))
        self.last_spans = spans
        result = self.optimizer.finish()
        if self.store.double_buffered and not result.skipped:
            self.store.swap_halves()  # the half the step wrote is current
        busy = busy_by_queue(spans)
        self.metrics = {"step": self.step, "step_s": time.perf_counter() - start, "recv_s": busy.get("push", 0.0),
                        "optim_s": busy.get("optim", 0.0), "send_s": busy.get("pull", 0.0),
                        "io_s": busy.get("nvme_read", 0.0) + busy.get("nvme_write", 0.0),
                        "grad_norm": result.grad_norm, "skipped": result.skipped}
        return self.metrics
