"""The ``rolloutcli inspect`` command and its human reports (see ``pipeline/inspect.py``, ``inspect_dataset.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from rolloutcli.cli.common import Common, flag, with_common
from rolloutcli.cli.dataset import ReadFilesArg, resolve_inputs
from rolloutcli.cli.render import _num, _shape, _size, command_lines, print_grid
from rolloutcli.cli.stats import with_per_dim
from rolloutcli.errors import RolloutError

EXAMPLE = "rolloutcli inspect sample_data/cartpole_gru.h5 --json"
FOLDER_MARKERS = ("manifest.json", "data/main_data.hdf5")  # a shard folder, a Minari dataset: one report each


@with_common()
def inspect(
    files: ReadFilesArg,
    strict: flag("--strict", text="Exit 1 when the data has problems.") = False,
    per_dim: flag("--per-dim", text="Per-dimension mean/std/min/max of observations and actions.") = False,
    *,
    common: Common,
) -> None:
    """Show what a rollout file holds: fields, episodes, reward/value statistics, warnings."""
    from rolloutcli.pipeline.inspect import run_inspect

    folder = Path(files[0])
    if len(files) == 1 and any((folder / marker).is_file() for marker in FOLDER_MARKERS):  # not a dataset
        dataset, file = None, Path(files[0])
    else:
        dataset = resolve_inputs(files)
        file = dataset.files[0] if not dataset.many else dataset.root
    if dataset is not None and dataset.many:
        from rolloutcli.pipeline.inspect_dataset import run_inspect_dataset

        report, render = (
            run_inspect_dataset(dataset, common.run(), common.progress(), per_dim=per_dim),
            render_inspect_dataset,
        )
    else:
        report, render = run_inspect(file, common.run(), common.progress(), per_dim=per_dim), render_inspect
    common.emit(report, with_per_dim(render) if per_dim else render)
    if strict and report["warnings"]:
        where = "run without -q to see them" if common.quiet and not common.json_output else "listed above"
        raise RolloutError(f"{file}: --strict: {len(report['warnings'])} warnings ({where}).")


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
    rows = []
    for spec in report["fields"]:
        chunks = _shape(spec["chunks"]) if spec["chunks"] else "contiguous"
        cells = (spec["name"], _shape(spec["shape"]), spec["dtype"], chunks, spec["compression"] or "-")
        rows.append((*cells, _size(spec["nbytes"])))
    print_grid(console, "fields", ("dataset", "shape", "dtype", "chunks", "filters", "size"), rows, ("size",))
    _episodes(console, report["episodes"])

    _statistics(console, "statistics", report)
    for net, layout in report["hidden_states"].items():
        console.print(f"hidden state ({net}): {layout['type']}, {layout['layers']} layer(s), size {layout['size']}")
    if report["gae"]:
        console.print("gae: " + ", ".join(f"{k}={v}" for k, v in report["gae"].items()))
    if report["timeouts"]["applied"] or any(spec["name"] == "values" for spec in report["fields"]):
        _timeouts_line(console, report["timeouts"])
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


STAT_COLUMNS = ("field", "mean", "std", "min", "max", "non-finite")


def _statistics(console: Console, title: str, report: dict[str, Any]) -> None:
    rows = []
    for name in ("rewards", "values", "last_values", "advantages", "returns"):
        moments = report.get(name)
        if moments:
            rows.append((name, *(_num(moments[k]) for k in ("mean", "std", "min", "max", "nonfinite"))))
    print_grid(console, title, STAT_COLUMNS, rows, STAT_COLUMNS[1:])


def _timeouts_line(console: Console, timeouts: dict[str, Any]) -> None:
    """The time-out rule: what an earlier gae applied, else what gae applies without --timeouts, and why (not
    printed where gae cannot run: a file without 'values', as an import, whose warning says so)."""
    why = "the file's timeouts_rule" if timeouts["from"] == "file" else "default: the file names none"
    if timeouts["applied"]:
        recorded = timeouts["recorded"] or "none"
        console.print(f"time-out rule: gae applied {timeouts['applied']} (timeouts_rule: {recorded})")
    else:
        console.print(f"time-out rule: {timeouts['gae']} ({why})")


def _attrs_and_nonfinite(console: Console, report: dict[str, Any]) -> None:
    _attr_lines(console, "root attributes", report["attrs"])
    for bad in report["nonfinite"]:
        where = f"step {bad['first_step']}" + (f", env {bad['first_env']}" if bad["first_env"] is not None else "")
        console.print(f"non-finite: {bad['dataset']}: {bad['count']} values, first at {where}")


def _attr_lines(console: Console, title: str, attrs: dict[str, Any]) -> None:
    """Attributes one per line, each cut to the console's width (--json has them whole)."""
    if attrs:
        console.print(f"{title}:")
    for key, value in attrs.items():
        line = f"  {key} = {value}"
        console.print(line if len(line) <= console.width else line[: console.width - 3] + "...")


def render_tree(console: Console, report: dict[str, Any]) -> None:
    """Print the tree of a file outside the contract, then the line that says what to do with it."""
    console.print(Text.assemble((report["file"], "bold"), f"  {report['kind']}  (not a rollout file)"))
    if report["tree"]:
        rows = []
        for entry in report["tree"]:
            dataset = "shape" in entry
            chunks = _shape(entry["chunks"]) if entry.get("chunks") else "contiguous" if dataset else ""
            rows.append(
                (
                    entry["path"],
                    _shape(entry["shape"]) if dataset else "group",
                    entry.get("dtype", ""),
                    chunks,
                    entry.get("compression") or ("-" if dataset else ""),
                )
            )
        print_grid(console, "objects", ("path", "shape", "dtype", "chunks", "filters"), rows)
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
        command = report.get("command")
        if warning == report["problem"] and command:  # the command on a line of its own, whole, to copy
            console.print(Text.assemble(("warning", "yellow"), f": {warning.removesuffix(command).rstrip()}"))
            for line in command_lines(command, console.width):
                console.print(line)
        else:
            console.print(Text.assemble(("warning", "yellow"), f": {warning}"))


def _episodes(console: Console, episodes: dict[str, Any]) -> None:
    """The episodes: counts, lengths, the length histogram (a run of empty bins on one line), episodes per env."""
    lengths = episodes["lengths"]
    console.print(
        Text.assemble(
            ("episodes", "bold"),
            f": {episodes['completed']} completed ({episodes['terminations']} terminations, "
            f"{episodes['time_outs']} time-outs)",
        )
    )
    console.print(
        f"  {episodes['started_before_recording']} started before the recording, "
        f"{episodes['unfinished']} unfinished at the end"
    )
    if episodes.get("autoreset_steps"):
        console.print(f"  {episodes['autoreset_steps']} autoreset steps (no transition: not counted as episodes)")
    if lengths["count"]:
        console.print(
            f"  length of {lengths['count']} fully recorded episodes: min {lengths['min']}  "
            f"mean {lengths['mean']:.1f}  max {lengths['max']}"
        )
        console.print(
            f"  percentiles: p5 {lengths['p5']}  p25 {lengths['p25']}  median {lengths['p50']}  "
            f"p75 {lengths['p75']}  p95 {lengths['p95']}"
        )
    for line in histogram_lines(episodes["histogram"]):
        console.print(line)
    per_env = episodes["per_env"]
    console.print(f"  episodes per env: min {per_env['min']}  mean {per_env['mean']:.2f}  max {per_env['max']}")


def histogram_lines(bins: list[dict[str, int]]) -> list[str]:
    """A line per bin, bars scaled to 40 cells; consecutive empty bins share one line (their whole range)."""
    peak = max((b["count"] for b in bins), default=0) or 1
    merged: list[dict[str, int]] = []
    for b in bins:
        if merged and not b["count"] and not merged[-1]["count"]:
            merged[-1] = {**merged[-1], "to": b["to"]}
        else:
            merged.append(b)
    lines = []
    for b in merged:
        label = f"{b['from']}-{b['to']}" if b["from"] != b["to"] else f"{b['from']}"
        bar = "█" * max(1 if b["count"] else 0, round(40 * b["count"] / peak))
        lines.append(f"  {label:>11} | {bar + ' ' if bar else ''}{b['count']}")
    return lines


def render_inspect_dataset(console: Any, report: dict[str, Any]) -> None:
    """A dataset ``inspect``: a row per file, the totals, the episodes and statistics over all files."""
    totals = report["totals"]
    console.print(
        f"{report['dataset']}  {totals['files']} files  {_size(totals['bytes'])}  {totals['steps']} steps  "
        f"{totals['envs']} envs  {totals['episodes']} episodes"
    )
    rows = []
    for row in report["files"]:
        cells = (row["name"], row["T"], row["N"], row["steps"], row["episodes"], _size(row["size_bytes"]))
        rows.append((*cells, row["warnings"]))
    columns = ("file", "T", "N", "steps", "episodes", "size", "warnings")
    print_grid(console, "files", columns, rows, columns[1:])
    _episodes(console, report["episodes"])
    _statistics(console, "statistics over all files", report)
    for warning in report["warnings"]:
        console.print(f"warning: {warning}")
