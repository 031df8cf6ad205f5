"""What ``split`` must know of a file before it writes: the fields it cannot move as raw bytes, and the size of
its output besides the padded fields (for the free-space check)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.errors import problem_line

SPAN_NAMES = ("trajectory_env", "trajectory_start", "trajectory_length")


def unpaddable(path: Path, dtypes: dict[str, np.dtype]) -> list[str]:
    """Fields split cannot move as raw bytes: object references and variable-length data (what their bytes
    point to is elsewhere in the file: moved, they would dangle)."""
    found = "HDF5 object references or variable-length data"
    fix = "Store the field as fixed-size values or outside the [T, N, ...] layout."
    return [problem_line(path, name, "fixed-size values", found, fix) for name, t in dtypes.items() if t.hasobject]


def unpadded_bytes(schema: Any, fields: list[str], M: int) -> int:
    """The split output's bytes besides the padded fields: the spans, the datasets copied verbatim (recorded
    hidden states included) and each trajectory's first hidden state."""
    hidden = [path for paths in schema.hidden.values() for path in paths]
    starts = sum(schema.fields[p].nbytes // max(schema.T * schema.N, 1) * M for p in hidden)
    copied = sum(spec.nbytes for name, spec in schema.fields.items() if name not in fields)
    return len(SPAN_NAMES) * 8 * M + copied + starts
