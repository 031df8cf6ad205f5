"""A per-file command (``gae``, ``split``) on a dataset: one output per input, one folder published as a unit.

The folder is built as ``.<name>.rolloutcli-partial`` beside ``-o``: each input's output under the input's
relative name, a line of the journal (:mod:`~rolloutcli.pipeline.dataset_journal`) as each is done, then
``dataset.json`` (command, options, inputs and outputs with their sizes and XXH3-128, in input order) written
from the journal, the journal removed, and the folder renamed onto ``-o``. A failed or killed run keeps the
partial folder with its journal; ``--resume`` continues it, keeping each output whose recorded input and output
hashes still match, redoing the rest. ``dataset.json`` holds nothing that depends on the engine, the worker
count or timing, so it is byte-identical for every engine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from array import array
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from rolloutcli.dataset import Dataset, Signature, check_agrees, file_hash, signature
from rolloutcli.errors import EXIT_IO, EXIT_UNSAFE, EXIT_USAGE, RolloutError, stop_if_signalled
from rolloutcli.hdf5.atomic import folder_sync_deferred, fsync_dir
from rolloutcli.hdf5.limits import SafetyOptions
from rolloutcli.hdf5.probe import probe_ahead, probed_once
from rolloutcli.hdf5.reader import kept_open
from rolloutcli.hdf5.rename import rename_noreplace
from rolloutcli.pipeline.dataset_journal import JOURNAL, RECORD, Journal, earlier_entries
from rolloutcli.pipeline.dataset_partial import (
    check_partial_folder,
    check_published,
    discard_partial,
    drop_temporaries,
)
from rolloutcli.pipeline.dataset_totals import Totals, compact
from rolloutcli.pipeline.engine import EngineOptions, Unit, close_pools, run_units, start_engine
from rolloutcli.pipeline.lazy import Lazy
from rolloutcli.pipeline.progress import Progress, unit_progress
from rolloutcli.pipeline.timeouts_rule import DATASET_DEFAULT_NOTE

DATASET_FORMAT = "rolloutcli.dataset"
DATASET_VERSION = 1
PARTIAL = ".rolloutcli-partial"


def partial_folder(dst: Path) -> Path:
    """Where a dataset output is built (beside ``dst``; kept after a failure for ``--resume``)."""
    dst = Path(os.path.abspath(dst))
    return dst.parent / f".{dst.name}{PARTIAL}"


def _entry(path: Path, name: str) -> dict[str, Any]:
    return {"name": name, "size_bytes": os.stat(path).st_size, "xxh3_128": file_hash(path)}


def _check_destination(dataset: Dataset, dst: Path, overwrite: bool, resume: bool, tmp: Path) -> None:
    real = os.path.realpath(dst)
    for root in sorted({os.path.realpath(f) for f in dataset.folders}):
        if os.path.commonpath([root, real]) == root:
            raise RolloutError(
                f"{dst}: output folder inside the input folder {root}; expected it elsewhere "
                "(its files would become inputs). Choose another -o.",
                exit_code=EXIT_UNSAFE,  # as an output that is the input
            )
    if os.path.lexists(dst) and not (overwrite and (Path(dst) / "dataset.json").is_file()):
        raise RolloutError(
            f"{dst}: already exists; expected a new output folder. Choose another -o, or --overwrite "
            "(replaces only a dataset folder rolloutcli wrote).",
            exit_code=EXIT_USAGE,
        )
    if os.path.lexists(tmp) and not resume:
        raise RolloutError(
            f"{tmp}: an earlier run's partial output; expected none. Continue it with --resume, or delete it.",
            exit_code=EXIT_USAGE,
        )


def _kept(entries: Iterable[dict[str, Any]], dataset: Dataset, tmp: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(index, entry)`` of each of ``entries`` (an earlier run's) whose output in ``tmp`` and input still have
    the recorded hashes (and the input its recorded path)."""
    index = {name: i for i, name in enumerate(dataset.names)}
    for entry in entries:
        source, out = entry.get("input"), entry.get("output")
        if not isinstance(source, dict) or not isinstance(out, dict) or not isinstance(out.get("name"), str):
            continue
        name = out["name"]
        i = index.get(name)
        if i is None:
            _drop_stale(tmp, name, out)
            continue
        if source.get("name") != name or not (tmp / name).is_file():
            continue
        if _input_entry(dataset.files[i], name) == source and _entry(tmp / name, name) == out:
            yield i, {"input": source, "output": out}


def _drop_stale(tmp: Path, name: str, out: dict[str, Any]) -> None:
    """Remove the output an earlier run wrote for an input no longer in the dataset, if it is still as recorded
    (so this run wrote it, and it holds nothing else): left, it would be refused as no output of this run."""
    if os.path.isabs(name) or os.path.normpath(name) != name or ".." in Path(name).parts:
        return  # no name rolloutcli records (a garbled entry): what it names is not this run's to remove
    path = tmp / name
    if path.is_file() and not path.is_symlink() and _entry(path, name) == out:
        path.unlink()


def _input_entry(path: Path, name: str) -> dict[str, Any]:
    return {"path": os.path.abspath(path), **_entry(path, name)}


# the first file, its per-step fields (None: not checked), how files are opened
Base = tuple[Path, Signature | None, SafetyOptions | None]


def hashed_unit(
    fn: Callable[..., Any], args: tuple[Any, ...], src: Path, out: Path, name: str, base: Base, ahead: Path | None
) -> dict[str, Any]:
    """A dataset's work unit: check that ``src``'s per-step fields agree with the first file's, run the
    command's unit ``fn(*args)`` writing ``out`` from ``src``, then return the entries of both for
    ``dataset.json`` and the unit's summary made small (``summary``, for the driver's totals). The check and the
    hashing run in the workers, in parallel; the file is probed once (``ahead``: the file of the unit this process
    runs next, probed meanwhile), opened once. Run again (Ray retries a task whose node was lost after it wrote
    ``out``; an ``OSError`` while hashing), it replaces the ``out`` of the earlier attempt: the command's unit
    refused it as an existing output (exit 2)."""
    first, expected, safety = base
    if ahead is not None:  # the next unit's input, in this process: probed while this one runs
        probe_ahead(ahead, safety)
    # the input is opened once for the check and the command; the driver syncs the folders before it publishes
    with probed_once(), kept_open(), folder_sync_deferred():
        if expected is not None and src != first:
            check_agrees(first, expected, src, signature(src, safety)[0])
        source = _input_entry(src, name)
        if os.path.lexists(out):
            os.unlink(out)
        summary = fn(*args, **unit_progress())
    return {"input": source, "output": _entry(out, name), "summary": compact(summary)}


def run_dataset(
    dataset: Dataset,
    dst: Path,
    command: str,
    options: dict[str, Any],
    make_unit: Callable[[Path, Path], Unit],
    engine: EngineOptions,
    *,
    overwrite: bool = False,
    resume: bool = False,
    safety: SafetyOptions | None = None,
    rollouts: bool = True,
    progress: Progress | None = None,
    rows: bool = True,
) -> dict[str, Any]:
    """Write one output per input of ``dataset`` into the folder ``dst`` (see the module docstring).

    ``make_unit(src, out)`` is the work unit writing ``out`` from ``src`` (it returns its summary). Every file's
    per-step fields must agree with the first file's (``dataset.check_agreement``'s rule, checked in the units;
    ``safety``: how they are opened for it). With a local pool the first failing file is reported, as a serial
    check would. ``rollouts`` False: the inputs are no rollout files (``split --unpad``'s split files, which each
    unit checks in full), and no agreement is checked. ``progress`` advances by each finished file's input bytes;
    the result holds the summary over the ``ran`` files run (``total``) and, with ``rows``, a row per file
    (``per_file``; else None: the driver's memory stays flat in the file count).
    """
    dst = Path(dst)
    tmp = partial_folder(dst)
    _check_destination(dataset, dst, overwrite, resume, tmp)
    head = {"format": DATASET_FORMAT, "format_version": DATASET_VERSION, "command": command, "options": options}
    earlier: Iterable[dict[str, Any]] = ()
    if resume and os.path.lexists(tmp):
        check_partial_folder(tmp, dataset.names)  # a symlink, a FIFO: refused before anything is read or changed
        drop_temporaries(tmp)
        earlier = earlier_entries(tmp, head, len(dataset.files))  # other options: refused here, as above
    first = Path(os.path.abspath(dataset.files[0]))
    base: Base = (first, signature(first, safety)[0] if rollouts else None, safety)
    start_engine(engine)
    journal = _start_journal(Journal(tmp, head, len(dataset.files)), _kept(earlier, dataset, tmp))
    reused = journal.done
    try:
        serial = engine.engine == "local" and engine.workers == 1  # then the units run in order, here
        pending = array("q", (i for i, offset in enumerate(journal.offsets) if offset < 0))
        units = _units(dataset, tmp, make_unit, base, pending, serial)
        reporter = _Reporter(dataset, pending, journal, progress or Progress(), command, rows)
        run_units(units, engine, reporter.done)
    except BaseException:
        (progress or Progress()).finish()
        journal.close()
        if not journal.done:  # nothing to resume: a corrected rerun must not be refused for an empty folder
            with contextlib.suppress(OSError):
                discard_partial(tmp, dataset.names, (JOURNAL, RECORD))
        raise
    finally:
        close_pools()
    drop_temporaries(tmp)  # an attempt lost with its node (Ray then retried its unit) left what it was writing
    journal.compact()
    check_published(tmp, dataset.names, RECORD)  # a file planted in the folder: refused, never published
    _publish(tmp, dst, overwrite)
    reporter.finish()
    return {
        "input": [str(f) for f in dataset.files],
        "output": str(dst),
        "files": len(dataset.files),
        "reused": reused,
        "bytes_written": journal.bytes_written,
        "total": reporter.totals.result(str(dst)),
        "ran": reporter.totals.files,
        "per_file": reporter.totals.per_file() if rows else None,
    }


class _Reporter:
    """The driver's side of each finished unit: its entries into the journal, its summary into the totals, its
    input's bytes onto the progress bar (files done in its description)."""

    def __init__(
        self, dataset: Dataset, pending: array, journal: Journal, progress: Progress, command: str, rows: bool
    ) -> None:
        self.dataset, self.pending, self.journal, self.progress = dataset, pending, journal, progress
        self.totals, self.command, self.count = Totals(rows), command, len(pending)
        self.progress.start(self._description(), sum(os.path.getsize(dataset.files[i]) for i in pending))

    def _description(self) -> str:
        return f"{self.command}: {self.totals.files}/{self.count} files"

    def done(self, k: int, result: dict[str, Any]) -> None:
        i = self.pending[k]
        summary = result.pop("summary")
        self.journal.add(i, result)
        self.totals.add(i, self.dataset.names[i], result["output"]["size_bytes"], summary)
        self.progress.describe(self._description())
        self.progress.advance(result["input"]["size_bytes"])

    def finish(self) -> None:
        """The bar removed, then the one warning about files without a time-out rule."""
        self.progress.finish()
        if self.totals.defaulted:
            self.progress.warn(DATASET_DEFAULT_NOTE.format(count=self.totals.defaulted, files=self.totals.files))


def _start_journal(journal: Journal, kept: Iterable[tuple[int, dict[str, Any]]]) -> Journal:
    """``journal`` started with the ``kept`` outputs; a partial folder made for it is removed if that fails."""
    made = not journal.folder.is_dir()
    journal.folder.mkdir(exist_ok=True)
    try:
        journal.start(kept)
    except BaseException:
        if made:
            shutil.rmtree(journal.folder, ignore_errors=True)
        raise
    return journal


def _units(
    dataset: Dataset, tmp: Path, make_unit: Callable[[Path, Path], Unit], base: Base, pending: array, serial: bool
) -> Lazy[Unit]:
    """The work units of the files not yet done (``pending``: unit k's input), each made when the engine takes it:
    a list of them held about 1 KB a file in the driver for the whole run. Stale outputs are removed first (a
    unit does not overwrite)."""
    for i in pending:
        out = tmp / dataset.names[i]
        out.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(out):
            out.unlink()

    def unit(k: int) -> Unit:
        i, name = pending[k], dataset.names[pending[k]]
        src = Path(os.path.abspath(dataset.files[i]))  # absolute: tasks run in other folders
        ahead = dataset.files[pending[k + 1]] if serial and k + 1 < len(pending) else None
        return (hashed_unit, (*make_unit(src, tmp / name), src, tmp / name, name, base, ahead))

    return Lazy(len(pending), unit)


def _publish(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Rename the finished folder onto ``dst`` (an earlier dataset folder moved aside first with --overwrite)."""
    stop_if_signalled()
    old = None
    try:
        if overwrite and os.path.lexists(dst):
            old = tmp.parent / f".{dst.name}.rolloutcli-old"
            os.rename(dst, old)
        rename_noreplace(tmp, dst)
    except OSError as exc:
        raise RolloutError(
            f"{dst}: cannot publish the output folder: {exc.strerror or exc}.", exit_code=EXIT_IO
        ) from exc
    fsync_dir(dst.parent)  # the publication itself is on disk when the command ends
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
