"""Writing the hardware profile that `luwu plan --profile` reads (a HardwareProfile JSON object).

A bench measures only some of the profile's keys, so it merges them into FILE: running
`luwu bench io --profile-out hw.json` on the disk of each box builds up one profile, and keys
that no bench wrote keep the planner's defaults when `luwu plan` reads the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["merge_profile"]


def merge_profile(path: str | Path, values: dict[str, float]) -> dict[str, float]:
    """Sets ``values`` in the profile at ``path`` (created if missing) and returns the whole profile.
    Refuses a file that is not a valid profile rather than overwriting what the user wrote."""
    from luwu_rt.plan.spec import HardwareProfile

    path = Path(path)
    merged: dict[str, float] = {}
    if path.exists():
        HardwareProfile.from_json(path)  # raises, naming the file, when it is not a profile
        merged = json.loads(path.read_text())
    merged.update({k: float(v) for k, v in values.items()})
    HardwareProfile.from_dict(merged)  # never write what `luwu plan --profile` would refuse
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file
    return merged
