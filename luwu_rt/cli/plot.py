"""`luwu plot LOG.jsonl`: a run at a glance from its ``--json-log``.

Three panels over the steps: training loss (and the validation loss where the
run evaluated), tokens/s, and where a step's time went (compute, waiting on IO
or the optimizer, the rest). Lines of a resumed run that repeat a step replace
the earlier ones, so a log appended to across resumes plots as one run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["add_arguments", "read_log", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", help="a --json-log file of luwu train")
    parser.add_argument("--out", default=None, help="image to write (default: LOG with .png)")


def read_log(path: str | Path) -> tuple[dict[int, dict], dict[int, float]]:
    """``(steps, validation)``: each step's last line, and each evaluated step's validation loss."""
    steps: dict[int, dict] = {}
    val: dict[int, float] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise OSError(exc.errno, f"cannot read the log ({exc.strerror})", str(path)) from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            step = int(entry["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{path}:{number}: not a line of luwu train --json-log: {line[:80]!r}") from None
        if "val_loss" in entry:
            val[step] = float(entry["val_loss"])
        else:
            steps[step] = entry
    if not steps:
        raise ValueError(f"{path} holds no training steps; write one with luwu train --json-log {path}")
    return dict(sorted(steps.items())), dict(sorted(val.items()))


def run(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    steps, val = read_log(args.log)
    out = Path(args.out) if args.out else Path(args.log).with_suffix(".png")
    x = list(steps)
    fig, (loss, speed, parts) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    loss.plot(x, [steps[s]["loss"] for s in x], label="train")
    if val:
        loss.plot(list(val), list(val.values()), "o-", label="validation")
    loss.set_ylabel("loss")
    loss.legend()
    speed.plot(x, [steps[s]["tokens_per_s"] for s in x])
    speed.set_ylabel("tokens/s")
    if all("compute_s" in steps[s] for s in x):
        compute = [steps[s]["compute_s"] * 1e3 for s in x]
        wait = [steps[s]["wait_s"] * 1e3 for s in x]
        other = [max(steps[s]["step_s"] * 1e3 - c - w, 0.0) for s, c, w in zip(x, compute, wait)]
        parts.stackplot(x, compute, wait, other, labels=["compute", "waiting on IO / optimizer", "other"])
        parts.legend(loc="upper right")
    else:  # a log of an older version: the step time only
        parts.plot(x, [steps[s]["step_s"] * 1e3 for s in x], label="step")
    parts.set_ylabel("ms per step")
    parts.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    print(out)
    return 0
