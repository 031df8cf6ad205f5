"""Render pipeline results (plain dicts): text on stdout, progress bars on stderr, JSON (NaN/Inf as null).

Strings may come from untrusted files: ``printable`` makes each one line without control characters, and the
consoles never parse rich markup or emoji codes, so every name prints as it is spelled.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from rolloutcli.errors import one_line, stop_if_signalled
from rolloutcli.pipeline.progress import Progress, TestPause

stdout = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)
stderr = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)


def printable(value: Any) -> Any:
    """``value`` with every string (keys too) made one printable line, recursively through dicts and lists."""
    if isinstance(value, (str, os.PathLike)):
        return one_line(str(value))
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable(v) for v in value]
    return value


def _plain(value: Any) -> Any:
    """JSON-ready data: numpy scalars and arrays as Python values, non-finite floats as None. What is plain already
    is returned as it is, not copied (a dataset's report holds a row per file: 10,000 rows copied whole would
    double them in memory while the JSON is written)."""
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # numpy scalar or array, torch tensor
        value = value.tolist()
    if isinstance(value, dict):
        out = {str(k): _plain(v) for k, v in value.items()}
        same = type(value) is dict and all(type(k) is str and out[k] is v for k, v in value.items())
        return value if same else out
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return value if type(value) is list and all(a is b for a, b in zip(items, value, strict=True)) else items
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return value


def to_json(result: dict[str, Any]) -> str:
    """One JSON object on one line; NaN and Infinity become null."""
    return json.dumps(_plain(result), default=str, allow_nan=False)


def _size(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return str(num)


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class RichProgress(Progress):
    """A ``Progress`` that draws a rich bar on stderr (nothing when quiet or not a terminal)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.enabled = not quiet and stderr.is_terminal  # rich would still print a blank line into a pipe
        self._bar: Any = None
        self._task: Any = None
        self._test = TestPause()  # the test hook (pipeline/progress.py)

    def start(self, description: str, total: int) -> None:
        stop_if_signalled()  # a stop point: a signal held back during an import, or whose exception was lost
        if not self.enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.finish()
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self._bar = Progress(*columns, console=stderr, transient=True)
        self._bar.start()
        self._task = self._bar.add_task(one_line(description), total=total)

    def advance(self, amount: int = 1) -> None:
        stop_if_signalled()
        if self._bar is not None:
            self._bar.advance(self._task, amount)
        self._test.advance()

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def warn(self, message: str) -> None:
        """A warning about the data: one line on stderr, unless --quiet."""
        if not self.quiet:
            stderr.print(f"warning: {one_line(message)}")


def _table(title: str, columns: tuple[str, ...], right: tuple[str, ...] = (), fold: tuple[str, ...] = ()) -> Table:
    """A borderless table; only the ``fold`` columns may wrap (folded, never cut), so it fits 80 columns."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    for column in columns:
        justify = "right" if column in right else "left"
        table.add_column(column, justify=justify, overflow="fold", no_wrap=column not in fold)
    return table


def _shape(shape: list[int]) -> str:
    return "x".join(str(d) for d in shape) or "scalar"


def _stats_line(name: str, moments: dict[str, Any]) -> str:
    return (
        f"{name}: mean {_num(moments['mean'])}  std {_num(moments['std'])}  min {_num(moments['min'])}  "
        f"max {_num(moments['max'])}  non-finite {moments['nonfinite']}"
    )


def derived_header(console: Console, command: str, summary: dict[str, Any]) -> None:
    """The first line of a per-file command's summary (gae, nstep, returns): input, where it went, T, N, blocks."""
    where = "in place" if summary["in_place"] else f"-> {summary['output']}"
    console.print(
        f"{command} {summary['input']} {where}  (T={summary['T']}, N={summary['N']}, {summary['blocks']} env block(s))"
    )
