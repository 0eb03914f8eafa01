"""Every CPU backend against torch.optim.AdamW / Adam / SGD."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import luwu_rt.kernels as K
from luwu_rt.kernels import _cpp
from optim_reference import assert_close, random_hparams, run_case

CPU_BACKENDS = ["cpp", "numba", "torch"]
SIZES = [0, 1, 7, 1023, 4097]
KINDS = ["adamw", "adam", "sgd"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numel", SIZES)
def test_matches_torch_fp32(backend: str, kind: str, numel: int) -> None:
    # str hashes are salted per process; crc32 keeps the cases the same on every run.
    rng = random.Random(zlib.crc32(f"{backend}/{kind}/{numel}".encode()))
    for decay, scaled, zero_init in ((False, False, True), (True, True, False), (True, True, True)):
        hp = random_hparams(rng, kind, decay=decay, scaled=scaled)
        run_case(kind, backend, numel=numel, num_steps=rng.choice([1, 17, 50]), grad_dtype=torch.float32,
                 out_dtype=None, hp=hp, seed=rng.randrange(1 << 30), zero_init=zero_init)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_grads_and_copy_out(backend: str, kind: str, grad_dtype: torch.dtype,
                                          out_dtype: torch.dtype) -> None:
    rng = random.Random(11)
    hp = random_hparams(rng, kind, decay=True, scaled=True)
    run_case(kind, backend, numel=1023, num_steps=5, grad_dtype=grad_dtype, out_dtype=out_dtype, hp=hp, seed=3)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_grads_propagate_like_torch(backend: str, kind: str) -> None:
    hp = random_hparams(random.Random(5), kind, decay=True, scaled=True)
    run_case(kind, backend, numel=4097, num_steps=3, grad_dtype=torch.float32, out_dtype=torch.bfloat16, hp=hp,
             seed=9, non_finite=True)


@pytest.mark.parametrize("isa", _cpp.supported_isas())
@pytest.mark.parametrize("kind", KINDS)
def test_cpp_every_isa_of_this_cpu(monkeypatch: pytest.MonkeyPatch, isa: str, kind: str) -> None:
    monkeypatch.setattr(_cpp, "_BEST_ISA", _cpp._ISAS[isa])
    rng = random.Random(17)
    for numel in (7, 1023, 4097):  # tails of every length class of both vector widths
        hp = random_hparams(rng, kind, decay=True, scaled=True)
        run_case(kind, "cpp", numel=numel, num_steps=4, grad_dtype=torch.bfloat16, out_dtype=torch.float16, hp=hp,
                 seed=numel, non_finite=True)
        run_case(kind, "cpp", numel=numel, num_steps=4, grad_dtype=torch.float16, out_dtype=torch.bfloat16, hp=hp,
                 seed=numel + 1)


def test_cpp_threads_split_bit_identically() -> None:
    # Large enough (> 3 Mi elements) that three threads each take blocks.
    n = 3 * (1 << 20) + 7
    grad = torch.randn(n, dtype=torch.bfloat16)
    results = []
    for num_threads in (1, 2, 3):
        p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step in (1, 2):
            _cpp.adam(p, grad, m, v, out, decoupled=True, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.1, grad_scale=0.5, num_threads=num_threads)
        results.append(torch.cat([p, m, v, out.float()]))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_cpp_thread_count_follows_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(_cpp._C, "optim_sgd_step", lambda **kw: seen.append(kw["num_threads"]))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 5)
    p = torch.zeros(4)
    _cpp.sgd(p, p, None, None, first_step=True, nesterov=False, lr=0.1, momentum=0.0, dampening=0.0,
             weight_decay=0.0, grad_scale=1.0)
    _cpp.sgd(p, p, None, None, first_step=True, nesterov=False, lr=0.1, momentum=0.0, dampening=0.0,
             weight_decay=0.0, grad_scale=1.0, num_threads=3)
    assert seen == [5, 3]
    with pytest.raises(ValueError, match="num_threads"):
        _cpp.sgd(p, p, None, None, first_step=True, nesterov=False, lr=0.1, momentum=0.0, dampening=0.0,
                 weight_decay=0.0, grad_scale=1.0, num_threads=0)


def test_traffic_probe_moves_the_bytes() -> None:
    n = 1000
    p, g, m, v = (torch.full((n,), float(i)) for i in range(1, 5))
    before = [t.clone() for t in (p, m, v)]
    out = torch.zeros(n, dtype=torch.bfloat16)
    _cpp.traffic_probe(p, g, m, v, out)
    # Every element of every written array changed (XOR with the gradient's bits) and the copy was written.
    assert all(bool((a.view(torch.int32) != b.view(torch.int32)).all()) for a, b in zip((p, m, v), before))
    assert bool((out.view(torch.int16) != 0).all())


def test_numba_cuda_in_simulator_subprocess() -> None:
    # The simulator must be chosen before numba is imported, so it gets its own
    # interpreter; the setting never reaches this process's other tests.
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    here = Path(__file__).parent
    proc = subprocess.run([sys.executable, str(here / "optim_reference.py")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "simulator cases passed: 48" in proc.stdout


def test_cupy_on_gpu() -> None:
    reason = K.available()["cupy"]
    if reason is not None:
        pytest.skip(f"cupy backend unavailable: {reason}")
    rng = random.Random(23)
    for kind in KINDS:
        for numel in SIZES:
            hp = random_hparams(rng, kind, decay=True, scaled=True)
            _run_on_cuda(kind, "cupy", numel, hp)


def test_numba_cuda_on_gpu() -> None:
    from luwu_rt.kernels import _numba_cuda

    if _numba_cuda.SIMULATOR or K.available()["numba-cuda"] is not None:
        pytest.skip(f"no real CUDA device for numba: {K.available()['numba-cuda'] or 'simulator active'}")
    rng = random.Random(29)
    for kind in KINDS:
        for numel in SIZES:
            _run_on_cuda(kind, "numba-cuda", numel, random_hparams(rng, kind, decay=True, scaled=True))


def _run_on_cuda(kind: str, backend: str, numel: int, hp: dict) -> None:
    """GPU backends against the torch reference backend on the same device."""
    init = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).cuda()
    for grad_dtype in (torch.float32, torch.bfloat16, torch.float16):
        sides = {}
        for b in (backend, "torch"):
            p = init.clone()
            state = [torch.zeros_like(p), torch.zeros_like(p)]
            out = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
            for step in range(1, 4):
                grad = torch.randn(numel, generator=torch.Generator().manual_seed(step)).to(grad_dtype).cuda()
                if kind == "sgd":
                    K.sgd_step(p, grad, state[0], step=step, lr=hp["lr"], momentum=hp["momentum"],
                               dampening=hp["dampening"], nesterov=hp["nesterov"],
                               weight_decay=hp["weight_decay"], grad_scale=hp["grad_scale"], param_out=out,
                               backend=b)
                else:
                    fn = K.adamw_step if kind == "adamw" else K.adam_step
                    fn(p, grad, state[0], state[1], step=step, lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"],
                       eps=hp["eps"], weight_decay=hp["weight_decay"], grad_scale=hp["grad_scale"], param_out=out,
                       backend=b)
            torch.cuda.synchronize()
            sides[b] = (p.cpu(), [s.cpu() for s in state], out.cpu())
        (p, state, out), (rp, rstate, _) = sides[backend], sides["torch"]
        for name, ours, ref in zip(("param", "state0", "state1"), [p, *state], [rp, *rstate]):
            assert_close(f"{name} ({kind}/{backend} numel={numel} grad={grad_dtype})", ours, ref)
        assert torch.equal(out.view(torch.int16), p.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("spin_micros", [0, 50])
def test_cpp_pool_with_changing_thread_counts_and_concurrent_callers(spin_micros: int) -> None:
    # Runs with 1-4 threads interleave from four Python threads (the GIL is
    # released in the kernels); every result must match the reference backend.
    from concurrent.futures import ThreadPoolExecutor

    n = 2 * (1 << 20) + 3  # enough for two threads (dispatch.cpp: kMinPerThread)

    def job(seed: int) -> bool:
        gen = torch.Generator().manual_seed(seed)
        grad = torch.randn(n, generator=gen)
        ours, ref = torch.zeros(n), torch.zeros(n)
        buf_ours, buf_ref = torch.zeros(n), torch.zeros(n)
        for step in range(1, 6):
            kw = {"nesterov": False, "lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.01,
                  "grad_scale": 1.0, "first_step": step == 1}
            _cpp.sgd(ours, grad, buf_ours, None, num_threads=1 + (seed + step) % 4, **kw)
            from luwu_rt.kernels import _torch

            _torch.sgd(ref, grad, buf_ref, None, **kw)
        return torch.equal(ours, ref) and torch.equal(buf_ours, buf_ref)

    _cpp._C.optim_set_spin_micros(spin_micros)  # 0: every wait goes to sleep on the condition variables
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            assert all(pool.map(job, range(8)))
    finally:
        _cpp._C.optim_set_spin_micros(50)
    with pytest.raises(ValueError, match="micros must be >= 0"):
        _cpp._C.optim_set_spin_micros(-1)
