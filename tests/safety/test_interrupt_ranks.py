"""Issue 12, case 2 with several ranks: a signal that reaches one rank stops every rank after the same
step; rank 0 commits the checkpoint of that step (slices of both ranks) and the run resumes from it."""

import os

from safety_common import SMALL, losses, luwu

from luwu_rt.ckpt.format import CheckpointReader, list_checkpoints
from luwu_rt.ckpt.save import verify_checkpoint


def test_sigint_on_one_rank_stops_both_after_one_step(tmp_path) -> None:
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    args = ["train", "--nproc", "2", "--strategy", "zero3", "--steps", "4", *SMALL, "--ckpt-dir", str(ck),
            "--json-log", str(log), "--timeout", "60"]
    env = dict(os.environ, LUWU_TEST_SIGNAL_AT="backward@2", LUWU_TEST_SIGNAL_RANK="1")
    r = luwu(*args, env=env)
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr and "stopped responding" not in r.stderr, r.stderr
    assert [p.name for p in list_checkpoints(ck)] == ["step_00000002"], r.stderr
    reader = CheckpointReader(ck / "step_00000002")
    assert reader.meta["world_size"] == 2 and any(".slice1of2" in name for name in reader.tensors)
    verify_checkpoint(reader, read_data=True)
    r = luwu(*args, "--resume")
    assert r.returncode == 0, r.stderr
    assert sorted(losses(log)) == [1, 2, 3, 4]
