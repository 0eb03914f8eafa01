"""``OptimizerStep`` (exec/step.py) against plain references: the schedule and clip factor against the
formulas written out, and whole steps of a plan against ``torch.optim.AdamW`` on the same gradients."""

from __future__ import annotations

import math

import pytest
import torch

from luwu_rt.exec import Executor, OptimizerStep, StepOutcome
from luwu_rt.optim.config import OptimConfig
from luwu_rt.plan import Budgets, ModelSpec, Placement, UnitSpec, plan_step, validate
from luwu_rt.store import Arena, TieredStore

SIZES = (3000, 5000)
CHUNK = 2 * 4096
OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, beta1=0.9, beta2=0.95, eps=1e-4, weight_decay=0.1,
                    grad_clip=1.0)
TOTAL_STEPS = 5
LOSS_SCALE = 4.0


def reference_lr(step: int, o: OptimConfig = OPTIM, total: int = TOTAL_STEPS) -> float:
    """Linear warmup from 0, then cosine from ``lr`` down to ``min_lr`` at ``total``."""
    if step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    progress = min((step - o.warmup_steps) / (total - o.warmup_steps), 1.0)
    return o.min_lr + (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress)) / 2


def reference_clip(norm: float | None, max_norm: float) -> float:
    """Global-norm clipping as torch.nn.utils.clip_grad_norm_ scales: max_norm / (norm + 1e-6), at most 1."""
    if norm is None or max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def _step(*, shards=None, optim: OptimConfig = OPTIM) -> OptimizerStep:
    return OptimizerStep(shards or {}, optim=optim, total_steps=TOTAL_STEPS, loss_scale=LOSS_SCALE,
                         param_dtype=torch.bfloat16, grad_dtype=torch.float32)


@pytest.mark.parametrize("step", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("norm", [None, 0.0, 0.5, 1.0, 3.0, 250.0, math.inf, math.nan])
@pytest.mark.parametrize("grad_clip", [0.0, 1.0])
def test_hyper_parameters_follow_the_schedule_and_the_clip_factor(step, norm, grad_clip) -> None:
    o = OptimConfig(**{**{f: getattr(OPTIM, f) for f in OPTIM.__slots__}, "grad_clip": grad_clip})
    h = _step(optim=o).hyper(step, norm)
    assert h.lr == pytest.approx(reference_lr(step, o), rel=1e-12)
    assert h.grad_scale == pytest.approx(reference_clip(norm, grad_clip) / LOSS_SCALE, rel=1e-12)
    assert (h.beta1, h.beta2, h.eps, h.weight_decay) == (o.beta1, o.beta2, o.eps, o.weight_decay)


def test_adam_counts_applied_updates_only() -> None:
    """An update that ran elsewhere (the optimizer node's outcome): skipped steps leave Adam's count."""
    s = _step()
    s.start_at(adam_step=7)
    for step, skipped in ((8, False), (9, True), (10, False)):
        s.begin(step)
        assert s.adamw.step == s.adam_step + 1  # the kernel's t is the next update's
        result = s.finish(outcome=StepOutcome(grad_norm=2.5, skipped=skipped))
        assert (result.lr, result.grad_norm, result.skipped) == (reference_lr(step), 2.5, skipped)
    assert s.adam_step == 9


class _Run:
    """A two-unit plan whose update waits for the norm, run by the executor with ``OptimizerStep``'s handlers;
    its backward writes the gradients the test gives (times the loss scale, as a scaled loss would)."""

    def __init__(self) -> None:
        model = ModelSpec(units=tuple(UnitSpec(name=f"u{i}", num_params=n) for i, n in enumerate(SIZES)),
                          param_bytes=2, grad_bytes=4, chunk_bytes=CHUNK, max_shards_per_state=2,
                          optimizer_waits_for_backward=True)
        plan = plan_step(model, budgets=Budgets(device_bytes=1 << 20, host_bytes=1 << 20),
                         placement=Placement(params="host", optimizer="host", grads="host"))
        validate(plan)
        assert plan.count("NormReduce") == 1
        self.store = TieredStore(plan, arenas={t: Arena(n, tier=t) for t, n in plan.arena_bytes.items()},
                                 nvme=None)
        self.step = _step(shards=plan.shards)
        self.grads: dict[int, torch.Tensor] = {}
        self.executor = Executor(plan, store=self.store, handlers={"Compute": self._compute, **self.step.handlers()},
                                 chaos=None)

    def _compute(self, op, views) -> None:
        if op.name.startswith("B"):
            for sid, view in views.items():
                if sid.state == "grad":
                    info, start = self.store.shards[sid], self.store.offsets[sid]
                    scaled = self.grads[sid.unit][start : start + info.numel] * LOSS_SCALE
                    view.view(torch.float32)[: info.numel].copy_(scaled)

    def run(self, step: int, grads: dict[int, torch.Tensor]):
        self.grads = grads
        self.step.begin(step)
        self.executor.run()
        return self.step.finish()

    def read(self, unit: int, state: str) -> torch.Tensor:
        dtype = torch.bfloat16 if state == "param" else torch.float32
        return self.store.read_state(unit, state, torch.empty(SIZES[unit], dtype=dtype))

    def close(self) -> None:
        self.executor.close()
        self.store.close()


def test_steps_equal_torch_adamw_with_clipping_skips_and_the_schedule() -> None:
    """Three steps: a clipped one, one with an infinite gradient (skipped: nothing changes but the compute
    copy, refreshed from the master; Adam's count stays), an unclipped one, against torch.optim.AdamW given
    the same unscaled, clipped gradients, the schedule's lr, and no step for the skipped one."""
    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=g) for n in SIZES]
    params = [torch.nn.Parameter(m.clone()) for m in masters]
    torch_adamw = torch.optim.AdamW(params, lr=1.0, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps,
                                    weight_decay=OPTIM.weight_decay, foreach=False)
    run = _Run()
    try:
        for u, m in enumerate(masters):
            run.store.write_state(u, "master", m)
            run.store.write_state(u, "param", m.to(torch.bfloat16))
            for state in ("exp_avg", "exp_avg_sq"):
                run.store.write_state(u, state, torch.zeros_like(m))
        run.store.flush()
        steps = {1: [torch.randn(n, generator=g) * 3 for n in SIZES],  # norm ~ 200: clipped to 1
                 2: [torch.randn(n, generator=g) for n in SIZES],
                 3: [torch.randn(n, generator=g) * 1e-3 for n in SIZES]}  # norm ~ 0.09: not clipped
        steps[2][1][17] = math.inf
        for step, grads in steps.items():
            before = {(u, s): run.read(u, s) for u in range(len(SIZES)) for s in ("master", "exp_avg", "exp_avg_sq")}
            result = run.run(step, dict(enumerate(grads)))
            norm = math.sqrt(sum(float(x.double().square().sum()) for x in grads))
            assert result.lr == pytest.approx(reference_lr(step), rel=1e-12)
            if step == 2:
                assert result.skipped and not math.isfinite(result.grad_norm) and run.step.adam_step == 1
                for (u, s), value in before.items():
                    assert torch.equal(run.read(u, s), value), (u, s)
                for u in range(len(SIZES)):
                    assert torch.equal(run.read(u, "param"), run.read(u, "master").to(torch.bfloat16))
                continue
            assert not result.skipped and result.grad_norm == pytest.approx(norm, rel=1e-5)
            clip = reference_clip(norm, OPTIM.grad_clip)
            assert (clip < 0.1) == (step == 1)
            for p, grad in zip(params, grads):
                p.grad = grad * clip
            for group in torch_adamw.param_groups:
                group["lr"] = reference_lr(step)
            torch_adamw.step()
            for u, p in enumerate(params):
                state = torch_adamw.state[p]
                torch.testing.assert_close(run.read(u, "exp_avg"), state["exp_avg"], rtol=1e-5, atol=1e-9)
                torch.testing.assert_close(run.read(u, "exp_avg_sq"), state["exp_avg_sq"], rtol=1e-5, atol=1e-12)
                torch.testing.assert_close(run.read(u, "master"), p.detach(), rtol=1e-5, atol=1e-7)
                assert torch.equal(run.read(u, "param"), run.read(u, "master").to(torch.bfloat16))
        assert run.step.adam_step == 2 and int(torch_adamw.state[params[0]]["step"]) == 2
    finally:
        run.close()
