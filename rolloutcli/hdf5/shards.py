"""Shard files and their manifest: write one shard, read it back, read and verify ``manifest.json``; read
regions of a rollout for the export.

A shard is a small HDF5 file built **in memory** by libhdf5 (the core driver, no backing store) and written
with plain Python I/O, never by libhdf5 into a file on disk: after a failed write (disk full, file-size
limit) h5py keeps an id open and the interpreter crashes at exit; bytes written by Python just raise
``OSError``. Every dataset is contiguous (chunked when compressed), without timestamps, so a shard's bytes
depend only on its data.

Building and writing a shard, and hashing it, run in two background threads, overlapping the next shard's
gather; :class:`ShardWriter` hands out results in order.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import re
import stat
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np
import torch

from rolloutcli.errors import EXIT_BAD_DATA, EXIT_IO, RolloutError, problem_line
from rolloutcli.hdf5.filecopy import start_writeback
from rolloutcli.hdf5.safety import HDF5_ERRORS, SafetyOptions, open_hdf5, translate_hdf5_error
from rolloutcli.hdf5.schema import FLAG_FIELDS

if TYPE_CHECKING:
    from rolloutcli.hdf5.reader import RolloutReader

SHARD_FORMAT = "shard"
MANIFEST_FORMAT = "rolloutcli.shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MANIFEST_MAX_BYTES = 1 << 26
ENTRY_KEYS = ("file", "epoch", "mini_batch", "rows", "sha256")
MODES = ("feedforward", "recurrent", "distillation", "history")
COMPRESSIONS = ("lzf", "gzip")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\.h5$")  # a plain name inside the folder, no path
_HASH_CHUNK = 8 << 20
_BUILDS = itertools.count()
_WRITE_FIXES = {
    errno.ENOSPC: "Free disk space or write to another disk",
    errno.EDQUOT: "Free space within your disk quota or write to another disk",
    errno.EFBIG: "The shard exceeds the file size limit (ulimit -f); raise it or use more --num-mini-batches",
    errno.EROFS: "The file system is read-only; choose a writable folder",
}
Shapes = Mapping[str, tuple[tuple[int, ...], np.dtype]]


# ----------------------------------------------------------------------------------------------------------
# Reading the source (the export never holds an h5py object)
# ----------------------------------------------------------------------------------------------------------


def chunk_extents(reader: RolloutReader, name: str) -> tuple[int, int, int] | None:
    """``(steps, envs, bytes)`` of one chunk of a chunked per-step field (None when contiguous)."""
    spec = reader.schema.fields[name]
    if spec.chunks is None or spec.env_axis is None:
        return None
    return spec.chunks[0], spec.chunks[spec.env_axis], int(np.prod(spec.chunks)) * spec.dtype.itemsize


def read_region(reader: RolloutReader, name: str, steps: tuple[int, int], envs: tuple[int, int]) -> np.ndarray:
    """Steps ``t0:t1`` of envs ``n0:n1`` of a per-step field, normalised as ``RolloutReader.array`` returns it
    (its dtype, flags 0/1, a trailing 1 of scalar fields squeezed), C-contiguous.

    Raises:
        RolloutError: the data cannot be read (HDF5 errors translated, naming the field).
    """
    spec = reader.schema.fields[name]
    dtype, shape = reader.normalized(name, *envs)
    index: list[slice] = [slice(None)] * len(spec.shape)
    index[0], index[spec.env_axis or 1] = slice(*steps), slice(*envs)
    try:
        data = np.asarray(reader.handle[name][tuple(index)])
    except HDF5_ERRORS as exc:
        raise translate_hdf5_error(reader.path, exc, name) from exc
    if spec.role in FLAG_FIELDS:
        data = data != 0
    data = data.astype(dtype, copy=False).reshape(steps[1] - steps[0], *shape[1:])
    return np.ascontiguousarray(data)


# ----------------------------------------------------------------------------------------------------------
# Writing shards
# ----------------------------------------------------------------------------------------------------------


def _numpy(value: torch.Tensor | np.ndarray) -> np.ndarray:
    """A C-contiguous host array sharing memory with a CPU tensor (copied only when it must be)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous().numpy()
    return np.ascontiguousarray(value)


def shard_bytes(
    tensors: Mapping[str, torch.Tensor | np.ndarray],
    attrs: Mapping[str, Any],
    group_attrs: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    compression: str | None = None,
) -> bytes:
    """The whole file of a shard: datasets in the given order, then the groups' attributes."""
    # A name of its own: libhdf5 refuses to open two files of one name at once (nothing is created on disk).
    name = f"rolloutcli-shard-{next(_BUILDS)}.h5"
    handle = h5py.File(name, "w", driver="core", backing_store=False, libver=("earliest", "latest"))
    try:
        for key, value in attrs.items():
            handle.attrs[key] = value
        for field, value in tensors.items():
            array = _numpy(value)
            # ``dataset`` keeps the newest dataset open until the image is taken: what libhdf5 writes (the
            # metadata's places) depends on which objects are open, and shards keep their bytes across versions.
            if compression:
                dataset = handle.create_dataset(
                    field, data=array, chunks=True, compression=compression, track_times=False
                )
            else:
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)  # contiguous, allocated at once, never filled
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
                dataset = handle.create_dataset(field, array.shape, array.dtype, dcpl=dcpl, track_times=False)
                if array.size:
                    dataset[...] = array
        for group, values in (group_attrs or {}).items():
            if group not in handle:
                raise ValueError(f"attributes for the group '{group}', which no dataset of the shard is in")
            for key, value in values.items():
                handle[group].attrs[key] = value
        handle.flush()
        return handle.id.get_file_image()
    finally:
        handle.close()


def _write_bytes(path: Path, data: bytes, *, fsync: bool = False) -> int:
    """Write ``data`` to a new file with plain Python I/O; return the byte count.

    Without ``fsync``, the kernel is asked to start writing the file to disk at once (not waiting for it):
    the fsync of the folder's publish then finds it (nearly) done.
    """
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        if fsync:
            os.fsync(handle.fileno())
        else:
            start_writeback(handle.fileno(), 0, 0)  # 0 bytes = to the end of the file
    return len(data)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ShardWriter:
    """Write shards into ``folder`` in the background: one thread builds and writes each shard, another hashes it.

    ``submit`` returns once the *previous* shard is built, written and hashed, so a caller that alternates two
    sets of buffers can refill one while the other is written. ``results`` maps file name to
    ``(bytes, sha256)``. Use as a context manager: leaving it waits for every thread (also on errors, so
    nothing writes into a folder that is being removed).
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

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.wait_all()
        finally:
            self._writer.shutdown(wait=True, cancel_futures=True)
            self._hasher.shutdown(wait=True, cancel_futures=True)

    def _write(self, name: str, tensors: Mapping[str, torch.Tensor | np.ndarray]) -> tuple[int, str]:
        try:
            image = shard_bytes(tensors, self.attrs, self.group_attrs, compression=self.compression)
        except HDF5_ERRORS as exc:
            raise translate_hdf5_error(self.label / name, exc) from exc
        digest = self._hasher.submit(_sha256, image)
        try:
            size = _write_bytes(self.folder / name, image)
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
        """Block until the shard in flight is written and hashed; raise ``RolloutError`` (exit 3) if it failed."""
        if self._pending is not None:
            name, future = self._pending
            self._pending = None
            self.results[name] = future.result()

    def wait_all(self) -> None:
        """Block until every shard is written and hashed (durability comes from the folder's publish, which
        fsyncs every file in it: :func:`rolloutcli.hdf5.atomic.atomic_folder`)."""
        self.wait()


# ----------------------------------------------------------------------------------------------------------
# Manifest
# ----------------------------------------------------------------------------------------------------------


def write_manifest(folder: Path, manifest: Mapping[str, Any]) -> None:
    """Write ``manifest.json`` (plain I/O, fsynced); call it last, after every shard is on disk."""
    path = Path(folder) / MANIFEST_NAME
    text = json.dumps(manifest, indent=1, sort_keys=False) + "\n"
    try:
        _write_bytes(path, text.encode(), fsync=True)
    except OSError as exc:
        raise RolloutError(f"{path}: cannot write the manifest: {exc.strerror or exc}.", exit_code=EXIT_IO) from exc


def _manifest_text(path: Path) -> str:
    """The manifest's text: a regular file (never a FIFO or device: opened without blocking, checked before
    reading) of at most ``MANIFEST_MAX_BYTES``."""
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
        manifest = json.loads(_manifest_text(Path(folder) / MANIFEST_NAME))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT


def _check_source(manifest: dict[str, Any], bad: Any) -> None:
    source = manifest.get("source")
    if not isinstance(source, dict):
        bad("source", "an object with the source's T and N", source)
        return
    for key in ("T", "N"):
        value = source.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            bad(f"source.{key}", "an integer >= 1", value)


def _check_entry(folder: Path, where: str, entry: Any, bad: Any) -> None:
    if not isinstance(entry, dict) or any(key not in entry for key in ENTRY_KEYS):
        bad(where, f"an object with keys {', '.join(ENTRY_KEYS)}", entry)
        return
    name = entry["file"]
    inside = os.path.realpath(folder)
    if not isinstance(name, str) or not _FILE_NAME.match(name):
        bad(f"{where}.file", "a plain .h5 file name inside the folder", name)
    elif os.path.dirname(os.path.realpath(folder / name)) != inside:
        bad(f"{where}.file", "a shard file inside the folder", f"{name} resolving to {os.path.realpath(folder / name)}")
    elif not (folder / name).is_file():
        bad(f"{where}.file", "an existing shard file", f"{name} missing")
    for key in ("epoch", "mini_batch", "rows"):
        if not isinstance(entry[key], int) or isinstance(entry[key], bool) or entry[key] < 0:
            bad(f"{where}.{key}", "an integer >= 0", entry[key])
    if not isinstance(entry["sha256"], str) or not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
        bad(f"{where}.sha256", "64 hex digits", entry["sha256"])


def read_manifest(folder: Path | str) -> dict[str, Any]:
    """Read and check ``folder/manifest.json``: format, mode, source, shard entries, and that every file
    exists inside the folder (a shard that is a link resolving elsewhere is refused).

    Raises:
        RolloutError: missing folder or manifest (exit 3); malformed manifest or missing shard (exit 1),
            every problem listed.
    """
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not folder.is_dir():
        raise RolloutError(f"{folder}: no such shard folder. Run `rolloutcli batch` to create it.", exit_code=EXIT_IO)
    try:
        manifest = json.loads(_manifest_text(path))
    except FileNotFoundError as exc:
        raise RolloutError(
            f"{path}: no manifest; the folder is not a complete `rolloutcli batch` output.", exit_code=EXIT_IO
        ) from exc
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise RolloutError.field(path, "(file)", "a JSON manifest", f"unreadable content ({reason})") from exc
    problems: list[str] = []

    def bad(field: str, expected: str, found: object) -> None:
        problems.append(problem_line(path, field, expected, repr(found)))

    if not isinstance(manifest, dict):
        raise RolloutError.field(path, "(root)", "a JSON object", type(manifest).__name__)
    if manifest.get("format") != MANIFEST_FORMAT:
        bad("format", repr(MANIFEST_FORMAT), manifest.get("format"))
    if manifest.get("format_version") != FORMAT_VERSION:
        bad("format_version", str(FORMAT_VERSION), manifest.get("format_version"))
    if manifest.get("mode") not in MODES:
        bad("mode", "feedforward, recurrent, distillation or history", manifest.get("mode"))
    _check_source(manifest, bad)
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards:
        bad("shards", "a non-empty list", shards)
        shards = []
    for i, entry in enumerate(shards):
        _check_entry(folder, f"shards[{i}]", entry, bad)
    if problems:
        raise RolloutError.many(path, problems, exit_code=EXIT_BAD_DATA)
    return manifest


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_shard(folder: Path, entry: Mapping[str, Any]) -> None:
    """Raise ``RolloutError`` (exit 1) when a shard's bytes do not match the manifest's sha256."""
    path = Path(folder) / entry["file"]
    found = file_sha256(path)
    if found != entry["sha256"]:
        raise RolloutError.field(
            path,
            "sha256",
            entry["sha256"],
            found,
            "The shard was modified or damaged after it was written; run `rolloutcli batch` again.",
        )


def read_shard(path: Path, safety: SafetyOptions | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every dataset of a shard (audited like any input) and its attributes.

    Returns ``({dataset path: array}, {"": root attrs, group path: attrs, ...})``.
    """
    arrays: dict[str, np.ndarray] = {}
    attrs: dict[str, Any] = {}
    with open_hdf5(path, safety) as handle:
        try:

            def visit(name: str, obj: h5py.HLObject) -> None:
                if isinstance(obj, h5py.Dataset):
                    arrays[name] = obj[()]
                elif obj.attrs:
                    attrs[name] = dict(obj.attrs)

            attrs[""] = dict(handle.attrs)
            handle.visititems(visit)
        except HDF5_ERRORS as exc:
            raise translate_hdf5_error(path, exc) from exc
    if attrs[""].get("rolloutcli_format") not in (SHARD_FORMAT, SHARD_FORMAT.encode()):
        found = repr(attrs[""].get("rolloutcli_format"))
        raise RolloutError.field(path, "rolloutcli_format", repr(SHARD_FORMAT), found, "Not a rolloutcli shard.")
    return arrays, attrs
