"""Writing an experiment's results."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str, payload: dict) -> None:
    """``payload`` as indented JSON at ``path`` (parent folders created; non-JSON values as strings)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"wrote {path}")
