"""Plans the kit's tests share: hand-written ones with and without a missing dependency, and small planner plans."""

from luwu_rt.models.presets import get_preset
from luwu_rt.plan import (Access, Belady, Budgets, Compute, Free, Load, ModelSpec, OptimStep, Placement, ShardId,
                          Strategy, UnitSpec, gpt_model_spec, lower_bounds, plan_step)
from luwu_rt.plan.search import fitting_budgets
from luwu_rt.testing import hand_plan

MiB = 1 << 20
P, M = ShardId(0, "param", 0), ShardId(0, "master", 0)
ROOMY = Budgets(device_bytes=1 << 30, host_bytes=1 << 30)


def load_then_compute(*, forget: bool):
    """A parameter loaded to the device while the host updates another unit; the forward reads the loaded copy.
    ``forget``: the forward depends on the update only, not on the load that writes what it reads (the load is
    so quick that without delays it ends first anyway)."""
    ops = [
        Load(deps=(), queue="h2d", nbytes=64 * MiB, inputs=(Access(P, "host", 0),), outputs=(Access(P, "device", 0),)),
        OptimStep(deps=(), queue="optim", unit=1, num_params=8 << 20, tier="host",
                  inputs=(Access(M, "host", 64 * MiB),), outputs=(Access(M, "host", 64 * MiB),)),
        Compute(deps=(1,) if forget else (0, 1), queue="compute", name="F0", unit=0, flops=10**12,
                inputs=(Access(P, "device", 0),)),
        Free(deps=(0, 2), queue="mem", shard=P, tier="device", slot=0),
    ]
    return hand_plan(ops, shards={P: 64 * MiB, M: 32 * MiB}, homes={"param": "host", "master": "host"}, budgets=ROOMY)


def tiny_model(**kw) -> ModelSpec:
    return gpt_model_spec(get_preset("gpt-tiny"), chunk_bytes=64 * 1024, **kw)


def small_model() -> ModelSpec:
    """Three units, one shard per state: plans of a few dozen ops, for tests that simulate many of them."""
    units = tuple(UnitSpec(name=f"u{i}", num_params=n, flops_per_token=2 * n) for i, n in
                  enumerate([20_000, 60_000, 30_000]))
    return ModelSpec(units=units, chunk_bytes=64 * 1024, max_shards_per_state=1, tokens_per_step=64,
                     activation_bytes=64 * 1024)


def tight_plan(model: ModelSpec, placement: Placement, *, strategy: Strategy = Strategy(), factor: float = 1.3,
               host_factor: float | None = None, policy="belady"):
    """A plan under budgets ``factor`` (on the host ``host_factor``) times the smallest that plan (with Belady),
    where eviction and prefetch matter. The smallest that plan, not the lower bounds: how far above its bound a
    plan needs changes with the op granularity (an update in pieces stages less at once than the forward holds)."""
    least = fitting_budgets(Budgets(device_bytes=0, host_bytes=0),
                            bounds=lower_bounds(model, placement=placement, strategy=strategy),
                            plan=lambda b: plan_step(model, budgets=b, placement=placement, strategy=strategy))
    assert least is not None, "no budgets plan this model"
    budgets = Budgets(device_bytes=int(least.device_bytes * factor) + 4096,
                      host_bytes=int(least.host_bytes * (host_factor or factor)) + 4096)
    return plan_step(model, budgets=budgets, placement=placement, strategy=strategy, policy=policy)


class KeepEmbedding(Belady):
    """Belady, except that the embedding (unit 0) never leaves the device while anything else can."""

    name = "keep-embedding"

    def victim(self, candidates, view):
        if view.tier != "device":
            return super().victim(candidates, view)
        others = [s for s in candidates if s.unit != 0]
        return super().victim(others, view) if others else None


class NoPrefetch(Belady):
    """Belady's evictions, but no load starts before the step before its reader finished."""

    name = "no-prefetch"

    def prefetch_depth(self, shard, view):
        return 0
