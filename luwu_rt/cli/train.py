"""`luwu train`: train a model larger than the device (and host) budgets.

With no arguments it trains gpt-tiny on the embedded corpus (the Python
standard library's source) on the CPU for 300 steps, over all three tiers: the
default budgets leave the parameters and gradients room on the device but keep
the optimizer state out of the host budget, so the planner puts it on an NVMe
tier in a scratch directory under the current directory ([Note: missing
directories] in dirs.py). Flags override a ``--config`` TOML file, which
overrides the defaults of ``TrainConfig``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["add_arguments", "run"]

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from luwu_rt.cli.flags import add_config_flags

    # Every TrainConfig field that is a flag, with the field's type, default and choices ([Note: one flag table]).
    add_config_flags(parser)
    parser.add_argument("--resume-if-exists", dest="resume_if_exists", action="store_true",
                        help="--resume when --ckpt-dir holds a checkpoint, else start from step 0")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="TOML file with the same keys; flags override it")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--stop-after", dest="stop_after", type=int, default=None, metavar="N",
                        help="stop after step N, as Ctrl-C would (with --ckpt-dir a checkpoint of it), and exit 0: "
                             "--resume then continues the same run, on the same learning-rate schedule, to --steps")
    parser.add_argument("--spawn-node", dest="spawn_node", action="store_true",
                        help="strategy node: start a local optimizer node (luwu node serve) for the --nproc ranks "
                             "and stop it when training ends or fails")
    parser.add_argument("--node-shards", dest="node_shards", type=int, default=1, metavar="K",
                        help="with --spawn-node: start K node shards (luwu node serve --shard i/K), each keeping 1/K "
                             "of every unit (default 1)")
    parser.add_argument("--node-log", dest="node_log", default=None, metavar="FILE",
                        help="with --spawn-node: the node's lines, with its per-step times, are appended to FILE "
                             "(default: its per-step lines are not kept; its errors reach stderr either way)")
    parser.add_argument("--node-snapshot-every", dest="node_snapshot_every", type=int, default=0, metavar="K",
                        help="with --spawn-node: the node shards snapshot their state every K steps, and one that "
                             "dies is started again on its snapshots while the workers rejoin it and replay, with "
                             "the same losses (default 0: no snapshots; a node that dies ends the run)")
    parser.add_argument("--node-snapshot-dir", dest="node_snapshot_dir", default=None, metavar="DIR",
                        help="with --node-snapshot-every: where the shards' snapshots go, a directory per shard "
                             "(default: a temporary directory, removed when the run ends)")
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="run N ranks on this machine (data parallel, each on its share of the cores); "
                             "the same as torchrun --nproc-per-node N -m luwu_rt train ...")
    parser.add_argument("--max-restarts", dest="max_restarts", type=int, default=0, metavar="N",
                        help="with --nproc and --ckpt-dir: when a rank fails (killed, out of memory), end the "
                             "ranks and start them all again from the newest checkpoint, up to N times, as torchrun "
                             "--max-restarts does; a user error (exit 2) or Ctrl-C ends the run (default 0)")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    from luwu_rt.cli.flags import config_overrides

    out = config_overrides(args)
    if args.resume_if_exists:
        out.setdefault("checkpoint", {})["resume"] = True
    return out


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's config keys: the flags given over the ``--config`` file, each read under the keys' current
    names first ([Note: renamed config keys] in config.py)."""
    from luwu_rt.config import load_toml, merge, upgrade_keys
    from luwu_rt.engine import TrainConfig

    toml = upgrade_keys(TrainConfig, load_toml(args.config)) if args.config else {}
    return merge(toml, _overrides(args))


def _build(args: argparse.Namespace):
    from luwu_rt.ckpt.format import CheckpointReader
    from luwu_rt.ckpt.resume import check_steps, choose_checkpoint
    from luwu_rt.cli.dirs import nothing_left_on_error
    from luwu_rt.config import from_mapping
    from luwu_rt.engine import Engine, TrainConfig
    from luwu_rt.engine.config import resumed_settings
    from luwu_rt.fs import lock_dir, lock_file, writable_dir
    from luwu_rt.optim.schedule import resume_line

    settings = _settings(args)
    config = from_mapping(TrainConfig, settings)
    off = config.offload
    if off.nvme_dir and not os.path.exists(off.nvme_dir):
        # Created as `luwu plan --nvme-dir` assumes, but said: a typo should not fill another disk unnoticed;
        # the engine removes what it created when it closes ([Note: missing directories] in dirs.py).
        fate = "kept: --keep-nvme-state" if off.keep_nvme_state else "removed at exit"
        _say(f"creating --nvme-dir {off.nvme_dir} (it did not exist; {fate})")
    for path, flag in ((config.json_log, "--json-log"), (config.trace, "--trace")):
        if path:  # outputs are checked before the first step, not when it ends ([Note: directory locks])
            writable_dir(os.path.dirname(os.path.abspath(path)), flag=f"the directory of {flag}")
    ckpt = config.checkpoint
    # A refused run (it does not fit, a checkpoint it cannot resume) leaves no directory or lock file behind.
    first = int(os.environ.get("RANK") or 0) == 0
    with nothing_left_on_error(config.offload.nvme_dir, ckpt.dir, config.json_log if first else None) as held:
        if config.json_log and first:  # one run per log, or their lines interleave; released when _train ends
            args.json_log_lock = lock_file(config.json_log, flag="--json-log")
            held.append(args.json_log_lock)
        if not ckpt.dir:
            return Engine(None, config)
        if first:
            # Held until the process ends: rank 0 alone writes and deletes checkpoints ([Note: directory locks]).
            held.append(lock_dir(ckpt.dir, flag="--ckpt-dir"))
        start = choose_checkpoint(ckpt.dir, resume=ckpt.resume, if_exists=args.resume_if_exists, say=_say)
        if start is None:
            return Engine(None, config)
        reader = CheckpointReader(start)
        # What Engine.load will run: the saved run's settings, the flags given over them.
        resumed = from_mapping(TrainConfig, resumed_settings(reader.settings, settings))
        check_steps(start, step=reader.step, steps=resumed.steps, given="steps" in settings)
        _say(f"resuming from {start} (step {reader.step} of run {reader.run_id or '(no run id)'})")
        saved_end = resumed_settings(reader.settings, {})["optim"]["schedule_steps"]
        _say(resume_line(resumed.optim, step=reader.step, steps=resumed.steps, saved_end=saved_end))
        if reader.lacks:  # an older format ([Note: older formats] in ckpt/format.py)
            _say(f"{start} is a {reader.format} checkpoint: it lacks {'; '.join(reader.lacks)}")
        return Engine.load(start, overrides=settings)


def _built(args: argparse.Namespace):
    """``_build``, or ``None`` for a resume of a run that is complete (said, and not an error)."""
    from luwu_rt.ckpt.resume import RunComplete

    try:
        return _build(args)
    except RunComplete as done:
        _say(f"luwu: {done}")
        return None


def _say(line: str) -> None:
    """A line on stderr from the first rank only (every rank of a multi-rank run runs this code)."""
    import os

    if int(os.environ.get("RANK") or 0) == 0:
        print(line, file=sys.stderr)


# The state groups a user places with --offload-*: (name in the first line, the flag's key, plan states).
_GROUPS = (("params", "params", ("param",)), ("grads", "grads", ("grad",)),
           ("optimizer state", "optimizer", ("master", "exp_avg", "exp_avg_sq")))


def _describe(engine) -> str:
    """The run's first line: where each state lives and why, read from the plan's homes and budgets
    (not from the flags), so that it says what the planner decided."""
    from luwu_rt.plan import format_size
    from luwu_rt.plan.analysis import state_bytes

    plan = engine.plan
    sizes = state_bytes(plan)
    tiers: dict[str, list[tuple[str, str, int]]] = {}
    for name, key, states in _GROUPS:
        held = [s for s in states if s in sizes]  # strategy node: the optimizer state is the node's
        if held:
            tiers.setdefault(plan.homes[held[0]], []).append((name, key, sum(sizes[s] for s in held)))
    homes = [f"{' and '.join(n for n, _, _ in groups)} on {_where(engine, tier)} ({_why(engine, tier, groups)})"
             for tier in ("device", "host", "nvme") if (groups := tiers.get(tier))]
    homes += engine.optimizer.describe()  # beyond the plan's homes: e.g. the optimizer node's
    peaks = ", ".join(f"{t} {format_size(n)}" for t, n in plan.peak_bytes.items() if n)
    if engine.world.distributed:
        s = engine.strategy
        group = f" in sharding groups of {s.shard_ways}" if s.name == "hsdp" else ""
        why = " (auto: the fastest predicted step that fits)" if engine.config.strategy == "auto" else ""
        ranks = (f"; strategy {s.name} on {engine.world.size} ranks{group}{why}"
                 f"{_compression(s, engine.config.compress_warmup)}; per rank: peak")
    else:
        ranks = "; peak"
    return (f"{engine.config.model}: {engine.chain.num_params / 1e6:.2f}M params in {engine.chain.num_units} units; "
            f"{', '.join(homes)}{ranks} {peaks}; {_kept(engine)}{_updates(engine)}; "
            f"planned with the {engine.profile_choice.describe()}")


def _updates(engine) -> str:
    """When the updates run, where exact clipping or fp16 needs the step's norm before them ([Note: speculative
    updates] in plan/sequence.py); nothing where they need not wait."""
    if engine.speculation is not None:
        return "; updates speculate on a double-buffered optimizer state (redone when the norm needs clipping)"
    return f"; updates wait for the gradient norm: {engine.why_updates_wait}" if engine.why_updates_wait else ""


def _kept(engine) -> str:
    """How many units keep their forward graph ([Note: kept graphs chosen by the budget] in engine/kept.py)."""
    why = " (auto: the most that fit)" if engine.config.keep_graphs == "auto" else ""
    return f"forward graphs kept by {len(engine.keep_graph)} of {engine.chain.num_units - 1} units{why}"


def _compression(strategy, warmup: int) -> str:
    """How the run compresses its gradients, for the first line: the codec, how many units use it, and from which
    step ([Note: compression warm-up] in engine/engine.py)."""
    if not strategy.compresses:
        return ""
    codecs = [c for c in strategy.compress if c != "none"]
    kinds = ", ".join(f"{c} on {codecs.count(c)}" for c in dict.fromkeys(codecs))
    after = f" from step {warmup + 1}, uncompressed before" if warmup else ""
    return f", gradients compressed ({kinds} of {len(strategy.compress)} units){after}"


def _where(engine, tier: str) -> str:
    if tier == "nvme":
        return f"nvme at {engine.config.offload.nvme_dir}"
    return tier


def _why(engine, tier: str, groups: list[tuple[str, str, int]]) -> str:
    """Why the planner put ``groups`` (name, flag key, bytes) on ``tier``: the budget they fit, or the
    faster tier's budget they did not; a placement the user gave is named as such."""
    from luwu_rt.plan import format_size as size

    off, plan = engine.config.offload, engine.plan
    forced = [key for _, key, _ in groups if getattr(off, key) != "auto"]
    if len(forced) == len(groups):
        return ", ".join(f"--offload-{key} {tier}" for key in forced)
    names = " and ".join(n for n, _, _ in groups)
    nbytes = sum(n for _, _, n in groups)
    arena = max(plan.budgets.device_bytes - plan.device_reserve_bytes, 0)
    if tier == "device":
        cpu = "; a CPU arena, no GPU" if engine.device.type == "cpu" else ""
        return (f"{size(nbytes)} fit the {size(arena)} device arena beside {size(plan.device_reserve_bytes)} of "
                f"activations{cpu}")
    budget, what = (arena, "device arena") if tier == "host" else (plan.budgets.host_bytes, "host budget")
    if nbytes > budget:
        return f"{what} {size(budget)} < {names} {size(nbytes)}"
    return f"{names} {size(nbytes)}: no room beside the rest in the {size(budget)} {what}"


@contextlib.contextmanager
def _scratch_nvme_dir(args: argparse.Namespace) -> Iterator[None]:
    """Without an NVMe directory of its own (no --nvme-dir, none in --config), a run's NVMe tier is a
    scratch directory ./luwu-scratch-* made here and removed when the run ends: on success, on an error
    and on Ctrl-C ([Note: missing directories] in dirs.py). A resumed run makes a new one rather than
    reuse the checkpoint's: the tier is rebuilt every run anyway, and the old scratch is gone."""
    from luwu_rt.cli.dirs import scratch_dir
    from luwu_rt.config import load_toml

    args.scratch = None
    offload = load_toml(args.config).get("offload") if args.config else None
    from_toml = offload.get("nvme_dir") if isinstance(offload, dict) else None  # a malformed table: from_mapping says
    if args.nvme_dir is not None or from_toml is not None:  # "" too: the config refuses it in one line
        yield
        return
    with scratch_dir(flag="--nvme-dir", keep=bool(args.keep_nvme_state)) as scratch:
        # As a flag, so that the ranks of --nproc get it too: one scratch for all, which this process
        # (the launcher) removes after they exit, however they exit.
        args.nvme_dir, args.scratch = scratch.path, scratch
        try:
            yield
        finally:
            if args.keep_nvme_state and not scratch.removed:
                _say(f"the NVMe tier's files stay in {scratch.path} (--keep-nvme-state)")


def run(args: argparse.Namespace) -> int:
    from luwu_rt.interrupt import StopRequest, test_hook

    world_size = int(os.environ.get("WORLD_SIZE") or 1)
    if getattr(args, "max_restarts", 0):
        return _restarting(args, world_size)
    if getattr(args, "stop_after", None) is not None and args.stop_after < 1:
        raise ValueError(f"--stop-after {args.stop_after}: give the step to stop after, >= 1")
    if getattr(args, "node_shards", 1) != 1 and not getattr(args, "spawn_node", False):
        raise ValueError("--node-shards goes with --spawn-node; for nodes you started, list every shard's address "
                         "in --node, in shard order")
    if getattr(args, "node_log", None) and not getattr(args, "spawn_node", False):
        raise ValueError("--node-log goes with --spawn-node; a node you started takes luwu node serve --log-file FILE")
    for flag, given in (("--node-snapshot-every", getattr(args, "node_snapshot_every", 0)),
                        ("--node-snapshot-dir", getattr(args, "node_snapshot_dir", None))):
        if given and not getattr(args, "spawn_node", False):
            raise ValueError(f"{flag} goes with --spawn-node; a node you started takes luwu node serve "
                             f"--snapshot-dir DIR --snapshot-every K")
    if getattr(args, "node_snapshot_dir", None) and not args.node_snapshot_every:
        raise ValueError("--node-snapshot-dir goes with --node-snapshot-every K (how often the shards snapshot)")
    if getattr(args, "spawn_node", False):  # a local optimizer node around the whole run (node/spawn.py)
        if world_size > 1 or args.node:
            raise ValueError("--spawn-node starts the node itself: leave out --node, and use --nproc, not torchrun")
        from luwu_rt.node.spawn import spawned_node

        if args.node_shards < 1:
            raise ValueError(f"--node-shards {args.node_shards}: give a number of node processes >= 1")
        from luwu_rt.engine import TrainConfig

        # The run's --timeout (flag or --config), else TrainConfig's default: the node waits as long as the ranks.
        timeout_s = _settings(args).get("timeout_s", TrainConfig().timeout_s)
        with spawned_node(num_workers=args.nproc or 1, timeout_s=timeout_s, num_shards=args.node_shards,
                          log_file=args.node_log, snapshot_every=args.node_snapshot_every,
                          snapshot_dir=args.node_snapshot_dir) as address:
            args.spawn_node, args.node, args.strategy = False, address, args.strategy or "node"
            args.node_shards, args.node_log, args.node_snapshot_every, args.node_snapshot_dir = 1, None, 0, None
            return run(args)
    with _scratch_nvme_dir(args):
        if not (args.nproc is not None and args.nproc > 1 and world_size == 1):
            # From here on a signal asks to stop after a step instead of raising ([Note: interrupting a run]);
            # the launcher of --nproc keeps Python's handler and forwards Ctrl-C to the ranks.
            args.stop_request = StopRequest().install()
            try:
                test_hook("start", 1)
                return _run(args, world_size)
            finally:
                # In the `luwu` process itself (not a caller's process) signals stay ignored from here on.
                in_luwu = getattr(sys.modules.get("__main__"), "main", None) is _cli_main()
                args.stop_request.finish(ignore_signals=in_luwu)
        return _run(args, world_size)


RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
"""How many times the ranks were started again ([Note: restarting the ranks]); torchrun's name for it."""


def _restarting(args: argparse.Namespace, world_size: int) -> int:
    """[Note: restarting the ranks]
    ``--max-restarts N`` runs the launcher's ranks again when one fails: the
    launcher has already ended the others (a rank that loses a peer exits), so
    all of them start again, with ``--resume-if-exists`` on the run's
    ``--ckpt-dir``, and go on from its newest checkpoint, whose resume is exact
    (the JSON log drops the lines past it). A node that ``--spawn-node`` started
    is started afresh with them, and takes the checkpoint's optimizer state.
    Exit 2 (an error in what the user gave) and Ctrl-C (130) are not failures a
    restart cures. The ranks see the count in ``TORCHELASTIC_RESTART_COUNT``."""
    import copy

    most = args.max_restarts
    if most < 0:
        raise ValueError(f"--max-restarts {most}: give how many times to start the ranks again, >= 0")
    if world_size > 1 or not (args.nproc is not None and args.nproc > 1):
        raise ValueError("--max-restarts goes with --nproc N (N >= 2): the launcher starts the ranks again; under "
                         "torchrun give torchrun --max-restarts")
    if getattr(args, "node", None):
        raise ValueError("--max-restarts goes with --spawn-node under strategy node, not --node ADDR: a node you "
                         "started holds the run's later steps, which ranks started again from a checkpoint cannot "
                         "rejoin; restart that node on its --snapshot-dir instead")
    directory = _settings(args).get("checkpoint", {}).get("dir")  # the rest is checked as each attempt starts
    if not directory:
        raise ValueError("--max-restarts needs --ckpt-dir (and --ckpt-every N): the ranks start again from its "
                         "newest checkpoint")
    restart = 0
    while True:
        os.environ[RESTART_COUNT_ENV] = str(restart)
        attempt = copy.copy(args)
        attempt.max_restarts = 0
        attempt.resume_if_exists = args.resume_if_exists or restart > 0
        code = run(attempt)
        if code in (0, 2, 130) or restart == most:
            return code
        restart += 1
        print(f"luwu: the run failed (exit status {code}); starting its {args.nproc} ranks again from the newest "
              f"checkpoint in {directory} (restart {restart} of {most})", file=sys.stderr, flush=True)


def _cli_main():
    from luwu_rt.cli.main import main

    return main


def _run(args: argparse.Namespace, world_size: int) -> int:
    if world_size > 1:  # a rank of torchrun or of --nproc: take its share of the cores before anything heavy
        from luwu_rt.dist.launch import pin_cores

        pin_cores(int(os.environ.get("LOCAL_RANK") or 0), int(os.environ.get("LOCAL_WORLD_SIZE") or world_size))
    if args.nproc is not None or world_size > 1:
        from luwu_rt.cli.flags import config_argv
        from luwu_rt.config import from_mapping
        from luwu_rt.dist.launch import launch, run_rank
        from luwu_rt.engine import TrainConfig

        if args.nproc is not None and args.nproc < 1:
            raise ValueError(f"--nproc {args.nproc}: give a number of ranks >= 1")
        if args.nproc is not None and world_size > 1:
            raise ValueError("--nproc starts the ranks itself: leave it out under torchrun (WORLD_SIZE is set)")
        # The whole config is checked here, so that the launcher fails before it starts any rank.
        timeout = from_mapping(TrainConfig, _settings(args)).timeout_s
        if args.nproc is not None and args.nproc > 1:
            # The ranks get the flags that were given ('--flag=value', which a value starting with '-' survives).
            argv = config_argv(args)
            argv += [f"--{name.replace('_', '-')}" for name in ("resume_if_exists", "quiet") if getattr(args, name)]
            argv += [f"--stop-after={args.stop_after}"] if args.stop_after is not None else []
            argv += [f"--config={args.config}"] if args.config else []
            return launch([sys.executable, "-m", "luwu_rt", "train", *argv], args.nproc, timeout_s=timeout)
        if world_size > 1:
            built = []

            def train() -> int:
                engine = _built(args)
                if engine is None:
                    return 0
                built.append(engine)
                code = _train(engine, args)
                # Not in a finally: after a failed step the queue threads may be stuck in collectives, and
                # run_rank exits the process without waiting for them (after ``discard``, below).
                engine.close()
                return code

            def discard() -> None:  # a failed rank leaves no NVMe tier behind (its files are the run's size)
                for engine in built:
                    engine.store.discard()

            return run_rank(train, timeout_s=timeout, cleanup=discard)
    engine = _built(args)
    if engine is None:
        return 0
    if getattr(args, "scratch", None) is not None and engine.store.nvme is None:
        args.scratch.remove()  # the plan keeps nothing on NVMe: no empty directory in the way while it runs
    try:
        return _train(engine, args)
    finally:
        engine.close()  # joins the queue threads, also when a step failed or was interrupted


_LOGGED = ("step", "loss", "tokens_per_s", "step_s", "lr", "grad_norm", "skipped", "compute_s", "wait_s",
           "optim_s", "io_s", "wire_bytes", "encode_s", "decode_s", "updates")
"""Fields of a step's line in ``--json-log``; an evaluation adds a line ``{"step", "val_loss"}``. ``wire_bytes``:
what the rank sends per step by its collectives; ``encode_s``/``decode_s``: its time in gradient codecs;
``updates``: how a step of a double-buffered optimizer state ended (``commit``, ``redo``, ``skip`` or ``wait``:
[Note: when to speculate] in exec/speculate.py), else ``as planned``."""


def _stopping(engine, stop) -> bool:
    """Whether to stop before the next step: a signal reached this rank or, with several ranks, any
    rank, so that all of them stop after the same step ([Note: interrupting a run])."""
    if not engine.world.distributed:
        return stop.requested
    return engine.world.all_reduce([1.0 if stop.requested else 0.0], "max")[0] > 0


def _log_line(log, path: str, record: dict) -> None:
    try:
        log.write(json.dumps(record) + "\n")
        log.flush()
    except OSError as exc:  # a full disk names the file, not only the errno
        raise OSError(exc.errno, f"writing --json-log failed: {exc.strerror}", path) from None


def _train(engine, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from luwu_rt.dist import health

    from luwu_rt.interrupt import wrap_handlers

    c = engine.config
    first = engine.world.rank == 0  # metrics are global: only the first rank reports them
    _say(_describe(engine))
    if engine.store.nvme is not None and first:
        from luwu_rt.cli.dirs import disk_problem

        nvme_dir = c.offload.nvme_dir
        if problem := disk_problem(nvme_dir):  # the IO engine goes through the page cache there: say so
            _say(f"luwu: the NVMe tier at {nvme_dir} {problem}: its IO goes through the page cache instead of "
                 f"O_DIRECT; for a real disk run from a directory on one, or pass --nvme-dir DIR on one")
    if engine.weights_source:  # which of the model, a checkpoint folder or the seed the run starts from
        _say(f"first {engine.weights_source}")
    stop = getattr(args, "stop_request", None)
    stop_after = getattr(args, "stop_after", None)
    wrap_handlers(engine)
    saved = engine.step if c.checkpoint.resume else -1  # the step of this run's newest checkpoint
    if c.json_log and first and c.checkpoint.resume and engine.step > 0:
        from luwu_rt.cli.json_log import drop_lines_after

        if dropped := drop_lines_after(c.json_log, engine.step):
            _say(f"dropped {dropped} line(s) past step {engine.step} from --json-log: the steps after the checkpoint "
                 f"run again")
    try:
        log = open(c.json_log, "a") if c.json_log and first else None
    except OSError as exc:
        raise OSError(exc.errno, f"cannot open --json-log ({exc.strerror})", c.json_log) from None
    totals = {"step_s": 0.0, "compute_s": 0.0, "optim_s": 0.0, "io_s": 0.0, "wait_s": 0.0, "encode_s": 0.0,
              "decode_s": 0.0}
    ran, speed = 0, 0.0
    bar = tqdm(total=c.steps, initial=engine.step, disable=args.quiet or not first, unit="step", dynamic_ncols=True)
    try:
        while engine.step < c.steps:
            if stop is not None and _stopping(engine, stop):
                break
            if stop_after is not None and engine.step >= stop_after:  # every rank at the same step
                break
            m = engine.train_step()
            health.progress(engine.step)  # a failure report names the step a silent rank stopped at
            ran += 1
            for key in totals:
                totals[key] += m[key]
            bar.update(1)
            # Tokens/s of one step jumps with the machine's noise; the bar shows a moving average.
            speed = m["tokens_per_s"] if ran == 1 else 0.9 * speed + 0.1 * m["tokens_per_s"]
            bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{speed:.0f}")
            if log:
                _log_line(log, c.json_log, {k: m[k] for k in _LOGGED})
            if c.eval_every and engine.step % c.eval_every == 0:
                val = engine.evaluate()  # on every rank: a collective under sharded strategies
                if first:
                    bar.write(f"step {engine.step}: validation loss {val:.4f}")
                if log:
                    _log_line(log, c.json_log, {"step": engine.step, "val_loss": val})
            if c.checkpoint.dir and c.checkpoint.every and engine.step % c.checkpoint.every == 0:
                where = engine.save(c.checkpoint.dir)
                saved = engine.step
                if first:
                    bar.write(f"step {engine.step}: checkpoint saved to {where}", file=sys.stderr)
    finally:
        bar.close()
        if log:
            try:
                log.close()
            except OSError:
                pass  # the write that failed has raised already
        if getattr(args, "json_log_lock", None) is not None:
            args.json_log_lock.release()
    if c.checkpoint.dir and saved != engine.step and engine.step > 0:
        _say(f"step {engine.step}: checkpoint saved to {engine.save(c.checkpoint.dir)}")
    if stop is not None and stop.requested:
        if first:
            where = f"; --resume continues from step {engine.step}" if c.checkpoint.dir and engine.step else ""
            print(f"luwu: stopped after step {engine.step} of {c.steps}{where}", file=sys.stderr)
        return stop.exit_code
    if stop_after is not None and engine.step < c.steps and first:
        where = f"; --resume continues from step {engine.step}" if c.checkpoint.dir and engine.step else ""
        print(f"luwu: stopped after step {engine.step} of {c.steps} (--stop-after){where}", file=sys.stderr)
    if c.trace and engine.last_spans:
        from luwu_rt.exec import write_rank_traces

        every = engine.world.all_gather_object(engine.last_spans)  # one file, one process row per rank
        if first:
            # The optimizer's own processes (the node's queues): a row of their own each.
            write_rank_traces(every, c.trace, extra=engine.optimizer.trace_rows())
    if ran and first:
        avg = {k: v / ran for k, v in totals.items()}
        other = max(avg["step_s"] - avg["compute_s"] - avg["wait_s"], 0.0)
        print(f"step {engine.step}: loss {m['loss']:.4f}; per step {avg['step_s'] * 1e3:.1f} ms = compute "
              f"{avg['compute_s'] * 1e3:.1f} + waiting on IO/optimizer {avg['wait_s'] * 1e3:.1f} + other "
              f"{other * 1e3:.1f} ms (optimizer busy {avg['optim_s'] * 1e3:.1f} ms, "
              f"IO busy {avg['io_s'] * 1e3:.1f} ms, "
              f"overlapped)")
        if engine.strategy.compresses:
            print(f"gradients compressed: {m['wire_bytes'] / 1e6:.3g} MB sent per rank per step; encode "
                  f"{avg['encode_s'] * 1e3:.1f} ms, decode {avg['decode_s'] * 1e3:.1f} ms per step (overlapped)")
    return 0
