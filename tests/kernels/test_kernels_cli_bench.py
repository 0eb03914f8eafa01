"""`luwu bench optim` end to end on a tiny size (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from luwu_rt.cli.main import main


def test_json_output_lists_backends_and_probe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "optim", "--numel", "4099", "--rounds", "1", "--grad-dtype", "bf16", "--param-out",
                 "bf16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["probe_mparams_per_s"] > 0
    names = {r["name"] for r in report["results"]}
    assert {"cpp", "numba", "torch", "torch-fused", "torch-foreach"} <= names
    assert all(r["mparams_per_s"] > 0 for r in report["results"])
    # Every backend or peer that did not run says why.
    for name in ("numba-cuda", "cupy", "deepspeed"):
        assert name in names or report["unavailable"][name]


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "optim", "--numel", "1000", "--rounds", "1", "--no-torch-ref"]) == 0
    out = capsys.readouterr().out
    assert "probe (memory ceiling)" in out and "cpp" in out and "x probe" in out


def test_bad_numel_is_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "optim", "--numel", "0"]) == 2
    assert "luwu: error: numel must be >= 1" in capsys.readouterr().err
