"""The analytic workload of a built-in GPT: units, FLOPs and activation bytes.

The planner itself knows nothing about transformers: it plans a chain of
``UnitSpec``s. This module turns a ``GPTShape`` (``luwu_rt.models.presets``)
into that chain from closed formulas, so that a 175B model can be planned
without building it. FLOPs follow Kaplan et al. (2020) ([Note: FLOPs of a
unit] in spec.py): 2 per parameter per token plus 2 x seq_len x d_model per
block for attention; the embedding is a lookup, the tied head multiplies by
the embedding matrix.
Activations follow Korthikanti et al. (2022): each unit's saved input, one
block's recompute workspace and the logits.
"""

from __future__ import annotations

from typing import Any

from .spec import ModelSpec, UnitSpec, forward_flops_per_token

__all__ = ["gpt_units", "gpt_activation_bytes", "gpt_model_spec"]


def gpt_units(shape: Any, *, seq_len: int) -> tuple[UnitSpec, ...]:
    """Embedding, blocks and head of ``shape``. A tied head reads the embedding's parameters, so
    the embedding unit is accessed at F0, F_head, B_head and B0."""
    d = shape.d_model
    tied_matrix = shape.vocab_size * d if shape.tie_embeddings else 0  # the head multiplies by wte, read from unit 0
    block_flops = forward_flops_per_token(matmul_params=shape.block_params, seq_len=seq_len, attention_width=d)
    units = [UnitSpec(name="embedding", num_params=shape.embedding_params,
                      flops_per_token=forward_flops_per_token(matmul_params=0))]
    units += [UnitSpec(name=f"block{i}", num_params=shape.block_params, flops_per_token=block_flops)
              for i in range(shape.num_layers)]
    units.append(UnitSpec(name="head", num_params=shape.head_params, reads=(0,) if shape.tie_embeddings else (),
                          flops_per_token=forward_flops_per_token(matmul_params=shape.head_params + tied_matrix)))
    return tuple(units)


def gpt_activation_bytes(shape: Any, *, batch_size: int, seq_len: int, elem_bytes: int = 2) -> int:
    """Device bytes of one micro-batch's activations with unit-boundary recomputation: every unit's
    saved input, one block's recompute workspace (Korthikanti's 34sbh + 5as^2b, scaled from 2-byte
    to ``elem_bytes`` elements) and the fp32 logits with their gradient."""
    d, tokens = shape.d_model, batch_size * seq_len
    num_units = shape.num_layers + 2
    saved_inputs = num_units * tokens * d * elem_bytes
    block_workspace = tokens * d * (34 + 5 * shape.num_heads * seq_len // d) * elem_bytes // 2
    logits = 2 * tokens * shape.vocab_size * 4
    return saved_inputs + block_workspace + logits


def gpt_model_spec(shape: Any, *, batch_size: int = 1, seq_len: int = 0, num_micro_batches: int = 1,
                   chunk_bytes: int = 64 * 2**20, max_shards_per_state: int = 4) -> ModelSpec:
    """The ``ModelSpec`` of a built-in GPT trained in bf16 with ``batch_size`` sequences of ``seq_len``
    tokens per micro-batch (0: the preset's maximum) and ``num_micro_batches`` micro-batches per step."""
    seq_len = seq_len or shape.max_seq_len
    if batch_size <= 0 or not 0 < seq_len <= shape.max_seq_len:
        raise ValueError(f"batch_size={batch_size} must be positive and seq_len={seq_len} in 1..{shape.max_seq_len}")
    tokens = batch_size * seq_len
    return ModelSpec(units=gpt_units(shape, seq_len=seq_len), tokens_per_step=tokens * num_micro_batches,
                     num_micro_batches=num_micro_batches, chunk_bytes=chunk_bytes,
                     max_shards_per_state=max_shards_per_state,
                     activation_bytes=gpt_activation_bytes(shape, batch_size=batch_size, seq_len=seq_len))
