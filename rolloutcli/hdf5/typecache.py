"""h5py's conversions between numpy dtypes and HDF5 datatypes, made once per type, and the attribute reads and
writes that use them.

h5py converts on every call: ``h5t.py_create`` (numpy dtype to HDF5 type) costs about 18 us, and a read or write
given no memory type pays it; ``TypeID.dtype`` (the other way) costs as much. An attribute's read through
``AttributeManager`` pays both, and its write both twice: about 0.2 ms an attribute, of which libhdf5's own work
is a quarter. A small file has a dozen attributes, read by the prober, written by a command (issue 39).

The caches hold what h5py returns, keyed by everything it is computed from: a numpy dtype by its ``str`` and its
metadata (where h5py marks variable-length strings), an HDF5 type by its encoding (``H5Tencode``, which holds
every property of the type). What cannot be keyed (compound and array dtypes, unhashable metadata) is converted
each time. ``read_attr`` and ``create_attr`` do exactly what h5py's ``attrs[name]`` and ``attrs.create`` do
(h5py 3.16), with the conversions cached: the same values, the same bytes (``tests/test_typecache.py``).
"""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np
from h5py._hl.base import array_for_new_object  # h5py's own making of an attribute's array

_LIMIT = 256  # types kept per cache (a file has a handful; a hostile one cannot grow the cache)
_MEMORY: dict[tuple[Any, ...], h5py.h5t.TypeID] = {}
_NUMPY: dict[bytes, np.dtype] = {}
_SPACES: dict[tuple[int, ...], h5py.h5s.SpaceID] = {}


def simple_space(shape: tuple[int, ...]) -> h5py.h5s.SpaceID:
    """``h5py.h5s.create_simple(shape)`` (rank 0: a scalar space), made once per shape (~11 us each; an output
    creates two dozen objects, most of a few shapes). libhdf5 copies a space it is given: never modify it."""
    found = _SPACES.get(shape)
    if found is None:
        found = h5py.h5s.create_simple(shape)
        if len(_SPACES) < _LIMIT:
            _SPACES[shape] = found
    return found


def memory_type(dtype: np.dtype, logical: bool = False) -> h5py.h5t.TypeID:
    """``h5py.h5t.py_create(dtype, logical=logical)``, made once per dtype (never modify what it returns)."""
    key = _dtype_key(dtype, logical)
    found = _MEMORY.get(key) if key is not None else None
    if found is None:
        found = h5py.h5t.py_create(dtype, logical=logical)
        if key is not None and len(_MEMORY) < _LIMIT:
            _MEMORY[key] = found
    return found


def _dtype_key(dtype: np.dtype, logical: bool) -> tuple[Any, ...] | None:
    if dtype.fields is not None or dtype.subdtype is not None:
        return None
    items: tuple[Any, ...] = ()
    if dtype.metadata:
        items = tuple(sorted(dtype.metadata.items()))
        try:
            hash(items)
        except TypeError:  # an enum's mapping: converted each time
            return None
    return (dtype.str, items, bool(logical))


def stored_dtype(tid: h5py.h5t.TypeID) -> np.dtype:
    """``tid.dtype``: the numpy dtype h5py reads an HDF5 type as, made once per type."""
    key = tid.encode()
    found = _NUMPY.get(key)
    if found is None:
        found = tid.dtype
        if len(_NUMPY) < _LIMIT:
            _NUMPY[key] = found
    return found


def read_attr(obj: Any, name: str) -> Any:
    """``obj.attrs[name]`` (``obj``: an h5py File, Group, Dataset or Datatype), as h5py reads it."""
    return read_attr_typed(obj, name)[0]


def read_attr_typed(obj: Any, name: str) -> tuple[Any, np.dtype]:
    """``obj.attrs[name]`` and the dtype h5py reads its stored type as (the attribute opened once)."""
    attr = h5py.h5a.open(obj.id, name.encode())
    dtype = stored_dtype(attr.get_type())
    shape = attr.shape
    if shape is None or dtype.subdtype is not None:  # an empty attribute, an array type: h5py's own way
        return obj.attrs[name], dtype
    arr = np.zeros(shape, dtype=dtype, order="C")
    attr.read(arr, mtype=memory_type(dtype))
    string_info = h5py.check_string_dtype(dtype)
    if string_info and string_info.length is None:  # variable-length strings: bytes to str, as h5py does
        arr = np.array([b.decode("utf-8", "surrogateescape") for b in arr.flat], dtype=dtype).reshape(arr.shape)
    return arr[()] if arr.ndim == 0 else arr, dtype


def create_attr(obj: Any, name: str, value: Any, dtype: Any = None) -> None:
    """``obj.attrs.create(name, value, dtype=dtype)``: the same attribute, the same bytes. A committed type, an
    array dtype or an empty value go through h5py."""
    if isinstance(dtype, h5py.Datatype) or isinstance(value, h5py.Empty):
        obj.attrs.create(name, value, dtype=dtype)
        return
    data = array_for_new_object(value, specified_dtype=dtype)
    dtype = data.dtype if dtype is None else np.dtype(dtype)
    if dtype.subdtype is not None:
        obj.attrs.create(name, value, dtype=dtype)
        return
    data = np.asarray(data, dtype=dtype)
    key, oid = name.encode(), obj.id
    if h5py.h5a.exists(oid, key):
        h5py.h5a.delete(oid, key)
    attr = h5py.h5a.create(oid, key, memory_type(dtype, logical=True), simple_space(data.shape))
    try:
        attr.write(data, mtype=memory_type(dtype))
    except BaseException:
        attr.close()
        h5py.h5a.delete(oid, key)
        raise
    attr.close()
