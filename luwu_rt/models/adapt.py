"""Turn whatever the user hands the engine into a ``UnitChain``."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from luwu_rt.models.gpt import GPT, GPTChain, build_gpt
from luwu_rt.models.presets import GPTShape
from luwu_rt.models.units import LossFn, UnitChain, chain_from_sequential, lm_loss

__all__ = ["as_unit_chain"]


def as_unit_chain(model: object, *, loss_fn: LossFn = lm_loss) -> UnitChain:
    """A chain for ``model``, which may be

    * a ``UnitChain`` (returned as is);
    * a preset name such as ``"gpt-125m"`` or a ``GPTShape`` (built on meta);
    * ``"hf:PATH"``, a local Hugging Face model folder (built on meta from its config; ``chain.source``
      tells the engine to stream its weights in);
    * a ``GPT`` module;
    * an ``nn.Sequential``, ``nn.ModuleList`` or list of modules (one unit each, ``loss_fn`` on the output);
    * a Hugging Face GPT-2 / Llama-family causal LM, or its config (built on meta).
    """
    if isinstance(model, UnitChain):
        return model
    if isinstance(model, str) and model.startswith("hf:"):
        from luwu_rt.models.hf import HF_SCHEME, load_pretrained_chain

        return load_pretrained_chain(model[len(HF_SCHEME):])
    if isinstance(model, (str, GPTShape)):
        return build_gpt(model)
    if isinstance(model, GPT):
        return GPTChain(model)
    if _is_hf_config(model):
        from luwu_rt.models.hf import build_hf_chain

        return build_hf_chain(model)
    if isinstance(model, nn.Module) and _is_hf_model(model):
        from luwu_rt.models.hf import HFCausalLMChain

        return HFCausalLMChain(model)
    if isinstance(model, (nn.Sequential, nn.ModuleList)) or (
        isinstance(model, Sequence) and model and all(isinstance(m, nn.Module) for m in model)
    ):
        return chain_from_sequential(model, loss_fn=loss_fn)
    raise ValueError(
        f"cannot split a {type(model).__name__} into units; pass a preset name, a GPT, an nn.Sequential or list "
        "of modules, a Hugging Face GPT-2/Llama model or config, or a UnitChain subclass that says how"
    )


def _is_hf_config(obj: object) -> bool:
    # Duck-typed so that transformers is imported only when it is actually used.
    return hasattr(obj, "model_type") and hasattr(obj, "to_dict") and not isinstance(obj, nn.Module)


def _is_hf_model(module: nn.Module) -> bool:
    return hasattr(module, "config") and hasattr(module, "_init_weights") and hasattr(module, "lm_head")
