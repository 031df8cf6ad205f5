"""Write HDF5 outputs: the output half of the front door (no pipeline holds an h5py object).

``RolloutOutput`` is a new file at the temporary path ``atomic.atomic_file`` yields: it creates datasets, writes
blocks, copies untouched datasets verbatim from its source (HDF5 object copy moves the stored chunks without
decoding them), copies attributes with object references re-pointed into the output, and translates libhdf5's
failures: an operating-system fault is an I/O error of the output (exit 3), a failed object copy a read error
of the source, anything else an error writing the output, never blamed on the input.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import h5py
import numpy as np

from rolloutcli.core.host import numpy_storable
from rolloutcli.errors import EXIT_IO, RolloutError
from rolloutcli.hdf5.listing import attr_names, selects_all
from rolloutcli.hdf5.listing import text as listing_text
from rolloutcli.hdf5.references import DANGLING, holds_references, repoint, row_blocks
from rolloutcli.hdf5.safety import HDF5_ERRORS, system_errno, translate_write_error
from rolloutcli.hdf5.typecache import create_attr, memory_type, read_attr_typed, simple_space, stored_dtype

if TYPE_CHECKING:  # tensors are recognised by duck typing: `gae` on the CPU never imports torch
    import torch

    from rolloutcli.hdf5.reader import H5Input

R = TypeVar("R")
# libhdf5 reports write-side failures as these (shape or dtype mistakes of the caller raise others: bugs)
_OUTPUT_ERRORS = (OSError, RuntimeError, MemoryError)


def to_numpy(value: torch.Tensor | np.ndarray) -> np.ndarray:
    """A host numpy view/copy of a tensor (one device-to-host transfer)."""
    value = numpy_storable(value)
    return value.cpu().numpy() if hasattr(value, "detach") else value


OUTPUT_CACHE = 256 << 10  # an output's metadata cache, counted as libhdf5 counts it (``cap_metadata_cache``)
OPEN_DATASETS = 256  # datasets an output keeps open between writes (a small file's output has a dozen)
# A dataset open for writing, its shape and its dtype (``DatasetID.shape`` and ``.dtype`` cost ~15 us each, as much
# as a small file's write; an ``h5py.Dataset`` around it ~25 us, made only for a write of part of it).
Target = tuple[h5py.h5d.DatasetID, tuple[int, ...], np.dtype]


def _fills(shape: tuple[int, ...], dtype: np.dtype, index: tuple[Any, ...], array: np.ndarray) -> bool:
    """Whether ``dataset[index] = array`` writes all of a dataset of ``shape`` and ``dtype`` from a C-ordered
    ``array`` of its shape and plain numeric or bool dtype (then it is written whole, with the same bytes)."""
    if array.shape != shape or array.dtype != dtype or dtype.kind not in "biuf" or not array.flags.c_contiguous:
        return False
    return array.size > 0 and selects_all(index, shape)


@functools.cache
def _untimed_dataset() -> h5py.h5p.PropDCID:
    """Dataset creation without modification times, made once (libhdf5 copies it into each dataset)."""
    plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    plist.set_obj_track_times(False)
    return plist


def new_dataset(parent: Any, name: str, shape: tuple[int, ...], dtype: Any) -> Target:
    """An empty contiguous dataset ``name`` under the existing groups of ``parent`` (an h5py File or Group),
    without modification times: what ``parent.create_dataset(name, shape=, dtype=, track_times=False)`` makes
    (the same bytes), through the low-level API with its property list and dataspace made once (h5py's costs
    ~0.15 ms, this ~0.07: a small file's output creates a dozen)."""
    tid = dtype.id if isinstance(dtype, h5py.Datatype) else memory_type(np.dtype(dtype), logical=True)
    shape = tuple(shape)
    found = h5py.h5d.create(parent.id, name.encode(), tid, simple_space(shape), dcpl=_untimed_dataset())
    return found, shape, stored_dtype(tid)  # the dataset's type is a copy of ``tid``: the same dtype


def opened_target(parent: Any, name: str) -> Target:
    """The existing dataset ``name`` under ``parent``, opened for writes."""
    found = h5py.h5d.open(parent.id, name.encode())
    return found, tuple(found.shape), stored_dtype(found.get_type())


def write_array(target: Target, index: tuple[Any, ...], array: np.ndarray) -> None:
    """``dataset[index] = array``; all of it, from an array of its shape and dtype, through the low-level write
    (no selection: h5py's costs ~0.2 ms)."""
    dataset, shape, dtype = target
    if _fills(shape, dtype, index, array):
        dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, array, memory_type(array.dtype))
    else:
        h5py.Dataset(dataset)[index] = array


def _access(low: int) -> h5py.h5p.PropFAID:
    """File access from format ``low`` on, without HDF5's sieve buffer: outputs are written as strided slabs
    (``[:, m0:m1]`` of a contiguous ``[L, M, ...]``), around each of which it would read back and rewrite bytes."""
    access = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    access.set_libver_bounds(low, h5py.h5f.LIBVER_LATEST)
    access.set_sieve_buf_size(0)
    return access


def cap_metadata_cache(fid: h5py.h5f.FileID) -> None:
    """Hold an output's metadata cache at ``OUTPUT_CACHE`` bytes. libhdf5 counts an entry's size on disk and
    grows the cache up to 32 MB, while an object header or chunk index node takes ~5-10 KB in memory: an export
    of 5,000 episodes kept them all (50 MB). A full cache writes its oldest entries out early (equal runs still
    give equal bytes); a small file's output never fills it."""
    cache = fid.get_mdc_config()
    cache.max_size = cache.initial_size = cache.min_size = OUTPUT_CACHE
    cache.set_initial_size = True
    fid.set_mdc_config(cache)


def _untimed() -> h5py.h5p.PropFCID:
    """File creation without the root group's modification times (equal runs give equal bytes)."""
    plist = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    plist.set_obj_track_times(False)
    return plist


@functools.cache
def _sync_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutcli-sync")


class _EarlySync:
    """``fdatasync`` of a file being written, on a thread of its own (the GIL released), one at a time: the disk
    writes the blocks while the next ones are written, so the fsync before the publish only waits for the last
    ones (durability still comes from that fsync; an early one's failure is left for it to report)."""

    def __init__(self, path: Path | str) -> None:
        self.fd: int | None = os.open(path, os.O_RDONLY)
        self.running: Future[None] | None = None

    def start(self) -> None:
        if self.fd is not None and (self.running is None or self.running.done()):
            self.running = _sync_pool().submit(os.fdatasync, self.fd)

    def close(self) -> None:
        if self.running is not None:
            wait([self.running])
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class RolloutOutput:
    """A new HDF5 file at ``tmp`` (published at ``dst`` by the caller's ``atomic_file``).

    Written in the HDF5 1.8 format or later: its dense attribute storage holds attributes over 64 KiB, which
    valid inputs may carry. ``source`` (an open ``H5Input``) is where ``copy`` and ``copy_attrs`` read from.
    """

    def __init__(
        self, tmp: Path | str, dst: Path | str, source: H5Input | None = None, *, early_sync: bool = False
    ) -> None:
        self.dst, self.source = Path(dst), source
        self.file = self._do(
            lambda: h5py.File(
                h5py.h5f.create(
                    os.fsencode(tmp), h5py.h5f.ACC_TRUNC, fcpl=_untimed(), fapl=_access(h5py.h5f.LIBVER_V18)
                )
            )
        )
        self._do(lambda: cap_metadata_cache(self.file.id))
        self._early = _EarlySync(tmp) if early_sync else None
        # Copied datasets holding object references, (source name, output name): libhdf5's copy across files
        # nulls their references, so :meth:`copy_attrs` writes them again, re-pointed into the output.
        self._references: list[tuple[str, str]] = []
        self._objects: dict[str, Target] = {}  # the datasets made or written to, by name (open)

    def __enter__(self) -> RolloutOutput:
        return self

    def sync_early(self) -> None:
        """With ``early_sync``: have the disk start on what was written so far while writing goes on."""
        if self._early is not None:
            self._early.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if self._early is not None:
            self._early.close()
        if kind is None:
            self._do(self.file.close)
        else:
            with contextlib.suppress(*HDF5_ERRORS):  # the exception on its way says what went wrong first
                self.file.close()

    def _do(self, fn: Callable[[], R]) -> R:
        try:
            return fn()
        except (*HDF5_ERRORS, MemoryError) as exc:
            # an OS fault may come as any of h5py's exceptions (a group created past RLIMIT_FSIZE: KeyError)
            if system_errno(exc) is not None or isinstance(exc, MemoryError):
                raise translate_write_error(self.dst, exc) from exc
            if not isinstance(exc, _OUTPUT_ERRORS):
                raise
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RolloutError(
                f"{self.dst}: cannot write the output ({first}); nothing was written.", exit_code=EXIT_IO
            ) from exc

    def _parents(self, name: str) -> None:
        """Create the groups above ``name`` without modification times, so equal runs give equal bytes."""
        parts = name.strip("/").split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            path = "/".join(parts[:depth])
            if path not in self.file:
                plist = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
                plist.set_obj_track_times(False)
                self._do(lambda path=path, plist=plist: h5py.h5g.create(self.file.id, path.encode(), gcpl=plist))

    def _source(self) -> H5Input:
        assert self.source is not None, "this output has no source to copy from"
        return self.source

    def create(self, name: str, shape: tuple[int, ...], dtype: Any = None, *, like: str | None = None) -> None:
        """Create an empty dataset; ``like``: take the dtype of this source dataset (byte order and committed
        datatype included, when that datatype was copied with :meth:`copy`)."""
        if like is not None:
            dtype = self._stored_type(like)
        self._parents(name)
        self._open(name, self._do(lambda: new_dataset(self.file, name, shape, dtype)))

    def _open(self, name: str, target: Target) -> None:
        """Keep ``target`` open for the writes to come, with at most ``OPEN_DATASETS`` others (the oldest closed
        first, looked up again when written): an export creates every episode's datasets before writing any,
        and each open dataset holds ~10 KB of libhdf5's memory (5,000 episodes held 50 MB)."""
        self._objects[name] = target
        if len(self._objects) > OPEN_DATASETS:
            del self._objects[next(iter(self._objects))]

    def _stored_type(self, name: str) -> Any:
        source = self._source()
        stored = source.guard(lambda: source.opened(name).get_type(), name)
        if stored.committed():
            path = h5py.h5i.get_name(stored).decode("utf-8", "surrogateescape").lstrip("/")
            if path in self.file and isinstance(self.file[path], h5py.Datatype):
                return self.file[path]
        return source.datasets[name].dtype

    def write(self, name: str, index: tuple[Any, ...], value: torch.Tensor | np.ndarray) -> None:
        """``dataset[index] = value``."""
        array = to_numpy(value)
        if name not in self._objects:  # looked up once, low-level (File[name] costs ~0.12 ms, paid on every block)
            self._open(name, self._do(lambda: opened_target(self.file, name)))
        target = self._objects[name]
        self._do(lambda: write_array(target, index, array))

    def release(self, names: Iterable[str]) -> None:
        """Close the datasets :meth:`create` made or :meth:`write` looked up: an export of many episodes keeps open
        only those of the episodes still being written (each open dataset holds libhdf5 memory)."""
        for name in names:
            self._objects.pop(name, None)

    def put(self, name: str, value: torch.Tensor | np.ndarray) -> None:
        """Write one whole dataset (creating intermediate groups)."""
        array = to_numpy(value)
        self._parents(name)
        self._do(lambda: self.file.create_dataset(name, data=array, track_times=False))

    def set_attrs(self, attrs: Mapping[str, Any], name: str = "") -> None:
        """Set attributes of the object at ``name`` (``""``: the root); None values are skipped."""
        found = self.file[name] if name else self.file
        for key, value in attrs.items():
            if value is not None:
                self._do(lambda key=key, value=value: create_attr(found, key, value))

    def delete_attrs(self, keys: Iterable[str], name: str = "") -> None:
        found = (self.file[name] if name else self.file).attrs
        for key in keys:
            if key in found:
                self._do(lambda key=key: found.__delitem__(key))

    def copy(self, names: Iterable[str], rename: Callable[[str], str] = str) -> None:
        """Copy datasets (or named datatypes) of the source verbatim: stored chunks, filters, attributes."""
        source = self._source()
        for name in names:
            target = rename(name)
            parent, _, leaf = target.rpartition("/")
            self._parents(target)
            group = self.file[parent] if parent else self.file
            try:
                source.handle.copy(source.handle[name], group, name=leaf)
            except (*HDF5_ERRORS, MemoryError) as exc:
                raise translate_write_error(self.dst, exc, source.path) from exc
            if name in source.datasets and holds_references(source.datasets[name].dtype):
                self._references.append((name, target))

    def copy_attrs(self, rename: Callable[[str], str | None] = str) -> list[str]:
        """Copy the attributes of every source object (root, groups, datasets, named datatypes) onto the output
        object at ``rename(path)`` when there is one. Object references are re-pointed at the output's object
        of the renamed path; an attribute holding a reference with no such object (or a region reference) is
        not copied. Returns those attributes, as ``path@name``. Copied datasets of references are re-pointed the
        same way first (:meth:`repoint_references`)."""
        self.repoint_references(rename)
        source, dropped = self._source(), []
        names = [""]

        def visit(name: bytes, info: Any) -> None:
            if info.num_attrs:  # objects without attributes are not looked up (~0.1 ms each, most of a file's)
                names.append(listing_text(name))

        source.guard(lambda: h5py.h5o.visit(source.handle.id, visit, info=True))
        for name in names:
            target = rename(name)
            if target is None or (target and target not in self.file):
                continue
            held = source.handle[name] if name else source.handle  # each object looked up once
            out = self.file[target] if target else self.file
            for key in source.guard(lambda held=held: attr_names(held), name or None):
                value, dtype = source.guard(lambda held=held, key=key: read_attr_typed(held, key), name or None)
                value = repoint(value, source.handle, self.file, rename)
                if value is DANGLING:  # an object copy brought it along, pointing into the source: remove it
                    dropped.append(f"{name or '/'}@{key}")
                    self.delete_attrs([key], target)
                    continue
                self._do(lambda out=out, key=key, value=value, dtype=dtype: create_attr(out, key, value, dtype))
        return dropped

    def repoint_references(self, rename: Callable[[str], str | None]) -> None:
        """Write each copied dataset of references again, every reference re-pointed at the output's object of
        the renamed path, in blocks of rows; one that cannot be (no such object, a region reference) is refused:
        a dangling or nulled reference would lose what the input said."""
        source = self._source()
        for name, target in self._references:
            stored, out = source.handle[name], self.file[target]
            for index in row_blocks(stored, source.guard(stored.id.get_storage_size, name)):
                data = source.guard(lambda stored=stored, index=index: stored[index], name)
                value = repoint(data, source.handle, self.file, rename)
                if value is DANGLING:
                    raise RolloutError.field(
                        source.path,
                        name,
                        "object references to objects the output keeps",
                        "a reference to an object the output does not hold, or a region reference",
                        "Nothing was written; point the references at datasets the output keeps, or remove them.",
                    )
                self._do(lambda out=out, index=index, value=value: out.__setitem__(index, value))


def open_for_update(path: Any) -> h5py.File:
    """Open our own temporary copy of a file for adding datasets (``gae``; never an input)."""
    return h5py.File(h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDWR, fapl=_access(h5py.h5f.LIBVER_EARLIEST)))
