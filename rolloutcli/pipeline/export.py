"""``export``: a dataset's episodes, joined across consecutive recordings, written for another tool (Minari,
robomimic, D4RL), optionally split into training and validation episodes or envs.

The writers live in ``rolloutcli/hdf5/export_<target>.py`` (one entry point each, see
:mod:`rolloutcli.pipeline.episode_plan`); this module plans, draws the split, streams the chunks and publishes
the output atomically (a file or a folder, by target).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutcli.core.episodes import valid_side
from rolloutcli.dataset import file_hash, resolve
from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.hdf5.atomic import atomic_file, atomic_folder, check_output_path
from rolloutcli.hdf5.export_marker import MARK, is_export_folder
from rolloutcli.pipeline.episode_plan import Chunk, Episode, EpisodePlan
from rolloutcli.pipeline.episodes import plan_episodes, read_chunks
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import Progress

TARGETS = ("minari", "robomimic", "d4rl")
SPLIT_BY = ("episode", "env")


@dataclass(frozen=True)
class ExportOptions:
    """``partial``: keep episodes begun before the first file or unfinished at the last (marked).
    ``valid_fraction``: the share drawn for validation (0: no split), ``split_by``: episode or env, ``seed``."""

    target: str
    partial: bool = False
    valid_fraction: float = 0.0
    split_by: str = "episode"
    seed: int = 0

    def check(self) -> None:
        if self.target not in TARGETS:
            raise RolloutError(f"--to: expected {', '.join(TARGETS)}, found '{self.target}'.", exit_code=EXIT_USAGE)
        if not 0.0 <= self.valid_fraction < 1.0:
            raise RolloutError(
                f"--valid-fraction: expected a number in [0, 1), found {self.valid_fraction}. "
                "Give the share of episodes to hold out, e.g. 0.1.",
                exit_code=EXIT_USAGE,
            )
        if self.split_by not in SPLIT_BY:
            raise RolloutError(f"--split-by: expected episode or env, found '{self.split_by}'.", exit_code=EXIT_USAGE)


def _writer(target: str) -> tuple[Callable[..., list[str]], Callable[[bool], str]]:
    """The target's entry point and whether it writes a file or a folder (with or without a split)."""
    module = importlib.import_module(f"rolloutcli.hdf5.export_{target}")
    return getattr(module, f"export_{target}"), module.output_kind


def splitter(plan: EpisodePlan, fraction: float, by: str, seed: int) -> Callable[[Episode], bool] | None:
    """Whether an episode goes to the validation side: drawn from the seed and the episode's identity (its
    recording, env and first step) or its env's (recording, env), so that adding files never moves an episode
    or an env to the other side. A file without ``recording_id`` is named by its content's hash."""
    if fraction <= 0:
        return None
    hashes = {file: file_hash(plan.files[file]) for file in plan.standalone.values()}

    def valid(ep: Episode) -> bool:
        alone = plan.standalone.get(ep.recording) == ep.first_file  # a recording_id may spell a file's name
        lane = f"{hashes[ep.first_file] if alone else ep.recording}\0{ep.lane}"
        identity = lane if by == "env" else f"{lane}\0{ep.origin[0]}\0{ep.origin[1]}"
        return valid_side(seed, identity, fraction)

    return valid


def _counted(chunks: Iterator[Chunk], progress: Progress) -> Iterator[Chunk]:
    for chunk in chunks:
        yield chunk
        progress.advance(chunk.steps)


def run_export(
    files: Sequence[str | Path],
    dst: Path,
    options: ExportOptions,
    run: RunOptions,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    engine: Any = None,
) -> dict[str, Any]:
    """Export the episodes of the dataset ``files`` to ``dst``; the summary. ``engine``: where each file is read
    for the plan (its flags, values and first and last observations); one process writes the output."""
    options.check()
    progress = progress or Progress()
    started = time.monotonic()
    dataset = resolve(files)
    write, kind = _writer(options.target)
    # the dataset's packed paths as they are: a list of them held ~500 B a file for the whole export
    inputs, folder = dataset.files, kind(options.valid_fraction > 0) == "folder"
    # an output in the way is refused before the files are read (and again at publish)
    owner = {"kind": "folder", "owned": is_export_folder, "mark": MARK} if folder else {}
    check_output_path(dst, inputs, overwrite=overwrite, **owner)
    plan = plan_episodes(
        dataset.files, dataset.names, partial=options.partial, safety=run.safety, budget=run.max_memory, engine=engine
    )
    if not plan.episodes:
        raise RolloutError(
            f"{dataset.files[0]}: field 'dones': expected at least one whole episode, found none "
            f"({plan.partial} partial). Record longer, or keep partial episodes with --partial-episodes."
        )
    if all(ep.steps == 1 and not ep.has_next for ep in plan.episodes):  # every target needs the next observation
        raise RolloutError(
            f"{dataset.files[0]}: field 'observations': expected an episode with a step to export (two steps, or "
            f"the observation after its step recorded), found {len(plan.episodes)} one-step episodes without it. "
            "Record final_observations and last_observations, or longer episodes."
        )
    valid = splitter(plan, options.valid_fraction, options.split_by, options.seed)
    if folder:  # --overwrite replaces a folder only where an export of ours is
        publish = atomic_folder(dst, inputs=inputs, overwrite=overwrite, owned=is_export_folder, mark=MARK)
    else:
        publish = atomic_file(dst, inputs=inputs, overwrite=overwrite)
    progress.start(f"export {options.target}", plan.steps)
    with publish as tmp:  # the writers name ``dst`` in their messages, never the temporary
        chunks = _counted(read_chunks(plan, run.max_memory, run.safety), progress)
        warnings = write(tmp, plan, chunks, valid, label=dst)
    progress.finish()
    for warning in warnings:  # on stderr, as every command's; kept in the summary too (--json)
        progress.warn(warning)
    held_out = [ep for ep in plan.episodes if valid is not None and valid(ep)]
    return {
        "input": str(dataset.root if dataset.many else dataset.files[0]),
        "output": str(dst),
        "target": options.target,
        "files": len(plan.files),
        "episodes": len(plan.episodes),
        "steps": plan.steps,
        "partial_kept": plan.partial - plan.left_out,
        "partial_left_out": plan.left_out,
        "valid_episodes": len(held_out),
        "valid_steps": sum(ep.steps for ep in held_out),
        "split": None
        if valid is None
        else {"by": options.split_by, "fraction": options.valid_fraction, "seed": options.seed},
        "warnings": warnings,
        "seconds": time.monotonic() - started,
    }
