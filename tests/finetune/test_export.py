"""``luwu ckpt export --format hf``: a folder that ``from_pretrained`` loads, with the engine's weights."""

import argparse
import json

import pytest
import torch

from luwu_rt.cli import ckpt
from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig

from .conftest import VOCAB, transformers

BATCH, SEQ = 2, 16


def _config(tmp_path, model: str) -> TrainConfig:
    return from_mapping(TrainConfig, {
        "model": model, "steps": 2, "batch_size": BATCH, "seq_len": SEQ, "optim": {"warmup_steps": 0},
        "offload": {"params": "host", "optimizer": "host", "grads": "host", "device_mem": "64MiB",
                    "host_mem": "64MiB", "chunk_size": "64KiB"},
        "checkpoint": {"dir": str(tmp_path / "ckpt")}})


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _export(checkpoint, out, *extra: str) -> None:
    parser = argparse.ArgumentParser()
    ckpt.add_arguments(parser)
    assert ckpt.run(parser.parse_args(["export", str(checkpoint), "--format", "hf", "--out", str(out), *extra])) == 0


def _trained_and_exported(tmp_path, model: str, *extra: str):
    """Two steps, a checkpoint, its export; the engine's evaluation loss on a fresh batch and the export's."""
    with Engine(None, _config(tmp_path, model)) as engine:
        for i in range(2):
            engine.train_step(_batch(i))
        path = engine.save(tmp_path / "ckpt")
        x, y = _batch(99)
        expected = engine.evaluate([(x, y)])
    _export(path, tmp_path / "out", *extra)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="sdpa")
    with torch.no_grad():
        got = torch.nn.functional.cross_entropy(hf(input_ids=x).logits.flatten(0, 1), y.flatten()).item()
    return expected, got, hf


def test_hf_run_exports_sharded_and_loads(saved, tmp_path) -> None:
    name, folder, source = saved
    expected, got, hf = _trained_and_exported(tmp_path, f"hf:{folder}", "--max-shard-size", "40KB")
    assert got == pytest.approx(expected, rel=1e-5)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert set(index["weight_map"]) == set(source.state_dict()) - ({"lm_head.weight"} if name == "gpt2" else set())
    assert type(hf) is type(source)


def test_gpt_preset_exports_as_gpt2(tmp_path) -> None:
    expected, got, hf = _trained_and_exported(tmp_path, "gpt-tiny")
    assert isinstance(hf, transformers.GPT2LMHeadModel)
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert got == pytest.approx(expected, rel=1e-5)


def test_a_model_without_an_hf_architecture_is_refused(tmp_path) -> None:
    modules = [torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)]
    with Engine(modules, _config(tmp_path, "gpt-tiny")) as engine:
        path = engine.save(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="not those of preset gpt-tiny; only hf:PATH runs and the built-in GPT"):
        _export(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
