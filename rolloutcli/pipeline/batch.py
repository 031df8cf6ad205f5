"""``rolloutcli batch``: export mini-batch shards (feed-forward, recurrent, distillation) and a manifest.

Every mode is a :class:`~rolloutcli.core.batching.ShardPlan`: the source rows ``t * N + n`` of each shard in
slot order. A shard's fields are gathered as ``[rows, ...]`` in that order, then shaped per mode
(:func:`_shard_tensors`) and written by :class:`~rolloutcli.hdf5.shards.ShardWriter`. Two ways to gather,
with byte-identical results:

* **in memory** (the needed fields take at most half of ``--max-memory``): read them once, then
  ``index_select`` each shard's rows into one of two reused buffer sets (warm memory; the writer threads
  write and hash one set while the next shard is gathered into the other).
* **streamed** (larger files): the feed-forward shuffle is the one step that crosses the whole file, so each
  pass streams blocks (of steps, or of envs) and *scatters* rows: ``positions`` (the inverse of the plan,
  8 bytes per row) gives each row of the block its shard and slot; the block's rows are sorted by position
  and cut into one piece per shard, kept in memory or appended to the shard's spill file ``.spill-<k>`` (in
  the output's temporary folder) once pending pieces exceed a quarter of the budget. A shard is assembled
  (``index_copy_`` at its slots) and written as soon as its last row arrived: recurrent and distillation
  shards complete as the blocks stream past, feed-forward shards at the end of the pass.

Everything is written into a temporary folder that is renamed into place when complete, manifest last.
Orders never depend on the budget, so the shards are identical whichever way they were gathered.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolloutcli.core.batching import BatchPlan, ShardPlan, gather_rows, plan_batches, scatter_rows
from rolloutcli.core.trajectories import hidden_states_at_starts, plan_trajectories, scatter_into_trajectories
from rolloutcli.errors import EXIT_BAD_DATA, EXIT_IO, EXIT_USAGE, RolloutError, problem_line
from rolloutcli.hdf5.atomic import atomic_folder
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.safety import HDF5_ERRORS, translate_hdf5_error
from rolloutcli.hdf5.schema import FLAG_FIELDS
from rolloutcli.hdf5.shards import (
    COMPRESSIONS,
    FORMAT_VERSION,
    MANIFEST_FORMAT,
    SHARD_FORMAT,
    ShardWriter,
    write_manifest,
)
from rolloutcli.hdf5.storage_io import distribution_order
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import NoProgress, Progress

ORDER_TEXT = {
    ("feedforward", False): "epoch e: the e-th torch.randperm(T*N) drawn from torch.Generator().manual_seed(seed); "
    "M mini-batches whose sizes differ by at most one row",
    ("feedforward", True): "RSL-RL: one torch.randperm(M*(T*N//M)) from torch.Generator().manual_seed(seed), "
    "reused every epoch; T*N % M rows dropped",
    ("recurrent", False): "contiguous env groups whose sizes differ by at most one env, the same every epoch",
    ("recurrent", True): "RSL-RL: contiguous groups of N//M envs, the same every epoch; N % M envs dropped",
    ("recurrent", "shuffle"): "epoch e: env groups cut from the e-th torch.randperm(N) of "
    "torch.Generator().manual_seed(seed), sizes differing by at most one env, each sorted",
    ("distillation", False): "RSL-RL generator() order: consecutive step ranges of all envs, sizes differing "
    "by at most one step, the same every epoch",
}


@dataclass(frozen=True)
class BatchOptions:
    """What ``batch`` exports.

    Attributes:
        num_mini_batches: M, shards per epoch (feed-forward rows, recurrent env groups, distillation step ranges).
        epochs: E; epochs that share an order (parity, fixed env groups, distillation) share their files.
        seed: seeds the ``torch.Generator`` every order is drawn from.
        mode: ``feedforward``, ``recurrent`` or ``distillation``.
        rsl_parity: reproduce RSL-RL exactly (one order reused, remainder dropped).
        shuffle_envs: recurrent only: new env groups every epoch.
        compression: None (default, fastest), ``lzf`` or ``gzip``.
    """

    num_mini_batches: int
    epochs: int = 1
    seed: int = 0
    mode: str = "feedforward"
    rsl_parity: bool = False
    shuffle_envs: bool = False
    compression: str | None = None


@dataclass(frozen=True)
class _Field:
    source: str  # HDF5 path in the rollout file
    name: str  # dataset path in the shards
    role: str  # the source field's role (schema)
    dtype: torch.dtype  # as RolloutReader.tensor returns it (normalised)
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


def _usage(message: str) -> RolloutError:
    return RolloutError(message, exit_code=EXIT_USAGE)


def _check_options(options: BatchOptions) -> None:
    if options.mode not in ("feedforward", "recurrent", "distillation"):
        raise _usage(f"batch: expected mode feedforward, recurrent or distillation, found '{options.mode}'.")
    if options.num_mini_batches < 1:
        raise _usage(f"--num-mini-batches: expected an integer >= 1, found {options.num_mini_batches}.")
    if options.epochs < 1:
        raise _usage(f"--epochs: expected an integer >= 1, found {options.epochs}.")
    if options.shuffle_envs and options.mode != "recurrent":
        raise _usage("--shuffle-envs: expected --recurrent (it reshuffles env groups), found another mode.")
    if options.shuffle_envs and options.rsl_parity:
        raise _usage("--shuffle-envs: RSL-RL uses fixed env groups; drop --rsl-parity or --shuffle-envs.")
    if options.rsl_parity and options.mode == "distillation":
        raise _usage("--rsl-parity: distillation shards are always in RSL-RL's generator() order; drop it.")
    if options.compression not in (None, *COMPRESSIONS):
        raise _usage(f"--compression: expected lzf or gzip, found '{options.compression}'.")


def _check_source(reader: RolloutReader, options: BatchOptions) -> None:
    fields, path = reader.schema.fields, reader.path
    if options.mode == "distillation":
        if "privileged_actions" not in fields:
            raise RolloutError.field(
                path,
                "privileged_actions",
                "a dataset [T, N, *action_shape] of teacher actions for --distillation",
                "nothing",
                "Record the teacher's actions, or export RL mini-batches without --distillation.",
            )
    else:
        missing = [name for name in ("advantages", "returns") if name not in fields]
        if missing:
            raise RolloutError.many(
                path,
                [
                    problem_line(path, name, "a dataset [T, N]", "nothing", "Run `rolloutcli gae` first.")
                    for name in missing
                ],
                exit_code=EXIT_BAD_DATA,
            )
    limit = {"feedforward": (reader.T * reader.N, "rows (T*N)"), "recurrent": (reader.N, "envs (N)")}.get(
        options.mode, (reader.T, "steps (T)")
    )
    if options.num_mini_batches > limit[0]:
        raise _usage(
            f"--num-mini-batches: expected at most {limit[0]} (the file's {limit[1]}), "
            f"found {options.num_mini_batches}."
        )


def _fields(reader: RolloutReader, mode: str) -> list[_Field]:
    """The fields a mode exports, observations first, each with its row dtype and shape (probed on env 0)."""
    schema = reader.schema
    pairs = [(path, f"observations/{key}") for key, path in schema.observation_keys.items()]
    if mode == "distillation":
        pairs += [("privileged_actions", "privileged_actions"), ("dones", "dones")]
    else:
        observations = set(schema.observation_keys.values())
        pairs += [(n, n) for n in sorted(schema.per_step_names()) if n not in observations]
        if mode == "recurrent":
            pairs += [(path, path) for net in ("actor", "critic") for path in schema.hidden.get(net, [])]
    out = []
    for source, name in pairs:
        probe = reader.tensor(source, 0, 1)
        role = schema.fields[source].role
        row_shape = (probe.shape[1], probe.shape[3]) if role == "hidden" else tuple(probe.shape[2:])
        out.append(_Field(source, name, role, probe.dtype, row_shape))
    return out


def _read_rows(reader: RolloutReader, field: _Field, start: int, stop: int) -> torch.Tensor:
    """Env block ``[start:stop]`` of a field as time-major rows ``[T * n, *row_shape]``."""
    data = reader.tensor(field.source, start, stop)
    if field.hidden:  # [T, layers, n, H] -> [T, n, layers, H]
        data = data.permute(0, 2, 1, 3)
    return data.reshape(reader.T * (stop - start), *field.row_shape)


def _read_steps(reader: RolloutReader, field: _Field, start: int, stop: int) -> torch.Tensor:
    """Steps ``[start:stop]`` of a (non-hidden) field as rows ``[(stop - start) * N, *row_shape]``.

    A time block of a ``[T, N, ...]`` dataset is one contiguous region: read ~10x faster than an env block's
    strided slab. Normalised like ``RolloutReader.tensor`` (whose dtype ``field`` recorded).
    """
    try:
        data = np.asarray(reader.handle[field.source][start:stop])
    except HDF5_ERRORS as exc:
        raise translate_hdf5_error(reader.path, exc, field.source) from exc
    if field.role in FLAG_FIELDS:
        data = (data != 0).astype(np.uint8)
    else:
        data = data.astype(field.numpy_dtype, copy=False)
    return torch.from_numpy(np.ascontiguousarray(data)).reshape((stop - start) * reader.N, *field.row_shape)


def _shard_tensors(
    mode: str, plan: ShardPlan, shard: int, rows: dict[str, torch.Tensor], fields: list[_Field], T: int, N: int
) -> dict[str, torch.Tensor]:
    """Shape one shard's gathered rows ``{name: [rows, ...]}`` into the datasets of its file (see docs/batch.md)."""
    if mode == "feedforward":
        out = {f.name: rows[f.name] for f in fields}
        out["index"] = plan.rows_of(shard)
        return out
    if mode == "distillation":
        assert plan.steps is not None
        start, stop = plan.steps[shard]
        out = {f.name: rows[f.name].view(stop - start, N, *f.row_shape) for f in fields}
        out["steps"] = torch.arange(start, stop, dtype=torch.int64)
        return out
    assert plan.envs is not None
    envs = plan.envs[shard]
    per_step = {f.name: rows[f.name].view(T, envs.numel(), *f.row_shape) for f in fields}
    trajectories = plan_trajectories(per_step["dones"])
    spans = trajectories.spans
    out = {}
    for f in fields:
        if f.name.startswith("observations/"):
            out[f.name] = scatter_into_trajectories(per_step[f.name], trajectories)
    out["masks"] = trajectories.masks()
    for f in fields:
        if f.hidden:  # the state fed into the network at each trajectory's first step: [layers, M, H]
            out[f.name] = hidden_states_at_starts(per_step[f.name].permute(0, 2, 1, 3), spans)
        elif not f.name.startswith("observations/"):
            out[f.name] = per_step[f.name]
    out["env_ids"] = envs.to(torch.int64)
    out["trajectory_env"] = envs.to(torch.int64)[spans.env]
    out["trajectory_start"] = spans.start
    return out


class _Emitter:
    """Hands shards to the writer under their file names (after the first epoch that uses them), and lends
    the two reused buffer sets that shards are gathered into."""

    def __init__(
        self,
        plan: BatchPlan,
        writer: ShardWriter,
        fields: list[_Field],
        T: int,
        N: int,
        progress: Progress,
        *,
        buffer_sets: int = 2,
    ) -> None:
        self.plan, self.writer, self.fields, self.T, self.N, self.progress = plan, writer, fields, T, N, progress
        self.largest = max(max(p.sizes) for p in plan.passes)
        self.buffer_sets = buffer_sets
        self._buffers: list[dict[str, torch.Tensor]] = []
        self._count = 0

    def file_name(self, pass_index: int, shard: int) -> str:
        return f"e{self.plan.epoch_pass.index(pass_index):04d}-b{shard:05d}.h5"

    def buffers(self, size: int) -> dict[str, torch.Tensor]:
        """``[size, *row_shape]`` views of the buffer set the next shard may use.

        With two sets, they alternate: the writer holds one until the shard after it is submitted. With one
        (the streamed export, to keep memory down), the shard in flight is waited for first. Reused memory
        is warm; a fresh allocation per shard costs page faults that take longer than the copy itself.
        """
        if not self._buffers:
            self._buffers = [
                {f.name: torch.empty(self.largest, *f.row_shape, dtype=f.dtype) for f in self.fields}
                for _ in range(self.buffer_sets)
            ]
        if self.buffer_sets == 1:
            self.writer.wait()
        return {name: buffer[:size] for name, buffer in self._buffers[self._count % self.buffer_sets].items()}

    def prepare(self) -> None:
        """Build the writer's file layouts before any data is held (feed-forward and distillation shards have
        one or two shapes; a layout's construction briefly takes twice a shard's size)."""
        if self.plan.mode == "recurrent":
            return
        plan = self.plan.passes[0]
        for shard in sorted({plan.sizes.index(size) for size in plan.sizes}):
            size = plan.sizes[shard]
            if self.plan.mode == "feedforward":
                shapes = {f.name: ((size, *f.row_shape), f.numpy_dtype) for f in self.fields}
                shapes["index"] = ((size,), np.dtype(np.int64))
            else:
                assert plan.steps is not None
                steps = plan.steps[shard][1] - plan.steps[shard][0]
                shapes = {f.name: ((steps, self.N, *f.row_shape), f.numpy_dtype) for f in self.fields}
                shapes["steps"] = ((steps,), np.dtype(np.int64))
            self.writer.prepare(shapes)

    def emit(self, pass_index: int, shard: int, rows: dict[str, torch.Tensor]) -> None:
        plan = self.plan.passes[pass_index]
        tensors = _shard_tensors(self.plan.mode, plan, shard, rows, self.fields, self.T, self.N)
        self.writer.submit(self.file_name(pass_index, shard), tensors)
        self._count += 1
        self.progress.advance()


def _in_memory(reader: RolloutReader, fields: list[_Field], emitter: _Emitter) -> None:
    """Read every needed field once, then gather each shard into one of two reused buffer sets."""
    source = {f.name: _read_rows(reader, f, 0, reader.N) for f in fields}
    for pass_index, plan in enumerate(emitter.plan.passes):
        for shard, size in enumerate(plan.sizes):
            index = plan.rows_of(shard)
            target = emitter.buffers(size)
            rows = {name: gather_rows(source[name], index, out=target[name]) for name in source}
            emitter.emit(pass_index, shard, rows)


def _aligned(nbytes: int) -> int:
    """Round up to 8 bytes, so every field of a spill chunk starts aligned for its dtype."""
    return (nbytes + 7) // 8 * 8


class _Spill:
    """Rows of shards waiting for the rest of their rows: in memory, or appended to a spill file per shard.

    A spill chunk of k rows is ``slots [k] int64`` then, per field, its ``[k, *row_shape]`` bytes padded to
    8 bytes. Only the chunk sizes stay in memory.
    """

    def __init__(self, folder: Path, fields: list[_Field], budget: int) -> None:
        self.folder, self.fields, self.budget = folder, fields, budget
        # Deleting a large file takes the file system a while: do it beside the work.
        self.cleaner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutcli-spill")
        self.pending: dict[int, list[tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {}
        self.chunks: dict[int, list[int]] = {}
        self.pending_bytes = 0
        self.row_bytes = 8 + sum(f.row_bytes for f in fields)

    def path(self, shard: int) -> Path:
        return self.folder / f".spill-{shard:06d}"

    def add(self, shard: int, slots: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        self.pending.setdefault(shard, []).append((slots, rows))
        self.pending_bytes += slots.numel() * self.row_bytes

    def spill_if_needed(self) -> None:
        if self.pending_bytes <= self.budget:
            return
        for shard, pieces in self.pending.items():
            try:
                with open(self.path(shard), "ab") as handle:
                    for slots, rows in pieces:
                        handle.write(slots.numpy().data)
                        for f in self.fields:
                            data = rows[f.name].contiguous().view(-1).view(torch.uint8).numpy().data
                            handle.write(data)
                            handle.write(bytes(_aligned(len(data)) - len(data)))
                        self.chunks.setdefault(shard, []).append(slots.numel())
            except OSError as exc:
                raise RolloutError(
                    f"{self.path(shard)}: cannot write temporary data: {exc.strerror or exc}. Free disk space.",
                    exit_code=EXIT_IO,
                ) from exc
        self.pending, self.pending_bytes = {}, 0

    def _read_chunks(self, shard: int, chunks: list[int]) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        pieces = []
        with open(self.path(shard), "rb") as handle:
            for count in chunks:
                widths = [_aligned(count * f.row_bytes) for f in self.fields]
                raw = bytearray(8 * count + sum(widths))
                handle.readinto(raw)
                data = torch.frombuffer(raw, dtype=torch.uint8)
                offset, rows = 8 * count, {}
                for f, width in zip(self.fields, widths, strict=True):
                    part = data[offset : offset + count * f.row_bytes]
                    rows[f.name] = part.view(f.dtype).view(count, *f.row_shape)
                    offset += width
                pieces.append((data[: 8 * count].view(torch.int64), rows))
        self.cleaner.submit(self.path(shard).unlink)
        return pieces

    def close(self) -> None:
        self.cleaner.shutdown(wait=True)

    def assemble(self, shard: int, size: int, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The shard's rows in slot order, in ``out`` (``[size, ...]`` per field) unless they arrived in one
        piece; its spill file is read and deleted."""
        pieces = self.pending.pop(shard, [])
        self.pending_bytes -= sum(slots.numel() for slots, _ in pieces) * self.row_bytes
        chunks = self.chunks.pop(shard, [])
        if not chunks and len(pieces) == 1 and pieces[0][0].numel() == size:
            return pieces[0][1]  # one piece, sorted by position: already in slot order
        pieces = (self._read_chunks(shard, chunks) if chunks else []) + pieces
        for slots, rows in pieces:
            for f in self.fields:
                scatter_rows(out[f.name], slots, rows[f.name])
        return out


def _stream_blocks(reader: RolloutReader, fields: list[_Field], mode: str, budget: int) -> list[tuple[str, int, int]]:
    """Blocks of the source to stream: ``("steps", t0, t1)`` or ``("envs", n0, n1)``.

    Step blocks when every field is contiguous or chunked across all envs: a time block is then one
    contiguous region (about 10x faster to read than an env block's strided slab), and distillation ranges
    complete as the stream passes. Env blocks for recurrent shards (an env group's rows arrive together) and
    for files chunked by env (a step block would decompress every chunk once per block).

    A block's read takes an eighth of ``budget``: the read, its sorted copy and the pieces cut from it are
    alive together, and pending pieces take another quarter before they are spilled.
    """
    specs = [reader.schema.fields[f.source] for f in fields]
    by_steps = mode != "recurrent" and all(s.chunks is None or s.chunks[1] >= reader.N for s in specs)
    if not by_steps:
        return [("envs", a, b) for a, b in reader.blocks([f.source for f in fields], budget=max(budget // 8, 1))]
    per_step = reader.N * sum(f.row_bytes for f in fields)
    steps = max(1, (budget // 8) // max(per_step, 1))
    return [("steps", t, min(reader.T, t + steps)) for t in range(0, reader.T, steps)]


def _streamed(
    reader: RolloutReader,
    fields: list[_Field],
    emitter: _Emitter,
    folder: Path,
    blocks: list[tuple[str, int, int]],
    budget: int,
) -> None:
    """Stream blocks per pass, scatter rows to their shards (spilling), write shards as they complete."""
    T, N = reader.T, reader.N
    for pass_index, plan in enumerate(emitter.plan.passes):
        positions = plan.positions(T * N)
        offsets = torch.tensor(plan.offsets, dtype=torch.int64)
        received = [0] * len(plan.sizes)
        spill = _Spill(folder, fields, max(budget // 4, 1))
        try:
            for kind, start, stop in blocks:
                if kind == "envs":
                    rows = {f.name: _read_rows(reader, f, start, stop) for f in fields}
                    block_positions = positions.view(T, N)[:, start:stop].reshape(-1)
                else:
                    rows = {f.name: _read_steps(reader, f, start, stop) for f in fields}
                    block_positions = positions[start * N : stop * N]
                sorted_pos, order = torch.sort(block_positions)
                kept = int(torch.searchsorted(sorted_pos, 0))  # -1 (rows in no shard) sort first
                sorted_pos, order = sorted_pos[kept:], order[kept:]
                gathered = {name: gather_rows(value, order) for name, value in rows.items()}
                del rows
                bounds = torch.searchsorted(sorted_pos, offsets).tolist()
                for shard, size in enumerate(plan.sizes):
                    lo, hi = bounds[shard], bounds[shard + 1]
                    if lo == hi:
                        continue
                    slots = sorted_pos[lo:hi] - plan.offsets[shard]
                    spill.add(shard, slots, {name: value[lo:hi] for name, value in gathered.items()})
                    received[shard] += hi - lo
                    if received[shard] == size:
                        rows = spill.assemble(shard, size, emitter.buffers(size))
                        emitter.emit(pass_index, shard, rows)
                spill.spill_if_needed()
                emitter.progress.advance()
        finally:
            spill.close()
        assert received == list(plan.sizes), "every planned row must arrive exactly once"


def _hash_file(path: Path, result: dict[str, str], stop: threading.Event) -> None:
    """sha256 of the source, in a thread beside the export (hashlib releases the GIL)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            while not stop.is_set() and (chunk := handle.read(8 << 20)):
                digest.update(chunk)
    except OSError as exc:
        result["error"] = exc.strerror or str(exc)
        return
    result["sha256"] = digest.hexdigest()


def _gae_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """What a ``gae`` run recorded in the source (None where it recorded nothing)."""
    names = {
        "gamma": "gae_gamma",
        "lambda": "gae_lambda",
        "advantages_normalized": "advantages_normalized",
        "timeouts_bootstrapped": "timeouts_bootstrapped",
    }
    return {key: attrs.get(name) for key, name in names.items()}


def _manifest(
    reader: RolloutReader,
    options: BatchOptions,
    plan: BatchPlan,
    fields: list[_Field],
    entries: list[dict[str, Any]],
    source_sha256: str,
    distribution: list[str],
) -> dict[str, Any]:
    src = reader.path
    order_key = (options.mode, "shuffle" if options.shuffle_envs else options.rsl_parity)
    return {
        "format": MANIFEST_FORMAT,
        "format_version": FORMAT_VERSION,
        "mode": options.mode,
        "source": {
            "path": os.path.abspath(src),
            "size_bytes": os.stat(src).st_size,
            "sha256": source_sha256,
            "T": reader.T,
            "N": reader.N,
        },
        "options": {key: value for key, value in asdict(options).items() if key != "mode"},
        "order": ORDER_TEXT[order_key],
        "gae": _gae_attrs(reader.schema.attrs),
        "rows_per_epoch": sum(plan.passes[0].sizes),
        "dropped_rows": plan.dropped_rows,
        "dropped_envs": plan.dropped_envs,
        "observation_keys": sorted(reader.schema.observation_keys),
        "distribution_order": distribution,
        "fields": {
            f.name: {"dtype": str(f.dtype).removeprefix("torch."), "row_shape": list(f.row_shape)} for f in fields
        },
        "shards": entries,
    }


def run_batch(
    src: Path,
    dst: Path,
    options: BatchOptions,
    run: RunOptions,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write the shard folder ``dst`` from the rollout file ``src``; return a summary dict.

    Raises:
        RolloutError: bad options or ``num_mini_batches`` too large (exit 2), missing ``advantages``/
            ``returns`` in an RL mode or ``privileged_actions`` for distillation (exit 1), I/O faults (exit 3).
    """
    progress = progress or NoProgress()
    started = time.perf_counter()
    _check_options(options)
    src, dst = Path(src), Path(dst)
    with RolloutReader(src, run.safety, budget=run.max_memory) as reader:
        _check_source(reader, options)
        T, N = reader.T, reader.N
        fields = _fields(reader, options.mode)
        plan = plan_batches(
            options.mode,
            T,
            N,
            options.num_mini_batches,
            options.epochs,
            parity=options.rsl_parity,
            shuffle_envs=options.shuffle_envs,
            generator=torch.Generator().manual_seed(options.seed),
        )
        streamed = T * N * sum(f.row_bytes for f in fields) > run.max_memory // 2
        blocks = _stream_blocks(reader, fields, options.mode, run.max_memory) if streamed else []
        exported = any(f.name.startswith("distribution/") for f in fields)
        distribution = distribution_order(reader) if exported else []
        group_attrs = {"distribution": {"order": distribution}} if exported else {}
        attrs = {"rolloutcli_format": SHARD_FORMAT, "format_version": FORMAT_VERSION, "mode": options.mode}
        source_hash: dict[str, str] = {}
        stop_hash = threading.Event()
        hasher = threading.Thread(target=_hash_file, args=(src, source_hash, stop_hash), daemon=True)
        # One torch thread: the gathers are a small part of the work, and an idle OpenMP worker spinning on
        # the second core slowed the hashing and writing threads (measured: 2-3x slower exports).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            hasher.start()  # the source's sha256, beside the export
            with atomic_folder(dst, inputs=[src], overwrite=overwrite) as tmp:
                with ShardWriter(tmp, attrs, group_attrs, compression=options.compression, label=dst) as writer:
                    emitter = _Emitter(plan, writer, fields, T, N, progress, buffer_sets=1 if streamed else 2)
                    emitter.prepare()
                    progress.start("batch", sum(len(p.sizes) for p in plan.passes) + len(plan.passes) * len(blocks))
                    if streamed:
                        _streamed(reader, fields, emitter, tmp, blocks, run.max_memory)
                    else:
                        _in_memory(reader, fields, emitter)
                    writer.wait_all()
                hasher.join()
                if "sha256" not in source_hash:
                    reason = source_hash.get("error")
                    raise RolloutError(f"{src}: cannot read the file to hash it: {reason}.", exit_code=EXIT_IO)
                entries = []
                for epoch, pass_index in enumerate(plan.epoch_pass):
                    for shard, size in enumerate(plan.passes[pass_index].sizes):
                        name = emitter.file_name(pass_index, shard)
                        entry = {"file": name, "epoch": epoch, "mini_batch": shard, "rows": size}
                        entries.append({**entry, "sha256": writer.results[name][1]})
                manifest = _manifest(reader, options, plan, fields, entries, source_hash["sha256"], distribution)
                write_manifest(tmp, manifest)  # last: a folder with a manifest is complete
                progress.finish()
        finally:
            torch.set_num_threads(threads)
            stop_hash.set()
            progress.finish()
    written = sum(size for size, _ in writer.results.values())
    seconds = time.perf_counter() - started
    return {
        "input": str(src),
        "output": str(dst),
        "mode": options.mode,
        "T": T,
        "N": N,
        **{key: value for key, value in asdict(options).items() if key != "mode"},
        "files": len(writer.results),
        "entries": len(entries),
        "rows_per_epoch": manifest["rows_per_epoch"],
        "dropped_rows": plan.dropped_rows,
        "dropped_envs": plan.dropped_envs,
        "bytes_written": written,
        "streamed": streamed,
        "blocks": len(blocks) if streamed else 1,
        "gae": manifest["gae"],
        "order": manifest["order"],
        "seconds": seconds,
        "gb_per_s": written / seconds / 1e9 if seconds > 0 else None,
    }
