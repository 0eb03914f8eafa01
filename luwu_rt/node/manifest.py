"""What the node learns from the workers' HELLO: the layout, the optimizer's settings and the schedule.

[Note: the manifest]
A HELLO carries a JSON object (never pickle): ``model`` (each unit's name,
parameter count and the units it reads; compute dtype bytes; chunk bytes;
plan granularity; whether updates wait for the global norm), ``optim`` (the
``OptimConfig`` fields: AdamW's hyper-parameters, the warmup/cosine schedule
and clipping), ``steps`` (the schedule's length), ``dtype`` and ``loss_scale``,
``num_workers``, ``start_step``/``adam_step`` (where the workers' run
resumes) and ``compress``, the codec of the workers' pushes (``none``, or one
of ``plan.codec.NODE_CODECS``: [Note: compressed pushes] in plan/codec.py).
Every worker's manifest must be equal to worker 0's; ``difference``
names the first key that is not, so the refusal says which flag to fix. The
node needs nothing else about the model: it never sees its code.

[Note: a HELLO is checked whole]
A HELLO comes from anyone who can connect, so the node reads it as hostile
until it is checked whole: ``parse_manifest`` takes at most
``MAX_HELLO_BYTES``, refuses JSON's NaN and Infinity, and checks every field -
its presence, type (a bool is no number), range, the dtype's name and that the
parameter bytes match it, each unit's reads - and that no other key is there,
before the node changes any state. Its caps (``MAX_UNITS`` units,
``MAX_UNIT_PARAMS`` parameters a unit, ``MAX_WORKERS``, ``MAX_STEPS``) keep
what a HELLO can make the node plan and allocate bounded, and its cost is
linear in the payload: the node's one socket loop answers everyone else
meanwhile. Only a manifest that passes may bind the node to a run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

from luwu_rt.config import from_mapping
from luwu_rt.optim.config import OptimConfig
from luwu_rt.plan import ModelSpec, UnitSpec
from luwu_rt.plan.codec import NODE_CODECS, parse_codec

from .config import check_address
from .protocol import MAX_PAYLOAD_BYTES

__all__ = ["MAX_HELLO_BYTES", "MAX_UNITS", "difference", "first_difference", "job_id", "manifest_bytes", "model_spec",
           "parse_manifest"]

MANIFEST_VERSION = 1
MAX_HELLO_BYTES = 256 * 2**10
"""Largest HELLO payload a node reads ([Note: a HELLO is checked whole]): a manifest of ``MAX_UNITS`` units fits."""
MAX_UNITS = 1024
"""Units a manifest may declare: the node plans them on its socket loop (a 128-layer model has 130)."""
MAX_UNIT_PARAMS = 2**40
MAX_WORKERS = 2**16
MAX_NODE_SHARDS = 256
MAX_STEPS = 2**31 - 1
_PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_TOP = {"manifest_version", "nodes", "model", "optim", "steps", "dtype", "loss_scale", "num_workers", "start_step",
        "adam_step", "compress"}
_MODEL = {"units", "param_bytes", "chunk_bytes", "max_shards_per_state", "optimizer_waits_for_backward"}
_UNIT = {"name", "num_params", "reads"}


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The canonical encoding: sorted keys, no whitespace, so equal manifests are equal bytes."""
    return json.dumps({"manifest_version": MANIFEST_VERSION, **manifest}, sort_keys=True,
                      separators=(",", ":")).encode()


def job_id(manifest: dict[str, Any]) -> int:
    """32 bits that every message of the run carries: a digest of the manifest."""
    return int.from_bytes(hashlib.sha256(manifest_bytes(manifest)).digest()[:4], "little")


def model_spec(manifest: dict[str, Any]) -> ModelSpec:
    """The planner's view of the workers' model; raises ``ValueError`` naming a malformed field."""
    try:
        m = manifest["model"]
        units = tuple(UnitSpec(name=str(u["name"]), num_params=int(u["num_params"]),
                               reads=tuple(int(r) for r in u["reads"])) for u in m["units"])
        return ModelSpec(units=units, param_bytes=int(m["param_bytes"]), grad_bytes=4,
                         chunk_bytes=int(m["chunk_bytes"]), max_shards_per_state=int(m["max_shards_per_state"]),
                         optimizer_waits_for_backward=bool(m["optimizer_waits_for_backward"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"HELLO manifest lacks or mistypes {exc}: the worker runs another luwu_rt version") from None


def difference(a: Any, b: Any) -> str | None:
    """The first place where ``a`` and ``b`` differ, as ``key.sub: a != b``; ``None`` when equal."""
    found = first_difference(a, b)
    return None if found is None else f"{found[0]}: {found[1]!r} != {found[2]!r}"


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first place where ``a`` and ``b`` differ: ``(key.sub, a's value, b's value)`` (``'<missing>'`` for
    a key one lacks); ``None`` when equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            where = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                return where, a.get(key, "<missing>"), b.get(key, "<missing>")
            found = first_difference(a[key], b[key], where)
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else (path or "manifest", a, b)


def parse_manifest(payload: bytes | memoryview) -> dict[str, Any]:
    """The manifest a HELLO carries, checked whole ([Note: a HELLO is checked whole]); ``ValueError`` naming the
    first field that is missing, mistyped or out of range."""
    if len(payload) > MAX_HELLO_BYTES:
        raise ValueError(f"a manifest of {len(payload)} bytes, over the cap of {MAX_HELLO_BYTES}")
    try:
        manifest = json.loads(bytes(payload), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"the manifest is not JSON ({type(exc).__name__})") from None
    _check_keys(manifest, "manifest", required=_TOP - {"nodes"}, optional={"nodes"})
    if manifest["manifest_version"] != MANIFEST_VERSION:
        raise ValueError(f"manifest_version {manifest['manifest_version']!r}, this node reads {MANIFEST_VERSION}: run "
                         f"the same luwu_rt on the node and the workers")
    if "nodes" in manifest:
        nodes = manifest["nodes"]
        if not isinstance(nodes, list) or not 2 <= len(nodes) <= MAX_NODE_SHARDS:
            raise ValueError(f"manifest.nodes: expected a list of 2 to {MAX_NODE_SHARDS} node addresses")
        for i, address in enumerate(nodes):
            if not isinstance(address, str) or len(address) > 1024:
                raise ValueError(f"manifest.nodes[{i}]: expected an address")
            check_address(address, flag=f"manifest.nodes[{i}]", bind=False)
    steps = _int(manifest["steps"], "manifest.steps", 1, MAX_STEPS)
    start = _int(manifest["start_step"], "manifest.start_step", 0, steps)
    _int(manifest["adam_step"], "manifest.adam_step", 0, start)
    _int(manifest["num_workers"], "manifest.num_workers", 1, MAX_WORKERS)
    if manifest["dtype"] not in _PARAM_BYTES:
        raise ValueError(f"manifest.dtype {manifest['dtype']!r}: expected one of {', '.join(_PARAM_BYTES)}")
    scale = manifest["loss_scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"manifest.loss_scale {scale!r}: expected a positive number")
    codec = manifest["compress"]
    if not isinstance(codec, str) or len(codec) > 64:
        raise ValueError("manifest.compress: expected a codec's name")
    try:
        spec = parse_codec(codec)
    except ValueError as exc:
        raise ValueError(f"manifest.compress: {exc}") from None
    if spec.family not in ("none",) + NODE_CODECS:
        raise ValueError(f"manifest.compress {codec!r}: a node decodes none, {', '.join(NODE_CODECS)} (topk:RATIO)")
    optim = manifest["optim"]
    _check_keys(optim, "manifest.optim", required={f.name for f in dataclasses.fields(OptimConfig)})
    from_mapping(OptimConfig, optim, where="manifest.optim")  # types and ranges, as a config file's
    _check_model(manifest["model"], dtype=manifest["dtype"])
    return manifest


def _check_model(model: Any, *, dtype: str) -> None:
    _check_keys(model, "manifest.model", required=_MODEL)
    if _int(model["param_bytes"], "manifest.model.param_bytes", 2, 4) != _PARAM_BYTES[dtype]:
        raise ValueError(f"manifest.model.param_bytes {model['param_bytes']} does not match dtype {dtype}")
    chunk = _int(model["chunk_bytes"], "manifest.model.chunk_bytes", 4096, MAX_PAYLOAD_BYTES)
    if chunk % 4096:
        raise ValueError(f"manifest.model.chunk_bytes {chunk}: expected a multiple of 4096")
    _int(model["max_shards_per_state"], "manifest.model.max_shards_per_state", 1, 1024)
    if not isinstance(model["optimizer_waits_for_backward"], bool):
        raise ValueError("manifest.model.optimizer_waits_for_backward: expected true or false")
    units = model["units"]
    if not isinstance(units, list) or not 1 <= len(units) <= MAX_UNITS:
        raise ValueError(f"manifest.model.units: expected a list of 1 to {MAX_UNITS} units")
    for i, unit in enumerate(units):
        where = f"manifest.model.units[{i}]"
        _check_keys(unit, where, required=_UNIT)
        if not isinstance(unit["name"], str) or not 0 < len(unit["name"]) <= 128:
            raise ValueError(f"{where}.name: expected a name of 1 to 128 characters")
        _int(unit["num_params"], f"{where}.num_params", 1, MAX_UNIT_PARAMS)
        reads = unit["reads"]
        if not isinstance(reads, list) or len(reads) >= len(units):
            raise ValueError(f"{where}.reads: expected a list of other units")
        seen = set()
        for r in reads:
            if _int(r, f"{where}.reads", 0, len(units) - 1) == i or r in seen:
                raise ValueError(f"{where}.reads: lists unit {r} twice, or itself")
            seen.add(r)


def _check_keys(table: Any, where: str, *, required: set[str], optional: set[str] = frozenset()) -> None:
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table of keys, got {type(table).__name__}")
    missing, unknown = sorted(required - set(table)), sorted(set(table) - required - optional)
    if missing or unknown:
        raise ValueError(f"{where}: " + (f"lacks {', '.join(missing)}" if missing else f"unknown key(s) "
                                         f"{', '.join(unknown[:5])}") + ": the worker runs another luwu_rt version")


def _int(value: Any, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{where} {value!r}: expected a whole number in {lo}..{hi}")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no number of a manifest")
