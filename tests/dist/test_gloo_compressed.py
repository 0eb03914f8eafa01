"""Compressed ddp and zero2 in real processes (gloo on loopback, chaos mode on): ``dist_sim``'s ranks, whose
gradients are known, each run by its own process over real process groups, bit for bit the single process
that sends the same gradients through the same codec with error feedback (``dist_sim.reference``): the
optimizer state, the parameters and every rank's residual, after 3 steps of 2 micro-batches."""

from __future__ import annotations

import torch

from dist_sim import SIZES, reference
from ranks import run_ranks
import rank_jobs

from luwu_rt.exec.chaos import CHAOS_ENV

RUNS = [("ddp", "onebit"), ("zero1", "topk:0.01"), ("zero2", "onebit")]
STEPS = 3


def test_compressed_strategies_over_gloo_equal_the_single_process_codec(tmp_path):
    results = run_ranks(rank_jobs.compressed_sim, 2, RUNS, STEPS, str(tmp_path), env={CHAOS_ENV: "5"})
    for name, codec in RUNS:
        expect = reference(world=2, micro_batches=2, steps=STEPS, clip=False, compress=(codec, name))[-1]
        for u in range(len(SIZES)):
            for state in ("master", "exp_avg", "exp_avg_sq", "param"):
                parts = [torch.from_numpy(results[r][(name, codec)][state][u]) for r in range(2)]
                got = parts[0] if name == "ddp" or state == "param" else torch.cat(parts)[: SIZES[u]]
                want = expect[u]["master" if state == "param" else state]
                assert torch.equal(got, want), (name, codec, u, state)
            for r in range(2):
                got = torch.from_numpy(results[r][(name, codec)]["residual"][u])
                assert torch.equal(got, expect[u][f"residual{r}"]), (name, codec, u, r)
