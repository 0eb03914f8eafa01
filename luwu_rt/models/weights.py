"""Where a run's first weights come from, one unit at a time.

[Note: where the first weights come from]
The engine fills the store unit by unit with each unit's flat fp32 master
weights. They come from exactly one of three sources, chosen once per run:

* ``init_from`` (a safetensors file or folder, e.g. a Hugging Face model
  folder or this project's export): each unit's tensors are read from the
  shards, by name, straight into its flat buffer; the model stays on meta and
  is never whole in RAM ([Note: streaming a checkpoint in] in safetensors_in.py);
* the model's own tensors, when its parameters are real (a user's pretrained
  ``nn.Module``): each unit is copied, then released to meta, so that the
  store holds the only copy the engine trains;
* the seed, when the model is on meta: ``chain.materialize(u, seed=...)``.

A model with some units real and others on meta is refused: silently seeding
the meta part of a half-loaded model is the bug this module exists to stop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from luwu_rt.models.units import UnitChain

__all__ = ["FirstWeights", "first_weights"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class FirstWeights:
    """One source of first weights: ``unit(u)`` gives unit ``u``'s flat fp32 master weights."""

    kind: str
    """``init_from``, ``model`` or ``seed``."""
    description: str
    """One line for the log, e.g. ``weights from /models/llama (3 safetensors files)``."""
    unit: Callable[[int], torch.Tensor]
    """Unit index to its own parameters, flattened in ``own_params`` order, fp32."""


def first_weights(chain: UnitChain, *, seed: int, init_from: str | os.PathLike | None = None) -> FirstWeights:
    """The source of ``chain``'s first weights ([Note: where the first weights come from]).

    ``init_from`` defaults to the folder an ``hf:PATH`` chain was built from (``chain.source``).
    """
    init_from = init_from if init_from is not None else getattr(chain, "source", None)
    if init_from is not None:
        from luwu_rt.models.safetensors_in import SafetensorsIn

        reader = SafetensorsIn(init_from, chain)
        source = FirstWeights(kind="init_from", description=f"weights from {reader.describe()}", unit=reader.unit)
    else:
        params = [p for u in range(chain.num_units) for p in chain.own_params(u)]
        num_meta = sum(p.is_meta for p in params)
        if 0 < num_meta < len(params):
            raise ValueError(_mixed_error(chain))
        if num_meta == 0:
            source = FirstWeights(kind="model", description="weights from the model's own parameters "
                                  "(each unit copied into the store, then released)", unit=lambda u: _take(chain, u))
        else:
            source = FirstWeights(kind="seed", description=f"weights initialised from seed {seed} (model on meta)",
                                  unit=lambda u: _seeded(chain, u, seed))
    _log.info("first %s", source.description)
    return source


def _flat(chain: UnitChain, u: int) -> torch.Tensor:
    params = chain.own_params(u)
    if not params:
        return torch.zeros(0)
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params])


def _take(chain: UnitChain, u: int) -> torch.Tensor:
    flat = _flat(chain, u)
    chain.release(u)
    return flat


def _seeded(chain: UnitChain, u: int, seed: int) -> torch.Tensor:
    chain.materialize(u, seed=seed)
    return _take(chain, u)


def _mixed_error(chain: UnitChain) -> str:
    meta = real = None
    for u in range(chain.num_units):
        for name, p in chain.named_own_params(u):
            if p.is_meta and meta is None:
                meta = f"{chain.names[u]}.{name}"
            if not p.is_meta and real is None:
                real = f"{chain.names[u]}.{name}"
    return (f"the model is partly on the meta device ({meta}) and partly real ({real}); load every parameter "
            "(to start from your weights) or build the whole model on meta (to initialise it from the seed), "
            "or pass init_from= / --init-from a safetensors checkpoint")
