"""Runs a luwu_rt.kernels step function and torch.optim side by side on the
same gradients and compares the results (shared by the kernel tests and the
CUDA-simulator subprocess)."""

from __future__ import annotations

import random
import sys

import torch

import luwu_rt.kernels as K

RTOL = 1e-6


def random_hparams(rng: random.Random, kind: str, *, decay: bool, scaled: bool) -> dict:
    hp = {"lr": 10 ** rng.uniform(-4, -1), "weight_decay": rng.uniform(0.001, 0.1) if decay else 0.0,
          "grad_scale": rng.uniform(0.1, 4.0) if scaled else 1.0}
    if kind in ("adamw", "adam"):
        # beta1 below 0.5 exercises lerp's other branch (weight >= 0.5).
        hp.update(beta1=rng.choice([rng.uniform(0.0, 0.5), rng.uniform(0.5, 0.99)]),
                  beta2=rng.uniform(0.9, 0.9999), eps=10 ** rng.uniform(-10, -6))
    else:
        momentum = rng.choice([0.0, rng.uniform(0.1, 0.95)])
        nesterov = momentum > 0 and rng.random() < 0.5
        hp.update(momentum=momentum, nesterov=nesterov, dampening=0.0 if nesterov else rng.choice([0.0, 0.3]))
    return hp


def _torch_optimizer(kind: str, param: torch.nn.Parameter, hp: dict) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD([param], lr=hp["lr"], momentum=hp["momentum"], dampening=hp["dampening"],
                               nesterov=hp["nesterov"], weight_decay=hp["weight_decay"], foreach=False)
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return cls([param], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
               weight_decay=hp["weight_decay"], foreach=False)


def make_grads(numel: int, num_steps: int, grad_dtype: torch.dtype, *, seed: int,
               non_finite: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(numel, generator=gen).to(grad_dtype) for _ in range(num_steps)]
    if non_finite and numel >= 4:
        grads[-1][0] = float("nan")
        grads[-1][1] = float("inf")
        grads[-1][numel - 1] = float("-inf")
    return grads


def assert_close(name: str, ours: torch.Tensor, ref: torch.Tensor, scale: float = 0.0) -> float:
    """1e-6 relative, with an absolute floor of 1e-6 of the tensor's scale (the
    largest finite magnitude it has had) for elements passing through zero:
    torch's CPU sqrt is not correctly rounded (the kernels' is), so an update
    can differ by an ulp of the values it was computed from. Returns the scale."""
    finite = ref[torch.isfinite(ref)]
    scale = max(scale, float(finite.abs().max()) if finite.numel() else 0.0)
    torch.testing.assert_close(ours, ref, rtol=RTOL, atol=RTOL * scale, equal_nan=True, msg=lambda m: f"{name}: {m}")
    return scale


def run_case(kind: str, backend: str, *, numel: int, num_steps: int, grad_dtype: torch.dtype,
             out_dtype: torch.dtype | None, hp: dict, seed: int, non_finite: bool = False,
             zero_init: bool = False) -> None:
    """Steps both sides num_steps times and asserts they agree after each step.

    zero_init starts the parameters at 0, so that they are the sum of the
    updates and the 1e-6 relative check sees an update's own rounding (from
    random parameters of scale 1 an update of scale lr is mostly below it).
    """
    gen = torch.Generator().manual_seed(seed + 1)
    init = torch.zeros(numel) if zero_init else torch.randn(numel, generator=gen)
    ref_param = torch.nn.Parameter(init.clone())
    opt = _torch_optimizer(kind, ref_param, hp)
    param = init.clone()
    state = [torch.zeros(numel), torch.zeros(numel)] if kind != "sgd" else [torch.zeros(numel)]
    out = torch.empty(numel, dtype=out_dtype) if out_dtype is not None else None
    scales: dict[str, float] = {}
    for step, grad in enumerate(make_grads(numel, num_steps, grad_dtype, seed=seed, non_finite=non_finite), 1):
        ref_param.grad = grad.to(torch.float32) * hp["grad_scale"]
        opt.step()
        common = {"step": step, "lr": hp["lr"], "weight_decay": hp["weight_decay"], "grad_scale": hp["grad_scale"],
                  "param_out": out, "backend": backend}
        if kind == "sgd":
            K.sgd_step(param, grad, state[0], momentum=hp["momentum"], dampening=hp["dampening"],
                       nesterov=hp["nesterov"], **common)
        else:
            fn = K.adamw_step if kind == "adamw" else K.adam_step
            fn(param, grad, state[0], state[1], beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"], **common)
        where = f"{kind}/{backend} numel={numel} step={step} grad={grad_dtype} hp={hp}"
        ref_state = opt.state[ref_param]
        pairs = [("param", param, ref_param.detach())]
        if kind != "sgd":
            pairs += [("exp_avg", state[0], ref_state["exp_avg"]), ("exp_avg_sq", state[1], ref_state["exp_avg_sq"])]
        elif hp["momentum"] != 0.0:
            pairs.append(("momentum_buffer", state[0], ref_state["momentum_buffer"]))
        for name, ours, ref in pairs:
            scales[name] = assert_close(f"{name} ({where})", ours, ref, scales.get(name, 0.0))
        if out is not None:
            # Bit-equal to torch's own rounding of the (our) fp32 result, NaN and Inf included.
            expect = param.to(out_dtype).view(torch.int16)
            mismatched = int((out.view(torch.int16) != expect).sum())
            assert mismatched == 0, f"param_out differs from param.to({out_dtype}) in {mismatched} elements ({where})"


def _simulator_main() -> int:
    """Entry point for the NUMBA_ENABLE_CUDASIM=1 subprocess: tiny sizes only."""
    rng = random.Random(7)
    cases = 0
    for kind in ("adamw", "adam", "sgd"):
        for numel in (0, 1, 7, 33):
            for grad_dtype, out_dtype in ((torch.float32, None), (torch.float32, torch.float32),
                                          (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)):
                hp = random_hparams(rng, kind, decay=numel % 2 == 1, scaled=True)
                run_case(kind, "numba-cuda", numel=numel, num_steps=3, grad_dtype=grad_dtype, out_dtype=out_dtype,
                         hp=hp, seed=rng.randrange(1 << 30), non_finite=numel == 33)
                cases += 1
    print(f"simulator cases passed: {cases}")
    return 0


if __name__ == "__main__":
    sys.exit(_simulator_main())
