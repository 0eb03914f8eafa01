"""The node tests spawn worker processes with the gloo tests' helpers (tests/dist/ranks.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dist"))
