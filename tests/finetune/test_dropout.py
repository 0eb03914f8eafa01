"""A model with dropout: evaluation in eval mode, training in train mode, with masks drawn by step
([Note: dropout is drawn by step] in engine/compute.py)."""

import pytest
import torch

from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.engine.compute import StepRng
from luwu_rt.optim.schedule import lr_at

from .conftest import VOCAB, transformers

BATCH, SEQ, STEPS = 2, 16, 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A two-layer GPT-2 with dropout everywhere (embedding, attention, residuals), saved as a folder."""
    folder = tmp_path_factory.mktemp("gpt2-dropout")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.2, embd_pdrop=0.2,
                                     attn_pdrop=0.2)
    torch.manual_seed(5)
    transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(folder)
    return folder


def _config(folder, tmp_path, **extra) -> TrainConfig:
    base = {"model": f"hf:{folder}", "steps": STEPS, "batch_size": BATCH, "seq_len": SEQ, "seed": 1,
            "offload": {"params": "host", "optimizer": "host", "grads": "host", "device_mem": "64MiB",
                        "host_mem": "64MiB", "chunk_size": "64KiB"}}
    return from_mapping(TrainConfig, {**base, **extra})


def _batches(n: int):
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, VOCAB, (n, BATCH, SEQ + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _hf_loss(model, x, y) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())


def test_evaluate_runs_in_eval_mode_and_equals_transformers(folder, tmp_path) -> None:
    (x, y), = _batches(1)
    with Engine(None, _config(folder, tmp_path)) as engine:
        first = engine.evaluate([(x, y)])
        assert [engine.evaluate([(x, y)]) for _ in range(3)] == [first] * 3
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
        with torch.no_grad():
            assert first == pytest.approx(float(_hf_loss(model, x, y)), rel=1e-6)
        # Training runs in train mode (dropout on: the step's loss is not the evaluation's), and
        # evaluation after it in eval mode again.
        trained = engine.train_step([(x, y)])["loss"]
        assert abs(trained - first) > 1e-4
        after = engine.evaluate([(x, y)])
        assert engine.evaluate([(x, y)]) == after


@pytest.mark.parametrize("keep_graphs", ["none", "all"], ids=["recomputed", "kept"])
def test_training_with_dropout_equals_plain_transformers_with_the_same_masks(folder, tmp_path, keep_graphs) -> None:
    # The reference draws each step's masks from the state the engine's step draws from; with every unit
    # recomputed in backward, the gradients match only if the recomputation replays its forward's masks.
    config = _config(folder, tmp_path, keep_graphs=keep_graphs)
    batches = _batches(STEPS)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").train()
    o = config.optim
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    expect = []
    for step, (x, y) in enumerate(batches, start=1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, total_steps=STEPS)
        opt.zero_grad()
        with StepRng(seed=config.seed).state(step, torch.device("cpu")).drawing():
            loss = _hf_loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        expect.append(loss.item())
    with Engine(None, config) as engine:
        got = [engine.train_step([b])["loss"] for b in batches]
    assert got == pytest.approx(expect, rel=1e-5)


def _state(engine: Engine) -> dict[str, torch.Tensor]:
    return {f"{u}.{s}": engine.store.read_state(u, s, torch.empty(engine.chain.num_unit_params(u)))
            for u in range(engine.chain.num_units) for s in ("master", "exp_avg", "exp_avg_sq")}


def test_resume_with_dropout_is_exact(folder, tmp_path) -> None:
    batches = _batches(STEPS)
    with Engine(None, _config(folder, tmp_path)) as straight:
        expect = [straight.train_step([b])["loss"] for b in batches]
        expect_state = _state(straight)
    with Engine(None, _config(folder, tmp_path)) as first:
        losses = [first.train_step([b])["loss"] for b in batches[:2]]
        path = first.save(tmp_path / "ckpt")
    torch.rand(1000)  # the process's own draws between the runs change nothing
    with Engine.load(path) as resumed:
        losses += [resumed.train_step([b])["loss"] for b in batches[2:]]
        assert losses == expect
        for key, value in _state(resumed).items():
            assert torch.equal(value, expect_state[key]), key
