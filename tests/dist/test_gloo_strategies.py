"""Every data-parallel strategy in real processes (gloo on loopback) against the single-process run on the
same global batch: 10 steps of gpt-tiny, per-rank batch 2 on 2 ranks (4 for hsdp) against batch 2N on one,
losses equal within 1e-5 relative; with every placement on the device (clipping on: updates wait for the
global norm) and with the optimizer state on NVMe (clipping off: updates overlap backward); in the
executor's chaos mode; and checkpoints moved between numbers of ranks and strategies."""

from __future__ import annotations

from pathlib import Path

import pytest

from rank_jobs import SAVE_AT, STEPS, config
from ranks import run_ranks
import rank_jobs

from luwu_rt.engine import Engine
from luwu_rt.exec.chaos import CHAOS_ENV

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
ON_DEVICE = {"offload": {"params": "device", "optimizer": "device", "grads": "device"}, "optim": {"grad_clip": 1.0}}
OPTIM_ON_NVME = {"offload": {"optimizer": "nvme", "params": "host", "host_mem": "8MiB"}, "optim": {"grad_clip": 0.0}}


def _merge(*parts: dict) -> dict:
    from luwu_rt.config import merge

    out: dict = {}
    for p in parts:
        out = merge(out, p)
    return out


def _local(overrides: dict, *, world: int, save: str | None = None) -> list[float]:
    """The single-process run on the global batch of ``world`` ranks."""
    with Engine(None, config(**_merge(overrides, {"batch_size": 2 * world}))) as engine:
        assert engine.strategy.name == "local"
        losses = []
        for _ in range(STEPS):
            losses.append(engine.train_step()["loss"])
            if save and engine.step == SAVE_AT:
                engine.save(save)
        return losses


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst <= 1e-5, f"{what}: losses differ from the single-process run by {worst:.2e} relative\n{got}\n{want}"


@pytest.fixture(scope="module")
def nvme_root(tmp_path_factory):
    return tmp_path_factory.mktemp("nvme")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def reference(ckpts, nvme_root):
    """Single-process losses per placement; the on-device run saves the step-5 checkpoint ``local``."""
    with pytest.MonkeyPatch.context() as m:
        m.delenv(CHAOS_ENV, raising=False)
        return {"device": _local(ON_DEVICE, world=2, save=str(ckpts / "local")),
                "nvme": _local(_merge(OPTIM_ON_NVME, {"offload": {"nvme_dir": str(nvme_root / "local")}}), world=2)}


def _runs(placement: dict, nvme_root, tag: str) -> list[tuple[str, dict]]:
    runs = []
    for s in STRATEGIES:
        extra = {"offload": {"nvme_dir": str(nvme_root / f"{tag}-{s}")}} if "optimizer" in placement["offload"] and \
            placement["offload"]["optimizer"] == "nvme" else {}
        runs.append((s, _merge(placement, {"strategy": s}, extra)))
    return runs


@pytest.mark.parametrize("chaos_mode", [False, True], ids=["plain", "chaos"])
def test_every_strategy_on_device_equals_local(reference, ckpts, nvme_root, chaos_mode):
    env = {CHAOS_ENV: "7"} if chaos_mode else {CHAOS_ENV: ""}
    save = None if chaos_mode else {"zero3": str(ckpts / "zero3")}
    results = run_ranks(rank_jobs.train, 2, _runs(ON_DEVICE, nvme_root, "dev"), save, env=env)
    for s in STRATEGIES:
        r = results[0][s]
        assert r["strategy"] == s and r["placement"].optimizer == "device"
        _close(r["losses"], reference["device"], f"{s} on device{' (chaos)' if chaos_mode else ''}")
        assert results[1][s]["losses"] == r["losses"], "every rank reports the global loss"
        assert results[1][s]["val"] == r["val"]


@pytest.mark.parametrize("chaos_mode", [False, True], ids=["plain", "chaos"])
def test_every_strategy_with_optimizer_on_nvme_equals_local(reference, nvme_root, chaos_mode):
    env = {CHAOS_ENV: "11"} if chaos_mode else {CHAOS_ENV: ""}
    results = run_ranks(rank_jobs.train, 2, _runs(OPTIM_ON_NVME, nvme_root, f"nvme{int(chaos_mode)}"), env=env)
    for s in STRATEGIES:
        r = results[0][s]
        assert r["strategy"] == s and r["placement"].optimizer == "nvme"
        _close(r["losses"], reference["nvme"], f"{s} with optimizer on NVMe{' (chaos)' if chaos_mode else ''}")
    # Each rank kept its own shards in its own directory (seen while the run held them: the directories the
    # engine created are gone after it closed).
    for rank in (0, 1):
        files = results[rank]["zero3"]["nvme_files"]
        home = nvme_root / f"nvme{int(chaos_mode)}-zero3" / f"rank-{rank}"
        assert files and all(Path(f).parent.parent == home for f in files), (rank, files)


@pytest.mark.parametrize("chaos_mode", [False, True], ids=["plain", "chaos"])
def test_hsdp_on_four_ranks_in_groups_of_two_equals_local(nvme_root, chaos_mode):
    with pytest.MonkeyPatch.context() as m:
        m.delenv(CHAOS_ENV, raising=False)
        want = _local(ON_DEVICE, world=4)
    env = {CHAOS_ENV: "13"} if chaos_mode else {CHAOS_ENV: ""}
    runs = [("hsdp", _merge(ON_DEVICE, {"strategy": "hsdp", "shard_group_size": 2}))]
    results = run_ranks(rank_jobs.train, 4, runs, env=env)
    _close(results[0]["hsdp"]["losses"], want, "hsdp G=2 on 4 ranks")


def test_checkpoints_move_between_numbers_of_ranks_and_strategies(reference, ckpts, chaos):
    """1 -> 2 ranks (local -> ddp), 2 -> 2 (zero3 -> ddp), 2 -> 1 (zero3 -> local): each resumed run
    continues the single-process run exactly. Depends on the plain on-device run having saved ``zero3``."""
    local_ckpt = ckpts / "local" / f"step_{SAVE_AT:08d}"
    zero3_ckpt = ckpts / "zero3" / f"step_{SAVE_AT:08d}"
    assert zero3_ckpt.is_dir(), "the zero3 run of test_every_strategy_on_device_equals_local saves it"
    want = reference["device"][SAVE_AT:]
    on_two = {**ON_DEVICE, "strategy": "ddp", "batch_size": 2}
    env = {CHAOS_ENV: str(chaos.seed)}
    for source in (local_ckpt, zero3_ckpt):
        got = run_ranks(rank_jobs.resume, 2, str(source), on_two, env=env)[0]
        assert got["start"] == SAVE_AT and got["strategy"] == "ddp"
        _close(got["losses"], want, f"{source.parent.name} checkpoint resumed on 2 ranks under ddp")
    # Exported, the zero3 run's slices are one ordinary state dict, equal to the single-process run's.
    import torch

    from luwu_rt.ckpt.export import export_state_dict

    sharded, whole = export_state_dict(zero3_ckpt), export_state_dict(local_ckpt)
    assert sharded.keys() == whole.keys()
    for name, value in whole.items():
        assert sharded[name].shape == value.shape and torch.allclose(sharded[name], value, rtol=1e-4, atol=1e-6), name
    with Engine.load(zero3_ckpt, overrides={"batch_size": 4}) as engine:
        assert engine.strategy.name == "local"
        _close([engine.train_step()["loss"] for _ in range(SAVE_AT, STEPS)], want, "zero3 checkpoint resumed on 1 rank")


def test_hugging_face_gpt2_trains_under_zero3_as_on_one_rank(no_chaos):
    pytest.importorskip("transformers", reason="transformers is not installed (optional dependency)")
    on_device = ON_DEVICE
    want = rank_jobs.train_hf(0, _merge(on_device, {"batch_size": 4}))
    got = run_ranks(rank_jobs.train_hf, 2, _merge(on_device, {"strategy": "zero3"}), env={CHAOS_ENV: ""})
    _close(got[0], want, "Hugging Face GPT-2 under zero3")


def test_gradient_accumulation_equals_local(chaos):
    """Two micro-batches per step: ddp reduces once, on the last one; zero2 and zero3 reduce-scatter each
    micro-batch and add the slices up."""
    accum = _merge(ON_DEVICE, {"grad_accum": 2})
    with chaos.off():
        want = _local(accum, world=2)
    runs = [(s, _merge(accum, {"strategy": s})) for s in ("ddp", "zero2", "zero3")]
    results = run_ranks(rank_jobs.train, 2, runs, env={CHAOS_ENV: str(chaos.seed)})
    for s, _ in runs:
        _close(results[0][s]["losses"], want, f"{s} with 2 micro-batches per step (chaos)")
