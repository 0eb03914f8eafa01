"""`luwu calibrate` and the profile a run plans with (issue 22, item 1; [Note: which profile] in
engine/hwprofile.py): measured into a file and this machine's cache, found by `luwu plan`, `luwu train` and
`--strategy auto`, and named in their first line."""

from __future__ import annotations

import dataclasses
import json

import pytest

from luwu_rt.cli.main import main
from luwu_rt.engine.hwprofile import ProfileChoice, cached_profile_path, choose_profile, per_rank, read_profile
from luwu_rt.plan import HardwareProfile

TINY = ["--model", "gpt-tiny", "--batch-size", "1", "--seq-len", "16", "--nvme-mb", "4", "--net-mib", "1",
        "--optim-numel", str(1 << 16), "--codec-numel", str(1 << 16)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty profile cache of the test's own."""
    monkeypatch.setenv("LUWU_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_calibrate_writes_a_profile_that_plan_and_train_use(tmp_path, cache, capsys):
    out = tmp_path / "hw.json"
    assert main(["calibrate", *TINY, "--nvme-dir", str(tmp_path / "disk"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and f"wrote {cached_profile_path()}" in printed
    assert not (tmp_path / "disk").exists(), "the directory calibrate created is removed"
    values = json.loads(out.read_text())
    assert json.loads(cached_profile_path().read_text()) == values
    profile, notes = read_profile(out)
    for f in dataclasses.fields(HardwareProfile):
        assert f.name in values, f"calibrate measures {f.name}"
    assert 0.0 <= profile.cpu_overlap <= 1.0 and profile.shard_collective_factor >= 1.0
    assert notes["_machine"]["cores"] >= 1 and notes["_measured"]["compute"]["model"] == "gpt-tiny"
    assert {"read_gbps", "write_gbps", "mixed_gbps", "sweep", "checksum_gbps"} <= set(notes["_measured"]["nvme"])
    assert profile.nvme_core_s_per_gb > 0, "the store's checksums alone take the cores' time"
    # luwu plan without --profile finds the cached calibration, and says so first.
    assert main(["plan", "--nvme-size", "0", "--world-size", "2", "--strategy", "auto", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["profile"]["source"] == "calibrated" and planned["profile"]["path"] == str(cached_profile_path())


def test_calibrate_refuses_to_write_nowhere(tmp_path, cache, capsys):
    assert main(["calibrate", "--no-cache"]) == 2
    assert "--no-cache writes the profile nowhere: give --out FILE" in capsys.readouterr().err


def test_plan_first_line_names_the_profile(tmp_path, cache, capsys):
    assert main(["plan", "--nvme-size", "0", "--host-mem", "64MiB"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(
        "built-in profile (a GPU server; `luwu calibrate` measures this machine)")
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"compute_flops": 1e9, "_note": "anything"}))
    assert main(["plan", "--nvme-size", "0", "--host-mem", "64MiB", "--profile", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(f"profile {path}")
    assert main(["plan", "--nvme-size", "0", "--host-mem", "64MiB", "--profile", "builtin", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["profile"]["source"] == "builtin"


def test_plan_predicts_with_the_profile_given(tmp_path, cache, capsys):
    slow, fast = tmp_path / "slow.json", tmp_path / "fast.json"
    slow.write_text(json.dumps({"compute_flops": 1e9}))
    fast.write_text(json.dumps({"compute_flops": 1e15}))
    steps = {}
    for path in (slow, fast):
        assert main(["plan", "--nvme-size", "0", "--offload-optimizer", "device", "--offload-params", "device",
                     "--offload-grads", "device", "--device-mem", "1GiB", "--profile", str(path), "--json"]) == 0
        steps[path] = json.loads(capsys.readouterr().out)["predicted_step_s"]
    assert steps[slow] > 100 * steps[fast]


def test_a_profile_that_is_no_profile_is_refused_naming_the_writers(tmp_path, cache, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nvme_gbps": 3}))
    assert main(["plan", "--profile", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown hardware profile key(s) ['nvme_gbps']" in err and "luwu calibrate --out" in err
    assert main(["plan", "--profile", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_train_plans_with_the_profile_and_says_so_first(tmp_path, cache, capsys):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"compute_flops": 1e9}))
    assert main(["train", "--steps", "1", "--eval-every", "0", "--quiet", "--device-mem", "256MiB", "--host-mem",
                 "256MiB", "--nvme-dir", str(tmp_path / "nvme"), "--profile", str(path)]) == 0
    err = capsys.readouterr().err
    first = next(line for line in err.splitlines() if line.startswith("gpt-tiny:"))
    assert first.endswith(f"planned with the profile {path}")


def test_the_engine_plans_with_the_config_profile(tmp_path, cache):
    from luwu_rt.config import from_mapping
    from luwu_rt.engine import Engine, TrainConfig

    steps = {}
    for flops in (1e9, 1e15):
        path = tmp_path / f"{flops:g}.json"
        path.write_text(json.dumps({"compute_flops": flops}))
        config = from_mapping(TrainConfig, {"profile": str(path), "offload": {"device_mem": "256MiB",
                                                                               "host_mem": "256MiB"}})
        with Engine(None, config, materialize=False) as engine:
            assert engine.profile_choice.source == "file"
            steps[flops] = engine.predicted.predicted_step_s
    assert steps[1e9] > 100 * steps[1e15]


def test_cache_is_keyed_by_the_machine(cache):
    a = cached_profile_path({"cpu": "A", "cores": 2, "gpus": [], "ram_gib": 24, "device": "cpu"})
    b = cached_profile_path({"cpu": "A", "cores": 4, "gpus": [], "ram_gib": 24, "device": "cpu"})
    assert a != b and a.parent == b.parent == cache / "profiles"
    assert choose_profile(None).source == "builtin"  # nothing cached for this machine
    cached_profile_path().parent.mkdir(parents=True)
    cached_profile_path().write_text(json.dumps({"compute_flops": 5e11}))
    assert choose_profile("auto").profile.compute_flops == 5e11
    assert choose_profile("builtin").profile == HardwareProfile()


def test_a_rank_gets_its_share_of_a_calibrated_machine():
    base = HardwareProfile(compute_flops=8e10, host_optim_params_per_s=4e8, h2d_gbps=2.0, net_gbps=1.0,
                           nvme_read_gbps=3.0, nvme_write_gbps=4.0, node_nvme_read_gbps=3.0)
    machine = {"_machine": {"device": "cpu"}}
    one = per_rank(ProfileChoice(profile=base, source="file", notes=machine), local_ranks=2)
    assert one.compute_flops == 4e10 and one.host_optim_params_per_s == 2e8 and one.h2d_gbps == 1.0
    assert one.net_gbps == 1.0, "the network is each rank's own"
    assert (one.nvme_read_gbps, one.nvme_write_gbps) == (1.5, 2.0), "the ranks' NVMe tiers share one disk"
    assert one.node_nvme_read_gbps == 3.0, "the optimizer node's disk is its own"
    gpu = per_rank(ProfileChoice(profile=base, source="file", notes={"_machine": {"device": "cuda"}}), local_ranks=2)
    assert gpu.compute_flops == 8e10 and gpu.nvme_read_gbps == 1.5, "each GPU computes alone, but shares the disk"
    # A hand-written profile (no _machine) gives per-rank figures already.
    assert per_rank(ProfileChoice(profile=base, source="file"), local_ranks=8) == base


def test_profile_notes_are_not_read_but_unknown_keys_are_refused(tmp_path):
    assert HardwareProfile.from_dict({"_sources": {"x": "y"}, "net_gbps": 3}).net_gbps == 3.0
    with pytest.raises(ValueError, match="between 0 and 1"):
        HardwareProfile(cpu_overlap=1.5)


def test_the_testbed_profile_documents_every_figure():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "profiles" / "luwu-testbed.json"
    values = json.loads(path.read_text())
    keys = {k for k in values if not k.startswith("_")}
    assert keys and keys <= set(values["_sources"]), f"no source for {sorted(keys - set(values['_sources']))}"
    profile, notes = read_profile(path)
    assert "_machine" not in notes and profile.net_gbps == 12.5  # 100 Gb/s


def test_ranks_measure_their_compute_side_by_side():
    """[Note: the compute rate of ranks side by side] (cli/probes.py): each of the ranks, pinned to its share of
    the cores, measures the model at once; the rate is a rank's times the ranks, so that ``per_rank`` gives
    back what a rank measured."""
    from luwu_rt.cli import probes

    got = probes.compute_rate("gpt-tiny", batch_size=1, seq_len=16, steps=2, ranks=2)
    assert got["ranks"] == 2 and len(got["rank_flops"]) == 2 and all(f > 0 for f in got["rank_flops"])
    assert got["flops"] == pytest.approx(sum(got["rank_flops"]))  # twice the median of two
    with pytest.raises(RuntimeError, match="compute probe of rank [01] of 2 failed: .*no-such-model"):
        probes.compute_rate("no-such-model", batch_size=1, seq_len=16, ranks=2)
