"""What the node learns from the workers' HELLO: the layout, the optimizer's settings and the schedule.

[Note: the manifest]
A HELLO carries a JSON object (never pickle): ``model`` (each unit's name,
parameter count and the units it reads; compute dtype bytes; chunk bytes;
plan granularity; whether updates wait for the global norm), ``optim`` (the
``OptimConfig`` fields: AdamW's hyper-parameters, the warmup/cosine schedule
and clipping), ``steps`` (the schedule's length), ``dtype`` and ``loss_scale``,
``num_workers`` and ``start_step``/``adam_step`` (where the workers' run
resumes). Every worker's manifest must be equal to worker 0's; ``difference``
names the first key that is not, so the refusal says which flag to fix. The
node needs nothing else about the model: it never sees its code.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from luwu_rt.plan import ModelSpec, UnitSpec

__all__ = ["difference", "job_id", "manifest_bytes", "model_spec"]

MANIFEST_VERSION = 1


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


def difference(a: Any, b: Any, path: str = "") -> str | None:
    """The first place where ``a`` and ``b`` differ, as ``key.sub: a != b``; ``None`` when equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            where = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                return f"{where}: {a.get(key, '<missing>')!r} != {b.get(key, '<missing>')!r}"
            found = difference(a[key], b[key], where)
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            found = difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path or 'manifest'}: {a!r} != {b!r}"
