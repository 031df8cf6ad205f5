"""The shard export on an engine (``batch --workers K``, ``--engine ray``): a map step and a reduce step.

A map unit reads one source block, finds each row's shard and slot in every pass (the plan's streamed order or
its positions) and writes the rows of each shard to a piece file ``.map/p<pass>-s<shard>/<block>`` in the
temporary shard folder (``k`` as 8 bytes, slots ``[k] int64``, then each field's ``[k, *row_shape]`` bytes
padded to 8). A reduce unit scatters a shard's pieces into slot order, shapes them as the mode does,
writes the shard file and removes the pieces. The driver runs the maps, then the reduces, then writes the
manifest. Units are pure functions of their arguments and write only their own files, so a retried unit gives
the same bytes, and the shards are the bytes of the in-process export (same plan, same rows, same writer).
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from rolloutcli.core.batching import BatchPlan, ShardPlan, block_rows, scatter_rows
from rolloutcli.hdf5.limits import SafetyOptions
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.shards import FORMAT_VERSION, SHARD_FORMAT, ShardWriter
from rolloutcli.pipeline.engine import close_pools, run_units
from rolloutcli.pipeline.scatter import Field, Rows, aligned
from rolloutcli.shard_manifest import file_sha256

MAP = ".map"


@dataclass(frozen=True)
class ExportSpec:
    """What every unit needs (picklable): the fields, the plan, how rows are read, taken and shaped."""

    mode: str
    fields: list[Field]
    plan: BatchPlan
    read: Callable[..., torch.Tensor]
    take: Callable[..., Rows]
    shape: Callable[[ShardPlan, int, Rows], Mapping[str, torch.Tensor]]
    env_concat: bool
    total_envs: int
    total_rows: int
    safety: SafetyOptions
    budget: int
    folder: Path = Path()
    attrs: dict[str, Any] = field(default_factory=dict)
    group_attrs: dict[str, dict[str, Any]] = field(default_factory=dict)
    compression: str | None = None

    def writer_attrs(self) -> dict[str, Any]:
        return {"rolloutcli_format": SHARD_FORMAT, "format_version": FORMAT_VERSION, "mode": self.mode, **self.attrs}


def _piece(folder: Path, pass_index: int, shard: int) -> Path:
    return folder / MAP / f"p{pass_index:04d}-s{shard:06d}"


def _write_piece(path: Path, slots: torch.Tensor, rows: Rows, fields: list[Field]) -> None:
    with open(path, "wb") as handle:
        handle.write(slots.numel().to_bytes(8, "little"))
        handle.write(slots.to(torch.int64).contiguous().numpy().data)
        for f in fields:
            data = rows[f.name].contiguous().view(-1).view(torch.uint8).numpy().data
            handle.write(data)
            handle.write(bytes(aligned(len(data)) - len(data)))


def _read_piece(path: Path, fields: list[Field]) -> tuple[torch.Tensor, Rows]:
    """A piece's slots and rows, views of this process's piece buffer (valid until the next read)."""
    size = os.path.getsize(path)
    buffer = _Warm.piece(size)
    with open(path, "rb", buffering=0) as handle:
        handle.readinto(memoryview(buffer)[:size])
    count = int.from_bytes(buffer[:8], "little")
    data = torch.frombuffer(buffer, dtype=torch.uint8, count=size)[8:]
    offset, rows = 8 * count, {}
    for f in fields:
        rows[f.name] = data[offset : offset + count * f.row_bytes].view(f.dtype).view(count, *f.row_shape)
        offset += aligned(count * f.row_bytes)
    return data[: 8 * count].view(torch.int64), rows


class _Warm:
    """What a process keeps from one reduce unit to the next (a worker runs one unit at a time): the shard and
    piece buffers, whose pages stay mapped, and the shard writer, whose file layouts stay built. Fresh buffers
    and layouts cost a page fault per 4 KiB: a third more CPU time in the benchmark (benchmarks/README.md)."""

    shards: ClassVar[dict[str, torch.Tensor]] = {}
    buffer = bytearray()
    writer: ShardWriter | None = None

    @classmethod
    def shard(cls, fields: list[Field], size: int) -> Rows:
        """``{name: [size, *row_shape]}`` views of the shard buffers (contents undefined)."""
        out = {}
        for f in fields:
            buffer = cls.shards.get(f.name)
            if buffer is None or buffer.dtype != f.dtype or buffer.shape[1:] != f.row_shape or len(buffer) < size:
                cls.shards.pop(f.name, None)  # free the old one first
                buffer = cls.shards[f.name] = torch.empty(size, *f.row_shape, dtype=f.dtype)
            out[f.name] = buffer[:size]
        return out

    @classmethod
    def piece(cls, size: int) -> bytearray:
        if len(cls.buffer) < size:
            cls.buffer = bytearray()  # free the old one first
            cls.buffer = bytearray(size)
        return cls.buffer

    @classmethod
    def shard_writer(cls, spec: ExportSpec) -> ShardWriter:
        """A writer into ``spec.folder`` with the spec's attributes (the previous one closed if they differ)."""
        old = cls.writer
        same = (spec.folder, spec.writer_attrs(), spec.group_attrs, spec.compression)
        if old is None or (old.folder, old.attrs, old.group_attrs, old.compression) != same:
            if old is not None:
                old.__exit__(None, None, None)
            cls.writer = ShardWriter(spec.folder, spec.writer_attrs(), spec.group_attrs, compression=spec.compression)
        return cls.writer

    @classmethod
    def release(cls) -> None:
        """Close the kept writer (its threads end) and drop the buffers: what the driver ran in-process is not
        held after the command."""
        writer, cls.writer = cls.writer, None
        if writer is not None:
            writer.__exit__(None, None, None)
        cls.shards.clear()
        cls.buffer = bytearray()


def map_block(
    spec: ExportSpec, path: Path, block: tuple[int, int, int, int], offsets: tuple[int, int], tag: str
) -> int:
    """Read one block of ``path`` and write its rows' pieces for every pass; returns the rows read."""
    with RolloutReader(path, spec.safety, budget=spec.budget) as reader:
        data = {f.name: spec.read(reader, f, block) for f in spec.fields}
        rows = block_rows(block, reader.N, offsets, spec.env_concat, spec.total_envs)
    scratch: Rows | None = None  # the gathered rows of one piece, reused (fresh memory costs page faults)
    for pass_index, plan in enumerate(spec.plan.passes):
        if plan.order is not None:
            positions = plan.positions_of(rows)
        else:
            positions = plan.positions(spec.total_rows)[rows]
        sorted_pos, order = torch.sort(positions)
        kept = int(torch.searchsorted(sorted_pos, 0))  # -1 (rows in no shard) sort first
        sorted_pos, order = sorted_pos[kept:], order[kept:]
        bounds = torch.searchsorted(sorted_pos, torch.tensor(plan.offsets, dtype=torch.int64)).tolist()
        largest = max(hi - lo for lo, hi in itertools.pairwise(bounds))
        if scratch is None or len(next(iter(scratch.values()))) < largest:
            scratch = None  # free the old one first
            scratch = {f.name: torch.empty(largest, *f.row_shape, dtype=f.dtype) for f in spec.fields}
        for shard in range(len(plan.sizes)):
            lo, hi = bounds[shard], bounds[shard + 1]
            if lo == hi:
                continue
            folder = _piece(spec.folder, pass_index, shard)
            folder.mkdir(parents=True, exist_ok=True)
            taken = spec.take(block, data, order[lo:hi], {name: b[: hi - lo] for name, b in scratch.items()})
            _write_piece(folder / tag, sorted_pos[lo:hi] - plan.offsets[shard], taken, spec.fields)
    return rows.numel()


def reduce_shard(spec: ExportSpec, pass_index: int, shard: int, name: str) -> tuple[str, tuple[int, str]]:
    """Assemble one shard from its pieces (any order: each row carries its slot), write it, then remove its
    pieces, whose space the next shards reuse (kept until the end, they doubled the space the export took, and
    writing into tmpfs with less memory free took 1.3x the time: benchmarks/README.md).

    Safe to run again: pieces that are gone were removed after the shard was written, so the shard is complete
    and its record is read back; a shard file beside its pieces is an attempt that died writing it, rewritten.
    """
    folder = _piece(spec.folder, pass_index, shard)
    path = spec.folder / name
    if not folder.is_dir() and path.exists():
        return name, (path.stat().st_size, file_sha256(path))
    path.unlink(missing_ok=True)
    size = spec.plan.passes[pass_index].sizes[shard]
    out = _Warm.shard(spec.fields, size)
    received = 0
    for piece in sorted(folder.iterdir()) if folder.is_dir() else []:
        slots, rows = _read_piece(piece, spec.fields)
        received += slots.numel()
        for f in spec.fields:
            scatter_rows(out[f.name], slots, rows[f.name])
    if received != size:
        raise AssertionError(f"reduce: shard {name} received {received} rows, planned {size}")
    tensors = spec.shape(spec.plan.passes[pass_index], shard, out)
    writer = _Warm.shard_writer(spec)
    writer.submit(name, tensors)
    writer.wait()  # before returning: the next unit refills the buffers
    _remove_pieces(folder)
    return name, writer.results.pop(name)


def _remove_pieces(folder: Path) -> None:
    """Remove a shard's piece folder in one step (renamed first: a unit run again finds all pieces or none)."""
    if folder.is_dir():
        used = folder.with_name(folder.name + ".used")
        shutil.rmtree(used, ignore_errors=True)
        os.replace(folder, used)
        shutil.rmtree(used, ignore_errors=True)


def run_parallel(spec: ExportSpec, folder: Path, sources: list[Any], engine: Any) -> dict[str, tuple[int, str]]:
    """Maps then reduces on ``engine`` into ``folder``; returns each shard file's ``(bytes, sha256)``."""
    try:
        return _map_reduce(replace(spec, folder=folder), sources, engine)
    finally:
        close_pools()
        _Warm.release()


def _map_reduce(spec: ExportSpec, sources: list[Any], engine: Any) -> dict[str, tuple[int, str]]:
    folder = spec.folder
    maps = [
        (map_block, (spec, Path(source.path).absolute(), block, (source.row_offset, source.env_offset), tag))
        for i, source in enumerate(sources)
        for b, block in enumerate(source.blocks)
        for tag in [f"f{i:05d}-b{b:06d}"]
    ]
    run_units(maps, engine)
    plan = spec.plan
    reduces = [
        (reduce_shard, (spec, p, s, f"e{plan.epoch_pass.index(p):04d}-b{s:05d}.h5"))
        for p, each in enumerate(plan.passes)
        for s in range(len(each.sizes))
    ]
    results = dict(run_units(reduces, engine))
    shutil.rmtree(folder / MAP, ignore_errors=True)
    return results
