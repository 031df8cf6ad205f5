"""The ``rolloutcli export`` command: a dataset's whole episodes for Minari, robomimic or D4RL (see
``pipeline/export.py``). Registered on the app by ``cli/app.py``."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from rolloutcli.cli.common import (
    Common,
    SplitBy,
    SplitByOpt,
    ValidFractionOpt,
    flag,
    need_output,
    not_stdout,
    with_common,
)
from rolloutcli.cli.dataset import ReadFilesArg

EXAMPLE = "rolloutcli export runs/ --to minari -o datasets/cartpole-expert-v0"


_not_stdout = not_stdout("-o", "exports are HDF5 files or folders")


class Target(str, enum.Enum):
    minari = "minari"
    robomimic = "robomimic"
    d4rl = "d4rl"


def render_export(console: Console, summary: dict[str, Any]) -> None:
    """Print an ``export`` summary."""
    console.print(
        f"export {summary['input']} -> {summary['output']} ({summary['target']}): {summary['episodes']} episodes, "
        f"{summary['steps']} steps from {summary['files']} files"
    )
    kept, left = summary["partial_kept"], summary["partial_left_out"]
    if kept or left:
        console.print(
            f"partial episodes: {kept} kept (marked), {left} left out"
            + (" (keep them with --partial-episodes)" if left else "")
        )
    if summary["split"]:
        split = summary["split"]
        console.print(
            f"validation: {summary['valid_episodes']} episodes, {summary['valid_steps']} steps (by {split['by']}, "
            f"fraction {split['fraction']}, seed {split['seed']})"
        )
    console.print(f"done in {summary['seconds']:.2f} s")


@with_common(overwrite=True, engine=True)
def export(
    files: ReadFilesArg,
    to: Annotated[Target, typer.Option("--to", help="The target layout.")],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", metavar="OUT", callback=_not_stdout, help="Output file or folder (--to)."),
    ] = None,
    partial_episodes: flag(
        "--partial-episodes", text="Keep episodes begun before the first file or unfinished at the last (marked)."
    ) = False,
    valid_fraction: ValidFractionOpt = 0.0,
    split_by: SplitByOpt = SplitBy.episode,
    seed: Annotated[int, typer.Option("--seed", metavar="S", min=0, help="Seed of the split.")] = 0,
    *,
    common: Common,
) -> None:
    """Write the dataset's whole episodes, joined across consecutive files, for Minari, robomimic or D4RL."""
    from rolloutcli.pipeline.export import ExportOptions, run_export

    output = need_output(output, "export", "an output path (-o OUT)")
    options = ExportOptions(to.value, partial_episodes, valid_fraction, split_by.value, seed)
    common.write(render_export, output, run_export, files, output, options, engine=common.engine)
