"""Copy a file's bytes in the kernel, optionally in a background thread that overlaps the caller's work.

``gae`` carries every dataset it does not touch over to its output by copying the whole input file (nothing
decoded), then adds its datasets to the copy. This module imports neither h5py nor torch, so the copy can
start before either is loaded.

The copy uses ``os.copy_file_range`` (no user-space buffer; a reflink where the filesystem offers one) in
steps of ``COPY_STEP`` bytes. After each step it asks the kernel to start writing that step to disk
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait for the disk), so the fsync that publishes
the output finds little left to write. Measured on a 1.06 GB file here: copy 0.27 s then fsync 0.25 s;
with write-back started per step, 0.42-0.49 s for both.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path

COPY_STEP = 64 << 20  # bytes per kernel copy call: write-back starts (and progress moves) every 64 MiB
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _load_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to disk; never waits for the
    disk and never fails (a hint: the publishing fsync is what guarantees durability)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def copy_file_bytes(
    source: Path,
    target: Path,
    advance: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Copy ``source``'s bytes over ``target`` in the kernel, ``COPY_STEP`` bytes at a time.

    Calls ``advance(bytes)`` after each step; returns early (leaving a partial file) once ``stop`` is set.
    Falls back to ``shutil.copyfile`` where ``copy_file_range`` is missing or refused (other filesystems).

    Raises:
        OSError: the copy failed (disk full, file-size limit, I/O error).
    """
    size = os.path.getsize(source)
    with open(source, "rb") as src, open(target, "wb") as dst:
        copied = 0
        try:
            while copied < size:
                if stop is not None and stop.is_set():
                    return
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


class BackgroundCopy:
    """``copy_file_bytes(source, target)`` in a thread (``copy_file_range`` releases the GIL).

    Use as a context manager: leaving the block stops the copy at its next step and waits for the thread,
    so nothing writes into ``target`` afterwards (it may be removed). :meth:`wait` blocks until the copy is
    complete, reporting progress from the *calling* thread, and raises the copy's ``OSError`` if it failed.
    """

    def __init__(self, source: Path, target: Path) -> None:
        self.source, self.target = Path(source), Path(target)
        self.size = os.path.getsize(self.source)
        self._copied = 0
        self._stop = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rolloutcli-copy", daemon=True)

    def _count(self, nbytes: int) -> None:
        self._copied += nbytes

    def _run(self) -> None:
        try:
            copy_file_bytes(self.source, self.target, self._count, self._stop)
        except BaseException as exc:  # handed to the waiting thread
            self._error = exc
        finally:
            self._done.set()

    def __enter__(self) -> BackgroundCopy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def wait(self, advance: Callable[[int], None] | None = None, poll: float = 0.05) -> None:
        """Block until the copy is complete, calling ``advance(new bytes)`` about every ``poll`` seconds.

        Raises:
            OSError: the copy failed.
        """
        reported = 0
        while True:
            finished = self._done.wait(poll)
            if advance is not None and self._copied > reported:
                copied = self._copied
                advance(copied - reported)
                reported = copied
            if finished:
                break
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._stop.is_set():
            raise OSError(errno.ECANCELED, "the copy was stopped")

    @property
    def done(self) -> bool:
        return self._done.is_set()


__all__ = ["COPY_STEP", "BackgroundCopy", "copy_file_bytes", "start_writeback"]
