"""Errors a user can cause are one line and exit 2, from one process or from every rank (issue 20, item 7):
a node address in use, malformed or past the last port; a batch size past any tensor; a Hugging Face folder
of negative sizes; a binary --config; a node's refusal under --nproc."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

FIXTURE_MODEL = Path(__file__).resolve().parent.parent / "ckpt" / "fixtures" / "before_flag_table" / "model"


def _luwu(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "luwu_rt", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


def _one_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    errors = [line for line in r.stderr.splitlines() if line.startswith("luwu: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_node_serve_on_a_port_in_use_is_one_line(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _luwu("node", "serve", "--num-workers", "1", "--timeout", "5", "--bind", f"tcp://127.0.0.1:{port}",
                  cwd=tmp_path, timeout=60)
    _one_line(r, f"--bind tcp://127.0.0.1:{port}: cannot listen there (Address already in use)")


@pytest.mark.parametrize("bind, needle", [
    ("tcp://127.0.0.1;0.0.0.0:{port}", "expected tcp://HOST:PORT"),  # passed as loopback, then a traceback
    ("tcp://127.0.0.1:99999", "port 99999 is not in 1..65535"),  # ZeroMQ listened on 99999 - 65536, silently
    ("tcp://127.evil.example:{port}", "needs --auth-keys"),  # not loopback, however it starts
])
def test_node_serve_refuses_an_address_it_would_misread(tmp_path, bind, needle) -> None:
    r = _luwu("node", "serve", "--num-workers", "1", "--timeout", "5", "--bind", bind.format(port=_free_port()),
              cwd=tmp_path, timeout=60)
    _one_line(r, needle)


def test_a_batch_size_past_any_tensor_is_one_line(tmp_path) -> None:
    """It was a 56-line TypeError from deep inside torch."""
    r = _luwu("train", "--batch-size", "99999999999999999999", "--steps", "1", cwd=tmp_path)
    _one_line(r, "batch_size must be a positive integer below 2**31, got 99999999999999999999")


def test_a_binary_config_file_is_one_line_naming_it(tmp_path) -> None:
    config = tmp_path / "c.toml"
    config.write_bytes(bytes(range(256)))
    r = _luwu("train", "--config", str(config), "--steps", "1", cwd=tmp_path)
    _one_line(r, f"config file {config} is not valid TOML: not UTF-8 text")


def test_a_hugging_face_folder_of_negative_sizes_is_one_line(tmp_path) -> None:
    pytest.importorskip("transformers", reason="hf: models need transformers (test extra)")
    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((FIXTURE_MODEL / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "n_embd": -32}))
    r = _luwu("train", "--model", f"hf:{model}", "--steps", "1", "--batch-size", "1", "--seq-len", "16",
              cwd=tmp_path)
    _one_line(r, f"{model / 'config.json'}: n_embd is -32")


def test_a_nodes_refusal_under_nproc_is_one_line_per_rank_and_exits_2(tmp_path) -> None:
    """A node that serves another number of workers refuses both ranks: each says so in one whole line (the
    fix at its end was cut off), no traceback, and the run exits 2 like one process (it exited 1)."""
    ready = tmp_path / "address"
    node = subprocess.Popen([sys.executable, "-m", "luwu_rt", "node", "serve", "--num-workers", "3", "--timeout", "60",
                             "--bind", "tcp://127.0.0.1:*", "--ready-file", str(ready)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert node.poll() is None and time.monotonic() < deadline, "the node did not listen"
            time.sleep(0.05)
        r = _luwu("train", "--nproc", "2", "--strategy", "node", "--node", ready.read_text(), "--steps", "2",
                  "--batch-size", "1", "--seq-len", "16", "--eval-every", "0", "--quiet", "--timeout", "60",
                  cwd=tmp_path)
    finally:
        node.kill()
        node.wait()
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    for rank in (0, 1):
        lines = [line for line in r.stderr.splitlines() if line.startswith(f"luwu: rank {rank}: NodeError")]
        assert len(lines) == 1 and lines[0].endswith("start both with the same count"), r.stderr[-3000:]


@pytest.mark.parametrize("flags, needle", [
    (("--node-snapshot-every", "2"), "--node-snapshot-every goes with --spawn-node"),
    (("--spawn-node", "--node-snapshot-dir", "snaps"), "--node-snapshot-dir goes with --node-snapshot-every K"),
    (("--spawn-node", "--node-snapshot-every", "-1"), "--node-snapshot-every -1: give a number of steps >= 1"),
])
def test_node_snapshot_flags_of_spawned_nodes_are_checked(tmp_path, flags, needle) -> None:
    """[Note: spawned nodes that die] in node/spawn.py: the flags say what they go with, before anything starts."""
    r = _luwu("train", "--strategy", "node", "--nproc", "2", "--steps", "1", *flags, cwd=tmp_path, timeout=120)
    _one_line(r, needle)
    assert not (tmp_path / "snaps").exists()
