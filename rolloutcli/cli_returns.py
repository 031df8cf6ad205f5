"""The ``rolloutcli returns`` command: Monte-Carlo returns-to-go without a critic (see ``pipeline/returns.py``).

Registered on the app by ``cli.py``; the pipeline is imported inside the command so ``--help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from rolloutcli.cli_common import (
    ExternalOpt,
    FileOutputOpt,
    JsonOpt,
    MemoryOpt,
    OverwriteOpt,
    QuietOpt,
    emit,
    flag,
    run_options,
)
from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.render import RichProgress

EXAMPLE = "rolloutcli returns sample_data/cartpole_gru.h5 -o run_returns.h5 --gamma 0.99"


def render_returns(console: Console, summary: dict[str, Any]) -> None:
    """Print a ``returns`` summary."""
    where = "in place" if summary["in_place"] else f"-> {summary['output']}"
    console.print(
        f"returns {summary['input']} {where}  (T={summary['T']}, N={summary['N']}, {summary['blocks']} env block(s))"
    )
    stats = summary["returns"]
    console.print(
        f"gamma {summary['gamma']}  rewards from {summary['rewards_from']}  {summary['episodes']} episodes, "
        f"{summary['truncated_episodes']} truncated (marked in returns_truncated)"
    )
    console.print(f"returns_to_go  mean {stats['mean']:.6g}  std {stats['std']:.6g}")
    console.print(f"done in {summary['seconds']:.2f} s")


def returns(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="Rollout file (.h5); no values needed.")],
    output: FileOutputOpt = None,
    gamma: Annotated[float, typer.Option("--gamma", help="Discount factor.", min=0.0, max=1.0)] = 0.99,
    in_place: flag("--in-place", text="Add the results to FILE itself (atomically).") = False,
    overwrite: OverwriteOpt = False,
    json_output: JsonOpt = False,
    max_memory: MemoryOpt = "1G",
    allow_external: ExternalOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Monte-Carlo discounted returns-to-go per episode, without a critic; write FILE + returns_to_go,
    returns_truncated (episodes cut by a time-out or the end of the recording)."""
    from rolloutcli.pipeline.returns import run_returns

    if in_place and output is not None:
        raise RolloutError("returns: expected either -o OUT.h5 or --in-place, found both.", exit_code=EXIT_USAGE)
    run = run_options(max_memory, allow_external)
    summary = run_returns(
        file, output, gamma, run, overwrite=overwrite, in_place=in_place, progress=RichProgress(quiet)
    )
    emit(summary, render_returns, json_output, quiet, file if in_place else output)
