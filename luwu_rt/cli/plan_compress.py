"""What ``luwu plan`` says about gradient compression: each unit's codec, its bytes and time against
uncompressed ([Note: selective compression] in plan/compression.py), and the whole step both ways."""

from __future__ import annotations

from typing import Any

__all__ = ["compression_text", "describe_compression"]


def describe_compression(model, result, *, request: str, profile, budgets, placement, policy: str,
                         warmup: int = 0) -> dict[str, Any]:
    """The ``compression`` part of ``luwu plan``'s report for the plan of ``result`` (``--compress request``):
    per unit, and the step predicted with the uncompressed plan of the same strategy and placement; with
    ``warmup`` (``--compress-warmup``) also the step its first ``warmup`` steps run, as the engine plans it."""
    from dataclasses import replace

    from luwu_rt.plan import estimate, plan_step, validate
    from luwu_rt.plan.analysis import wire_bytes
    from luwu_rt.plan.compression import unit_choices

    strategy = result.plan.strategy
    units = [{"unit": c.unit, "name": model.units[c.unit].name, "codec": c.codec, "raw_bytes": c.raw_bytes,
              "wire_bytes": c.wire_bytes, "raw_s": c.raw_s, "sync_s": c.sync_s}
             for c in unit_choices(model, strategy, profile)] if strategy.name in ("ddp", "zero1", "zero2") else []
    if strategy.name == "node":  # pushes: their bytes from the plan ([Note: compressed pushes] in plan/codec.py)
        units = [{"unit": op.unit, "name": model.units[op.unit].name, "codec": strategy.codec(op.unit),
                  "raw_bytes": 4 * model.units[op.unit].num_params, "wire_bytes": op.comm_bytes, "raw_s": None,
                  "sync_s": None} for op in sorted((o for o in result.plan.ops if o.kind == "Push"),
                                                   key=lambda o: o.unit)]
    plain = plan_step(model, budgets=budgets, placement=result.placement, strategy=replace(strategy, compress=()),
                      policy=policy)
    plain_s = estimate(plain, profile).predicted_step_s
    report = {"request": request, "units": units, "wire_bytes_per_step": wire_bytes(result.plan),
              "uncompressed_wire_bytes_per_step": wire_bytes(plain), "uncompressed_step_s": plain_s,
              "saved_s": plain_s - result.cost.predicted_step_s}
    if warmup:  # the engine's warm-up plan: over the same store, the codec's shards laid out and untouched
        warm = plan_step(replace(model, uncompressed=True), budgets=budgets, placement=result.placement,
                         strategy=strategy, policy=policy)
        validate(warm)  # never report a plan that breaks an invariant
        report["warmup"] = {"steps": warmup, "wire_bytes_per_step": wire_bytes(warm),
                            "step_s": estimate(warm, profile, steady=True).predicted_step_s}
    return report


def compression_text(c: dict[str, Any], predicted_s: float) -> list[str]:
    from luwu_rt.plan import format_size

    lines = [f"gradient compression (--compress {c['request']}): per unit, bytes sent per rank per step and "
             f"synchronisation time (encode + transfer + decode) against uncompressed"]
    if not c["units"]:
        return lines + ["  none: this strategy runs no compressible gradient collective"]
    lines.append(f"  {'unit':<10} {'codec':<12} {'raw':>10} {'sent':>10} {'raw s':>10} {'with codec s':>13}")
    for u in c["units"]:
        times = f"{u['raw_s']:>10.3g} {u['sync_s']:>13.3g}" if u["raw_s"] is not None else f"{'-':>10} {'-':>13}"
        lines.append(f"  {u['name']:<10} {u['codec']:<12} {format_size(u['raw_bytes']):>10} "
                     f"{format_size(u['wire_bytes']):>10} {times}")
    saved = c["uncompressed_wire_bytes_per_step"] - c["wire_bytes_per_step"]
    lines.append(f"  step: {format_size(c['wire_bytes_per_step'])} sent per rank instead of "
                 f"{format_size(c['uncompressed_wire_bytes_per_step'])} ({format_size(max(saved, 0))} saved); "
                 f"predicted {predicted_s:.3g} s instead of {c['uncompressed_step_s']:.3g} s "
                 f"({c['saved_s']:+.3g} s saved)")
    if "warmup" in c:
        w = c["warmup"]
        lines.append(f"  steps 1..{w['steps']} (--compress-warmup): uncompressed, "
                     f"{format_size(w['wire_bytes_per_step'])} sent per rank, predicted {w['step_s']:.3g} s; "
                     f"the codec from step {w['steps'] + 1}")
    return lines
