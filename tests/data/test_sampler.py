import numpy as np
import pytest
import torch

from luwu_rt.data.sampler import BatchSampler


def test_batches_are_shifted_windows_of_the_data() -> None:
    tokens = np.arange(1000, dtype=np.uint16) % 251
    sampler = BatchSampler(tokens, batch_size=3, seq_len=16, seed=0)
    inputs, targets = sampler.batch(5)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (3, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    for row in inputs:
        start = int(row[0])
        assert torch.equal(row, torch.from_numpy((np.arange(start, start + 16) % 251).astype(np.int64)))


def test_batch_depends_only_on_seed_and_step() -> None:
    tokens = np.random.default_rng(0).integers(0, 256, 10_000).astype(np.uint8)
    a = BatchSampler(tokens, batch_size=4, seq_len=8, seed=1)
    b = BatchSampler(tokens, batch_size=4, seq_len=8, seed=1)
    c = BatchSampler(tokens, batch_size=4, seq_len=8, seed=2)
    b.batch(0), b.batch(1)  # drawing other batches first changes nothing (resume needs no sampler state)
    assert torch.equal(a.batch(7)[0], b.batch(7)[0])
    assert not torch.equal(a.batch(7)[0], a.batch(8)[0])
    assert not torch.equal(a.batch(7)[0], c.batch(7)[0])
    it = iter(a)
    assert torch.equal(next(it)[0], a.batch(0)[0]) and torch.equal(next(it)[0], a.batch(1)[0])


def test_every_window_can_be_drawn_including_the_last() -> None:
    tokens = np.arange(10, dtype=np.uint8)
    sampler = BatchSampler(tokens, batch_size=64, seq_len=8, seed=0)
    starts = {int(x) for step in range(4) for x in sampler.batch(step)[0][:, 0]}
    assert starts == {0, 1}  # windows of 9 tokens fit at offsets 0 and 1 only


def test_errors() -> None:
    with pytest.raises(ValueError, match="seq-len"):
        BatchSampler(np.zeros(8, dtype=np.uint8), batch_size=1, seq_len=8, seed=0)
    with pytest.raises(ValueError, match="positive"):
        BatchSampler(np.zeros(8, dtype=np.uint8), batch_size=0, seq_len=4, seed=0)
    with pytest.raises(ValueError, match="1-D"):
        BatchSampler(np.zeros((2, 8), dtype=np.uint8), batch_size=1, seq_len=4, seed=0)
    bad = BatchSampler(np.full(50, 300, dtype=np.uint16), batch_size=1, seq_len=4, seed=0, vocab_size=256)
    with pytest.raises(ValueError, match="token id 300"):
        bad.batch(0)
