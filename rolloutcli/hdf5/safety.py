"""Open untrusted HDF5 files safely, and turn libhdf5's failures into one-line ``RolloutError``s.

``open_hdf5`` opens read-only, regular files only: the metadata is first read in a child process, a prober
(:mod:`rolloutcli.hdf5.probe`), then the file is audited (:mod:`rolloutcli.hdf5.audit`) before any data is read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

import h5py

from rolloutcli.errors import EXIT_BAD_DATA, EXIT_IO, RolloutError
from rolloutcli.hdf5.access import open_read
from rolloutcli.hdf5.audit import audit_file
from rolloutcli.hdf5.identity import identity
from rolloutcli.hdf5.limits import SafetyOptions, check_regular_file
from rolloutcli.hdf5.listing import Listing, from_json
from rolloutcli.hdf5.probe import probe_metadata

# Operating-system faults (as opposed to corrupt content) that h5py reports with an errno.
_SYSTEM_IO_ERRNOS = {
    errno.EIO,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.EFBIG,
    errno.EMFILE,
    errno.ENFILE,
    errno.ENOMEM,
}
# libhdf5 reports the OS error of a failed read/write only inside its message text.
_ERRNO_IN_TEXT = re.compile(r"errno = (\d+)")
OUT_OF_MEMORY_FIX = "Lower --max-memory (the memory budget) or free memory, and try again"
# libhdf5's words for a failed allocation (a MemoryError in Python)
_MEMORY_TEXTS = ("memory allocation failed", "cannot allocate memory", "out of memory", "can't allocate")
# What to do about an OS fault while writing an output.
_WRITE_FIXES = {
    errno.ENOSPC: "Free disk space or write to another disk",
    errno.EDQUOT: "Free space within your disk quota or write to another disk",
    errno.EFBIG: "The output exceeds the file size limit (ulimit -f) or the file system's largest file; "
    "write to another file system",
    errno.EROFS: "The file system is read-only; choose a writable folder",
    errno.EACCES: "Choose a writable folder",
    errno.EPERM: "Choose a writable folder",
    errno.ENOMEM: OUT_OF_MEMORY_FIX,
}

# HDF5 raises many exception types for corrupt or hostile files.
HDF5_ERRORS = (OSError, KeyError, RuntimeError, TypeError, ValueError, SystemError, IndexError, AttributeError)


# Exceptions of failed writes, kept alive on purpose: their tracebacks hold the h5py objects of the output,
# and freeing those makes libhdf5 flush a file whose writes failed, which segfaults (hdf5-facts.md). The
# CLI ends such a run with ``os._exit`` so the interpreter's shutdown never frees them either.
_FAILED_WRITES: list[BaseException] = []


def system_errno(exc: BaseException) -> int | None:
    """The operating-system fault (disk full, file too large, EIO, read-only...) behind ``exc``, if any.

    h5py puts libhdf5's OS error in the message (``errno = 27``), not in ``errno``; a failed write also fails
    the close that follows, so the chain is searched too.
    """
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 8:
        if isinstance(current, OSError) and current.errno in _SYSTEM_IO_ERRNOS:
            return current.errno
        match = _ERRNO_IN_TEXT.search(str(current))
        if match and int(match.group(1)) in _SYSTEM_IO_ERRNOS:
            return int(match.group(1))
        current = current.__cause__ or current.__context__
        seen += 1
    return None


def translate_write_error(dst: Path | str, exc: BaseException, source: Path | str | None = None) -> RolloutError:
    """An exception raised while an output was being written, as a one-line ``RolloutError``: an OS fault is
    about the output (exit 3); anything else came from reading the input ``source`` (object copy and block reads
    decode its chunks)."""
    code = system_errno(exc)
    if code is not None:
        _FAILED_WRITES.append(exc)
        fix = _WRITE_FIXES.get(code, "Check the disk and try again")
        return RolloutError(
            f"{dst}: cannot write the output: {os.strerror(code)}. {fix}; nothing was written.", exit_code=EXIT_IO
        )
    return translate_hdf5_error(dst if source is None else source, exc)


def translate_hdf5_error(path: Path | str, exc: BaseException, field: str | None = None) -> RolloutError:
    """Turn any libhdf5/h5py exception into a one-line ``RolloutError`` naming file and field."""
    text = str(exc)
    where = f"{path}: field '{field}'" if field else f"{path}"
    if "file signature not found" in text:
        return RolloutError(
            f"{where}: not an HDF5 file (file signature not found). rolloutcli reads HDF5 rollout files; "
            "check the path.",
            exit_code=EXIT_BAD_DATA,
        )
    if "truncated file" in text:
        return RolloutError(
            f"{where}: the file is truncated (shorter than its header says). Copy it again from the source.",
            exit_code=EXIT_BAD_DATA,
        )
    if "already open for write" in text or "file is already open" in text:
        return RolloutError(
            f"{where}: the file is marked as open for writing (a writer crashed or is still running). "
            "If no program is writing it, run 'h5clear -s' on it.",
            exit_code=EXIT_IO,
        )
    if "unable to lock file" in text:
        return RolloutError(
            f"{where}: the file is locked by another process. Wait for the writer to finish and try again.",
            exit_code=EXIT_IO,
        )
    if isinstance(exc, PermissionError) or "Permission denied" in text:
        return RolloutError(f"{where}: permission denied. Check the file's permissions.", exit_code=EXIT_IO)
    code = system_errno(exc)
    if isinstance(exc, MemoryError) or code == errno.ENOMEM or any(t in text.lower() for t in _MEMORY_TEXTS):
        return RolloutError(f"{where}: out of memory while reading it. {OUT_OF_MEMORY_FIX}.", exit_code=EXIT_IO)
    if code is not None:
        return RolloutError(f"{where}: I/O error: {os.strerror(code)}.", exit_code=EXIT_IO)
    first = text.splitlines()[0] if text else type(exc).__name__
    return RolloutError(
        f"{where}: data unreadable, file corrupt ({first}). Re-export the file from its source.",
        exit_code=EXIT_BAD_DATA,
    )


@contextlib.contextmanager
def open_listed(path: Path | str, options: SafetyOptions | None = None) -> Iterator[tuple[h5py.File, Listing | None]]:
    """Open ``path`` read-only after checking it is a regular file and probing its metadata, and audit it before
    yielding it (unless the probe's audit found the file it opened clean: the same identity as this one's
    descriptor means the same bytes), with the probe's listing of it (None: the caller lists it); every HDF5
    exception raised meanwhile becomes a ``RolloutError``."""
    path = Path(path)
    options = options or SafetyOptions()
    check_regular_file(path)
    probed = probe_metadata(path, options)
    try:
        handle = open_read(path)
    except HDF5_ERRORS as exc:
        raise translate_hdf5_error(path, exc) from exc
    try:
        listing = None
        try:
            if probed.clean is None or identity(os.fstat(handle.id.get_vfd_handle())) != probed.clean:
                audit_file(path, handle, options)
            elif probed.listing is not None:
                listing = from_json(probed.listing)
        except HDF5_ERRORS as exc:
            raise translate_hdf5_error(path, exc) from exc
        yield handle, listing
    finally:
        with contextlib.suppress(*HDF5_ERRORS):
            handle.close()


@contextlib.contextmanager
def open_hdf5(path: Path | str, options: SafetyOptions | None = None) -> Iterator[h5py.File]:
    """``open_listed``'s file alone."""
    with open_listed(path, options) as (handle, _):
        yield handle
