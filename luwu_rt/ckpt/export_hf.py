"""Checkpoint export to a Hugging Face model folder that ``from_pretrained`` loads.

[Note: streaming an export out]
The export never holds the whole model: units are read from the checkpoint one
at a time (their fp32 master weights, joined from any number of ranks' slices),
cut into tensors under the names the Hugging Face model gives them, and
gathered into a shard that is written as soon as the next tensor would push it
past ``max_shard_bytes``. Memory is one unit plus one shard. The folder is
written under a temporary name and renamed at the end, so a failed export
leaves nothing that looks like a model.

Sources: an ``hf:PATH`` run exports under its model's own names (read from
``config.json`` in PATH, whose tokenizer and generation files are copied
along); a built-in GPT preset exports as a ``GPT2LMHeadModel``, whose layout it
shares (pre-LN blocks, learned positions, fused QKV, biases, exact GELU), with
the linear weights transposed into GPT-2's ``Conv1D`` layout.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from luwu_rt.ckpt.format import CheckpointReader

__all__ = ["export_hf"]

# Files of a model folder that describe how to use the weights rather than the weights themselves.
_COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "vocab.json", "merges.txt", "tokenizer.model")

# GPT preset parameter (within a block) -> GPT-2 name, and whether the weight is transposed (Conv1D stores
# (in, out) where nn.Linear stores (out, in)).
_GPT2_BLOCK = {"ln_1.weight": ("ln_1.weight", False), "ln_1.bias": ("ln_1.bias", False),
               "attn.qkv.weight": ("attn.c_attn.weight", True), "attn.qkv.bias": ("attn.c_attn.bias", False),
               "attn.proj.weight": ("attn.c_proj.weight", True), "attn.proj.bias": ("attn.c_proj.bias", False),
               "ln_2.weight": ("ln_2.weight", False), "ln_2.bias": ("ln_2.bias", False),
               "mlp.fc.weight": ("mlp.c_fc.weight", True), "mlp.fc.bias": ("mlp.c_fc.bias", False),
               "mlp.proj.weight": ("mlp.c_proj.weight", True), "mlp.proj.bias": ("mlp.c_proj.bias", False)}

Rename = Callable[[int, str, torch.Tensor], tuple[str, torch.Tensor]]


def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
              max_shard_bytes: int = 2 << 30) -> Path:
    """Writes ``out/`` (config.json, safetensors shards and their index) from ``checkpoint``
    ([Note: streaming an export out]); returns ``out``."""
    from luwu_rt.models.hf import _require_transformers

    transformers = _require_transformers()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty; give a new folder for the exported model")
    if max_shard_bytes <= 0:
        raise ValueError(f"--max-shard-size must be positive, got {max_shard_bytes} bytes")
    reader = CheckpointReader(checkpoint)
    model_name = reader.meta["config"]["model"]
    if model_name.startswith("hf:"):
        config, rename, source = _hf_source(reader, model_name[3:])
    else:
        config, rename, source = _gpt_source(reader, model_name, transformers), _gpt2_name, None
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        config.save_pretrained(tmp)
        for name in _COPIED:
            if source is not None and (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
        _write_shards(_tensors(reader, rename, dtype), tmp, max_shard_bytes=max_shard_bytes)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _tensors(reader: CheckpointReader, rename: Rename, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter under its exported name, one unit read at a time."""
    for u, unit in enumerate(reader.meta["model"]["units"]):
        numel = sum(math.prod(shape) for _, shape in unit["params"])
        flat = reader.read_joined(f"u{u}.master", numel)
        offset = 0
        for name, shape in unit["params"]:
            n = math.prod(shape)
            key, tensor = rename(u, name, flat[offset:offset + n].reshape(shape))
            yield key, tensor.to(dtype).contiguous()
            offset += n


def _write_shards(tensors: Iterator[tuple[str, torch.Tensor]], folder: Path, *, max_shard_bytes: int) -> None:
    """Shards as ``save_pretrained`` names them (one file without an index when it all fits in one)."""
    from safetensors.torch import save_file

    names: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        save_file(shard, str(folder / f"part-{len(names)}.tmp"), metadata={"format": "pt"})
        names.append(list(shard))
        shard.clear()

    for key, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        shard[key] = tensor
        size += nbytes
        total += nbytes
    if shard or not names:
        flush()
    if len(names) == 1:
        os.replace(folder / "part-0.tmp", folder / "model.safetensors")
        return
    weight_map = {}
    for i, keys in enumerate(names):
        file = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        os.replace(folder / f"part-{i}.tmp", folder / file)
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _hf_source(reader: CheckpointReader, folder: str) -> tuple[object, Rename, Path]:
    """The config of an ``hf:PATH`` run and the canonical name of each of its parameters."""
    from luwu_rt.models.hf import load_pretrained_chain
    from luwu_rt.models.safetensors_in import checkpoint_names

    source = Path(folder)
    if not (source / "config.json").is_file():
        raise ValueError(f"the checkpoint was trained from hf:{folder}, whose config.json is gone; put the model "
                         "folder back there (only its config.json is needed)")
    chain = load_pretrained_chain(source)
    _check_layout(reader, chain, f"the model built from {source / 'config.json'} (its config changed since training)")
    names = checkpoint_names(chain)
    canonical = [{name: aliases[0] for name, aliases in unit} for unit in names]
    return chain.model.config, lambda u, name, t: (canonical[u][name], t), source


def _check_layout(reader: CheckpointReader, chain, what: str) -> None:
    """The checkpoint must hold exactly ``chain``'s parameters (a user's own model trained under a preset's
    config name does not)."""
    ours = [[[spec.name, list(spec.shape)] for spec in chain.layout(u)] for u in range(chain.num_units)]
    theirs = [[[n, list(shape)] for n, shape in unit["params"]] for unit in reader.meta["model"]["units"]]
    if ours != theirs:
        raise ValueError(f"the checkpoint's parameters are not those of {what}; only hf:PATH runs and the built-in "
                         "GPT presets export as a Hugging Face folder: export with --out FILE (.safetensors) instead")


def _gpt_source(reader: CheckpointReader, model_name: str, transformers):
    """A GPT-2 config with the preset's shapes; the preset's layout is GPT-2's ([Note: streaming an export out])."""
    from luwu_rt.models.gpt import build_gpt
    from luwu_rt.models.presets import get_preset

    try:
        shape = get_preset(model_name)
    except (KeyError, ValueError):
        raise ValueError(f"cannot export model {model_name!r} as a Hugging Face folder: only hf:PATH runs and the "
                         "built-in GPT presets have a Hugging Face architecture; export with --out FILE "
                         "(.safetensors) instead") from None
    _check_layout(reader, build_gpt(shape), f"preset {model_name}")
    return transformers.GPT2Config(
        n_layer=shape.num_layers, n_embd=shape.d_model, n_head=shape.num_heads, vocab_size=shape.vocab_size,
        n_positions=shape.max_seq_len, n_inner=shape.ffn_mult * shape.d_model, activation_function="gelu",
        layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=shape.tie_embeddings, bos_token_id=0, eos_token_id=0)


def _gpt2_name(u: int, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A GPT preset's parameter under its GPT-2 name (unit 0: embeddings, 1..L: blocks, last: head)."""
    if name.startswith(("wte.", "wpe.")):
        return f"transformer.{name}", tensor
    if name.startswith("ln_f."):
        return f"transformer.{name}", tensor
    if name == "lm_head.weight":
        return name, tensor
    key, transpose = _GPT2_BLOCK[name]
    return f"transformer.h.{u - 1}.{key}", tensor.t() if transpose else tensor
