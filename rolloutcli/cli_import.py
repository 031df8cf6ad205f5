"""The ``rolloutcli import`` command: bring a D4RL, Minari, robomimic / Isaac Lab or ikostrikov recording into the
rollout format (see ``pipeline/importer.py``). Registered on the app by ``cli.py``."""

from __future__ import annotations

import enum
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
    run_options,
)
from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.render import RichProgress


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


def import_command(
    source: Annotated[
        Path, typer.Argument(metavar="SRC", help="Recording: an HDF5 file, a torch.save file or a Minari folder.")
    ],
    output: FileOutputOpt = None,
    layout: Annotated[Layout, typer.Option("--from", help="The source's layout (auto: recognise it).")] = Layout.auto,
    overwrite: OverwriteOpt = False,
    json_output: JsonOpt = False,
    max_memory: MemoryOpt = "1G",
    allow_external: ExternalOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write a recording of another layout (D4RL, Minari, robomimic, ikostrikov) as a rollout file."""
    from rolloutcli.pipeline.importer import run_import

    if output is None:
        raise RolloutError("import: expected an output path (-o OUT.h5), found none.", exit_code=EXIT_USAGE)
    run = run_options(max_memory, allow_external)
    summary = run_import(source, output, layout.value, run, overwrite=overwrite, progress=RichProgress(quiet))
    emit(summary, render_import, json_output, quiet, output)
