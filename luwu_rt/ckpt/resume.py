"""Which checkpoint a ``luwu train`` run starts from, decided before any work and said out loud.

[Note: one run per checkpoint directory]
A checkpoint directory belongs to one run: every checkpoint records its run id
([Note: the manifest protects itself] in ckpt/format.py), retention deletes only
the run's own checkpoints, and a run that does not resume refuses a directory
that already holds checkpoints (naming the run and its last step) instead of
writing beside them, where ``--resume`` would later pick the highest step
whoever wrote it. ``--resume`` loads the newest checkpoint whose manifest is
sound and names every newer one it skipped and why; with nothing to resume
from it is an error (``--resume-if-exists`` starts from step 0 instead).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from luwu_rt.ckpt.format import MANIFEST, CheckpointReader, list_checkpoints
from luwu_rt.ckpt.save import verify_checkpoint

__all__ = ["RunComplete", "check_steps", "choose_checkpoint"]


class RunComplete(Exception):
    """A resume of a run that already ran all its steps: nothing to do, which is not an error (a job that
    reruns ``--resume-if-exists`` until it succeeds must see success); the message says how to go further."""


def choose_checkpoint(directory: str, *, resume: bool, if_exists: bool, say: Callable[[str], None]) -> Path | None:
    """The checkpoint to resume from (``None``: start from step 0), or ``ValueError`` with the fix
    ([Note: one run per checkpoint directory])."""
    root = Path(directory)
    if (root / MANIFEST).exists():
        raise ValueError(f"--ckpt-dir {directory} is a checkpoint, not a checkpoint directory; "
                         f"pass its parent {root.parent} (--resume takes the latest checkpoint there)")
    found = list_checkpoints(root)
    if not resume:
        if found:
            last = _describe(found[-1])
            raise ValueError(f"--ckpt-dir {directory} holds checkpoints of another run ({last}); pass --resume "
                             f"to continue it, or give this run another --ckpt-dir")
        return None
    skipped = []
    for path in reversed(found):
        try:
            verify_checkpoint(CheckpointReader(path), read_data=False)
        except (ValueError, OSError) as exc:
            skipped.append(f"{path.name} ({exc})")
            continue
        for line in skipped:
            say(f"luwu: skipping the newer checkpoint {line}")
        return path
    if skipped:
        raise ValueError(f"--resume: no usable checkpoint in {directory}: " + "; ".join(skipped))
    if not if_exists:
        raise ValueError(f"--resume: {directory} holds no checkpoint to resume from; drop --resume to start "
                         f"from step 0, or pass --resume-if-exists")
    say(f"no checkpoint in {directory} yet; starting from step 0 (--resume-if-exists)")
    return None


def check_steps(path: Path, *, step: int, steps: int, given: bool) -> None:
    """The resumed run must go beyond the checkpoint's ``step``: ``--steps`` that would do nothing are an error;
    a run that ran all its own steps raises ``RunComplete``. ``steps``: where it ends; ``given``: whether the
    user gave them (else they are the saved run's own)."""
    if steps > step:
        return
    if given:
        raise ValueError(f"--steps {steps} is not beyond step {step} of the checkpoint {path}; "
                         f"give --steps above {step} to train further")
    # The saved run's own --steps: it ran them all ([Note: the schedule of a resumed run] in optim/schedule.py).
    raise RunComplete(f"the run in {path.parent} is complete: its checkpoint {path.name} is at step {step} of its "
                     f"{steps}; to train further give --steps N above {step} (the steps past the learning-rate "
                     f"schedule's end run at its min_lr; add --schedule-steps N to stretch the cosine to step N)")


def _describe(path: Path) -> str:
    try:
        reader = CheckpointReader(path)
    except (ValueError, OSError):
        return f"the last one, {path.name}, is unreadable"
    run = f"run {reader.run_id}" if reader.run_id else "a run of an older version"
    return f"{run}, last step {reader.step} in {path}"
