"""Command-line pieces for datasets (several files) and engines, shared by the per-file commands and ``batch``.

``FILE...`` takes paths, directories and globs. One plain file runs the command as before; a dataset (several
paths, a directory or a glob) writes one output per input into the folder ``-o`` (``pipeline/dataset_job.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rolloutcli.cli.common import Common, RunState
from rolloutcli.errors import EXIT_USAGE, RolloutError

if TYPE_CHECKING:
    from rolloutcli.hdf5.limits import SafetyOptions

FilesArg = Annotated[
    list[str],
    typer.Argument(metavar="FILE", help="Rollout files, directories or globs (a dataset: -o names a folder)."),
]
ReadFilesArg = Annotated[  # for the commands that write no file per input (no -o)
    list[str],
    typer.Argument(metavar="FILE", help="Rollout files, directories or globs (several: a dataset)."),
]


def resolve_inputs(files: list[str]) -> Any:
    """The :class:`~rolloutcli.dataset.Dataset` the arguments name."""
    from rolloutcli.dataset import resolve

    return resolve(files)


def per_file(
    command: str,
    files: list[str],
    output: Path | None,
    options: dict[str, Any],
    make_unit: Callable[[Path, Path], Any],
    engine: Any,
    *,
    overwrite: bool,
    resume: bool,
    single: Callable[[Path], dict[str, Any]],
    safety: SafetyOptions | None = None,
    rollouts: bool = True,
    progress: Any = None,
    rows: bool = True,
) -> dict[str, Any]:
    """Run ``single(file)`` for one plain file, else the dataset job (``-o`` a folder; ``safety``: the
    ``SafetyOptions`` its files are opened with; ``rollouts`` False: the inputs are split files; ``progress``: the
    dataset's bar; ``rows``: keep a row per file, for ``--json``)."""
    from rolloutcli.pipeline.dataset_job import partial_folder, run_dataset
    from rolloutcli.pipeline.engine import prestart, unit_modules

    dataset = resolve_inputs(files)
    if not dataset.many:
        if resume:
            raise RolloutError(f"--resume: expected a dataset (several files), found {files[0]}.", exit_code=EXIT_USAGE)
        return single(dataset.files[0])
    if output is None:
        raise RolloutError(
            f"{command}: expected an output folder (-o FOLDER) for a dataset, found none.", exit_code=EXIT_USAGE
        )
    prestart(engine, ["rolloutcli.pipeline.dataset_job", *unit_modules([make_unit(dataset.files[0], output)])])
    try:
        return run_dataset(
            dataset,
            output,
            command,
            options,
            make_unit,
            engine,
            overwrite=overwrite,
            resume=resume,
            safety=safety,
            rollouts=rollouts,
            progress=progress,
            rows=rows,
        )
    except BaseException:  # a signal's message then names the partial folder the run kept, if it kept one
        kept = partial_folder(output)
        RunState.kept = str(kept) if kept.is_dir() else None
        raise


def render_dataset(render: Callable[[Any, dict[str, Any]], None]) -> Callable[[Any, dict[str, Any]], None]:
    """The summary of a dataset run: what it wrote, then the command's own summary (``render``) over the files it
    ran (all of them, unless --resume kept some)."""

    def draw(console: Any, summary: dict[str, Any]) -> None:
        reused = f" ({summary['reused']} kept from the earlier run)" if summary.get("reused") else ""
        console.print(f"Wrote {summary['files']} files{reused} and dataset.json to {summary['output']}")
        if summary.get("ran"):
            render(console, {**summary["total"], "seconds": summary["seconds"]})

    return draw


def derive_command(
    command: str,
    files: list[str],
    output: Path | None,
    record: dict[str, Any],
    unit: tuple[Callable[..., dict[str, Any]], tuple[Any, ...]],
    render: Callable[[Any, dict[str, Any]], None],
    common: Common,
) -> None:
    """A per-file command (gae, nstep, returns): ``fn(src, dst, *args, ...)`` with ``unit = (fn, args)`` on one
    file (``-o OUT.h5`` or ``--in-place``), or on every file of a dataset into the folder ``-o``."""
    fn, args = unit
    in_place, overwrite = common.in_place, common.overwrite
    if in_place and output is not None:
        raise RolloutError(f"{command}: expected either -o OUT.h5 or --in-place, found both.", exit_code=EXIT_USAGE)
    if in_place and resolve_inputs(files).many:
        raise RolloutError("--in-place: expected one file, found a dataset; use -o FOLDER.", exit_code=EXIT_USAGE)

    def single(file: Path) -> dict[str, Any]:
        summary = fn(file, output, *args, overwrite=overwrite, in_place=in_place, progress=common.progress())
        common.emit(summary, render, file if in_place else output)
        return summary

    summary = per_file(
        command,
        files,
        output,
        record,
        lambda src, out: (fn, (src, out, *args)),
        common.engine,
        overwrite=overwrite,
        resume=common.resume,
        single=single,
        safety=common.run().safety,
        progress=common.dataset_progress(),
        rows=common.json_output,  # a row per file only where it is printed
    )
    if "reused" in summary:
        common.emit(summary, render_dataset(render), output)
