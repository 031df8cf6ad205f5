"""The shard export on an engine (``batch --workers K``, ``--engine ray``): a map step and a reduce step.

A map unit reads one source block, finds each row's shard and slot in every pass (the plan's streamed order or
its positions) and writes the rows of each shard to a piece file ``.map/p<pass>-s<shard>/<block>`` in the
temporary shard folder (``k`` as 8 bytes, slots ``[k] int64``, then each field's ``[k, *row_shape]`` bytes
padded to 8). A reduce unit scatters a shard's pieces into slot order, shapes them as the mode does and
writes the shard file. The driver runs the maps, then the reduces, then writes the manifest. Units are pure
functions of their arguments and write only their own files, so a retried unit rewrites the same bytes, and
the shards are the bytes of the in-process export (same plan, same rows, same shard writer).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from rolloutcli.core.batching import BatchPlan, ShardPlan, block_rows, scatter_rows
from rolloutcli.hdf5.limits import SafetyOptions
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.shards import FORMAT_VERSION, SHARD_FORMAT, ShardWriter
from rolloutcli.pipeline.engine import close_pools, run_units
from rolloutcli.pipeline.scatter import Field, Rows, aligned

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
    raw = bytearray(path.read_bytes())
    count = int.from_bytes(raw[:8], "little")
    data = torch.frombuffer(raw, dtype=torch.uint8)[8:]
    offset, rows = 8 * count, {}
    for f in fields:
        rows[f.name] = data[offset : offset + count * f.row_bytes].view(f.dtype).view(count, *f.row_shape)
        offset += aligned(count * f.row_bytes)
    return data[: 8 * count].view(torch.int64), rows


def map_block(
    spec: ExportSpec, path: Path, block: tuple[int, int, int, int], offsets: tuple[int, int], tag: str
) -> int:
    """Read one block of ``path`` and write its rows' pieces for every pass; returns the rows read."""
    with RolloutReader(path, spec.safety, budget=spec.budget) as reader:
        data = {f.name: spec.read(reader, f, block) for f in spec.fields}
        rows = block_rows(block, reader.N, offsets, spec.env_concat, spec.total_envs)
    for pass_index, plan in enumerate(spec.plan.passes):
        if plan.order is not None:
            positions = plan.positions_of(rows)
        else:
            positions = plan.positions(spec.total_rows)[rows]
        sorted_pos, order = torch.sort(positions)
        kept = int(torch.searchsorted(sorted_pos, 0))  # -1 (rows in no shard) sort first
        sorted_pos, order = sorted_pos[kept:], order[kept:]
        bounds = torch.searchsorted(sorted_pos, torch.tensor(plan.offsets, dtype=torch.int64)).tolist()
        for shard in range(len(plan.sizes)):
            lo, hi = bounds[shard], bounds[shard + 1]
            if lo == hi:
                continue
            folder = _piece(spec.folder, pass_index, shard)
            folder.mkdir(parents=True, exist_ok=True)
            taken = spec.take(block, data, order[lo:hi], None)
            _write_piece(folder / tag, sorted_pos[lo:hi] - plan.offsets[shard], taken, spec.fields)
    return rows.numel()


def reduce_shard(spec: ExportSpec, pass_index: int, shard: int, name: str) -> tuple[str, tuple[int, str]]:
    """Assemble one shard from its pieces (any order: each row carries its slot) and write it."""
    size = spec.plan.passes[pass_index].sizes[shard]
    out = {f.name: torch.empty(size, *f.row_shape, dtype=f.dtype) for f in spec.fields}
    folder = _piece(spec.folder, pass_index, shard)
    received = 0
    for piece in sorted(folder.iterdir()) if folder.is_dir() else []:
        slots, rows = _read_piece(piece, spec.fields)
        received += slots.numel()
        for f in spec.fields:
            scatter_rows(out[f.name], slots, rows[f.name])
    if received != size:
        raise AssertionError(f"reduce: shard {name} received {received} rows, planned {size}")
    tensors = spec.shape(spec.plan.passes[pass_index], shard, out)
    with ShardWriter(spec.folder, spec.writer_attrs(), spec.group_attrs, compression=spec.compression) as writer:
        writer.submit(name, tensors)
        writer.wait()
    return name, writer.results[name]


def run_parallel(spec: ExportSpec, folder: Path, sources: list[Any], engine: Any) -> dict[str, tuple[int, str]]:
    """Maps then reduces on ``engine`` into ``folder``; returns each shard file's ``(bytes, sha256)``."""
    try:
        return _map_reduce(replace(spec, folder=folder), sources, engine)
    finally:
        close_pools()


def _map_reduce(spec: ExportSpec, sources: list[Any], engine: Any) -> dict[str, tuple[int, str]]:
    folder = spec.folder
    maps = [
        (map_block, (spec, Path(source.reader.path).absolute(), block, (source.row_offset, source.env_offset), tag))
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
