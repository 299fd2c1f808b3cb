"""What the reliability tests measured, collected for benchmarks/reliability.py.

Each test calls ``record(kind, **fields)``; when ``AGENTLOOP_RELIABILITY_REPORT`` names a file, one
JSON line is appended to it (else nothing happens), so ``make test`` writes nothing.
"""

from __future__ import annotations

import json
import os
from typing import Any

ENV = "AGENTLOOP_RELIABILITY_REPORT"


def record(kind: str, **fields: Any) -> None:
    """Append ``{"kind": kind, **fields}`` to the report file, if one is set."""
    path = os.environ.get(ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"kind": kind, **fields}) + "\n")
