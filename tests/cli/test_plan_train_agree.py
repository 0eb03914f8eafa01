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


@pytest.mark.parametrize("keep", ["none", "all"])
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
