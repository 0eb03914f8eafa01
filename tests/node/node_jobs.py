"""What each worker process of the node tests runs (importable, so ``ranks.run_ranks`` can spawn it)."""

from __future__ import annotations

import os
from typing import Any

STEPS = 10


def config(**overrides: Any):
    """gpt-tiny on short sequences, as the gloo tests run it (tests/dist/rank_jobs.py)."""
    from rank_jobs import config as base

    return base(**{"steps": STEPS, **overrides})


def train(rank: int, runs: list[tuple[str, dict, str]]) -> dict[str, list[float]]:
    """Each run ``(key, overrides, chaos seed or "")`` for ``STEPS`` steps, one after another: its losses."""
    from luwu_rt.engine import Engine
    from luwu_rt.exec.chaos import CHAOS_ENV

    out = {}
    for key, overrides, chaos in runs:
        os.environ[CHAOS_ENV] = chaos  # read when the engine's executors are made
        with Engine(None, config(**overrides)) as engine:
            assert engine.strategy.name == "node"
            out[key] = [engine.train_step()["loss"] for _ in range(STEPS)]
    return out


def train_metrics(rank: int, runs: list[tuple[str, dict, str]], given: tuple[str, ...] = (),
                  steps: int = STEPS) -> dict[str, dict[str, Any]]:
    """Each run ``(key, overrides, chaos seed or "")`` for ``steps`` steps: its losses, grad norms and the
    steps the worker replayed after its node restarted. Runs named in ``given`` pass ``train_step`` the
    batches the engine would draw (a node restart must replay them from what it kept)."""
    from luwu_rt.engine import Engine
    from luwu_rt.exec.chaos import CHAOS_ENV

    out = {}
    for key, overrides, chaos in runs:
        os.environ[CHAOS_ENV] = chaos  # read when the engine's executors are made
        with Engine(None, config(**{"steps": steps, **overrides})) as engine:
            if key in given:
                metrics = [engine.train_step(engine._my_rows(engine.sampler().batch(engine.step)))
                           for _ in range(steps)]
            else:
                metrics = [engine.train_step() for _ in range(steps)]
            out[key] = {"loss": [m["loss"] for m in metrics], "grad_norm": [m["grad_norm"] for m in metrics],
                        "replayed": engine.optimizer.replayed, "rejoins": engine.optimizer.rejoins}
    return out


def save_then_resume(rank: int, first: str, second: str, directory: str) -> dict[str, Any]:
    """Trains ``STEPS`` steps against the node at ``first``, checkpointing at step ``SAVE_AT``; then resumes
    that checkpoint against the (fresh) node at ``second`` to ``STEPS``: both runs' losses."""
    from rank_jobs import SAVE_AT

    from luwu_rt.engine import Engine
    from luwu_rt.exec.chaos import CHAOS_ENV

    os.environ[CHAOS_ENV] = ""
    with Engine(None, config(strategy="node", node=first)) as engine:
        losses = []
        for _ in range(STEPS):
            losses.append(engine.train_step()["loss"])
            if engine.step == SAVE_AT:
                path = engine.save(directory)
        last = engine.save(directory)  # after the node's last step too
    with Engine.load(path, overrides={"strategy": "node", "node": second}) as engine:
        resumed = [engine.train_step()["loss"] for _ in range(engine.step, STEPS)]
    return {"losses": losses, "resumed": resumed, "path": str(path), "last": str(last)}


def train_any(rank: int, runs: list[tuple[str, dict, str]], steps: int) -> dict[str, dict[str, Any]]:
    """Each run ``(key, overrides, chaos seed or "")`` for ``steps`` steps, under whatever strategy it names:
    its losses, grad norms and the bytes a worker sends per step (the JSON log's ``wire_bytes``)."""
    from luwu_rt.engine import Engine
    from luwu_rt.exec.chaos import CHAOS_ENV

    out = {}
    for key, overrides, chaos in runs:
        os.environ[CHAOS_ENV] = chaos  # read when the engine's executors are made
        with Engine(None, config(**overrides)) as engine:
            metrics = [engine.train_step() for _ in range(steps)]
            out[key] = {"loss": [m["loss"] for m in metrics], "grad_norm": [m["grad_norm"] for m in metrics],
                        "wire_bytes": metrics[-1]["wire_bytes"], "encode_s": sum(m["encode_s"] for m in metrics),
                        "push_bytes": sum(op.comm_bytes for op in engine.plan.ops if op.kind == "Push")}
    return out


def _final_states(engine) -> dict[str, Any]:
    """After the run's last step: every unit's master weights and moments (from the node), and this worker's
    residuals (its store), each state's units joined as one numpy array (pickled by value)."""
    import torch

    out = {}
    for state in ("master", "exp_avg", "exp_avg_sq", "residual"):
        parts = [engine.optimizer.read_state(u, state, torch.empty(engine.chain.num_unit_params(u)))
                 for u in range(engine.chain.num_units) if state != "residual" or engine.strategy.codec(u) != "none"]
        out[state] = torch.cat(parts).numpy() if parts else None
    return out



def compressed_resume(rank: int, runs: list[tuple[str, list[str], str, str]], steps: int,
                      save_at: int) -> dict[str, dict[str, Any]]:
    """Per run ``(codec, [first, second] node addresses, checkpoint directory, chaos seed or "")``: strategy
    node with ``codec`` for ``steps`` steps against the node at ``first``, checkpointing after ``save_at``
    (``path``), its losses and final states (``_final_states``) as ``full``; then that checkpoint resumed to
    ``steps`` against the fresh node at ``second``, this process drawing the chaos seed: the same as ``resumed``."""
    from luwu_rt.engine import Engine
    from luwu_rt.exec.chaos import CHAOS_ENV

    out: dict[str, dict[str, Any]] = {}
    for codec, (first, second), directory, chaos in runs:
        got = out[codec] = {}
        os.environ[CHAOS_ENV] = ""
        with Engine(None, config(strategy="node", node=first, compress=codec, steps=steps)) as engine:
            losses = []
            for _ in range(steps):
                losses.append(engine.train_step()["loss"])
                if engine.step == save_at:
                    got["path"] = str(engine.save(directory))
            got["full"] = {"loss": losses, **_final_states(engine)}
        os.environ[CHAOS_ENV] = chaos  # read when the engine's executors are made
        with Engine.load(got["path"], overrides={"strategy": "node", "node": second}) as engine:
            assert engine.step == save_at
            got["resumed"] = {"loss": [engine.train_step()["loss"] for _ in range(save_at, steps)],
                              **_final_states(engine)}
    return out
