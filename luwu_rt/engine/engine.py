"""``Engine``: out-of-core training of a chain of units, on one rank or data-parallel on several.

Per step: sample micro-batches, run the step's ``SwapPlan`` through the
executor, whose ``Compute`` ops run units forward and backward
(``engine/compute.py``) and whose optimizer ops go to where the optimizer runs
([Note: where the optimizer runs] in exec/place.py): here, where ``OptimStep``
ops run the fused AdamW kernel on each unit's shards as soon as the plan allows
(``OptimizerStep`` in exec/step.py), or on optimizer node shards that the plan's
``Push``/``Pull`` ops reach (node/worker.py). The plan was made once, at
construction, from the model's unit sizes, the placement and the budgets, and
checked by the validator; every step repeats it.

[Note: data parallelism in the engine]
With N ranks (``torchrun`` or ``luwu train --nproc N``) every rank runs its own
copy of the engine and the plan of the chosen strategy (engine/strategy.py);
the plan's collectives run on one process group per queue
([Note: one process group per queue] in dist/world.py) through
``CollectiveHandlers``. What a rank adds beside the plan:

- data: micro-batch i of a step is the one a single-process run with batch
  N x b draws; rank r trains on its rows [r*b, (r+1)*b);
- the loss is scaled by 1 / (N x micro-batches) and collectives sum, so the
  reduced gradient is the gradient of the global batch's mean loss;
- gradients are kept and reduced in fp32 whatever the compute dtype;
- a sharded state holds this rank's slice of each unit (``_mine``), a
  checkpoint the slices of the first replica;
- metrics (loss, tokens) are reduced over the ranks on the control group.
"""

from __future__ import annotations

import os
import shutil
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from luwu_rt.config import from_mapping
from luwu_rt.dist import CollectiveHandlers, TorchGroup
from luwu_rt.dist.compressed import CodecHandlers
from luwu_rt.dist.world import World, init_from_env, queue_groups
from luwu_rt.ckpt.format import CheckpointReader, new_run_id, run_checkpoints
from luwu_rt import heap
from luwu_rt.engine.budgets import DEMO_MODEL, resolve_budgets
from luwu_rt.engine.compute import StepRng, UnitCompute, UnitwiseConfig
from luwu_rt.engine.config import TrainConfig, resumed_settings
from luwu_rt.engine.hwprofile import choose_profile, per_rank
from luwu_rt.fs import DirLock, lock_dir, missing_top, remove_made, scratch_name, writable_dir
from luwu_rt.io import rank_queue_depth
from luwu_rt.ckpt.save import PERSISTENT, rank_tensors, read_residual, save_checkpoint, verify_checkpoint
from luwu_rt.engine.strategy import (candidate_strategies, choose_plan, double_buffered_or_why, plan_digest,
                                     warmup_steps)
from luwu_rt.engine.kept import plan_kept
from luwu_rt.kernels.dtypes import torch_dtype
from luwu_rt.exec import (Executor, LocalOptimizer, OptimizerPlace, OptimizerStep, Queues, Span, SpeculativeRuns,
                          busy_by_queue)
from luwu_rt.models.adapt import as_unit_chain
from luwu_rt.models.units import UnitChain
from luwu_rt.models.weights import first_weights
from luwu_rt.plan import Budgets, ModelSpec, Placement, SwapPlan, estimate, plan_step, validate
from luwu_rt.plan.analysis import params_at_risk, wire_bytes
from luwu_rt.plan.search import snug_arenas, step_times
from luwu_rt.plan.spec import ceil_div
from luwu_rt.store import TieredStore

__all__ = ["Engine"]

def _nothing() -> None:
    pass


def _remove_made(path: Path, *, top: Path, lock: DirLock) -> None:
    """Removes an NVMe directory the engine created, its lock file too, then drops the lock: never before,
    or another run could take a lock whose file is then removed under it ([Note: directory locks])."""
    try:
        remove_made(path, top=top)
    finally:
        lock.release()


def _as_chain(model: Any) -> UnitChain:
    """``as_unit_chain``, plus factories: a callable (not a module) is called to build the model."""
    if callable(model) and not isinstance(model, (nn.Module, UnitChain, str)):
        model = model()
    return as_unit_chain(model)


class Engine:
    """Trains a chain of units whose parameters and optimizer state live where the plan puts them.

    ``model``: a preset name (``"gpt-tiny"``), a ``UnitChain``, an ``nn.Sequential``-like list of units,
    or a factory returning one, or ``"hf:PATH"`` (a local Hugging Face model folder). The first weights
    ([Note: where the first weights come from] in models/weights.py) come from ``init_from`` (or
    ``config.init_from``: a safetensors checkpoint, streamed in unit by unit), else from the model's own
    parameters when they are real tensors, else (a model on ``meta``) from ``config.seed``.
    """

    def __init__(self, model: Any = None, config: TrainConfig | None = None, *, materialize: bool = True,
                 init_from: str | os.PathLike | None = None) -> None:
        # Before any thread of the run allocates: one heap for all of them ([Note: the C heap under CPU tensors]).
        heap.share_one_arena()
        config = config or TrainConfig()
        if config.optim.schedule_steps is None:
            # Where the cosine ends is part of the run's config: its checkpoints and the node's HELLO say it, and a
            # resume keeps it ([Note: the schedule of a resumed run] in optim/schedule.py).
            config = replace(config, optim=replace(config.optim, schedule_steps=config.steps))
        self.config = config
        self.world: World = init_from_env(timeout_s=config.timeout_s)
        self._demo = (model if model is not None else config.model) == DEMO_MODEL  # built by name: the demo's budgets
        self.chain = _as_chain(model if model is not None else config.model)
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.param_dtype = torch_dtype(config.dtype)
        self.loss_scale = config.loss_scale if config.dtype == "fp16" else 1.0
        self._made_dirs: Callable[[], Any] = _nothing
        """Removes the NVMe directory this engine created, once: at ``close``, or when the interpreter exits
        (an engine never closed), or at once when the plan keeps nothing on NVMe."""
        try:
            self._plan()
        except BaseException:
            self._made_dirs()  # a run that does not fit leaves no directory behind
            raise
        device_arena = self.store.arenas.get("device")
        # [Note: data parallelism in the engine]: gradients in fp32 across ranks, the loss scaled to the global mean.
        grad_dtype = torch.float32 if self.model_spec.grad_bytes == 4 else self.param_dtype  # as the plan sized them
        self.compute = UnitCompute(self.chain, param_dtype=self.param_dtype, grad_dtype=grad_dtype,
                                   config=UnitwiseConfig(
                                       loss_scale=self.loss_scale / (config.grad_accum * self.world.size),
                                       keep_graph=self.keep_graph),
                                   device_arena=device_arena.buffer if device_arena is not None else None,
                                   at_risk=frozenset().union(*map(params_at_risk, self._plans())),
                                   step_rng=StepRng(seed=config.seed, rank=self.world.rank))
        self.optimizer: OptimizerPlace = self._place_optimizer(grad_dtype)
        """Where the optimizer runs ([Note: where the optimizer runs] in exec/place.py)."""
        handlers = {"Compute": self.compute, **self.optimizer.handlers()}
        # One set of queue threads and streams serves both plans: a unit computes on the same
        # long-lived thread in training and evaluation ([Note: persistent queue threads]).
        self.queues = Queues(device=self.device)
        # A step's tail of write-backs may still run when train_step returns ([Note: steady state] in
        # plan/steady.py): whatever reads or writes the store between steps waits for it first.
        self.store.settle = self.queues.drain
        self.executor = Executor(self.plan, store=self.store, queues=self.queues, handlers=handlers)
        self.eval_executor = Executor(self.eval_plan, store=self.store, queues=self.queues,
                                      handlers={k: v for k, v in handlers.items() if k in ("Compute", "Gather")})
        self.warm_executor = None if self.warm_plan is None else Executor(
            self.warm_plan, store=self.store, queues=self.queues, handlers=handlers)
        self.speculation: SpeculativeRuns | None = None
        """The step's plans by half and how they ran, with a double-buffered optimizer state."""
        if self.halves is not None:
            assert isinstance(self.optimizer, LocalOptimizer)
            restore = {**handlers, "OptimStep": self.optimizer.step.restore}
            runs = {name: [self.executor if p is self.plan else Executor(
                        p, store=self.store, queues=self.queues, handlers=restore if name == "restore" else handlers)
                           for p in pair] for name, pair in self.halves.items()}
            self.speculation = SpeculativeRuns(self.optimizer.step, self.store, **runs)
        self.step = 0
        """Optimizer steps taken (the step number of the last completed ``train_step``)."""
        self.run_id: str | None = None
        """The run whose checkpoints these are: a fresh run's first ``save`` names it, a loaded one keeps its own."""
        self._dir_locks: dict[str, Any] = {}
        """Checkpoint directories this engine locked ([Note: directory locks] in fs.py), until ``close``."""
        self.last_spans: list[Span] = []
        self._sampler = None
        self.init_from = init_from if init_from is not None else config.init_from
        """Safetensors file or folder the first weights are read from (``None``: the model or the seed)."""
        self.weights_source: str | None = None
        """Where the first weights came from, one line for the log (``None`` when loaded from a checkpoint)."""
        if materialize:
            self._materialize()

    def close(self) -> None:
        """Joins the queue threads, releases the store's IO engine and removes the NVMe directory this engine
        created ([Note: missing directories] in cli/dirs.py); idempotent. The engine cannot run steps
        afterwards."""
        try:
            self.queues.drain()  # the last step's tail: its failure is this run's
        finally:
            self.optimizer.close()  # a node's: says BYE
            self.queues.close()
            self._release()

    def _release(self) -> None:
        """The store's files and IO engine, the NVMe directory this engine made, the checkpoint locks."""
        self.store.close()
        self._made_dirs()  # after the store closed the tier's files; a finalizer runs once
        for lock in getattr(self, "_dir_locks", {}).values():  # checkpoint directories save() locked
            lock.release()
        self._dir_locks = {}

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- construction -------------------------------------------------------------------------

    def _plan(self) -> None:
        off, world = self.config.offload, self.world
        nvme_root = None
        nvme_bytes = 0
        if off.nvme_dir:
            # Each rank its own directory: its own shards, its own disk bandwidth where D spans disks.
            base = Path(off.nvme_dir) / f"rank-{world.rank}" if world.distributed else Path(off.nvme_dir)
            made = missing_top(base)
            world.barrier()  # every rank has looked before any creates D: each knows whether the run made it
            writable_dir(base, flag="--nvme-dir")  # a file or an unwritable directory: one line, now
            if made is not None and not off.keep_nvme_state:  # removed by close ([Note: missing directories])
                lock = lock_dir(base, flag="--nvme-dir")  # held until the files (the lock file too) are gone
                self._made_dirs = weakref.finalize(self, _remove_made, base, top=made, lock=lock)
            nvme_root = base / "luwu_state"
            # Every rank must plan from the same budgets to make the same plan: the smallest free space.
            nvme_bytes = int(world.all_reduce([shutil.disk_usage(base).free], "min")[0])
        # "auto" budgets from this machine; every rank plans with the smallest ([Note: automatic budgets]).
        auto = resolve_budgets(off.device_mem_bytes, off.host_mem_bytes, demo=self._demo, device_type=self.device.type,
                               local_ranks=world.local_size)
        device_bytes, host_bytes = (int(b) for b in world.all_reduce(list(auto), "min"))
        budgets = Budgets(device_bytes=device_bytes, host_bytes=host_bytes, nvme_bytes=nvme_bytes)
        placement = Placement(params=off.params, optimizer=off.optimizer, grads=off.grads)
        strategies = candidate_strategies(self.config.strategy, world_size=world.size,
                                          shard_group_size=self.config.shard_group_size,
                                          compress=self.config.compress,
                                          node_shards=len(self.config.node.split(",")) if self.config.node else 1)
        # Placement and strategy "auto" choose by predicted step time: on this machine's figures where known.
        # Rank 0's profile for every rank: a rank on another machine with a cached calibration of its own would
        # otherwise plan differently.
        self.profile_choice = world.all_gather_object(choose_profile(self.config.profile))[0]
        profile = per_rank(self.profile_choice, local_ranks=world.local_size)
        # The planner's view of this run, its activation reserve measured by running the chain on the meta
        # device as the step will ([Note: activation estimate] in workload.py), with the graphs the budgets
        # leave room for ([Note: kept graphs chosen by the budget] in kept.py): as `luwu plan` answers.
        kept = plan_kept(self.chain, self.config, world_size=world.size,
                         plan=lambda model, explain: choose_plan(model, strategies=strategies, budgets=budgets,
                                                                 placement=placement, compress=self.config.compress,
                                                                 profile=profile, explain=explain))
        self.keep_graph: frozenset[int] = kept.units
        """The units whose forward keeps its graph until their backward."""
        self.model_spec: ModelSpec = kept.model
        """The planner's view of the run, with the reserve of ``keep_graph``'s activations."""
        self.strategy, result = kept.strategy, kept.result
        self._agree(result)
        self.placement = result.placement
        # Arenas no larger than the step needs ([Note: arenas no larger than the step needs] in plan/search.py):
        # every plan over the store made again under each trial limit, judged by the steps' predicted times and
        # the chains under them ([Note: a chain under the bound] there).
        unlimited, made = self._plans_for(budgets, step=result.plan)
        double = isinstance(made, dict)
        self.why_updates_wait = made if isinstance(made, str) else ""
        """Why the step's updates wait for its norm where clipping or fp16 needs it before them (``""``: they need
        not wait, or they speculate), as the planner says (``speculate_or_wait``)."""
        snug, _ = snug_arenas(budgets, plans=lambda b: unlimited if b is budgets else self._plans_for(
                                  b, halves=double)[0],
                              predict=lambda plans: step_times(plans, profile))
        (self.plan, self.eval_plan, *others), made = self._plans_for(
            snug, step=result.plan if snug is budgets else None, halves=double, check=True)
        self.halves: dict[str, tuple[SwapPlan, SwapPlan]] | None = made if isinstance(made, dict) else None
        """The step's plans by half of a double-buffered optimizer state (``plan_speculative``), the step's plan the
        speculative one; ``None`` when the state has one half."""
        self.warm_plan: SwapPlan | None = others[0] if self._warms() else None
        """The step of a compression warm-up ([Note: compression warm-up]); ``None`` without one."""
        if self.halves is not None:
            self.model_spec = replace(self.model_spec, double_buffer=True)
        self.predicted = estimate(self.plan, profile)
        self.wire_bytes = wire_bytes(self.plan)
        """Bytes this rank sends per step by the plan's collectives (compressed payloads as encoded)."""
        self.warm_wire_bytes = wire_bytes(self.warm_plan) if self.warm_plan is not None else self.wire_bytes
        self.store = TieredStore.create(self.plan, device=self.device, nvme_root=nvme_root,
                                        io_backend=self.config.io_backend, also=(self.eval_plan, *others),
                                        scratch=not off.keep_nvme_state,
                                        queue_depth=rank_queue_depth(world.local_size))
        if self.store.nvme is None:
            self._made_dirs()  # the plan keeps nothing on NVMe: no directory of ours in the way while it runs

    def _plans_for(self, budgets: Budgets, *, step: SwapPlan | None = None, halves: bool | None = None,
                   check: bool = False) -> tuple[tuple[SwapPlan, ...], dict[str, tuple[SwapPlan, SwapPlan]] | str]:
        """Every plan this run makes over its store with ``budgets`` - the step's (a double-buffered optimizer
        state's speculative one), evaluation's, a compression warm-up's (third, when ``_warms``), the other
        halves' - and ``_double_buffered``'s answer: the halves by name, or why the state has one. ``step``: the
        step's plan of a state with one half, made already;
        ``halves``: whether the state must have two (else ``ValueError``, as for a plan that does not fit);
        ``check``: each plan validated."""
        made = self._double_buffered(budgets)
        two = made if isinstance(made, dict) else None
        if halves is not None and halves != (two is not None):
            raise ValueError("the second half of the optimizer state does not fit these budgets")
        model = replace(self.model_spec, double_buffer=two is not None)
        if two is not None:
            step = two["speculate"][0]
        elif step is None:
            step = plan_step(model, budgets=budgets, placement=self.placement, strategy=self.strategy)
        # Evaluation runs a forward-only plan (one micro-batch) over the same store: the same layout (which
        # depends on the micro-batches: accumulating reduce-scatters have a workspace), homes and reserve.
        evaluation = plan_step(replace(model, forward_only=True), budgets=budgets, placement=self.placement,
                               strategy=self.strategy)
        warm = (plan_step(replace(model, uncompressed=True), budgets=budgets, placement=self.placement,
                          strategy=self.strategy),) if self._warms() else ()
        plans = (step, evaluation, *warm, *(p for pair in (two or {}).values() for p in pair if p is not step))
        if check:
            for plan in plans:
                validate(plan)
        return plans, made

    def _double_buffered(self, budgets: Budgets) -> dict[str, tuple[SwapPlan, SwapPlan]] | str:
        """The plans of a double-buffered optimizer state, by half, or why the state has one half
        (``double_buffered_or_why``; ``""`` where the updates need not wait for the norm)."""
        return double_buffered_or_why(self.model_spec, warmup=warmup_steps(self.config.compress_warmup, self.strategy),
                                      budgets=budgets, placement=self.placement, strategy=self.strategy)

    # [Note: compression warm-up]
    # Error feedback delivers what a sparse codec leaves out later, in one piece: under topk:0.01 a value
    # reaches the optimizer about once every 100 steps as the sum of the gradients it missed. Adam divides
    # that spike by its own root mean square, so a coordinate moves by a few learning rates per delivery
    # where it would have moved by one per step: the run trains slower, most while the loss falls fastest
    # (gpt-tiny, ddp at 2 ranks, 300 steps: 26% above the uncompressed loss). DeepSpeed's 1-bit Adam
    # (freeze_step) and DGC start with uncompressed steps for this; so does ``--compress-warmup N``: steps
    # 1..N run ``warm_plan``, the step planned with ``ModelSpec.uncompressed`` over the same store (the
    # codec's shards laid out, untouched), so the residuals are still zero when step N + 1 first encodes,
    # and a run resumed at any step picks its plan by the step number alone. One plan per step kind: a
    # warm-up runs without a double-buffered optimizer state.

    def _warms(self) -> bool:
        """Whether the run's first steps synchronise uncompressed ([Note: compression warm-up])."""
        return bool(warmup_steps(self.config.compress_warmup, self.strategy))

    def _plans(self) -> list[SwapPlan]:
        """Every training plan this engine may run (the step's; with a double-buffered state every half's)."""
        if self.halves is not None:
            return [p for pair in self.halves.values() for p in pair]
        return [self.plan] if self.warm_plan is None else [self.warm_plan, self.plan]

    def _agree(self, result) -> None:
        """Every rank must run the same plan, or their collectives would not match: compare digests."""
        digests = self.world.all_gather_object(plan_digest(result))
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            raise RuntimeError(f"ranks {differ} planned differently from rank 0 (strategy, placement or collectives); "
                               "give every rank the same configuration and budgets")

    def _mine(self, state: str, values: torch.Tensor) -> torch.Tensor:
        """This rank's part of a unit's whole buffer of ``state``: its slice when the strategy shards it
        ([Note: slices of a full buffer] in dist/collectives.py), zero-padded at the end, else all of it."""
        if not self.strategy.sharded(state):
            return values
        ways = self.strategy.shard_ways
        per = ceil_div(values.numel(), ways)
        start = (self.world.rank % ways) * per
        out = torch.zeros(per, dtype=values.dtype)
        part = values[start : start + per]
        out[: part.numel()] = part
        return out

    def _place_optimizer(self, grad_dtype: torch.dtype) -> OptimizerPlace:
        """Where this run's optimizer runs, chosen here once ([Note: where the optimizer runs] in
        exec/place.py): under strategy node on the optimizer node shards ([Note: the worker under strategy
        node] in node/worker.py), else in this process on its store, the plan's collectives (if any)
        joining the ranks."""
        c = self.config
        if self.strategy.name == "node":
            from luwu_rt.node.worker import NodeWorker

            # A compressed push is encoded by the data-parallel strategies' Encode ([Note: compressed pushes]).
            codec = self.strategy.compress[0] if self.strategy.compresses else "none"
            encode = CodecHandlers(self.plan.shards, rank=self.world.rank).encode if self.strategy.compresses else None
            return NodeWorker(address=c.node, plan=self.plan, store=self.store, model=self.model_spec, optim=c.optim,
                              total_steps=c.steps, dtype=c.dtype, param_dtype=self.param_dtype,
                              loss_scale=self.loss_scale, rank=self.world.rank, num_workers=self.world.size,
                              all_reduce=self.world.all_reduce, timeout_s=c.timeout_s, node_key=c.node_key,
                              compress=codec, encode=encode)
        step = OptimizerStep(self.plan.shards, optim=c.optim, total_steps=c.steps, loss_scale=self.loss_scale,
                             param_dtype=self.param_dtype, grad_dtype=grad_dtype)
        collectives = {}
        if self.world.distributed:
            groups = {q: TorchGroup(pg)
                      for q, pg in queue_groups(self.strategy, self.plan.comm_groups, self.world).items()}
            collectives = CollectiveHandlers(self.plan.shards, groups=groups, param_dtype=self.param_dtype,
                                             grad_dtype=grad_dtype, norms=step.norms).handlers()
        return LocalOptimizer(step, store=self.store, all_reduce=self.world.all_reduce, collectives=collectives)

    @property
    def adam_step(self) -> int:
        """Updates applied (steps skipped for non-finite gradients do not count), Adam's ``t``."""
        return self.optimizer.adam_step

    def _materialize(self) -> None:
        """Writes every unit's first weights into the store, one unit at a time, from the source that
        ``first_weights`` chose and logged ([Note: where the first weights come from])."""
        source = first_weights(self.chain, seed=self.config.seed, init_from=self.init_from)
        self.weights_source = source.description
        for u in range(self.chain.num_units):
            flat = source.unit(u)
            self._write_unit(u, {"master": flat, "exp_avg": torch.zeros_like(flat),
                                 "exp_avg_sq": torch.zeros_like(flat)})
        heap.trim()  # the units' temporaries, freed, would stay resident ([Note: the C heap under CPU tensors])

    def _write_unit(self, unit: int, states: Mapping[str, torch.Tensor]) -> None:
        """Sets a unit's whole buffers (this rank's part of them, ``_mine``): the parameters in the store, the
        optimizer state where the optimizer runs; without a ``param`` the compute copy is the master's, and a
        compressed unit's residual starts from zeros unless given."""
        param = states["param"] if "param" in states else states["master"].to(self.param_dtype)
        if self.strategy.codec(unit) != "none" and "residual" not in states:
            states = {**states, "residual": torch.zeros_like(states["master"])}
        self.optimizer.keep_initial(unit, {s: self._mine(s, v) for s, v in states.items() if s != "param"})
        self.store.write_state(unit, "param", self._mine("param", param))
        self.store.flush()

    def _read_state(self, unit: int, state: str, out: torch.Tensor) -> torch.Tensor:
        """This rank's part of a unit's ``state`` after the last step: the parameters from the store, the
        optimizer state from where the optimizer runs."""
        read = self.store.read_state if state == "param" else self.optimizer.read_state
        return read(unit, state, out)

    # -- training -----------------------------------------------------------------------------

    def grad_norm(self) -> float:
        """Global L2 norm of the last step's (unscaled) gradients."""
        return self.optimizer.grad_norm

    def sampler(self):
        """The configured training data's batch sampler (created on first use)."""
        if self._sampler is None:
            from luwu_rt.data import BatchSampler, load_tokens

            # A GPT preset's shape or a Hugging Face chain's config knows the vocabulary; other chains are byte-level.
            vocab = (getattr(self.chain, "vocab_size", None)
                     or getattr(getattr(self.chain, "shape", None), "vocab_size", None) or 256)
            # An hf:PATH model's folder tokenises text data with the model's own tokenizer.
            self.tokens = load_tokens(self.config.data, vocab_size=vocab,
                                      default_tokenizer=getattr(self.chain, "source", None))
            c = self.config
            # The global micro-batch: rank r trains on its rows ([Note: data parallelism in the engine]).
            self._sampler = BatchSampler(self.tokens.train, batch_size=c.batch_size * self.world.size,
                                         seq_len=c.seq_len, seed=c.seed, vocab_size=vocab)
        return self._sampler

    def _my_rows(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's sequences of a global micro-batch."""
        b, r = self.config.batch_size, self.world.rank
        return batch[0][r * b : (r + 1) * b], batch[1][r * b : (r + 1) * b]

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor] | list | None = None) -> dict[str, float]:
        """One optimizer step. ``batch``: ``(inputs, targets)``, a list of ``grad_accum`` of them, or
        ``None`` to draw the next ones from the configured data. Returns the step's metrics."""
        # Where the optimizer runs may run earlier steps again first ([Note: a node that restarts], node/worker.py).
        return self.optimizer.run_step(self._train_step, batch, step=self.step + 1)

    def _train_step(self, step: int, batch: tuple[torch.Tensor, torch.Tensor] | list | None) -> dict[str, float]:
        """Runs step ``step`` (1-based) on ``batch`` (``None``: the step's batches of the configured data)."""
        # Step - 1 is done: the next one, or one that runs again after a node restart, whose rejoin put the
        # parameters of step - 1 into the store ([Note: a node that restarts] in node/worker.py).
        self.step = step - 1
        c = self.config
        if batch is None:
            sampler = self.sampler()
            batches = [self._my_rows(sampler.batch((step - 1) * c.grad_accum + i)) for i in range(c.grad_accum)]
        else:
            batches = list(batch) if isinstance(batch, list) else [batch]
        if len(batches) != c.grad_accum:
            raise ValueError(f"train_step got {len(batches)} micro-batches; "
                             f"the plan was made for grad_accum={c.grad_accum}")
        batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        self.compute.begin(batches, step=step)  # [Note: dropout is drawn by step]
        self.optimizer.begin_step(step)
        start = time.perf_counter()
        warm = self.warm_executor is not None and step <= c.compress_warmup
        if self.speculation is None:  # the step's tail runs on beside the next step ([Note: steady state])
            self.last_spans = (self.warm_executor if warm else self.executor).run(pipeline=True)
        else:  # a redo sets the step up anew and runs it again ([Note: when to speculate] in exec/speculate.py)
            self.last_spans = self.speculation.run(
                lambda: (self.compute.begin(batches, step=step), self.optimizer.begin_step(step)))
        step_s = time.perf_counter() - start
        tokens = sum(y.numel() for _, y in batches) * self.world.size
        busy = busy_by_queue(self.last_spans)
        part = sum(self.compute.losses) / len(self.compute.losses) / self.world.size
        result = self.optimizer.finish_step(part)
        self.step = step
        return {
            "step": step, "loss": result.loss,
            "lr": result.lr, "grad_norm": result.grad_norm, "skipped": result.skipped,
            "step_s": step_s, "tokens_per_s": tokens / step_s, "compute_s": busy.get("compute", 0.0),
            "optim_s": busy.get("optim", 0.0), "kept_bytes": self.compute.kept_bytes,
            "io_s": sum(busy.get(q, 0.0) for q in ("nvme_read", "nvme_write", "h2d", "d2h")),
            "wire_bytes": self.warm_wire_bytes if warm else self.wire_bytes,
            "encode_s": busy.get("encode", 0.0), "decode_s": busy.get("decode", 0.0),
            "wait_s": max(step_s - busy.get("compute", 0.0), 0.0),  # compute queue idle: waiting on IO or the optimizer
            # Which plans ran ([Note: when to speculate]): a step that waited or was redone is not the speculative step.
            "updates": self.speculation.last if self.speculation is not None else "as planned",
        }

    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None, *,
                 num_batches: int | None = None) -> float:
        """Mean loss over ``batches`` (default: ``config.eval_batches`` validation batches), no gradients."""
        if batches is None:
            from luwu_rt.data import BatchSampler

            self.sampler()
            c = self.config
            val = BatchSampler(self.tokens.val, batch_size=c.batch_size * self.world.size, seq_len=c.seq_len,
                               seed=c.seed + 1, vocab_size=self._sampler.vocab_size)
            batches = [self._my_rows(val.batch(i)) for i in range(num_batches or c.eval_batches)]
        losses = []
        for x, y in batches:
            self.compute.begin([(x.to(self.device), y.to(self.device))], train=False)
            self.eval_executor.run()
            losses += self.compute.losses
        (loss,) = self.world.all_reduce([sum(losses) / len(losses) / self.world.size])
        return loss

    # -- checkpoints --------------------------------------------------------------------------

    def _load_residuals(self, reader: CheckpointReader) -> None:
        """Each compressed unit's residual of this rank from the checkpoint ([Note: residuals in checkpoints]
        in ckpt/save.py): its own on the same number of ranks, the sum of those it stands for on another."""
        for u in range(self.chain.num_units):
            if self.strategy.codec(u) != "none":
                values = read_residual(reader, u, self.chain.num_unit_params(u), rank=self.world.rank,
                                       world_size=self.world.size)
                self.optimizer.keep_initial(u, {"residual": values})
                self.store.flush()

    def _signature(self) -> dict[str, Any]:
        """Unit names, each own parameter's name and shape, and the prefix under which the unit's
        parameters appear in the whole model's ``state_dict`` (for export)."""
        whole = getattr(self.chain, "model", None)
        prefixes = {id(m): name for name, m in whole.named_modules()} if isinstance(whole, nn.Module) else {}
        return {"units": [{"name": self.chain.names[u],
                           "prefix": prefixes.get(id(self.chain.units[u]), self.chain.names[u]),
                           "params": [[n, list(p.shape)] for n, p in self.chain.named_own_params(u)]}
                          for u in range(self.chain.num_units)]}

    def save(self, directory: str | os.PathLike) -> Path:
        """Writes a checkpoint of the current step under ``directory`` (atomically); returns its path. With
        several ranks every rank calls it ([Note: checkpoints of several ranks] in ckpt/format.py)."""
        if self.run_id is None:  # a fresh run: its checkpoints are its own from now on
            self.run_id = new_run_id()
        numels = [self.chain.num_unit_params(u) for u in range(self.chain.num_units)]
        path = save_checkpoint(directory, world=self.world, step=self.step, adam_step=self.adam_step,
                               run_id=self.run_id, config=asdict(self.config), model=self._signature(),
                               strategy=self.strategy.name, read=self._read_state, locks=self._dir_locks,
                               tensors=rank_tensors(strategy=self.strategy, rank=self.world.rank, numels=numels,
                                                    param_dtype=self.param_dtype))
        if self.world.rank == 0:
            # Only this run's checkpoints ([Note: one run per checkpoint directory] in ckpt/resume.py).
            keep = self.config.checkpoint.keep
            for old in run_checkpoints(directory, self.run_id)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.world.barrier()
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike, model: Any = None, *,
             overrides: dict[str, Any] | None = None) -> "Engine":
        """An engine restored from the checkpoint ``directory`` (a ``step_<N>`` directory), to be closed
        (``with Engine.load(path) as engine:``). ``overrides`` changes config keys (e.g. the number of steps,
        budgets or placement) of the saved run's config, which the run otherwise keeps, its learning-rate
        schedule too: more ``steps`` than the saved schedule's end run at ``min_lr`` unless ``overrides``
        gives ``optim.schedule_steps`` ([Note: the schedule of a resumed run] in optim/schedule.py). The
        saved run's NVMe directory is not reused: ``overrides`` may name one, else a run that had one gets a
        fresh ``./luwu-scratch-*`` that ``close`` removes ([Note: missing directories] in cli/dirs.py)."""
        reader = CheckpointReader(directory)
        verify_checkpoint(reader, read_data=False)  # complete and self-consistent; data is checked as read
        settings = resumed_settings(reader.settings, overrides or {})
        if (reader.settings.get("offload") or {}).get("nvme_dir") and not settings["offload"].get("nvme_dir"):
            settings["offload"]["nvme_dir"] = scratch_name()  # created, and removed at close, by the engine
        engine = cls(model, from_mapping(TrainConfig, settings), materialize=False)
        try:
            engine._restore(reader)
        except BaseException:
            engine.close()  # its threads, locks and the directory it made: the caller never gets it to close
            raise
        return engine

    def _restore(self, reader: CheckpointReader) -> None:
        """Sets the store, the optimizer's state and the step from the checkpoint ``reader`` reads."""
        self.run_id = reader.run_id  # a resumed run goes on owning its checkpoints
        if self._signature() != reader.meta["model"]:
            raise ValueError(f"checkpoint {reader.directory} holds a different model than the one given "
                             f"(unit names or parameter shapes differ)")
        for u in range(self.chain.num_units):
            n = self.chain.num_unit_params(u)
            # Whole or in slices, from any strategy and number of ranks; this rank keeps its part.
            self._write_unit(u, {state: reader.read_joined(f"u{u}.{state}", n).to(
                                     self.param_dtype if state == "param" else torch.float32)
                                 for state in PERSISTENT})
        self._load_residuals(reader)
        heap.trim()  # as after materialising: the checkpoint's tensors, read and freed
        self.step = reader.meta["step"]
        self.optimizer.start_at(step=self.step, adam_step=reader.meta["adam_step"])

