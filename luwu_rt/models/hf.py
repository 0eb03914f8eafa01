"""Hugging Face causal LMs as unit chains: GPT-2 and the Llama family.

``transformers`` is not a dependency of luwu_rt: this module imports it only
when a chain is built, and raises a clear error when it is missing. Models are
built from a config (no weight download) on the ``meta`` device and
materialised unit by unit with the model's own ``_init_weights``.

Units: the embedding, one unit per decoder layer, and the head (final norm and
``lm_head``). When the config ties the embeddings, ``lm_head.weight`` *is*
the embedding's parameter, so the head reads unit 0 ([Note: ownership and
reads] in units.py). Layers are called without an attention mask: the causal
mask then comes from SDPA's ``is_causal``, which is why the chain requires
``attn_implementation="sdpa"`` (the eager path would attend to the future).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from luwu_rt.models.units import UnitChain, lm_loss

__all__ = ["HF_SCHEME", "HFCausalLMChain", "build_hf_chain", "load_pretrained_chain"]

HF_SCHEME = "hf:"
"""``model="hf:PATH"``: a local Hugging Face model folder ([Note: where the first weights come from] in weights.py)."""


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError("Hugging Face models need the transformers package: pip install transformers") from None
    return transformers


class _GPT2Embedding(nn.Module):
    """GPT-2's token and position embeddings and embedding dropout, as one unit."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class _Head(nn.Module):
    """Final norm and output projection."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


@dataclass(frozen=True, slots=True)
class _LlamaContext:
    """Per-batch inputs every Llama layer takes besides the hidden states."""

    position_ids: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]


class HFCausalLMChain(UnitChain):
    """A ``GPT2LMHeadModel`` or a Llama-family ``*ForCausalLM`` (Llama, Mistral, Qwen2, ...) as units."""

    def __init__(self, model: nn.Module) -> None:
        attn = getattr(model.config, "_attn_implementation", None)
        if attn != "sdpa":
            raise ValueError(f"unit-wise execution needs attn_implementation='sdpa' (got {attn!r}): layers run "
                             "without a mask and rely on SDPA's causal flag")
        self.model = model
        self.source: Path | None = None
        """The model folder the chain was built from (``hf:PATH``); its weights are the run's first weights."""
        self._rotary: nn.Module | None = None
        if hasattr(model, "transformer") and hasattr(model.transformer, "wpe"):
            body = model.transformer
            embed = _GPT2Embedding(body.wte, body.wpe, body.drop)
            layers, norm = list(body.h), body.ln_f
        elif hasattr(model, "model") and hasattr(model.model, "embed_tokens") and hasattr(model.model, "rotary_emb"):
            body = model.model
            embed, layers, norm = body.embed_tokens, list(body.layers), body.norm
            # The rotary tables are computed buffers, not parameters; a model built
            # on meta has them on meta too, so they are rebuilt from the config
            # (in the model as well, so that its own forward works).
            if any(b.is_meta for b in body.rotary_emb.buffers()):
                body.rotary_emb = type(body.rotary_emb)(config=model.config)
            self._rotary = body.rotary_emb
        else:
            raise ValueError(f"{type(model).__name__} is neither GPT-2 nor Llama-shaped (embed_tokens, layers, norm, "
                             "rotary_emb); wrap it with chain_from_sequential or a UnitChain subclass")
        units = [embed, *layers, _Head(norm, model.lm_head)]
        names = ["embed", *(f"layer{i}" for i in range(len(layers))), "head"]
        super().__init__(units, loss_fn=lm_loss, init_fn=model._init_weights, names=names)

    @property
    def vocab_size(self) -> int:
        """Token ids the model embeds, from its config (the data loader checks the data against it)."""
        return int(self.model.config.vocab_size)

    def attention_width(self, index: int) -> int:
        """Every decoder layer attends over the sequence with its query heads (all of them, also where
        grouped-query attention shares keys among them): heads x head width."""
        if not 0 < index < self.num_units - 1:
            return 0
        config = self.model.config
        heads = int(config.num_attention_heads)
        return heads * int(getattr(config, "head_dim", None) or config.hidden_size // heads)

    def context(self, inputs: torch.Tensor) -> _LlamaContext | None:
        if self._rotary is None:
            return None
        position_ids = torch.arange(inputs.shape[-1], device=inputs.device).unsqueeze(0)
        self._rotary.to(inputs.device)
        # The rotary tables take their dtype from this probe: fp32, as the
        # embedding output that the whole-model forward passes in is fp32.
        probe = torch.empty(0, dtype=torch.float32, device=inputs.device)
        with torch.no_grad():
            cos, sin = self._rotary(probe, position_ids)
        return _LlamaContext(position_ids=position_ids, position_embeddings=(cos, sin))

    def run(self, index: int, x: torch.Tensor, ctx: object) -> torch.Tensor:
        unit = self.units[index]
        if index == 0 or index == self.num_units - 1:
            return unit(x)
        if isinstance(ctx, _LlamaContext):
            out = unit(x, position_ids=ctx.position_ids, position_embeddings=ctx.position_embeddings)
        else:
            out = unit(x)
        # transformers 4.x layers return a tuple, 5.x a tensor.
        return out[0] if isinstance(out, tuple) else out


def build_hf_chain(config: Any) -> HFCausalLMChain:
    """A causal LM from a ``transformers`` config, on meta; materialise it with ``chain.materialize``."""
    transformers = _require_transformers()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return HFCausalLMChain(model)


def load_pretrained_chain(path: str | Path) -> HFCausalLMChain:
    """The chain of a local model folder (``config.json`` + safetensors, as ``save_pretrained`` writes it),
    built on meta from its config; the engine streams the weights in unit by unit (``chain.source``).
    Nothing is downloaded: a hub name that is not a local folder is an error."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json; hf:PATH takes a local model folder as save_pretrained "
                                "writes it (nothing is downloaded)")
    transformers = _require_transformers()
    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    where = folder / "config.json"
    for key, value in config.to_dict().items():
        not_positive = isinstance(value, bool) or not isinstance(value, int) or value <= 0
        if key in _SIZES and value is not None and not_positive:
            raise ValueError(f"{where}: {key} is {value!r}; a model's sizes are positive integers")
    try:
        chain = build_hf_chain(config)
    except (RuntimeError, TypeError, ZeroDivisionError) as exc:  # shapes that do not fit together (torch says)
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{where}: transformers cannot build the model it describes ({text})") from None
    chain.source = folder
    return chain


_SIZES = frozenset({"vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_inner", "n_ctx", "hidden_size",
                    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                    "max_position_embeddings", "head_dim"})
"""Keys of a Hugging Face config that are sizes or counts: a negative one fails deep inside torch otherwise."""
