"""luwu_rt.optim against torch.optim: same trajectories, exchangeable state_dicts."""

from __future__ import annotations

import copy

import pytest
import torch

import luwu_rt.optim as LO

CASES = [
    (LO.AdamW, torch.optim.AdamW, {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-7, "weight_decay": 0.05}),
    (LO.Adam, torch.optim.Adam, {"lr": 2e-3, "weight_decay": 0.01}),
    (LO.SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
    (LO.SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    (LO.SGD, torch.optim.SGD, {"lr": 0.05}),
]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, num_steps: int, seed: int, **step_kw) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(num_steps):
        x = torch.randn(5, 13, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step(**step_kw)


def _assert_models_close(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def _groups(model: torch.nn.Module) -> list[dict]:
    # Two groups with different lr so per-group options are exercised.
    first, second = list(model[0].parameters()), list(model[2].parameters())
    return [{"params": first}, {"params": second, "lr": 1e-3}]


@pytest.mark.parametrize("ours_cls, torch_cls, kwargs", CASES)
def test_same_trajectory_as_torch(ours_cls, torch_cls, kwargs: dict) -> None:
    a, b = _model(0), _model(0)
    _train(a, ours_cls(_groups(a), **kwargs), 12, seed=1)
    _train(b, torch_cls(_groups(b), foreach=False, **kwargs), 12, seed=1)
    _assert_models_close(a, b)


@pytest.mark.parametrize("ours_cls, torch_cls, kwargs", CASES)
def test_state_dict_moves_both_ways(ours_cls, torch_cls, kwargs: dict) -> None:
    ref = _model(0)
    ref_opt = torch_cls(_groups(ref), foreach=False, **kwargs)
    _train(ref, ref_opt, 4, seed=2)

    # torch -> ours: continue from torch's state and stay on torch's trajectory.
    ours = copy.deepcopy(ref)
    ours_opt = ours_cls(_groups(ours), **kwargs)
    ours_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    _train(ours, ours_opt, 3, seed=3)
    _train(ref, ref_opt, 3, seed=3)
    _assert_models_close(ours, ref)

    # ours -> torch: same keys and tensor layouts, and torch continues from it.
    sd = ours_opt.state_dict()
    ref_sd = ref_opt.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"]
    assert sd["state"].keys() == ref_sd["state"].keys()
    for idx, st in sd["state"].items():
        assert st.keys() == ref_sd["state"][idx].keys()
        for key, value in st.items():
            assert value.dtype == ref_sd["state"][idx][key].dtype and value.shape == ref_sd["state"][idx][key].shape
    back = copy.deepcopy(ours)
    back_opt = torch_cls(_groups(back), foreach=False, **kwargs)
    back_opt.load_state_dict(copy.deepcopy(sd))
    _train(back, back_opt, 2, seed=4)
    _train(ours, ours_opt, 2, seed=4)
    _assert_models_close(back, ours)


def test_grad_scale_is_applied_in_the_kernel() -> None:
    a, b = _model(0), _model(0)
    opt_a = LO.AdamW(a.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False)
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(3):
        for model, opt, gen, scale in ((a, opt_a, gen_a, 0.25), (b, opt_b, gen_b, None)):
            opt.zero_grad()
            x = torch.randn(5, 13, generator=gen)
            (model(x).square().mean() * 4.0).backward()  # a loss scaled by 4
            if scale is None:
                for p in model.parameters():
                    p.grad.mul_(0.25)
                opt.step()
            else:
                opt.step(grad_scale=scale)
    _assert_models_close(a, b)


@pytest.mark.parametrize("option", [{"amsgrad": True}, {"maximize": True}, {"foreach": True}, {"fused": True},
                                    {"capturable": True}])
def test_unsupported_options_are_refused(option: dict) -> None:
    with pytest.raises(ValueError, match=f"{next(iter(option))}=True is not supported"):
        LO.AdamW(_model(0).parameters(), **option)


def test_bad_hyper_parameters_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="beta1 must be in"):
        LO.Adam(_model(0).parameters(), betas=(1.5, 0.9))
    with pytest.raises(ValueError, match="nesterov requires momentum"):
        LO.SGD(_model(0).parameters(), lr=0.1, nesterov=True)


def test_backend_choice_is_used() -> None:
    a, b = _model(0), _model(0)
    _train(a, LO.AdamW(a.parameters(), backend="numba"), 3, seed=6)
    _train(b, LO.AdamW(b.parameters(), backend="torch"), 3, seed=6)
    _assert_models_close(a, b)
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        _train(a, LO.AdamW(a.parameters(), backend="nope"), 1, seed=6)
