"""`luwu plan`: text and JSON output for gpt-tiny and gpt-175b, and the does-not-fit answer."""

import json

import pytest

from luwu_rt.cli.main import main
from luwu_rt.models.presets import get_preset
from luwu_rt.plan import STRATEGIES

FIELDS = {"params", "fits", "peak_bytes", "io_bytes_per_step", "predicted_step_s", "bottleneck"}
GPU_RUN = ("--batch-size", "1", "--seq-len", "0", "--keep-graphs", "none", "--dtype", "bf16", "--chunk-size", "64MiB")
"""A GPU server's question (one full-length bf16 sequence, recomputation, large chunks), asked where the
defaults (luwu train's: a CPU run of gpt-tiny) do not fit the model."""


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["plan", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_gpt_175b_json(capsys):
    code, out = run_json(capsys, *GPU_RUN, "--model", "gpt-175b", "--device-mem", "80GiB", "--host-mem", "512GiB",
                         "--nvme-size", "4TB")
    assert code == 0 and out["fits"] is True
    assert FIELDS <= set(out)
    assert abs(out["params"] / 175e9 - 1) < 0.02
    assert out["peak_bytes"]["device"] <= 80 * 2**30 and out["peak_bytes"]["host"] <= 512 * 2**30
    assert out["placement"]["optimizer"] == "nvme"  # 2 TB of fp32 state cannot live in 512 GiB
    assert out["io_bytes_per_step"]["nvme"]["read"] > 0 and out["io_bytes_per_step"]["nvme"]["write"] > 0
    assert out["predicted_step_s"] > 0 and out["bottleneck"] in ("nvme", "nvme_read", "nvme_write")


def test_gpt_tiny_json_fits_on_device(capsys):
    code, out = run_json(capsys, *GPU_RUN, "--model", "gpt-tiny", "--host-mem", "1GiB")
    assert code == 0 and FIELDS <= set(out)
    assert out["params"] == get_preset("gpt-tiny").num_params
    assert out["placement"] == {"params": "device", "optimizer": "device", "grads": "device"}
    assert out["io_bytes_per_step"]["nvme"] == {"read": 0, "write": 0}


def test_gpt_tiny_text(capsys):
    assert main(["plan", *GPU_RUN, "--model", "gpt-tiny", "--device-mem", "64MiB", "--host-mem", "1GiB",
                 "--offload-optimizer", "host"]) == 0
    out = capsys.readouterr().out
    assert "gpt-tiny" in out and "predicted step time" in out and "bottleneck" in out
    assert "master" in out and "host" in out


def test_does_not_fit_states_the_memory_needed(capsys):
    code, out = run_json(capsys, *GPU_RUN, "--model", "gpt-175b", "--device-mem", "80GiB", "--host-mem", "64GiB")
    assert code == 1 and out["fits"] is False
    assert "needs at least" in out["reason"] and "of host memory or" in out["reason"] and "NVMe" in out["reason"]
    assert out["needs"]["host_bytes"] > 64 * 2**30 and out["needs"]["nvme_bytes"] > 2 * 10**12
    assert main(["plan", *GPU_RUN, "--model", "gpt-175b", "--host-mem", "64GiB"]) == 1
    assert "does not fit: needs at least" in capsys.readouterr().out


def test_nvme_dir_budget_is_its_free_space(capsys, tmp_path):
    code, out = run_json(capsys, *GPU_RUN, "--model", "gpt-tiny", "--nvme-dir", str(tmp_path), "--device-mem", "8MiB",
                         "--host-mem", "8MiB", "--offload-optimizer", "nvme")
    assert code == 0 and out["budgets"]["nvme"] > 0 and out["placement"]["optimizer"] == "nvme"


@pytest.mark.parametrize("argv, message", [
    (["--device-mem", "lots"], "cannot read size"),
    (["--nvme-dir", "/proc/self/status"], "is a file, not a directory"),
    (["--world-size", "2", "--strategy", "local"], "local runs one process"),
])
def test_bad_arguments_are_one_line_errors(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("luwu: error:") and message in err


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "local"])
def test_strategies_plan(capsys, strategy):
    code, out = run_json(capsys, "--model", "gpt-small", "--world-size", "4", "--strategy", strategy,
                         "--device-mem", "4GiB", "--host-mem", "8GiB", "--batch-size", "2", "--seq-len", "256")
    assert code == 0 and out["strategy"] == strategy and out["world_size"] == 4
    assert sum(out["busy_s"].get(q, 0) for q in ("gather", "reduce", "reduce_cross", "push", "pull")) > 0


def test_show_ops_lists_the_plan(capsys):
    assert main(["plan", *GPU_RUN, "--model", "gpt-tiny", "--device-mem", "5MiB", "--host-mem", "16MiB",
                 "--offload-params", "host", "--offload-optimizer", "host", "--show-ops", "5"]) == 0
    out = capsys.readouterr().out
    listing = out[out.index("first 5 ops"):].splitlines()[1:]
    assert len(listing) == 5 and "Load" in listing[0] and "param[0.0]:host@0 -> param[0.0]:device@" in listing[0]


# -- strategies the engine cannot run yet, hsdp's group flag, the optimizer node, predicted op times -----------

@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_plan_plans_is_one_train_runs(capsys, strategy):
    """`luwu train --strategy X` takes every strategy the planner plans (once not local), and plan says so
    (`runnable`, no 'plan only' line), also when the plan does not fit."""
    from luwu_rt.cli.main import parse_args

    world = "1" if strategy == "local" else "2"
    argv = ["--strategy", strategy, "--world-size", world, "--host-mem", "1GiB"]
    code, out = run_json(capsys, *argv)
    assert code == 0 and out["runnable"] is True and out["strategy"] == strategy
    assert main(["plan", *argv]) == 0 and "plan only" not in capsys.readouterr().out
    assert parse_args(["train", "--strategy", strategy]).strategy == strategy
    if strategy in ("zero3", "node"):  # a plan that does not fit still says whether train could run it
        code, out = run_json(capsys, "--model", "gpt-175b", "--strategy", strategy, "--world-size", "8",
                             "--host-mem", "1GiB", *(("--node-host-mem", "1GiB") if strategy == "node" else ()))
        assert code == 1 and out["runnable"] is True


def test_auto_strategy_is_the_default_for_several_ranks_and_picks_what_train_picks(capsys):
    code, out = run_json(capsys, *GPU_RUN, "--model", "gpt-small", "--world-size", "2", "--host-mem", "1GiB")
    assert code == 0 and out["strategy"] in ("ddp", "zero1", "zero2", "zero3") and out["runnable"] is True
    code, named = run_json(capsys, *GPU_RUN, "--model", "gpt-small", "--world-size", "2", "--host-mem", "1GiB",
                           "--strategy", out["strategy"])
    assert named["predicted_step_s"] == out["predicted_step_s"]
    # Under a host budget only sharding fits, auto must find a sharded strategy.
    code, tight = run_json(capsys, *GPU_RUN, "--model", "gpt-small", "--world-size", "2", "--device-mem", "200MiB",
                           "--host-mem", "260MiB")
    assert code == 0 and tight["strategy"] in ("zero1", "zero2", "zero3"), tight.get("reason")


def test_shard_group_size_and_its_alias(capsys):
    base = ("--strategy", "hsdp", "--world-size", "8", "--host-mem", "1GiB",
            "--nvme-size", "64GiB")  # not the disk's free space, which other processes change between the two plans
    outs = [run_json(capsys, *base, flag, "2")[1] for flag in ("--shard-group-size", "--group-size")]
    assert outs[0] == outs[1] and outs[0]["busy_s"].get("reduce_cross", 0) > 0
    default = run_json(capsys, *base)[1]  # min(8, N) = 8: one group, nothing to all-reduce across groups
    assert "reduce_cross" not in default["busy_s"]
    assert main(["plan", "--strategy", "zero3", "--world-size", "8", "--shard-group-size", "2"]) == 2
    assert "--shard-group-size applies to --strategy hsdp only" in capsys.readouterr().err
    assert main(["plan", "--strategy", "hsdp", "--world-size", "8", "--shard-group-size", "3"]) == 2
    assert "must divide world_size=8" in capsys.readouterr().err


NODE_ARGS = ("--strategy", "node", "--world-size", "4", "--host-mem", "1GiB", "--node-host-mem", "1GiB")


def test_node_strategy_plans_the_node_and_feeds_it_into_the_estimate(capsys):
    code, out = run_json(capsys, *NODE_ARGS, "--node-shards", "2")
    assert code == 0 and FIELDS <= set(out)
    node = out["node"]
    assert {"num_shards", "num_workers", "budgets", "placement", "states", "peak_bytes", "io_bytes_per_step", "busy_s",
            "step_s", "num_ops", "serve_order"} <= set(node)
    assert node["num_shards"] == 2 and node["num_workers"] == 4 and node["serve_order"] == [5, 4, 3, 2, 1, 0]
    assert node["placement"] == {"params": "host", "optimizer": "host", "grads": "host"}
    assert {"push", "pull", "optim", "reduce"} <= set(node["busy_s"]) and node["step_s"] > 0
    assert node["peak_bytes"]["host"] <= 2**30 and node["states"]["master"]["tier"] == "host"
    # The worker's prediction includes the node: a slower node optimizer shows in it.
    assert out["predicted_step_s"] >= max(node["busy_s"].values())
    assert main(["plan", *NODE_ARGS]) == 0
    text = capsys.readouterr().out
    assert "optimizer node: 1 process serving 4 workers" in text
    assert "units received, updated and served in the order workers push them: unit 5 first, unit 0 last" in text


def test_node_state_goes_to_nvme_when_node_memory_is_short(capsys):
    code, out = run_json(capsys, *GPU_RUN, *NODE_ARGS[:-1], "4MiB", "--node-nvme-size", "1GiB")
    assert code == 0 and out["node"]["placement"]["optimizer"] == "nvme"
    assert out["node"]["io_bytes_per_step"]["nvme"]["read"] > 0
    code, out = run_json(capsys, *GPU_RUN, *NODE_ARGS[:-1], "4MiB")
    assert code == 1 and out["fits"] is False
    assert "optimizer node does not fit" in out["reason"] and "--node-nvme-size" in out["reason"]
    assert out["needs"]["node_host_bytes"] > 4 * 2**20


def test_node_flags_need_the_node_strategy(capsys):
    assert main(["plan", "--strategy", "zero3", "--world-size", "2", "--node-shards", "2"]) == 2
    assert "--node-shards applies to --strategy node only" in capsys.readouterr().err


def _listing(out: str) -> list[list[str]]:
    head = next(i for i, line in enumerate(out.splitlines()) if "(slot = byte offset" in line)
    return [line.split() for line in out.splitlines()[head + 1:] if line.strip()]


def test_show_ops_shows_gathers_prefetched_during_backward(capsys):
    """The issue's check: `luwu plan --strategy zero3 --world-size 8 --show-ops 40` shows an all-gather for
    B(k-1) that starts before B(k) ends."""
    assert main(["plan", "--strategy", "zero3", "--world-size", "8", "--show-ops", "40"]) == 0
    out = capsys.readouterr().out
    assert "first 40 ops" in out and "µs from the step's start" in out
    rows = _listing(out)
    assert len(rows) == 40
    backward_end, prefetched = None, []
    for index, start, end, kind, queue, *rest in rows:
        if kind == "Compute" and rest[0].startswith("B"):
            backward_end = (rest[0], float(end))
        if kind == "Gather" and backward_end is not None and float(start) < backward_end[1]:
            prefetched.append((index, rest, backward_end[0]))
            assert queue == "gather" and "prefetch: starts before" in " ".join(rest)
    assert prefetched, out
    index, rest, during = prefetched[0]
    assert int(rest[rest.index("unit") + 1]) == int(during[1:]) - 1  # B(k-1)'s parameters, gathered during B(k)


def test_show_ops_can_start_at_the_backward(capsys):
    assert main(["plan", *GPU_RUN, "--device-mem", "16GiB", "--host-mem", "all", "--model", "gpt-small", "--strategy",
                 "zero3", "--world-size", "8", "--show-ops", "12",
                 "--ops-from", "backward"]) == 0
    out = capsys.readouterr().out
    rows = _listing(out)
    assert len(rows) == 12 and "from op" in out
    kinds = [(r[3], r[5] if r[3] == "Compute" else "") for r in rows]
    assert ("Compute", "B13") in kinds or any(k == "Gather" for k, _ in kinds)
    assert not any(name.startswith("F") for _, name in kinds)
    assert main(["plan", *GPU_RUN, "--show-ops", "5", "--ops-from", "soon"]) == 2
    assert "give an op index or 'backward'" in capsys.readouterr().err


def test_show_ops_times_include_the_node(capsys):
    assert main(["plan", *NODE_ARGS, "--show-ops", "400"]) == 0
    rows = _listing(capsys.readouterr().out)
    pulls = [r for r in rows if r[3] == "Wait" and r[4] == "pull"]
    assert pulls and all(float(r[2]) >= float(r[1]) for r in rows)


# -- kept graphs chosen by the budget ([Note: kept graphs chosen by the budget] in engine/kept.py) -------------

GPT_175B_40GIB = ("--model", "gpt-175b", "--device-mem", "40GiB", "--host-mem", "256GiB", "--nvme-size", "4TiB")


def test_gpt_175b_plans_with_recomputation_where_keeping_every_graph_does_not_fit(capsys):
    """The run of issue 21: 40 GiB hold no more than one block's graph beside the plan, so auto keeps that
    many and recomputes the rest (it was refused for 812 GiB of activations); all is refused as asked."""
    code, out = run_json(capsys, *GPT_175B_40GIB)
    assert code == 0 and out["fits"], out.get("reason")
    assert out["kept_graphs"] == {"count": 1, "of": 97, "request": "auto"}
    assert out["peak_bytes"]["device"] <= 40 * 2**30 and out["activation_bytes"] < 40 * 2**30
    code, every = run_json(capsys, *GPT_175B_40GIB, "--keep-graphs", "all")
    assert code == 1 and every["kept_graphs"] == {"count": 97, "of": 97, "request": "all"}
    assert every["activation_bytes"] > 700 * 2**30 and "device memory" in every["reason"]


def test_kept_graphs_are_the_same_with_a_gpu_and_without(capsys, monkeypatch):
    """The device is the GPU or the CPU arena, its budget --device-mem either way: the same budgets keep the
    same graphs (auto meant all on the CPU and none on a GPU)."""
    import torch

    argv = ("--model", "gpt-tiny", "--batch-size", "2", "--seq-len", "16", "--device-mem", "5MiB",
            "--host-mem", "64MiB", "--offload-params", "host", "--offload-optimizer", "host", "--offload-grads",
            "host", "--nvme-size", "0", "--profile", "builtin")
    outs = {}
    for gpu in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        code, outs[gpu] = run_json(capsys, *argv)
        assert code == 0, outs[gpu].get("reason")
    assert outs[False] == outs[True]
    assert 0 < outs[True]["kept_graphs"]["count"] < outs[True]["kept_graphs"]["of"]


def test_the_demo_keeps_every_graph_and_the_text_says_how_many(capsys):
    code, out = run_json(capsys)
    assert code == 0 and out["kept_graphs"] == {"count": 5, "of": 5, "request": "auto"}
    assert main(["plan", "--keep-graphs", "2"]) == 0
    text = capsys.readouterr().out
    assert "kept graphs: 2 of 5 units keep their forward graph until backward; the others recompute" in text
    assert main(["plan"]) == 0
    assert "kept graphs: 5 of 5 units keep their forward graph until backward (--keep-graphs auto: the most " \
           "that fit the device budget)" in capsys.readouterr().out


def test_the_plan_says_why_updates_wait_for_the_norm(capsys, tmp_path):
    """With exact clipping the updates speculate on a double-buffered optimizer state where its second half fits
    on NVMe; where they wait for the norm instead, the answer says why: the state in memory, or no room for the
    second half (the NVMe it needs named beside the budget)."""
    base = ("--model", "gpt-tiny", "--grad-clip", "1.0", "--host-mem", "64MiB", "--nvme-dir", str(tmp_path))
    code, out = run_json(capsys, *base, "--offload-optimizer", "nvme", "--nvme-size", "64MiB")
    assert code == 0 and out["updates"].startswith("speculative") and "updates_wait_because" not in out
    code, out = run_json(capsys, *base, "--offload-optimizer", "nvme", "--nvme-size", "16MiB")
    assert code == 0 and out["updates"].startswith("after the step's gradient norm")
    assert out["updates_wait_because"].startswith("the second half of the optimizer state does not fit")
    assert "MiB of NVMe, the budget is 16 MiB" in out["updates_wait_because"]
    code, out = run_json(capsys, *base, "--offload-optimizer", "host")
    assert code == 0 and "optimizer state is in host memory" in out["updates_wait_because"]
    assert main(["plan", *base, "--offload-optimizer", "host"]) == 0
    assert "updates: after the step's gradient norm (exact clipping or fp16): the optimizer state is in host" \
        in capsys.readouterr().out
    code, out = run_json(capsys, *base[:2], "--grad-clip", "0", *base[4:], "--offload-optimizer", "host")
    assert code == 0 and out["updates"] == "as gradients are final" and "updates_wait_because" not in out
