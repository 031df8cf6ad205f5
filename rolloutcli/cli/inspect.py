"""The ``rolloutcli inspect`` command and its human reports (see ``pipeline/inspect.py``, ``inspect_dataset.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rolloutcli.cli.common import Common, flag, with_common
from rolloutcli.cli.dataset import ReadFilesArg, resolve_inputs
from rolloutcli.cli.render import _num, _shape, _size, _table
from rolloutcli.cli.stats import with_per_dim
from rolloutcli.errors import RolloutError

EXAMPLE = "rolloutcli inspect sample_data/cartpole_gru.h5 --json"


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

    if len(files) == 1 and (Path(files[0]) / "manifest.json").is_file():  # a shard folder, not a dataset
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


def _timeouts_line(console: Console, timeouts: dict[str, Any]) -> None:
    """The time-out rule: what an earlier gae applied, else what gae applies without --timeouts, and why."""
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


def render_inspect_dataset(console: Any, report: dict[str, Any]) -> None:
    """A dataset ``inspect``: a row per file, the totals, the episodes and statistics over all files."""
    totals = report["totals"]
    console.print(
        f"{report['dataset']}  {totals['files']} files  {_size(totals['bytes'])}  {totals['steps']} steps  "
        f"{totals['envs']} envs  {totals['episodes']} episodes"
    )
    files = Table(title="files", title_justify="left")
    for column in ("file", "T", "N", "steps", "episodes", "size", "warnings"):
        files.add_column(column, justify="left" if column == "file" else "right", no_wrap=column == "file")
    for row in report["files"]:
        cells = (row["name"], row["T"], row["N"], row["steps"], row["episodes"], _size(row["size_bytes"]))
        files.add_row(*(str(c) for c in cells), str(row["warnings"]))
    console.print(files)
    _episodes(console, report["episodes"])
    stats = Table(title="statistics over all files", title_justify="left")
    for column in ("field", "mean", "std", "min", "max", "non-finite"):
        stats.add_column(column, justify="right")
    for name in ("rewards", "values", "last_values", "advantages", "returns"):
        if report.get(name):
            stats.add_row(name, *(_num(report[name][k]) for k in ("mean", "std", "min", "max", "nonfinite")))
    console.print(stats)
    for warning in report["warnings"]:
        console.print(f"warning: {warning}")
