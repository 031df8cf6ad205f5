"""Open untrusted HDF5 files safely: read-only, regular files only, audited before any data is read.

HDF5 can read other files on disk through external links, soft links (which can alias anything),
external raw storage and virtual datasets; unknown filter ids make libhdf5 load plugin code; a tiny
file can declare a huge dataset or chunk; a filtered chunk shorter than its checksum crashes libhdf5.
``open_hdf5`` walks every link from the root with ``visititems_links`` (``visititems`` skips soft and
external links) and checks each dataset's layout *before* any dataset is read.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import h5py

from rolloutcli.errors import EXIT_BAD_DATA, EXIT_IO, EXIT_UNSAFE, RolloutError
from rolloutcli.hdf5.limits import (
    SafetyOptions,
    check_regular_file,
)

# gzip 1, shuffle 2, fletcher32 3, scaleoffset 6, lzf 32000: built into h5py, no plugin search.
ALLOWED_FILTERS = {1: "gzip", 2: "shuffle", 3: "fletcher32", 6: "scaleoffset", 32000: "lzf"}
FLETCHER32_BYTES = 4  # a fletcher32 chunk shorter than its checksum crashes libhdf5 when read

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
}
# libhdf5 reports the OS error of a failed read/write only inside its message text.
_ERRNO_IN_TEXT = re.compile(r"errno = (\d+)")
# What to do about an OS fault while writing an output.
_WRITE_FIXES = {
    errno.ENOSPC: "Free disk space or write to another disk",
    errno.EDQUOT: "Free space within your disk quota or write to another disk",
    errno.EFBIG: "The output exceeds the file size limit (ulimit -f) or the file system's largest file; "
    "write to another file system",
    errno.EROFS: "The file system is read-only; choose a writable folder",
    errno.EACCES: "Choose a writable folder",
    errno.EPERM: "Choose a writable folder",
}

# HDF5 raises many exception types for corrupt or hostile files.
HDF5_ERRORS = (OSError, KeyError, RuntimeError, TypeError, ValueError, SystemError, IndexError, AttributeError)


# Exceptions of failed writes, kept alive on purpose: their tracebacks hold the h5py objects of the output,
# and freeing those makes libhdf5 flush a file whose writes failed, which segfaults (hdf5-facts.md). The
# CLI ends such a run with ``os._exit`` so the interpreter's shutdown never frees them either.
_FAILED_WRITES: list[BaseException] = []


def system_errno(exc: BaseException) -> int | None:
    """The operating-system fault (disk full, file too large, EIO, read-only...) behind ``exc``, if any.

    h5py raises ``OSError`` without ``errno`` for libhdf5 failures and puts the OS error in the message
    (``errno = 27``); a failed write also fails the close that follows, so the chain is searched too.
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
    """An exception raised while an output was being written, as a one-line ``RolloutError``.

    Operating-system faults (disk full, file too large, read-only file system) are I/O faults about the
    output (exit 3); anything else came from reading the untrusted input ``source`` (object copy and block
    reads decode its chunks) and is translated as a read error of that file.
    """
    if isinstance(exc, RolloutError):
        return exc
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
    if isinstance(exc, MemoryError):
        return RolloutError(f"{where}: out of memory. Lower --max-memory.", exit_code=EXIT_IO)
    code = system_errno(exc)
    if code is not None:
        return RolloutError(f"{where}: I/O error: {os.strerror(code)}.", exit_code=EXIT_IO)
    first = text.splitlines()[0] if text else type(exc).__name__
    return RolloutError(
        f"{where}: data unreadable, file corrupt ({first}). Re-export the file from its source.",
        exit_code=EXIT_BAD_DATA,
    )


def _filter_ids(dataset: h5py.Dataset) -> list[int]:
    plist = dataset.id.get_create_plist()
    return [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]


def audit_dataset(path: Path, name: str, dataset: h5py.Dataset, options: SafetyOptions) -> list[str]:
    """Problems that make reading ``dataset`` unsafe (empty list when it is safe)."""
    unsafe: list[str] = []
    allow = options.allow_external
    if not allow and dataset.external:
        unsafe.append(
            f"{path}: field '{name}': expected data stored in the file, found external raw storage "
            f"in another file; refusing to read outside the file. Pass --allow-external to trust it."
        )
        return unsafe
    for external in dataset.external or ():
        # Trusted (--allow-external) raw storage still must be a regular file: a FIFO hangs the read forever,
        # a device such as /dev/zero or /dev/urandom never ends.
        special = _special_file(path, external[0])
        if special:
            unsafe.append(
                f"{path}: field '{name}': expected external raw storage in a regular file, found {special}; "
                "refusing to read it even with --allow-external."
            )
            return unsafe
    if not allow and dataset.is_virtual:
        unsafe.append(
            f"{path}: field '{name}': expected data stored in the file, found a virtual dataset "
            f"that reads other files; refusing. Pass --allow-external to trust it."
        )
        return unsafe
    if dataset.dtype.kind not in "biufcSUOV":
        return unsafe
    itemsize = dataset.dtype.itemsize
    declared = math.prod(dataset.shape or ()) * itemsize  # math.prod is exact; np.prod overflows
    if declared > options.max_dataset_bytes:
        unsafe.append(
            f"{path}: field '{name}': expected at most {options.max_dataset_bytes} bytes, found a "
            f"declared size of {declared} bytes (shape {tuple(dataset.shape)}); refusing to read it."
        )
        return unsafe
    for filter_id in _filter_ids(dataset):
        if filter_id not in ALLOWED_FILTERS:
            unsafe.append(
                f"{path}: field '{name}': expected filters gzip/shuffle/fletcher32/lzf/scaleoffset, "
                f"found unknown filter id {filter_id}; refusing (it would load plugin code). "
                "Re-save the file with a standard filter."
            )
            return unsafe
    if dataset.chunks is not None:
        chunk_bytes = math.prod(dataset.chunks) * itemsize
        if chunk_bytes > options.max_chunk_bytes:
            unsafe.append(
                f"{path}: field '{name}': expected chunks of at most {options.max_chunk_bytes} bytes, "
                f"found chunks of {chunk_bytes} bytes ({dataset.chunks}); refusing (decompression "
                "bomb). Re-save with smaller chunks."
            )
            return unsafe
        short, end = _chunk_extent(dataset)
        if _filter_ids(dataset) and short is not None and short < FLETCHER32_BYTES:
            unsafe.append(
                f"{path}: field '{name}': expected filtered chunks of at least {FLETCHER32_BYTES} "
                f"bytes, found a stored chunk of {short} bytes; the file is corrupt."
            )
            return unsafe
    elif not dataset.external and not dataset.is_virtual and dataset.id.get_offset() is not None:
        end = dataset.id.get_offset() + dataset.id.get_storage_size()
    else:
        end = 0
    # Stored data past the end of the file: reading it fails, and copying it (HDF5 object copy) hits a
    # double free in libhdf5's error path (H5D__chunk_copy, fixed upstream after HDF5 2.0.0).
    size = os.path.getsize(dataset.file.filename)
    if end > size:
        unsafe.append(
            f"{path}: field '{name}': expected data stored inside the file ({size} bytes), found data stored "
            f"up to byte {end}; the file is corrupt or truncated."
        )
    return unsafe


def _special_file(path: Path, name: str | bytes) -> str | None:
    """Describe ``name`` (an external storage file) when it is not a regular file, else None.

    libhdf5 resolves a relative name against the working directory or the file's folder: both are checked.
    """
    text = os.fsdecode(name)
    candidates = [Path(text)] if os.path.isabs(text) else [Path(text), path.parent / text]
    for candidate in candidates:
        try:
            mode = os.stat(candidate).st_mode
        except OSError:
            continue
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "a device or socket"
            return f"'{candidate}', {kind}"
    return None


def _chunk_extent(dataset: h5py.Dataset) -> tuple[int | None, int]:
    """(smallest stored chunk size or None when no chunk is allocated, end offset of the last stored byte)."""
    smallest: list[int | None] = [None]
    end = [0]

    def visit(info: h5py.h5d.StoreInfo) -> None:
        current = smallest[0]
        if current is None or info.size < current:
            smallest[0] = info.size
        end[0] = max(end[0], info.byte_offset + info.size)

    try:
        dataset.id.chunk_iter(visit)
    except AttributeError:  # older libhdf5 without H5Dchunk_iter
        for index in range(dataset.id.get_num_chunks()):
            visit(dataset.id.get_chunk_info(index))
    return smallest[0], end[0]


def audit_file(path: Path, handle: h5py.File, options: SafetyOptions) -> None:
    """Walk every link from the root; raise ``RolloutError`` (exit 4) listing every unsafe object."""
    unsafe: list[str] = []
    datasets: list[str] = []

    def visit(name: str, link: h5py.HardLink | h5py.SoftLink | h5py.ExternalLink) -> None:
        if isinstance(link, h5py.ExternalLink):
            if not options.allow_external:
                unsafe.append(
                    f"{path}: field '{name}': expected data inside the file, found an external link "
                    f"to another file; refusing to follow it. Pass --allow-external to trust it."
                )
        elif isinstance(link, h5py.SoftLink):
            if not options.allow_external:
                unsafe.append(
                    f"{path}: field '{name}': expected a dataset or group, found a soft link to "
                    f"'{link.path}'; refusing to follow it. Pass --allow-external to trust it."
                )
        else:
            datasets.append(name)

    handle.visititems_links(visit)
    if unsafe:
        raise RolloutError.many(path, unsafe, exit_code=EXIT_UNSAFE)
    groups = {"": h5py.h5o.get_info(handle.id).addr}
    for name in datasets:
        # Only hard links remain here, so opening them cannot leave the file.
        obj = handle.get(name, getlink=False)
        if isinstance(obj, h5py.Dataset):
            unsafe.extend(audit_dataset(path, name, obj, options))
        elif isinstance(obj, h5py.Group):
            address = h5py.h5o.get_info(obj.id).addr
            ancestors = ["/".join(name.split("/")[:depth]) for depth in range(name.count("/") + 1)]
            loop = next((a for a in ancestors if groups.get(a) == address), None)
            if loop is not None:
                unsafe.append(
                    f"{path}: field '{name}': expected a tree of groups, found a hard link back to its own "
                    f"ancestor group '/{loop}' (a cycle); refusing. Re-save the file without the loop."
                )
            groups[name] = address
    if unsafe:
        raise RolloutError.many(path, unsafe, exit_code=EXIT_UNSAFE)


@contextlib.contextmanager
def open_hdf5(path: Path | str, options: SafetyOptions | None = None) -> Iterator[h5py.File]:
    """Open ``path`` read-only after checking it is a regular file, and audit it before yielding.

    Every HDF5 exception raised while opening or auditing becomes a ``RolloutError``; the metadata is first
    read in a throwaway child (``probe.probe_metadata``), so a file that crashes or hangs libhdf5 is refused.
    """
    from rolloutcli.hdf5.probe import probe_metadata

    path = Path(path)
    options = options or SafetyOptions()
    check_regular_file(path)
    probe_metadata(path, options.allow_external)  # a libhdf5 crash or hang on this file happens in a child
    try:
        handle = h5py.File(path, "r")
    except HDF5_ERRORS as exc:
        raise translate_hdf5_error(path, exc) from exc
    try:
        try:
            audit_file(path, handle, options)
        except HDF5_ERRORS as exc:
            raise translate_hdf5_error(path, exc) from exc
        yield handle
    finally:
        with contextlib.suppress(*HDF5_ERRORS):
            handle.close()
