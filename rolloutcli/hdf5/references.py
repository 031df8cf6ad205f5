"""Object references in an output's copied data and attributes: re-pointed from the source's objects to the
output's objects of the renamed paths (``RolloutOutput.copy_attrs`` and ``repoint_references``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import h5py
import numpy as np

from rolloutcli.hdf5.safety import HDF5_ERRORS

REPOINT_ITEMS = 1 << 16  # references re-pointed per block (each is a Python object and an HDF5 lookup)


def row_blocks(dataset: h5py.Dataset, stored_bytes: int) -> list[tuple[slice, ...]]:
    """Indexes of ``dataset`` in blocks of rows of about ``REPOINT_ITEMS`` values (``()``: a scalar); none when
    nothing was ever written (every value is the fill value: a null reference)."""
    if not dataset.shape:
        return [()]
    if stored_bytes == 0:
        return []
    step = max(1, REPOINT_ITEMS // max(math.prod(dataset.shape[1:]), 1))
    return [(slice(start, start + step),) for start in range(0, dataset.shape[0], step)]


def holds_references(dtype: np.dtype) -> bool:
    """Whether values of ``dtype`` hold HDF5 object or region references (compound members and variable-length
    sequences included)."""
    if dtype.names:
        return any(holds_references(dtype.fields[name][0]) for name in dtype.names)
    if dtype.subdtype is not None:
        return holds_references(dtype.subdtype[0])
    if h5py.check_dtype(ref=dtype) is not None:
        return True
    inner = h5py.check_dtype(vlen=dtype)
    return isinstance(inner, np.dtype) and holds_references(inner)


DANGLING = object()


def repoint(value: Any, source: h5py.File, out: h5py.File, rename: Callable[[str], str | None]) -> Any:
    """``value`` with every object reference into ``source`` replaced by one to the renamed object of ``out``;
    ``DANGLING`` when one cannot be (no such object, a region reference)."""
    if isinstance(value, h5py.RegionReference):
        return DANGLING
    if isinstance(value, h5py.Reference):
        if not value:
            return value
        try:
            target = rename(source[value].name.lstrip("/"))
        except HDF5_ERRORS:  # the input's own reference points nowhere (its object deleted): no target to keep
            return DANGLING
        return out[target].ref if target is not None and (target == "" or target in out) else DANGLING
    if isinstance(value, np.ndarray) and value.dtype.names:
        copy = value.copy()
        for field in value.dtype.names:
            part = repoint(value[field], source, out, rename)
            if part is DANGLING:
                return DANGLING
            copy[field] = part
        return copy
    if isinstance(value, np.ndarray) and value.dtype.kind == "O":  # variable-length data: arrays of arrays
        copy = np.empty(value.shape, dtype=object)
        for index, item in np.ndenumerate(value):
            copy[index] = part = repoint(item, source, out, rename)
            if part is DANGLING:
                return DANGLING
        return copy
    return value
