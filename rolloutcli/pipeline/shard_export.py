"""The one shard export engine (``batch`` in every mode: feed-forward, recurrent, distillation, history).

A mode is an :class:`ExportJob`: the fields it reads, its plan (the items of each shard in slot order, an
item named by a source row ``t * N + n``), how a block read from the source becomes items, how a shard's
items become its datasets, and its part of the manifest and summary. :func:`run_export` streams the source
in blocks of steps x envs and scatters every block's items to their shards; a source that fits in half of
``--max-memory`` is read once for every epoch.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolloutcli.core.batching import BatchPlan
from rolloutcli.dataset import Paths, file_hash
from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.hdf5.atomic import atomic_folder
from rolloutcli.hdf5.probe import probing_ahead
from rolloutcli.hdf5.reader import Listed, RolloutReader, listed
from rolloutcli.hdf5.shards import (
    FORMAT_VERSION,
    MANIFEST_FORMAT,
    SHARD_FORMAT,
    ShardWriter,
    chunk_extents,
    is_shard_folder,
    write_manifest,
)
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import Progress
from rolloutcli.pipeline.scatter import Emitter, Field, Gathered, Rows, ShardScatter
from rolloutcli.pipeline.shard_sources import Block, Source, Sources

# Pieces of shards waiting for their other rows stay in memory up to a quarter of the budget and at most this,
# then go to spill files (a sequential append, read back once; the page cache holds them, not this process):
# the pieces of a dataset grow with its files, and the process must not (10,000 files within 1.2x of 100).
PENDING_MAX = 8 << 20
Opener = Callable[[str | Path], AbstractContextManager[RolloutReader]]  # a file's reader, open inside the block


def _hash_files(paths: Sequence[Path], stop: threading.Event) -> list[str]:
    """Each source's XXH3-128, hashed beside the export (sha256 would make it wait)."""
    return [file_hash(path, stop) for path in paths]


@contextmanager
def shard_folder(
    srcs: Sequence[Path], dst: Path, job: ExportJob, overwrite: bool
) -> Iterator[tuple[Path, ShardWriter, Future]]:
    """The temporary folder beside ``dst``, its writer and the sources' hashes to come; published when the block
    ends normally (write the manifest last, inside it). Torch runs on one thread: idle OpenMP workers
    spinning would compete with the hashing and writing threads."""
    attrs = {"rolloutcli_format": SHARD_FORMAT, "format_version": FORMAT_VERSION, "mode": job.mode, **job.attrs}
    threads, stop = torch.get_num_threads(), threading.Event()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutcli-xxh3") as hasher:
            try:
                digest = hasher.submit(_hash_files, srcs, stop)
                with (
                    atomic_folder(dst, inputs=srcs, overwrite=overwrite, owned=is_shard_folder) as tmp,
                    ShardWriter(tmp, attrs, job.group_attrs, compression=job.compression, label=dst) as writer,
                ):
                    yield tmp, writer, digest
            finally:
                stop.set()
    finally:
        torch.set_num_threads(threads)


def export_fields(reader: RolloutReader, pairs: list[tuple[str, str]], window: int | None = None) -> list[Field]:
    """``(source, name)`` pairs as fields, from the metadata: the dtype and row shape reading them gives
    (normalised; hidden states: rows ``[layers, H]``; with ``window`` K: rows ``[K, *entry_shape]``)."""
    out = []
    for source, name in pairs:
        dtype, shape = reader.normalized(source, 0, 1)  # what reading env 0 would return (dones: uint8 0/1)
        role = reader.schema.fields[source].role
        row_shape = (shape[1], shape[3]) if role == "hidden" else tuple(shape[2:])
        if window is not None:
            row_shape = (window, *row_shape)
        out.append(Field(source, name, role, torch.from_numpy(np.empty(0, dtype)).dtype, row_shape))
    return out


def _source_record(source: Source, source_hash: str) -> dict[str, Any]:
    return {
        "path": os.path.abspath(source.path),
        "size_bytes": os.stat(source.path).st_size,
        "xxh3_128": source_hash,
        "T": source.T,
        "N": source.N,
    }


def _manifest(sources: Sequence[Source], job: ExportJob, hashes: list[str], shards: list[Any]) -> dict[str, Any]:
    """The manifest: the source file (with its XXH3-128; a dataset: its files, their row and env offsets), the
    mode's entries, each field's row, the shards."""
    records = [_source_record(s, h) for s, h in zip(sources, hashes, strict=True)]
    if len(sources) == 1:
        source: dict[str, Any] = records[0]
    else:
        steps = {s.T for s in sources}
        for record, s in zip(records, sources, strict=True):
            record |= {"row_offset": s.row_offset, "env_offset": s.env_offset}
        rows = "t * N_total + env_offset + n" if job.env_concat else "row_offset + t * N + n"
        T = steps.pop() if len(steps) == 1 else None
        source = {"files": records, "T": T, "N": sum(s.N for s in sources), "rows": rows}
    fields = {
        f.name: {"dtype": str(f.dtype).removeprefix("torch."), "row_shape": list(f.row_shape)} for f in job.fields
    }
    head = {"format": MANIFEST_FORMAT, "format_version": FORMAT_VERSION, "mode": job.mode}
    return {**head, "source": source, **job.manifest, "fields": fields, "shards": shards}


@dataclass
class ExportJob:
    """One mode of the export (see the module docstring).

    ``take(block, data, index, out)`` gathers items ``index`` (``t * n + j`` within the block) of the block's
    data ``{name: read(reader, field, block)}`` into ``out`` or new tensors. ``read_bytes``: bytes read per
    source row over every field (sizes the blocks). ``env_major``: prefer env blocks (a shard's items lie in
    few envs). ``manifest``: the mode's entries between ``source`` and ``fields``.
    """

    mode: str
    fields: list[Field]
    plan: BatchPlan
    read: Callable[[RolloutReader, Field, Block], torch.Tensor]
    take: Callable[[Block, Rows, torch.Tensor, Rows | None], Rows]
    shard_tensors: Callable[[int, int, Rows], Mapping[str, torch.Tensor]]
    read_bytes: int
    env_major: bool = False
    env_concat: bool = False  # a dataset's files side by side along envs (recurrent, distillation: one T)
    row_wise: bool = False  # ``take`` gathers rows whatever the block: small blocks are joined (``Gathered``)
    shape: Callable[[Any, int, Rows], Mapping[str, torch.Tensor]] | None = None  # picklable shard_tensors by plan
    attrs: dict[str, Any] = field(default_factory=dict)
    group_attrs: dict[str, dict[str, Any]] = field(default_factory=dict)
    compression: str | None = None
    manifest: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    label: str = "batch"


def usage(message: str) -> RolloutError:
    """A usage error (exit 2)."""
    return RolloutError(message, exit_code=EXIT_USAGE)


def _size(nbytes: int) -> str:
    """``nbytes`` rounded up to whole K, M or G (as ``--max-memory`` takes them)."""
    for unit, shift in (("G", 30), ("M", 20)):
        if nbytes > 1 << shift:
            return f"{-(-nbytes >> shift)}{unit}"
    return f"{-(-nbytes >> 10)}K"


def plan_blocks(reader: RolloutReader | Listed, job: ExportJob, budget: int) -> list[Block]:
    """The blocks to read: one when the source fits in half of ``budget``, else blocks of an eighth of it.

    Step blocks over every env when no field is chunked by env (one contiguous region); else env blocks,
    an env longer than a block cut along T in whole chunks. A budget below twice a chunk is refused (exit 2).
    """
    T, N, row = reader.T, reader.N, max(job.read_bytes, 1)
    extents = [chunk_extents(reader, f.source) for f in job.fields]
    largest_chunk = max((e[2] for e in extents if e is not None), default=0)
    if 2 * largest_chunk > budget:
        raise usage(
            f"--max-memory: {job.label} reads whole chunks of {reader.path} (up to {largest_chunk} bytes each); "
            f"expected a budget of at least {_size(2 * largest_chunk)}, found {budget} bytes. Raise --max-memory."
        )
    if T * N * row <= budget // 2:
        return [(0, T, 0, N)]
    target = max(budget // 8, 1)
    along = max((e[0] for e in extents if e is not None), default=1)

    def steps_of(envs: int) -> int:  # steps of ``envs`` envs that fit a block, whole chunks where one fits
        steps = max(1, target // (envs * row))
        return steps - steps % along if steps >= along else steps

    if not job.env_major and all(e is None or e[1] >= N for e in extents):
        steps = steps_of(N)
        return [(t, min(T, t + steps), 0, N) for t in range(0, T, steps)]
    envs = max(1, target // (T * row))
    if envs > 1 or T * row <= target:
        return [(0, T, n, min(N, n + envs)) for n in range(0, N, envs)]
    steps = steps_of(1)
    return [(t, min(T, t + steps), n, n + 1) for n in range(N) for t in range(0, T, steps)]


GATHER_BYTES = 1 << 20  # small blocks are joined up to this size (``Gathered``): ~36 small files a scatter


def _export_passes(
    job: ExportJob, emitter: Emitter, folder: Path, sources: Sequence[Source], budget: int, opened: Opener
) -> None:
    """Per pass, read each block (a single block once for every pass) and scatter its items to their shards;
    a file is open while its blocks are read."""
    first = sources[0]
    whole = len(sources) == 1 and first.blocks == [(0, first.T, 0, first.N)]
    total_envs = sum(s.N for s in sources)
    total_rows = sum(s.T * s.N for s in sources)
    cached: Rows | None = None
    for pass_index, plan in enumerate(job.plan.passes):
        streamed = plan.order is not None
        positions = None if whole or streamed else plan.positions(total_rows)
        complete = partial(emitter.emit, pass_index)
        pending = min(budget // 4, PENDING_MAX)
        out = ShardScatter(folder, job.fields, plan.sizes, pending, buffers=emitter.buffers, complete=complete)
        where = plan.positions_of if streamed else lambda rows, positions=positions: positions[rows]
        gathered = Gathered(out, job.take, min(budget // 16, GATHER_BYTES) if job.row_wise else 0, where)
        for source in sources:
            with opened(source.path) as reader:
                for block in source.blocks:
                    data = cached or {f.name: job.read(reader, f, block) for f in job.fields}
                    if whole:
                        cached = data
                        out.add(None, partial(job.take, block, data), order=plan.all_rows())
                    else:  # streamed orders: positions of this block's rows only, no per-row array of the dataset
                        rows = source.rows(block, job.env_concat, total_envs)
                        if job.row_wise:
                            gathered.add(rows, data)
                        else:
                            out.add(where(rows), partial(job.take, block, data))
                    del data
                    emitter.progress.advance()
        gathered.flush()
        out.finish()


def _run_parallel(job: ExportJob, sources: Sequence[Source], tmp: Path, run: RunOptions, engine: Any) -> dict:
    from rolloutcli.pipeline.parallel_export import ExportSpec, run_parallel

    assert job.shape is not None
    spec = ExportSpec(
        job.mode,
        job.fields,
        job.plan,
        job.read,
        job.take,
        job.shape,
        job.env_concat,
        sum(s.N for s in sources),
        sum(s.T * s.N for s in sources),
        run.safety,
        run.max_memory,
        attrs=job.attrs,
        group_attrs=job.group_attrs,
        compression=job.compression,
    )
    return run_parallel(spec, tmp, sources, engine)


def _check_shards_fit(job: ExportJob, budget: int) -> None:
    """Refuse, before any block is read, an export whose largest shard does not fit in ``budget``.

    A shard is gathered whole in memory (its buffers, then its file image), so its size, not the block's, is
    what a declared-huge source with few mini-batches costs (a 50 KB file declaring 2.3 GB took 2 GB); the
    blocks (an eighth of the budget) and the pending pieces (a quarter at most) are bounded by it already.
    """
    largest = max((max(p.sizes, default=0) for p in job.plan.passes), default=0) * sum(f.row_bytes for f in job.fields)
    if largest > budget:
        raise usage(
            f"--max-memory: {job.label} builds each shard in memory (the largest holds {largest} bytes); expected "
            f"a budget of at least {_size(largest)}, found {budget} bytes. Raise --max-memory or export more, "
            "smaller mini-batches."
        )


def _sources(srcs: Paths, job: ExportJob, run: RunOptions, opened: Opener, checked: bool) -> Sources:
    """Each file's blocks and offsets, the files opened one at a time (the next one probed meanwhile), or, when
    their values were ``checked`` already, planned from their probes' listings where these stand for them
    (``listed``); then the shards' check (no block read yet)."""
    out, rows, envs = Sources(srcs), 0, 0
    budget = run.max_memory
    for path in probing_ahead(srcs, run.safety):
        found = listed(path, run.safety) if checked else None
        with nullcontext(found) if found is not None else opened(path) as reader:
            out.append(reader.T, reader.N, plan_blocks(reader, job, budget), rows, envs)
            rows, envs = rows + reader.T * reader.N, envs + reader.N
    _check_shards_fit(job, budget)
    return out


def _many(src: Path | Sequence[Path]) -> bool:
    return not isinstance(src, str | os.PathLike)  # a str is a Sequence too, and one path


def run_export(
    src: Path | Sequence[Path],
    dst: Path,
    prepare: Callable[[Any], ExportJob],
    run: RunOptions,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    engine: Any = None,
    checked: bool = False,
) -> dict[str, Any]:
    """Write the shard folder ``dst`` from ``src``; ``prepare(reader)`` checks the source, builds the job.

    ``src`` a list of files (a dataset): ``prepare`` gets the first file's reader (the job knows the dataset
    from its own check; the other files are opened one at a time, never all at once). ``engine``
    (:class:`~rolloutcli.pipeline.engine.EngineOptions`) with more than one worker or Ray: the map and reduce
    units of :mod:`~rolloutcli.pipeline.parallel_export` (jobs with a ``shape``), the same bytes. ``checked``:
    the caller checked the values of the dataset's files (``check_agreement``'s ``values``), not checked again.
    """
    parallel = engine is not None and (engine.engine == "ray" or engine.workers > 1)
    if parallel:
        from rolloutcli.pipeline.engine import start_engine

        start_engine(engine)
    progress = progress or Progress()
    started = time.perf_counter()
    # packed (a list of Path objects held ~500 B a file); its paths are unique (``resolve``): a name says which
    srcs = src if isinstance(src, Paths) else Paths([os.fspath(p) for p in (src if _many(src) else [src])])
    dst, first_name = Path(dst), os.fspath(srcs[0])
    with RolloutReader(srcs[0], run.safety, budget=run.max_memory) as first:

        def opened(path: str | Path, check: bool = False) -> AbstractContextManager[RolloutReader]:
            """The first file's reader (open for the whole export) or a new one: the values of the other files
            are checked once, when their blocks are planned (``_sources``) unless ``checked``, and not again
            when they are read."""
            if os.fspath(path) == first_name:
                return nullcontext(first)
            return RolloutReader(path, run.safety, check=check, budget=run.max_memory)

        job = prepare(first)
        sources = _sources(srcs, job, run, partial(opened, check=not checked), checked)
        blocks = sum(len(s.blocks) for s in sources)
        streamed = sum(s.T * s.N for s in sources) * job.read_bytes > run.max_memory // 2
        passes = job.plan.passes
        try:
            with shard_folder(srcs, dst, job, overwrite) as (tmp, writer, source_hash):
                emitter = Emitter(
                    job.plan, writer, job.fields, progress, job.shard_tensors, buffer_sets=1 if streamed else 2
                )
                progress.start(job.label, sum(len(p.sizes) for p in passes) + len(passes) * blocks)
                if parallel and job.shape is not None:
                    writer.results.update(_run_parallel(job, sources, tmp, run, engine))
                else:
                    _export_passes(job, emitter, tmp, sources, run.max_memory, opened)
                writer.wait()
                entries = emitter.entries()  # every shard's hash is known now
                write_manifest(tmp, _manifest(sources, job, source_hash.result(), entries))
        finally:
            progress.finish()
    seconds = time.perf_counter() - started
    written = sum(size for size, _ in writer.results.values())
    steps = {s.T for s in sources}
    T, N = (steps.pop() if len(steps) == 1 else None), sum(s.N for s in sources)  # T: None for mixed lengths
    return {
        "input": str(srcs[0]) if len(srcs) == 1 else [str(p) for p in srcs],
        "output": str(dst),
        "mode": job.mode,
        "T": T,
        "N": N,
        **job.summary,
        "files": len(writer.results),
        "entries": len(entries),
        "bytes_written": written,
        "streamed": streamed,
        "blocks": blocks,
        "seconds": seconds,
        "gb_per_s": written / seconds / 1e9 if seconds > 0 else None,
    }
