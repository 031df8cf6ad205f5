"""What a command whose output can be far larger than its input (``import`` of declared or compressed data,
``split``'s padding) checks before any work: the output's uncompressed size against the free space of the
destination's file system (exit 3: needed, free, where). Memory needs no check here: every row is read and
written in blocks of ``--max-memory``, the episode-end flags too (:mod:`rolloutcli.pipeline.import_flags`)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

from rolloutcli.errors import EXIT_IO, RolloutError
from rolloutcli.hdf5.limits import budget_text
from rolloutcli.pipeline.import_flags import computed_bytes


def _nbytes(info: Any) -> int:
    return math.prod(info.shape) * info.dtype.itemsize


def output_bytes(plan: Any, listing: dict[str, Any]) -> int:
    """The uncompressed size of the datasets ``plan`` writes."""
    declared = sum(math.prod(shape) * dtype.itemsize for shape, dtype in plan.datasets.values())
    return declared + computed_bytes(plan.computed) + sum(_nbytes(listing[name]) for name in plan.verbatim)


def check_disk(dst: Path, plan: Any, listing: dict[str, Any]) -> None:
    """Refuse (exit 3) an import whose output the destination's file system cannot hold."""
    check_free_space(dst, output_bytes(plan, listing))


def check_free_space(dst: Path, need: int) -> None:
    """Refuse (exit 3: needed, free, where) ``need`` bytes of output the file system of ``dst`` cannot hold."""
    where = dst.resolve().parent
    free = shutil.disk_usage(where).free
    if need > free:
        raise RolloutError(
            f"{dst}: the output needs {budget_text(need)} of disk (uncompressed), {budget_text(free)} is free on the "
            f"file system holding {where}; free some space or write the output elsewhere.",
            exit_code=EXIT_IO,
        )
