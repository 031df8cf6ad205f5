"""Rows of rollout files read on demand, for the row-level datasets (:mod:`rolloutcli.rollout_dataset`).

Files are checked once (``describe``: the schema and every value check) when the dataset is built, then opened
lazily by each process that reads rows: a ``DataLoader`` worker opens its own handles, and a handle opened before
a fork is never used after it (HDF5 handles do not survive ``fork``). Each process keeps whole fields in memory,
least recently used first out, up to ``cache_bytes``: random rows of a chunked (compressed) field would decode a
whole chunk per row. A field larger than that is read step by step.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.safety import SafetyOptions


@dataclass(frozen=True)
class FileInfo:
    """What a row-level dataset needs to know of one file."""

    path: Path
    T: int
    N: int
    fields: dict[str, tuple[str, tuple[int, ...]]]  # dataset path -> (normalised dtype, row shape)
    distribution: list[str]  # distribution parameter names in tuple order
    dones: np.ndarray  # [T, N] uint8 (trajectories are cut there)


def describe_files(paths: Sequence[Path], safety: SafetyOptions) -> list[FileInfo]:
    """Open and check each file once (schema and values); return what the datasets index by."""
    out = []
    for path in paths:
        with RolloutReader(path, safety) as reader:
            fields = {}
            for name, spec in reader.schema.fields.items():
                if spec.role == "extra" or spec.env_axis is None:
                    continue
                dtype, shape = reader.normalized(name, 0, 1)
                row = (shape[1], shape[3]) if spec.role == "hidden" else tuple(shape[2:])
                fields[name] = (np.dtype(dtype).str, row)
            order = reader.distribution_order() if reader.schema.names("distribution") else []
            out.append(FileInfo(Path(path), reader.T, reader.N, fields, order, reader.array("dones")))
    return out


class RowReader:
    """Per-process handles on a list of files, and reads of rows or step ranges of their fields."""

    def __init__(self, paths: Sequence[Path], safety: SafetyOptions, cache_bytes: int = 256 << 20) -> None:
        self.paths = list(paths)
        self.safety = safety
        self.cache_bytes = cache_bytes
        self._pid = -1
        self._open: dict[int, RolloutReader] = {}
        self._cache: OrderedDict[tuple[int, str], np.ndarray] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {"paths": self.paths, "safety": self.safety, "cache_bytes": self.cache_bytes, "_pid": -1,
                "_open": {}, "_cache": OrderedDict()}  # fmt: skip

    def _reader(self, file: int) -> RolloutReader:
        if self._pid != os.getpid():  # a new process (a DataLoader worker, a fork): open its own handles
            self._pid, self._open, self._cache = os.getpid(), {}, OrderedDict()
        if file not in self._open:
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
        parts = []
        for t in np.unique(steps):
            columns = envs[steps == t].tolist()
            parts.append(self._read(reader, name, slice(int(t), int(t) + 1), columns)[0])
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
        self._open = {}
