"""A dataset run's summary over all its files, in the shape of one file's summary (so the command's own renderer
prints it), built as each file finishes: memory stays flat in the file count.

Each unit returns its command's summary made small (:func:`compact`: no paths, field lists or times); the driver
adds it to :class:`Totals`, which keeps sums (steps, bytes, counts, merged moments) and, per file, one row of a
few numbers for ``--json`` (its name, bytes written and the summary's counts: well under 200 bytes of JSON).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from rolloutcli.pipeline.timeouts_rule import describe

# integer counts that add up over files (N: the envs of all files); other integers (T, L) become a range
SUMMED = {
    "N",
    "blocks",
    "bootstrapped_rewards",
    "trajectories",
    "episodes",
    "truncated_episodes",
    "overflowed_steps",
    "input_bytes",
    "padded_bytes",
}
DROPPED = {"input", "output", "in_place", "seconds"}  # per file, not per dataset (the fields: the first file's)
MOMENT_KEYS = {"count", "mean", "std", "min", "max", "nonfinite"}


def compact(summary: dict[str, Any]) -> dict[str, Any]:
    """A unit's summary as it travels to the driver: without paths and time (its field list stays: every file of
    a dataset has the same fields, and the driver keeps only the first file's)."""
    return {k: v for k, v in summary.items() if k not in DROPPED}


def _merge_moments(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two ``Moments.as_dict()`` merged (Chan et al., as ``Moments.merge``)."""
    if not b["count"] or not a["count"]:
        kept = dict(b if b["count"] else a)
        kept["nonfinite"] = a["nonfinite"] + b["nonfinite"]
        return kept
    count = a["count"] + b["count"]
    delta = b["mean"] - a["mean"]
    m2 = sum(m["std"] ** 2 * (m["count"] - 1) for m in (a, b)) + delta * delta * a["count"] * b["count"] / count
    return {
        "count": count,
        "mean": a["mean"] + delta * b["count"] / count,
        "std": math.sqrt(m2 / (count - 1)),
        "min": min(a["min"], b["min"]),
        "max": max(a["max"], b["max"]),
        "nonfinite": a["nonfinite"] + b["nonfinite"],
    }


def _merge_lengths(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two trajectory-length summaries merged: count, min, mean, max exact; percentiles cannot be (None)."""
    count = a["count"] + b["count"]
    if not a["count"] or not b["count"]:
        kept = dict(b if b["count"] else a)
    else:
        kept = {"min": min(a["min"], b["min"]), "max": max(a["max"], b["max"])}
        kept["mean"] = (a["mean"] * a["count"] + b["mean"] * b["count"]) / count
    return {**{k: None for k in a}, **kept, "count": count, **{k: None for k in a if k.startswith("p")}}


def _merge(key: str, a: Any, b: Any) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        if MOMENT_KEYS <= a.keys():
            return _merge_moments(a, b)
        if key == "trajectory_lengths":
            return _merge_lengths(a, b)
        return {k: _merge(k, a[k], b.get(k)) for k in a}
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) or bool(b)  # "any file": bootstrapped by this run, already bootstrapped
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    if isinstance(a, float) or isinstance(b, float):
        return a if a == b else None  # a per-file figure (a raw mean) that does not add up
    return a if a == b else "mixed"


class Totals:
    """The running summary of a dataset run (see the module docstring)."""

    def __init__(self, rows: bool = True) -> None:
        self.keep_rows = rows  # a row per file (``--json``: 10,000 of them are 4.4 MB in the driver)
        self.files = 0
        self.steps = 0
        self.summary: dict[str, Any] = {}
        self.ranges: dict[str, tuple[int, int]] = {}  # T, L: min and max over files
        self.rules: Counter[str] = Counter()  # gae: "rule (where from)" -> files
        self.rows: list[tuple[int, dict[str, Any]]] = []
        self.defaulted = 0  # files gae applied the default time-out rule to (they name none)

    def add(self, index: int, name: str, size_bytes: int, summary: dict[str, Any]) -> None:
        """Add input ``index``'s (``name``) unit summary; its output has ``size_bytes``."""
        self.files += 1
        self.steps += int(summary.get("T") or 0) * int(summary.get("N") or 0)
        row: dict[str, Any] = {"name": name, "bytes_written": size_bytes}
        for key, value in summary.items():
            counted = isinstance(value, int) and not isinstance(value, bool)
            if counted:
                row[key] = value
            if counted and key not in SUMMED:
                low, high = self.ranges.get(key, (value, value))
                self.ranges[key] = (min(low, value), max(high, value))
            elif key not in self.summary:
                self.summary[key] = value
            elif key != "fields":
                self.summary[key] = _merge(key, self.summary[key], value)
        if "timeouts_from" in summary:
            rule = describe(summary["timeouts"], summary["timeouts_from"])
            self.rules[rule] += 1
            self.defaulted += summary["timeouts_from"] == "default"
            row["timeouts"] = summary["timeouts"]
        if self.keep_rows:
            self.rows.append((index, row))

    def result(self, output: str) -> dict[str, Any]:
        """The summary over all files added, shaped as one file's (``T`` as ``"24"`` or ``"24-48"``)."""
        total = dict(self.summary)
        for key, (low, high) in self.ranges.items():
            total[key] = str(low) if low == high else f"{low}-{high}"
        if "padded_bytes" in total and total.get("input_bytes"):
            total["padding_overhead"] = total["padded_bytes"] / total["input_bytes"]
        if len(self.rules) > 1:
            total["timeouts"] = total["timeouts_from"] = "mixed"
            total["timeouts_files"] = dict(self.rules)
        total.update({"input": f"{self.files} files", "output": output, "in_place": False, "steps": self.steps})
        return total

    def per_file(self) -> list[dict[str, Any]]:
        """The per-file rows, in input order."""
        return [row for _, row in sorted(self.rows, key=lambda item: item[0])]
