"""What each rank process of the gloo tests runs (importable, so ``ranks.run_ranks`` can spawn it)."""

from __future__ import annotations

from typing import Any

STEPS = 10
SAVE_AT = 5


def config(**overrides: Any):
    """gpt-tiny on short sequences: a step takes milliseconds, every unit still streams."""
    from luwu_rt.config import from_mapping, merge
    from luwu_rt.engine import TrainConfig

    base = {"model": "gpt-tiny", "steps": STEPS, "batch_size": 2, "seq_len": 32, "eval_every": 0,
            "keep_graphs": "none", "offload": {"device_mem": "256MiB", "host_mem": "256MiB", "chunk_size": "64KiB"}}
    return from_mapping(TrainConfig, merge(base, overrides))


def train(rank: int, runs: list[tuple[str, dict]], save: dict[str, str] | None = None) -> dict[str, Any]:
    """Each run of ``runs`` (``(key, config overrides)``) for ``STEPS`` steps: its losses, strategy and
    placement; runs named in ``save`` also write a checkpoint at step ``SAVE_AT`` into the directory given."""
    from luwu_rt.engine import Engine

    out = {}
    for key, overrides in runs:
        with Engine(None, config(**overrides)) as engine:
            losses = []
            for _ in range(STEPS):
                losses.append(engine.train_step()["loss"])
                if save and key in save and engine.step == SAVE_AT:
                    engine.save(save[key])
            nvme = engine.store.nvme  # where this rank's NVMe shards are, looked at while they are there
            out[key] = {"losses": losses, "strategy": engine.strategy.name, "placement": engine.placement,
                        "val": engine.evaluate(num_batches=1),
                        "nvme_files": sorted(str(p) for p in nvme.directory.glob("*.bin")) if nvme else []}
    return out


def resume(rank: int, checkpoint: str, overrides: dict) -> dict[str, Any]:
    """Continues the checkpoint to ``STEPS`` steps under ``overrides``; the losses of the steps it ran."""
    from luwu_rt.engine import Engine

    with Engine.load(checkpoint, overrides=overrides) as engine:
        start = engine.step
        losses = [engine.train_step()["loss"] for _ in range(start, STEPS)]
        return {"losses": losses, "strategy": engine.strategy.name, "start": start}


def hf_gpt2(world: int):
    """A two-layer Hugging Face GPT-2 on meta, dropout off (each rank would draw other masks)."""
    import transformers

    from luwu_rt.models.hf import build_hf_chain

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return build_hf_chain(cfg)


def train_hf(rank: int, overrides: dict, steps: int = 5) -> list[float]:
    """Losses of ``steps`` steps of ``hf_gpt2`` under ``overrides``."""
    from luwu_rt.engine import Engine

    with Engine(hf_gpt2(1), config(**overrides)) as engine:
        return [engine.train_step()["loss"] for _ in range(steps)]


def gather_into_one_buffer(rank: int) -> list[float]:
    """``TorchGroup.all_gather`` into consecutive pieces of one buffer (the path that gathers straight into
    it), with every warning an error: torch 2.13 deprecated ``all_gather_into_tensor`` (issue 19 item 10)."""
    import warnings

    import torch
    import torch.distributed as dist

    from luwu_rt.dist.collectives import TorchGroup

    dist.init_process_group("gloo")
    whole = torch.zeros(2 * dist.get_world_size())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TorchGroup(None).all_gather(list(whole.split(2)), torch.full((2,), float(rank + 1))).wait()
    return whole.tolist()


def point_to_point_collectives(rank: int) -> dict[str, bool]:
    """``TorchGroup``'s gloo reduce-scatter and all-gather ([Note: collectives on gloo]) on the world and on a
    subgroup that leaves rank 1 out: every rank checks its result against the collective's definition, bit for
    bit, with two calls of a kind in flight on one group before either is waited for."""
    import torch
    import torch.distributed as dist

    from luwu_rt.dist.collectives import TorchGroup

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    members = [r for r in range(world) if r != 1]
    sub = dist.new_group(members)  # every rank creates it; only its members use it
    checks = {}
    for name, ranks in (("world", list(range(world))), ("subgroup", members)):
        if rank not in ranks:
            continue
        group = TorchGroup(None if name == "world" else sub)
        size, me = len(ranks), ranks.index(rank)

        def full(of: int, call: int) -> torch.Tensor:  # what rank ``of`` (a group rank) reduce-scatters
            g = torch.Generator().manual_seed(1000 * call + of)
            return torch.randn(size * 5, generator=g) * 10 ** torch.randint(-3, 4, (size * 5,), generator=g)

        outs = [torch.empty(5), torch.empty(5)]
        handles = [group.reduce_scatter(outs[c], list(full(me, c).split(5))) for c in range(2)]
        for h in reversed(handles):
            h.wait()
        want = [torch.stack([full(r, c) for r in range(size)]).sum(0).split(5)[me] for c in range(2)]
        checks[f"{name} reduce_scatter"] = all(torch.equal(o, w) for o, w in zip(outs, want))
        wholes = [torch.zeros(3 * size), torch.zeros(3 * size)]
        handles = [group.all_gather(list(wholes[c].split(3)), torch.full((3,), float(10 * c + rank)))
                   for c in range(2)]
        for h in handles:
            h.wait()
        checks[f"{name} all_gather"] = all(
            torch.equal(wholes[c], torch.tensor([float(10 * c + r) for r in ranks]).repeat_interleave(3))
            for c in range(2))
    return checks


def compressed_sim(rank: int, runs: list[tuple[str, str]], steps: int, tmp: str) -> dict:
    """``dist_sim``'s rank (known gradients, exact sums) of each ``(strategy, codec)`` of ``runs``, its collectives
    on real gloo groups: per run, this rank's optimizer state, parameters and residuals after ``steps`` steps
    with 2 micro-batches."""
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from dist_sim import SIZES, build_rank, model_spec, reference
    from luwu_rt.dist import TorchGroup
    from luwu_rt.io import IOEngine
    from luwu_rt.plan import Budgets, Placement, Strategy, plan_step
    from luwu_rt.plan.compression import resolve_compression

    dist.init_process_group("gloo")
    world, model = dist.get_world_size(), model_spec(micro_batches=2)
    out = {}
    with IOEngine(block_bytes=4096, queue_depth=4) as io:
        for name, codec in runs:
            strategy = resolve_compression(model, Strategy(name=name, world_size=world), codec)
            plan = plan_step(model, budgets=Budgets(device_bytes=1 << 20, host_bytes=1 << 20, nvme_bytes=1 << 30),
                             placement=Placement(params="host", optimizer="nvme", grads="host"), strategy=strategy)
            groups = {q: TorchGroup(dist.new_group(list(range(world)))) for q in sorted(plan.comm_groups)}
            history = reference(world=world, micro_batches=2, steps=steps, clip=False, compress=(codec, name))
            r = build_rank(rank, plan, groups, Path(tmp) / f"{name}-{codec}", io)
            for step in range(1, steps + 1):
                r.step, r.params, r.optim.step = step, {u: history[step - 1][u]["master"] for u in range(len(SIZES))}, step
                r.executor.run()
            per = {"master": [], "exp_avg": [], "exp_avg_sq": [], "param": [], "residual": []}
            for u in range(len(SIZES)):
                for state in per:
                    numel = sum(i.numel for s, i in plan.shards.items() if s.unit == u and s.state == state)
                    # numpy: pickled by value (a tensor would be shared through a descriptor of this process)
                    per[state].append(r.store.read_state(u, state, torch.empty(numel)).numpy())
            r.executor.close()
            r.store.close()
            out[(name, codec)] = per
    return out


def converge(rank: int, runs: list[tuple[str, dict]], steps: int, tail: int) -> dict[str, Any]:
    """Each run of ``runs`` (``(key, config overrides)``) for ``steps`` steps: the mean training loss of its last
    ``tail`` steps, its validation loss, its step time and bytes sent per step, and the seconds it took."""
    import time

    from luwu_rt.engine import Engine

    out = {}
    for key, overrides in runs:
        start = time.perf_counter()
        with Engine(None, config(**{"steps": steps, **overrides})) as engine:
            metrics = [engine.train_step() for _ in range(steps)]
            out[key] = {"tail_loss": sum(m["loss"] for m in metrics[-tail:]) / tail, "val": engine.evaluate(),
                        "wire_bytes": metrics[-1]["wire_bytes"], "encode_s": metrics[-1]["encode_s"],
                        "decode_s": metrics[-1]["decode_s"], "seconds": time.perf_counter() - start,
                        "losses": [m["loss"] for m in metrics]}
    return out


def resume_compressed(rank: int, checkpoint: str) -> dict[str, list[float]]:
    """The losses of continuing ``checkpoint`` to ``STEPS`` steps: as loaded (``resumed``), and with every
    residual set to zero after loading (``zeroed``: what a resume that lost them would do)."""
    import torch

    from luwu_rt.engine import Engine

    out = {}
    for key in ("resumed", "zeroed"):
        with Engine.load(checkpoint) as engine:
            if key == "zeroed":
                for u in range(engine.chain.num_units):
                    if engine.strategy.codec(u) != "none":
                        engine.optimizer.keep_initial(u, {"residual": torch.zeros(engine.chain.num_unit_params(u))})
                engine.store.flush()
            out[key] = [engine.train_step()["loss"] for _ in range(engine.step, STEPS)]
    return out
