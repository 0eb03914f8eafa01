"""Compressed units' residuals in checkpoints ([Note: residuals in checkpoints] in ckpt/save.py): every rank
writes its own, the checkpoint verifies only with all of them, and a run on another number of ranks gets,
per rank, the sum of those it stands for, so the ranks together still owe what the saved ones did."""

from __future__ import annotations

import pytest
import torch

from luwu_rt.ckpt.format import CheckpointReader, CheckpointWriter
from luwu_rt.ckpt.save import (
    rank_tensors,
    read_residual,
    residual_name,
    verify_checkpoint,
)
from luwu_rt.plan.spec import Strategy

NUMELS = (5, 7)


def _checkpoint(tmp_path, *, ranks: int, drop: str | None = None) -> CheckpointReader:
    """Unit 0 compressed by ``ranks`` ranks (residual r = r + 1 everywhere), unit 1 not."""
    writer = CheckpointWriter(tmp_path, step=1)
    for u, n in enumerate(NUMELS):
        for state in ("param", "master", "exp_avg", "exp_avg_sq"):
            writer.add(f"u{u}.{state}", torch.zeros(n))
    for r in range(ranks):
        if residual_name(0, r, ranks) != drop:
            writer.add(residual_name(0, r, ranks), torch.full((NUMELS[0],), float(r + 1)))
    model = {"units": [{"name": f"u{u}", "prefix": f"u{u}", "params": [["w", [n]]]} for u, n in enumerate(NUMELS)]}
    return CheckpointReader(writer.commit({"run_id": "r", "config": {"dtype": "fp32"}, "step": 1, "adam_step": 1,
                                           "model": model, "world_size": ranks, "strategy": "ddp"}))


def test_every_rank_writes_its_own_residual_of_each_compressed_unit() -> None:
    strategy = Strategy(name="zero1", world_size=2, compress=("onebit", "none"))
    for rank in range(2):
        names = [t.name for t in rank_tensors(strategy=strategy, rank=rank, numels=NUMELS, param_dtype=torch.float32)
                 if t.state == "residual"]
        assert names == [residual_name(0, rank, 2)]
    plain = rank_tensors(strategy=Strategy(name="zero1", world_size=2), rank=1, numels=NUMELS,
                         param_dtype=torch.float32)
    assert not any(t.state == "residual" for t in plain)


def test_residuals_verify_and_map_onto_any_number_of_ranks(tmp_path) -> None:
    reader = _checkpoint(tmp_path, ranks=3)
    assert verify_checkpoint(reader, read_data=True) == 2 * 4 + 3
    mine = {(world, rank): read_residual(reader, 0, NUMELS[0], rank=rank, world_size=world)[0].item()
            for world in (1, 2, 3, 4) for rank in range(world)}
    assert mine == {(1, 0): 6.0, (2, 0): 4.0, (2, 1): 2.0, (3, 0): 1.0, (3, 1): 2.0, (3, 2): 3.0,
                    (4, 0): 1.0, (4, 1): 2.0, (4, 2): 3.0, (4, 3): 0.0}
    assert not read_residual(reader, 1, NUMELS[1], rank=0, world_size=2).any()  # saved uncompressed: zeros


def test_a_missing_rank_residual_is_a_corrupt_checkpoint(tmp_path) -> None:
    reader = _checkpoint(tmp_path, ranks=3, drop=residual_name(0, 1, 3))
    with pytest.raises(ValueError, match="residuals of unit 0 are not one per rank"):
        verify_checkpoint(reader, read_data=False)
