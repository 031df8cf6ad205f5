"""A command's output as a copy of its input: copy the file's bytes, then update the copy in place.

``gae`` copies the whole input file in the kernel (nothing decoded, a reflink where the file system offers one),
then adds its datasets to the copy (:class:`OpenCopy`). Write-back of each step starts as it goes
(``sync_file_range``, which does not wait), so the fsync that publishes the output finds little left to write.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from rolloutcli.hdf5.rename import libc_function
from rolloutcli.hdf5.writer import Target, new_dataset, open_for_update, write_array

COPY_STEP = 64 << 20  # bytes per kernel copy call: write-back starts (and progress moves) every 64 MiB
_SYNC_FILE_RANGE_WRITE = 2


_SYNC_FILE_RANGE = libc_function("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to disk; never waits for the
    disk and never fails (a hint: the publishing fsync is what guarantees durability)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def copy_file_bytes(source: Path, target: Path, advance: Callable[[int], None] | None = None) -> None:
    """Copy ``source``'s bytes over ``target`` in the kernel, ``COPY_STEP`` bytes at a time, calling
    ``advance(bytes)`` after each step; ``shutil.copyfile`` where ``copy_file_range`` is missing or refused.
    Raises ``OSError`` when the copy fails (disk full, file-size limit, I/O error)."""
    size = os.path.getsize(source)
    with open(source, "rb") as src, open(target, "wb") as dst:
        copied = 0
        try:
            while copied < size:
                done = os.copy_file_range(src.fileno(), dst.fileno(), min(COPY_STEP, size - copied))
                if done == 0:
                    break
                start_writeback(dst.fileno(), copied, done)
                copied += done
                if advance is not None:
                    advance(done)
        except (AttributeError, OSError) as exc:
            if copied or getattr(exc, "errno", None) in (errno.ENOSPC, errno.EFBIG, errno.EIO):
                raise
            copied = -1
    if copied != size:
        shutil.copyfile(source, target)
        if advance is not None:
            advance(size)


class OpenCopy:
    """Our own temporary copy of an input, open for update: what ``gae`` changes in it, by dataset name.
    HDF5 errors propagate as h5py raises them (the caller translates them)."""

    def __init__(self, path: Path) -> None:
        self._handle = open_for_update(path)
        self._created: dict[str, Target] = {}

    def __enter__(self) -> OpenCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()

    def read_steps(self, name: str, start: int, stop: int) -> np.ndarray:
        """Env columns ``[start, stop)`` of a ``[T, N]`` or ``[T, N, 1]`` dataset as ``[T, n]``, native byte order."""
        dataset = self._handle[name]
        block = np.asarray(dataset[:, start:stop])
        block = block.reshape(block.shape[:2])
        return block if block.dtype.isnative else block.astype(block.dtype.newbyteorder("="))

    def remove(self, name: str) -> None:
        if name in self._handle:
            del self._handle[name]

    def rename(self, old: str, new: str) -> None:
        """Rename dataset ``old`` to ``new``, replacing any ``new``."""
        self.remove(new)
        self._handle.move(old, new)

    def create(self, name: str, steps: int, envs: int, dtype: Any = np.float32) -> None:
        """A new empty ``[T, N]`` dataset ``name`` (float32 unless told; replacing any), filled by :meth:`write`."""
        self.remove(name)
        self._created[name] = new_dataset(self._handle, name, (steps, envs), dtype)

    def write(self, name: str, start: int, stop: int, block: np.ndarray) -> None:
        """Env columns ``[start, stop)`` of a dataset made by :meth:`create`."""
        write_array(self._created[name], (slice(None), slice(start, stop)), block)

    def read_written(self, name: str, start: int, stop: int) -> np.ndarray:
        """Env columns ``[start, stop)`` of a dataset made by :meth:`create`, as written."""
        return np.asarray(h5py.Dataset(self._created[name][0])[:, start:stop])

    def set_attrs(self, attrs: Mapping[str, Any], name: str = "/") -> None:
        """Set attributes of the root (or of the object ``name``); None removes an attribute."""
        target = self._handle[name].attrs
        for key, value in attrs.items():
            if value is not None:
                target[key] = value
            elif key in target:
                del target[key]
