"""Hugging Face adapters; they need the optional transformers package."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional dependency)")

from luwu_rt.engine.unitwise import unitwise_step  # noqa: E402
from luwu_rt.models.hf import HFCausalLMChain, build_hf_chain  # noqa: E402

VOCAB = 96


def _gpt2_config(**overrides):
    kwargs = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    kwargs.update(overrides)
    return transformers.GPT2Config(**kwargs)


def _llama_config(**overrides):
    kwargs = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
                  eos_token_id=0)
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


CONFIGS = {
    "gpt2": _gpt2_config,
    "llama": _llama_config,
    "llama-tied": lambda: _llama_config(tie_word_embeddings=True),
}


def _materialized(make_config, seed=0, order=None):
    chain = build_hf_chain(make_config())
    assert all(p.is_meta for p in chain.model.parameters())
    for index in order or range(chain.num_units):
        chain.materialize(index, seed=seed)
    return chain


def _batch(seq_len=12):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chain_forward_equals_the_hf_model(name) -> None:
    chain = _materialized(CONFIGS[name])
    assert chain.num_params == sum(p.numel() for p in chain.model.parameters())
    inputs, _ = _batch()
    with torch.no_grad():
        expected = chain.model(input_ids=inputs).logits
        got = chain.forward(inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_unitwise_step_equals_hf_autograd(name) -> None:
    chain = _materialized(CONFIGS[name])
    inputs, targets = _batch()
    params = list(chain.model.parameters())
    loss = torch.nn.functional.cross_entropy(chain.model(input_ids=inputs).logits.flatten(0, 1), targets.flatten())
    loss.backward()
    expected = [p.grad.clone() for p in params]
    chain.model.zero_grad(set_to_none=True)
    result = unitwise_step(chain, inputs, targets)
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["gpt2", "llama-tied"])
def test_tied_head_reads_the_embedding_and_init_is_order_free(name) -> None:
    forward = _materialized(CONFIGS[name], seed=3)
    backward = _materialized(CONFIGS[name], seed=3, order=reversed(range(forward.num_units)))
    last = forward.num_units - 1
    assert forward.reads(last) == (0,)
    assert any(p is forward.model.lm_head.weight for p in forward.own_params(0))
    for a, b in zip(forward.model.parameters(), backward.model.parameters()):
        assert torch.equal(a, b)
    emb = next(iter(forward.own_params(0)))
    assert emb.std().item() == pytest.approx(0.02, rel=0.05)  # initializer_range, not left as garbage


def test_gpt2_dropout_is_replayed_in_recomputation() -> None:
    chain = _materialized(lambda: _gpt2_config(resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2))
    chain.model.train()
    inputs, targets = _batch()
    params = list(chain.model.parameters())
    torch.manual_seed(5)
    loss = chain.forward(inputs, targets)
    loss.backward()
    expected = [p.grad.clone() for p in params]
    chain.model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    result = unitwise_step(chain, inputs, targets)
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-6)


def test_untied_llama_head_owns_lm_head() -> None:
    chain = _materialized(_llama_config)
    assert chain.reads(chain.num_units - 1) == ()
    assert any(p is chain.model.lm_head.weight for p in chain.own_params(chain.num_units - 1))


def test_a_gpt2_of_a_presets_shape_has_the_presets_flops() -> None:
    """The generic count ([Note: FLOPs of a unit]) with the layers' attention gives a Hugging Face GPT-2 the
    FLOPs plan/gpt.py gives a built-in GPT of its shape; a Llama layer attends with all its query heads."""
    from luwu_rt.models.presets import GPTShape
    from luwu_rt.plan.gpt import gpt_units

    chain = build_hf_chain(_gpt2_config())
    shape = GPTShape(name="gpt2-test", num_layers=2, d_model=32, num_heads=4, vocab_size=VOCAB, max_seq_len=32)
    assert [chain.flops_per_token(i, seq_len=24) for i in range(chain.num_units)] == [
        u.flops_per_token for u in gpt_units(shape, seq_len=24)]
    llama = build_hf_chain(_llama_config())  # 4 query heads of 8, 2 key/value heads
    assert [llama.attention_width(i) for i in range(llama.num_units)] == [0, 32, 32, 0]


def test_eager_attention_is_refused() -> None:
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel._from_config(_gpt2_config(), attn_implementation="eager")
    with pytest.raises(ValueError, match="sdpa"):
        HFCausalLMChain(model)
