"""A checkpoint written before the flag table and the config renames (issue 18, items 5) still verifies and
resumes, to the losses the code that wrote it reached (fixtures/before_flag_table/README.md says how it was
made). Its stored config uses the old keys (offload.device_mem, host_mem, chunk_size, timeout)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from luwu_rt.cli.main import main
from luwu_rt.ckpt.format import CheckpointReader

pytest.importorskip("transformers", reason="the checkpoint's model is a tiny Hugging Face folder (test extra)")

FIXTURE = Path(__file__).parent / "fixtures" / "before_flag_table"
STEP = "ckpt/step_00000002"
EXPECTED = {int(step): loss for step, loss in json.loads((FIXTURE / "expected.json").read_text())["losses"].items()}
"""Losses of the run that wrote the checkpoint (4 steps, saved at 2 and 4; only step 2 is kept here)."""
REL = 1e-5  # the same CPU kernels reach the same losses; other SIMD widths may round the last bits apart


@pytest.fixture
def run_dir(tmp_path, monkeypatch) -> Path:
    """The fixture copied to a scratch directory that is the current one: its config names the model, the
    data and the directories relative to where the run was started."""
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_fixture_is_from_before(run_dir) -> None:
    saved = CheckpointReader(run_dir / STEP).settings
    assert {"device_mem", "host_mem", "chunk_size"} <= set(saved["offload"]) and "timeout" in saved
    assert saved["steps"] == 4 and saved["model"] == "hf:model"


def test_it_verifies(run_dir, capsys) -> None:
    assert main(["ckpt", "verify", STEP]) == 0
    assert "complete, all checksums match" in capsys.readouterr().out


def test_engine_load_resumes_it_with_overrides(run_dir) -> None:
    from luwu_rt.engine import Engine

    # The saved config's keys are the old ones; an override of one of them applies.
    with Engine.load(run_dir / STEP, overrides={"offload": {"host_mem": "32MiB"}, "eval_every": 0}) as engine:
        assert engine.step == 2 and engine.plan.budgets.host_bytes == 32 * 2**20
        off = engine.config.offload  # the old keys, read under the new names
        assert (off.device_mem_bytes, off.chunk_bytes, engine.config.timeout_s) == (88 * 2**20, 4 * 2**20, 300.0)
        losses = {}
        while engine.step < engine.config.steps:  # the saved run's 4 steps
            loss = engine.train_step()["loss"]
            losses[engine.step] = loss
    assert list(losses) == [3, 4]
    assert losses == pytest.approx({s: EXPECTED[s] for s in (3, 4)}, rel=REL)


def test_luwu_train_resumes_it(run_dir) -> None:
    run = subprocess.run([sys.executable, "-m", "luwu_rt", "train", "--resume", "--ckpt-dir", "ckpt", "--json-log",
                          "log.jsonl", "--quiet", "--host-mem", "32MiB"], cwd=run_dir, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resuming from ckpt/step_00000002 (step 2 of run" in run.stderr
    rows = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 4]
    assert {r["step"]: r["loss"] for r in rows} == pytest.approx({s: EXPECTED[s] for s in (3, 4)}, rel=REL)
    # What the resumed run saved reads back under the keys' current names, and verifies.
    assert main(["ckpt", "verify", "ckpt/step_00000004"]) == 0
