"""``rolloutcli import``: a foreign recording (D4RL, Minari, robomimic / Isaac Lab, ikostrikov) as a rollout file.

The source is opened through the same audit as every input; :mod:`rolloutcli.pipeline.layouts` plans which source rows
go where, and the rows are copied in blocks of at most ``--max-memory`` bytes into a temporary file published
atomically: a failure leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.hdf5.atomic import atomic_file, check_output_path
from rolloutcli.hdf5.reader import H5Input, RolloutReader
from rolloutcli.hdf5.schema import FORMAT_NAME, FORMAT_VERSION
from rolloutcli.hdf5.writer import RolloutOutput
from rolloutcli.pipeline.import_flags import FlatFlags, block_rows, blocks
from rolloutcli.pipeline.import_limits import check_disk
from rolloutcli.pipeline.import_source import (
    TensorSource,
    check_episode_fields,
    check_listing,
    next_observation_mismatch,
    read_metadata,
)
from rolloutcli.pipeline.inspect_tree import nonfinite
from rolloutcli.pipeline.layouts import LAYOUTS, Copy, Plan, matches, plan_import, recognise, unrecognised
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import Progress

MINARI_DATA = ("data/main_data.hdf5", "main_data.hdf5")
MINARI_METADATA = "metadata.json"


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"  # at offset 0, 512, 1024, 2048, ... (a user block before it)


def _is_hdf5(path: Path) -> bool:
    """The HDF5 signature at one of the offsets the format allows (an HDF5 file with a zip appended is HDF5)."""
    try:
        with open(path, "rb") as file:
            size, offset = os.fstat(file.fileno()).st_size, 0
            while offset + 8 <= size:
                file.seek(offset)
                if file.read(8) == HDF5_SIGNATURE:
                    return True
                offset = 512 if offset == 0 else offset * 2
    except OSError:
        return False
    return False


def _is_torch_file(path: Path) -> bool:
    """A zip archive and not HDF5; a damaged zip counts (``TensorSource`` says what is wrong with it)."""
    if not path.is_file() or _is_hdf5(path):
        return False
    try:
        return zipfile.is_zipfile(path)
    except Exception:  # zipfile raises BadZipFile and others past is_zipfile for a damaged end record
        return True


def _minari_paths(src: Path) -> tuple[Path, Path | None]:
    """(main_data.hdf5, metadata.json or None) of a Minari dataset folder or its data file."""
    if not src.is_dir():
        meta = src.parent / MINARI_METADATA
        return src, meta if meta.is_file() else None
    for data in MINARI_DATA:
        if (src / data).is_file():
            meta = (src / data).parent / MINARI_METADATA
            if not meta.is_file():
                raise RolloutError(
                    f"{src}: Minari dataset folder without {meta.relative_to(src)}; expected the metadata "
                    "Minari writes beside main_data.hdf5. Copy the whole dataset folder, or import main_data.hdf5."
                )
            return src / data, meta
    raise RolloutError(
        f"{src}: is a folder; expected an HDF5 file, or a Minari dataset folder with data/main_data.hdf5. "
        "Check the path."
    )


@contextlib.contextmanager
def _open_source(src: Path, wanted: str, run: RunOptions) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The opened, audited source and the metadata found beside it (Minari's metadata.json)."""
    meta: dict[str, Any] = {}
    path = src
    if src.is_dir() or wanted == "minari":
        path, meta_path = _minari_paths(src)
        if meta_path is not None:
            meta = read_metadata(meta_path)
    if wanted in ("auto", "ikostrikov") and _is_torch_file(path):
        source: Any = TensorSource(path)
    else:
        source = H5Input(path, run.safety)
    try:
        yield source, meta
    finally:
        source.close()


def _read(source: Any) -> Any:
    """Rows ``index`` of a source dataset (what the plan and the computed outputs read)."""
    return lambda name, index: source.slice(name, (index,))


def _plan(src: Path, source: Any, wanted: str, meta: dict[str, Any]) -> Plan:
    layout = recognise(source.datasets) if wanted == "auto" else wanted
    if layout is None or not matches(source.datasets, layout):
        if isinstance(source, H5Input) and source.attrs_of("").get("rolloutcli_format") == FORMAT_NAME:
            raise RolloutError(
                f"{src}: already a rollout file (rolloutcli_format = {FORMAT_NAME}): nothing to import. "
                "Pass it to the other commands as it is."
            )
        raise unrecognised(src, source.datasets, wanted)
    check_listing(src, layout, source.datasets)
    check_episode_fields(src, layout, source.datasets)
    plan = plan_import(src, layout, source.datasets, _read(source))
    total = meta.get("total_episodes")
    if isinstance(total, int) and total != plan.episodes:
        raise RolloutError(
            f"{src}: metadata.json says total_episodes = {total}, found {plan.episodes} episodes in the data; "
            "the dataset is incomplete. Copy it again."
        )
    if meta:
        plan.attrs["source_metadata"] = json.dumps(meta, sort_keys=True)
    if isinstance(source, H5Input):  # robomimic keeps env_args on its data group
        for group in ("", "data") if layout == "robomimic" else ("",):
            plan.attrs.update({f"source_{k}": v for k, v in source.attrs_of(group).items()})
    return plan


def run_import(
    src: Path,
    dst: Path,
    layout: str,
    run: RunOptions,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    timeouts_rule: str | None = None,
) -> dict[str, Any]:
    """Import ``src`` (a file or a Minari dataset folder) into the rollout file ``dst``; the summary.
    ``timeouts_rule``: the trainer's time-out rule, written as the root attribute (none: the source does not say)."""
    if layout != "auto" and layout not in LAYOUTS:
        raise RolloutError(f"--from: expected auto or {', '.join(LAYOUTS)}, found '{layout}'.", exit_code=EXIT_USAGE)
    progress = progress or Progress()
    check_output_path(dst, [src], overwrite=overwrite)
    with _open_source(src, layout, run) as (source, meta):
        plan = _plan(src, source, layout, meta)
        check_disk(dst, plan, source.datasets)
        _count_episodes(plan, source, run.max_memory)
        notes = _keep_next_observations(src, source, plan, run.max_memory)
        _unclash(plan)
        if notes:  # next_observations carried too
            check_disk(dst, plan, source.datasets)
        h5 = source if isinstance(source, H5Input) else None
        with atomic_file(dst, inputs=[src], overwrite=overwrite) as tmp:
            with RolloutOutput(tmp, dst, h5, early_sync=True) as out:
                _write(plan, source, out, run.max_memory, progress)
                out.set_attrs(
                    {
                        "rolloutcli_format": FORMAT_NAME,
                        "format_version": FORMAT_VERSION,
                        "imported_from": plan.layout,
                        "source_file": os.path.basename(src),
                        **plan.attrs,
                        "timeouts_rule": timeouts_rule,  # None: not written
                    }
                )
            warnings = notes + _check_output(src, tmp, run)
    return {
        "input": str(src),
        "output": str(dst),
        "layout": plan.layout,
        "T": plan.T,
        "N": plan.N,
        "episodes": plan.episodes,
        "fields": sorted({*plan.datasets, *_computed_names(plan), *plan.verbatim.values()}),
        "recorded_from_reset": bool(plan.attrs.get("recorded_from_reset", False)),
        "timeouts_rule": timeouts_rule,
        "bytes_written": os.path.getsize(dst),
        "warnings": warnings,
    }


def _computed_names(plan: Plan) -> list[str]:
    return [name for computed in plan.computed for name in computed.outputs]


def _count_episodes(plan: Plan, source: Any, budget: int) -> None:
    """A flat file's episodes, counted from its flags a block at a time (after the disk check: a declared-huge
    source is refused before its flags are read)."""
    for flags in plan.computed:
        if isinstance(flags, FlatFlags):
            plan.episodes = flags.episodes(_read(source), block_rows(flags, source.datasets, budget))


def _unclash(plan: Plan) -> None:
    """A carried dataset whose place another output takes (ikostrikov's ``dones`` goes to ``source/dones``,
    where a ``source/dones`` of the source would go too) moves one ``source/`` further down."""
    taken = [*plan.datasets, *_computed_names(plan)]

    def clashes(target: str) -> bool:
        return any(target == t or target.startswith(t + "/") or t.startswith(target + "/") for t in taken)

    for name in sorted(plan.verbatim, key=lambda n: plan.verbatim[n] != n):  # those kept in place first
        target = plan.verbatim[name]
        while clashes(target):
            target = f"source/{target}"
        plan.verbatim[name] = target
        taken.append(target)


def _keep_next_observations(src: Path, source: Any, plan: Plan, budget: int) -> list[str]:
    """D4RL ``next_observations`` rows that disagree with the next ``observations`` row inside an episode are
    not a final observation: the dataset is carried whole under ``source/`` and the count said in a warning."""
    if plan.layout != "d4rl":
        return []
    flags = plan.computed[0]  # a D4RL plan computes only its dones and time_outs
    found = next_observation_mismatch(
        source, source.datasets, lambda start, stop: flags.rows(_read(source), start, stop)["dones"], budget
    )
    plan.verbatim.update({name: f"source/{name}" for name in found})
    return [
        f"{src}: field '{name}': {count} rows inside an episode differ from the next 'observations' row; "
        f"kept as they are in 'source/{name}' (final_observations holds the rows where an episode ends)."
        for name, count in found.items()
    ]


def _check_output(src: Path, tmp: Path, run: RunOptions) -> list[str]:
    """The format contract on the file about to be published (every problem at once, exit 1: nothing is
    published); the warnings for what is legal but unusual (NaN/Inf observations)."""
    try:
        with RolloutReader(tmp, run.safety, budget=run.max_memory) as reader:
            names = [n for n in reader.schema.names("observation") if reader.datasets[n].dtype.kind == "f"]
            found = nonfinite(reader, names, run.max_memory)
    except RolloutError as error:
        problems = [p.replace(str(tmp), str(src)).removeprefix(f"{src}: ") for p in error.problems]
        count = f"{len(problems)} problems: " if len(problems) > 1 else ""
        joined = "; ".join([*(p.removesuffix(".") for p in problems[:-1]), problems[-1]])
        raise RolloutError(
            f"{src}: would import as a rollout file the other commands refuse; nothing written. {count}{joined}",
            problems=[f"{src}: {p}" for p in problems],
        ) from None
    return [
        f"{src}: field '{row['dataset']}': {row['count']} NaN/Inf values (first at step {row['first_step']}); "
        "kept as they are: observations may hold them, check that they are meant."
        for row in found
    ]


def _row_bytes(source: Any, name: str) -> int:
    info = source.datasets[name]
    return math.prod(info.shape[1:]) * info.dtype.itemsize


def _read_block(source: Any, copy: Copy, first: int, rows: int, buffer: np.ndarray) -> np.ndarray:
    """Rows ``first : first + rows`` of ``copy``; numeric rows of an HDF5 source land in ``buffer`` (reused)."""
    index = slice(copy.start + first, copy.start + first + rows)
    dtype = source.datasets[copy.src].dtype
    if copy.single or not isinstance(source, H5Input) or dtype.kind not in "biufc" or dtype.names:
        return source.slice(copy.src, (index,))
    shape = (rows, *source.datasets[copy.src].shape[1:])
    block = buffer[: rows * _row_bytes(source, copy.src)].view(dtype.newbyteorder("=")).reshape(shape)
    source.read_into(copy.src, index, block)
    return block


def _write_computed(plan: Plan, source: Any, out: RolloutOutput, budget: int) -> None:
    """The computed outputs (dones, time_outs, ...) a block of rows within ``budget`` bytes at a time."""
    for computed in plan.computed:
        for name, (shape, dtype) in computed.outputs.items():
            out.create(name, shape, dtype)
        for start, stop in blocks(plan.T, block_rows(computed, source.datasets, budget)):
            for name, rows in computed.rows(_read(source), start, stop).items():
                out.write(name, (slice(start, stop),), rows)


def _copy_rows(jobs: list[tuple[Copy, int, int]], source: Any, out: RolloutOutput, progress: Progress) -> None:
    """The row copies, each block read into one buffer (freed on return: the computed outputs come next)."""
    largest = max((rows * _row_bytes(source, copy.src) for copy, _, rows in jobs), default=0)
    buffer = np.empty(largest, np.uint8)
    for copy, first, rows in jobs:
        block = _read_block(source, copy, first, rows, buffer)
        target = slice(copy.dst + first, copy.dst + first + rows)
        if copy.single:
            out.write(copy.out, (), block[0])
        else:
            out.write(copy.out, (target,), block[:, None] if copy.lane else block)
        out.sync_early()  # the disk writes this block while the next is read
        progress.advance()


def _write(plan: Plan, source: Any, out: RolloutOutput, budget: int, progress: Progress) -> None:
    """Create the datasets, copy the rows in blocks within ``budget`` bytes, add the computed outputs."""
    jobs = []  # (copy, first row, rows): no block holds more than ``budget`` bytes (at least one row)
    for copy in plan.copies:
        step = max(1, budget // max(_row_bytes(source, copy.src), 1))
        jobs += [(copy, first, min(step, copy.count - first)) for first in range(0, copy.count, step)]
    progress.start("import", len(jobs) + 1)
    for name, (shape, dtype) in plan.datasets.items():
        out.create(name, shape, dtype)
    _copy_rows(jobs, source, out, progress)
    _write_computed(plan, source, out, budget)
    if isinstance(source, H5Input):
        out.copy(plan.verbatim, lambda name: plan.verbatim[name])
        # libhdf5's copy nulls references: each is pointed again at the output's copy of its target, the only
        # objects kept as they were (one to an imported field, changed in layout, or elsewhere is refused)
        out.repoint_references(lambda name: plan.verbatim.get(name) if name else "")
    else:
        for name, target in plan.verbatim.items():  # a tensor's rows in blocks of the budget too
            info = source.datasets[name]
            out.create(target, info.shape, info.dtype)
            step = max(1, budget // max(_row_bytes(source, name), 1))
            for first in range(0, info.shape[0], step) if info.shape else ():
                out.write(target, (slice(first, first + step),), source.slice(name, (slice(first, first + step),)))
            if not info.shape:
                out.write(target, (), source.slice(name))
    progress.advance()
    progress.finish()
