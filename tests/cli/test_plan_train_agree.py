"""`luwu plan` and `luwu train` answer "does it fit, and where does each state go?" the same way: both
plan from the same ModelSpec, whose device reserve is the run's measured activations."""

import json

import pytest

from luwu_rt.cli.main import main
from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.engine.config import OffloadConfig
from luwu_rt.plan import DoesNotFit

BUDGETS_MIB = (8, 24, 60, 79, 84, 96, 256)


@pytest.mark.parametrize("keep", ["none", "all", "auto"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_plan_and_train_agree_on_a_grid_of_budgets(capsys, keep, dtype, grad_accum) -> None:
    for device_mib in BUDGETS_MIB:
        settings = {"model": "gpt-tiny", "batch_size": 16, "seq_len": 128, "grad_accum": grad_accum, "dtype": dtype,
                    "keep_graphs": keep, "optim": {"grad_clip": 1.0},
                    "offload": {"device_mem": f"{device_mib}MiB", "host_mem": "32MiB", "chunk_size": "4MiB"}}
        assert main(["plan", "--json", "--model", "gpt-tiny", "--batch-size", "16", "--seq-len", "128",
                     "--grad-accum", str(grad_accum), "--dtype", dtype, "--keep-graphs", keep, "--grad-clip", "1.0",
                     "--device-mem", f"{device_mib}MiB", "--host-mem", "32MiB", "--chunk-size", "4MiB",
                     "--nvme-size", "0"]) in (0, 1)  # the engine below has no NVMe tier: plan without one
        planned = json.loads(capsys.readouterr().out)
        try:
            engine = Engine(None, from_mapping(TrainConfig, settings), materialize=False)
        except DoesNotFit as exc:
            assert not planned["fits"], (device_mib, str(exc), planned)
            assert planned["reason"].startswith(str(exc)), (planned["reason"], str(exc))
            continue
        try:
            assert planned["fits"], (device_mib, planned["reason"])
            p = engine.placement
            assert planned["placement"] == {"params": p.params, "optimizer": p.optimizer, "grads": p.grads}
            assert planned["activation_bytes"] == engine.model_spec.activation_bytes
            assert planned["kept_graphs"]["count"] == len(engine.keep_graph)  # auto: as many in both
            assert planned["peak_bytes"] == dict(engine.plan.peak_bytes)
        finally:
            engine.close()


def test_with_no_flags_plan_answers_for_the_run_train_makes(tmp_path, capsys) -> None:
    """One source of defaults: `luwu plan` alone plans `luwu train` alone (model, batch, sequence, dtype,
    chunk size, budgets, kept graphs, clipping, and an NVMe tier on the current directory's disk, where
    train makes its scratch directory; the engine here gets such a directory as the CLI gives it one)."""
    assert main(["plan", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    config = TrainConfig(offload=OffloadConfig(nvme_dir=str(tmp_path / "luwu-scratch-test")))
    with Engine(None, config, materialize=False) as engine:
        p = engine.placement
        assert planned["model"] == engine.config.model
        assert planned["tokens_per_step"] == engine.model_spec.tokens_per_step
        assert planned["budgets"]["device"] == engine.plan.budgets.device_bytes  # "auto", resolved alike
        assert planned["budgets"]["host"] == engine.plan.budgets.host_bytes
        assert planned["activation_bytes"] == engine.model_spec.activation_bytes
        assert planned["placement"] == {"params": p.params, "optimizer": p.optimizer, "grads": p.grads}
        assert planned["peak_bytes"] == dict(engine.plan.peak_bytes)


def _agree(capsys, flags: list[str], settings: dict, *, model=None) -> dict:
    """`luwu plan FLAGS` and an engine of ``settings`` (what `luwu train FLAGS` builds) plan the same step."""
    assert main(["plan", "--json", "--nvme-size", "0", *flags]) == 0
    planned = json.loads(capsys.readouterr().out)
    with Engine(model, from_mapping(TrainConfig, settings), materialize=False) as engine:
        p = engine.placement
        assert planned["model"] == engine.config.model and planned["params"] == engine.chain.num_params
        assert planned["activation_bytes"] == engine.model_spec.activation_bytes
        assert planned["placement"] == {"params": p.params, "optimizer": p.optimizer, "grads": p.grads}
        assert planned["peak_bytes"] == dict(engine.plan.peak_bytes)
    return planned


@pytest.mark.parametrize("keep", ["0", "2", "4"])
def test_keep_graphs_n_plans_the_same(capsys, keep) -> None:
    """--keep-graphs N: a number of units in both commands (plan once read it from a string of its own)."""
    flags = ["--keep-graphs", keep, "--device-mem", "128MiB", "--host-mem", "64MiB"]
    settings = {"keep_graphs": int(keep), "offload": {"device_mem": "128MiB", "host_mem": "64MiB"}}
    planned = _agree(capsys, flags, settings)
    assert planned["fits"]


@pytest.mark.parametrize("clip, dtype", [("0", "fp32"), ("0", "fp16"), ("1.0", "bf16")])
def test_the_optimizer_waits_for_backward_alike(capsys, clip, dtype) -> None:
    """Clipping or fp16 (its overflow check) makes each update wait for the whole backward: one rule, the
    engine's, in both commands."""
    flags = ["--grad-clip", clip, "--dtype", dtype, "--keep-graphs", "none", "--host-mem", "64MiB"]
    settings = {"keep_graphs": "none", "dtype": dtype, "optim": {"grad_clip": float(clip)},
                "offload": {"host_mem": "64MiB"}}
    _agree(capsys, flags, settings)


def test_hf_model_plans_as_it_trains(capsys, tmp_path) -> None:
    """--model hf:PATH works in plan as in train (plan once took presets only)."""
    transformers = pytest.importorskip("transformers", reason="transformers comes with the test extra")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=256, n_positions=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    model = f"hf:{tmp_path / 'model'}"
    flags = ["--model", model, "--batch-size", "2", "--seq-len", "32", "--host-mem", "64MiB"]
    planned = _agree(capsys, flags, {"model": model, "batch_size": 2, "seq_len": 32, "offload": {"host_mem": "64MiB"}})
    assert planned["fits"] and planned["tokens_per_step"] == 64
    # --seq-len 0 is the model's own maximum (its n_positions), as for a preset.
    assert main(["plan", "--json", "--nvme-size", "0", *flags, "--seq-len", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens_per_step"] == 2 * 64
    assert main(["plan", *flags, "--seq-len", "65"]) == 2
    assert "takes at most 64 tokens per sequence" in capsys.readouterr().err
