"""`luwu bench io --profile-out` writes what `luwu plan --profile` reads (issue 13, item 4)."""

from __future__ import annotations

import json

from luwu_rt.cli.main import main


def _bench(tmp_path, profile, *extra):
    data = tmp_path / "disk"
    data.mkdir(exist_ok=True)
    return main(["bench", "io", "--dir", str(data), "--size-mb", "1", "--block-kb", "256", "--queue-depth", "4",
                 "--backend", "threads", "--profile-out", str(profile), *extra])


def test_bench_io_profile_feeds_plan(tmp_path, capsys):
    profile = tmp_path / "hw.json"
    assert _bench(tmp_path, profile, "--json") == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # --json still prints exactly one object on stdout
    assert f"luwu plan --profile {profile}" in captured.err
    written = json.loads(profile.read_text())
    assert set(written) == {"nvme_read_gbps", "nvme_write_gbps"} and min(written.values()) > 0
    assert main(["plan", "--profile", str(profile), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"]


def test_profile_out_keeps_other_keys(tmp_path, capsys):
    profile = tmp_path / "hw.json"
    profile.write_text(json.dumps({"compute_flops": 1e12, "nvme_read_gbps": 99.0}))
    assert _bench(tmp_path, profile) == 0
    written = json.loads(profile.read_text())
    assert written["compute_flops"] == 1e12 and written["nvme_read_gbps"] != 99.0


def test_profile_out_refuses_a_non_profile(tmp_path, capsys):
    profile = tmp_path / "hw.json"
    profile.write_text('{"backend": "threads"}')
    assert _bench(tmp_path, profile) == 2
    assert "unknown hardware profile key" in capsys.readouterr().err
    assert profile.read_text() == '{"backend": "threads"}'  # what the user wrote is left alone


def test_plan_refuses_bench_json_naming_the_fix(tmp_path, capsys):
    measurement = tmp_path / "io.json"
    data = tmp_path / "disk"
    data.mkdir()
    assert main(["bench", "io", "--dir", str(data), "--size-mb", "1", "--block-kb", "256", "--backend", "threads",
                 "--json"]) == 0
    measurement.write_text(capsys.readouterr().out)
    assert main(["plan", "--profile", str(measurement)]) == 2
    err = capsys.readouterr().err
    assert "valid keys: nvme_read_gbps" in err and "--profile-out" in err


def test_plan_profile_help_names_keys_and_writer(capsys):
    try:
        main(["plan", "--help"])
    except SystemExit:
        pass
    out = " ".join(capsys.readouterr().out.split())
    assert "node_nvme_write_gbps" in out and "luwu bench io --dir DIR --profile-out FILE" in out


def test_bench_io_creates_a_missing_dir_and_removes_it(tmp_path, capsys):
    """Issue 13: `luwu bench io --dir` on a missing directory creates it (and says so, on stderr) as
    `luwu train --nvme-dir` does, and removes what it created at exit."""
    missing = tmp_path / "not" / "yet"
    assert main(["bench", "io", "--dir", str(missing), "--size-mb", "1", "--block-kb", "256", "--queue-depth", "4",
                 "--json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)
    assert f"creating --dir {missing}" in captured.err
    assert list(tmp_path.iterdir()) == []
    kept = tmp_path / "kept"
    kept.mkdir()
    assert main(["bench", "io", "--dir", str(kept), "--size-mb", "1", "--block-kb", "256", "--queue-depth", "4"]) == 0
    assert "creating" not in capsys.readouterr().err and kept.is_dir()  # a directory the user made stays
