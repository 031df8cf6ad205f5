"""What ``import`` checks before it reads the rows: the memory its plan holds (the episode-end flags, read
whole, and the dones/time_outs built from them) against ``--max-memory`` (exit 2), and the output's
uncompressed size against the free space of the destination's file system (exit 3). A small source may declare
huge unallocated or compressed datasets: both are refused before any work."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from typing import Any

from rolloutcli.errors import EXIT_IO, EXIT_USAGE, RolloutError
from rolloutcli.hdf5.limits import budget_text
from rolloutcli.pipeline.import_source import FLAGS

PLAN_BYTES_PER_STEP = 8  # flags compared, ends, dones, time_outs: bytes the plan holds per step (and env)


def _nbytes(info: Any) -> int:
    return math.prod(info.shape) * info.dtype.itemsize


def _rows(info: Any) -> int:
    return info.shape[0] if info.shape else 0


def plan_bytes(layout: str, listing: dict[str, Any]) -> int:
    """The bytes planning ``layout`` holds at once (before the row copies, which are blocked by the budget)."""
    if layout == "d4rl":
        flags = sum(_nbytes(listing[n]) for n in FLAGS["d4rl"] if n in listing)
        return flags + PLAN_BYTES_PER_STEP * _rows(listing["rewards"])
    if layout == "ikostrikov":
        shape = listing["rewards"].shape
        flags = sum(_nbytes(listing[n]) for n in FLAGS["ikostrikov"] if n in listing)
        return flags + PLAN_BYTES_PER_STEP * math.prod(shape[:2])
    episode = re.compile(r"^(episode_\d+|data/demo_\d+)/(rewards|actions)$")
    steps = sum(_rows(info) for name, info in listing.items() if episode.match(name))
    flag = re.compile(r"^(episode_\d+/(terminations|truncations)|data/demo_\d+/dones)$")
    largest = max((_nbytes(info) for name, info in listing.items() if flag.match(name)), default=0)
    return largest + PLAN_BYTES_PER_STEP * steps


def check_plan_memory(path: object, layout: str, listing: dict[str, Any], max_memory: int) -> None:
    """Refuse (exit 2, naming the ``--max-memory`` that fits) a source whose plan would not fit."""
    need = plan_bytes(layout, listing)
    if need > max_memory:
        raise RolloutError(
            f"{path}: the episode-end flags of its {layout} layout need {budget_text(need)} of memory, more than "
            f"--max-memory {budget_text(max_memory)}; pass --max-memory {budget_text(need)} or more.",
            exit_code=EXIT_USAGE,
        )


def output_bytes(plan: Any, listing: dict[str, Any]) -> int:
    """The uncompressed size of the datasets ``plan`` writes."""
    declared = sum(math.prod(shape) * dtype.itemsize for shape, dtype in plan.datasets.values())
    computed = sum(array.nbytes for array in plan.arrays.values())
    return declared + computed + sum(_nbytes(listing[name]) for name in plan.verbatim)


def check_disk(dst: Path, plan: Any, listing: dict[str, Any]) -> None:
    """Refuse (exit 3: needed, free, where) an output the destination's file system cannot hold."""
    need = output_bytes(plan, listing)
    where = dst.resolve().parent
    free = shutil.disk_usage(where).free
    if need > free:
        raise RolloutError(
            f"{dst}: the output needs {budget_text(need)} of disk (uncompressed), {budget_text(free)} is free on the "
            f"file system holding {where}; free some space or write the output elsewhere.",
            exit_code=EXIT_IO,
        )
