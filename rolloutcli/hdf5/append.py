"""A rollout file written as it is recorded: datasets chunked and resizable along time, extended one block of
steps at a time, published at its final name only by :meth:`AppendFile.commit` (``atomic_file``: a temporary
beside it, fsynced and renamed). Anything else (an exception, Ctrl-C, a full disk, a writer never closed)
removes the temporary, so no half file ever sits under the final name.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.hdf5.atomic import atomic_file
from rolloutcli.hdf5.writer import RolloutOutput

COMPRESSIONS = (None, "gzip", "lzf")
_CHUNK_BYTES = 1 << 20  # chunks of about a MiB: HDF5's sweet spot for sequential writes and compression


def _abort(stack: contextlib.ExitStack) -> None:
    """Leave the ``atomic_file`` block by an exception: it removes the temporary and publishes nothing."""
    error = RuntimeError("recording aborted")
    with contextlib.suppress(BaseException):
        stack.__exit__(RuntimeError, error, None)


class AppendFile:
    """A new HDF5 rollout file at a temporary path beside ``dst``, open until :meth:`commit` or :meth:`abort`."""

    def __init__(self, dst: Path | str, *, compression: str | None = None, overwrite: bool = False) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression: expected one of {COMPRESSIONS}, found {compression!r}")
        self.dst, self.compression = Path(dst), compression
        stack = contextlib.ExitStack()
        try:
            # a library call (RolloutWriter): its user replaces a file with overwrite=True, not the CLI's option
            tmp = stack.enter_context(atomic_file(self.dst, overwrite=overwrite, overwrite_option="overwrite=True"))
            self.out = stack.enter_context(RolloutOutput(tmp, self.dst, early_sync=True))
        except BaseException:
            _abort(stack)
            raise
        self._stack = stack
        self._datasets: dict[str, Any] = {}  # name -> the h5py dataset extend() writes
        self._finalizer = weakref.finalize(self, _abort, stack)  # a writer dropped unclosed leaves nothing behind

    @property
    def file(self) -> Any:
        return self.out.file

    def _create(self, name: str, block: np.ndarray) -> Any:
        row = block[0].nbytes if block.shape[0] else block.itemsize
        # chunks of a power of two steps: the writer's blocks (a power of two steps too) cover whole chunks,
        # which HDF5 writes straight to the file (no chunk cache: each chunk is written once). A first block
        # shorter than a chunk is a whole short recording: one chunk of its length, not a mostly empty MiB.
        fit = max(1, min(_CHUNK_BYTES // max(row, 1), 1 << 16))
        rows = min(1 << (fit.bit_length() - 1), max(1, block.shape[0]))
        self.out._parents(name)
        dataset = self.out._do(
            lambda: self.file.create_dataset(
                name,
                shape=(0, *block.shape[1:]),
                maxshape=(None, *block.shape[1:]),
                dtype=block.dtype,
                chunks=(rows, *block.shape[1:]),
                compression=self.compression,
                track_times=False,
                rdcc_nbytes=0,
            )
        )
        self._datasets[name] = dataset
        return dataset

    def extend(self, name: str, start: int, block: np.ndarray) -> None:
        """Write ``block [k, ...]`` at steps ``[start, start + k)`` of ``name`` (created at its first block;
        steps before it read as zeros)."""
        dataset = self._datasets.get(name) or self._create(name, block)
        stop = start + block.shape[0]
        if dataset.shape[0] < stop:
            self.out._do(lambda: dataset.resize(stop, axis=0))
        self.out._do(lambda: dataset.write_direct(np.ascontiguousarray(block), dest_sel=np.s_[start:stop]))

    def pad(self, name: str, steps: int) -> None:
        """Grow ``name`` to ``steps`` steps (zeros)."""
        dataset = self._datasets.get(name) or self.file[name]
        if dataset.shape[0] < steps:
            self.out._do(lambda: dataset.resize(steps, axis=0))

    def put(self, name: str, value: np.ndarray, attrs: Mapping[str, Any] | None = None) -> None:
        self.out.put(name, value)
        if attrs:
            self.out.set_attrs(attrs, name)

    def set_attrs(self, attrs: Mapping[str, Any], name: str = "") -> None:
        self.out.set_attrs(attrs, name)

    def sync_early(self) -> None:
        """Have the disk start on what was written so far, while writing goes on (``RolloutOutput.sync_early``)."""
        self.out.sync_early()

    def commit(self) -> None:
        """Close the file and publish it at ``dst`` (fsynced, renamed)."""
        self._finalizer.detach()
        self._stack.close()

    def abort(self) -> None:
        """Remove the temporary; nothing is published."""
        if self._finalizer.detach() is not None:
            _abort(self._stack)
