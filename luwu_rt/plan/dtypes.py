"""The names of the floating-point types the runtime computes in and moves: the one table of them.

[Note: dtype names]
A user names a compute dtype by its short name: ``--dtype bf16`` (``TrainConfig.dtype``, which a node's
manifest carries too), ``luwu ckpt export --dtype``, ``luwu bench optim --grad-dtype``. Everything below the
user speaks the full name, which is torch's: ``torch.bfloat16``, a checkpoint manifest's ``"dtype"`` of a
tensor (``ckpt/format.py`` records any tensor's dtype so) and the node protocol's dtype codes
(``node/protocol.py`` numbers full names). The state kinds whose type does not follow the compute dtype (the
optimizer state, a squared norm) are here too: the planner sizes their shards from this table and the
executor's handlers view them through it (``exec/views.py`` ``state_dtypes``), so the two cannot disagree.
Pure Python in the planner's package, the lowest floor, so configs and the planner name dtypes without
importing torch (as ``parse_size`` lives in ``plan/sizes.py``); ``luwu_rt.kernels.dtypes`` maps the names to
``torch.dtype``.
"""

from __future__ import annotations

__all__ = ["DTYPE_NAMES", "ELEMENT_BYTES", "FIXED_STATE_DTYPES", "LOW_PRECISION", "full_name"]

DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""The compute dtypes, short name -> full name, in the order ``--help`` lists them (the default first)."""
LOW_PRECISION: tuple[str, ...] = ("bf16", "fp16")
"""The 2-byte compute dtypes: what a kernel's copy-out of the updated parameters (``param_out``) may be."""
ELEMENT_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "uint8": 1}
"""Bytes per element by full name: the compute dtypes, ``float64`` (a squared gradient norm's type) and
``uint8`` (a compressed gradient's payload bytes)."""
FIXED_STATE_DTYPES: dict[str, str] = {"master": "float32", "exp_avg": "float32", "exp_avg_sq": "float32",
                                      "norm": "float64", "residual": "float32", "grad_code": "uint8",
                                      "grad_codes": "uint8"}
"""Full dtype name of each state kind whose type is fixed: the master weights and the moments in fp32, a
(partial) squared gradient norm in float64, a compressed unit's error-feedback residual in fp32 and its
encoded payloads (``grad_code`` sent, ``grad_codes`` received) as bytes. The parameters' kinds (``param``,
``param_full``, ``param_slice``) take the compute dtype and the gradients' kinds their own
(``ModelSpec.param_bytes``, ``grad_bytes``)."""


def full_name(name: str, *, what: str = "dtype") -> str:
    """The full name of the compute dtype ``name`` (a short or a full name); ``what`` names the flag or key
    in the error (``ValueError``) for any other name."""
    if name in DTYPE_NAMES:
        return DTYPE_NAMES[name]
    if name in DTYPE_NAMES.values():
        return name
    raise ValueError(f"{what} {name!r}: choose one of {', '.join(DTYPE_NAMES)}")
