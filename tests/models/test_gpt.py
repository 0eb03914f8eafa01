import dataclasses

import pytest
import torch

from luwu_rt.models.gpt import build_gpt
from luwu_rt.models.presets import PRESETS


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_count_equals_preset_exactly(name: str) -> None:
    chain = build_gpt(name)  # meta: even gpt-175b costs no memory
    shape = PRESETS[name]
    assert chain.num_params == shape.num_params
    assert chain.num_units == shape.num_layers + 2
    assert chain.num_unit_params(0) == shape.embedding_params
    assert chain.num_unit_params(1) == shape.block_params
    assert chain.num_unit_params(chain.num_units - 1) == shape.head_params
    assert all(p.is_meta for p in chain.model.parameters())


def test_untied_head_owns_its_output_matrix() -> None:
    shape = dataclasses.replace(PRESETS["gpt-tiny"], name="tiny-untied", tie_embeddings=False)
    chain = build_gpt(shape, device="cpu")
    assert chain.num_params == shape.num_params
    assert chain.reads(chain.num_units - 1) == ()
    assert chain.forward(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, shape.vocab_size)


def test_tied_head_reads_the_embedding_unit() -> None:
    chain = build_gpt("gpt-tiny")
    last = chain.num_units - 1
    assert chain.reads(last) == (0,)
    assert chain.readers(0) == (last,)
    assert all(chain.reads(i) == () for i in range(last))
    assert chain.names[0] == "embed" and chain.names[last] == "head"


def _values(chain, index):
    return [p.detach().clone() for p in chain.own_params(index)]


def test_each_unit_depends_only_on_seed_and_index() -> None:
    forward = build_gpt("gpt-tiny", device="cpu", seed=11)
    lone = build_gpt("gpt-tiny")
    # One unit alone, with every other unit still on meta.
    lone.materialize(2, seed=11)
    assert all(p.is_meta for i in range(lone.num_units) if i != 2 for p in lone.own_params(i))
    for a, b in zip(_values(lone, 2), _values(forward, 2)):
        assert torch.equal(a, b)
    # All units in reverse order: the head (which reads wte) before the embedding.
    for index in reversed(range(lone.num_units)):
        lone.materialize(index, seed=11)
    for a, b in zip(lone.model.parameters(), forward.model.parameters()):
        assert torch.equal(a, b)


def test_materializing_the_head_after_the_embedding_leaves_wte_alone() -> None:
    chain = build_gpt("gpt-tiny")
    chain.materialize(0, seed=1)
    wte = chain.model.embed.wte.weight.detach().clone()
    chain.materialize(chain.num_units - 1, seed=1)
    assert torch.equal(chain.model.embed.wte.weight, wte)


def test_different_seeds_and_units_give_different_values() -> None:
    a = build_gpt("gpt-tiny", device="cpu", seed=0)
    b = build_gpt("gpt-tiny", device="cpu", seed=1)
    wa, wb = a.model.blocks[0].attn.qkv.weight, b.model.blocks[0].attn.qkv.weight
    assert not torch.equal(wa, wb)
    assert not torch.equal(a.model.blocks[0].attn.qkv.weight, a.model.blocks[1].attn.qkv.weight)


def test_gpt2_initialisation_statistics() -> None:
    chain = build_gpt("gpt-small", device="cpu", seed=0)
    block = chain.model.blocks[0]
    num_layers = chain.shape.num_layers
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert block.mlp.proj.weight.std().item() == pytest.approx(0.02 / (2 * num_layers) ** 0.5, rel=0.02)
    assert torch.all(block.attn.qkv.bias == 0) and torch.all(block.ln_1.weight == 1)
    assert chain.model.embed.wte.weight.std().item() == pytest.approx(0.02, rel=0.02)


def test_release_returns_a_unit_to_meta_keeping_identity() -> None:
    chain = build_gpt("gpt-tiny", device="cpu")
    params = chain.own_params(1)
    chain.release(1)
    assert all(p.is_meta for p in chain.model.blocks[0].parameters())
    assert [id(p) for p in chain.own_params(1)] == [id(p) for p in params]


def test_model_forward_equals_chain_forward_and_rejects_long_sequences() -> None:
    chain = build_gpt("gpt-tiny", device="cpu")
    idx = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(chain.model(idx), chain.forward(idx), rtol=0, atol=0)
    too_long = torch.zeros(1, chain.shape.max_seq_len + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="max_seq_len"):
        chain.forward(too_long)


def test_untrained_loss_is_near_uniform() -> None:
    chain = build_gpt("gpt-tiny", device="cpu")
    idx = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(idx, -1, dims=1)
    with torch.no_grad():
        loss = float(chain.forward(idx, targets))
    assert loss == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)
