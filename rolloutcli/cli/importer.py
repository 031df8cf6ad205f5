"""The ``rolloutcli import`` command: bring a D4RL, Minari, robomimic / Isaac Lab or ikostrikov recording into the
rollout format (see ``pipeline/importer.py``). Registered on the app by ``cli/app.py``."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from rolloutcli.cli.common import Common, FileOutputOpt, Timeouts, need_output, with_common

EXAMPLE = "rolloutcli import d4rl_hopper.hdf5 -o hopper.h5 --max-memory 256M"


class Layout(str, enum.Enum):
    auto = "auto"
    d4rl = "d4rl"
    minari = "minari"
    robomimic = "robomimic"
    ikostrikov = "ikostrikov"


def render_import(console: Console, summary: dict[str, Any]) -> None:
    """Print an ``import`` summary."""
    console.print(f"import {summary['input']} ({summary['layout']}) -> {summary['output']}")
    console.print(
        f"  {summary['episodes']} episodes, T={summary['T']} steps x N={summary['N']} envs, "
        f"{len(summary['fields'])} fields"
    )
    if summary.get("timeouts_rule"):
        console.print(f"time-out rule: {summary['timeouts_rule']} (written as timeouts_rule)")
    for warning in summary["warnings"]:
        console.print(f"warning: {warning}")
    console.print(f"done in {summary['seconds']:.2f} s")


@with_common(overwrite=True)
def import_command(
    source: Annotated[
        Path, typer.Argument(metavar="SRC", help="Recording: an HDF5 file, a torch.save file or a Minari folder.")
    ],
    output: FileOutputOpt = None,
    layout: Annotated[Layout, typer.Option("--from", help="The source's layout (auto: recognise it).")] = Layout.auto,
    timeouts_rule: Annotated[
        Timeouts | None,
        typer.Option(
            "--timeouts-rule",
            help="The trainer's time-out rule, written for gae to apply (default: none written; gae then uses rsl).",
            show_default=False,
        ),
    ] = None,
    *,
    common: Common,
) -> None:
    """Write a recording of another layout (D4RL, Minari, robomimic, ikostrikov) as a rollout file."""
    from rolloutcli.pipeline.importer import run_import

    output = need_output(output, "import", "an output path (-o OUT.h5)")
    rule = None if timeouts_rule is None else timeouts_rule.value
    common.write(render_import, output, run_import, source, output, layout.value, timeouts_rule=rule)
