"""`luwu plan`: text and JSON output for gpt-tiny and gpt-175b, and the does-not-fit answer."""

import json

import pytest

from luwu_rt.cli.main import main
from luwu_rt.models.presets import get_preset

FIELDS = {"params", "fits", "peak_bytes", "io_bytes_per_step", "predicted_step_s", "bottleneck"}


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["plan", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_gpt_175b_json(capsys):
    code, out = run_json(capsys, "--model", "gpt-175b", "--device-mem", "80GiB", "--host-mem", "512GiB",
                         "--nvme-size", "4TB")
    assert code == 0 and out["fits"] is True
    assert FIELDS <= set(out)
    assert abs(out["params"] / 175e9 - 1) < 0.02
    assert out["peak_bytes"]["device"] <= 80 * 2**30 and out["peak_bytes"]["host"] <= 512 * 2**30
    assert out["placement"]["optimizer"] == "nvme"  # 2 TB of fp32 state cannot live in 512 GiB
    assert out["io_bytes_per_step"]["nvme"]["read"] > 0 and out["io_bytes_per_step"]["nvme"]["write"] > 0
    assert out["predicted_step_s"] > 0 and out["bottleneck"] in ("nvme", "nvme_read", "nvme_write")


def test_gpt_tiny_json_fits_on_device(capsys):
    code, out = run_json(capsys, "--model", "gpt-tiny", "--host-mem", "1GiB")
    assert code == 0 and FIELDS <= set(out)
    assert out["params"] == get_preset("gpt-tiny").num_params
    assert out["placement"] == {"params": "device", "optimizer": "device", "grads": "device"}
    assert out["io_bytes_per_step"]["nvme"] == {"read": 0, "write": 0}


def test_gpt_tiny_text(capsys):
    assert main(["plan", "--model", "gpt-tiny", "--device-mem", "64MiB", "--host-mem", "1GiB",
                 "--offload-optimizer", "host"]) == 0
    out = capsys.readouterr().out
    assert "gpt-tiny" in out and "predicted step time" in out and "bottleneck" in out
    assert "master" in out and "host" in out


def test_does_not_fit_states_the_memory_needed(capsys):
    code, out = run_json(capsys, "--model", "gpt-175b", "--device-mem", "80GiB", "--host-mem", "64GiB")
    assert code == 1 and out["fits"] is False
    assert "needs at least" in out["reason"] and "of host memory or" in out["reason"] and "NVMe" in out["reason"]
    assert out["needs"]["host_bytes"] > 64 * 2**30 and out["needs"]["nvme_bytes"] > 2 * 10**12
    assert main(["plan", "--model", "gpt-175b", "--host-mem", "64GiB"]) == 1
    assert "does not fit: needs at least" in capsys.readouterr().out


def test_nvme_dir_budget_is_its_free_space(capsys, tmp_path):
    code, out = run_json(capsys, "--model", "gpt-tiny", "--nvme-dir", str(tmp_path), "--device-mem", "8MiB",
                         "--host-mem", "8MiB", "--offload-optimizer", "nvme")
    assert code == 0 and out["budgets"]["nvme"] > 0 and out["placement"]["optimizer"] == "nvme"


@pytest.mark.parametrize("argv, message", [
    (["--device-mem", "lots"], "cannot read size"),
    (["--nvme-dir", "/nonexistent/luwu"], "is not a directory"),
    (["--world-size", "2", "--strategy", "local"], "local runs one process"),
])
def test_bad_arguments_are_one_line_errors(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("luwu: error:") and message in err


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "hsdp", "node"])
def test_strategies_plan(capsys, strategy):
    code, out = run_json(capsys, "--model", "gpt-small", "--world-size", "4", "--strategy", strategy,
                         "--device-mem", "4GiB", "--host-mem", "8GiB", "--batch-size", "2", "--seq-len", "256")
    assert code == 0 and out["strategy"] == strategy and out["world_size"] == 4
    assert sum(out["busy_s"].get(q, 0) for q in ("gather", "reduce", "reduce_cross", "push", "pull")) > 0


def test_show_ops_lists_the_plan(capsys):
    assert main(["plan", "--model", "gpt-tiny", "--device-mem", "5MiB", "--host-mem", "16MiB",
                 "--offload-optimizer", "host", "--show-ops", "5"]) == 0
    out = capsys.readouterr().out
    listing = out[out.index("first 5 ops"):].splitlines()[1:]
    assert len(listing) == 5 and "Load" in listing[0] and "param[0.0]:host@0 -> param[0.0]:device@" in listing[0]
