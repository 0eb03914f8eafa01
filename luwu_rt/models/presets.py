"""Shapes of the built-in GPT family.

Pure Python (no torch) so that the planner and ``luwu plan`` can size a
175B-parameter model without building it. Shapes follow GPT-3 (Brown et al.,
2020, table 2.1) and OPT (Zhang et al., 2022) for the sizes GPT-3 lacks
(30B, 66B); the two small presets exist for tests and the default job.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPTShape", "PRESETS", "get_preset"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTShape:
    """A decoder-only transformer: embedding, ``num_layers`` blocks, head."""

    name: str
    """Preset name, e.g. ``gpt-125m``."""
    num_layers: int
    """Transformer blocks."""
    d_model: int
    """Hidden width."""
    num_heads: int
    """Attention heads; ``d_model`` must divide evenly."""
    vocab_size: int
    """Token embedding rows (50257 padded to a multiple of 64 for the GPT-3 shapes)."""
    max_seq_len: int
    """Learned position embedding rows."""
    ffn_mult: int = 4
    """MLP hidden width as a multiple of ``d_model``."""
    tie_embeddings: bool = True
    """The head reuses the token embedding matrix (as GPT-2/GPT-3 do)."""
    nominal_params: int = 0
    """The size the preset is named after, for the 2% check; 0 when unnamed."""

    def __post_init__(self) -> None:
        if min(self.num_layers, self.d_model, self.num_heads, self.vocab_size, self.max_seq_len) <= 0:
            raise ValueError(f"preset {self.name}: every dimension must be positive")
        if self.d_model % self.num_heads:
            raise ValueError(f"preset {self.name}: d_model={self.d_model} is not a multiple of "
                             f"num_heads={self.num_heads}")

    # Parameter counts per unit. A block has LayerNorm (2d) + QKV (3d^2 + 3d)
    # + attention projection (d^2 + d) + LayerNorm (2d) + MLP (2 f d^2 + f d + d).
    @property
    def block_params(self) -> int:
        d, f = self.d_model, self.ffn_mult
        return (3 + 1 + 2 * f) * d * d + (2 + 3 + 1 + 2 + f + 1) * d

    @property
    def embedding_params(self) -> int:
        return (self.vocab_size + self.max_seq_len) * self.d_model

    @property
    def head_params(self) -> int:
        """Final LayerNorm, plus the output matrix when it is not tied."""
        untied = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return 2 * self.d_model + untied

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.num_layers * self.block_params + self.head_params


def _gpt3(name: str, num_layers: int, d_model: int, num_heads: int, nominal: int) -> GPTShape:
    return GPTShape(name=name, num_layers=num_layers, d_model=d_model, num_heads=num_heads,
                    vocab_size=50304, max_seq_len=2048, nominal_params=nominal)


PRESETS: dict[str, GPTShape] = {
    p.name: p
    for p in (
        # Byte-level vocabulary: these train on the embedded corpus in seconds.
        GPTShape(name="gpt-tiny", num_layers=4, d_model=128, num_heads=4, vocab_size=256, max_seq_len=256),
        GPTShape(name="gpt-small", num_layers=6, d_model=640, num_heads=10, vocab_size=256, max_seq_len=512),
        _gpt3("gpt-125m", 12, 768, 12, 125_000_000),
        _gpt3("gpt-350m", 24, 1024, 16, 350_000_000),
        _gpt3("gpt-1.3b", 24, 2048, 16, 1_300_000_000),
        _gpt3("gpt-2.7b", 32, 2560, 32, 2_700_000_000),
        _gpt3("gpt-6.7b", 32, 4096, 32, 6_700_000_000),
        _gpt3("gpt-13b", 40, 5120, 40, 13_000_000_000),
        _gpt3("gpt-30b", 48, 7168, 56, 30_000_000_000),
        _gpt3("gpt-66b", 64, 9216, 72, 66_000_000_000),
        _gpt3("gpt-175b", 96, 12288, 96, 175_000_000_000),
    )
}


def get_preset(name: str) -> GPTShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
