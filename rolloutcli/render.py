"""Render pipeline results (plain dicts) for people: rich tables and a terminal histogram on stdout."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


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


def render_inspect(console: Console, report: dict[str, Any]) -> None:
    """Print an ``inspect`` report: header, fields, episodes and histogram, statistics, warnings."""
    fmt = report["format"]
    console.print(
        f"[bold]{report['file']}[/bold]  {_size(report['size_bytes'])}  T={report['T']} steps x "
        f"N={report['N']} envs  format={fmt['name'] or 'unlabelled'} v{fmt['version'] or '-'}"
    )
    fields = Table(title="fields", title_justify="left")
    for column in ("dataset", "role", "shape", "dtype", "chunks", "compression", "size"):
        fields.add_column(column, no_wrap=column in ("dataset", "shape"))
    for spec in report["fields"]:
        fields.add_row(
            spec["name"],
            spec["role"],
            str(tuple(spec["shape"])),
            spec["dtype"],
            str(tuple(spec["chunks"])) if spec["chunks"] else "contiguous",
            spec["compression"] or "-",
            _size(spec["nbytes"]),
        )
    console.print(fields)

    episodes = report["episodes"]
    lengths = episodes["lengths"]
    console.print(
        f"[bold]episodes[/bold]: {episodes['completed']} completed ({episodes['terminations']} terminations, "
        f"{episodes['time_outs']} time-outs), {episodes['started_before_recording']} started before the "
        f"recording, {episodes['unfinished']} unfinished at the end"
    )
    if lengths["count"]:
        console.print(
            f"  length of {lengths['count']} fully recorded episodes: min {lengths['min']}  "
            f"mean {lengths['mean']:.1f}  p5 {lengths['p5']}  p25 {lengths['p25']}  "
            f"median {lengths['p50']}  p75 {lengths['p75']}  p95 {lengths['p95']}  max {lengths['max']}"
        )
    _histogram(console, episodes["histogram"])
    per_env = episodes["per_env"]
    console.print(f"  episodes per env: min {per_env['min']}  mean {per_env['mean']:.2f}  max {per_env['max']}")

    stats = Table(title="statistics", title_justify="left")
    for column in ("field", "mean", "std", "min", "max", "non-finite"):
        stats.add_column(column, justify="right")
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
    for warning in report["warnings"]:
        console.print(f"[yellow]warning[/yellow]: {warning}", markup=True)


def _histogram(console: Console, bins: list[dict[str, int]], width: int = 40) -> None:
    if not bins:
        return
    peak = max(b["count"] for b in bins) or 1
    for b in bins:
        label = f"{b['from']}-{b['to']}" if b["from"] != b["to"] else f"{b['from']}"
        bar = "█" * max(1 if b["count"] else 0, round(width * b["count"] / peak))
        console.print(f"  {label:>11} | {bar} {b['count']}", markup=False)


def _stats_line(name: str, moments: dict[str, Any]) -> str:
    return (
        f"{name}: mean {_num(moments['mean'])}  std {_num(moments['std'])}  min {_num(moments['min'])}  "
        f"max {_num(moments['max'])}  non-finite {moments['nonfinite']}"
    )


def render_gae(console: Console, summary: dict[str, Any]) -> None:
    """Print a ``gae`` summary: where it went, what was applied, statistics, time."""
    where = "in place" if summary["in_place"] else f"-> {summary['output']}"
    console.print(
        f"gae {summary['input']} {where}  (T={summary['T']}, N={summary['N']}, {summary['blocks']} env block(s))"
    )
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
    console.print(f"done in {summary['seconds']:.3f} s")


def render_split(console: Console, summary: dict[str, Any]) -> None:
    """Print a ``split`` (or ``split --unpad``) summary."""
    if "padded_length" not in summary:
        console.print(
            f"unpad {summary['input']} -> {summary['output']}: {summary['trajectories']} trajectories "
            f"back to T={summary['T']} x N={summary['N']} ({len(summary['fields'])} fields) in "
            f"{summary['seconds']:.3f} s"
        )
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
        f"({summary['padding_overhead']:.2f}x)  {len(summary['fields'])} fields, "
        f"{summary['blocks']} env block(s), {summary['seconds']:.3f} s"
    )
