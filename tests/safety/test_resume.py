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
