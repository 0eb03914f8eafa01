"""Issue 12, case 5: resume says what it loads and what it skipped, and refuses what would surprise."""

import json

from safety_common import SMALL, luwu, one_line_error

from luwu_rt.ckpt.format import MANIFEST, CheckpointReader, list_checkpoints


def test_resume_cases(tmp_path) -> None:
    ck = tmp_path / "ck"
    empty = luwu("train", "--steps", "2", *SMALL, "--ckpt-dir", str(ck), "--resume")
    one_line_error(empty, "holds no checkpoint", "--resume-if-exists")  # not a silent fresh start
    made = luwu("train", "--steps", "3", *SMALL, "--ckpt-dir", str(ck), "--ckpt-every", "1", "--resume-if-exists")
    assert made.returncode == 0 and "starting from step 0" in made.stderr, made.stderr
    assert [p.name for p in list_checkpoints(ck)] == ["step_00000002", "step_00000003"]

    # --steps at or below the checkpoint's step would do nothing: an error naming both.
    one_line_error(luwu("train", "--steps", "3", *SMALL, "--ckpt-dir", str(ck), "--resume"),
                   "--steps 3 is not beyond step 3")
    # A checkpoint given as the directory: not a fresh run nested inside it.
    step3 = ck / "step_00000003"
    one_line_error(luwu("train", "--steps", "5", *SMALL, "--ckpt-dir", str(step3), "--resume"),
                   "is a checkpoint, not a checkpoint directory", str(ck))
    assert not list(step3.glob("step_*"))

    # A corrupt newest checkpoint is skipped by name and why; the older one is loaded and named.
    manifest = step3 / MANIFEST
    manifest.write_text(manifest.read_text()[:-40])
    r = luwu("train", "--steps", "4", *SMALL, "--ckpt-dir", str(ck), "--resume")
    assert r.returncode == 0, r.stderr
    assert "skipping the newer checkpoint step_00000003" in r.stderr and "corrupt" in r.stderr, r.stderr
    assert f"resuming from {ck / 'step_00000002'} (step 2" in r.stderr, r.stderr
    assert CheckpointReader(ck / "step_00000004").step == 4


def test_resume_in_another_compute_dtype(tmp_path) -> None:
    # Master weights and moments are fp32 in every checkpoint, so a new compute dtype is a cast, not a traceback.
    ck = tmp_path / "ck"
    assert luwu("train", "--steps", "2", *SMALL, "--ckpt-dir", str(ck)).returncode == 0
    r = luwu("train", "--steps", "3", *SMALL, "--ckpt-dir", str(ck), "--resume", "--dtype", "bf16")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert json.loads((ck / "step_00000003" / MANIFEST).read_text())["meta"]["config"]["dtype"] == "bf16"


# Issue 19 item 2: the learning-rate schedule of a resumed run ([Note: the schedule of a resumed run]).
SCHEDULE = "[optim]\nwarmup_steps = 1\n"
"""A warmup shorter than the runs, so that the cosine decides every resumed step's rate."""


def _rows(path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, open(path)) if "loss" in row}


def _tensors(step_dir) -> dict:
    reader = CheckpointReader(step_dir)
    return {name: reader.read(name) for name in reader.tensors}


def test_stop_and_resume_ends_where_the_uninterrupted_run_ends(tmp_path) -> None:
    """README's example: a run planned for 6 steps, stopped after 4, resumed with no flags but the directory,
    equals the run never stopped: each step's loss and learning rate, and every saved tensor."""
    import torch

    config = tmp_path / "run.toml"
    config.write_text(SCHEDULE)
    common = ["--config", str(config), *SMALL]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    r = luwu("train", "--steps", "6", *common, "--ckpt-dir", str(whole), "--json-log", str(tmp_path / "whole.jsonl"))
    assert r.returncode == 0, r.stderr
    log = str(tmp_path / "parts.jsonl")
    r = luwu("train", "--steps", "6", "--stop-after", "4", *common, "--ckpt-dir", str(parts), "--json-log", log)
    assert r.returncode == 0, r.stderr
    assert "stopped after step 4 of 6 (--stop-after); --resume continues from step 4" in r.stderr, r.stderr
    r = luwu("train", "--resume", "--ckpt-dir", str(parts), "--json-log", log, "--quiet")  # the saved run's settings
    assert r.returncode == 0, r.stderr
    assert "learning rate: the checkpoint's schedule goes on (cosine to 0.0003 at step 6)" in r.stderr, r.stderr
    a, b = _rows(tmp_path / "whole.jsonl"), _rows(log)
    assert list(a) == list(b) == [1, 2, 3, 4, 5, 6]
    assert [(a[s]["loss"], a[s]["lr"]) for s in a] == [(b[s]["loss"], b[s]["lr"]) for s in b]
    ta, tb = _tensors(whole / "step_00000006"), _tensors(parts / "step_00000006")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)

    # The run is complete: a --resume without --steps says so and how to go on, not "--steps 6 is not beyond",
    # and exits 0 (nothing to do is not a failure: a job rerunning --resume-if-exists until it succeeds stops).
    for flag in ("--resume", "--resume-if-exists"):
        r = luwu("train", flag, "--ckpt-dir", str(parts), "--quiet")
        assert r.returncode == 0 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
        for needle in (f"the run in {parts} is complete", "at step 6 of its 6", "give --steps N above 6",
                       "--schedule-steps N"):
            assert needle in r.stderr, (needle, r.stderr)
        assert "is not beyond" not in r.stderr
        assert not (parts / "step_00000007").exists()


def test_more_steps_after_the_schedule_run_at_min_lr_unless_told(tmp_path) -> None:
    """--resume --steps N beyond the saved run keeps its schedule (steps past its end at min_lr, no jump),
    and says so; --schedule-steps N recomputes the cosine, and the printed rate is the one the step gets.
    Before, the cosine was recomputed for the new total silently and the rate jumped."""
    from luwu_rt.optim.config import OptimConfig
    from luwu_rt.optim.schedule import lr_at

    config = tmp_path / "run.toml"
    config.write_text(SCHEDULE)
    common = ["--config", str(config), *SMALL]
    min_lr = OptimConfig().min_lr
    for name in ("kept", "stretched"):
        r = luwu("train", "--steps", "4", *common, "--ckpt-dir", str(tmp_path / name))
        assert r.returncode == 0, r.stderr

    log = tmp_path / "kept.jsonl"
    r = luwu("train", "--resume", "--steps", "6", *common, "--ckpt-dir", str(tmp_path / "kept"), "--json-log", str(log))
    assert r.returncode == 0, r.stderr
    assert ("learning rate: the checkpoint's schedule ends at step 4; steps 5-6 run at min_lr 0.0003 "
            "(--schedule-steps 6 stretches the cosine to step 6 instead: ") in r.stderr, r.stderr
    assert [row["lr"] for row in _rows(log).values()] == [min_lr, min_lr]

    log = tmp_path / "stretched.jsonl"
    r = luwu("train", "--resume", "--steps", "6", "--schedule-steps", "6", *common, "--ckpt-dir",
             str(tmp_path / "stretched"), "--json-log", str(log))
    assert r.returncode == 0, r.stderr
    o = OptimConfig()
    want = [lr_at(s, lr=o.lr, min_lr=o.min_lr, warmup_steps=1, total_steps=6) for s in (5, 6)]
    line = (f"learning rate: --schedule-steps 6 replaces the checkpoint's schedule (cosine to step 4): step 5 runs at "
            f"{want[0]:.3g} instead of {min_lr:.3g}")
    assert line in r.stderr, r.stderr
    assert [row["lr"] for row in _rows(log).values()] == want
    # The next resume keeps the stretched schedule: its checkpoint records it.
    assert json.loads((tmp_path / "stretched" / "step_00000006" / MANIFEST).read_text())["meta"]["config"]["optim"][
        "schedule_steps"] == 6
