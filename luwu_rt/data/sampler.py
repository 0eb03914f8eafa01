"""Seeded random batches of (inputs, targets) windows from a token array.

Batch ``k`` depends only on ``(seed, k)``: a resumed run draws exactly the
batches the uninterrupted run would have drawn, with no sampler state to
checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["BatchSampler"]


class BatchSampler:
    """Windows of ``seq_len + 1`` tokens at uniformly random offsets; targets are inputs shifted by one."""

    def __init__(self, tokens: np.ndarray, *, batch_size: int, seq_len: int, seed: int,
                 vocab_size: int | None = None) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        if batch_size <= 0 or seq_len <= 0:
            raise ValueError(f"batch size and sequence length must be positive, got {batch_size} and {seq_len}")
        if len(tokens) < seq_len + 1:
            raise ValueError(f"only {len(tokens)} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}; "
                             "use a shorter --seq-len or more data")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.vocab_size = vocab_size

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, int64 tensors of shape ``(batch_size, seq_len)``."""
        if step < 0:
            raise ValueError(f"step must be non-negative, not {step}")
        rng = np.random.default_rng([self.seed, step])
        offsets = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        windows = np.stack([np.asarray(self.tokens[o:o + self.seq_len + 1], dtype=np.int64) for o in offsets])
        if self.vocab_size is not None:
            top = int(windows.max())
            if top >= self.vocab_size:
                raise ValueError(f"token id {top} in the data is outside the model's vocabulary of "
                                 f"{self.vocab_size}; the data was tokenised for another model or read with the "
                                 "wrong --data-dtype")
        tensor = torch.from_numpy(windows)
        return tensor[:, :-1], tensor[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = 0
        while True:
            yield self.batch(step)
            step += 1
