"""`luwu plot`: a PNG from a --json-log, also from a log appended to across a resume; clear errors."""

import json

import pytest

from luwu_rt.cli.main import main
from luwu_rt.cli.plot import read_log


def _step(step, loss):
    return {"step": step, "loss": loss, "tokens_per_s": 1000.0 + step, "step_s": 0.1, "lr": 1e-3, "grad_norm": 1.0,
            "skipped": False, "compute_s": 0.06, "wait_s": 0.03, "optim_s": 0.02, "io_s": 0.01}


def test_plot_writes_a_png_and_a_resumed_step_replaces_the_first(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    lines = [_step(1, 5.0), _step(2, 4.0), {"step": 2, "val_loss": 4.5}, _step(3, 3.5), _step(3, 3.0)]
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    steps, val = read_log(log)
    assert list(steps) == [1, 2, 3] and steps[3]["loss"] == 3.0 and val == {2: 4.5}
    assert main(["plot", str(log)]) == 0
    png = tmp_path / "run.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_real_run(tmp_path):
    log = tmp_path / "log.jsonl"
    assert main(["train", "--steps", "4", "--batch-size", "2", "--seq-len", "32", "--eval-every", "2", "--quiet",
                 "--json-log", str(log)]) == 0
    steps, val = read_log(log)
    assert list(steps) == [1, 2, 3, 4] and list(val) == [2, 4]
    assert {"compute_s", "wait_s", "step_s", "tokens_per_s"} <= set(steps[1])
    assert main(["plot", str(log), "--out", str(tmp_path / "x.png")]) == 0 and (tmp_path / "x.png").is_file()


@pytest.mark.parametrize("text, message", [("", "holds no training steps"), ("not json\n", ":1: not a line")])
def test_plot_refuses_what_is_not_a_log(tmp_path, capsys, text, message):
    log = tmp_path / "bad.jsonl"
    log.write_text(text)
    assert main(["plot", str(log)]) == 2
    assert message in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
