"""The ``rolloutcli plot`` command: pictures of a rollout file (see ``pipeline/plot.py``; needs the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from rolloutcli.cli.common import Common, need_output, with_common

EXAMPLE = "rolloutcli plot sample_data/cartpole_gru.h5 -o report.png"


@with_common(overwrite="file")
def plot(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="Rollout file (.h5).")],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", metavar="REPORT", help="report.png, report.svg or report.html.")
    ] = None,
    *,
    common: Common,
) -> None:
    """Draw episode returns and lengths, distributions, actions, observation ranges, dones per env, padding."""
    from rolloutcli.pipeline.plot import run_plot

    output = need_output(output, "plot", "an output file (-o report.png)")
    common.write(_render, output, run_plot, file, output)


def _render(console: Any, summary: dict[str, Any]) -> None:
    console.print(f"plot {summary['input']} -> {summary['output']}")
    console.print(f"{len(summary['panels'])} panels, {summary['episodes']} completed episodes")
    console.print(f"done in {summary['seconds']:.2f} s")
