"""The kit as a package: a stable public API, no torch, traces in the format of `luwu train --trace`, and
`luwu plan --simulate`."""

import json
import subprocess
import sys

import luwu_rt.testing
from luwu_rt.cli.main import main
from luwu_rt.exec.trace import Span, write_rank_traces
from luwu_rt.plan import Placement, Strategy
from luwu_rt.testing import simulate

from plans import tight_plan, tiny_model

PUBLIC = {"Belady", "Fault", "LRU", "Policy", "PolicyView", "RaceError", "RankResult", "ShardIOError", "SimResult",
          "SlowTier", "StallRank", "assert_faster", "assert_valid", "hand_plan", "plan_for", "simulate"}


def test_the_public_api_is_listed():
    assert set(luwu_rt.testing.__all__) == PUBLIC
    assert all(hasattr(luwu_rt.testing, name) for name in PUBLIC)


def test_simulating_imports_no_torch_and_allocates_no_tensor(tmp_path):
    code = f"""
import sys
from luwu_rt.plan import Budgets, Placement, gpt_model_spec
from luwu_rt.models.presets import get_preset
from luwu_rt.testing import assert_valid, plan_for, simulate
plan = plan_for(gpt_model_spec(get_preset("gpt-1.3b"), batch_size=8, seq_len=1024),
                budgets=Budgets(device_bytes=8 << 30, host_bytes=16 << 30),
                placement=Placement(params="host", optimizer="nvme", grads="host"))
result = simulate(plan, chaos_seed=1)
result.write_trace({str(tmp_path / "t.json")!r})
print(result.summary())
assert_valid(plan, chaos_seeds=[2])
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "critical path" in done.stdout


def test_the_trace_is_the_executors_format_one_process_per_rank(tmp_path):
    plan = tight_plan(tiny_model(), Placement(params="host", optimizer="host", grads="host"),
                      strategy=Strategy(name="zero3", world_size=2))
    result = simulate([plan, plan], chaos_seed=3)
    result.write_trace(tmp_path / "sim.json")
    events = json.loads((tmp_path / "sim.json").read_text())["traceEvents"]
    write_rank_traces([[Span("Compute F0", "compute", 0.0, 1.0, 0, "device")]] * 2, tmp_path / "exec.json")
    reference = json.loads((tmp_path / "exec.json").read_text())["traceEvents"]
    assert {frozenset(e) for e in events} == {frozenset(e) for e in reference}  # the same fields, the same writer
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {e["tid"] for e in spans} == {op.queue for op in plan.ops}
    assert len(spans) == 2 * len(plan.ops)


def test_luwu_plan_simulate_agrees_with_its_prediction(capsys):
    assert main(["plan", "--simulate", "--json", "--nvme-size", "1GiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["simulated"]["step_s"] == out["predicted_step_s"]
    assert out["simulated"]["ranks_simulated"] == 1 and out["simulated"]["busy_s"] == out["busy_s"]


def test_luwu_plan_simulate_prints_the_summary_and_writes_every_ranks_trace(capsys, tmp_path):
    trace = tmp_path / "plan.json"
    assert main(["plan", "--simulate", "--chaos-seed", "5", "--trace", str(trace), "--strategy", "zero3",
                 "--world-size", "2", "--nvme-size", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "simulated step" in out and "2 ranks simulated" in out and "chaos seed 5" in out
    assert "stalled" in out and "critical path:" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}


def test_luwu_plan_simulation_flags_need_simulate(capsys):
    assert main(["plan", "--trace", "x.json"]) == 2
    assert "--trace applies to the simulated run: add --simulate" in capsys.readouterr().err


def test_luwu_plan_takes_a_policy_class_of_ones_own(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_policies.py").write_text(
        "from luwu_rt.plan import LRU\n\nclass Mine(LRU):\n    name = 'mine'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--policy", "my_policies:Mine", "--simulate", "--json", "--nvme-size", "1GiB"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "mine"
    assert main(["plan", "--policy", "my_policies:Nope"]) == 2
    assert "cannot import Nope from my_policies" in capsys.readouterr().err
    assert main(["plan", "--policy", "fifo"]) == 2
    assert "give one of belady, lru, or MODULE:CLASS" in capsys.readouterr().err
