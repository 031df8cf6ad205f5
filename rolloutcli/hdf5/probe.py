"""Read an untrusted file's metadata first in a throwaway child process, so a libhdf5 crash or hang is caught.

Some corrupt files defeat libhdf5 itself, in C code that Python cannot interrupt: a variable-length string
(h5py's default for ``str`` attributes, e.g. ``rolloutcli_format``) whose global-heap object claims size 0
sends ``H5HG__cache_heap_deserialize`` into an endless loop; other corrupt metadata crashes it. Checks in
Python cannot foresee every such bug, so ``probe_metadata`` forks a child that opens the file, audits it and
reads what the commands will read from the metadata (every attribute, every chunk index, variable-length
datasets). When the child dies by a signal or does not finish in time, the file is refused as corrupt (exit 1)
and this process never parses it. The child costs a few milliseconds; data is never read there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings
from pathlib import Path

import h5py

from rolloutcli.errors import EXIT_BAD_DATA, RolloutError

DEFAULT_PROBE_TIMEOUT = 30.0  # seconds for the child to read the metadata (real files need milliseconds)
VLEN_PROBE_BYTES = 64 << 20  # variable-length datasets up to this declared size are read by the probe


def probe_metadata(path: Path, allow_external: bool = False, timeout: float | None = None) -> None:
    """Raise ``RolloutError`` (exit 1) when reading ``path``'s metadata crashes or hangs libhdf5.

    Other problems (not HDF5, unsafe links, corrupt but erroring metadata) are left to the caller, which
    finds them again with proper messages. Without ``os.fork`` (or memory for a child) nothing is probed.
    """
    timeout = DEFAULT_PROBE_TIMEOUT if timeout is None else timeout
    if not hasattr(os, "fork"):
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "fork() in a multi-threaded process"
            pid = os.fork()
    except OSError:
        return
    if pid == 0:  # the child: never returns, never runs cleanup code of the parent
        try:
            with contextlib.suppress(BaseException):
                _read_metadata(path, allow_external)
        finally:
            os._exit(0)
    status = _wait(pid, timeout)
    if status is None:
        raise RolloutError(
            f"{path}: reading the file's metadata did not finish in {timeout:.0f} s (libhdf5 loops forever on "
            "some corrupt files); the file is corrupt. Re-export it from its source.",
            exit_code=EXIT_BAD_DATA,
        )
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        raise RolloutError(
            f"{path}: libhdf5 crashed ({name}) while reading the file's metadata; the file is corrupt. "
            "Re-export it from its source.",
            exit_code=EXIT_BAD_DATA,
        )


def _wait(pid: int, timeout: float) -> int | None:
    """The child's wait status, or None after ``timeout`` seconds (the child is then killed)."""
    deadline = time.monotonic() + timeout
    delay = 0.0002
    reaped = False
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                reaped = True
                return status
            if time.monotonic() >= deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
    finally:
        if not reaped:  # timed out, or this process is being interrupted (SIGTERM / Ctrl-C)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def _read_metadata(path: Path, allow_external: bool) -> None:
    """In the child: open, audit, then touch what commands read from the metadata (hard links only)."""
    from rolloutcli.hdf5.safety import SafetyOptions, audit_file

    with h5py.File(path, "r") as handle:
        try:
            audit_file(path, handle, SafetyOptions(allow_external=allow_external))
        except RolloutError:
            return  # refused: the parent refuses it too, without reading more
        names: list[str] = []
        handle.visititems_links(lambda name, link: names.append(name) if isinstance(link, h5py.HardLink) else None)
        for obj in [handle, *(handle[name] for name in names)]:
            for key in obj.attrs:
                obj.attrs[key]  # variable-length strings live in the global heap
            if not isinstance(obj, h5py.Dataset) or obj.external or obj.is_virtual:
                continue
            if obj.chunks is not None:
                obj.id.chunk_iter(lambda info: None)  # walks the chunk index
            if h5py.check_vlen_dtype(obj.dtype) is not None or obj.dtype.kind == "O":
                if obj.size * obj.dtype.itemsize <= VLEN_PROBE_BYTES:
                    obj[()]
