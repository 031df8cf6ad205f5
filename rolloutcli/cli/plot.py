"""The ``rolloutcli plot`` command: pictures of a rollout file (see ``pipeline/plot.py``; needs the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from rolloutcli.cli.common import Common, need_output, with_common

EXAMPLE = "rolloutcli plot run_gae.h5 -o report.png"  # GAE_EXAMPLE's output: every panel has data


@with_common(overwrite="file")
def plot(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="Rollout file (.h5).")],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", metavar="REPORT", help="report.png, report.svg or report.html.")
    ] = None,
    *,
    common: Common,
) -> None:
    """Draw episodes (whole and cut by the recording), reward per step, distributions, actions, observations, dones."""
    from rolloutcli.pipeline.plot import run_plot

    output = need_output(output, "plot", "an output file (-o report.png)")
    common.write(_render, output, run_plot, file, output)


def _render(console: Any, summary: dict[str, Any]) -> None:
    console.print(f"plot {summary['input']} -> {summary['output']}")
    episodes = f"{summary['episodes']} whole, {summary['partial_episodes']} cut by the recording"
    console.print(f"{len(summary['panels'])} panels; episodes: {episodes}, {summary['episodes_ended']} ended")
    console.print(f"done in {summary['seconds']:.2f} s")
