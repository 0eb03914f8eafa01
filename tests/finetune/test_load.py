"""Streaming a saved model folder into the store: names, shapes and corrupt files."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.models.safetensors_in import checkpoint_names

from .conftest import save_tiny


def _config(**extra) -> TrainConfig:
    base = {"steps": 1, "batch_size": 2, "seq_len": 8,
            "offload": {"params": "host", "optimizer": "host", "grads": "host", "device_mem": "64MiB",
                        "host_mem": "64MiB", "chunk_size": "64KiB"}}
    return from_mapping(TrainConfig, {**base, **extra})


def _expected(engine: Engine, model) -> list[torch.Tensor]:
    state = model.state_dict()
    return [torch.cat([state[names[0]].reshape(-1) for _, names in unit])
            for unit in checkpoint_names(engine.chain)]


def _masters(engine: Engine) -> list[torch.Tensor]:
    return [engine.store.read_state(u, "master", torch.empty(engine.chain.num_unit_params(u)))
            for u in range(engine.chain.num_units)]


def test_hf_folder_is_streamed_into_the_store(saved) -> None:
    name, folder, model = saved
    with Engine(None, _config(model=f"hf:{folder}")) as engine:
        assert engine.weights_source.startswith(f"weights from {folder} (")
        assert all(p.is_meta for p in engine.chain.model.parameters())  # never materialised whole
        for got, want in zip(_masters(engine), _expected(engine, model)):
            assert torch.equal(got, want)


def test_init_from_a_folder_into_a_model_built_elsewhere(saved) -> None:
    name, folder, model = saved
    from luwu_rt.models.hf import build_hf_chain

    with Engine(build_hf_chain(model.config), _config(), init_from=folder) as engine:
        for got, want in zip(_masters(engine), _expected(engine, model)):
            assert torch.equal(got, want)


def _shard_of(folder, key):
    return folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][key]


@pytest.mark.parametrize("damage", ["truncated", "corrupted header", "missing tensor", "shape mismatch",
                                    "unexpected tensor"])
def test_a_damaged_folder_is_one_clear_error(tmp_path, damage) -> None:
    folder = tmp_path / "src"
    save_tiny("llama", folder)
    key = "model.layers.1.mlp.up_proj.weight"
    shard = _shard_of(folder, key)
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
        message = rf"{shard.name}: not a readable safetensors file .*truncated or corrupted"
    elif damage == "corrupted header":
        data = bytearray(shard.read_bytes())
        data[8:24] = b"\xff" * 16
        shard.write_bytes(bytes(data))
        message = rf"{shard.name}: not a readable safetensors file"
    else:
        tensors = load_file(shard)
        if damage == "missing tensor":
            del tensors[key]
            message = rf"tensor '{key}' \(unit layer1\) is missing from"
        elif damage == "shape mismatch":
            tensors[key] = tensors[key][:-1]
            message = rf"tensor '{key}' in .* has shape \[63, 32\], but the model's '{key}' has \[64, 32\]"
        else:
            tensors["model.layers.2.mlp.up_proj.weight"] = tensors[key].clone()
            message = r"holds tensors the model has no parameter for: 'model.layers.2.mlp.up_proj.weight'"
        save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        Engine(None, _config(model=f"hf:{folder}"))


def test_hf_path_without_a_config_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"holds no config.json; hf:PATH takes a local model folder"):
        _config(model=f"hf:{tmp_path}")


def test_init_from_this_projects_export(tmp_path) -> None:
    from luwu_rt.ckpt.export import export

    config = _config(model="gpt-tiny", seed=5, checkpoint={"dir": str(tmp_path / "ckpt")})
    with Engine(None, config) as trained:
        trained.train_step((torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))))
        expected = _masters(trained)
        path = trained.save(tmp_path / "ckpt")
    file = export(path, tmp_path / "model.safetensors")
    with Engine(None, _config(model="gpt-tiny"), init_from=file) as engine:
        assert engine.weights_source == f"weights from {file} (1 safetensors file)"
        for got, want in zip(_masters(engine), expected):
            assert torch.equal(got, want)


def test_base_model_names_and_saved_buffers_are_accepted(tmp_path) -> None:
    from luwu_rt.models.hf import build_hf_chain

    model = save_tiny("gpt2", tmp_path / "full")
    # GPT2Model's own names (no "transformer." prefix, no lm_head: it is tied), plus the causal-mask buffer
    # that older GPT-2 checkpoints saved.
    state = {k.removeprefix("transformer."): v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state["h.0.attn.bias"] = torch.ones(1, 1, 4, 4)
    save_file(state, tmp_path / "base.safetensors")
    with Engine(build_hf_chain(model.config), _config(), init_from=tmp_path / "base.safetensors") as engine:
        for got, want in zip(_masters(engine), _expected(engine, model)):
            assert torch.equal(got, want)
