"""Reading a model's first weights from safetensors shards, one unit at a time.

[Note: streaming a checkpoint in]
A pretrained checkpoint can be larger than host memory, so it is never loaded
whole: the chain stays on meta, every shard is opened with ``safe_open``
(which maps the file and reads only the header), and unit ``u``'s flat fp32
buffer is filled tensor by tensor from the mapped files. The anonymous memory
this takes is one unit's flat buffer plus one tensor being converted; pages of
the mapped files are file-backed and the kernel may drop them at any time.

Every name and shape is checked against the headers before the first unit is
read, so a checkpoint for another model fails at once, naming the tensor,
rather than after minutes of loading.

[Note: checkpoint names]
A parameter is looked up under every name it has in the whole model
(``named_parameters(remove_duplicate=False)``: a tied ``lm_head.weight`` is
also ``transformer.wte.weight``, and ``save_pretrained`` keeps only one of
them), then without the Hugging Face base-model prefix (a checkpoint saved
from ``GPT2Model`` rather than ``GPT2LMHeadModel``), then as
``<unit prefix>.<name>``, the name this project's export gives a parameter
that the whole model does not hold. The first name is the canonical one,
which the Hugging Face export writes.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch
from torch import nn

from luwu_rt.models.units import UnitChain

__all__ = ["SafetensorsIn", "checkpoint_names", "shard_files"]

INDEX = "model.safetensors.index.json"

# Buffers that older checkpoints saved although current models rebuild them: GPT-2's causal mask and
# Llama's rotary frequencies. They are not parameters, so they are skipped rather than unexpected.
_BUFFER_KEYS = (re.compile(r"\.attn\.(masked_)?bias$"), re.compile(r"rotary_emb\.inv_freq$"))


def checkpoint_names(chain: UnitChain) -> list[list[tuple[str, list[str]]]]:
    """Per unit, per own parameter: its name in the unit and the names it may have in a checkpoint,
    canonical first ([Note: checkpoint names])."""
    whole = getattr(chain, "model", None)
    whole = whole if isinstance(whole, nn.Module) else None
    aliases: dict[int, list[str]] = {}
    prefixes: dict[int, str] = {}
    base = ""
    if whole is not None:
        for name, p in whole.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        prefixes = {id(m): name for name, m in whole.named_modules()}
        base = getattr(whole, "base_model_prefix", "") or ""
    out = []
    for u in range(chain.num_units):
        prefix = prefixes.get(id(chain.units[u]), chain.names[u])
        unit = []
        for name, p in chain.named_own_params(u):
            names = list(aliases.get(id(p), []))
            names += [n[len(base) + 1:] for n in names if base and n.startswith(base + ".")]
            names.append(f"{prefix}.{name}")
            unit.append((name, list(dict.fromkeys(names))))
        out.append(unit)
    return out


def shard_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: a file, a folder with an index, or a folder of shards."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint file or folder (check --init-from / hf:PATH)")
    index = path / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({exc}); re-save the model with save_pretrained")
        files = [path / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise FileNotFoundError(f"{f}: listed in {INDEX} but missing; copy the whole model folder")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = (f" (it holds {', '.join(other[:3])}: re-save with save_pretrained(..., safe_serialization=True))"
                if other else "")
        raise ValueError(f"{path}: no .safetensors files{hint}")
    return files


class SafetensorsIn:
    """The first weights of ``chain``'s units from the safetensors checkpoint at ``path``
    ([Note: streaming a checkpoint in])."""

    def __init__(self, path: str | os.PathLike, chain: UnitChain) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        self.files = shard_files(path)
        self._handles = []
        where: dict[str, object] = {}
        for f in self.files:
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as exc:  # safetensors raises its own error type for a bad header or size
                raise ValueError(f"{f}: not a readable safetensors file ({exc}); the file is truncated or "
                                 "corrupted: copy or save it again") from None
            self._handles.append(handle)
            for key in handle.keys():
                where[key] = handle
        self._units = self._resolve(chain, where)

    def _resolve(self, chain: UnitChain, where: dict[str, object]) -> list[list[tuple[str, object, tuple]]]:
        units, used = [], set()
        for u, params in enumerate(checkpoint_names(chain)):
            layout = {spec.name: spec.shape for spec in chain.layout(u)}
            unit = []
            for name, names in params:
                key = next((n for n in names if n in where), None)
                if key is None:
                    raise ValueError(f"tensor {names[0]!r} (unit {chain.names[u]}) is missing from {self.path} "
                                     f"({len(where)} tensors in {len(self.files)} files); the checkpoint is for "
                                     "another model: pass the folder whose config built this model")
                shape = tuple(where[key].get_slice(key).get_shape())
                if shape != tuple(layout[name]):
                    raise ValueError(f"tensor {key!r} in {self.path} has shape {list(shape)}, but the model's "
                                     f"{names[0]!r} has {list(layout[name])}; the checkpoint is for another "
                                     "model size: use the config.json saved with these weights")
                used.update(names)
                unit.append((key, where[key], shape))
            units.append(unit)
        ignored = _ignored(chain)
        unexpected = sorted(k for k in where if k not in used and not ignored(k))
        if unexpected:
            more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
            raise ValueError(f"{self.path} holds tensors the model has no parameter for: "
                             f"{', '.join(map(repr, unexpected[:3]))}{more}; the checkpoint is for another "
                             "model (more layers, another architecture)")
        return units

    def describe(self) -> str:
        return f"{self.path} ({len(self.files)} safetensors file{'s' * (len(self.files) > 1)})"

    def unit(self, u: int) -> torch.Tensor:
        """Unit ``u``'s flat fp32 weights; one tensor at a time is converted into the preallocated buffer."""
        params = self._units[u]
        flat = torch.empty(sum(math.prod(shape) for _, _, shape in params), dtype=torch.float32)
        offset = 0
        for key, handle, shape in params:
            n = math.prod(shape)
            try:
                tensor = handle.get_tensor(key)
            except Exception as exc:
                raise ValueError(f"{self.path}: tensor {key!r} cannot be read ({exc}); the file is corrupted: "
                                 "copy or save it again") from None
            flat[offset:offset + n].copy_(tensor.reshape(-1))
            del tensor
            offset += n
        return flat


def _ignored(chain: UnitChain):
    """A predicate on checkpoint keys that are not parameters but may be present: buffers the model
    rebuilds, and what Hugging Face itself ignores on load."""
    whole = getattr(chain, "model", None)
    buffers: set[str] = set()
    patterns = list(_BUFFER_KEYS)
    if isinstance(whole, nn.Module):
        base = getattr(whole, "base_model_prefix", "") or ""
        for name, _ in whole.named_buffers():
            buffers.add(name)
            if base and name.startswith(base + "."):
                buffers.add(name[len(base) + 1:])
        patterns += [re.compile(p) for p in getattr(whole, "_keys_to_ignore_on_load_unexpected", None) or []]
    return lambda key: key in buffers or any(p.search(key) for p in patterns)
