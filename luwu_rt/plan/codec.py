"""Gradient codecs as the planner sees them: names, payload sizes and what encoding and decoding cost.

The codecs themselves (kernels, error feedback) are ``luwu_rt.compress``; this module holds what a plan
must know about them and nothing else, so that the planner stays pure: how many bytes one chunk's
payload takes, which collective carries it under each strategy, and how long its encode and decode take
under a ``HardwareProfile``.

[Note: codecs on the wire]
A codec works on chunks of C gradient elements - a storage chunk of the fp32 gradient (``chunk_numel``),
except onebit, whose chunks are blocks of ``ONEBIT_BLOCK`` = 128 elements (one scale per 16k-element
storage chunk mixes parameters of unlike scale, and trained gpt-tiny 27% worse in 300 steps than one per
128, which ended within 4% of uncompressed) - and turns each chunk of n <= C elements into a payload of
fixed size p(n), a multiple of 4 bytes:

  codec           payload p(n) of one chunk                  what it keeps
  bf16, fp16      2n (rounded up to 4)                       every element, rounded to nearest even
  onebit          4 + 4 ceil(n / 32)                         one sign bit per element, one fp32 scale
                                                             (the mean |x| of the chunk)
  topk:R          8k, k = min(n, max(1, ceil(R n)))          the k largest |x| (ties: lowest index first),
                                                             as int32 index + fp32 value
  powersgd:Q      4 q (rows + cols), cols = ceil(sqrt n),    the chunk as a rows x cols matrix M, projected
                  rows = ceil(n / cols), q = min(Q, rows,    on q orthonormal columns P of M Q0 (Q0 random,
                  cols)                                      seeded by the chunk's bits): payload P and M^T P

A piece of m elements takes P(m) = floor(m / C) p(C) + p(m mod C) bytes (p(0) = 0), and a shorter piece's
payload is a prefix of a longer one's layout: every chunk but the last sits at the same offset.

Every rank encodes x = g + e (its gradient plus its residual), sends the payload and keeps
e = x - decode(payload) for the next step (error feedback). The payloads are not additive - sign bits,
index sets, each rank's own factors - so no collective can sum them in flight; every rank decodes the
payloads it receives and sums them in fp32, in rank order: the same bits on every rank and in a single
process that applies the codec to the same gradients. Per unit of N elements on W ranks, S = ceil(N / W):

  ddp            all-gather of one payload per rank: every rank decodes all W and sums them.
                 Sent per rank (W - 1) P(N); uncompressed all-reduce 2 (W - 1) / W x 4N.
  zero1, zero2   a reduce-scatter of payloads: every rank encodes its gradient as W pieces of S elements
                 and sends piece s to rank s (an all-to-all), which decodes the W pieces of its slice and
                 sums them. Sent per rank (W - 1) P(S); uncompressed reduce-scatter (W - 1) x 4S.
                 zero2 does it per micro-batch, as its uncompressed reduce-scatter.

So onebit sends 1/25.6 of the fp32 bytes at any W under zero1/zero2 and at W = 2 under ddp; ddp's
all-gather grows with W: its bytes over the all-reduce's are W / 51.2 for onebit and W / 4 for a cast
(break-even at W = 51 and W = 4; summing casts in flight as torch's bf16 hook does would halve the
bytes at any W but rounds every partial sum, an error no residual feeds back). A ddp reduce-scatter of
payloads followed by an all-gather of the re-encoded sums would move 2 (W - 1) / W P(N) at the price of a
second residual per slice; it is not built. The cost model prices each choice by this table
(``plan/compression.py``), so ``--compress auto`` compresses only where it pays.

[Note: compressed pushes]
Under strategy ``node`` a compressed unit's gradient is encoded on the worker as one piece per node shard
(piece j the slice that shard j keeps, S = ceil(N / k) elements, [Note: node shards] in node/shards.py),
with the worker's residual as error feedback, and the worker pushes piece j's payload P(n_j) to shard j.
The node decodes every worker's payload and sums the values in fp32 in rank order (``Pushes.take`` in
node/runner.py), as a ddp rank sums its all-gathered payloads: with one node shard the summed gradient is
ddp's bit for bit. With k shards it is not: a blocked codec (onebit, topk) cuts its blocks from each piece's
start, ddp's from the unit's; k workers on k shards are zero1 on k ranks instead, whose rank s encodes and
sums the same pieces (and whose sharded norm the shards' equals). Sent per worker per step sum_j P(n_j)
instead of 4N. Only the elementwise codecs
(``NODE_CODECS``); ``--compress auto`` is not offered for node (the cost model prices collectives, not
pushes). The run's codec is part of the HELLO manifest ([Note: the manifest] in node/manifest.py), so a
node refuses a worker whose codec is another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AUTO_CODECS",
    "CODEC_FAMILIES",
    "COMPRESSING_STRATEGIES",
    "NODE_CODECS",
    "ONEBIT_BLOCK",
    "CodecSpec",
    "codec_seconds",
    "parse_codec",
    "parse_request",
    "scheme",
]

CODEC_FAMILIES = ("none", "bf16", "fp16", "onebit", "topk", "powersgd")
"""Codec names without their parameter (``topk:RATIO``, ``powersgd:RANK`` take one)."""
COMPRESSING_STRATEGIES = ("ddp", "zero1", "zero2")
"""Strategies whose gradient synchronisation may be compressed ([Note: codecs on the wire])."""
NODE_CODECS = ("bf16", "fp16", "onebit", "topk")
"""Codec families a ``node`` worker's pushes may use ([Note: compressed pushes]): elementwise on each node
shard's slice, decoded by the node. powersgd is not among them: its factors are a per-matrix projection
that the node would have to run across rounds, which it does not."""
AUTO_CODECS = ("bf16", "onebit")
"""The codecs ``--compress auto`` chooses among per unit (besides none); ``auto:C1,C2`` names others."""
_RATE_KEY = {"bf16": "cast", "fp16": "cast", "onebit": "onebit", "topk": "topk", "powersgd": "powersgd"}
"""Codec family -> the prefix of its ``HardwareProfile`` rate keys (``<prefix>_encode_gbps``, ``..._decode_gbps``)."""
_FLAG = "--compress"
ONEBIT_BLOCK = 128
"""Elements per onebit scale ([Note: codecs on the wire]): 4 + 16 bytes per 128 fp32 elements, 25.6x fewer."""


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """One codec with its parameter: ``family`` (``CODEC_FAMILIES``), ``ratio`` (topk) or ``rank`` (powersgd)."""

    family: str
    ratio: float = 0.0
    rank: int = 0

    @property
    def name(self) -> str:
        """As ``--compress`` spells it: ``onebit``, ``topk:0.01``, ``powersgd:4``."""
        if self.family == "topk":
            return f"topk:{self.ratio:g}"
        return f"powersgd:{self.rank}" if self.family == "powersgd" else self.family

    def topk_count(self, n: int) -> int:
        """Values topk keeps of a chunk of ``n`` elements."""
        return min(n, max(1, math.ceil(self.ratio * n - 1e-9))) if n else 0

    def matrix(self, n: int) -> tuple[int, int, int]:
        """powersgd: ``(rows, cols, q)`` of a chunk of ``n`` elements seen as a matrix, and the rank kept."""
        cols = math.isqrt(n - 1) + 1 if n else 0
        rows = -(-n // cols) if n else 0
        return rows, cols, min(self.rank, rows, cols)

    def codec_chunk(self, chunk_numel: int) -> int:
        """Elements per codec chunk when the gradient's storage chunk holds ``chunk_numel``."""
        return min(chunk_numel, ONEBIT_BLOCK) if self.family == "onebit" else chunk_numel

    def chunk_bytes(self, n: int) -> int:
        """Payload bytes of one chunk of ``n`` elements ([Note: codecs on the wire])."""
        if n <= 0:
            return 0
        if self.family in ("bf16", "fp16"):
            return 4 * -(-n // 2)
        if self.family == "onebit":
            return 4 + 4 * -(-n // 32)
        if self.family == "topk":
            return 8 * self.topk_count(n)
        if self.family == "powersgd":
            rows, cols, q = self.matrix(n)
            return 4 * q * (rows + cols)
        assert self.family == "none", self.family
        return 4 * n

    def payload_bytes(self, numel: int, chunk_numel: int) -> int:
        """Bytes of the payload of a piece of ``numel`` elements cut into chunks of ``chunk_numel``."""
        if numel <= 0:
            return 0
        full, rest = divmod(numel, self.codec_chunk(chunk_numel))
        return full * self.chunk_bytes(self.codec_chunk(chunk_numel)) + self.chunk_bytes(rest)


def parse_codec(text: str) -> CodecSpec:
    """``none``, ``bf16``, ``fp16``, ``onebit``, ``topk:RATIO`` (0 < RATIO <= 1) or ``powersgd:RANK`` (>= 1);
    ``ValueError`` naming ``--compress`` and the choices otherwise."""
    family, _, arg = str(text).strip().partition(":")
    choices = "none, bf16, fp16, onebit, topk:RATIO (e.g. topk:0.01), powersgd:RANK (e.g. powersgd:4)"
    if family not in CODEC_FAMILIES:
        raise ValueError(f"{_FLAG} {text!r}: unknown codec; choose one of {choices}, or auto[:C1,C2,...]")
    if family == "topk":
        try:
            ratio = float(arg)
        except ValueError:
            ratio = math.nan
        if not 0 < ratio <= 1:
            raise ValueError(f"{_FLAG} {text!r}: topk takes the fraction of values it keeps, 0 < RATIO <= 1, "
                             f"e.g. topk:0.01")
        return CodecSpec(family, ratio=ratio)
    if family == "powersgd":
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"{_FLAG} {text!r}: powersgd takes its rank, an integer >= 1, e.g. powersgd:4")
        return CodecSpec(family, rank=int(arg))
    if arg:
        raise ValueError(f"{_FLAG} {text!r}: {family} takes no parameter; choose one of {choices}")
    return CodecSpec(family)


def parse_request(text: str) -> tuple[bool, tuple[str, ...]]:
    """A ``--compress`` value: ``(auto, codec names)``. ``auto`` and ``auto:C1,C2`` let the cost model choose
    per unit among the codecs named (``AUTO_CODECS`` by default) and none; a codec name applies to every unit."""
    text = str(text).strip()
    if text == "auto" or text.startswith("auto:"):
        names = text[5:].split(",") if text.startswith("auto:") else list(AUTO_CODECS)
        specs = [parse_codec(n) for n in names if n.strip()]
        if not specs:
            raise ValueError(f"{_FLAG} {text!r}: name the codecs auto may choose, e.g. auto:bf16,onebit")
        return True, tuple(dict.fromkeys(s.name for s in specs if s.family != "none"))
    return False, (parse_codec(text).name,)


def scheme(strategy: str) -> str:
    """The collective that carries a strategy's payloads: ``all_gather`` (ddp) or ``all_to_all`` (zero1/2)."""
    assert strategy in COMPRESSING_STRATEGIES, strategy
    return "all_gather" if strategy == "ddp" else "all_to_all"


def codec_seconds(codec: str, *, numel: int, encode: bool, profile: Any) -> float:
    """Seconds to encode ``numel`` gradient elements, or to decode payloads into ``numel`` elements, at the
    rates of ``profile`` (a ``HardwareProfile``: GB/s of fp32 gradient read or written)."""
    family = parse_codec(codec).family
    if family == "none" or numel <= 0:
        return 0.0
    rate = getattr(profile, f"{_RATE_KEY[family]}_{'encode' if encode else 'decode'}_gbps")
    return 4 * numel / (rate * 1e9)
