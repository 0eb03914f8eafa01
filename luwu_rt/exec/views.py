"""Typed views of one op's shards: what every handler that reads a unit's buffers starts from.

An op's views are flat ``uint8`` tensors, one per shard, each padded to 4 KiB
(``Views`` in executor.py). A handler wants a unit's buffer of each state kind
as elements of the kind's type, in element order: ``typed_views`` gives each
state's shards in chunk order, viewed as the kind's dtype and cut to the
elements they cover, so concatenated they are the unit's (or this rank's
slice of the unit's) flat buffer of that kind.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from luwu_rt.exec.executor import Views
from luwu_rt.kernels.dtypes import TORCH_DTYPES
from luwu_rt.plan.dtypes import FIXED_STATE_DTYPES
from luwu_rt.plan.ops import ShardId, ShardInfo
from luwu_rt.plan.spec import SECOND_HALF

__all__ = ["state_dtypes", "typed_views"]


def state_dtypes(*, param_dtype: torch.dtype, grad_dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The element type of every shard state kind of a plan: the compute copy and its workspaces
    (``param``, ``param_full``, ``param_slice``) in ``param_dtype``, the gradient and its workspaces in
    ``grad_dtype``, the optimizer state (both halves of a double-buffered one) and a compressed unit's residual
    in fp32, a squared norm in float64 (the table the planner sized them from: [Note: dtype names] in
    plan/dtypes.py) and compressed payloads as bytes."""
    return {"param": param_dtype, "param_full": param_dtype, "param_slice": param_dtype,
            "grad": grad_dtype, "grad_full": grad_dtype, "grad_slice": grad_dtype,
            **{state: TORCH_DTYPES[name] for state, name in FIXED_STATE_DTYPES.items()},
            **{kind: TORCH_DTYPES[FIXED_STATE_DTYPES[base]] for base, kind in SECOND_HALF.items()}}


def typed_views(views: Views, shards: Mapping[ShardId, ShardInfo], dtypes: Mapping[str, torch.dtype], *,
                states: tuple[str, ...] | None = None) -> dict[str, list[torch.Tensor]]:
    """``state -> [shard view as dtypes[state], cut to its elements]`` in chunk order, for the states of
    ``views`` (only ``states`` when given). Each state's shards must be of one unit: the pieces of one
    flat buffer."""
    by_state: dict[str, list[ShardId]] = {}
    for sid in views:
        if states is None or sid.state in states:
            by_state.setdefault(sid.state, []).append(sid)
    out: dict[str, list[torch.Tensor]] = {}
    for state, ids in by_state.items():
        assert len({s.unit for s in ids}) == 1, f"typed_views: {state} shards of several units {sorted(ids)}"
        ids.sort(key=lambda s: s.chunk)
        out[state] = [views[s].view(dtypes[state])[: shards[s].numel] for s in ids]
    return out
