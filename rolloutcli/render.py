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
from rich.text import Text

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
    """JSON-ready data: numpy scalars and arrays as Python values, non-finite floats as None."""
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # numpy scalar or array, torch tensor
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
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


def render_inspect(console: Console, report: dict[str, Any]) -> None:
    """Print an ``inspect`` report: header, fields, episodes and histogram, statistics, warnings."""
    if not report["contract"]:
        render_tree(console, report)
        return
    fmt = report["format"]
    console.print(
        Text.assemble(
            (report["file"], "bold"),
            f"  {_size(report['size_bytes'])}  T={report['T']} steps x N={report['N']} envs  "
            f"format={fmt['name'] or 'unlabelled'} v{fmt['version'] or '-'}",
        )
    )
    fields = _table(
        "fields",
        ("dataset", "shape", "dtype", "chunks", "filters", "size"),
        ("size",),
        ("dataset", "chunks", "filters"),
    )
    for spec in report["fields"]:
        chunks = _shape(spec["chunks"]) if spec["chunks"] else "contiguous"
        row = (spec["name"], _shape(spec["shape"]), spec["dtype"], chunks, spec["compression"] or "-")
        fields.add_row(*(Text(str(cell)) for cell in row), _size(spec["nbytes"]))
    console.print(fields)
    _episodes(console, report["episodes"])

    stats = _table(
        "statistics",
        ("field", "mean", "std", "min", "max", "non-finite"),
        right=("mean", "std", "min", "max", "non-finite"),
    )
    for name in ("rewards", "values", "last_values", "advantages", "returns"):
        moments = report.get(name)
        if moments:
            stats.add_row(name, *(_num(moments[k]) for k in ("mean", "std", "min", "max", "nonfinite")))
    console.print(stats)

    for net, layout in report["hidden_states"].items():
        console.print(f"hidden state ({net}): {layout['type']}, {layout['layers']} layer(s), size {layout['size']}")
    if report["gae"]:
        console.print("gae: " + ", ".join(f"{k}={v}" for k, v in report["gae"].items()))
    split = report["split"]
    console.print(
        f"split: {split['trajectories']} trajectories, padded to T: {_size(split['padded_bytes'])} "
        f"from {_size(split['input_bytes'])} ({split['blowup']:.2f}x)"
    )
    if report["extras"]:
        console.print("extra datasets (carried along): " + ", ".join(report["extras"]))
    _attrs_and_nonfinite(console, report)
    for warning in report["warnings"]:
        console.print(Text.assemble(("warning", "yellow"), f": {warning}"))


def _attrs_and_nonfinite(console: Console, report: dict[str, Any]) -> None:
    _attr_lines(console, "root attributes", report["attrs"])
    for bad in report["nonfinite"]:
        where = f"step {bad['first_step']}" + (f", env {bad['first_env']}" if bad["first_env"] is not None else "")
        console.print(f"non-finite: {bad['dataset']}: {bad['count']} values, first at {where}")


def _attr_lines(console: Console, title: str, attrs: dict[str, Any], width: int = 80) -> None:
    """Attributes one per line, each cut to ``width`` columns (--json has them whole)."""
    if attrs:
        console.print(f"{title}:")
    for key, value in attrs.items():
        line = f"  {key} = {value}"
        console.print(line if len(line) <= width else line[: width - 3] + "...")


def render_tree(console: Console, report: dict[str, Any]) -> None:
    """Print the tree of a file outside the contract, then the line that says what to do with it."""
    console.print(Text.assemble((report["file"], "bold"), f"  {report['kind']}  (not a rollout file)"))
    if report["tree"]:
        tree = _table("objects", ("path", "shape", "dtype", "chunks", "filters"), fold=("path", "chunks", "filters"))
        for entry in report["tree"]:
            dataset = "shape" in entry
            chunks = _shape(entry["chunks"]) if entry.get("chunks") else "contiguous" if dataset else ""
            cells = (
                entry["path"],
                _shape(entry["shape"]) if dataset else "group",
                entry.get("dtype", ""),
                chunks,
                entry.get("compression") or ("-" if dataset else ""),
            )
            tree.add_row(*(Text(c) for c in cells))
        console.print(tree)
        if report["objects"] > len(report["tree"]):
            console.print(f"... {report['objects'] - len(report['tree'])} more objects (--json lists the first ones)")
        for entry in report["tree"]:
            _attr_lines(console, f"attributes of {entry['path']}", entry["attrs"])
    else:
        _attr_lines(console, "attributes", report["attrs"])
    for bad in report["nonfinite"]:
        first = f"row {bad['first_step']}" + (f", column {bad['first_env']}" if bad["first_env"] is not None else "")
        console.print(f"non-finite: {bad['dataset']}: {bad['count']} values, first at {first}")
    for warning in report["warnings"]:
        console.print(Text.assemble(("warning", "yellow"), f": {warning}"))


def _episodes(console: Console, episodes: dict[str, Any]) -> None:
    lengths = episodes["lengths"]
    console.print(
        Text.assemble(
            ("episodes", "bold"),
            f": {episodes['completed']} completed ({episodes['terminations']} terminations, "
            f"{episodes['time_outs']} time-outs), {episodes['started_before_recording']} started before the "
            f"recording, {episodes['unfinished']} unfinished at the end",
        )
    )
    if episodes.get("autoreset_steps"):
        console.print(f"  {episodes['autoreset_steps']} autoreset steps (no transition: not counted as episodes)")
    if lengths["count"]:
        console.print(
            f"  length of {lengths['count']} fully recorded episodes: min {lengths['min']}  "
            f"mean {lengths['mean']:.1f}  p5 {lengths['p5']}  p25 {lengths['p25']}  "
            f"median {lengths['p50']}  p75 {lengths['p75']}  p95 {lengths['p95']}  max {lengths['max']}"
        )
    bins = episodes["histogram"]
    peak = max((b["count"] for b in bins), default=0) or 1
    for b in bins:
        label = f"{b['from']}-{b['to']}" if b["from"] != b["to"] else f"{b['from']}"
        bar = "█" * max(1 if b["count"] else 0, round(40 * b["count"] / peak))
        console.print(f"  {label:>11} | {bar} {b['count']}")
    per_env = episodes["per_env"]
    console.print(f"  episodes per env: min {per_env['min']}  mean {per_env['mean']:.2f}  max {per_env['max']}")


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


def render_gae(console: Console, summary: dict[str, Any]) -> None:
    """Print a ``gae`` summary: where it went, what was applied, statistics, time."""
    derived_header(console, "gae", summary)
    bootstrap = (
        f"{summary['bootstrapped_rewards']} rewards bootstrapped on time-outs"
        if summary["bootstrapped_by_this_run"]
        else "rewards were already bootstrapped"
        if summary["timeouts_bootstrapped"]
        else "no time-out bootstrapping"
    )
    console.print(
        f"gamma {summary['gamma']}  lambda {summary['lambda']}  normalized {summary['normalized']}  "
        f"last values: {summary['last_values']}  {bootstrap}"
    )
    console.print(_stats_line("advantages", summary["advantages"]))
    console.print(_stats_line("returns", summary["returns"]))
    console.print(f"done in {summary['seconds']:.2f} s")


def render_split(console: Console, summary: dict[str, Any]) -> None:
    """Print a ``split`` (or ``split --unpad``) summary."""
    if "padded_length" not in summary:
        console.print(
            f"unpad {summary['input']} -> {summary['output']}: {summary['trajectories']} trajectories "
            f"back to T={summary['T']} x N={summary['N']} ({len(summary['fields'])} fields)"
        )
        console.print(f"done in {summary['seconds']:.2f} s")
        return
    lengths = summary["trajectory_lengths"]
    console.print(
        f"split {summary['input']} -> {summary['output']}: {summary['trajectories']} trajectories from "
        f"N={summary['N']} envs, padded to L={summary['padded_length']} ({summary['pad_to']}"
        + (f", max length {summary['max_length']}" if summary["max_length"] else "")
        + ")"
    )
    console.print(
        f"trajectory length: min {lengths['min']}  mean {_num(lengths['mean'])}  median {lengths['p50']}  "
        f"p95 {lengths['p95']}  max {lengths['max']}"
    )
    console.print(
        f"padding overhead: {_size(summary['padded_bytes'])} from {_size(summary['input_bytes'])} "
        f"({summary['padding_overhead']:.2f}x)  {len(summary['fields'])} fields, {summary['blocks']} env block(s)"
    )
    console.print(f"done in {summary['seconds']:.2f} s")


# Below this many bytes written a throughput figure says more about start-up than about writing.
_RATE_MIN_BYTES = 64 << 20


def render_batch(console: Console, summary: dict[str, Any]) -> None:
    """Print a ``batch`` summary: what was written, how rows were ordered, what was dropped, time."""
    source, steps = summary["input"], f"T={summary['T']}"
    if isinstance(source, list):  # a dataset: its file count, not a Python list; files may differ in T
        source = f"{len(source)} files ({source[0]} ...)"
        steps = steps if summary["T"] is not None else "T differs"
    console.print(f"batch {source} -> {summary['output']}  ({summary['mode']}, {steps}, N={summary['N']})")
    unit = "windows" if summary["mode"] == "history" else "rows"
    console.print(
        f"{summary['entries']} mini-batches ({summary['epochs']} epoch(s) x {summary['num_mini_batches']}) in "
        f"{summary['files']} shard file(s), {_size(summary['bytes_written'])}, "
        f"{summary['rows_per_epoch']} {unit} per epoch"
    )
    if summary["mode"] == "history":
        episodes = "straddling episode ends" if summary["across_episodes"] else "inside one episode"
        console.print(
            f"history windows of {summary['history']} steps ({', '.join(summary['groups'])}), {episodes}, no padding"
        )
    if summary["mode"] == "transitions":
        console.print(
            f"transitions: {summary['n_step']}-step returns, gamma {summary['gamma']}, time-outs: "
            f"{summary['timeouts']}; {summary['held_back']} held back (bootstrap observation unknown)"
            + (f", {summary['autoreset_steps']} autoreset steps left out" if "autoreset_steps" in summary else "")
        )
    console.print(f"order: {summary['order']} (seed {summary['seed']})")
    if summary["dropped_rows"]:
        envs = f" ({len(summary['dropped_envs'])} envs)" if summary["dropped_envs"] else ""
        console.print(f"dropped (RSL-RL parity): {summary['dropped_rows']} rows{envs}")
    gae = summary.get("gae") or {}
    if gae.get("gamma") is not None:
        mixed = " (each file's, in order: they differ)" if any(isinstance(v, list) for v in gae.values()) else ""
        console.print(
            f"gae from the source{mixed}: gamma {gae['gamma']}  lambda {gae['lambda']}  "
            f"normalized {gae['advantages_normalized']}"
        )
    how = f"streamed in {summary['blocks']} blocks" if summary["streamed"] else "in memory"
    seconds, written = summary["seconds"], summary["bytes_written"]
    rate = f", {written / seconds / 1e9:.2f} GB/s written" if written >= _RATE_MIN_BYTES and seconds > 0 else ""
    console.print(f"done in {seconds:.2f} s ({how}{rate})")
