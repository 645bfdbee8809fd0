"""Transfer events of the connector, one JSON line each, one file per vLLM process.

The scheduler half (engine core) and the worker half of the connector live in different
processes; both append here and the stage joins the lines to its requests by tag. A file is what
still records a failed load when the KV store itself has gone away.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pandas as pd


class EventLog:
    def __init__(self, folder: str | os.PathLike, role: str) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.path = Path(folder) / f"{role}-{os.getpid()}.jsonl"
        self._file = open(self.path, "a", buffering=1)

    def write(self, **event: Any) -> None:
        self._file.write(json.dumps(event, default=str) + "\n")

    def close(self) -> None:
        self._file.close()


def read_events(folder: str | os.PathLike) -> pd.DataFrame:
    """Every event written so far (a partly written last line, from a killed process, is skipped)."""
    rows = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return pd.DataFrame(rows)
