"""Opening a file read-only with one file access property list per process.

``h5py.File(path, "r")`` makes a new access list on every open (``make_fapl``: ~0.1 ms, a quarter of a small
file's open and close) with the library's defaults. A training run is thousands of small files (issue 39), each
opened by the prober and again by the command, so the list is made once here: the same properties h5py sets
(format bounds earliest to latest, no alignment, the default caches and file locking), the same ``h5py.File``.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py

_ACCESS: dict[int, h5py.h5p.PropFAID] = {}  # by process id: made in this process, not inherited from a fork


def open_read(path: Path | str) -> h5py.File:
    """``h5py.File(path, "r")``: the same file object, the same errors (libhdf5's ``H5Fopen`` raises them)."""
    access = _ACCESS.get(os.getpid())
    if access is None:
        access = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
        access.set_libver_bounds(h5py.h5f.LIBVER_EARLIEST, h5py.h5f.LIBVER_LATEST)
        _ACCESS.clear()
        _ACCESS[os.getpid()] = access
    return h5py.File(h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY, fapl=access))
