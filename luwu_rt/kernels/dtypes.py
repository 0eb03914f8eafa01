"""The dtype table of ``luwu_rt/plan/dtypes.py`` ([Note: dtype names]) as ``torch.dtype``, one floor up, where
torch may be imported. The kernels take exactly the compute dtypes (fp32, bf16 or fp16 gradients; a bf16 or
fp16 copy-out), and every floor above turns a dtype's name into a ``torch.dtype`` through here."""

from __future__ import annotations

import torch

from luwu_rt.plan.dtypes import DTYPE_NAMES, ELEMENT_BYTES, LOW_PRECISION, full_name

__all__ = ["COMPUTE_DTYPES", "LOW_PRECISION_DTYPES", "TORCH_DTYPES", "torch_dtype"]

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ELEMENT_BYTES}
"""Full name (torch's) -> ``torch.dtype``, for every dtype of the table."""
COMPUTE_DTYPES: dict[str, torch.dtype] = {short: TORCH_DTYPES[full] for short, full in DTYPE_NAMES.items()}
"""Short name (``TrainConfig.dtype``) -> ``torch.dtype``: ``fp32``, ``bf16``, ``fp16``."""
LOW_PRECISION_DTYPES: tuple[torch.dtype, ...] = tuple(COMPUTE_DTYPES[name] for name in LOW_PRECISION)
"""bf16 and fp16: the dtypes of a kernel's copy-out of the updated parameters."""


def torch_dtype(name: str, *, what: str = "dtype") -> torch.dtype:
    """The ``torch.dtype`` of the compute dtype ``name`` (short, e.g. ``bf16``, or full, ``bfloat16``);
    ``ValueError`` naming ``what`` (the flag or key) and the choices for any other name."""
    return TORCH_DTYPES[full_name(name, what=what)]
