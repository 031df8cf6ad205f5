"""The ``rolloutcli import`` command: bring a D4RL, Minari, robomimic / Isaac Lab or ikostrikov recording into the
rollout format (see ``pipeline/importer.py``). Registered on the app by ``cli.py``."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from rolloutcli.cli_common import (
    Common,
    FileOutputOpt,
    OverwriteOpt,
    with_common,
)
from rolloutcli.errors import EXIT_USAGE, RolloutError


class Layout(str, enum.Enum):
    auto = "auto"
    d4rl = "d4rl"
    minari = "minari"
    robomimic = "robomimic"
    ikostrikov = "ikostrikov"


def render_import(console: Console, summary: dict[str, Any]) -> None:
    """Print an ``import`` summary."""
    console.print(
        f"import {summary['input']} ({summary['layout']}) -> {summary['output']}: {summary['episodes']} episodes, "
        f"T={summary['T']} steps x N={summary['N']} envs, {len(summary['fields'])} fields"
    )
    console.print(f"done in {summary['seconds']:.2f} s")


@with_common()
def import_command(
    source: Annotated[
        Path, typer.Argument(metavar="SRC", help="Recording: an HDF5 file, a torch.save file or a Minari folder.")
    ],
    output: FileOutputOpt = None,
    layout: Annotated[Layout, typer.Option("--from", help="The source's layout (auto: recognise it).")] = Layout.auto,
    overwrite: OverwriteOpt = False,
    *,
    common: Common,
) -> None:
    """Write a recording of another layout (D4RL, Minari, robomimic, ikostrikov) as a rollout file."""
    from rolloutcli.pipeline.importer import run_import

    if output is None:
        raise RolloutError("import: expected an output path (-o OUT.h5), found none.", exit_code=EXIT_USAGE)
    summary = run_import(source, output, layout.value, common.run(), overwrite=overwrite, progress=common.progress())
    common.emit(summary, render_import, output)
