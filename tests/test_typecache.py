"""``hdf5.typecache``: attributes read and written with cached type conversions give what h5py gives, value for
value and byte for byte, and the caches key every property the conversion reads."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from rolloutcli.hdf5.typecache import create_attr, memory_type, read_attr, read_attr_typed, stored_dtype

VALUES: list[tuple[Any, Any]] = [  # (value, dtype given to create: None = h5py's choice)
    ("trajectories", None),
    ("ünïcode", None),
    (b"raw bytes", None),
    (1.0, None),
    (np.float32(1.5), None),
    (np.float16(2.5), None),
    (7, None),
    (np.uint8(200), None),
    (np.int64(-3), ">i8"),
    (3.25, ">f8"),
    (True, None),
    (np.bool_(False), None),
    (np.arange(6, dtype="<i4").reshape(2, 3), None),
    (np.arange(4, dtype=">f4"), None),
    (["a", "bc", "déf"], None),
    ([b"x", b"yz"], None),
    (np.array([b"ab", b"c"], dtype="S2"), None),
    (np.zeros(0, dtype="<f8"), None),
    (np.array([[1, 2, 3]], dtype="<i2"), np.dtype(("<i2", (3,)))),  # an array type: h5py's own path
    (np.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f8")]), None),
    (h5py.Empty("f"), None),
    (np.array([1, 0], dtype="u1"), h5py.enum_dtype({"OFF": 0, "ON": 1}, basetype="u1")),
    ("fixed ascii", h5py.string_dtype("ascii", 16)),
    ("vlen ascii", h5py.string_dtype("ascii")),
]


def _write(path: Path, fast: bool, twice: bool = False) -> None:
    with h5py.File(path, "w", track_order=False) as handle:
        group = handle.create_group("g")
        for _ in range(2 if twice else 1):  # the second time over existing attributes
            for i, (value, dtype) in enumerate(VALUES):
                for obj in (handle, group):
                    if fast:
                        create_attr(obj, f"a{i}", value, dtype)
                    else:
                        obj.attrs.create(f"a{i}", value, dtype=dtype)


@pytest.mark.parametrize("twice", [False, True])
def test_create_attr_writes_h5py_bytes(tmp_path: Path, twice: bool) -> None:
    ours, theirs = tmp_path / "ours.h5", tmp_path / "theirs.h5"
    _write(ours, True, twice)
    _write(theirs, False, twice)
    assert hashlib.sha256(ours.read_bytes()).digest() == hashlib.sha256(theirs.read_bytes()).digest()


def _same(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs)
    if isinstance(theirs, h5py.Empty):
        assert ours.dtype == theirs.dtype
    elif isinstance(theirs, np.ndarray):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert ours.dtype.metadata == theirs.dtype.metadata
        assert ours.tobytes() == theirs.tobytes() if ours.dtype.kind != "O" else ours.tolist() == theirs.tolist()
    else:
        assert ours == theirs and getattr(ours, "dtype", None) == getattr(theirs, "dtype", None)


def test_read_attr_gives_h5py_values(tmp_path: Path) -> None:
    path = tmp_path / "attrs.h5"
    _write(path, False)
    with h5py.File(path, "r") as handle:
        for obj in (handle, handle["g"]):
            for name in obj.attrs:
                _same(read_attr(obj, name), obj.attrs[name])
                _same(read_attr(obj, name), obj.attrs[name])  # from the caches
                assert read_attr_typed(obj, name)[1] == obj.attrs.get_id(name).dtype


def test_missing_attribute_raises_as_h5py(tmp_path: Path) -> None:
    path = tmp_path / "attrs.h5"
    _write(path, False)
    with h5py.File(path, "r") as handle:
        with pytest.raises(KeyError):
            handle.attrs["nope"]
        with pytest.raises(KeyError):
            read_attr(handle, "nope")


def test_caches_tell_types_apart() -> None:
    """Dtypes numpy calls equal (a variable-length string and a plain object) and HDF5 types that differ only
    in their byte order or character set convert as h5py converts them, each."""
    assert np.dtype("O") == h5py.string_dtype()  # numpy ignores the metadata h5py reads
    for dtype in (h5py.string_dtype(), h5py.string_dtype("ascii"), np.dtype("<f4"), np.dtype(">f4")):
        for logical in (False, True):
            assert memory_type(dtype, logical) == h5py.h5t.py_create(dtype, logical=logical)
            assert memory_type(dtype, logical).dtype == h5py.h5t.py_create(dtype, logical=logical).dtype
    for dtype in (h5py.string_dtype(), h5py.string_dtype("ascii"), np.dtype("<i4"), np.dtype(">i4")):
        tid = h5py.h5t.py_create(dtype, logical=True)
        assert stored_dtype(tid) == tid.dtype
        assert h5py.check_string_dtype(stored_dtype(tid)) == h5py.check_string_dtype(tid.dtype)
