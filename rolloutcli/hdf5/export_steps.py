"""What the episode exports to robomimic and D4RL share: which steps of an episode they keep, where a chunk's
rows go, the checks and the warning lines, and the output file (h5py through :class:`RolloutOutput`).

Both targets store, for every step, the observation after it (robomimic's ``next_obs``, D4RL's
``next_observations``). Inside an episode that is the next step's observation; after the last step it is the
chunk's ``next_observation``. Where that was not recorded (``episode.has_next`` False) the last step is left
out: never an invented observation. So an episode keeps :func:`kept_steps` steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from rolloutcli.errors import RolloutError
from rolloutcli.hdf5.export_marker import MARKER
from rolloutcli.hdf5.writer import RolloutOutput
from rolloutcli.pipeline.episode_plan import Chunk, Episode, EpisodePlan

# Fields an export writes (observations/<key> and final_observations/<key> through the observations).
HELD = ("actions", "rewards", "dones", "time_outs")


def kept_steps(episode: Episode) -> int:
    """The steps of ``episode`` an export keeps: all of them where the observation after the last was recorded."""
    return episode.steps if episode.has_next else episode.steps - 1


def rows_in(chunk: Chunk, kept: int) -> tuple[slice, slice]:
    """(rows of the chunk, steps of the episode) of the chunk's steps the export keeps (``obs``, ``actions``...)."""
    count = max(0, min(chunk.steps, kept - chunk.offset))
    return slice(0, count), slice(chunk.offset, chunk.offset + count)


def rows_before(chunk: Chunk, kept: int) -> tuple[slice, slice]:
    """(rows of the chunk, steps of the episode) for the observation after each step: a chunk's row ``i`` is
    the observation after step ``offset + i - 1`` (the episode's first row follows no kept step)."""
    low = max(0, 1 - chunk.offset)
    high = max(low, min(chunk.steps, kept - chunk.offset + 1))
    return slice(low, high), slice(chunk.offset - 1 + low, chunk.offset - 1 + high)


def check_plan(out: Path, plan: EpisodePlan, target: str) -> None:
    """Refuse a plan the target cannot hold: no observation group, no actions or rewards."""
    if not plan.observations:
        raise RolloutError.field(
            out,
            "observations",
            f"an observation group to export to {target}",
            "none in the dataset",
            "Export a rollout file that records observations.",
        )
    for name in ("actions", "rewards"):
        if name not in plan.fields:
            raise RolloutError.field(
                out,
                name,
                f"per-step {name} to export to {target}",
                "none in the dataset",
                f"Export a rollout file that records {name}.",
            )


def held(name: str) -> bool:
    """``name`` (a field of :attr:`EpisodePlan.fields`) has a place in the robomimic and D4RL exports."""
    return name in HELD or name.split("/")[0] in ("observations", "final_observations")


def warnings(plan: EpisodePlan, target: str) -> list[str]:
    """The export's warning lines: the episodes whose last step is left out, the fields the target cannot hold."""
    lines = []
    missing = sum(not e.has_next for e in plan.episodes)
    if missing:
        lines.append(
            f"{missing} episodes end without the observation after their last step (not recorded): "
            f"their last step is left out of {target}"
        )
    left = sorted({n.split("/")[0] for n in [*(n for n in plan.fields if not held(n)), *plan.not_held]})
    if left:
        lines.append(f"{target} has no place for {', '.join(left)}: not exported")
    return lines


def file_names(plan: EpisodePlan) -> list[str]:
    """The source files' names, which the per-step ``source_file`` index points into."""
    return [Path(p).name for p in plan.files]


def next_observation(out: Path, chunk: Chunk, key: str) -> np.ndarray:
    """The observation after the episode's last step (its last chunk, ``has_next`` True)."""
    after = chunk.next_observation or {}
    if key not in after:
        raise RolloutError.field(
            out,
            f"final_observations/{key}",
            f"the observation after episode {chunk.episode.number}'s last step",
            "none in its last chunk although the plan says it was recorded",
            "Report this as a bug.",
        )
    return after[key]


class StepCount:
    """Counts the steps written per episode; at the end every kept step must have arrived (a reader that
    stopped early would otherwise leave rows of fill values in the output)."""

    def __init__(self, plan: EpisodePlan) -> None:  # by episode number (0, 1, ...): two arrays, no dict
        self.want = np.zeros(len(plan.episodes), np.int64)
        for e in plan.episodes:
            self.want[e.number] = kept_steps(e)
        self.seen = np.zeros_like(self.want)

    def add(self, chunk: Chunk, count: int) -> None:
        self.seen[chunk.episode.number] += count

    def check(self, out: Path) -> None:
        short = np.flatnonzero(self.seen != self.want)
        if len(short):
            n = int(short[0])
            raise RolloutError.field(
                out,
                "episodes",
                f"{int(self.want[n])} steps of episode {n}",
                f"{int(self.seen[n])} read",
                "The dataset changed while it was exported; export it again.",
            )


@contextlib.contextmanager
def new_file(path: Path, label: Path, target: str) -> Iterator[RolloutOutput]:
    """A new HDF5 file at ``path``, marked as an export to ``target`` (:mod:`rolloutcli.hdf5.export_marker`);
    libhdf5's failures become one-line errors naming ``label``, the path the user gave (``path`` is temporary)."""
    with RolloutOutput(path, label) as out:
        out.set_attrs({MARKER: target})
        yield out


def write_steps(
    out: Path, h5: RolloutOutput, chunk: Chunk, kept: int, base: int, keys: list[str], place: Callable[..., str]
) -> slice:
    """Write a chunk's kept steps at row ``base`` + step: each observation, the one after it (the next row's, or the
    recorded one after the episode's last step), actions, rewards and the step's source file. ``place(role[, key])``
    names the dataset of ``obs``/``next_obs`` (with a key), ``actions``, ``rewards``, ``source_file``. Returns the
    chunk's rows written."""
    src, dst = rows_in(chunk, kept)
    before_src, before_dst = rows_before(chunk, kept)
    for key in keys:
        rows = chunk.rows[f"observations/{key}"]
        write_rows(h5, place("obs", key), base + dst.start, rows[src])
        write_rows(h5, place("next_obs", key), base + before_dst.start, rows[before_src])
        if chunk.last and chunk.episode.has_next:
            h5.write(place("next_obs", key), (base + kept - 1,), next_observation(out, chunk, key))
    for name in ("actions", "rewards"):
        write_rows(h5, place(name), base + dst.start, chunk.rows[name][src])
    write_rows(h5, place("source_file"), base + dst.start, np.full(src.stop, chunk.file, np.int32))
    return src


def write_rows(out: RolloutOutput, name: str, first: int, rows: np.ndarray) -> None:
    if len(rows):
        out.write(name, (slice(first, first + len(rows)),), rows)


def split_side(valid: Callable[[Episode], bool] | None, episode: Episode) -> str:
    """``train`` or ``valid`` (no split: everything is ``train``)."""
    return "valid" if valid is not None and valid(episode) else "train"
