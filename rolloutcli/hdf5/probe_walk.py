"""The prober's quick walk of a file's metadata, with h5py's low-level API.

The high-level objects cost about 0.1 ms each to make, and the prober's walk with them (the audit, then the
attributes, chunk indexes and listing) took about 5 ms of a small file's few, more than its reader's own work
(issue 39). This walk opens each object once and reads the same metadata (object headers, creation properties,
chunk indexes, attributes), so a file that crashes or hangs libhdf5 still does it here. It vouches for a file
only when it is plainly clean: hard links only, no group reached twice, datasets of plain numeric types stored in
the file with the standard filters, within the limits of ``SafetyOptions``, inside the file. Anything else (a
soft link, a committed datatype, a string dataset, a problem) it leaves to the full audit
(``audit.audit_file``), which finds the same problems with their messages: it vouches for a subset of what the
audit passes, never for more.
"""

from __future__ import annotations

import math
import os
from typing import Any

import h5py
from h5py._hl.filters import get_filter_name  # h5py's names of filters, as ``get_filters`` gives them

from rolloutcli.hdf5.audit import ALLOWED_FILTERS, FLETCHER32_BYTES, chunk_extent
from rolloutcli.hdf5.limits import SafetyOptions
from rolloutcli.hdf5.listing import PLAIN_KINDS, Listing, packing, read_attrs
from rolloutcli.hdf5.schema import DatasetInfo
from rolloutcli.hdf5.typecache import stored_dtype


class _NotPlain(Exception):
    """The file is not plainly clean: the full audit decides."""


def quick_walk(handle: h5py.File, options: SafetyOptions) -> Listing | None:
    """The listing of ``handle`` (as ``listing.list_datasets`` and ``read_attrs`` give it) when it is plainly
    clean under ``options`` (see the module docstring); None when the full audit must decide."""
    try:
        return _walk(handle, options)
    except _NotPlain:
        return None


def _walk(handle: h5py.File, options: SafetyOptions) -> Listing:
    fid = handle.id
    size = os.fstat(fid.get_vfd_handle()).st_size
    links: list[tuple[bytes, int]] = []  # (name, object address) of each hard link, as ``visititems`` meets them

    def link(name: bytes, info: Any) -> bool | None:
        links.append((name, info.u))
        return True if info.type != h5py.h5l.TYPE_HARD else None  # not None: the visit stops

    if fid.links.visit(link, info=True):
        raise _NotPlain
    # every object under one name: the links' order is then ``visititems``' (libhdf5's object visit is this
    # link visit, each object kept under its first name), and no group is reached twice (no cycle)
    addresses = {h5py.h5o.get_info(fid).addr, *(address for _, address in links)}
    if len(addresses) != len(links) + 1:  # an object reached twice: the audit decides
        raise _NotPlain
    datasets: dict[bytes, DatasetInfo] = {}
    for name, _ in links:
        obj = h5py.h5o.open(fid, name)
        if isinstance(obj, h5py.h5d.DatasetID):
            datasets[name] = _dataset(obj, size, options)
        elif not isinstance(obj, h5py.h5g.GroupID):  # a committed datatype: the prober copies it, on its slow path
            raise _NotPlain
        if h5py.h5a.get_num_attrs(obj):
            read_attrs(h5py.Dataset(obj) if isinstance(obj, h5py.h5d.DatasetID) else h5py.Group(obj))
    attrs = read_attrs(handle)  # variable-length strings live in the global heap
    try:
        listed = {name.decode("utf-8"): info for name, info in datasets.items()}
    except UnicodeDecodeError as exc:  # h5py would list bytes
        raise _NotPlain from exc
    return Listing(listed, [], attrs)


def _dataset(obj: h5py.h5d.DatasetID, size: int, options: SafetyOptions) -> DatasetInfo:
    """The dataset's listing entry, after the audit's checks (``audit._dataset_problem``) found nothing."""
    plist = obj.get_create_plist()
    dtype = stored_dtype(obj.get_type())  # ``obj.dtype``, made once per type (~35 us a dataset)
    layout = plist.get_layout()
    if plist.get_external_count() or layout == h5py.h5d.VIRTUAL or dtype.kind not in PLAIN_KINDS:
        raise _NotPlain
    if dtype.fields is not None or dtype.subdtype is not None:
        raise _NotPlain
    space = obj.get_space()
    if space.get_simple_extent_type() not in (h5py.h5s.SIMPLE, h5py.h5s.SCALAR):
        raise _NotPlain
    shape = tuple(int(s) for s in space.shape)
    if math.prod(shape) * dtype.itemsize > options.max_dataset_bytes:
        raise _NotPlain
    filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
    if any(f not in ALLOWED_FILTERS for f in filters):
        raise _NotPlain
    chunks = plist.get_chunk() if layout == h5py.h5d.CHUNKED else None
    if chunks is not None:
        if math.prod(chunks) * dtype.itemsize > options.max_chunk_bytes:
            raise _NotPlain
        smallest, end = chunk_extent(obj)
        if filters and smallest is not None and smallest < FLETCHER32_BYTES:
            raise _NotPlain
    else:
        offset = obj.get_offset()
        end = 0 if offset is None else offset + obj.get_storage_size()
    if end > size:
        raise _NotPlain
    # ``listing.dataset_info``'s entry from what was read above (read again, ~30 us a dataset)
    return DatasetInfo(shape, dtype, chunks, packing(get_filter_name(f) for f in filters))
