"""Whole episodes of a dataset, across consecutive recordings (format contract 1.2): what an export reads.

Files of one recording (same root attribute ``recording_id``) are taken in ``recording_index`` order, whatever
their names: env lane ``n`` of one file continues lane ``n`` of the one before, so an episode may run across
several files. A file without ``recording_id`` stands alone. An :class:`EpisodePlan` lists every episode
(whole or partial) with its length and how it ended; :func:`rolloutcli.pipeline.episodes.read_chunks` then
yields each episode's steps as :class:`Chunk` s (the rows of one episode from one file), so an episode longer
than the memory budget is never held whole. No h5py here.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class Episode:
    """One episode of the plan.

    ``number``: its position in the export (0, 1, ...): recordings in dataset order, then by ``start``, then by
    lane. ``recording``: the ``recording_id`` of its files, or the name of its standalone file. ``start``: the
    step of the recording (counted over its files in index order) at which it begins. ``steps``: its length.
    ``partial_start``: it began before the first recorded step (the recording did not start at a reset);
    ``partial_end``: the last file ends before it does. ``terminated``/``truncated``: how it ended (a time-out
    is a truncation; a partial end is neither). ``has_next``: the observation after its last step was recorded
    (``final_observations`` at the done, or ``last_observations`` at the end of the last file).
    ``first_file``/``last_file``: indices into :attr:`EpisodePlan.files` of the files its steps come from.
    ``origin`` names its first step whatever files the dataset holds besides (``start`` counts from the first
    file of the recording in the dataset): a split draws from it.
    """

    number: int
    recording: str
    lane: int
    start: int
    steps: int
    partial_start: bool
    partial_end: bool
    terminated: bool
    truncated: bool
    has_next: bool
    first_file: int
    last_file: int
    origin: tuple[int, int] = (0, 0)  # (recording_index of its first file, row there): where it starts, stably

    @property
    def partial(self) -> bool:
        return self.partial_start or self.partial_end


@dataclass
class Chunk:
    """Consecutive steps of one episode, all from one file.

    ``rows``: field path as in the rollout file (``observations/policy``, ``actions``, ``rewards``, ``dones``,
    ``time_outs``, ``final_observations/<key>``, ...) -> ``[steps, ...]`` for the episode's lane, as stored (dtype
    kept; a trailing 1 of the scalar fields dropped; flags as bool). ``offset``: the step of the episode of
    ``rows``' first row. ``file``: index into :attr:`EpisodePlan.files`. ``next_observation``: on the episode's
    last chunk only, where recorded: observation key -> the observation after its last step (no step axis).
    """

    episode: Episode
    offset: int
    file: int
    rows: dict[str, np.ndarray]
    next_observation: dict[str, np.ndarray] | None = None

    @property
    def steps(self) -> int:
        return len(next(iter(self.rows.values())))

    @property
    def last(self) -> bool:
        return self.offset + self.steps == self.episode.steps


Piece = tuple[Episode, int, int, int]  # (episode, row_start, row_stop, step of the episode at row_start)


class Pieces(Mapping[int, list[Piece]]):
    """File -> its pieces, in the order added, as integers, each piece made when read (from ``episodes``, by
    number): a list of tuples a file held ~200 B of the plan of a dataset of small files; this, 40 B a piece."""

    def __init__(self, episodes: Sequence[Episode]) -> None:
        self.episodes = episodes
        self._rows = array("q")  # file, episode number, row_start, row_stop, step: 5 a piece, in the order added
        self._index: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # files, their first rows, the order

    def add(self, file: int, episode: Episode, start: int, stop: int, offset: int) -> None:
        self._rows.extend((file, episode.number, start, stop, offset))
        self._index = None

    def _indexed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The files in the order their first piece was added; the pieces' files sorted, and the pieces in that
        order (a stable sort: each file's in the order added). Copies: the array stays free to grow."""
        if self._index is None:
            files = np.frombuffer(self._rows, np.int64)[::5].copy()
            order = np.argsort(files, kind="stable")
            keys, first = np.unique(files, return_index=True)
            self._index = (keys[np.argsort(first, kind="stable")], files[order], order)
        return self._index

    def __getitem__(self, file: int) -> list[Piece]:
        _, files, order = self._indexed()
        lo, hi = np.searchsorted(files, [file, file + 1]).tolist()
        if lo == hi:
            raise KeyError(file)
        rows = [self._rows[5 * i + 1 : 5 * i + 5] for i in order[lo:hi].tolist()]
        return [(self.episodes[number], start, stop, offset) for number, start, stop, offset in rows]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indexed()[0].tolist())

    def __len__(self) -> int:
        return len(self._indexed()[0])


@dataclass
class EpisodePlan:
    """The episodes of a dataset, in export order.

    ``files``: the dataset's files in reading order (recordings in dataset order, each by ``recording_index``).
    ``fields``: every per-step field a chunk carries -> (stored dtype, shape of one step). ``observations``:
    observation keys (``policy``, ...) -> (dtype, shape of one observation). ``not_held``: fields laid out by
    env that chunks do not carry (hidden states, ``last_values``, ...). ``left_out``: partial episodes left out
    (``partial=False``); they are not in ``episodes``.
    """

    files: Sequence[Path]  # a dataset's files (:class:`rolloutcli.dataset.Paths`: packed, a Path made when read)
    episodes: list[Episode]
    fields: dict[str, tuple[np.dtype, tuple[int, ...]]]
    observations: dict[str, tuple[np.dtype, tuple[int, ...]]]
    not_held: list[str] = field(default_factory=list)
    left_out: int = 0
    partial: int = 0  # partial episodes in the dataset (kept or left out)
    # How the reader finds them (set by the planner): chunk row name -> dataset path; observation key ->
    # last_observations path; file -> its pieces (episode, row_start, row_stop, step of the episode at row_start).
    sources: dict[str, str] = field(default_factory=dict)
    last: dict[str, str] = field(default_factory=dict)
    pieces: Mapping[int, list[Piece]] = field(default_factory=dict)  # the planner's: :class:`Pieces`
    standalone: dict[str, int] = field(default_factory=dict)  # a file without recording_id: its name -> file

    @property
    def steps(self) -> int:
        return sum(e.steps for e in self.episodes)
