"""``rolloutcli batch --history K``: shards of fixed-length history windows ``[B, K, ...]`` and a manifest.

The windows are those a ``CircularBuffer(K, N)`` filled with the rollout step by step would hold (see
:mod:`rolloutcli.core.history`): by default the env's buffer is reset after each done, so a window never
spans an episode end; ``across_episodes`` never resets (AMP's replay buffers). Only windows whose K steps
were all recorded are exported (no padding). Epoch e shuffles every eligible window with the e-th
``torch.randperm(W)`` of ``torch.Generator().manual_seed(seed)`` and cuts it into M mini-batches whose sizes
differ by at most one (:func:`~rolloutcli.core.history.history_plan`).

A shard holds ``observations/<group> [B, K, ...]`` (the chosen groups), ``window_dones [B, K]`` (uint8),
``window_env [B]`` and ``window_end [B]`` (int64: the env and the step ``t`` of each window's newest entry).

Two ways to gather, byte-identical:

* **in memory** (the chosen groups and ``dones`` take at most half of ``--max-memory``): read them once and
  gather each shard's windows with one ``index_select`` per field.
* **streamed**: windows are per env, so each pass (epoch) reads env blocks of an eighth of the budget,
  gathers the block's windows in chunks of at most another eighth, already sorted by their position in the
  epoch's order, and hands them to the spill scatter (:mod:`rolloutcli.pipeline.scatter`, shared with the
  feed-forward export), which writes each shard once its last window arrived.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolloutcli.core.batching import BatchPlan
from rolloutcli.core.history import gather_windows, history_plan, window_ends, window_mask
from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.shards import COMPRESSIONS, FORMAT_VERSION, MANIFEST_FORMAT, SHARD_FORMAT, Shapes
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import NoProgress, Progress
from rolloutcli.pipeline.scatter import ShardScatter
from rolloutcli.pipeline.shard_export import Emitter, Field, ShardExport, field_records, source_record

ORDER_TEXT = (
    "epoch e: the e-th torch.randperm(W) drawn from torch.Generator().manual_seed(seed), applied to the W "
    "eligible windows in ascending order of their newest step's row t*N+n; M mini-batches whose sizes differ "
    "by at most one window"
)
WINDOW_TEXT = (
    "window_end t, window_env n: steps t-K+1..t of env n, oldest to newest (CircularBuffer.buffer order); "
    "only windows whose K steps were all recorded (t >= K-1, no padding); {episodes}"
)
EPISODES_TEXT = {
    False: "the env's buffer is reset after each done: no done among a window's first K-1 steps",
    True: "never reset (AMP): windows may straddle episode ends (see window_dones)",
}


@dataclass(frozen=True)
class HistoryOptions:
    """What ``batch --history`` exports.

    Attributes:
        history: K, steps per window (>= 1, <= T).
        num_mini_batches: M, shards per epoch (<= the eligible windows W).
        epochs: E, each with a fresh order (a file per mini-batch and epoch).
        seed: seeds the ``torch.Generator`` the orders are drawn from.
        across_episodes: never reset the buffers at dones (windows may straddle episode ends).
        groups: observation groups to export (None: all, in the file's order).
        compression: None (default, fastest), ``lzf`` or ``gzip``.
    """

    history: int
    num_mini_batches: int
    epochs: int = 1
    seed: int = 0
    across_episodes: bool = False
    groups: tuple[str, ...] | None = None
    compression: str | None = None


def _usage(message: str) -> RolloutError:
    return RolloutError(message, exit_code=EXIT_USAGE)


def _check_options(options: HistoryOptions) -> None:
    if options.history < 1:
        raise _usage(f"--history: expected an integer >= 1 (steps per window), found {options.history}.")
    if options.num_mini_batches < 1:
        raise _usage(f"--num-mini-batches: expected an integer >= 1, found {options.num_mini_batches}.")
    if options.epochs < 1:
        raise _usage(f"--epochs: expected an integer >= 1, found {options.epochs}.")
    if options.groups is not None and not options.groups:
        raise _usage("--observations: expected one or more observation groups (policy,critic), found none.")
    if options.compression not in (None, *COMPRESSIONS):
        raise _usage(f"--compression: expected lzf or gzip, found '{options.compression}'.")


def _groups(reader: RolloutReader, options: HistoryOptions) -> list[str]:
    """The observation groups to export, in the order asked (default: the file's), each once."""
    known = list(reader.schema.observation_keys)
    if options.groups is None:
        return known
    unknown = [g for g in options.groups if g not in reader.schema.observation_keys]
    if unknown:
        raise _usage(
            f"--observations: expected groups of {reader.path} ({', '.join(known)}), found "
            f"{', '.join(repr(g) for g in unknown)}."
        )
    return list(dict.fromkeys(options.groups))


def _fields(reader: RolloutReader, groups: list[str], history: int) -> list[Field]:
    """The chosen groups and ``dones`` as window fields (rows ``[K, *entry_shape]``), probed on env 0."""
    schema = reader.schema
    pairs = [(schema.observation_keys[g], f"observations/{g}") for g in groups] + [("dones", "window_dones")]
    out = []
    for source, name in pairs:
        probe = reader.tensor(source, 0, 1)  # [T, 1, *entry_shape], normalised (dones: uint8 0/1)
        out.append(Field(source, name, schema.fields[source].role, probe.dtype, (history, *probe.shape[2:])))
    return out


def _eligible(reader: RolloutReader, options: HistoryOptions, budget: int) -> torch.Tensor:
    """``[T, N]`` bool window mask (:func:`~rolloutcli.core.history.window_mask`), from env blocks of dones.

    A block's stored dones take a 32nd of ``budget``: the mask's temporaries take up to ~19 bytes per step.
    """
    mask = torch.empty((reader.T, reader.N), dtype=torch.bool)
    for start, stop in reader.blocks(["dones"], budget=max(budget // 32, 1)):
        dones = reader.tensor("dones", start, stop)
        mask[:, start:stop] = window_mask(dones, options.history, across_episodes=options.across_episodes)
    return mask


def _shard_tensors(
    plan: BatchPlan, pass_index: int, shard: int, rows: dict[str, torch.Tensor], N: int
) -> dict[str, torch.Tensor]:
    """A shard's datasets: the gathered windows ``[B, K, ...]`` plus ``window_env``/``window_end [B]`` int64."""
    ends = plan.passes[pass_index].rows_of(shard)
    return {**rows, "window_env": torch.remainder(ends, N), "window_end": torch.div(ends, N, rounding_mode="floor")}


def _layouts(plan: BatchPlan, fields: list[Field]) -> list[Shapes]:
    """Shard layouts (one per mini-batch size: at most two), built before any data is held."""
    out: list[Shapes] = []
    for size in sorted(set(plan.passes[0].sizes), reverse=True):
        shapes = {f.name: ((size, *f.row_shape), f.numpy_dtype) for f in fields}
        shapes["window_env"] = shapes["window_end"] = ((size,), np.dtype(np.int64))
        out.append(shapes)
    return out


def _in_memory(reader: RolloutReader, fields: list[Field], emitter: Emitter, history: int) -> None:
    """Read the fields once (``[T, N, ...]``), then gather each shard's windows into reused buffers."""
    source = {f.name: reader.tensor(f.source) for f in fields}
    for pass_index, plan in enumerate(emitter.plan.passes):
        for shard, size in enumerate(plan.sizes):
            ends = plan.rows_of(shard)
            target = emitter.buffers(size)
            rows = {name: gather_windows(source[name], ends, history, out=target[name]) for name in source}
            emitter.emit(pass_index, shard, rows)


def _streamed(
    reader: RolloutReader,
    fields: list[Field],
    emitter: Emitter,
    mask: torch.Tensor,
    folder: Path,
    blocks: list[tuple[int, int]],
    budget: int,
) -> None:
    """Per pass: read env blocks, gather their windows in position order, scatter them to their shards."""
    T, N = reader.T, reader.N
    history = fields[0].row_shape[0]
    chunk = max(1, (budget // 8) // max(sum(f.row_bytes for f in fields), 1))
    for pass_index, plan in enumerate(emitter.plan.passes):
        positions = plan.positions(T * N).view(T, N)

        def complete(shard: int, rows: dict[str, torch.Tensor], pass_index: int = pass_index) -> None:
            emitter.emit(pass_index, shard, rows)

        with ShardScatter(folder, fields, plan.sizes, budget // 4, buffers=emitter.buffers, complete=complete) as out:
            for start, stop in blocks:
                block = {f.name: reader.tensor(f.source, start, stop) for f in fields}  # [T, n, ...]
                local = window_ends(mask[:, start:stop])  # rows t * n + j of the block
                where = positions[:, start:stop].reshape(-1)[local]
                where, order = torch.sort(where)
                local = local[order]
                assert local.numel() == 0 or int(where[0]) >= 0, "every eligible window is in every epoch"
                for lo in range(0, local.numel(), chunk):
                    ends = local[lo : lo + chunk]
                    windows = {name: gather_windows(value, ends, history) for name, value in block.items()}
                    out.add(where[lo : lo + chunk], windows, ordered=True)
                del block
                emitter.progress.advance()
        out.finish()


def _manifest(
    reader: RolloutReader,
    options: HistoryOptions,
    groups: list[str],
    fields: list[Field],
    windows: int,
    entries: list[dict[str, Any]],
    source_hash: str,
) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "format_version": FORMAT_VERSION,
        "mode": "history",
        "source": source_record(reader, source_hash),
        "options": {
            "num_mini_batches": options.num_mini_batches,
            "epochs": options.epochs,
            "seed": options.seed,
            "history": options.history,
            "across_episodes": options.across_episodes,
            "observations": groups,
            "compression": options.compression,
        },
        "order": ORDER_TEXT,
        "history": options.history,
        "across_episodes": options.across_episodes,
        "padding": "none",
        "window": WINDOW_TEXT.format(episodes=EPISODES_TEXT[options.across_episodes]),
        "groups": groups,
        "windows_per_epoch": windows,
        "rows_per_epoch": windows,
        "dropped_rows": 0,
        "dropped_envs": [],
        "observation_keys": groups,
        "distribution_order": [],
        "fields": field_records(fields),
        "shards": entries,
    }


def run_history(
    src: Path,
    dst: Path,
    options: HistoryOptions,
    run: RunOptions,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write the history shard folder ``dst`` from the rollout file ``src``; return a summary dict.

    Raises:
        RolloutError: bad options, K > T, an unknown group, no eligible window or more mini-batches than
            windows (exit 2); I/O faults (exit 3).
    """
    progress = progress or NoProgress()
    started = time.perf_counter()
    _check_options(options)
    src, dst = Path(src), Path(dst)
    with RolloutReader(src, run.safety, budget=run.max_memory) as reader:
        T, N, K = reader.T, reader.N, options.history
        if K > T:
            raise _usage(f"--history: expected at most {T} (the file's steps T), found {K}.")
        groups = _groups(reader, options)
        fields = _fields(reader, groups, K)
        mask = _eligible(reader, options, run.max_memory)
        ends = window_ends(mask)
        windows = ends.numel()
        if windows == 0:
            raise _usage(
                f"--history: no window of {K} steps lies inside one episode of {src} (every recorded episode "
                "is shorter). Use a smaller --history, or --across-episodes."
            )
        if options.num_mini_batches > windows:
            raise _usage(
                f"--num-mini-batches: expected at most {windows} (the eligible windows), "
                f"found {options.num_mini_batches}."
            )
        plan = history_plan(
            ends, options.num_mini_batches, options.epochs, generator=torch.Generator().manual_seed(options.seed)
        )
        del ends
        entry_bytes = sum(f.row_bytes // K for f in fields)
        streamed = T * N * entry_bytes > run.max_memory // 2
        blocks = reader.blocks([f.source for f in fields], budget=max(run.max_memory // 8, 1)) if streamed else []
        attrs = {
            "rolloutcli_format": SHARD_FORMAT,
            "format_version": FORMAT_VERSION,
            "mode": "history",
            "history": K,
            "across_episodes": options.across_episodes,
        }

        def shard_tensors(pass_index: int, shard: int, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return _shard_tensors(plan, pass_index, shard, rows, N)

        try:
            with ShardExport(src, dst, attrs, compression=options.compression, overwrite=overwrite) as out:
                emitter = Emitter(plan, out.writer, fields, progress, shard_tensors, buffer_sets=1 if streamed else 2)
                emitter.prepare(_layouts(plan, fields))
                progress.start("batch --history", options.epochs * (options.num_mini_batches + len(blocks)))
                if streamed:
                    _streamed(reader, fields, emitter, mask, out.tmp, blocks, run.max_memory)
                else:
                    _in_memory(reader, fields, emitter, K)
                content_hash = out.source_hash()  # waits for every shard: their hashes are known after it
                entries = emitter.entries()
                manifest = _manifest(reader, options, groups, fields, windows, entries, content_hash)
                out.publish(manifest)
        finally:
            progress.finish()
    seconds = time.perf_counter() - started
    return {
        "input": str(src),
        "output": str(dst),
        "mode": "history",
        "T": T,
        "N": N,
        **{key: value for key, value in asdict(options).items() if key != "groups"},
        "groups": groups,
        "files": len(out.writer.results),
        "entries": len(entries),
        "windows_per_epoch": windows,
        "rows_per_epoch": windows,
        "dropped_rows": 0,
        "dropped_envs": [],
        "bytes_written": out.bytes_written,
        "streamed": streamed,
        "blocks": len(blocks) if streamed else 1,
        "order": ORDER_TEXT,
        "seconds": seconds,
        "gb_per_s": out.bytes_written / seconds / 1e9 if seconds > 0 else None,
    }
