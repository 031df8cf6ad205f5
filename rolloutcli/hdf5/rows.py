"""Rows of rollout files read on demand, for the row-level datasets (:mod:`rolloutcli.rollout_dataset`).

Files are checked once (``describe``: the schema and every value check) when the dataset is built, then opened
lazily by each process that reads rows: a ``DataLoader`` worker opens its own handles, and a handle opened before
a fork is never used after it (HDF5 handles do not survive ``fork``). Each process keeps whole fields in memory,
least recently used first out, up to ``cache_bytes``: random rows of a chunked (compressed) field would decode a
whole chunk per row. A field larger than that is read by the rows asked for, the steps one chunk holds at once
(each chunk decoded once per read); ``read_bytes`` bounds what one row costs to read (its bytes, or the chunk
libhdf5 decodes whole to get at it, when compressed): a field over it is refused when the dataset is built.
Each process keeps at most ``OPEN_FILES`` files open, least recently used closed first: a dataset of a training
run's 10,000 files would otherwise run out of file descriptors (commonly 1,024 a process) and hold each file's
metadata in memory.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.safety import SafetyOptions

OPEN_FILES = 64  # files a process keeps open at once


@dataclass(frozen=True)
class FileInfo:
    """What a row-level dataset needs to know of one file."""

    path: Path
    T: int
    N: int
    fields: dict[str, tuple[str, tuple[int, ...]]]  # dataset path -> (normalised dtype, row shape)
    distribution: list[str]  # distribution parameter names in tuple order
    dones: np.ndarray  # [T, N] uint8 (trajectories are cut there)
    row_cost: dict[str, tuple[int, str]]  # dataset path -> (bytes read to get one row, what they are)


def _row_cost(spec: Any, row: tuple[int, ...]) -> tuple[int, str]:
    """Bytes libhdf5 handles to read one row of a field: the row, or a compressed chunk decoded whole."""
    row_bytes = math.prod(row) * spec.dtype.itemsize
    if spec.chunks is not None and spec.compression:
        chunk_bytes = math.prod(spec.chunks) * spec.dtype.itemsize
        if chunk_bytes > row_bytes:
            return chunk_bytes, f"compressed chunks {list(spec.chunks)} of {chunk_bytes} bytes decoded whole per row"
    return row_bytes, f"rows of {row_bytes} bytes"


def check_row_costs(info: FileInfo, names: Sequence[str], read_bytes: int) -> None:
    """Refuse a field one row of which cannot be read within ``read_bytes``."""
    for name in names:
        cost, what = info.row_cost[name]
        if cost > read_bytes:
            raise RolloutError.field(
                info.path, name, f"one row readable within read_bytes={read_bytes}", what,
                f"Re-save the file with smaller chunks, or pass read_bytes={cost} (or more).", exit_code=EXIT_USAGE,
            )  # fmt: skip


def describe_files(paths: Sequence[Path], safety: SafetyOptions) -> list[FileInfo]:
    """Open and check each file once (schema and values); return what the datasets index by."""
    out = []
    for path in paths:
        with RolloutReader(path, safety) as reader:
            fields, costs = {}, {}
            for name, spec in reader.schema.fields.items():
                if spec.role == "extra" or spec.env_axis is None:
                    continue
                dtype, shape = reader.normalized(name, 0, 1)
                row = (shape[1], shape[3]) if spec.role == "hidden" else tuple(shape[2:])
                fields[name] = (np.dtype(dtype).str, row)
                costs[name] = _row_cost(spec, row)
            order = reader.distribution_order() if reader.schema.names("distribution") else []
            out.append(FileInfo(Path(path), reader.T, reader.N, fields, order, reader.array("dones"), costs))
    return out


class RowReader:
    """Per-process handles on a list of files, and reads of rows or step ranges of their fields."""

    def __init__(
        self, paths: Sequence[Path], safety: SafetyOptions, cache_bytes: int = 256 << 20, read_bytes: int = 64 << 20
    ) -> None:
        self.paths, self.read_bytes = list(paths), read_bytes
        self.safety = safety
        self.cache_bytes = cache_bytes
        self._pid = -1
        self._open: OrderedDict[int, RolloutReader] = OrderedDict()
        self._cache: OrderedDict[tuple[int, str], np.ndarray] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {"paths": self.paths, "safety": self.safety, "cache_bytes": self.cache_bytes, "_pid": -1,
                "read_bytes": self.read_bytes, "_open": OrderedDict(), "_cache": OrderedDict()}  # fmt: skip

    def _reader(self, file: int) -> RolloutReader:
        if self._pid != os.getpid():  # a new process (a DataLoader worker, a fork): open its own handles
            self._pid, self._open, self._cache = os.getpid(), OrderedDict(), OrderedDict()
        if file in self._open:
            self._open.move_to_end(file)
            return self._open[file]
        while len(self._open) >= OPEN_FILES:
            self._open.popitem(last=False)[1].close()
        self._open[file] = RolloutReader(self.paths[file], self.safety, check=False)  # checked when built
        return self._open[file]

    def _whole(self, file: int, name: str) -> np.ndarray | None:
        """Field ``name`` of a file as ``[T, N, *row_shape]`` from the cache (read on a miss), or None when it is
        larger than the cache."""
        key = (file, name)
        if key in self._cache and self._pid == os.getpid():
            self._cache.move_to_end(key)
            return self._cache[key]
        reader = self._reader(file)
        nbytes = reader.schema.fields[name].nbytes
        if nbytes > self.cache_bytes:
            return None
        while self._cache and sum(a.nbytes for a in self._cache.values()) + nbytes > self.cache_bytes:
            self._cache.popitem(last=False)
        data = reader.array(name)
        if reader.schema.fields[name].role == "hidden":  # [T, layers, N, H] -> [T, N, layers, H]
            data = np.ascontiguousarray(data.transpose(0, 2, 1, 3))
        self._cache[key] = data
        return data

    def rows(self, file: int, name: str, rows: np.ndarray) -> np.ndarray:
        """``[len(rows), *row_shape]`` of field ``name`` at flat rows ``t * N + n`` (any order, repeats allowed)."""
        reader = self._reader(file)
        whole = self._whole(file, name)
        if whole is not None:
            steps, envs = np.divmod(rows, reader.N)
            return whole[steps, envs]
        unique, inverse = np.unique(rows, return_inverse=True)
        steps, envs = np.divmod(unique, reader.N)
        spec = reader.schema.fields[name]
        span = spec.chunks[0] if spec.chunks is not None and spec.compression else 1  # steps one chunk holds
        row_bytes = spec.nbytes // max(1, reader.T * reader.N)
        parts = []
        for first in np.unique(steps // span) * span:  # each chunk's steps in one read: decoded once
            mine = (steps >= first) & (steps < first + span)
            low, high = int(steps[mine].min()), int(steps[mine].max()) + 1
            columns = np.unique(envs[mine])
            if (
                high - low > 1 and (high - low) * len(columns) * row_bytes > self.read_bytes
            ):  # one step at a time: within the bound
                parts += [self.rows(file, name, unique[mine & (steps == t)]) for t in np.unique(steps[mine])]
                continue
            block = self._read(reader, name, slice(low, high), columns.tolist())
            parts.append(block[steps[mine] - low, np.searchsorted(columns, envs[mine])])
        return np.concatenate(parts)[inverse]

    def steps(self, file: int, name: str, start: int, stop: int, env: int) -> np.ndarray:
        """``[stop - start, *row_shape]`` of field ``name`` for one env."""
        whole = self._whole(file, name)
        if whole is not None:
            return whole[start:stop, env].copy()
        return self._read(self._reader(file), name, slice(start, stop), [env])[:, 0]

    @staticmethod
    def _read(reader: RolloutReader, name: str, steps: slice, envs: list[int]) -> np.ndarray:
        """``[steps, envs, *row_shape]`` normalised (hidden states as rows ``[layers, H]``)."""
        hidden = reader.schema.fields[name].role == "hidden"
        index = (steps, slice(None), envs) if hidden else (steps, envs)
        data = reader.normalise(name, reader.slice(name, index))
        return np.ascontiguousarray(data.transpose(0, 2, 1, 3)) if hidden else data

    def close(self) -> None:
        for reader in self._open.values():
            reader.close()
        self._open = OrderedDict()
