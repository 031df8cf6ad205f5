"""``batch --valid-fraction F --split-by episode|env``: the dataset's rows (or envs) in two shard folders,
``OUT/train`` and ``OUT/valid``, each a shard folder of its own (``ShardDataset`` opens either).

The side of an episode or env is drawn as ``export`` draws it (:func:`rolloutcli.pipeline.export.splitter`:
the seed and a stable identity), over the dataset's episodes joined across consecutive recordings. Each side is
then one ``batch`` run whose plan shuffles only that side's rows (:mod:`rolloutcli.core.split_rows`): the same
source rows, read once per side, no copy of the data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutcli.core.split_rows import Run, SideRows
from rolloutcli.dataset import resolve
from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.hdf5.atomic import atomic_folder
from rolloutcli.hdf5.shards import is_shard_folder
from rolloutcli.pipeline.episode_plan import Episode, EpisodePlan
from rolloutcli.pipeline.episodes import plan_episodes
from rolloutcli.pipeline.export import splitter

SIDES = ("train", "valid")


@dataclass(frozen=True)
class HoldOut:
    """``fraction`` of the episodes (``by = "episode"``) or envs (``"env"``) go to ``OUT/valid``."""

    fraction: float
    by: str = "episode"
    seed: int = 0

    def check(self, mode: str) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise _usage(f"--valid-fraction: expected a number in (0, 1), found {self.fraction}.")
        if mode not in ("feedforward", "recurrent"):
            raise _usage(
                f"--valid-fraction: expected feed-forward or --recurrent batches, found --{mode}. Hold out "
                "episodes with `rolloutcli export --valid-fraction`, or batch each side's files."
            )
        if mode == "recurrent" and self.by != "env":
            raise _usage(
                "--split-by episode: recurrent batches hold whole envs, so a held-out episode would leave a hole "
                "in its env; use --split-by env."
            )

    def check_parity(self, parity: bool) -> None:
        if parity:
            raise _usage("--rsl-parity: RSL-RL holds nothing out; drop --valid-fraction or --rsl-parity.")


def _usage(message: str) -> RolloutError:
    return RolloutError(message, exit_code=EXIT_USAGE)


@dataclass
class Side:
    """One side: its rows in feed-forward numbering, its envs in the dataset's env numbering (files side by side),
    and what it holds."""

    name: str
    rows: SideRows
    envs: list[int]
    record: dict[str, Any] = field(default_factory=dict)  # the manifest's and summary's "split"


def _covering(runs: list[tuple[int, int, bool]], T: int) -> list[tuple[int, int, bool]]:
    """One lane's runs ``(t0, t1, valid)`` in time order, stretched to cover ``[0, T)``: a step in no episode
    (gymnasium's autoreset step after a done) goes with the episode before it."""
    runs = sorted(runs)
    out = []
    for i, (t0, _, valid) in enumerate(runs):
        start = 0 if i == 0 else t0
        stop = runs[i + 1][0] if i + 1 < len(runs) else T
        out.append((start, stop, valid))
    return out


def _lanes(plan: EpisodePlan, valid: Callable[[Episode], bool], index: dict[Path, int]) -> dict:
    """(dataset file, lane) -> that lane's runs ``(t0, t1, valid)``."""
    lanes: dict[tuple[int, int], list[tuple[int, int, bool]]] = {}
    for k, pieces in plan.pieces.items():
        for ep, start, stop, _ in pieces:
            lanes.setdefault((index[plan.files[k]], ep.lane), []).append((start, stop, valid(ep)))
    return lanes


def plan_sides(
    files: list[Path], sizes: list[tuple[int, int]], hold_out: HoldOut, run: Any, engine: Any
) -> tuple[Side, Side]:
    """The two sides of a dataset (``files`` in dataset order, ``sizes`` their ``(T, N)``; ``run``: the command's
    RunOptions; ``engine``: where each file is read for the plan)."""
    safety, budget = run.safety, run.max_memory
    dataset = resolve(files)
    plan = plan_episodes(list(dataset.files), dataset.names, partial=True, safety=safety, budget=budget, engine=engine)
    valid = splitter(plan, hold_out.fraction, hold_out.by, hold_out.seed)
    assert valid is not None
    index = {path: i for i, path in enumerate(files)}
    runs: dict[bool, list[Run]] = {False: [], True: []}
    env_side: dict[int, bool] = {}
    env_offsets = [sum(n for _, n in sizes[:i]) for i in range(len(sizes))]
    for (file, lane), found in _lanes(plan, valid, index).items():
        for t0, t1, side in _covering(found, sizes[file][0]):
            runs[side].append(Run(file, lane, t0, t1))
            if hold_out.by == "env":  # every run of a lane has one side
                env_side[env_offsets[file] + lane] = side
    for side, name in ((True, "validation"), (False, "training")):
        if not runs[side] or all(run.t0 == run.t1 for run in runs[side]):
            raise _usage(
                f"--valid-fraction: the {name} side holds none of the {len(plan.episodes)} episodes "
                f"({hold_out.by} split, seed {hold_out.seed}); change --valid-fraction or --seed."
            )
    out = []
    for side in (False, True):
        episodes = [ep for ep in plan.episodes if valid(ep) == side]
        envs = sorted(env for env, s in env_side.items() if s == side)
        record = {"side": SIDES[side], "by": hold_out.by, "fraction": hold_out.fraction, "seed": hold_out.seed}
        rows = SideRows(sizes, runs[side])
        lanes = len({(ep.recording, ep.lane) for ep in episodes})  # an env of a recording, over all its files
        record |= {"episodes": len(episodes), "rows": rows.count, "envs": lanes if hold_out.by == "env" else None}
        out.append(Side(SIDES[side], rows, envs, record))
    return out[0], out[1]


def is_split_folder(path: Path) -> bool:
    """An earlier split ``batch`` output: exactly the shard folders ``train`` and ``valid`` (``--overwrite``)."""
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError:
        return False
    return names == ["train", "valid"] and all(is_shard_folder(path / name) for name in names)


def run_split_batch(
    src: list[Path], dst: Path, sides: tuple[Side, Side], each: Callable[[Path, Side], dict[str, Any]], overwrite: bool
) -> dict[str, Any]:
    """Publish ``dst`` holding ``train`` and ``valid`` once both are written; ``each(folder, side)`` writes one
    side's shards (a ``batch`` run) and returns its summary."""
    summaries = {}
    with atomic_folder(dst, inputs=src, overwrite=overwrite, owned=is_split_folder) as tmp:
        for side in sides:
            summaries[side.name] = each(tmp / side.name, side) | {"output": str(dst / side.name)}
    split = {key: value for key, value in sides[1].record.items() if key not in ("side", "episodes", "rows", "envs")}
    return {"output": str(dst), "split": split, **summaries}
