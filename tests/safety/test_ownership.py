"""Issue 12, case 1: a checkpoint directory belongs to one run; retention deletes only its own checkpoints."""

from safety_common import SMALL, luwu, one_line_error

from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.ckpt.format import CheckpointReader, CheckpointWriter, list_checkpoints
from luwu_rt.engine.config import CheckpointConfig


def test_second_run_refuses_a_directory_of_another_run(tmp_path) -> None:
    ck = tmp_path / "ck"
    first = luwu("train", "--steps", "4", *SMALL, "--ckpt-dir", str(ck), "--ckpt-every", "2", "--seed", "1")
    assert first.returncode == 0, first.stderr
    before = [p.name for p in list_checkpoints(ck)]
    run_id = CheckpointReader(ck / "step_00000004").run_id
    assert before == ["step_00000002", "step_00000004"] and run_id
    r = luwu("train", "--steps", "2", *SMALL, "--ckpt-dir", str(ck), "--ckpt-every", "1", "--seed", "2")
    one_line_error(r, f"run {run_id}", "last step 4", "--resume", "another --ckpt-dir")
    assert [p.name for p in list_checkpoints(ck)] == before  # nothing deleted, nothing added
    resumed = luwu("train", "--steps", "5", *SMALL, "--ckpt-dir", str(ck), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"step 4 of run {run_id}" in resumed.stderr  # it says what it resumes
    assert CheckpointReader(ck / "step_00000005").run_id == run_id  # a resumed run keeps owning its checkpoints
    assert [p.name for p in list_checkpoints(ck)] == ["step_00000004", "step_00000005"]


def test_retention_keeps_other_runs_checkpoints(tmp_path) -> None:
    with CheckpointWriter(tmp_path, step=20) as w:  # a checkpoint of another run, at a higher step
        w.commit({"run_id": "someone-else"})
    config = TrainConfig(batch_size=2, seq_len=16, steps=10, checkpoint=CheckpointConfig(keep=1))
    with Engine(None, config) as engine:
        for step in (1, 2, 3):
            engine.step = step
            engine.save(tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000020"]
    assert CheckpointReader(tmp_path / "step_00000020").run_id == "someone-else"
