"""`luwu plan`: does a model fit on this box, where does each state live, and how fast is a step?

Plans one training step with the pure planner (no GPU, no IO) and prints the
placement, the peak bytes per tier, the bytes moved per step and the predicted
step time with its bottleneck; or the memory it would take to fit. Exit status 1
when the model does not fit. For ``--strategy node`` it also plans the optimizer
node's side and simulates both together. ``--simulate`` runs the plan in virtual
time (``luwu_rt.testing.simulate``) and prints where each queue waited and the
critical path; ``--chaos-seed`` and ``--trace`` go with it.

It takes the flags of ``luwu train`` that a plan depends on, from the same table ([Note: one flag table] in
flags.py), builds the same ``TrainConfig`` and plans with the engine's own ``ModelSpec``: it answers for the
run ``luwu train`` makes with those flags. ``--world-size`` and the budgets' overrides are its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

__all__ = ["add_arguments", "run"]

_NODE_TIER_CHOICES = ("host", "nvme", "auto")
_NODE_FLAGS = ("node_shards", "node_host_mem", "node_nvme_size", "node_offload_params", "node_offload_optimizer",
               "node_offload_grads")
_SHOW_OPS_HELP = (
    "also print N ops of the plan, in plan order (one valid execution order), from --ops-from: index, predicted "
    "start and end (µs from the step's start, ms for steps over a second; by the cost model), kind, queue, "
    "reads -> writes, deps. With prefetch an op may start before ops listed above it end: a load or "
    "all-gather that starts before the compute listed above it ends is marked 'prefetch' (e.g. --strategy "
    "zero3 --world-size 8 --show-ops 40 shows the gathers of B(k-1) starting during B(k))")
# What `luwu plan` adds to the help of a flag it shares with `luwu train`.
_NOTES = {
    "host_mem": "'all': this machine's RAM",
    "seq_len": "0: the model's maximum",
    "nvme_dir": "it need not exist yet: the free space of its disk is the NVMe budget (without --nvme-dir: the "
                "current directory's disk, where luwu train makes its scratch directory)",
    "strategy": "luwu plan also plans any strategy for --world-size ranks",
    "profile": "the file's keys: {keys} (GB/s, seconds, per second, FLOP/s; missing keys keep the built-in "
               "defaults, keys starting with _ are notes); `luwu bench io --dir DIR --profile-out FILE` writes the "
               "NVMe keys of DIR's disk into FILE",
}
_PLANNED_NODE = "tcp://planned-only:0"
"""The optimizer node's address in the config ``luwu plan`` builds for strategy node: ``TrainConfig`` wants the
address a run connects to; a plan connects to nothing."""


def _default_host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from luwu_rt.cli.flags import add_config_flags

    # The flags of luwu train that a plan depends on, from the same table ([Note: one flag table] in flags.py):
    # the same defaults, the same choices, and luwu plan plans the run luwu train makes with them.
    add_config_flags(parser, plans_only=True, notes={**_NOTES, "profile": _profile_note()})
    parser.add_argument("--nvme-size", default=None,
                        help="NVMe budget instead of the free space of --nvme-dir (e.g. to plan for another box; 0: "
                             "no NVMe tier)")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    node = parser.add_argument_group("optimizer node (--strategy node)")
    node.add_argument("--node-shards", type=int, default=None, metavar="K",
                      help="optimizer node processes that split the chunks, each with its own NIC and budgets "
                           "(default 1)")
    node.add_argument("--node-host-mem", default=None,
                      help="host memory of each node process (default: this machine's RAM)")
    node.add_argument("--node-nvme-size", default=None, help="NVMe space of each node process (default: none)")
    for state in ("params", "optimizer", "grads"):
        node.add_argument(f"--node-offload-{state}", default=None, choices=_NODE_TIER_CHOICES,
                          help=f"home tier of the node's {state} (default auto: fastest that fits)")
    parser.add_argument("--policy", default="belady", metavar="belady|lru|MODULE:CLASS",
                        help="eviction and prefetch policy: a built-in, or a luwu_rt.plan.Policy subclass of your own "
                             "(imported from MODULE, made with no arguments) (default belady)")
    parser.add_argument("--show-ops", type=int, default=0, metavar="N", help=_SHOW_OPS_HELP)
    parser.add_argument("--ops-from", default="0", metavar="I|backward",
                        help="first op --show-ops prints: an op index, or 'backward' for the ops after the last "
                             "forward compute (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    sim = parser.add_argument_group("simulation (luwu_rt.testing.simulate: the plan run in virtual time)")
    sim.add_argument("--simulate", action="store_true",
                     help="also run the plan on simulated tiers (the profile's bandwidths, the plan's budgets; no "
                          "torch, no IO) and print work and stalls by queue, peak and moved bytes per tier and the "
                          "critical path; a race between ops fails it, naming both")
    sim.add_argument("--chaos-seed", type=int, default=None, metavar="S",
                     help="with --simulate: random delays around every op and one op held back (seed S), which "
                          "exposes a missing dependency; every rank of --world-size is simulated; the step time "
                          "under chaos is no prediction")
    sim.add_argument("--trace", default=None, metavar="FILE",
                     help="with --simulate: write the simulated timeline as Chrome trace JSON, the format of "
                          "`luwu train --trace` (Perfetto, chrome://tracing)")


def _profile_note() -> str:
    from dataclasses import fields

    from luwu_rt.plan.spec import HardwareProfile

    return _NOTES["profile"].format(keys=", ".join(f.name for f in fields(HardwareProfile)))


def _budgets(args: argparse.Namespace, config, *, device_type: str):
    """The budgets ``luwu train`` would plan with: "auto" resolved as the engine resolves it ([Note:
    automatic budgets] in engine/budgets.py), for --world-size ranks on this machine."""
    from luwu_rt.engine.budgets import DEMO_MODEL, resolve_budgets
    from luwu_rt.plan import Budgets

    off = config.offload
    device, host = resolve_budgets(off.device_mem_bytes, off.host_mem_bytes, demo=config.model == DEMO_MODEL,
                                   device_type=device_type, local_ranks=args.world_size)
    return Budgets(device_bytes=device, host_bytes=host, nvme_bytes=_nvme_budget(args, off.nvme_dir))


def _nvme_budget(args: argparse.Namespace, nvme_dir: str | None) -> int:
    from luwu_rt.cli.dirs import free_bytes
    from luwu_rt.plan.sizes import parse_size

    if args.nvme_size is not None:
        return parse_size(args.nvme_size)
    # No --nvme-dir: luwu train makes a scratch directory in the current directory; plan with its disk.
    path = Path(nvme_dir if nvme_dir is not None else os.curdir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--nvme-dir {path} is a file, not a directory; give a directory, or --nvme-size to plan "
                         f"without one")
    # A missing directory is one `luwu train --nvme-dir` creates: plan with the free space of the disk it
    # will be created on, as train will ([Note: missing directories] in dirs.py).
    return free_bytes(path)


def _nvme_where(args: argparse.Namespace, nvme_dir: str | None) -> str | None:
    """Where the planned NVMe tier would live, as the title says it."""
    if args.nvme_size is not None:
        return None
    from luwu_rt.cli.dirs import SCRATCH_PREFIX

    return nvme_dir if nvme_dir is not None else f"./{SCRATCH_PREFIX}* (luwu train's scratch)"


def _strategy(args: argparse.Namespace, config):
    """The strategy (or, for auto, the candidates) of ``config`` on ``--world-size`` ranks; unlike a run,
    a plan may name any strategy for any number of ranks."""
    from luwu_rt.plan import Strategy

    name = "local" if config.strategy == "auto" and args.world_size == 1 else config.strategy
    if config.shard_group_size and name not in ("hsdp", "auto"):
        raise ValueError(f"--shard-group-size applies to --strategy hsdp only, not {name}")
    given = [f"--{f.replace('_', '-')}" for f in _NODE_FLAGS if getattr(args, f) is not None]
    if given and name != "node":
        raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --strategy node only, "
                         f"not {name}")
    if name == "auto":
        from luwu_rt.engine.strategy import candidate_strategies

        return candidate_strategies("auto", world_size=args.world_size, shard_group_size=config.shard_group_size,
                                    compress=config.compress)
    return Strategy(name=name, world_size=args.world_size, group_size=config.shard_group_size)


def _train_config(args: argparse.Namespace):
    """The ``TrainConfig`` that ``luwu train`` builds from the same flags, and the model's chain (built on
    meta): plan's own readings of two flags (``--host-mem all``, ``--seq-len 0``) applied first."""
    from luwu_rt.cli.flags import config_overrides
    from luwu_rt.config import from_mapping
    from luwu_rt.engine import TrainConfig
    from luwu_rt.models.adapt import as_unit_chain

    settings = config_overrides(args)
    offload = settings.get("offload", {})
    if offload.get("host_mem_bytes") == "all":
        offload["host_mem_bytes"] = _default_host_bytes()
    if settings.get("strategy") == "node":
        settings["node"] = _PLANNED_NODE
    chain = as_unit_chain(settings.get("model", TrainConfig().model))
    most = _max_seq_len(chain)
    if settings.get("seq_len") == 0:
        if most is None:
            raise ValueError(f"--seq-len 0: the maximum sequence length of {settings['model']} is not known; "
                             f"give --seq-len")
        settings["seq_len"] = most
    config = from_mapping(TrainConfig, settings)
    if most is not None and config.seq_len > most:
        raise ValueError(f"--seq-len {config.seq_len}: {config.model} takes at most {most} tokens per sequence")
    return config, chain


def _max_seq_len(chain) -> int | None:
    """The most tokens per sequence the model takes (a preset's, or a Hugging Face config's positions)."""
    shape = getattr(chain, "shape", None)
    if shape is not None:
        return shape.max_seq_len
    hf = getattr(getattr(chain, "model", None), "config", None)
    for key in ("n_positions", "max_position_embeddings"):
        if isinstance(getattr(hf, key, None), int):
            return getattr(hf, key)
    return None


def run(args: argparse.Namespace) -> int:
    import torch

    from luwu_rt.engine.kept import fewest_kept, plan_kept
    from luwu_rt.plan import DoesNotFit, Placement, estimate, plan_auto, validate

    for flag, value in (("--chaos-seed", args.chaos_seed), ("--trace", args.trace)):
        if value is not None and not args.simulate:
            raise ValueError(f"{flag} applies to the simulated run: add --simulate")
    policy = _policy(args.policy)
    config, chain = _train_config(args)
    off = config.offload
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    budgets = _budgets(args, config, device_type=device_type)
    strategy = _strategy(args, config)
    candidates = strategy if isinstance(strategy, list) else [strategy]
    placement = Placement(params=off.params, optimizer=off.optimizer, grads=off.grads)
    from luwu_rt.engine.hwprofile import choose_profile, per_rank

    # Chosen as the engine chooses ([Note: which profile]); the --world-size ranks share this machine, as the
    # budgets take them to.
    choice = choose_profile(config.profile)
    profile = per_rank(choice, local_ranks=args.world_size)
    asked = []  # the ModelSpecs put to the planner, in order

    def plan(model, explain: bool):
        asked.append(model)
        if len(candidates) > 1:  # auto: the strategy luwu train would pick
            from luwu_rt.engine.strategy import choose_plan

            return choose_plan(model, strategies=candidates, budgets=budgets, placement=placement, profile=profile,
                               compress=config.compress, explain=explain)
        from luwu_rt.plan.compression import resolve_compression

        strategy = resolve_compression(model, candidates[0], config.compress, profile=profile)
        return strategy, plan_auto(model, budgets=budgets, placement=placement, strategy=strategy, profile=profile,
                                   policy=policy, explain=explain)

    def header(model, strategy, kept: int) -> dict:
        # "runnable" stays in the JSON for its readers: luwu train runs every strategy the planner plans.
        return {"model": config.model, "params": model.num_params, "strategy": strategy.name,
                "world_size": strategy.world_size, "tokens_per_step": model.tokens_per_step,
                "activation_bytes": model.activation_bytes,
                "kept_graphs": {"count": kept, "of": chain.num_units - 1, "request": config.keep_graphs},
                "budgets": {"device": budgets.device_bytes, "host": budgets.host_bytes, "nvme": budgets.nvme_bytes},
                "nvme_dir": _nvme_where(args, off.nvme_dir),
                "profile": {"source": choice.source, "path": choice.path, "described": choice.describe()},
                "runnable": True}

    kept = None
    try:
        kept = plan_kept(chain, config, world_size=args.world_size, plan=plan)
        model, strategy, result = kept.model, kept.strategy, kept.result
        head = header(model, strategy, len(kept.units))
        node = _plan_node(args, model, strategy, profile, policy) if strategy.name == "node" else None
    except DoesNotFit as exc:
        if kept is None:  # refused with the fewest graphs the request allows: the last ModelSpec planned
            head = header(asked[-1], candidates[0], len(fewest_kept(config.keep_graphs, num_units=chain.num_units)))
        reason = str(exc)
        if not budgets.nvme_bytes and "nvme_bytes" in exc.needs:
            reason += " (pass --nvme-dir DIR or --nvme-size to plan with an NVMe tier)"
        if "node_nvme_bytes" in exc.needs and args.node_nvme_size is None:
            reason += " (pass --node-nvme-size to give the node an NVMe tier)"
        report = {**head, "fits": False, "reason": reason, "needs": exc.needs}
        print(json.dumps(report, indent=2) if args.json else f"{_title(head)}\n{reason}")
        return 1
    validate(result.plan)  # never report a plan that breaks an invariant
    node_plan = None if node is None else node.plan
    from luwu_rt.engine.strategy import double_buffered_or_why, warmup_steps

    warmup = warmup_steps(config.compress_warmup, strategy)  # a run with a warm-up has no double-buffered state
    made = double_buffered_or_why(model, warmup=warmup, budgets=budgets, placement=result.placement,
                                  strategy=strategy, policy=policy)
    halves = made if isinstance(made, dict) else None
    if halves is not None:  # the plan luwu train runs: updates speculate ([Note: speculative updates])
        result = dataclasses.replace(result, plan=halves["speculate"][0])
        validate(result.plan)
    # A step in steady state, beside the previous one's tail, as luwu train runs them ([Note: steady state]).
    cost = estimate(result.plan, profile, node=node_plan, steady=node_plan is None)
    report = {**head, "fits": True, **_describe(result, cost), "updates": _updates(model, halves)}
    if made and isinstance(made, str):  # why the updates wait for the norm
        report["updates_wait_because"] = made
    if halves is not None:
        report["predicted_by_updates"] = _by_updates(halves, profile, committed=cost.predicted_step_s)
    if config.compress != "none":  # each unit's codec, and what it saves ([Note: selective compression])
        from luwu_rt.cli.plan_compress import describe_compression

        report["compression"] = describe_compression(model, result, request=config.compress, profile=profile,
                                                     budgets=budgets, placement=placement, policy=args.policy,
                                                     warmup=warmup)
    if node is not None:
        validate(node.plan)
        report["node"] = _describe_node(node, cost, model=model, num_shards=args.node_shards or 1)
    sim = _simulate(args, result.plan, profile, node=node_plan) if args.simulate else None
    if sim is not None:
        report["simulated"] = _describe_simulation(sim)
    print(json.dumps(report, indent=2) if args.json else _text(head, report))
    if args.show_ops and not args.json:
        print(_show_ops(result.plan, profile, node=node_plan, count=args.show_ops, origin=args.ops_from))
    if sim is not None and not args.json:
        print("\n" + sim.summary())
    return 0


def _policy(value: str):
    """``--policy``: a built-in's name, or ``MODULE:CLASS`` naming a ``Policy`` subclass to import."""
    import importlib

    from luwu_rt.plan import POLICIES, Policy

    if value in POLICIES:
        return value
    module, _, name = value.partition(":")
    if not module or not name:
        raise ValueError(f"--policy {value!r}: give one of {', '.join(POLICIES)}, or MODULE:CLASS of a "
                         f"luwu_rt.plan.Policy of your own")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--policy {value}: cannot import {name} from {module} ({exc}); is {module} on PYTHONPATH?") \
            from None
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"--policy {value}: {name} is not a subclass of luwu_rt.plan.Policy")
    return cls()


def _simulate(args: argparse.Namespace, plan, profile, *, node):
    """The plan run in virtual time ([Note: simulating ranks] in testing/simulate.py): one rank with symmetric
    peers, or under chaos every rank of the world, so that collectives wait for the slowest."""
    from luwu_rt.testing import simulate

    world = plan.strategy.world_size
    ranks = [plan] * world if args.chaos_seed is not None and node is None and world > 1 else plan
    sim = simulate(ranks, profile, chaos_seed=args.chaos_seed, node=node)
    if args.trace:
        sim.write_trace(args.trace)
    return sim


def _describe_simulation(sim) -> dict:
    return {
        "step_s": sim.step_s,
        "ranks_simulated": len(sim.ranks),
        "chaos_seed": sim.chaos_seed,
        "busy_s": dict(sim.busy_s),
        "stall_s": dict(sim.stall_s),
        "peak_bytes": dict(sim.peak_bytes),
        "moved_bytes": {t: dict(v) for t, v in sim.moved_bytes.items()},
        "critical_path_ops": len(sim.critical_path),
    }


def _plan_node(args: argparse.Namespace, model, strategy, profile, policy):
    from luwu_rt.plan import Budgets, Placement, parse_size, plan_node_auto

    shards = args.node_shards if args.node_shards is not None else 1
    if shards < 1:
        raise ValueError(f"--node-shards must be at least 1, got {shards}")
    budgets = Budgets(device_bytes=0,
                      host_bytes=parse_size(args.node_host_mem) if args.node_host_mem else _default_host_bytes(),
                      nvme_bytes=parse_size(args.node_nvme_size) if args.node_nvme_size else 0)
    placement = Placement(params=args.node_offload_params or "auto", optimizer=args.node_offload_optimizer or "auto",
                          grads=args.node_offload_grads or "auto")
    return plan_node_auto(model, budgets=budgets, placement=placement, num_workers=strategy.world_size,
                          num_shards=shards, profile=profile, policy=policy)


def _states(plan) -> dict:
    """Each state kind's bytes on this process and its home (workspaces are not state)."""
    from luwu_rt.plan.analysis import state_bytes

    return {s: {"tier": plan.homes[s], "bytes": b} for s, b in state_bytes(plan).items()}


def _updates(model, halves) -> str:
    """When each unit's update runs: what the run's clipping and the optimizer state's home allow."""
    if halves is not None:
        return "speculative: as gradients are final, into the other half of the optimizer state on NVMe"
    if model.optimizer_waits_for_backward:
        return "after the step's gradient norm (exact clipping or fp16)"
    return "as gradients are final"


def _by_updates(halves, profile, *, committed: float) -> dict[str, float]:
    """The predicted step by how it ends ([Note: when to speculate] in exec/speculate.py), as ``luwu train
    --json-log`` names it: ``commit`` is the plan's step; ``wait`` its waiting plan in steady state; a ``skip``
    runs the speculative plan and the restore, and a ``redo`` the waiting plan after both (the extra runs
    priced one after the other, without a pipeline)."""
    from luwu_rt.plan import estimate, validate

    for name in ("wait", "restore"):  # priced here, so checked here: every plan through the validator
        validate(halves[name][0])
    wait = estimate(halves["wait"][0], profile, steady=True).predicted_step_s
    restore = estimate(halves["restore"][0], profile).predicted_step_s
    cold_wait = estimate(halves["wait"][0], profile).predicted_step_s
    return {"commit": committed, "wait": wait, "skip": committed + restore, "redo": committed + restore + cold_wait}


def _placement(p) -> dict:
    return {"params": p.params, "optimizer": p.optimizer, "grads": p.grads}


def _describe(result, cost) -> dict:
    plan = result.plan
    return {
        "placement": _placement(result.placement),
        "states": _states(plan),
        "peak_bytes": dict(plan.peak_bytes),
        "io_bytes_per_step": {t: dict(v) for t, v in cost.io_bytes.items()},
        "predicted_step_s": cost.predicted_step_s,
        "bottleneck": cost.bottleneck,
        "busy_s": dict(cost.busy_s),
        "num_ops": len(plan.ops),
        "policy": plan.policy,
    }


def _describe_node(node, cost, *, model, num_shards: int) -> dict:
    from luwu_rt.plan import push_order

    plan = node.plan
    return {
        "num_shards": num_shards,
        "num_workers": plan.strategy.world_size,
        "budgets": {"host": plan.budgets.host_bytes, "nvme": plan.budgets.nvme_bytes},
        "placement": _placement(node.placement),
        "states": _states(plan),
        "peak_bytes": {t: plan.peak_bytes[t] for t in ("host", "nvme")},
        "io_bytes_per_step": {t: dict(v) for t, v in cost.node_io_bytes.items() if t != "device"},
        "busy_s": dict(cost.node_busy_s),
        "step_s": cost.node_step_s,
        "num_ops": len(plan.ops),
        "serve_order": list(push_order(model)),
    }


def _count(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _title(head: dict) -> str:
    from luwu_rt.plan import format_size

    world = f" x{head['world_size']}" if head["world_size"] > 1 else ""
    budgets = head["budgets"]
    nvme = format_size(budgets["nvme"]) if budgets["nvme"] else "none"
    if budgets["nvme"] and head.get("nvme_dir"):
        nvme += f" at {head['nvme_dir']}"
    return (f"{head['model']}: {_count(head['params'])} params, strategy {head['strategy']}{world}, "
            f"{head['tokens_per_step']} tokens/step; budgets device {format_size(budgets['device'])}, "
            f"host {format_size(budgets['host'])}, nvme {nvme}; {head['profile']['described']}")


def _tables(r: dict, *, who: str, tiers: tuple[str, ...]) -> list[str]:
    """The per-state and per-tier tables of one process (a worker rank or a node)."""
    from luwu_rt.plan import format_size

    lines = [f"state        {who:>8}    home"]
    for state, info in r["states"].items():
        transient = "  (each unit's grads are freed after its update)" if state == "grad" else ""
        lines.append(f"{state:<12} {format_size(info['bytes']):>10}  {info['tier']}{transient}")
    lines += ["", "tier      peak bytes   read/step   write/step"]
    for tier in tiers:
        io = r["io_bytes_per_step"][tier]
        lines.append(f"{tier:<8} {format_size(r['peak_bytes'][tier]):>11} {format_size(io['read']):>11} "
                     f"{format_size(io['write']):>12}")
    return lines


def _busy(busy: dict) -> str:
    return ", ".join(f"{q} {s:.3g}s" for q, s in sorted(busy.items(), key=lambda kv: -kv[1]))


def _text(head: dict, r: dict) -> str:
    from luwu_rt.plan import format_size

    lines = [_title(head), ""] + _tables(r, who="per rank", tiers=tuple(r["peak_bytes"]))
    lines.append("")
    lines.append(f"predicted step time {r['predicted_step_s']:.3g} s, bottleneck {r['bottleneck']} "
                 f"(busy: {_busy(r['busy_s'])})")
    lines.append(f"updates: {r['updates']}" + (f": {r['updates_wait_because']}" if "updates_wait_because" in r else ""))
    if by := r.get("predicted_by_updates"):  # clipping persists from step to step: such steps wait
        lines.append(f"  a step that waits for the norm {by['wait']:.3g} s; one redone {by['redo']:.3g} s")
    lines.append(f"{r['num_ops']} ops, eviction {r['policy']}; device reserve for activations "
                 f"{format_size(head['activation_bytes'])} (in the device peak)")
    lines.append(_kept_text(head["kept_graphs"]))
    if "compression" in r:
        from luwu_rt.cli.plan_compress import compression_text

        lines += [""] + compression_text(r["compression"], r["predicted_step_s"])
    if "node" in r:
        lines += [""] + _node_text(r["node"])
    return "\n".join(lines)


def _kept_text(kept: dict) -> str:
    """Which units keep their forward graph, and why: the request, or under auto what fitted."""
    why = " (--keep-graphs auto: the most that fit the device budget)" if kept["request"] == "auto" else ""
    rest = "; the others recompute theirs in backward" if kept["count"] < kept["of"] else ""
    return (f"kept graphs: {kept['count']} of {kept['of']} units keep their forward graph until backward{why}"
            f"{rest} (the last unit runs once)")


def _node_text(n: dict) -> list[str]:
    from luwu_rt.plan import format_size

    nvme = format_size(n["budgets"]["nvme"]) if n["budgets"]["nvme"] else "none"
    procs = f"{n['num_shards']} processes, each" if n["num_shards"] > 1 else "1 process"
    lines = [f"optimizer node: {procs} serving {n['num_workers']} workers; budgets host "
             f"{format_size(n['budgets']['host'])}, nvme {nvme}", ""]
    lines += _tables(n, who="per node", tiers=("host", "nvme"))
    order = n["serve_order"]
    lines += ["", f"node step {n['step_s']:.3g} s (busy: {_busy(n['busy_s'])}); units received, updated and served "
                  f"in the order workers push them: unit {order[0]} first, unit {order[-1]} last",
              f"{n['num_ops']} node ops"]
    return lines


def _show_ops(plan, profile, *, node, count: int, origin: str) -> str:
    """``count`` ops from ``origin`` with predicted times; prefetched loads and gathers marked."""
    from luwu_rt.plan import Compute, Gather, Load, format_ops, op_times

    first = _first_op(plan, origin)
    stop = min(first + count, len(plan.ops))
    times = op_times(plan, profile, node=node)
    # format_ops prints seconds as ms with three decimals; a step shorter than a second reads better
    # in µs (a small model's ops take microseconds), so its times go in scaled by 1e-3.
    fast = max((end for _, end in times), default=0.0) < 1.0
    unit, scale = ("µs", 1e3) if fast else ("ms", 1.0)
    lines = format_ops(plan, start=first, stop=stop, times=[(a * scale, b * scale) for a, b in times]).splitlines()
    last_compute = None
    for i in range(stop):
        op = plan.ops[i]
        if i >= first and isinstance(op, (Gather, Load)) and last_compute is not None \
                and times[i][0] < times[last_compute][1]:
            lines[i - first] += f"  <- prefetch: starts before {plan.ops[last_compute].name} ends"
        if isinstance(op, Compute):
            last_compute = i
    where = f"first {stop - first}" if first == 0 else f"{stop - first}"
    span = "" if first == 0 else f" from op {first} of {len(plan.ops)}"
    return (f"\n{where} ops{span} (slot = byte offset in the tier's arena; times: predicted start and end, "
            f"{unit} from the step's start):\n" + "\n".join(lines))


def _first_op(plan, origin: str) -> int:
    from luwu_rt.plan import Compute

    if origin == "backward":
        computes = [(i, op.name) for i, op in enumerate(plan.ops) if isinstance(op, Compute)]
        first_b = next((i for i, name in computes if name.startswith("B")), None)
        if first_b is None:
            raise ValueError("--ops-from backward: this plan has no backward")
        return max((i + 1 for i, name in computes if name.startswith("F") and i < first_b), default=0)
    if not origin.isdigit():
        raise ValueError(f"--ops-from {origin!r}: give an op index or 'backward'")
    if int(origin) >= len(plan.ops):
        raise ValueError(f"--ops-from {origin}: the plan has {len(plan.ops)} ops")
    return int(origin)
