"""Human-readable byte sizes: ``parse_size("4GiB")`` and ``format_size(n)``.

Shared by every command that takes a memory budget (``luwu plan``, ``luwu
train``, ``luwu bench``) so that the same spelling means the same bytes
everywhere.
"""

from __future__ import annotations

import math
import re

__all__ = ["flag_size", "format_size", "parse_size"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: ``"512MiB"``, ``"4GiB"``, ``"1.5TB"``, ``"4096"``.

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones
    (KB, MB, GB, TB, or K, M, G, T) powers of 1000, as disk and RAM vendors use
    them. Case does not matter. Fractions round down to whole bytes.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    match = _SIZE_RE.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read size {text!r}: write a number with an optional unit, e.g. 512MiB, 4GiB, 1.5TB "
            f"(units: {', '.join(u for u in _UNITS if u)})")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(num_bytes: int | float) -> str:
    """``1536 * 2**20`` -> ``"1.50 GiB"``; binary units, three significant figures."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def flag_size(num_bytes: int) -> str:
    """The shortest spelling ``parse_size`` reads as at least ``num_bytes``: three significant figures in
    binary units, rounded up, no space (``3.3GiB``, ``733MiB``), as a flag's value in a suggestion."""
    value, unit = float(num_bytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    decimals = 0 if unit == "B" else max(0, 3 - len(str(int(value))))
    step = 10**decimals
    rounded = math.ceil(value * step - 1e-9) / step
    text = f"{rounded:.{decimals}f}".rstrip("0").rstrip(".") if decimals else f"{rounded:.0f}"
    out = f"{text}{unit}"
    if parse_size(out) < num_bytes:  # float rounding: one step more
        out = f"{(rounded + 1 / step):.{decimals}f}".rstrip("0").rstrip(".") + unit
    assert parse_size(out) >= num_bytes, (num_bytes, out)
    return out
