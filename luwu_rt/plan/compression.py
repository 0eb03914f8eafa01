"""Selective compression: which codec, if any, each unit's gradient synchronisation uses.

[Note: selective compression]
Compressing a unit pays when the bytes it saves on the link take longer than encoding and decoding
them. Per unit of N elements, with the link of the strategy's group (``net_gbps``, ``net_latency_s``)
and the codec rates of the ``HardwareProfile``, the unit's synchronisation takes

  uncompressed    the strategy's collective of the fp32 gradient ([Note: collective cost] in cost.py)
  codec c         encode N elements + the collective of its payloads ([Note: codecs on the wire] in
                  codec.py) + decode W payloads into this rank's piece

(zero2: once per micro-batch), and ``--compress auto`` gives each unit the fastest of none and the
candidate codecs, none on a tie. The three terms are summed, not overlapped: encode and decode run on
queues of their own beside backward, so the sum is the unit's own latency, an upper bound of what it
adds to the step. A plan is then made with the chosen codecs like any other, and ``estimate`` times the
whole step. The choice depends only on the model, the strategy and the profile, so every rank makes it
alike (and ``plan_digest`` checks that they did).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .codec import (
    COMPRESSING_STRATEGIES,
    codec_seconds,
    parse_codec,
    parse_request,
    scheme,
)
from .cost import collective_seconds
from .sequence import _ring, codec_chunk_numel, codec_pieces
from .spec import HardwareProfile, ModelSpec, Strategy, ceil_div

__all__ = ["UnitChoice", "choose_codecs", "resolve_compression", "unit_choices", "unit_sync"]


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitChoice:
    """One unit's synchronisation under its codec, against uncompressed ([Note: selective compression])."""

    unit: int
    codec: str
    raw_bytes: int
    """Bytes this rank sends per step for the unit uncompressed."""
    wire_bytes: int
    """Bytes it sends with ``codec``."""
    raw_s: float
    """Predicted seconds of the uncompressed collective(s) per step."""
    sync_s: float
    """Predicted seconds of encode + collective + decode per step with ``codec``."""


def unit_sync(model: ModelSpec, strategy: Strategy, unit: int, codec: str,
              profile: HardwareProfile) -> tuple[int, float]:
    """``(bytes sent, seconds)`` per step of unit ``unit``'s gradient synchronisation under ``strategy`` with
    ``codec`` (``none``: the uncompressed collective)."""
    ways, numel = strategy.world_size, model.units[unit].num_params
    times = model.num_micro_batches if strategy.name == "zero2" else 1
    link = {"ranks": ways, "latency_s": profile.net_latency_s, "gbps": profile.net_gbps}
    if parse_codec(codec).family == "none":
        collective = "all_reduce" if strategy.name == "ddp" else "reduce_scatter"
        full = numel * model.grad_bytes if strategy.name == "ddp" else ceil_div(numel, ways) * ways * model.grad_bytes
        return times * _ring(full, ways, collective), times * collective_seconds(collective, nbytes=full, **link)
    _, piece = codec_pieces(model, strategy, unit)
    received = ways * parse_codec(codec).payload_bytes(piece, codec_chunk_numel(model))
    seconds = (codec_seconds(codec, numel=numel, encode=True, profile=profile)
               + collective_seconds(scheme(strategy.name), nbytes=received, **link)
               + codec_seconds(codec, numel=ways * piece, encode=False, profile=profile))
    return times * _ring(received, ways, scheme(strategy.name)), times * seconds


def unit_choices(model: ModelSpec, strategy: Strategy, profile: HardwareProfile) -> tuple[UnitChoice, ...]:
    """Each unit's synchronisation under the codecs ``strategy`` (resolved) gives it, against uncompressed."""
    return choose_codecs(model, strategy, candidates=(), profile=profile, given=True)


def choose_codecs(model: ModelSpec, strategy: Strategy, *, candidates: tuple[str, ...],
                  profile: HardwareProfile, given: bool = False) -> tuple[UnitChoice, ...]:
    """Per unit, the fastest of none and ``candidates`` ([Note: selective compression]); with ``given``, the
    codec ``strategy`` already gives it."""
    out = []
    for u in range(len(model.units)):
        raw_bytes, raw_s = unit_sync(model, strategy, u, "none", profile)
        best = ("none", raw_bytes, raw_s)
        for codec in (strategy.codec(u),) if given else candidates:
            nbytes, seconds = unit_sync(model, strategy, u, codec, profile)
            if seconds < best[2] or (given and codec != "none"):
                best = (codec, nbytes, seconds)
        out.append(UnitChoice(unit=u, codec=best[0], raw_bytes=raw_bytes, wire_bytes=best[1], raw_s=raw_s,
                              sync_s=best[2]))
    return tuple(out)


def resolve_compression(model: ModelSpec, strategy: Strategy, request: str, *,
                        profile: HardwareProfile = HardwareProfile()) -> Strategy:
    """``strategy`` with the codec of each unit that ``request`` (a ``--compress`` value) asks for: one codec
    for every unit, or under ``auto`` the cost model's choice per unit. A strategy that runs no gradient
    collective (one rank) or cannot compress (zero3, hsdp) is left uncompressed under ``auto``, and so is node
    (``TrainConfig`` refuses ``auto`` for it); an explicit codec for zero3 or hsdp is a ``ValueError``
    (``Strategy``'s), one for node compresses its pushes ([Note: compressed pushes] in codec.py)."""
    auto, names = parse_request(request)
    capable = strategy.name in COMPRESSING_STRATEGIES and strategy.world_size > 1
    if strategy.name == "node" and not auto and names != ("none",):  # pushes to the node, even from one worker
        return replace(strategy, compress=names * len(model.units))
    if names == ("none",) or (auto and not capable) or (strategy.world_size == 1 and not auto):
        return replace(strategy, compress=())
    if not auto:
        return replace(strategy, compress=names * len(model.units))
    chosen = choose_codecs(model, strategy, candidates=names, profile=profile)
    return replace(strategy, compress=tuple(c.codec for c in chosen))
