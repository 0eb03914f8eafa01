"""Checkpoint export to a plain state dict (``torch.save``) or a safetensors file.

The fp32 master weights of each unit are cut back into the model's parameters
by the names and shapes recorded in the checkpoint, under the names they have
in the whole model's ``state_dict``. ``load_export(model, path)`` loads one into a freshly built model,
also one built on the meta device (as ``build_gpt`` builds it), which holds no memory to load into.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from luwu_rt.ckpt.format import CheckpointReader

__all__ = ["export", "export_state_dict", "load_export"]


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


def load_export(model, path: str | os.PathLike, *, device: torch.device | str = "cpu") -> torch.nn.Module:
    """Loads the export at ``path`` (``.safetensors``, else ``torch.save``) into ``model`` and returns the
    module, e.g. ``load_export(build_gpt("gpt-tiny"), "model.safetensors")``. ``model``: an ``nn.Module``
    or a chain with one (``build_gpt``'s ``GPTChain``). A module on the meta device is first given real,
    uninitialised memory on ``device`` (``to_empty``), which the export then fills: strictly, every name
    and shape must match, so no parameter is left uninitialised. The module keeps its dtype (values cast)."""
    module = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"load_export needs an nn.Module or a chain with a .model module, got {type(model).__name__}")
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        # to_empty leaves garbage where the export has nothing: refuse such tensors rather than run on them.
        loaded = set(state)
        empty = [name for name, _ in (*module.named_parameters(), *module.named_buffers()) if name not in loaded]
        if empty:
            raise ValueError(f"{path} has no values for {', '.join(empty[:5])}{' ...' if len(empty) > 5 else ''} "
                             f"of this meta model; build the model on a device (e.g. build_gpt(..., device='cpu')) "
                             f"so that those keep their initial values")
        module.to_empty(device=device)
    try:
        module.load_state_dict(state)
    except RuntimeError as exc:  # names and shapes differ: another model than the one trained
        raise ValueError(f"{path} does not fit this model (was it exported from another preset?): {exc}") from None
    return module
