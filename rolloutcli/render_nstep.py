"""Human summaries of the commands of issue 16 (``nstep``; rich, to stdout)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from rolloutcli.render import _num, _stats_line, derived_header


def render_nstep(console: Console, summary: dict[str, Any]) -> None:
    """Print an ``nstep`` summary: where it went, the windows by how they end, the returns' statistics."""
    derived_header(console, "nstep", summary)
    windows = summary["windows"]
    console.print(
        f"n {summary['n']}  gamma {summary['gamma']}  time-outs: {summary['timeouts']}  rewards: {summary['rewards']}"
    )
    console.print(
        f"windows ending on a termination {windows['terminated']}, on a time-out (final observation) "
        f"{windows['final_observation']}, past the rollout's end {windows['rollout_end']}"
    )
    console.print(_stats_line("nstep_returns", summary["returns"]))
    console.print(f"done in {summary['seconds']:.2f} s")


def render_per_dim(console: Console, per_dim: dict[str, Any]) -> None:
    """One table per observation group / actions: a row per dimension (mean, std, min, max, non-finite)."""
    for label, stats in per_dim.items():
        table = Table(title=f"{label} {stats['shape']} per dimension", title_justify="left")
        for column in ("dim", "mean", "std", "min", "max", "non-finite"):
            table.add_column(column, justify="right")
        for d, row in enumerate(zip(stats["mean"], stats["std"], stats["min"], stats["max"], strict=True)):
            table.add_row(str(d), *(_num(v) for v in row), str(stats["nonfinite"][d]))
        console.print(table)
        if stats["nonfinite_total"]:
            console.print(f"{label}: {stats['nonfinite_total']} non-finite values counted, not averaged in")
