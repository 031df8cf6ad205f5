"""A per-file command (``gae``, ``split``) on a dataset: one output per input, one folder published as a unit.

The folder is built as ``.<name>.rolloutcli-partial`` beside ``-o``: each input's output under the input's
relative name, then ``dataset.json`` (command, options, inputs and outputs with their sizes and XXH3-128)
written last, then the folder renamed onto ``-o``. A failed or killed run keeps the partial folder (with a
``dataset.json`` of the outputs done so far); ``--resume`` continues it, keeping each output whose recorded
input and output hashes still match, redoing the rest. ``dataset.json`` holds nothing that depends on the
engine, the worker count or timing, so it is byte-identical for every engine.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rolloutcli.dataset import Dataset, Signature, check_agrees, file_hash, signature
from rolloutcli.errors import EXIT_IO, EXIT_UNSAFE, EXIT_USAGE, RolloutError, stop_if_signalled
from rolloutcli.hdf5.atomic import TEMP_MARKER, atomic_file
from rolloutcli.hdf5.limits import SafetyOptions
from rolloutcli.hdf5.probe import probed_once
from rolloutcli.hdf5.rename import rename_noreplace
from rolloutcli.pipeline.engine import EngineOptions, Unit, close_pools, run_units, start_engine
from rolloutcli.pipeline.progress import unit_progress

DATASET_FORMAT = "rolloutcli.dataset"
DATASET_VERSION = 1
PARTIAL = ".rolloutcli-partial"


def partial_folder(dst: Path) -> Path:
    """Where a dataset output is built (beside ``dst``; kept after a failure for ``--resume``)."""
    dst = Path(os.path.abspath(dst))
    return dst.parent / f".{dst.name}{PARTIAL}"


def _entry(path: Path, name: str) -> dict[str, Any]:
    return {"name": name, "size_bytes": os.stat(path).st_size, "xxh3_128": file_hash(path)}


def _write_record(folder: Path, record: dict[str, Any]) -> None:
    """``dataset.json``, replaced atomically (a kill leaves the previous record or this one)."""
    with atomic_file(folder / "dataset.json", overwrite=True) as tmp:
        Path(tmp).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


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


def _reusable(tmp: Path, record: dict[str, Any], dataset: Dataset) -> dict[str, dict[str, Any]]:
    """The input entries (by name) of outputs in ``tmp`` an earlier run finished whose input and output hashes
    still match."""
    try:
        old = json.loads((tmp / "dataset.json").read_text())
    except (OSError, ValueError):
        return {}
    if old.get("command") != record["command"] or old.get("options") != record["options"]:
        raise RolloutError(
            f"{tmp}: --resume: expected the options of the run that left it ({old.get('options')}), found "
            f"{record['options']}. Rerun with the same options, or delete the folder.",
            exit_code=EXIT_USAGE,
        )
    recorded = {entry.get("name"): entry for entry in old.get("inputs", [])}
    keep = {}
    for out in old.get("outputs", []):
        name, path = out.get("name"), tmp / str(out.get("name"))
        if name not in recorded or name not in dataset.names or not path.is_file():
            continue
        source = _input_entry(dataset.files[dataset.names.index(name)], name)
        if source == recorded[name] and _entry(path, name) == out:
            keep[name] = source
    return keep


def _drop_temporaries(tmp: Path) -> None:
    """Remove what units of a killed run, or attempts lost with their node, were writing into ``tmp``
    (``.<name>.rolloutcli-tmp-*``: a SIGKILL removes nothing), so it is never published."""
    for path in sorted(tmp.rglob(f"*{TEMP_MARKER}*")):
        if path.is_file() or path.is_symlink():
            path.unlink(missing_ok=True)


def _input_entry(path: Path, name: str) -> dict[str, Any]:
    return {"path": os.path.abspath(path), **_entry(path, name)}


# the first file, its per-step fields (None: not checked), how files are opened
Base = tuple[Path, Signature | None, SafetyOptions | None]


def hashed_unit(
    fn: Callable[..., Any], args: tuple[Any, ...], src: Path, out: Path, name: str, base: Base
) -> dict[str, Any]:
    """A dataset's work unit: check that ``src``'s per-step fields agree with the first file's, run the
    command's unit ``fn(*args)`` writing ``out`` from ``src``, then return the entries of both for
    ``dataset.json``. The check and the hashing run in the workers, in parallel; the file is probed once. Run
    again (Ray retries a task whose node was lost after it wrote ``out``; an ``OSError`` while hashing), it
    replaces the ``out`` of the earlier attempt: the command's unit refused it as an existing output (exit 2)."""
    first, expected, safety = base
    with probed_once():
        if expected is not None and src != first:
            check_agrees(first, expected, src, signature(src, safety)[0])
        source = _input_entry(src, name)
        if os.path.lexists(out):
            os.unlink(out)
        fn(*args, **unit_progress())
    return {"input": source, "output": _entry(out, name)}


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
) -> dict[str, Any]:
    """Write one output per input of ``dataset`` into the folder ``dst`` (see the module docstring).

    ``make_unit(src, out)`` is the work unit writing ``out`` from ``src`` (it returns its summary). Every file's
    per-step fields must agree with the first file's (``dataset.check_agreement``'s rule, checked in the units;
    ``safety``: how they are opened for it). With a local pool the first failing file is reported, as a serial
    check would. ``rollouts`` False: the inputs are no rollout files (``split --unpad``'s split files, which each
    unit checks in full), and no agreement is checked.
    """
    dst = Path(dst)
    tmp = partial_folder(dst)
    _check_destination(dataset, dst, overwrite, resume, tmp)
    record: dict[str, Any] = {
        "format": DATASET_FORMAT,
        "format_version": DATASET_VERSION,
        "command": command,
        "options": options,
        "inputs": [],
        "outputs": [],
    }
    if resume and tmp.is_dir():
        _drop_temporaries(tmp)
    keep = _reusable(tmp, record, dataset) if resume and tmp.is_dir() else {}
    first = Path(os.path.abspath(dataset.files[0]))
    base: Base = (first, signature(first, safety)[0] if rollouts else None, safety)
    start_engine(engine)
    tmp.mkdir(exist_ok=True)
    inputs, outputs = dict(keep), {name: _entry(tmp / name, name) for name in keep}
    units, names = [], []
    for file, name in zip(dataset.files, dataset.names, strict=True):
        if name in keep:
            continue
        out = tmp / name
        out.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(out):
            out.unlink()
        src = Path(os.path.abspath(file))  # absolute: tasks run in other folders
        units.append((hashed_unit, (*make_unit(src, out), src, out, name, base)))
        names.append(name)

    def entries() -> dict[str, list[dict[str, Any]]]:
        finished = [name for name in dataset.names if name in outputs]
        return {"inputs": [inputs[n] for n in finished], "outputs": [outputs[n] for n in finished]}

    def done(index: int, result: dict[str, Any]) -> None:  # record progress so a later --resume can skip it
        inputs[names[index]], outputs[names[index]] = result["input"], result["output"]
        _write_record(tmp, {**record, **entries()})

    try:
        run_units(units, engine, done)
    except BaseException:
        if not outputs:  # nothing to resume: a corrected rerun must not be refused for an empty folder
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        close_pools()
    _drop_temporaries(tmp)  # an attempt lost with its node (Ray then retried its unit) left what it was writing
    _write_record(tmp, {**record, **entries()})
    _publish(tmp, dst, overwrite)
    return {
        "input": [str(f) for f in dataset.files],
        "output": str(dst),
        "files": len(dataset.files),
        "reused": len(keep),
        "bytes_written": sum(o["size_bytes"] for o in outputs.values()),
    }


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
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
