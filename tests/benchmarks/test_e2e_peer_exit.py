"""``bench_e2e.run_peer``: a peer whose ranks all wrote their measured steps before one of them failed on the way
out (DeepSpeed ZeRO-Offload's "terminate called without an active exception") keeps its figures, with how it
ended; one that failed before writing them is unavailable with its error."""

from __future__ import annotations

import importlib.util
import json
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench_e2e():
    spec = importlib.util.spec_from_file_location("bench_e2e_under_test", ROOT / "benchmarks" / "bench_e2e.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


@pytest.mark.parametrize("writes", [True, False])
def test_a_peer_that_fails_after_writing_its_steps_keeps_them(tmp_path, monkeypatch, writes):
    bench = _bench_e2e()

    class Rank:
        """A finished rank process: rank 1 aborts at exit, after writing its times (or before, ``writes``)."""

        def __init__(self, cmd, env, stdout, stderr):
            rank = int(env["RANK"])
            result = cmd[cmd.index("--result") + 1]
            if writes or rank == 0:
                Path(f"{result}.rank{rank}").write_text(json.dumps(
                    {"times": [9.0, 2.0 + rank, 3.0], "losses": [5.0, 4.5, 4.25], "kind": "fake peer"}))
            if rank == 1:  # as DeepSpeed's rank wrote it: a warning from site-packages, then the abort
                stderr.write(f"{sysconfig.get_paths()['purelib']}/torch/distributed/c10d_logger.py:83: "
                             f"FutureWarning: `all_gather_into_tensor` is deprecated.\n"
                             f"  return func(*args, **kwargs)\n"
                             f"terminate called without an active exception\n")
            self.returncode, self.pid = (-6 if rank == 1 else 0), 0

        def poll(self):
            return self.returncode

    monkeypatch.setattr(bench.subprocess, "Popen", Rank)
    args = SimpleNamespace(nproc=2, model="gpt-tiny", batch_size=1, seq_len=16, steps=3, nvme_dir=str(tmp_path),
                           timeout=60.0)
    got = bench.run_peer("torch-ddp", args, str(tmp_path))
    if writes:
        assert got["step_s"] == 3.0 and got["loss"] == 4.25 and got["ranks"] == 2  # slowest rank, warm-up left out
        assert "rank 1 exited with status -6 after writing its result" in got["exit_note"]
        assert got["exit_note"].endswith(": terminate called without an active exception"), got["exit_note"]
    else:
        assert got["error"] == "terminate called without an active exception" and "step_s" not in got
