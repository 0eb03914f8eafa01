"""`luwu plan`: does a model fit on this box, where does each state live, and how fast is a step?

Plans one training step with the pure planner (no GPU, no IO) and prints the
placement, the peak bytes per tier, the bytes moved per step and the predicted
step time with its bottleneck; or the memory it would take to fit. Exit status 1
when the model does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

__all__ = ["add_arguments", "run"]

_TIER_CHOICES = ("device", "host", "nvme", "auto")


def _default_host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from luwu_rt.models.presets import PRESETS
    from luwu_rt.plan.spec import STRATEGIES

    parser.add_argument("--model", default="gpt-tiny", choices=list(PRESETS), metavar="PRESET",
                        help=f"built-in model preset ({', '.join(PRESETS)}); default gpt-tiny")
    parser.add_argument("--device-mem", default="16GiB", help="device memory budget, e.g. 80GiB (default 16GiB)")
    parser.add_argument("--host-mem", default=None, help="pinned host memory budget (default: this machine's RAM)")
    parser.add_argument("--nvme-dir", default=None, help="directory for the NVMe tier; its free space is the budget")
    parser.add_argument("--nvme-size", default=None,
                        help="NVMe budget instead of the free space of --nvme-dir (e.g. to plan for another box)")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--strategy", default=None, choices=STRATEGIES,
                        help="data-parallel strategy (default: local for one rank, ddp for more)")
    parser.add_argument("--group-size", type=int, default=0, help="hsdp: ranks per sharding group (default min(8, N))")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step (default 1)")
    parser.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default: the preset's maximum)")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches of --batch-size sequences per optimizer step (default 1)")
    for state in ("params", "optimizer", "grads"):
        parser.add_argument(f"--offload-{state}", default="auto", choices=_TIER_CHOICES,
                            help=f"home tier of the {state} (default auto: fastest placement that fits)")
    parser.add_argument("--chunk-size", default="64MiB", help="storage chunk size, a multiple of 4KiB (default 64MiB)")
    parser.add_argument("--profile", default=None, metavar="JSON",
                        help="hardware profile (bandwidths, FLOP/s) as written by `luwu bench`; default: built-in")
    parser.add_argument("--policy", default="belady", choices=("belady", "lru"), help="eviction policy (default belady)")
    parser.add_argument("--show-ops", type=int, default=0, metavar="N", help="also print the first N ops of the plan")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _nvme_budget(args: argparse.Namespace) -> int:
    from luwu_rt.plan.sizes import parse_size

    if args.nvme_size is not None:
        return parse_size(args.nvme_size)
    if args.nvme_dir is None:
        return 0  # no NVMe tier unless one is named
    path = Path(args.nvme_dir)
    if not path.is_dir():
        raise ValueError(f"--nvme-dir {path} is not a directory; create it or pass --nvme-size to plan without one")
    return shutil.disk_usage(path).free


def run(args: argparse.Namespace) -> int:
    from luwu_rt.models.presets import get_preset
    from luwu_rt.plan import (Budgets, DoesNotFit, HardwareProfile, Placement, Strategy, gpt_model_spec,
                              parse_size, plan_auto, validate)

    shape = get_preset(args.model)
    model = gpt_model_spec(shape, batch_size=args.batch_size, seq_len=args.seq_len, num_micro_batches=args.grad_accum,
                           chunk_bytes=parse_size(args.chunk_size))
    budgets = Budgets(device_bytes=parse_size(args.device_mem),
                      host_bytes=parse_size(args.host_mem) if args.host_mem else _default_host_bytes(),
                      nvme_bytes=_nvme_budget(args))
    strategy = Strategy(name=args.strategy or ("local" if args.world_size == 1 else "ddp"),
                        world_size=args.world_size, group_size=args.group_size)
    placement = Placement(params=args.offload_params, optimizer=args.offload_optimizer, grads=args.offload_grads)
    profile = HardwareProfile.from_json(args.profile) if args.profile else HardwareProfile()
    head = {"model": shape.name, "params": model.num_params, "strategy": strategy.name,
            "world_size": strategy.world_size, "tokens_per_step": model.tokens_per_step,
            "budgets": {"device": budgets.device_bytes, "host": budgets.host_bytes, "nvme": budgets.nvme_bytes}}
    try:
        result = plan_auto(model, budgets=budgets, placement=placement, strategy=strategy, profile=profile,
                           policy=args.policy)
    except DoesNotFit as exc:
        reason = str(exc)
        if not budgets.nvme_bytes and "nvme_bytes" in exc.needs:
            reason += " (pass --nvme-dir to plan with an NVMe tier)"
        report = {**head, "fits": False, "reason": reason, "needs": exc.needs}
        print(json.dumps(report, indent=2) if args.json else f"{_title(head)}\n{reason}")
        return 1
    validate(result.plan)  # never report a plan that breaks an invariant
    report = {**head, "fits": True, **_describe(result)}
    print(json.dumps(report, indent=2) if args.json else _text(head, report))
    if args.show_ops and not args.json:
        from luwu_rt.plan import format_ops

        print(f"\nfirst {min(args.show_ops, len(result.plan.ops))} ops (slot = byte offset in the tier's arena):")
        print(format_ops(result.plan, stop=args.show_ops))
    return 0


def _describe(result) -> dict:
    plan, cost = result.plan, result.cost
    state_bytes: dict[str, int] = {}
    for shard, info in plan.shards.items():
        state_bytes[shard.state] = state_bytes.get(shard.state, 0) + info.nbytes
    return {
        "placement": {"params": result.placement.params, "optimizer": result.placement.optimizer,
                      "grads": result.placement.grads},
        "states": {s: {"tier": plan.homes[s], "bytes": b} for s, b in state_bytes.items()},
        "peak_bytes": dict(plan.peak_bytes),
        "io_bytes_per_step": {t: dict(v) for t, v in cost.io_bytes.items()},
        "predicted_step_s": cost.predicted_step_s,
        "bottleneck": cost.bottleneck,
        "busy_s": dict(cost.busy_s),
        "num_ops": len(plan.ops),
        "policy": plan.policy,
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
    return (f"{head['model']}: {_count(head['params'])} params, strategy {head['strategy']}{world}, "
            f"{head['tokens_per_step']} tokens/step; budgets device {format_size(budgets['device'])}, "
            f"host {format_size(budgets['host'])}, nvme {nvme}")


def _text(head: dict, r: dict) -> str:
    from luwu_rt.plan import format_size

    lines = [_title(head), "", "state        per rank    home"]
    for state, info in r["states"].items():
        transient = "  (each unit's grads are freed after its update)" if state == "grad" else ""
        lines.append(f"{state:<12} {format_size(info['bytes']):>10}  {info['tier']}{transient}")
    lines.append("")
    lines.append("tier      peak bytes   read/step   write/step")
    for tier, peak in r["peak_bytes"].items():
        io = r["io_bytes_per_step"][tier]
        lines.append(f"{tier:<8} {format_size(peak):>11} {format_size(io['read']):>11} {format_size(io['write']):>12}")
    lines.append("")
    busy = ", ".join(f"{q} {s:.3g}s" for q, s in sorted(r["busy_s"].items(), key=lambda kv: -kv[1]))
    lines.append(f"predicted step time {r['predicted_step_s']:.3g} s, bottleneck {r['bottleneck']} (busy: {busy})")
    lines.append(f"{r['num_ops']} ops, eviction {r['policy']}")
    return "\n".join(lines)

