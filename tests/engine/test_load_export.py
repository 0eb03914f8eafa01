"""Issue 13 item 8: an export loads into a freshly built model with one call, `load_export(model, path)`."""

from __future__ import annotations

import pytest
import torch

from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.ckpt.export import export, load_export
from luwu_rt.models.gpt import build_gpt


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load_export")
    config = from_mapping(TrainConfig, {"steps": 1, "batch_size": 2, "seq_len": 16,
                                        "offload": {"params": "host", "optimizer": "host", "grads": "host",
                                                    "device_mem": "64MiB", "host_mem": "64MiB"}})
    with Engine(None, config) as engine:
        engine.train_step()
        ckpt = engine.save(tmp / "ck")
        x = torch.randint(0, 256, (2, 16))
        yield ckpt, tmp, x, engine.evaluate([(x, x)])


@pytest.mark.parametrize("suffix", (".safetensors", ".pt"))
def test_load_export_into_a_meta_model(trained, suffix) -> None:
    ckpt, tmp, x, ref = trained
    out = export(ckpt, tmp / f"model{suffix}")
    model = load_export(build_gpt("gpt-tiny"), out)  # built on meta, as build_gpt does by default
    assert not any(p.is_meta for p in model.parameters())
    with torch.no_grad():
        assert float(model(x, x)) == pytest.approx(ref, rel=1e-5)


def test_load_export_names_a_wrong_model(trained) -> None:
    ckpt, tmp, _, _ = trained
    out = export(ckpt, tmp / "model.safetensors")
    with pytest.raises(ValueError, match="has no values for"):
        load_export(build_gpt("gpt-small"), out)
