"""`luwu bench io` end to end, on a small file."""

from __future__ import annotations

import json

import pytest

from luwu_rt.cli.main import main


@pytest.mark.parametrize("backend", ("io_uring", "threads"))
def test_bench_io_json(tmp_path, capsys, backend):
    assert main(["bench", "io", "--dir", str(tmp_path), "--size-mb", "4", "--block-kb", "256",
                 "--queue-depth", "4", "--backend", backend, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == backend
    assert out["block_bytes"] == 256 << 10 and out["queue_depth"] == 4 and out["size_bytes"] == 4 << 20
    assert out["write_gbps"] > 0 and out["read_gbps"] > 0
    assert list(tmp_path.iterdir()) == []  # its file is cleaned up


def test_bench_io_sweep(tmp_path, capsys):
    assert main(["bench", "io", "--dir", str(tmp_path), "--size-mb", "1", "--sweep"]) == 0
    out = capsys.readouterr().out
    assert "best for writes: --block-kb" in out and "best for reads:  --block-kb" in out
    assert list(tmp_path.iterdir()) == []


def test_bench_io_dir_that_is_a_file(tmp_path, capsys):
    # A missing --dir is created and removed again (tests/cli/test_bench_profile.py); a file is the error.
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "io", "--dir", str(blocker), "--size-mb", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("luwu: error:") and "--dir names a file, not a directory" in err


def test_bench_io_bad_block(tmp_path, capsys):
    assert main(["bench", "io", "--dir", str(tmp_path), "--size-mb", "1", "--block-kb", "3"]) == 2
    assert "--block-kb" in capsys.readouterr().err
