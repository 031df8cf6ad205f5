"""The ``rolloutcli returns`` command: Monte-Carlo returns-to-go without a critic (see ``pipeline/returns.py``).

Registered on the app by ``cli.py``; the pipeline is imported inside the command so ``--help`` stays fast.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

from rolloutcli.cli_common import Common, FileOutputOpt, with_common
from rolloutcli.cli_dataset import FilesArg, derive_command
from rolloutcli.render import derived_header

EXAMPLE = "rolloutcli returns sample_data/cartpole_gru.h5 -o run_returns.h5 --gamma 0.99"


def render_returns(console: Console, summary: dict[str, Any]) -> None:
    """Print a ``returns`` summary."""
    derived_header(console, "returns", summary)
    stats = summary["returns"]
    console.print(
        f"gamma {summary['gamma']}  rewards from {summary['rewards_from']}  {summary['episodes']} episodes, "
        f"{summary['truncated_episodes']} truncated (marked in returns_truncated)"
    )
    console.print(f"returns_to_go  mean {stats['mean']:.6g}  std {stats['std']:.6g}")
    console.print(f"done in {summary['seconds']:.2f} s")


@with_common(in_place=True, overwrite=True, engine=True, resume=True)
def returns(
    files: FilesArg,
    output: FileOutputOpt = None,
    gamma: Annotated[float, typer.Option("--gamma", help="Discount factor.", min=0.0, max=1.0)] = 0.99,
    *,
    common: Common,
) -> None:
    """Monte-Carlo discounted returns-to-go per episode, without a critic; write FILE + returns_to_go,
    returns_truncated (episodes cut by a time-out or the end of the recording)."""
    from rolloutcli.pipeline.returns import run_returns

    unit = (run_returns, (gamma, common.run()))
    derive_command("returns", files, output, {"gamma": gamma}, unit, render_returns, common)
