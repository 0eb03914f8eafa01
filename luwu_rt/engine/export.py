"""Checkpoint export to a plain state dict (``torch.save``) or a safetensors file.

The fp32 master weights of each unit are cut back into the model's parameters
by the names and shapes recorded in the checkpoint, under the names they have
in the whole model's ``state_dict`` (for the built-in GPT:
``chain.model.load_state_dict(...)`` loads the export directly).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from luwu_rt.engine.checkpoint import CheckpointReader

__all__ = ["export", "export_state_dict"]


def export_state_dict(checkpoint: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of every parameter in the checkpoint, from its fp32 master weights."""
    reader = CheckpointReader(checkpoint)
    out: dict[str, torch.Tensor] = {}
    for u, unit in enumerate(reader.meta["model"]["units"]):
        numel = sum(math.prod(shape) for _, shape in unit["params"])
        flat = reader.read_joined(f"u{u}.master", numel)  # whole, or the slices of several ranks
        offset = 0
        for name, shape in unit["params"]:
            n = 1
            for d in shape:
                n *= d
            out[f"{unit['prefix']}.{name}"] = flat[offset : offset + n].reshape(shape).to(dtype).clone()
            offset += n
        if offset != flat.numel():
            raise ValueError(f"{checkpoint}: unit {u} holds {flat.numel()} values but its parameters need {offset}")
    return out


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> Path:
    """Writes the state dict to ``out``: safetensors when it ends in ``.safetensors``, else ``torch.save``.
    Written to a temporary name and renamed, so a failed export leaves no partial file."""
    out = Path(out)
    state = export_state_dict(checkpoint, dtype=dtype)
    tmp = out.with_name(out.name + ".tmp")
    try:
        if out.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(state, str(tmp), metadata={"source": str(checkpoint)})
        else:
            torch.save(state, tmp)
        # safetensors creates its file 0600; an export is an ordinary file of the user's (their umask decides).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
