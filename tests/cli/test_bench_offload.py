import json
import subprocess
import sys


def test_offload_step_json_fields(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "luwu_rt", "bench", "offload-step", "--params", "3M",
                        "--unit-params", "1M", "--chunk-size", "1MiB", "--host-mem", "64MiB", "--steps", "2",
                        "--nvme-dir", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["params"] == 3_000_000 and out["units"] == 3
    for key in ("step_s", "io_bound_s", "predicted_s", "serial_step_s"):
        assert out[key] > 0
    # Master + two moments, fp32, read and written once per step.
    assert out["nvme_read_bytes"] >= 12 * 3_000_000 and out["nvme_write_bytes"] >= 12 * 3_000_000
    assert list(tmp_path.iterdir()) == []  # its files are removed


def test_offload_step_creates_a_missing_dir_and_removes_it(tmp_path) -> None:
    """Issue 13: a missing --nvme-dir is treated as `luwu train` treats it (created, said), and what the
    benchmark created is removed at exit, as it keeps nothing there."""
    nv = tmp_path / "not" / "yet"
    r = subprocess.run([sys.executable, "-m", "luwu_rt", "bench", "offload-step", "--params", "1M", "--unit-params",
                        "512K", "--chunk-size", "1MiB", "--host-mem", "64MiB", "--steps", "1", "--nvme-dir", str(nv),
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"creating --nvme-dir {nv}" in r.stderr
    json.loads(r.stdout)  # the line about the directory goes to stderr: --json keeps stdout to one object
    assert list(tmp_path.iterdir()) == []  # tmp_path/not, which it made, is gone as well
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = subprocess.run([sys.executable, "-m", "luwu_rt", "bench", "offload-step", "--params", "1M", "--unit-params",
                        "512K", "--host-mem", "64MiB", "--nvme-dir", str(blocker)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "names a file, not a directory" in r.stderr and "Traceback" not in r.stderr


def test_offload_step_too_little_host_suggests_its_own_flags(tmp_path) -> None:
    """Issue 13 item 5: the remedy names this command's flags (its placement is fixed), and the --host-mem
    it suggests runs."""
    import re

    base = [sys.executable, "-m", "luwu_rt", "bench", "offload-step", "--params", "3M", "--unit-params", "1M",
            "--chunk-size", "1MiB", "--steps", "1", "--nvme-dir", str(tmp_path)]
    r = subprocess.run(base + ["--host-mem", "8MiB"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "every state lives on NVMe" not in r.stderr and "--unit-params" in r.stderr
    suggested = re.search(r"pass --host-mem (\S+) or more", r.stderr)
    assert suggested, r.stderr
    r = subprocess.run(base + ["--host-mem", suggested.group(1), "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
