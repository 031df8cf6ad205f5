"""One side (training or validation) of a split ``batch``: which source rows or envs it holds, and its shuffle.

A side's rows are runs of steps of one env lane (a whole lane for a split by env, an episode's steps for a split
by episode). :class:`SideRows` numbers them run after run (by file, lane, then step) and maps both ways between
that number and the dataset row (``row_offset + t * N + n``, as a feed-forward export numbers them), with a few
integers per run and none per row. :class:`SideOrder` is then a :class:`~rolloutcli.core.order.RowOrder` of the
side's rows, placed where a plan takes a ``RowOrder``: rows of the other side have position ``-1`` (in no shard).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rolloutcli.core.order import RowOrder


@dataclass(frozen=True)
class Run:
    """Steps ``[t0, t1)`` of env ``lane`` of file ``file`` (dataset order)."""

    file: int
    lane: int
    t0: int
    t1: int


class SideRows:
    """The rows of ``runs`` (disjoint) in a dataset of files of ``sizes`` ``(T, N)``, feed-forward numbering."""

    def __init__(self, sizes: list[tuple[int, int]], runs: list[Run]) -> None:
        runs = sorted(runs, key=lambda r: (r.file, r.lane, r.t0))
        steps = np.array([t for t, _ in sizes], np.int64)
        envs = np.array([n for _, n in sizes], np.int64)
        row_offsets = np.concatenate([[0], np.cumsum(steps * envs)])
        self._lane_offsets = np.concatenate([[0], np.cumsum(envs)])
        self._row_offsets, self._envs, self._key = row_offsets, envs, int(steps.max(initial=0)) + 1
        file = np.array([r.file for r in runs], np.int64)
        lane = np.array([r.lane for r in runs], np.int64)
        t0 = np.array([r.t0 for r in runs], np.int64)
        self._t0, self._t1 = t0, np.array([r.t1 for r in runs], np.int64)
        self._starts = (self._lane_offsets[file] + lane) * self._key + t0  # sorted: by file, lane, t0
        self._base = row_offsets[file] + lane  # row of step t of run i: base + t * stride
        self._stride = envs[file]
        lengths = self._t1 - t0
        self._prefix = np.concatenate([[0], np.cumsum(lengths)])
        self.count = int(self._prefix[-1])

    def rows(self, numbers: torch.Tensor) -> torch.Tensor:
        """The dataset row of each side row number (``0 <= number < count``)."""
        k = numbers.numpy().astype(np.int64)
        run = np.searchsorted(self._prefix, k, side="right") - 1
        t = self._t0[run] + k - self._prefix[run]
        return torch.from_numpy(self._base[run] + t * self._stride[run]).view(numbers.shape)

    def numbers(self, rows: torch.Tensor) -> torch.Tensor:
        """The side row number of each dataset row, ``-1`` for rows of the other side."""
        r = rows.numpy().astype(np.int64).reshape(-1)
        file = np.searchsorted(self._row_offsets, r, side="right") - 1
        local = r - self._row_offsets[file]
        t, n = local // self._envs[file], local % self._envs[file]
        key = (self._lane_offsets[file] + n) * self._key + t
        run = np.searchsorted(self._starts, key, side="right") - 1
        safe = np.maximum(run, 0)
        inside = (run >= 0) & (key - self._starts[safe] < self._t1[safe] - self._t0[safe])
        out = np.where(inside, self._prefix[safe] + t - self._t0[safe], -1)
        return torch.from_numpy(out).view(rows.shape)


@dataclass(frozen=True)
class SideOrder:
    """A :class:`RowOrder` of one side's rows in dataset row numbers (duck-typed where a plan takes a RowOrder)."""

    order: RowOrder
    side: SideRows

    @property
    def key(self) -> int:
        return self.order.key

    def rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.side.rows(self.order.rows(start, stop))

    def positions(self, rows: torch.Tensor | np.ndarray) -> torch.Tensor:
        numbers = self.side.numbers(torch.as_tensor(rows, dtype=torch.int64))
        kept = numbers >= 0
        out = torch.full_like(numbers, -1)
        out[kept] = self.order.positions(numbers[kept])
        return out
