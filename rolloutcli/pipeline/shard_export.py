"""What every shard export shares (``batch`` in all its modes): fields, the emitter, the folder's life.

* :class:`Field`: a source dataset and the row it contributes to a shard (dtype, per-row shape).
* :class:`Emitter`: lends the reused buffers shards are gathered into, shapes a shard's rows into its
  datasets (a callback per mode) and hands them to the :class:`~rolloutcli.hdf5.shards.ShardWriter` under
  their file names; lists the manifest's shard entries.
* :class:`ShardExport`: one torch thread, the source's content hash computed beside the export, the temporary
  folder published atomically (:func:`~rolloutcli.hdf5.atomic.atomic_folder`), the writer, the manifest last.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from rolloutcli.core.batching import BatchPlan
from rolloutcli.errors import EXIT_IO, RolloutError
from rolloutcli.hdf5.atomic import atomic_folder
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.shards import Shapes, ShardWriter, is_shard_folder, write_manifest
from rolloutcli.pipeline.progress import Progress

Rows = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Field:
    """A source dataset and the row it contributes to shards.

    Attributes:
        source: HDF5 path in the rollout file.
        name: dataset path in the shards.
        role: the source field's role (schema).
        dtype: as ``RolloutReader.tensor`` returns it (normalised).
        row_shape: the shape of one row as the export moves it (``[layers, H]`` for hidden states,
            ``[K, *entry_shape]`` for a history window).
    """

    source: str
    name: str
    role: str
    dtype: torch.dtype
    row_shape: tuple[int, ...]

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype of ``dtype`` (the shards are written from numpy views)."""
        return torch.empty(0, dtype=self.dtype).numpy().dtype

    @property
    def hidden(self) -> bool:
        """``[T, layers, N, H]`` in the source; rows ``[layers, H]``."""
        return self.role == "hidden"

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of this field."""
        count = self.dtype.itemsize
        for size in self.row_shape:
            count *= size
        return count


class Emitter:
    """Hands shards to the writer under their file names (named after the first epoch that uses them), and
    lends the reused buffer sets that shards are gathered into.

    Args:
        plan: every epoch's mini-batches.
        writer: where shards go.
        fields: the gathered fields (buffers are ``[rows, *row_shape]`` per field).
        progress: advanced once per shard.
        shard_tensors: ``shard_tensors(pass_index, shard, rows)`` shapes one shard's gathered rows
            ``{name: [rows, *row_shape]}`` into the datasets of its file.
        buffer_sets: 2 (the writer writes one set while the next shard is gathered into the other) or 1
            (streamed exports: the shard in flight is waited for first, to keep memory down).
    """

    def __init__(
        self,
        plan: BatchPlan,
        writer: ShardWriter,
        fields: list[Field],
        progress: Progress,
        shard_tensors: Callable[[int, int, Rows], Mapping[str, torch.Tensor]],
        *,
        buffer_sets: int = 2,
    ) -> None:
        self.plan, self.writer, self.fields, self.progress = plan, writer, fields, progress
        self.shard_tensors = shard_tensors
        self.largest = max(max(p.sizes) for p in plan.passes)
        self.buffer_sets = buffer_sets
        self._buffers: list[Rows] = []
        self._count = 0

    def file_name(self, pass_index: int, shard: int) -> str:
        """``e<epoch>-b<mini-batch>.h5`` of the first epoch that uses the pass."""
        return f"e{self.plan.epoch_pass.index(pass_index):04d}-b{shard:05d}.h5"

    def buffers(self, size: int) -> Rows:
        """``[size, *row_shape]`` views of the buffer set the next shard may use.

        Reused memory is warm; a fresh allocation per shard costs page faults that take longer than the copy.
        """
        if not self._buffers:
            self._buffers = [
                {f.name: torch.empty(self.largest, *f.row_shape, dtype=f.dtype) for f in self.fields}
                for _ in range(self.buffer_sets)
            ]
        if self.buffer_sets == 1:
            self.writer.wait()
        return {name: buffer[:size] for name, buffer in self._buffers[self._count % self.buffer_sets].items()}

    def prepare(self, layouts: Iterable[Shapes]) -> None:
        """Build the writer's file layouts before any data is held (a layout's construction briefly takes
        twice a shard's size)."""
        for shapes in layouts:
            self.writer.prepare(shapes)

    def emit(self, pass_index: int, shard: int, rows: Rows) -> None:
        """Shape and submit one shard (``rows {name: [size, *row_shape]}`` in slot order)."""
        self.writer.submit(self.file_name(pass_index, shard), self.shard_tensors(pass_index, shard, rows))
        self._count += 1
        self.progress.advance()

    def entries(self) -> list[dict[str, Any]]:
        """The manifest's shard list, in epoch then mini-batch order: ``{file, epoch, mini_batch, rows, sha256}``."""
        out = []
        for epoch, pass_index in enumerate(self.plan.epoch_pass):
            for shard, size in enumerate(self.plan.passes[pass_index].sizes):
                name = self.file_name(pass_index, shard)
                entry = {"file": name, "epoch": epoch, "mini_batch": shard, "rows": size}
                out.append({**entry, "sha256": self.writer.results[name][1]})
        return out


SOURCE_HASH = "xxh3_128"  # the manifest's name for the source's content hash


def _hash_file(path: Path, result: dict[str, str], stop: threading.Event) -> None:
    """The source's content hash (XXH3, 128 bits), in a thread beside the export (xxhash releases the GIL).

    Not sha256: the export is CPU-bound on two cores, and sha256 of the source (2 GB/s with SHA-NI) took
    ~0.18 s of the ~0.5 s export of a 0.37 GB file; XXH3 hashes at ~33 GB/s here. The hash identifies the file
    (``xxh128sum FILE`` prints the same digest); shard checksums stay sha256.
    """
    digest = xxhash.xxh3_128()
    try:
        with open(path, "rb") as handle:
            while not stop.is_set() and (chunk := handle.read(8 << 20)):
                digest.update(chunk)
    except OSError as exc:
        result["error"] = exc.strerror or str(exc)
        return
    result[SOURCE_HASH] = digest.hexdigest()


class ShardExport:
    """The life of one shard folder, as a context manager.

    Entering sets torch to one thread (the gathers are a small part of the work; an idle OpenMP worker
    spinning on the second core slowed the hashing and writing threads 2-3x), starts hashing ``src`` in a
    thread, creates the temporary folder :attr:`tmp` beside ``dst`` and opens :attr:`writer` on it. Call
    :meth:`publish` with the manifest once every shard is submitted; leaving the block then renames the
    folder into place. Leaving it by an exception removes the temporary folder (no ``dst`` appears).
    """

    def __init__(
        self,
        src: Path,
        dst: Path,
        attrs: Mapping[str, Any],
        group_attrs: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        compression: str | None = None,
        overwrite: bool = False,
    ) -> None:
        self.src, self.dst = Path(src), Path(dst)
        self.attrs, self.group_attrs = attrs, group_attrs or {}
        self.compression, self.overwrite = compression, overwrite
        self._hash: dict[str, str] = {}
        self._stop = threading.Event()
        self._hasher = threading.Thread(target=_hash_file, args=(self.src, self._hash, self._stop), daemon=True)
        self._stack = ExitStack()
        self.tmp = Path()
        self.writer: ShardWriter

    def __enter__(self) -> ShardExport:
        with ExitStack() as stack:
            stack.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(1)
            stack.callback(self._stop.set)
            self._hasher.start()
            folder = atomic_folder(self.dst, inputs=[self.src], overwrite=self.overwrite, owned=is_shard_folder)
            self.tmp = stack.enter_context(folder)
            self.writer = stack.enter_context(
                ShardWriter(self.tmp, self.attrs, self.group_attrs, compression=self.compression, label=self.dst)
            )
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self._stack.__exit__(*exc)

    def source_hash(self) -> str:
        """Wait for every shard to be written and for the source's content hash; return it.

        Raises:
            RolloutError: the source could not be read to hash it (exit 3), or a shard failed to write.
        """
        self.writer.wait_all()
        self._hasher.join()
        if SOURCE_HASH not in self._hash:
            reason = self._hash.get("error")
            raise RolloutError(f"{self.src}: cannot read the file to hash it: {reason}.", exit_code=EXIT_IO)
        return self._hash[SOURCE_HASH]

    def publish(self, manifest: Mapping[str, Any]) -> None:
        """Write ``manifest.json`` (last: a folder with a manifest is complete)."""
        self.writer.wait_all()
        write_manifest(self.tmp, manifest)

    @property
    def bytes_written(self) -> int:
        """Bytes of every shard file written so far."""
        return sum(size for size, _ in self.writer.results.values())


def source_record(reader: RolloutReader, content_hash: str) -> dict[str, Any]:
    """The manifest's ``source``: ``{path, size_bytes, xxh3_128, T, N}`` of the rollout file."""
    return {
        "path": os.path.abspath(reader.path),
        "size_bytes": os.stat(reader.path).st_size,
        SOURCE_HASH: content_hash,
        "T": reader.T,
        "N": reader.N,
    }


def gae_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """What a ``gae`` run recorded in the source (None where it recorded nothing)."""
    names = {
        "gamma": "gae_gamma",
        "lambda": "gae_lambda",
        "advantages_normalized": "advantages_normalized",
        "timeouts_bootstrapped": "timeouts_bootstrapped",
    }
    return {key: attrs.get(name) for key, name in names.items()}


def field_records(fields: Iterable[Field]) -> dict[str, dict[str, Any]]:
    """The manifest's ``fields``: each shard dataset's dtype and per-row shape."""
    return {f.name: {"dtype": str(f.dtype).removeprefix("torch."), "row_shape": list(f.row_shape)} for f in fields}
