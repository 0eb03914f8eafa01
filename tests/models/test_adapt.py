import pytest
import torch
from torch import nn

from luwu_rt.models.adapt import as_unit_chain
from luwu_rt.models.gpt import GPT, GPTChain
from luwu_rt.models.presets import get_preset
from luwu_rt.models.units import UnitChain


def test_presets_modules_and_chains() -> None:
    chain = as_unit_chain("gpt-tiny")
    assert isinstance(chain, GPTChain) and chain.num_params == get_preset("gpt-tiny").num_params
    assert as_unit_chain(chain) is chain
    assert isinstance(as_unit_chain(get_preset("gpt-tiny")), GPTChain)
    with torch.device("meta"):
        gpt = GPT(get_preset("gpt-tiny"))
    assert as_unit_chain(gpt).model is gpt
    seq = nn.Sequential(nn.Embedding(16, 4), nn.Linear(4, 16))
    assert as_unit_chain(seq).num_units == 2
    assert as_unit_chain(list(seq)).num_units == 2


def test_custom_loss_for_sequential() -> None:
    seq = nn.Sequential(nn.Linear(3, 1))
    chain = as_unit_chain(seq, loss_fn=lambda y, t: ((y - t) ** 2).mean())
    x, t = torch.ones(2, 3), torch.zeros(2, 1)
    assert chain.forward(x, t).item() == pytest.approx((seq(x) ** 2).mean().item())


def test_unsupported_object_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot split a int"):
        as_unit_chain(3)
    with pytest.raises(ValueError, match="unknown model preset"):
        as_unit_chain("gpt-7")
    with pytest.raises(ValueError, match="cannot split a list"):
        as_unit_chain([])


def test_hugging_face_config_and_model() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional dependency)")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                                     bos_token_id=0, eos_token_id=0)
    chain = as_unit_chain(config)
    assert chain.num_units == 3 and chain.reads(2) == (0,)
    assert isinstance(as_unit_chain(chain.model), UnitChain)
