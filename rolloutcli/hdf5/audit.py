"""The audit: what makes an HDF5 file unsafe to read, found from its metadata before any data is read.

HDF5 can read other files on disk through external links, soft links (which can alias anything),
external raw storage and virtual datasets; unknown filter ids make libhdf5 load plugin code; a tiny
file can declare a huge dataset or chunk; a filtered chunk shorter than its checksum crashes libhdf5.
``audit_file`` walks every link from the root with ``visititems_links`` (``visititems`` skips soft and
external links) and checks each dataset's layout.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import h5py

from rolloutcli.errors import EXIT_UNSAFE, RolloutError
from rolloutcli.hdf5.limits import SafetyOptions

# gzip 1, shuffle 2, fletcher32 3, scaleoffset 6, lzf 32000: built into h5py, no plugin search.
ALLOWED_FILTERS = {1: "gzip", 2: "shuffle", 3: "fletcher32", 6: "scaleoffset", 32000: "lzf"}
# Registered HDF5 plugin filters (https://portal.hdfgroup.org/documentation/hdf5-docs/registered_filter_plugins)
PLUGIN_FILTERS = {307: "bzip2", 32001: "blosc", 32004: "lz4", 32008: "bitshuffle", 32013: "zfp", 32015: "zstd",
                  32026: "blosc2"}  # fmt: skip
FLETCHER32_BYTES = 4  # a fletcher32 chunk shorter than its checksum crashes libhdf5 when read
LAYOUT_KINDS = "biufcSUOV"  # dtype kinds whose layout (sizes, filters, chunk index) the audit checks


def _filter_ids(dataset: h5py.Dataset) -> list[int]:
    plist = dataset.id.get_create_plist()
    return [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]


def _dataset_problem(dataset: h5py.Dataset, path: Path, options: SafetyOptions) -> str | None:
    """What makes reading ``dataset`` unsafe (the first problem found), or None."""
    problem = _storage_problem(path, dataset, options.allow_external)
    if problem is None and dataset.dtype.kind in LAYOUT_KINDS:
        problem = _layout_problem(dataset, options)
    return problem


def _storage_problem(path: Path, dataset: h5py.Dataset, allow: bool) -> str | None:
    """Data stored outside the file (external raw storage, virtual datasets), unless trusted."""
    if not allow and dataset.external:
        return (
            "expected data stored in the file, found external raw storage in another file; refusing to read "
            "outside the file. Pass --allow-external to trust it."
        )
    for external in dataset.external or ():
        # Trusted (--allow-external) raw storage still must be a regular file: a FIFO hangs the read forever,
        # a device such as /dev/zero or /dev/urandom never ends.
        special = _special_file(path, external[0])
        if special:
            return (
                f"expected external raw storage in a regular file, found {special}; refusing to read it even "
                "with --allow-external."
            )
    if not allow and dataset.is_virtual:
        return (
            "expected data stored in the file, found a virtual dataset that reads other files; refusing. "
            "Pass --allow-external to trust it."
        )
    return None


def _layout_problem(dataset: h5py.Dataset, options: SafetyOptions) -> str | None:
    """Absurd declared sizes, unknown filters, decompression bombs, chunks too short or past the file's end."""
    itemsize = dataset.dtype.itemsize
    declared = math.prod(dataset.shape or ()) * itemsize  # math.prod is exact; np.prod overflows
    if declared > options.max_dataset_bytes:
        return (
            f"expected at most {options.max_dataset_bytes} bytes, found a declared size of {declared} bytes "
            f"(shape {tuple(dataset.shape)}); refusing to read it."
        )
    filters = _filter_ids(dataset)
    unknown = [f for f in filters if f not in ALLOWED_FILTERS]
    if unknown:
        name = f" ({PLUGIN_FILTERS[unknown[0]]})" if unknown[0] in PLUGIN_FILTERS else ""
        return (
            f"expected filters gzip/shuffle/fletcher32/lzf/scaleoffset, found unknown filter id {unknown[0]}{name}; "
            "refusing (it would load plugin code). Re-save the file with a standard filter: "
            f"h5repack -f NONE {dataset.file.filename} plain.h5 (with the plugin installed)."
        )
    end = 0
    if dataset.chunks is not None:
        chunk_bytes = math.prod(dataset.chunks) * itemsize
        if chunk_bytes > options.max_chunk_bytes:
            return (
                f"expected chunks of at most {options.max_chunk_bytes} bytes, found chunks of {chunk_bytes} bytes "
                f"({dataset.chunks}); refusing (decompression bomb). Re-save with smaller chunks."
            )
        short, end = chunk_extent(dataset.id)
        if filters and short is not None and short < FLETCHER32_BYTES:
            return (
                f"expected filtered chunks of at least {FLETCHER32_BYTES} bytes, found a stored chunk of {short} "
                "bytes; the file is corrupt."
            )
    elif not dataset.external and not dataset.is_virtual and dataset.id.get_offset() is not None:
        end = dataset.id.get_offset() + dataset.id.get_storage_size()
    # Stored data past the end of the file: reading it fails, and copying it (HDF5 object copy) hits a
    # double free in libhdf5's error path (H5D__chunk_copy, fixed upstream after HDF5 2.0.0).
    size = os.path.getsize(dataset.file.filename)
    if end > size:
        return (
            f"expected data stored inside the file ({size} bytes), found data stored up to byte {end}; the file "
            "is corrupt or truncated."
        )
    return None


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


def chunk_extent(dataset: h5py.h5d.DatasetID) -> tuple[int | None, int]:
    """(smallest stored chunk size or None when no chunk is allocated, end offset of the last stored byte)."""
    smallest: list[int | None] = [None]
    end = [0]

    def visit(info: h5py.h5d.StoreInfo) -> None:
        current = smallest[0]
        if current is None or info.size < current:
            smallest[0] = info.size
        end[0] = max(end[0], info.byte_offset + info.size)

    try:
        dataset.chunk_iter(visit)
    except AttributeError:  # older libhdf5 without H5Dchunk_iter
        for index in range(dataset.get_num_chunks()):
            visit(dataset.get_chunk_info(index))
    return smallest[0], end[0]


def audit_file(path: Path, handle: h5py.File, options: SafetyOptions) -> dict[str, h5py.HLObject]:
    """Walk every link from the root; raise ``RolloutError`` (exit 4) listing every unsafe object. Return the
    objects of the hard links, by name (the metadata probe goes on with them)."""
    unsafe: list[str] = []
    objects: dict[str, h5py.HLObject] = {}
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
        obj = objects[name] = handle.get(name, getlink=False)
        if isinstance(obj, h5py.Dataset) and (problem := _dataset_problem(obj, path, options)):
            unsafe.append(f"{path}: field '{name}': {problem}")
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
    return objects
