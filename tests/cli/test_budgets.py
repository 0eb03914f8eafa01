"""Issue 19 items 3 and 4: budgets for real models. A run that names no budget gets a share of this machine
(the demo gpt-tiny keeps its three-tier showcase); a model that does not fit is refused with budgets that
do, every one planned with before it is suggested, every raised limit at once; a refused run leaves
nothing behind ([Note: automatic budgets] in engine/budgets.py, [Note: suggesting budgets] in
plan/search.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from luwu_rt.cli.main import main
from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.engine.budgets import DEMO_BUDGETS, machine_budgets, resolve_budgets
from luwu_rt.plan import Budgets, DoesNotFit, Placement, flag_size, parse_size, plan_auto, plan_step

DEVICE_TYPE = "cuda" if torch.cuda.is_available() else "cpu"


def _plan(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["plan", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def _options(reason: str) -> list[list[str]]:
    """The flags of each remedy in a does-not-fit message ("it plans with A, or with B")."""
    advice = reason.split("; it plans with ", 1)[1].split(" (pass ")[0]
    out = []
    for option in advice.split(", or with "):
        flags = re.findall(r"(--device-mem|--host-mem) (\S+)", option)
        nvme = re.search(r"--nvme-dir on a disk with (\S+) free", option)
        out.append([a for f, v in flags for a in (f, v)] + (["--nvme-size", nvme.group(1)] if nvme else []))
    return out


def test_auto_budgets_are_the_demos_for_gpt_tiny_and_the_machines_otherwise() -> None:
    assert resolve_budgets("auto", "auto", demo=True, device_type=DEVICE_TYPE) == DEMO_BUDGETS
    assert resolve_budgets(1 << 30, "auto", demo=True, device_type=DEVICE_TYPE) == (1 << 30, DEMO_BUDGETS[1])
    assert resolve_budgets(5, 7, demo=False, device_type=DEVICE_TYPE) == (5, 7)
    device, host = resolve_budgets("auto", "auto", demo=False, device_type=DEVICE_TYPE)
    mine = machine_budgets(device_type=DEVICE_TYPE)
    assert device == pytest.approx(mine[0], rel=0.1) and host == pytest.approx(mine[1], rel=0.1)
    assert device > 64 * DEMO_BUDGETS[0] and host > 64 * DEMO_BUDGETS[1]  # a real machine, not the demo
    two = machine_budgets(device_type="cpu", local_ranks=2)  # ranks on one machine share its RAM
    assert two[1] == pytest.approx(machine_budgets(device_type="cpu")[1] / 2, rel=0.1)


def test_plan_sizes_budgets_from_the_machine_except_for_the_demo(capsys) -> None:
    code, demo = _plan(capsys)
    assert code == 0 and (demo["budgets"]["device"], demo["budgets"]["host"]) == DEMO_BUDGETS
    # gpt-125m did not fit the demo's 88 MiB / 6 MiB; with this machine's budgets it plans.
    code, out = _plan(capsys, "--model", "gpt-125m")
    assert code == 0 and out["fits"], out.get("reason")
    mine = machine_budgets(device_type=DEVICE_TYPE)
    assert out["budgets"]["device"] == pytest.approx(mine[0], rel=0.1)


@pytest.fixture(scope="module")
def long_gpt2(tmp_path_factory):
    """A 0.12M-parameter GPT-2 whose activations (1024 positions, vocabulary 2000) overflow the demo's
    88 MiB at the default batch: the README's fine-tuning case that did not fit."""
    transformers = pytest.importorskip("transformers", reason="transformers comes with the test extra")
    folder = tmp_path_factory.mktemp("gpt2-long")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=2000, n_positions=1024,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(folder)
    return folder


def test_a_fine_tuning_run_without_budgets_plans_and_one_too_small_names_budgets_that_do(long_gpt2) -> None:
    with Engine(None, TrainConfig(model=f"hf:{long_gpt2}"), materialize=False) as engine:
        mine = machine_budgets(device_type=DEVICE_TYPE)
        assert engine.plan.budgets.device_bytes == pytest.approx(mine[0], rel=0.1)
    # The demo's 88 MiB hold no longer every unit's graph: auto keeps fewer, and the run plans (it was refused
    # with every graph kept, [Note: kept graphs chosen by the budget] in engine/kept.py).
    demo = {"model": f"hf:{long_gpt2}", "offload": {"device_mem": "88MiB", "host_mem": "6MiB"}}
    with Engine(None, from_mapping(TrainConfig, demo), materialize=False) as engine:
        assert 0 < len(engine.keep_graph) < engine.chain.num_units - 1
    small = {**demo, "offload": {"device_mem": "32MiB", "host_mem": "6MiB"}}  # too small even to recompute
    with pytest.raises(DoesNotFit) as info:
        Engine(None, from_mapping(TrainConfig, small), materialize=False)
    assert "--device-mem" in str(info.value)
    for flags in _options(str(info.value)):
        given = dict(zip(flags[::2], flags[1::2]))
        offload = {"device_mem": given.get("--device-mem", "32MiB"), "host_mem": given.get("--host-mem", "6MiB")}
        with Engine(None, from_mapping(TrainConfig, {**small, "offload": offload}), materialize=False):
            pass  # the suggested budgets plan


def test_does_not_fit_names_every_limit_at_once_and_each_suggestion_plans(capsys) -> None:
    base = ["--model", "gpt-small", "--keep-graphs", "none", "--batch-size", "2", "--seq-len", "64"]
    code, out = _plan(capsys, *base, "--device-mem", "8MiB", "--host-mem", "1MiB", "--nvme-size", "0")
    assert code == 1 and not out["fits"]
    options = _options(out["reason"])
    assert len(options) == 2, out["reason"]
    # Device and host are both short: one message says both, with the NVMe alternative beside them.
    assert "--device-mem" in options[0] and "--host-mem" in options[0], out["reason"]
    assert "--nvme-size" in options[1], out["reason"]
    for flags in options:
        given = dict(zip(flags[::2], flags[1::2]))
        argv = ["--device-mem", given.get("--device-mem", "8MiB"), "--host-mem", given.get("--host-mem", "1MiB"),
                "--nvme-size", given.get("--nvme-size", "0")]
        code, planned = _plan(capsys, *base, *argv)
        assert code == 0 and planned["fits"], (argv, planned.get("reason"))


def test_remedies_plan_with_plan_auto() -> None:
    from luwu_rt.models.presets import get_preset
    from luwu_rt.plan import gpt_model_spec

    model = gpt_model_spec(get_preset("gpt-small"), batch_size=1, seq_len=128)
    for budgets in (Budgets(device_bytes=1 << 20, host_bytes=1 << 20, nvme_bytes=0),
                    Budgets(device_bytes=model.activation_bytes + (1 << 20), host_bytes=1 << 20, nvme_bytes=1 << 20),
                    Budgets(device_bytes=1 << 20, host_bytes=1 << 20)):
        with pytest.raises(DoesNotFit) as info:
            plan_auto(model, budgets=budgets)
        assert info.value.remedies, str(info.value)
        for remedy in info.value.remedies:
            plan_auto(model, budgets=remedy.budgets)  # plans: no exception
            for tier in ("device", "host"):  # values a flag spells: printed is planned
                have = remedy.budgets.of(tier)
                assert parse_size(flag_size(have)) == have


def test_bench_offload_step_suggests_a_host_budget_that_plans(capsys, tmp_path) -> None:
    """The README's command with 1 GiB: the suggestion was the lower bound (733 MiB), which failed the same
    way; now it is a value that plans (checked here by planning, not by running 3 GB of IO)."""
    from luwu_rt.cli.bench_offload import _model_spec

    nvme = tmp_path / "nv"
    assert main(["bench", "offload-step", "--params", "256M", "--host-mem", "1GiB", "--nvme-dir", str(nvme)]) == 2
    err = capsys.readouterr().err
    suggested = re.search(r"pass --host-mem (\S+) or more", err)
    assert suggested, err
    model = _model_spec(256_000_000, 16_000_000, 16 << 20)
    placement = Placement(params="host", optimizer="nvme", grads="host")
    plan_step(model, budgets=Budgets(device_bytes=0, host_bytes=parse_size(suggested.group(1))), placement=placement)
    assert parse_size(suggested.group(1)) > parse_size("733MiB") and not nvme.exists()
    plan_step(model, budgets=Budgets(device_bytes=0, host_bytes=parse_size("2GiB")), placement=placement)  # README


def test_a_refused_run_leaves_nothing_behind(tmp_path) -> None:
    existing = tmp_path / "existing-ckpt"
    existing.mkdir()
    for ckpt in (tmp_path / "new" / "ckpt", existing):
        r = subprocess.run([sys.executable, "-m", "luwu_rt", "train", "--steps", "1", "--quiet", "--device-mem", "1MiB",
                            "--nvme-dir", str(tmp_path / "made" / "nvme"), "--ckpt-dir", str(ckpt)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "does not fit" in r.stderr and "--device-mem" in r.stderr, r.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["existing-ckpt"]
        assert list(existing.iterdir()) == []  # not even a lock file
