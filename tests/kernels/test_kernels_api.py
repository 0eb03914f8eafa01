"""Argument checking and backend selection of luwu_rt.kernels."""

from __future__ import annotations

import pytest
import torch

import luwu_rt.kernels as K


def _adam_args(n: int = 8) -> dict:
    return {"param": torch.zeros(n), "grad": torch.ones(n), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}


@pytest.mark.parametrize("fn", [K.adamw_step, K.adam_step])
@pytest.mark.parametrize("name, bad, match", [
    ("param", torch.zeros(8, dtype=torch.float64), "param has dtype"),
    ("grad", torch.zeros(8, dtype=torch.float64), "grad has dtype"),
    ("grad", torch.zeros(9), "grad has shape"),
    ("exp_avg", torch.zeros(8, dtype=torch.bfloat16), "exp_avg has dtype"),
    ("exp_avg_sq", torch.zeros(4), "exp_avg_sq has shape"),
    ("exp_avg", torch.zeros(16)[::2], "exp_avg is not contiguous"),
    ("param", torch.zeros(16)[::2], "param is not contiguous"),
    ("grad", torch.zeros(8, device="meta"), "grad is on meta"),
    ("exp_avg_sq", [0.0] * 8, "exp_avg_sq must be a torch.Tensor"),
])
def test_adam_bad_tensor_names_the_argument(fn, name: str, bad: object, match: str) -> None:
    args = _adam_args()
    args[name] = bad
    with pytest.raises(ValueError, match=match):
        fn(args.pop("param"), args.pop("grad"), args.pop("exp_avg"), args.pop("exp_avg_sq"), step=1, lr=0.1)


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(8, dtype=torch.float64), "param_out has dtype"),
    (torch.zeros(7, dtype=torch.bfloat16), "param_out has shape"),
    (torch.zeros(16, dtype=torch.float16)[::2], "param_out is not contiguous"),
])
def test_bad_param_out(bad: torch.Tensor, match: str) -> None:
    a = _adam_args()
    with pytest.raises(ValueError, match=match):
        K.adamw_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], step=1, lr=0.1, param_out=bad)


@pytest.mark.parametrize("kwargs, match", [
    ({"step": 0}, "step must be an integer >= 1"),
    ({"step": 1.5}, "step must be an integer >= 1"),
    ({"lr": -1.0}, "lr must be >= 0"),
    ({"beta1": 1.0}, "beta1 must be in"),
    ({"beta2": -0.1}, "beta2 must be in"),
    ({"eps": float("nan")}, "eps must be finite"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
    ({"grad_scale": float("inf")}, "grad_scale must be finite"),
    ({"backend": "fortran"}, "backend must be 'auto' or one of"),
])
def test_bad_hyper_parameters(kwargs: dict, match: str) -> None:
    a = _adam_args()
    call = {"step": 1, "lr": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        K.adamw_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], **call)


def test_sgd_checks() -> None:
    p, g = torch.zeros(8), torch.ones(8)
    with pytest.raises(ValueError, match="momentum_buffer is None but momentum != 0"):
        K.sgd_step(p, g, step=1, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="momentum_buffer has shape"):
        K.sgd_step(p, g, torch.zeros(3), step=1, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="nesterov requires momentum > 0"):
        K.sgd_step(p, g, step=1, lr=0.1, nesterov=True)
    K.sgd_step(p, g, step=1, lr=0.5)  # momentum 0 needs no buffer
    assert torch.equal(p, torch.full((8,), -0.5))


def test_available_lists_every_backend_with_reasons() -> None:
    status = K.available()
    assert set(status) == set(K.BACKENDS)
    assert status["torch"] is None and status["cpp"] is None and status["numba"] is None
    for name, reason in status.items():
        assert reason is None or (isinstance(reason, str) and reason), name


def test_auto_picks_cpp_on_cpu_and_refuses_wrong_device() -> None:
    assert K.resolve_backend("auto", torch.device("cpu")).__name__.endswith("_cpp")
    if K.available()["cupy"] is not None:
        with pytest.raises(ValueError, match="backend 'cupy' is unavailable"):
            K.resolve_backend("cupy", torch.device("cpu"))
    with pytest.raises(ValueError, match="runs on \\['cpu'\\] tensors"):
        K.resolve_backend("numba", torch.device("cuda"))


def test_backends_agree_bit_for_bit_on_fp32_where_torch_is_not_involved() -> None:
    # cpp and numba implement the same roundings (numba's fma goes through
    # float64, which can differ in rare double-rounding cases only).
    results = []
    for backend in ("cpp", "numba"):
        gen = torch.Generator().manual_seed(0)
        p, m, v = torch.randn(4097, generator=gen), torch.zeros(4097), torch.zeros(4097)
        for step in range(1, 4):
            K.adamw_step(p, torch.randn(4097, generator=gen), m, v, step=step, lr=1e-2, weight_decay=0.01,
                         backend=backend)
        results.append(torch.cat([p, m, v]))
    assert int((results[0] != results[1]).sum()) <= 2
