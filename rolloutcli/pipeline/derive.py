"""The derive job: a copy of a rollout file plus datasets computed per env block (``gae``; any per-step command).

A command gives a function that, from the open and validated input, returns a :class:`Derived`: the fields
it reads per block (which size the blocks), its share of ``--max-memory``, and three hooks: ``prepare`` (make
room in the copy), ``block`` (compute one env block and write it), ``finish`` (later passes, attributes; it
returns the summary). The job copies the input's bytes to a temporary beside the output, runs the hooks on the
copy, refuses to publish when the input changed meanwhile, and publishes atomically (or replaces the input).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutcli.errors import EXIT_IO, EXIT_USAGE, RolloutError
from rolloutcli.hdf5.atomic import atomic_file, check_output_path
from rolloutcli.hdf5.filecopy import OpenCopy, copy_file_bytes
from rolloutcli.hdf5.limits import check_regular_file
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.safety import HDF5_ERRORS, translate_write_error
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import Progress

Blocks = list[tuple[int, int]]


@dataclass(frozen=True)
class Derived:
    """What a derive job adds to the copy (see the module docstring)."""

    label: str
    inputs: list[str]
    share: int
    prepare: Callable[[OpenCopy], None]
    block: Callable[[OpenCopy, int, int], None]
    finish: Callable[[OpenCopy, Blocks], dict[str, Any]]


def run_derive(
    src: Path,
    dst: Path | None,
    make: Callable[[RolloutReader], Derived],
    run: RunOptions,
    *,
    name: str,
    overwrite: bool = False,
    in_place: bool = False,
    progress: Progress,
) -> dict[str, Any]:
    """Write ``dst`` (or replace ``src`` when ``in_place``) = ``src`` + what ``make``'s job derives; ``name``
    (the command) appears in its messages."""
    started, src = time.perf_counter(), Path(src)
    dst = _destination(src, dst, in_place, name)
    check_output_path(dst, [src], overwrite=overwrite or in_place, replace_input=in_place)
    check_regular_file(src)  # before the copy: a FIFO or device would never end
    if in_place and not os.access(src, os.W_OK):
        raise RolloutError(
            f"{src}: the input is write-protected; refusing to replace it with --in-place. "
            "Make it writable (chmod u+w) or write a new file with -o OUT.h5.",
            exit_code=EXIT_IO,
        )
    identity = _identity(src)
    with atomic_file(dst, inputs=[src], overwrite=overwrite, replace_input=in_place) as tmp:
        try:
            summary = _derive(src, tmp, make, run, progress)
        except HDF5_ERRORS as exc:
            raise translate_write_error(dst, exc, src) from exc
        if _identity(src) != identity:
            raise RolloutError(
                f"{src}: the input changed while {name} ran (its size, modification time or inode); nothing was "
                f"written. Run {name} again once the file is complete.",
                exit_code=EXIT_IO,
            )
    summary.update({"input": str(src), "output": str(dst), "in_place": in_place})
    summary["seconds"] = time.perf_counter() - started
    return summary


def _destination(src: Path, dst: Path | None, in_place: bool, name: str) -> Path:
    if in_place:
        return Path(os.path.realpath(src))  # replace the file itself, not a symlink to it
    if dst is None:
        raise RolloutError(
            f"{name}: expected an output path (-o OUT.h5) or --in-place, found neither.", exit_code=EXIT_USAGE
        )
    return Path(dst)


def _identity(path: Path) -> tuple[int, int, int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def _derive(
    src: Path, tmp: Path, make: Callable[[RolloutReader], Derived], run: RunOptions, progress: Progress
) -> dict[str, Any]:
    """Validate ``src`` (``make`` checks what its job needs), copy it to ``tmp``, run the job on the copy."""
    with RolloutReader(src, run.safety, budget=run.max_memory) as reader:
        job = make(reader)
        progress.start("copy", max(1, src.stat().st_size))
        copy_file_bytes(src, tmp, progress.advance)
        with OpenCopy(tmp) as out:
            job.prepare(out)
            blocks = reader.blocks(job.inputs, budget=max(run.max_memory // job.share, 1))
            progress.start(job.label, len(blocks))
            for start, stop in blocks:
                job.block(out, start, stop)
                progress.advance()
            summary = job.finish(out, blocks)
            progress.finish()
    return {"T": reader.T, "N": reader.N, "blocks": len(blocks), **summary}
