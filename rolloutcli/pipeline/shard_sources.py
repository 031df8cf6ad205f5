"""The files of a shard export (:class:`Source`: a file, its blocks, where its rows sit in the dataset) and a
dataset's of them, packed (:class:`Sources`)."""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rolloutcli.core.batching import block_rows
from rolloutcli.dataset import Paths

Block = tuple[int, int, int, int]  # steps t0:t1 x envs n0:n1 of the source


@dataclass(frozen=True, slots=True)
class Source:
    """One file of the export, its blocks, and where its rows sit in the dataset: feed-forward row
    ``row_offset + t * N + n``; with ``env_concat`` (one T, files side by side along envs) ``t * N_total +
    env_offset + n``. One file: both are ``t * N + n``. No open reader: an open HDF5 file holds ~0.5 MB of
    libhdf5 caches, so a dataset's files are opened one at a time (all open, 1,000 files took 1 GB)."""

    path: str
    T: int
    N: int
    blocks: list[Block]
    row_offset: int = 0
    env_offset: int = 0

    def rows(self, block: Block, env_concat: bool, total_envs: int) -> torch.Tensor:
        """``[steps * envs]`` int64 dataset rows of a block, time-major."""
        return block_rows(block, self.N, (self.row_offset, self.env_offset), env_concat, total_envs)


class Sources(Sequence[Source]):
    """The sources of the files ``paths``, in order, as integers, each :class:`Source` made when read: a list of
    them held ~310 B a file of a dataset (the object, its path, its list of blocks) for the whole export; this,
    72 B a small file."""

    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self._sizes = array("q")  # T, N, row_offset, env_offset of each file
        self._blocks = array("q")  # the files' blocks end to end, 4 integers each
        self._ends = array("q")  # where each file's blocks end in ``_blocks`` (counted in blocks)

    def append(self, T: int, N: int, blocks: list[Block], row_offset: int, env_offset: int) -> None:
        """The next file's source (the files in the order of ``paths``)."""
        self._sizes.extend((T, N, row_offset, env_offset))
        for block in blocks:
            self._blocks.extend(block)
        self._ends.append(len(self._blocks) // 4)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: int) -> Source:  # type: ignore[override]  # no slices: the callers read one at a time
        i = range(len(self._ends))[i]  # a negative index counts from the end; out of range: IndexError
        T, N, row_offset, env_offset = self._sizes[4 * i : 4 * i + 4]
        flat = self._blocks[4 * (self._ends[i - 1] if i else 0) : 4 * self._ends[i]]
        blocks: list[Block] = [(flat[j], flat[j + 1], flat[j + 2], flat[j + 3]) for j in range(0, len(flat), 4)]
        return Source(os.fspath(self.paths[i]), T, N, blocks, row_offset, env_offset)
