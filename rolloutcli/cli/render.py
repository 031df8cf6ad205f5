"""Render pipeline results (plain dicts): text on stdout, progress bars on stderr, JSON (NaN/Inf as null).

Strings may come from untrusted files: ``printable`` makes each one line without control characters, and the
consoles never parse rich markup or emoji codes, so every name prints as it is spelled.

Every line on stdout fits the console's width (the terminal's; 80 columns when piped, unless COLUMNS says
otherwise): text wraps at spaces only (``fit``), so a name (a path, a dataset) is never broken; tables are
``grid`` lines whose name column gives way first (a long name takes a line of its own).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleDimensions
from rich.text import Text

from rolloutcli.errors import one_line, stop_if_signalled
from rolloutcli.pipeline.lazy import Lazy
from rolloutcli.pipeline.progress import Progress, TestPause

PIPE_WIDTH = 80  # the width of stdout when it is not a terminal and COLUMNS is not set


def fit(text: str | Text, width: int) -> list[Text]:
    """``text`` as lines of at most ``width`` cells, broken at spaces only: a word (a name, a path) is never cut;
    one longer than ``width`` stands alone on its line. Continuation lines are indented two more than the first."""
    text = Text(text) if isinstance(text, str) else text
    lines: list[Text] = []
    for line in text.split("\n", allow_blank=True):
        plain = line.plain
        if cell_len(plain) <= width:
            lines.append(line)
            continue
        indent = " " * min(len(plain) - len(plain.lstrip(" ")) + 2, width // 2)
        prefix, start, end = "", 0, 0
        for word in re.finditer(r"\S+", plain):
            if end and cell_len(prefix + plain[start : word.end()]) > width:
                lines.append(Text(prefix) + line[start:end])
                prefix, start = indent, word.start()
            end = word.end()
        lines.append(Text(prefix) + line[start:end])
    return lines


def command_lines(command: str, width: int) -> list[str]:
    """A command to copy, indented two: one line, or broken between words with shell continuations (`` \\``),
    so a paste runs it whole; an option stays with its value."""
    lines, line = [], "  "
    for word in re.findall(r"-\S+ (?!-)\S+|\S+", command):
        if line.strip() and cell_len(f"{line} {word} \\") > width:
            lines.append(f"{line} \\")
            line = "    "
        line = f"{line} {word}" if line.strip() else line + word
    return [*lines, line]


class FitConsole(Console):
    """stdout's console: 80 columns when piped; each text it prints is ``fit`` to its width (tables and other
    renderables print as rich draws them)."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self.is_terminal or self._width is not None or (self._environ.get("COLUMNS") or "").isdigit():
            return size
        return ConsoleDimensions(PIPE_WIDTH, size.height)

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if len(objects) == 1 and isinstance(objects[0], (str, Text)) and not kwargs:
            for line in fit(objects[0], self.width):
                super().print(line)
            return
        super().print(*objects, **kwargs)


stdout = FitConsole(highlight=False, soft_wrap=True, markup=False, emoji=False)
stderr = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)


def printable(value: Any) -> Any:
    """``value`` with every string (keys too) made one printable line, recursively through dicts and lists."""
    if isinstance(value, (str, os.PathLike)):
        return one_line(str(value))
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, Lazy)):
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
    if isinstance(value, (list, tuple, Lazy)):
        items = [_plain(v) for v in value]
        return value if type(value) is list and all(a is b for a, b in zip(items, value, strict=True)) else items
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return value


def json_pieces(result: dict[str, Any]) -> Iterator[str]:
    """``json.dumps(result)`` (one line; NaN and Infinity as null) in pieces, a list in ``result`` an item at a
    time: a dataset's report holds a row per file, and its whole text, with the encoder's own pieces of it, took
    ~1.2 KB a file of the driver's memory while it was printed (3.6 MB more for 3,000 files)."""
    for k, (key, value) in enumerate(result.items()):
        yield ("{" if k == 0 else ", ") + _dumps(str(key)) + ": "
        if isinstance(value, (list, Lazy)):  # Lazy: each row made as it is written
            for i, item in enumerate(value):
                yield ("[" if i == 0 else ", ") + _dumps(item)
            yield "]" if value else "[]"
        else:
            yield _dumps(value)
    yield "}" if result else "{}"


def _dumps(value: Any) -> str:
    return json.dumps(_plain(value), default=str, allow_nan=False)


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
        from rich.progress import Progress

        self.finish()
        self._bar = Progress(*self._columns(), console=stderr, transient=True)
        self._bar.start()
        self._task = self._bar.add_task(one_line(description), total=total)

    def _columns(self) -> tuple[Any, ...]:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

        return (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())

    def describe(self, description: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=one_line(description))

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


class DatasetProgress(RichProgress):
    """A dataset run's bar: the files done (its description), the bytes of the inputs read, the time left. The test
    hook pauses in the units (their own progress), not here."""

    def __init__(self, quiet: bool) -> None:
        super().__init__(quiet)
        self._test = Progress()

    def _columns(self) -> tuple[Any, ...]:
        from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn

        # at most about 70 columns: "gae: 10000/10000 files", the bar, "12.3/45.6 GiB", "0:00:12"
        bar = BarColumn(bar_width=20)
        return (TextColumn("{task.description}"), bar, DownloadColumn(binary_units=True), TimeRemainingColumn())


def grid(
    width: int, title: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]], right: tuple[str, ...] = ()
) -> list[str]:
    """A table as lines of text, every table alike: the title, the header, a rule, a row per item; columns two
    spaces apart, ``right`` ones right-justified. The first column holds names and gives way first: a name
    longer than the ``width`` the other columns leave stands on a line of its own, its cells on the next."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([cell_len(h), *(cell_len(r[i]) for r in cells)]) for i, h in enumerate(columns)]
    rest = sum(widths[1:]) + 2 * (len(columns) - 1)
    widths[0] = min(widths[0], max(cell_len(columns[0]), width - rest))

    def line(row: list[str] | tuple[str, ...]) -> str:
        pads = (" " * (w - cell_len(c)) for c, w in zip(row, widths, strict=True))
        parts = (p + c if h in right else c + p for c, p, h in zip(row, pads, columns, strict=True))
        return "  ".join(parts).rstrip()

    lines = [title, line(columns), "─" * min(width, sum(widths) + 2 * (len(columns) - 1))]
    for row in cells:
        if cell_len(row[0]) > widths[0]:
            lines.append(row[0])
            row = ["", *row[1:]]
        lines.append(line(row))
    return lines


def print_grid(console: Console, title: str, columns: tuple[str, ...], rows: list, right: tuple[str, ...] = ()) -> None:
    """``grid`` at the console's width, printed."""
    for line in grid(console.width, title, columns, rows, right):
        console.print(Text(line))


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
