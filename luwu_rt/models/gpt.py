"""The built-in GPT family as a chain of units.

Decoder-only, pre-LayerNorm, GELU MLP, causal attention through
``scaled_dot_product_attention``, learned positions (GPT-2/GPT-3). Unit 0 is
the embedding (``wte``, ``wpe``), units ``1..L`` are the blocks, unit ``L+1``
is the head (final LayerNorm, then logits with unit 0's ``wte`` when the
embeddings are tied, as ``GPTShape.num_params`` counts them).

Initialisation follows GPT-2: N(0, 0.02) for weights and embeddings, zero
biases, unit LayerNorms, and the two residual projections of each block scaled
by ``1/sqrt(2L)`` so the residual stream's variance does not grow with depth.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from luwu_rt.models.presets import GPTShape, get_preset
from luwu_rt.models.units import UnitChain, lm_loss
from luwu_rt.plan.gpt import gpt_units

__all__ = ["GPT", "GPTBlock", "GPTChain", "GPTEmbedding", "GPTHead", "build_gpt"]

_INIT_STD = 0.02


class GPTEmbedding(nn.Module):
    """Unit 0: token ids ``(B, T)`` to hidden states ``(B, T, d)``."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.max_seq_len = shape.max_seq_len
        self.wte = nn.Embedding(shape.vocab_size, shape.d_model)
        self.wpe = nn.Embedding(shape.max_seq_len, shape.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq_len = idx.shape[-1]
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds the model's max_seq_len={self.max_seq_len}; "
                             "use a shorter --seq-len")
        positions = torch.arange(seq_len, device=idx.device)
        return self.wte(idx) + self.wpe(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.num_heads = shape.num_heads
        self.qkv = nn.Linear(shape.d_model, 3 * shape.d_model)
        self.proj = nn.Linear(shape.d_model, shape.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, width = x.shape
        qkv = self.qkv(x).view(batch, seq_len, 3, self.num_heads, width // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq_len, width))


class MLP(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.fc = nn.Linear(shape.d_model, shape.ffn_mult * shape.d_model)
        self.proj = nn.Linear(shape.ffn_mult * shape.d_model, shape.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class GPTBlock(nn.Module):
    """Units ``1..L``: pre-LN attention and MLP, each on the residual stream."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(shape.d_model)
        self.attn = CausalSelfAttention(shape)
        self.ln_2 = nn.LayerNorm(shape.d_model)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTHead(nn.Module):
    """Unit ``L+1``: final LayerNorm and logits.

    With tied embeddings the output matrix is unit 0's ``wte``, passed in by
    the chain rather than held here, so that it is stored and updated once.
    """

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(shape.d_model)
        self.lm_head = None if shape.tie_embeddings else nn.Linear(shape.d_model, shape.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, wte: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.lm_head.weight if self.lm_head is not None else wte
        assert weight is not None, "a tied head needs the embedding matrix"
        return F.linear(self.ln_f(x), weight)


class GPT(nn.Module):
    """The whole model as an ordinary module (for a plain PyTorch training loop)."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed = GPTEmbedding(shape)
        self.blocks = nn.ModuleList(GPTBlock(shape) for _ in range(shape.num_layers))
        self.head = GPTHead(shape)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x, self.embed.wte.weight)
        return logits if targets is None else lm_loss(logits, targets)


class GPTChain(UnitChain):
    """A ``GPT`` seen as ``L + 2`` units; ``model`` is the same modules as one ``nn.Module``."""

    def __init__(self, model: GPT) -> None:
        shape = model.shape
        units = [model.embed, *model.blocks, model.head]
        names = ["embed", *(f"block{i}" for i in range(shape.num_layers)), "head"]
        reads = {len(units) - 1: (0,)} if shape.tie_embeddings else {}
        super().__init__(units, init_fn=_gpt_init_fn(shape.num_layers), reads=reads, names=names)
        self.model = model
        self.shape = shape

    def run(self, index: int, x: torch.Tensor, ctx: object) -> torch.Tensor:
        if index == self.num_units - 1:
            return self.model.head(x, self.model.embed.wte.weight)
        return self.units[index](x)

    def flops_per_token(self, index: int, *, seq_len: int) -> int:
        """The preset's closed formula (plan/gpt.py), so that the engine plans a built-in GPT with the FLOPs
        its preset is planned with: the generic count would take the head's read of unit 0 as the position
        table too, which the head never multiplies by."""
        return gpt_units(self.shape, seq_len=seq_len)[index].flops_per_token


def _gpt_init_fn(num_layers: int):
    residual_std = _INIT_STD / math.sqrt(2 * num_layers)

    def init(module: nn.Module) -> None:
        # nn.Module.apply visits children before parents, so the residual
        # projections' scaled init (at the parent) overrides the Linear default.
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, (CausalSelfAttention, MLP)):
            nn.init.normal_(module.proj.weight, mean=0.0, std=residual_std)

    return init


def build_gpt(shape: GPTShape | str, *, device: torch.device | str = "meta", seed: int = 0) -> GPTChain:
    """A GPT chain built on ``meta``; with another ``device`` every unit is materialised from ``seed``.

    Materialising on a real device allocates the whole model: use it for models
    that fit (tests, the plain-loop reference). The engine keeps the default and
    materialises one unit at a time.
    """
    if isinstance(shape, str):
        shape = get_preset(shape)
    with torch.device("meta"):
        chain = GPTChain(GPT(shape))
    if torch.device(device).type != "meta":
        for index in range(chain.num_units):
            chain.materialize(index, seed=seed, device=device)
    return chain
