"""``rolloutcli batch``: export mini-batch shards (feed-forward, recurrent, distillation) and a manifest.

Every mode is a :class:`~rolloutcli.core.batching.ShardPlan`: the source rows ``t * N + n`` of each shard in
slot order. A shard's fields are gathered as ``[rows, ...]`` in that order, then shaped per mode
(:func:`_shard_tensors`) and written by :class:`~rolloutcli.hdf5.shards.ShardWriter`. Two ways to gather,
with byte-identical results:

* **in memory** (the needed fields take at most half of ``--max-memory``): read them once, then
  ``index_select`` each shard's rows into one of two reused buffer sets (warm memory; the writer threads
  write and hash one set while the next shard is gathered into the other).
* **streamed** (larger files): the feed-forward shuffle is the one step that crosses the whole file, so each
  pass streams blocks (of steps, or of envs) and *scatters* rows (:mod:`rolloutcli.pipeline.scatter`,
  shared with ``batch --history``): ``positions`` (the inverse of the plan,
  8 bytes per row) gives each row of the block its shard and slot; the block's rows are sorted by position
  and cut into one piece per shard, kept in memory or appended to the shard's spill file ``.spill-<k>`` (in
  the output's temporary folder) once pending pieces exceed a quarter of the budget. A shard is assembled
  (``index_copy_`` at its slots) and written as soon as its last row arrived: recurrent and distillation
  shards complete as the blocks stream past, feed-forward shards at the end of the pass.

Everything is written into a temporary folder that is renamed into place when complete, manifest last.
Orders never depend on the budget, so the shards are identical whichever way they were gathered.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolloutcli.core.batching import BatchPlan, ShardPlan, gather_fields, plan_batches
from rolloutcli.core.trajectories import hidden_states_at_starts, plan_trajectories, scatter_into_trajectories
from rolloutcli.errors import EXIT_BAD_DATA, EXIT_USAGE, RolloutError, problem_line
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.safety import HDF5_ERRORS, translate_hdf5_error
from rolloutcli.hdf5.schema import FLAG_FIELDS
from rolloutcli.hdf5.shards import (
    COMPRESSIONS,
    FORMAT_VERSION,
    MANIFEST_FORMAT,
    SHARD_FORMAT,
    Shapes,
)
from rolloutcli.hdf5.storage_io import distribution_order
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import NoProgress, Progress
from rolloutcli.pipeline.scatter import ShardScatter
from rolloutcli.pipeline.shard_export import Emitter, Field, ShardExport, field_records, gae_attrs, source_record

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


def _fields(reader: RolloutReader, mode: str) -> list[Field]:
    """The fields a mode exports, observations first, each with its row dtype and shape (as read, normalised)."""
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
        dtype, shape = reader.normalized(source, 0, 1)  # what reading env 0 would return (metadata only)
        role = schema.fields[source].role
        row_shape = (shape[1], shape[3]) if role == "hidden" else tuple(shape[2:])
        out.append(Field(source, name, role, torch.from_numpy(np.empty(0, dtype)).dtype, row_shape))
    return out


def _read_rows(reader: RolloutReader, field: Field, start: int, stop: int) -> torch.Tensor:
    """Env block ``[start:stop]`` of a field as time-major rows ``[T * n, *row_shape]``."""
    data = reader.tensor(field.source, start, stop)
    if field.hidden:  # [T, layers, n, H] -> [T, n, layers, H]
        data = data.permute(0, 2, 1, 3)
    return data.reshape(reader.T * (stop - start), *field.row_shape)


def _read_steps(reader: RolloutReader, field: Field, start: int, stop: int) -> torch.Tensor:
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
    mode: str, plan: ShardPlan, shard: int, rows: dict[str, torch.Tensor], fields: list[Field], T: int, N: int
) -> dict[str, torch.Tensor]:
    """Shape one shard's gathered rows ``{name: [rows, ...]}`` into its file's datasets (README: the shard folder)."""
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


def _in_memory(reader: RolloutReader, fields: list[Field], emitter: Emitter) -> None:
    """Read every needed field once, then gather each shard into one of two reused buffer sets."""
    source = {f.name: _read_rows(reader, f, 0, reader.N) for f in fields}
    for pass_index, plan in enumerate(emitter.plan.passes):
        for shard, size in enumerate(plan.sizes):
            index = plan.rows_of(shard)
            target = emitter.buffers(size)
            rows = gather_fields(source, index, target)
            emitter.emit(pass_index, shard, rows)


def _stream_blocks(reader: RolloutReader, fields: list[Field], mode: str, budget: int) -> list[tuple[str, int, int]]:
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
    fields: list[Field],
    emitter: Emitter,
    folder: Path,
    blocks: list[tuple[str, int, int]],
    budget: int,
) -> None:
    """Stream blocks per pass and scatter their rows to their shards (:mod:`rolloutcli.pipeline.scatter`)."""
    T, N = reader.T, reader.N
    for pass_index, plan in enumerate(emitter.plan.passes):
        positions = plan.positions(T * N)

        def complete(shard: int, rows: dict[str, torch.Tensor], pass_index: int = pass_index) -> None:
            emitter.emit(pass_index, shard, rows)

        with ShardScatter(
            folder, fields, plan.sizes, budget // 4, buffers=emitter.buffers, complete=complete
        ) as scatter:
            for kind, start, stop in blocks:
                if kind == "envs":
                    rows = {f.name: _read_rows(reader, f, start, stop) for f in fields}
                    block_positions = positions.view(T, N)[:, start:stop].reshape(-1)
                else:
                    rows = {f.name: _read_steps(reader, f, start, stop) for f in fields}
                    block_positions = positions[start * N : stop * N]
                scatter.add(block_positions, rows)
                del rows
                emitter.progress.advance()
        scatter.finish()


def _layouts(plan: BatchPlan, fields: list[Field], N: int) -> list[Shapes]:
    """The file layouts of feed-forward and distillation shards (one or two shapes), built before any data
    is held; recurrent shards vary with their trajectories and are laid out as they come."""
    if plan.mode == "recurrent":
        return []
    first = plan.passes[0]
    out: list[Shapes] = []
    for shard in sorted({first.sizes.index(size) for size in first.sizes}):
        size = first.sizes[shard]
        if plan.mode == "feedforward":
            shapes = {f.name: ((size, *f.row_shape), f.numpy_dtype) for f in fields}
            shapes["index"] = ((size,), np.dtype(np.int64))
        else:
            assert first.steps is not None
            steps = first.steps[shard][1] - first.steps[shard][0]
            shapes = {f.name: ((steps, N, *f.row_shape), f.numpy_dtype) for f in fields}
            shapes["steps"] = ((steps,), np.dtype(np.int64))
        out.append(shapes)
    return out


def _manifest(
    reader: RolloutReader,
    options: BatchOptions,
    plan: BatchPlan,
    fields: list[Field],
    entries: list[dict[str, Any]],
    source_hash: str,
    distribution: list[str],
) -> dict[str, Any]:
    order_key = (options.mode, "shuffle" if options.shuffle_envs else options.rsl_parity)
    return {
        "format": MANIFEST_FORMAT,
        "format_version": FORMAT_VERSION,
        "mode": options.mode,
        "source": source_record(reader, source_hash),
        "options": {key: value for key, value in asdict(options).items() if key != "mode"},
        "order": ORDER_TEXT[order_key],
        "gae": gae_attrs(reader.schema.attrs),
        "rows_per_epoch": sum(plan.passes[0].sizes),
        "dropped_rows": plan.dropped_rows,
        "dropped_envs": plan.dropped_envs,
        "observation_keys": sorted(reader.schema.observation_keys),
        "distribution_order": distribution,
        "fields": field_records(fields),
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

        def shard_tensors(pass_index: int, shard: int, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return _shard_tensors(options.mode, plan.passes[pass_index], shard, rows, fields, T, N)

        try:
            with ShardExport(src, dst, attrs, group_attrs, compression=options.compression, overwrite=overwrite) as out:
                emitter = Emitter(plan, out.writer, fields, progress, shard_tensors, buffer_sets=1 if streamed else 2)
                emitter.prepare(_layouts(plan, fields, N))
                progress.start("batch", sum(len(p.sizes) for p in plan.passes) + len(plan.passes) * len(blocks))
                if streamed:
                    _streamed(reader, fields, emitter, out.tmp, blocks, run.max_memory)
                else:
                    _in_memory(reader, fields, emitter)
                content_hash = out.source_hash()
                entries = emitter.entries()
                manifest = _manifest(reader, options, plan, fields, entries, content_hash, distribution)
                out.publish(manifest)
        finally:
            progress.finish()
    seconds = time.perf_counter() - started
    return {
        "input": str(src),
        "output": str(dst),
        "mode": options.mode,
        "T": T,
        "N": N,
        **{key: value for key, value in asdict(options).items() if key != "mode"},
        "files": len(out.writer.results),
        "entries": len(entries),
        "rows_per_epoch": manifest["rows_per_epoch"],
        "dropped_rows": plan.dropped_rows,
        "dropped_envs": plan.dropped_envs,
        "bytes_written": out.bytes_written,
        "streamed": streamed,
        "blocks": len(blocks) if streamed else 1,
        "gae": manifest["gae"],
        "order": manifest["order"],
        "seconds": seconds,
        "gb_per_s": out.bytes_written / seconds / 1e9 if seconds > 0 else None,
    }
