import pytest
import torch
from torch import nn

from luwu_rt.engine.unitwise import (
    Phase,
    UnitHooks,
    UnitwiseConfig,
    final_points,
    step_schedule,
    unitwise_loss,
    unitwise_step,
)
from luwu_rt.models.gpt import build_gpt
from luwu_rt.models.units import UnitChain, chain_from_sequential

VOCAB = 256


def _batch(seed: int = 0, *, batch: int = 2, seq_len: int = 16, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _reference_grads(chain: UnitChain, inputs, targets, *, autocast_dtype=None):
    """Loss and grads of one ordinary whole-model autograd step."""
    params = [p for i in range(chain.num_units) for p in chain.own_params(i)]
    for p in params:
        p.grad = None
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = chain.forward(inputs, targets)
    loss.backward()
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return float(loss.detach()), grads


def _unitwise_grads(chain: UnitChain, inputs, targets, **config):
    params = [p for i in range(chain.num_units) for p in chain.own_params(i)]
    result = unitwise_step(chain, inputs, targets, config=UnitwiseConfig(**config))
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return result.loss, grads


def _assert_grads_close(actual, expected, *, rtol, atol):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol)


def _tied_sequential(seed: int = 0) -> UnitChain:
    torch.manual_seed(seed)
    emb = nn.Embedding(VOCAB, 32)
    out = nn.Linear(32, VOCAB, bias=False)
    out.weight = emb.weight  # tied through a shared Parameter: the last unit reads unit 0
    return chain_from_sequential(nn.Sequential(emb, nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.2),
                                               nn.Linear(64, 32), nn.LayerNorm(32), out))


def test_gpt_unitwise_step_equals_whole_model_autograd() -> None:
    chain = build_gpt("gpt-tiny", device="cpu", seed=3)
    inputs, targets = _batch()
    ref_loss, ref = _reference_grads(chain, inputs, targets)
    loss, got = _unitwise_grads(chain, inputs, targets)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_close(got, ref, rtol=1e-5, atol=1e-7)


def test_sequential_with_tied_weight_and_dropout_equals_autograd() -> None:
    chain = _tied_sequential()
    assert chain.reads(chain.num_units - 1) == (0,)
    assert chain.num_params == sum(p.numel() for p in set(nn.ModuleList(chain.units).parameters()))
    inputs, targets = _batch(1)
    torch.manual_seed(7)
    ref_loss, ref = _reference_grads(chain, inputs, targets)
    torch.manual_seed(7)  # same dropout masks: the recomputation must replay them
    loss, got = _unitwise_grads(chain, inputs, targets)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_close(got, ref, rtol=1e-5, atol=1e-7)


def test_without_rng_replay_dropout_recomputation_differs() -> None:
    # Shows the equivalence above depends on the replay, not on luck.
    chain = _tied_sequential()
    inputs, targets = _batch(1)
    torch.manual_seed(7)
    _, ref = _reference_grads(chain, inputs, targets)
    torch.manual_seed(7)
    _, got = _unitwise_grads(chain, inputs, targets, preserve_rng=False)
    assert any(not torch.allclose(a, e, rtol=1e-4, atol=1e-6) for a, e in zip(got, ref))


class _Recorder(UnitHooks):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.final: dict[int, list] = {}

    def acquire(self, index, *, phase):
        self.events.append(("F" if phase is Phase.FORWARD else "B", index))

    def release(self, index, *, phase):
        self.events.append(("f" if phase is Phase.FORWARD else "b", index))

    def grads_final(self, index, grads, *, chain):
        self.events.append(("G", index))
        self.final[index] = grads


def test_order_of_computation_and_final_gradients() -> None:
    chain = build_gpt("gpt-tiny", device="cpu", seed=0)
    n = chain.num_units
    rec = _Recorder()
    unitwise_step(chain, *_batch(), hooks=rec)
    forward = [e for i in range(n - 1) for e in (("F", i), ("f", i))]
    backward = []
    for i in range(n - 1, -1, -1):
        backward += [("B", i), ("b", i)]
        if i > 0:
            backward.append(("G", i))  # a block or the head is final right after its own backward
    backward += [("G", 0)]  # the tied embedding only after B0, with the head's contribution in it
    assert rec.events == forward + backward
    assert list(step_schedule(chain)) == rec.events


def test_schedule_when_a_unit_reads_a_later_unit() -> None:
    # Unit 1 reads unit 3's weight: unit 3 is final only after B1, and the
    # recorded hook calls still follow step_schedule.
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    chain = UnitChain([nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.GELU(), shared, nn.Linear(8, VOCAB)],
                      reads={1: (3,)})
    chain.run = lambda i, x, ctx: (torch.nn.functional.linear(x, chain.units[3].weight) + chain.units[1](x)
                                   if i == 1 else chain.units[i](x))
    assert final_points(chain) == ((0,), (3, 1), (2,), (), (4,))
    rec = _Recorder()
    inputs, targets = _batch(seq_len=4)
    unitwise_step(chain, inputs, targets, hooks=rec)
    assert rec.events == list(step_schedule(chain))
    _, ref = _reference_grads(chain, inputs, targets)
    got = [g for i in range(chain.num_units) for g in rec.final[i]]
    _assert_grads_close(got, ref, rtol=1e-5, atol=1e-7)


def test_grads_final_delivers_grads_aligned_with_own_params() -> None:
    chain = build_gpt("gpt-tiny", device="cpu", seed=0)
    inputs, targets = _batch()
    _, ref = _reference_grads(chain, inputs, targets)
    rec = _Recorder()
    unitwise_step(chain, inputs, targets, hooks=rec)
    got = [g for i in range(chain.num_units) for g in rec.final[i]]
    _assert_grads_close(got, ref, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in chain.model.parameters())  # custom hooks own the grads


class _OutOfCore(UnitHooks):
    """Keeps every unit's parameters off the meta device only between acquire and release,
    and its saved inputs in a side store: the protocol an out-of-core engine follows."""

    def __init__(self, chain: UnitChain) -> None:
        self.chain = chain
        self.store = {i: [p.detach().clone() for p in chain.own_params(i)] for i in range(chain.num_units)}
        self.inputs: dict[int, torch.Tensor] = {}
        self.final: dict[int, list] = {}
        for i in range(chain.num_units):
            chain.release(i)

    def _units(self, index):
        return (index, *self.chain.reads(index))

    def acquire(self, index, *, phase):
        for u in self._units(index):
            for p, value in zip(self.chain.own_params(u), self.store[u]):
                torch.utils.swap_tensors(p, nn.Parameter(value.clone()))

    def release(self, index, *, phase):
        for u in self._units(index):
            self.chain.release(u)

    def save_input(self, index, x):
        self.inputs[index] = x.clone()
        return index

    def load_input(self, index, handle):
        return self.inputs.pop(handle)

    def grads_final(self, index, grads, *, chain):
        assert all(p.is_meta for p in chain.own_params(index)), "grads must not need the params resident"
        self.final[index] = grads


def test_params_resident_only_during_their_unit() -> None:
    chain = build_gpt("gpt-tiny", device="cpu", seed=0)
    inputs, targets = _batch()
    ref_loss, ref = _reference_grads(chain, inputs, targets)
    hooks = _OutOfCore(chain)
    result = unitwise_step(chain, inputs, targets, hooks=hooks)
    assert result.loss == pytest.approx(ref_loss, rel=1e-6)
    assert not hooks.inputs
    got = [g for i in range(chain.num_units) for g in hooks.final[i]]
    _assert_grads_close(got, ref, rtol=1e-5, atol=1e-7)


def test_bf16_autocast_matches_autocast_autograd() -> None:
    chain = build_gpt("gpt-tiny", device="cpu", seed=0)
    inputs, targets = _batch()
    ref_loss, ref = _reference_grads(chain, inputs, targets, autocast_dtype=torch.bfloat16)
    loss, got = _unitwise_grads(chain, inputs, targets, autocast_dtype=torch.bfloat16)
    assert loss == pytest.approx(ref_loss, rel=1e-3)
    _assert_grads_close(got, ref, rtol=2e-2, atol=1e-4)
    fp32_loss, _ = _reference_grads(chain, inputs, targets)
    assert loss == pytest.approx(fp32_loss, rel=2e-2)
    assert all(g.dtype == torch.float32 for g in got)  # grads of fp32 params stay fp32


def test_bf16_parameters_without_autocast() -> None:
    # An engine may compute with bf16 copies of the parameters instead of autocast.
    chain = build_gpt("gpt-tiny", device="cpu", seed=0)
    for p in chain.model.parameters():
        torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(torch.bfloat16)))
    inputs, targets = _batch()
    ref_loss, ref = _reference_grads(chain, inputs, targets)
    loss, got = _unitwise_grads(chain, inputs, targets)
    assert all(g.dtype == torch.bfloat16 for g in got)
    assert loss == pytest.approx(ref_loss, rel=1e-2)
    _assert_grads_close([g.float() for g in got], [g.float() for g in ref], rtol=5e-2, atol=1e-3)


def test_loss_scale_scales_grads_not_loss() -> None:
    chain = build_gpt("gpt-tiny", device="cpu", seed=0)
    inputs, targets = _batch()
    loss1, g1 = _unitwise_grads(chain, inputs, targets)
    loss2, g2 = _unitwise_grads(chain, inputs, targets, loss_scale=1024.0)
    assert loss2 == loss1
    _assert_grads_close([g / 1024.0 for g in g2], g1, rtol=1e-5, atol=1e-9)


def test_default_hooks_accumulate_like_backward() -> None:
    chain = build_gpt("gpt-tiny", device="cpu", seed=0)
    a, b = _batch(0), _batch(1)
    _, ga = _reference_grads(chain, *a)
    _, gb = _reference_grads(chain, *b)
    unitwise_step(chain, *a)
    unitwise_step(chain, *b)
    params = list(chain.model.parameters())
    _assert_grads_close([p.grad for p in params], [x + y for x, y in zip(ga, gb)], rtol=1e-5, atol=1e-7)


def test_unitwise_loss_is_the_forward_loss() -> None:
    chain = build_gpt("gpt-tiny", device="cpu", seed=0)
    inputs, targets = _batch()
    with torch.no_grad():
        expected = float(chain.forward(inputs, targets))
    assert unitwise_loss(chain, inputs, targets) == pytest.approx(expected, rel=1e-6)


def test_frozen_unit_gets_no_grads_but_passes_gradient_on() -> None:
    chain = _tied_sequential()
    for p in chain.own_params(1):
        p.requires_grad_(False)
    inputs, targets = _batch()
    torch.manual_seed(0)
    _, ref = _reference_grads_frozen(chain, inputs, targets)
    torch.manual_seed(0)
    rec = _Recorder()
    unitwise_step(chain, inputs, targets, hooks=rec)
    assert rec.final[1] == [None, None]
    got = [g for i in range(chain.num_units) for g in rec.final[i] if g is not None]
    _assert_grads_close(got, ref, rtol=1e-5, atol=1e-7)


def _reference_grads_frozen(chain, inputs, targets):
    params = [p for i in range(chain.num_units) for p in chain.own_params(i) if p.requires_grad]
    loss = chain.forward(inputs, targets)
    grads = torch.autograd.grad(loss, params)
    return loss.item(), list(grads)


@pytest.mark.parametrize("keep", [frozenset({0, 2, 3}), frozenset(range(6))])
def test_keeping_graphs_instead_of_recomputing_gives_the_same_step(keep) -> None:
    chain = build_gpt("gpt-tiny", device="cpu", seed=2)
    inputs, targets = _batch()
    ref_loss, ref = _reference_grads(chain, inputs, targets)
    rec = _Recorder()
    result = unitwise_step(chain, inputs, targets, hooks=rec, config=UnitwiseConfig(keep_graph=keep))
    assert result.loss == pytest.approx(ref_loss, rel=1e-6)
    assert rec.events == list(step_schedule(chain))  # the engine sees the same hook calls either way
    got = [g for i in range(chain.num_units) for g in rec.final[i]]
    _assert_grads_close(got, ref, rtol=1e-5, atol=1e-7)


def test_kept_graphs_with_dropout_and_only_kept_inputs_unsaved() -> None:
    chain = _tied_sequential()
    inputs, targets = _batch(1)

    class Saves(UnitHooks):
        def __init__(self):
            self.saved = []

        def save_input(self, index, x):
            self.saved.append(index)
            return x

    torch.manual_seed(3)
    _, ref = _reference_grads(chain, inputs, targets)
    torch.manual_seed(3)
    hooks = Saves()
    unitwise_step(chain, inputs, targets, hooks=hooks, config=UnitwiseConfig(keep_graph=frozenset({1, 3})))
    assert hooks.saved == [0, 2, 4, 5, 6]
    got = [p.grad for i in range(chain.num_units) for p in chain.own_params(i)]
    _assert_grads_close(got, ref, rtol=1e-5, atol=1e-7)


def test_keep_graph_outside_the_chain_is_an_error() -> None:
    chain = build_gpt("gpt-tiny", device="cpu")
    with pytest.raises(ValueError, match="keep_graph names unit 9"):
        unitwise_step(chain, *_batch(), config=UnitwiseConfig(keep_graph=frozenset({9})))


@pytest.mark.parametrize("kwargs, match", [
    ({"keep_graph": frozenset({-1})}, "keep_graph"),
    ({"autocast_dtype": torch.float64}, "autocast_dtype"),
    ({"loss_scale": 0.0}, "loss_scale"),
    ({"loss_scale": float("inf")}, "loss_scale"),
])
def test_config_validation(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        UnitwiseConfig(**kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_init_matches_cpu_and_step_matches_autograd() -> None:
    cpu = build_gpt("gpt-tiny", device="cpu", seed=4)
    chain = build_gpt("gpt-tiny", device="cuda", seed=4)
    for a, b in zip(cpu.model.parameters(), chain.model.parameters()):
        assert b.is_cuda and torch.equal(a, b.cpu())
    inputs, targets = (t.cuda() for t in _batch())
    params = list(chain.model.parameters())
    torch.manual_seed(0)
    loss = chain.forward(inputs, targets)
    expected = torch.autograd.grad(loss, params)
    result = unitwise_step(chain, inputs, targets)
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    _assert_grads_close([p.grad for p in params], list(expected), rtol=1e-4, atol=1e-6)
    bf16 = unitwise_step(chain, inputs, targets, config=UnitwiseConfig(autocast_dtype=torch.bfloat16))
    assert bf16.loss == pytest.approx(result.loss, rel=2e-2)
