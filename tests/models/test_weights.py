"""Where the engine's first weights come from: the user's tensors, or the seed for a model on meta."""

import logging

import pytest
import torch
from torch import nn

from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.models.units import chain_from_sequential

VOCAB, WIDTH = 64, 16


def _config(tmp_path) -> TrainConfig:
    return from_mapping(TrainConfig, {
        "steps": 1, "batch_size": 2, "seq_len": 8,
        "offload": {"params": "host", "optimizer": "host", "grads": "host", "device_mem": "64MiB",
                    "host_mem": "64MiB", "chunk_size": "64KiB"}})


def _modules() -> list[nn.Module]:
    return [nn.Embedding(VOCAB, WIDTH), nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()), nn.Linear(WIDTH, VOCAB)]


def _masters(engine: Engine) -> list[torch.Tensor]:
    return [engine.store.read_state(u, "master", torch.empty(engine.chain.num_unit_params(u)))
            for u in range(engine.chain.num_units)]


def test_real_weights_are_the_start_and_are_released(tmp_path, caplog) -> None:
    model = nn.Sequential(*_modules())
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(0.5 + i)
    expected = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in model]
    with caplog.at_level(logging.INFO, logger="luwu_rt.models.weights"), Engine(model, _config(tmp_path)) as engine:
        assert engine.weights_source.startswith("weights from the model's own parameters")
        for got, want in zip(_masters(engine), expected):
            assert torch.equal(got, want)
        # The store holds the only copy: the user's module was released to meta unit by unit.
        assert all(p.is_meta for p in model.parameters())
    assert "model's own parameters" in caplog.text


def test_model_on_meta_starts_from_the_seed(tmp_path, caplog) -> None:
    with torch.device("meta"):
        model = nn.Sequential(*_modules())
    reference = chain_from_sequential(_modules())
    for u in range(reference.num_units):
        reference.materialize(u, seed=0)
    with caplog.at_level(logging.INFO, logger="luwu_rt.models.weights"), Engine(model, _config(tmp_path)) as engine:
        assert engine.weights_source == "weights initialised from seed 0 (model on meta)"
        for u, got in enumerate(_masters(engine)):
            assert torch.equal(got, torch.cat([p.detach().reshape(-1) for p in reference.own_params(u)]))
    assert "seed 0" in caplog.text


def test_half_real_half_meta_is_refused(tmp_path) -> None:
    modules = _modules()
    with torch.device("meta"):
        modules[2] = nn.Linear(WIDTH, VOCAB)
    with pytest.raises(ValueError, match=r"partly on the meta device \(2:Linear.weight\) and partly real"):
        Engine(modules, _config(tmp_path))
