"""Human summaries of the commands of issue 16 (``nstep``; rich, to stdout)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from rolloutcli.render import _stats_line


def render_nstep(console: Console, summary: dict[str, Any]) -> None:
    """Print an ``nstep`` summary: where it went, the windows by how they end, the returns' statistics."""
    where = "in place" if summary["in_place"] else f"-> {summary['output']}"
    console.print(
        f"nstep {summary['input']} {where}  (T={summary['T']}, N={summary['N']}, {summary['blocks']} env block(s))"
    )
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
