"""Shard files and their manifest: write one shard and ``manifest.json``, read a shard back; read regions of a
rollout for the export. (The manifest's checks are the reader's: :mod:`rolloutcli.shards`.)

A shard is built **in memory** by libhdf5 (core driver, no backing store) and written with plain Python I/O:
after a failed write (disk full, file-size limit) h5py keeps an id open and the interpreter crashes at exit,
while Python's writes just raise ``OSError``. Datasets are contiguous (chunked when compressed) and carry no
timestamps, so a shard's bytes depend only on its data. An uncompressed shard is written from its *layout*
(:func:`_layout`) filled with views of the tensors: byte for byte :func:`shard_bytes`, without copying the data.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import math
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np
import torch

from rolloutcli.errors import EXIT_IO, RolloutError
from rolloutcli.hdf5.filecopy import start_writeback
from rolloutcli.hdf5.safety import HDF5_ERRORS, SafetyOptions, open_hdf5, translate_hdf5_error

if TYPE_CHECKING:
    from rolloutcli.hdf5.reader import Listed, RolloutReader

SHARD_FORMAT = "shard"
MANIFEST_FORMAT = "rolloutcli.shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MANIFEST_MAX_BYTES = 1 << 26
COMPRESSIONS = ("lzf", "gzip")
_BUILDS = itertools.count()
_WRITE_FIXES = {
    errno.ENOSPC: "Free disk space or write to another disk",
    errno.EDQUOT: "Free space within your disk quota or write to another disk",
    errno.EFBIG: "The shard exceeds the file size limit (ulimit -f); raise it or use more --num-mini-batches",
    errno.EROFS: "The file system is read-only; choose a writable folder",
}
Shapes = Mapping[str, tuple[tuple[int, ...], np.dtype]]
Segment = bytes | memoryview
Layout = tuple[bytes | str, ...]


# ---------------------------------------------------- reading the source (the export never holds an h5py object)


def chunk_extents(reader: RolloutReader | Listed, name: str) -> tuple[int, int, int] | None:
    """``(steps, envs, bytes)`` of one chunk of a chunked per-step field (None when contiguous)."""
    spec = reader.schema.fields[name]
    if spec.chunks is None or spec.env_axis is None:
        return None
    return spec.chunks[0], spec.chunks[spec.env_axis], int(np.prod(spec.chunks)) * spec.dtype.itemsize


def read_region(reader: RolloutReader, name: str, steps: tuple[int, int], envs: tuple[int, int]) -> np.ndarray:
    """Steps ``t0:t1`` of envs ``n0:n1`` of a per-step field, normalised as ``RolloutReader.array`` returns it."""
    spec = reader.schema.fields[name]
    index: list[slice] = [slice(None)] * len(spec.shape)
    index[0], index[spec.env_axis or 1] = slice(*steps), slice(*envs)
    return reader.normalise(name, reader.slice(name, tuple(index)))


# ------------------------------------------------------------------------------------------------ writing shards


def _numpy(value: torch.Tensor | np.ndarray) -> np.ndarray:
    """A C-contiguous host array sharing memory with a CPU tensor (copied only when it must be)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous().numpy()
    return np.ascontiguousarray(value)


def _image(
    arrays: Mapping[str, np.ndarray | tuple[tuple[int, ...], np.dtype]],
    attrs: Mapping[str, Any],
    group_attrs: Mapping[str, Mapping[str, Any]],
    compression: str | None = None,
) -> tuple[bytes, dict[str, int]]:
    """A shard's file image and the offset of each contiguous dataset's data; a ``(shape, dtype)`` instead of an
    array leaves that data unwritten (zeros)."""
    # A name of its own: libhdf5 refuses to open two files of one name at once (nothing is created on disk).
    name = f"rolloutcli-shard-{next(_BUILDS)}.h5"
    with h5py.File(name, "w", driver="core", backing_store=False, libver=("earliest", "latest")) as handle:
        for key, value in attrs.items():
            handle.attrs[key] = value
        offsets = {}
        for field, item in arrays.items():
            # ``dataset`` keeps the newest dataset open until the image is taken: what libhdf5 writes (the
            # metadata's places) depends on which objects are open, and shards keep their bytes across versions.
            if compression:
                dataset = handle.create_dataset(
                    field, data=item, chunks=True, compression=compression, track_times=False
                )
                continue
            shape, dtype = (item.shape, item.dtype) if isinstance(item, np.ndarray) else item
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)  # contiguous, allocated at once, never filled
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
            dataset = handle.create_dataset(field, shape, dtype, dcpl=dcpl, track_times=False)
            if isinstance(item, np.ndarray) and item.size:
                dataset[...] = item
            offsets[field] = dataset.id.get_offset() or 0
        for group, values in group_attrs.items():
            if group not in handle:
                raise ValueError(f"attributes for the group '{group}', which no dataset of the shard is in")
            for key, value in values.items():
                handle[group].attrs[key] = value
        handle.flush()
        return handle.id.get_file_image(), offsets


def shard_bytes(
    tensors: Mapping[str, torch.Tensor | np.ndarray],
    attrs: Mapping[str, Any],
    group_attrs: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    compression: str | None = None,
) -> bytes:
    """The whole file of a shard as libhdf5 writes it (the reference :class:`ShardWriter` equals)."""
    return _image({name: _numpy(value) for name, value in tensors.items()}, attrs, group_attrs or {}, compression)[0]


def _layout(shapes: Shapes, attrs: Mapping[str, Any], group_attrs: Mapping[str, Mapping[str, Any]]) -> Layout:
    """An uncompressed shard's file as a sequence: metadata bytes, or the name of a dataset whose data go there.
    Filled with the arrays' bytes it equals :func:`shard_bytes`, without copying the data through libhdf5."""
    image, offsets = _image(shapes, attrs, group_attrs)
    parts: list[bytes | str] = []
    cursor = 0
    for name, offset in sorted(offsets.items(), key=lambda item: item[1]):
        shape, dtype = shapes[name]
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if nbytes == 0:
            continue
        if offset < cursor or offset + nbytes > len(image):
            raise RuntimeError(f"unexpected HDF5 layout for '{name}': {offset}+{nbytes} in {len(image)} bytes")
        parts += [image[cursor:offset], name]
        cursor = offset + nbytes
    parts.append(image[cursor:])
    return tuple(part for part in parts if part != b"")


def _write_segments(path: Path, segments: Iterable[Segment], *, fsync: bool = False) -> int:
    """Write ``segments`` to a new file with plain Python I/O; return the byte count. Without ``fsync`` the
    kernel starts writing it back at once, so the folder's publishing fsync finds it (nearly) done."""
    written = 0
    with open(path, "xb") as handle:
        for segment in segments:
            written += handle.write(segment)
        handle.flush()
        if fsync:
            os.fsync(handle.fileno())
        else:
            start_writeback(handle.fileno(), 0, 0)  # 0 bytes = to the end of the file
    return written


def _sha256(segments: Sequence[Segment]) -> str:
    digest = hashlib.sha256()
    for segment in segments:
        digest.update(segment)
    return digest.hexdigest()


class ShardWriter:
    """Write shards into ``folder`` in the background: one thread builds and writes each shard, another hashes it.

    ``submit`` returns once the *previous* shard is written and hashed, so a caller alternating two sets of
    buffers refills one while the other is written. ``results`` maps file name to ``(bytes, sha256)``. Leaving
    the context waits for every thread (also on errors: nothing writes into a folder being removed).
    """

    def __init__(
        self,
        folder: Path,
        attrs: Mapping[str, Any],
        group_attrs: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        compression: str | None = None,
        label: Path | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.label = Path(label) if label is not None else self.folder  # the folder named in messages
        self.attrs = dict(attrs)
        self.group_attrs = {k: dict(v) for k, v in (group_attrs or {}).items()}
        self.compression = compression
        self.results: dict[str, tuple[int, str]] = {}
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutcli-shard")
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutcli-sha256")
        self._pending: tuple[str, Future[tuple[int, str]]] | None = None
        self._layouts: dict[tuple[Any, ...], Layout] = {}  # used by the writer thread only

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.wait()
        finally:
            self._writer.shutdown(wait=True, cancel_futures=True)
            self._hasher.shutdown(wait=True, cancel_futures=True)

    def _segments(self, arrays: Mapping[str, np.ndarray]) -> list[Segment]:
        """The shard's bytes in order: its image (compressed), or its layout filled with views of ``arrays``."""
        if self.compression:
            return [_image(arrays, self.attrs, self.group_attrs, self.compression)[0]]
        key = tuple((name, a.shape, a.dtype.str) for name, a in arrays.items())
        if key not in self._layouts:
            if len(self._layouts) >= 4:  # feed-forward, distillation and history shards have one or two shapes
                self._layouts.clear()
            shapes = {name: (a.shape, a.dtype) for name, a in arrays.items()}
            self._layouts[key] = _layout(shapes, self.attrs, self.group_attrs)
        return [p if isinstance(p, bytes) else memoryview(arrays[p]).cast("B") for p in self._layouts[key]]

    def _write(self, name: str, tensors: Mapping[str, torch.Tensor | np.ndarray]) -> tuple[int, str]:
        try:
            segments = self._segments({field: _numpy(value) for field, value in tensors.items()})
        except HDF5_ERRORS as exc:
            raise translate_hdf5_error(self.label / name, exc) from exc
        digest = self._hasher.submit(_sha256, segments)
        try:
            size = _write_segments(self.folder / name, segments)
        except OSError as exc:
            fix = _WRITE_FIXES.get(exc.errno or 0, "Choose another output folder")
            message = f"{self.label / name}: cannot write the shard: {exc.strerror or exc}. {fix}."
            raise RolloutError(message, exit_code=EXIT_IO) from exc
        finally:
            sha256 = digest.result()
        return size, sha256

    def submit(self, name: str, tensors: Mapping[str, torch.Tensor | np.ndarray]) -> None:
        """Queue ``tensors`` (CPU; left unchanged until the next ``submit`` or ``wait`` returns) as the shard
        file ``folder/name``."""
        self.wait()
        self._pending = (name, self._writer.submit(self._write, name, tensors))

    def wait(self) -> None:
        """Block until the shard in flight (so every shard) is written and hashed; raise ``RolloutError`` (exit 3)
        if it failed. (Durable once ``atomic_folder`` publishes the folder.)"""
        if self._pending is not None:
            name, future = self._pending
            self._pending = None
            self.results[name] = future.result()


# ------------------------------------------------------------------------------------------------------ manifest


def write_manifest(folder: Path, manifest: Mapping[str, Any]) -> None:
    """Write ``manifest.json`` (plain I/O, fsynced); call it last, after every shard is on disk."""
    path = Path(folder) / MANIFEST_NAME
    # Written as it is encoded (json.dumps(manifest, indent=1)'s bytes): a dataset's manifest names every file, and
    # its whole text, then its bytes, took 6 MB more for 10,000 files.
    parts = itertools.chain(json.JSONEncoder(indent=1).iterencode(manifest), ["\n"])
    try:
        _write_segments(path, (part.encode() for part in parts), fsync=True)
    except OSError as exc:
        raise RolloutError(f"{path}: cannot write the manifest: {exc.strerror or exc}.", exit_code=EXIT_IO) from exc


def manifest_text(path: Path) -> str:
    """The manifest's text: a regular file (opened without blocking, so a FIFO cannot hang) of at most
    ``MANIFEST_MAX_BYTES``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if info.st_size > MANIFEST_MAX_BYTES:
            raise OSError(errno.EFBIG, f"larger than {MANIFEST_MAX_BYTES} bytes")
        return handle.read(MANIFEST_MAX_BYTES + 1).decode()


def is_shard_folder(folder: Path) -> bool:
    """True for a folder ``rolloutcli batch`` wrote: its ``manifest.json`` names the shard format."""
    try:
        manifest = json.loads(manifest_text(Path(folder) / MANIFEST_NAME))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT


def _decoded_bytes(dataset: h5py.Dataset) -> int:
    """Memory reading ``dataset`` whole takes: its data, and one chunk decoded beside it when filtered."""
    data = math.prod(dataset.shape or ()) * dataset.dtype.itemsize
    chunk = math.prod(dataset.chunks) * dataset.dtype.itemsize if dataset.chunks and dataset.compression else 0
    return data + chunk


def _check_decoded(path: Path, sizes: dict[str, int], max_bytes: int | None) -> None:
    """Refuse, before any data is read, a shard whose datasets take more than ``max_bytes`` to read (a few MB of
    compressed zeros may declare gigabytes), naming its largest dataset."""
    total = sum(sizes.values())
    if max_bytes is None or total <= max_bytes:
        return
    largest = max(sizes, key=sizes.__getitem__)
    raise RolloutError.field(
        path, largest, f"a shard readable within read_bytes={max_bytes}",
        f"{total} bytes to read, {sizes[largest]} of them this dataset's",
        f"Pass read_bytes={total} (or more), or write smaller shards (batch --num-mini-batches).",
    )  # fmt: skip


def read_shard(
    path: Path, safety: SafetyOptions | None = None, max_bytes: int | None = None
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every dataset of a shard (audited like any input) and its attributes:
    ``({dataset path: array}, {"": root attrs, group path: attrs, ...})``; a shard whose datasets take more
    than ``max_bytes`` to read is refused before any is read."""
    arrays: dict[str, np.ndarray] = {}
    attrs: dict[str, Any] = {}
    with open_hdf5(path, safety) as handle:
        try:
            datasets: dict[str, h5py.Dataset] = {}

            def visit(name: str, obj: h5py.HLObject) -> None:
                if isinstance(obj, h5py.Dataset):
                    datasets[name] = obj
                elif obj.attrs:
                    attrs[name] = dict(obj.attrs)

            attrs[""] = dict(handle.attrs)
            handle.visititems(visit)
            if attrs[""].get("rolloutcli_format") not in (SHARD_FORMAT, SHARD_FORMAT.encode()):
                found = repr(attrs[""].get("rolloutcli_format"))
                raise RolloutError.field(
                    path, "rolloutcli_format", repr(SHARD_FORMAT), found, "Not a rolloutcli shard."
                )
            _check_decoded(path, {name: _decoded_bytes(d) for name, d in datasets.items()}, max_bytes)
            arrays = {name: dataset[()] for name, dataset in datasets.items()}
        except HDF5_ERRORS as exc:
            raise translate_hdf5_error(path, exc) from exc
    return arrays, attrs
