"""What a reader takes from a file's metadata: its datasets, committed datatypes and root attributes.

The metadata probe's prober (:mod:`rolloutcli.hdf5.probe_helper`) reads all of it anyway, in its own process, to
find the files that crash libhdf5; it sends this listing back with its verdict, as JSON, and a reader that
opens the same file (the same identity) takes it instead of walking the file again (about 2 ms of a small
file's few: issue 39). The listing travels only when JSON gives back exactly what the reader would have found;
otherwise (an unusual dtype, an attribute JSON cannot hold) the reader lists the file itself. Also here: the
test the readers' and writers' low-level whole-dataset paths share (``selects_all``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import h5py
import numpy as np
from h5py._hl.filters import get_filters  # h5py's own reading of a dataset's filters

from rolloutcli.hdf5.schema import DatasetInfo
from rolloutcli.hdf5.typecache import read_attr

ATTR_ITEMS = 4096  # a longer array attribute is described, not listed (a 16 MB one would be 16M Python ints)
PLAIN_KINDS = "biufc"  # numeric dtypes: no variable-length data, no members; they travel as their ``dtype.str``


class Listing(NamedTuple):
    datasets: dict[str, DatasetInfo]  # every dataset reachable by hard links, as ``visititems`` meets them
    named_types: list[str]  # the committed (named) datatypes
    attrs: dict[str, Any]  # the root attributes as plain data (``attr_value``)


def attr_value(value: Any) -> Any:
    """An attribute as plain Python data (bytes decoded, numpy scalars and short arrays as Python values)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist() if value.size <= ATTR_ITEMS else f"<{value.dtype} array of shape {value.shape}>"
    return value


def read_attrs(obj: h5py.HLObject) -> dict[str, Any]:
    """The attributes of ``obj`` as plain data."""
    return {key: attr_value(read_attr(obj, key)) for key in attr_names(obj)}


def attr_names(obj: h5py.HLObject) -> list[str | bytes]:
    """``list(obj.attrs)``: the names in h5py's order (creation order where the object tracks it, else by name),
    without its objects (~0.05 ms an object of a small file's few)."""
    oid = h5py.h5g.open(obj.id, b"/") if isinstance(obj, h5py.File) else obj.id  # the root group's, as h5py
    if not isinstance(oid, (h5py.h5g.GroupID, h5py.h5d.DatasetID)):  # a committed datatype: h5py's own way
        return list(obj.attrs)
    tracked = oid.get_create_plist().get_attr_creation_order() & h5py.h5p.CRT_ORDER_TRACKED
    names: list[str | bytes] = []
    index = h5py.h5.INDEX_CRT_ORDER if tracked else h5py.h5.INDEX_NAME
    h5py.h5a.iterate(oid, lambda name, *_: names.append(text(name)), index_type=index)
    return names


def dataset_info(obj: h5py.h5d.DatasetID) -> DatasetInfo:
    """A dataset's entry, from its low-level id: what h5py's ``Dataset`` gives (shape, dtype, chunks, and its
    compression, shuffle and fletcher32 filters, as one text) without making one (~0.1 ms each)."""
    plist = obj.get_create_plist()
    chunks = plist.get_chunk() if plist.get_layout() == h5py.h5d.CHUNKED else None
    shape = tuple(int(s) for s in obj.shape or ())
    return DatasetInfo(shape, obj.dtype, chunks, packing(get_filters(plist)))  # what Dataset.compression etc. read


def packing(named: Iterable[str]) -> str | None:
    """A dataset's compression, shuffle and fletcher32 filters as one text, from its filters' names (h5py's)."""
    named = set(named)
    compression = next((x for x in ("gzip", "lzf", "szip") if x in named), None)
    return "+".join(p for p in (compression, "shuffle", "fletcher32") if p is not None and p in named) or None


def selects_all(index: tuple[Any, ...], shape: tuple[int, ...]) -> bool:
    """Whether ``dataset[index]`` is all of a dataset of ``shape`` (``()``, or a tuple of full slices)."""
    if len(index) > len(shape) or not all(type(i) is slice for i in index):
        return False
    return all(i.indices(n) == (0, n, 1) for i, n in zip(index, shape, strict=False))


def text(name: bytes) -> str | bytes:
    """A name as h5py's high-level objects give it: UTF-8 decoded, else the bytes."""
    try:
        return name.decode("utf-8")
    except UnicodeDecodeError:
        return name


def list_datasets(handle: h5py.File) -> tuple[dict[str, DatasetInfo], list[str]]:
    """Every dataset reachable by hard links (each object once, under the name ``visititems`` gives it) and
    the committed datatypes' paths."""
    found: dict[str, DatasetInfo] = {}
    named_types: list[str] = []

    def visit(name: bytes, info: Any) -> None:
        if info.type == h5py.h5o.TYPE_DATASET:
            found[text(name)] = dataset_info(h5py.h5o.open(handle.id, name))
        elif info.type == h5py.h5o.TYPE_NAMED_DATATYPE:
            named_types.append(text(name))

    h5py.h5o.visit(handle.id, visit, info=True)  # no high-level object is made: each costs ~0.1 ms
    return found, named_types


def _plain(value: Any) -> bool:
    """Whether JSON gives ``value`` back as it is (type and value)."""
    if value is None or type(value) in (str, int, float, bool):
        return True
    return type(value) is list and all(_plain(item) for item in value)


def _plain_dtype(dtype: np.dtype) -> bool:
    return dtype.kind in PLAIN_KINDS and dtype.metadata is None and dtype.fields is None and dtype.subdtype is None


def to_json(listing: Listing) -> dict[str, Any] | None:
    """``listing`` as JSON data, or None when JSON would not give it back exactly."""
    plain = [*listing.datasets, *listing.named_types, *listing.attrs, *listing.attrs.values()]
    if not _plain(plain) or not all(_plain_dtype(info.dtype) for info in listing.datasets.values()):
        return None
    datasets = {
        name: [list(info.shape), info.dtype.str, list(info.chunks) if info.chunks else None, info.compression]
        for name, info in listing.datasets.items()
    }
    return {"datasets": datasets, "named_types": listing.named_types, "attrs": listing.attrs}


def from_json(data: Any) -> Listing | None:
    """The listing ``to_json`` made, or None when ``data`` is not one."""
    try:
        datasets = {
            str(name): DatasetInfo(tuple(map(int, shape)), np.dtype(dtype), tuple(chunks) if chunks else None, packing)
            for name, (shape, dtype, chunks, packing) in data["datasets"].items()
        }
        return Listing(datasets, [str(n) for n in data["named_types"]], dict(data["attrs"]))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
