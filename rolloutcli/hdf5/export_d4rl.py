"""Export whole episodes as a D4RL dataset: one HDF5 file of flat per-step arrays, episodes end to end.

Layout (``N`` = the kept steps of all episodes, in episode order): ``observations`` ``[N, ...]`` (D4RL's own
layout) where the rollout has one observation group, else ``observations/<key>`` (rolloutcli's ``import``
reads both; D4RL's loaders expect the flat one); ``next_observations`` the same way; ``actions``; ``rewards``;
``terminals`` and ``timeouts`` (bool); ``infos/source_file`` (int32: index into the root attribute
``source_files`` of the file the step was read from). Every episode's last row has exactly one of
``terminals`` (it terminated) or ``timeouts`` (a time-out, the recording's end, or a left-out last step), so
D4RL's ``sequence_dataset`` cuts the episodes where they end. The flat dataset's one key is the attribute
``key`` of ``observations``. Partial episodes: root attributes ``partial_start_rows`` (first row of each
episode begun before the recording) and ``partial_end_rows`` (last row of each episode the recording cut).

With a split, ``out`` is a folder holding ``train.hdf5`` and ``valid.hdf5``, each laid out as above.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from rolloutcli.errors import EXIT_IO, RolloutError
from rolloutcli.hdf5.export_steps import (
    StepCount,
    check_plan,
    file_names,
    kept_steps,
    new_file,
    split_side,
    warnings,
    write_steps,
)
from rolloutcli.hdf5.writer import RolloutOutput
from rolloutcli.pipeline.episode_plan import Chunk, Episode, EpisodePlan

TARGET = "d4rl"
SPLIT_FILES = {"train": "train.hdf5", "valid": "valid.hdf5"}


def output_kind(split: bool) -> str:
    """What ``export_d4rl`` writes at ``out``: a file, or with a split a folder of two files."""
    return "folder" if split else "file"


def export_d4rl(
    out: Path,
    plan: EpisodePlan,
    chunks: Iterable[Chunk],
    valid: Callable[[Episode], bool] | None,
    *,
    label: Path | None = None,
) -> list[str]:
    """Write ``plan``'s episodes, read from ``chunks``, as the D4RL file ``out`` (with ``valid``: the folder
    ``out`` of ``train.hdf5`` and ``valid.hdf5``); the warning lines. Messages name ``label`` (the destination
    the user gave; ``out`` may be its temporary), or ``out``."""
    shown = Path(label or out)
    check_plan(shown, plan, TARGET)
    sides = np.empty(len(plan.episodes), "U5")  # by episode number (0, 1, ...): arrays, no dict an episode
    for e in plan.episodes:
        sides[e.number] = split_side(valid, e)
    first, sizes = _rows(plan, sides)
    paths = {"train": out} if valid is None else {s: out / name for s, name in SPLIT_FILES.items()}
    if valid is not None:
        try:
            out.mkdir(exist_ok=True)
        except OSError as exc:
            raise RolloutError(f"{shown}: cannot create the output folder: {exc.strerror}.", exit_code=EXIT_IO) from exc
    names = _names(plan)
    count = StepCount(plan)
    with contextlib.ExitStack() as stack:
        files = {
            side: stack.enter_context(new_file(path, shown / path.name if path != out else shown, TARGET))
            for side, path in paths.items()
        }
        for side, h5 in files.items():
            _create(h5, plan, names, sizes[side])
            _flags_and_attrs(h5, plan, [e for e in plan.episodes if sides[e.number] == side], first)
        for chunk in chunks:
            number = chunk.episode.number
            count.add(chunk, _write_chunk(shown, files[str(sides[number])], chunk, int(first[number]), names))
        count.check(shown)
    return warnings(plan, TARGET)


def _rows(plan: EpisodePlan, sides: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
    """Each episode's first row in its file, and each file's rows (episodes end to end, in episode order)."""
    first, sizes = np.zeros(len(plan.episodes), np.int64), {"train": 0, "valid": 0}
    for episode in sorted(plan.episodes, key=lambda e: e.number):
        side = str(sides[episode.number])
        first[episode.number] = sizes[side]
        sizes[side] += kept_steps(episode)
    return first, sizes


def _names(plan: EpisodePlan) -> dict[str, tuple[str, str]]:
    """Observation key -> (its observations dataset, its next_observations dataset)."""
    if len(plan.observations) == 1:
        return {key: ("observations", "next_observations") for key in plan.observations}
    return {key: (f"observations/{key}", f"next_observations/{key}") for key in plan.observations}


def _create(h5: RolloutOutput, plan: EpisodePlan, names: dict[str, tuple[str, str]], rows: int) -> None:
    for key, (dtype, shape) in plan.observations.items():
        for name in names[key]:
            h5.create(name, (rows, *shape), dtype)
            if name in ("observations", "next_observations"):
                h5.set_attrs({"key": key}, name)
    for name in ("actions", "rewards"):
        dtype, shape = plan.fields[name]
        h5.create(name, (rows, *shape), dtype)
    h5.create("infos/source_file", (rows,), np.int32)
    h5.set_attrs({"source_files": file_names(plan)})


def _flags_and_attrs(h5: RolloutOutput, plan: EpisodePlan, episodes: list[Episode], first: np.ndarray) -> None:
    """``terminals`` and ``timeouts``, known from the plan (one flag per episode, at its last kept row; held as
    the row indices only), and the partial episodes' rows. Columns of the episodes, in their order: no tuple or
    row object an episode."""

    def column(value: Callable[[Episode], int], dtype: type) -> np.ndarray:
        return np.fromiter((value(e) for e in episodes), dtype, count=len(episodes))

    kept = column(kept_steps, np.int64)
    starts = first[column(lambda e: e.number, np.int64)]
    has, ends = kept > 0, starts + kept - 1
    ended = column(lambda e: e.terminated and e.has_next, bool)
    rows = int(kept.sum())
    for name, where in (("terminals", ends[has & ended]), ("timeouts", ends[has & ~ended])):
        h5.create(name, (rows,), bool)
        _set_rows(h5, name, rows, where)
    h5.set_attrs(
        {
            "partial_start_rows": starts[has & column(lambda e: e.partial_start, bool)],
            "partial_end_rows": ends[has & column(lambda e: e.partial_end, bool)],
        }
    )


def _set_rows(h5: RolloutOutput, name: str, rows: int, where: np.ndarray, block: int = 1 << 20) -> None:
    """``name[where] = True``, every row written, a block of rows at a time (memory stays one block)."""
    marks = np.asarray(where, np.int64)
    for start in range(0, rows, block):
        flags = np.zeros(min(block, rows - start), bool)
        inside = marks[(marks >= start) & (marks < start + block)]
        flags[inside - start] = True
        h5.write(name, (slice(start, start + len(flags)),), flags)


def _write_chunk(out: Path, h5: RolloutOutput, chunk: Chunk, base: int, names: dict[str, tuple[str, str]]) -> int:
    """Write the chunk's kept steps at their rows (``base``: its episode's first row); how many it added."""
    flat = {"actions": "actions", "rewards": "rewards", "source_file": "infos/source_file"}

    def place(role: str, key: str | None = None) -> str:
        return flat[role] if key is None else names[key][role == "next_obs"]

    return write_steps(out, h5, chunk, kept_steps(chunk.episode), base, list(names), place).stop
