"""A dataset: several rollout files named by paths, directories and globs, taken in sorted path order.

:func:`resolve` turns command-line arguments into a :class:`Dataset` (sorted unique files, each with its name
relative to the dataset's root, which outputs reuse); :func:`check_agreement` checks that the files' per-step
fields agree in names, trailing shapes and dtypes (and, where an export needs it, in T). Neither depends on the
order a shell or a directory listing gives.
"""

from __future__ import annotations

import glob
import itertools
import os
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from threading import Event
from typing import Any

import xxhash

from rolloutcli.errors import EXIT_IO, EXIT_USAGE, RolloutError
from rolloutcli.hdf5.limits import SafetyOptions
from rolloutcli.hdf5.probe import probing_ahead
from rolloutcli.hdf5.reader import H5Input, RolloutReader

SUFFIXES = (".h5", ".hdf5")
GLOB_CHARS = set("*?[")


class Paths(Sequence[Path]):
    """Paths held as one string and where each ends, each ``Path`` made when read: a dataset's ``Path`` objects
    held ~500 bytes a file of the driver's memory for the whole run (5 MB for 10,000 files); this, their
    characters and 8 bytes."""

    def __init__(self, paths: Sequence[str]) -> None:
        self._ends = array("q", itertools.accumulate(map(len, paths)))
        self._text = "".join(paths)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: int) -> Path:  # type: ignore[override]  # no slices: the callers read one at a time
        i = range(len(self._ends))[i]  # a negative index counts from the end; out of range: IndexError
        return Path(self._text[self._ends[i - 1] if i else 0 : self._ends[i]])


@dataclass(frozen=True)
class Dataset:
    """``files`` in sorted order; ``names[i]``: ``files[i]`` relative to ``root`` (an output's relative name).
    ``many``: the arguments name a dataset (several paths, a directory or a glob), even if it holds one file."""

    files: Sequence[Path]
    names: tuple[str, ...]
    root: Path
    many: bool
    folders: tuple[Path, ...] = ()  # the directories named (an output must not lie inside one)


def _expand(arg: str) -> tuple[list[str], Path, bool]:
    """The files one argument names (each as ``str(Path(file))``), the folder its relative names start from, and
    whether it is a dataset. Strings, not ``Path`` objects: a dataset's paths, with those ``resolve`` makes from
    them, were the driver's peak memory past its start-up (~1 KB a file)."""
    path = Path(arg)
    if os.path.isdir(path):
        found = map(Path, glob.iglob(os.path.join(glob.escape(arg), "**", "*"), recursive=True))
        files = [str(p) for p in found if p.suffix.lower() in SUFFIXES and p.is_file()]
        if not files:  # like a glob matching nothing: the arguments name no input (usage, not the data)
            raise RolloutError(
                f"{arg}: expected rollout files (*.h5, *.hdf5) in the directory, found none. Check the path.",
                exit_code=EXIT_USAGE,
            )
        return files, path, True
    if not os.path.lexists(path) and GLOB_CHARS & set(arg):
        files = [str(Path(p)) for p in glob.iglob(arg, recursive=True) if os.path.isfile(p)]
        if not files:
            raise RolloutError(
                f"{arg}: expected files matching the pattern, found none. Check the pattern.", exit_code=EXIT_USAGE
            )
        return files, Path(os.path.commonpath({os.path.abspath(os.path.dirname(p)) for p in files})), True
    return [str(path)], path.parent, False


def resolve(args: Sequence[str | Path]) -> Dataset:
    """The dataset named by ``args`` (files, directories, globs): sorted by path, each file once.

    Raises:
        RolloutError: a directory without rollout files, a glob matching nothing, no argument, or one file
            named twice (by two paths, links included): exit 2, all of them.
    """
    if not args:
        raise RolloutError("expected at least one rollout file, directory or glob, found none.", exit_code=EXIT_USAGE)
    found: dict[str, str] = {}  # real path -> the file as named
    roots: list[Path] = []
    many = len(args) > 1
    folders = tuple(Path(a) for a in args if os.path.isdir(a))
    for arg in args:
        files, root, is_dataset = _expand(str(arg))
        many = many or is_dataset
        roots.append(Path(os.path.abspath(root)))
        for file in files:
            real = os.path.realpath(file)
            if real in found:
                raise RolloutError(
                    f"{file}: the same file as {found[real]}; expected each input once. Drop one of them.",
                    exit_code=EXIT_USAGE,
                )
            found[real] = file
    files = sorted(found.values(), key=os.path.abspath)
    root = Path(os.path.commonpath([*roots, *{os.path.dirname(os.path.abspath(f)) for f in files}]))
    names = tuple(os.path.relpath(os.path.abspath(f), root) for f in files)
    return Dataset(Paths(files), names, root, many, folders)


Signature = dict[str, tuple[str, tuple[int, ...]]]


def reader_signature(reader: RolloutReader) -> Signature:
    """Field laid out by env (per-step ``[T, N, ...]``, hidden states ``[T, layers, N, H]``, ``last_values``
    ``[N]``) -> (dtype, shape without T and N) as the reader returns them."""
    out = {}
    for name, spec in reader.schema.fields.items():
        if spec.env_axis is None:
            continue
        dtype, shape = reader.normalized(name, 0, 1)
        kept = [size for axis, size in enumerate(shape) if axis != spec.env_axis and not (axis == 0 < spec.env_axis)]
        out[name] = (str(dtype), tuple(kept))
    return out


def signature(
    file: Path,
    safety: SafetyOptions | None = None,
    each: Callable[[RolloutReader], None] | None = None,
    values: int | None = None,
) -> tuple[Signature, tuple[int, int]]:
    """``file``'s per-step fields (:func:`_signature`) and its ``(T, N)``; a file rolloutcli wrote that is no
    rollout (a split file, a shard) is named as such. ``each(reader)`` is called on the open file, unchecked, or
    with its values checked in blocks within ``values`` bytes when given (``RolloutReader``'s check)."""
    checked = {"check": True, "budget": values} if values is not None else {"check": False}
    with dataset_reader(file, safety, **checked) as reader:
        if each is not None:
            each(reader)
        return reader_signature(reader), (reader.T, reader.N)


def dataset_reader(file: Path, safety: SafetyOptions | None = None, **options: Any) -> RolloutReader:
    """``RolloutReader(file, safety, **options)`` for a file of a dataset: a file rolloutcli wrote that is no
    rollout (a split file, a shard) is named as such, with what to do, instead of its shape problems."""
    try:
        return RolloutReader(file, safety, **options)
    except RolloutError as error:
        raise _ours(file, safety) or error from error


_OURS = {  # rolloutcli_format of files rolloutcli writes that are no rollouts -> what they are, what to do
    "trajectories": (
        "a file written by rolloutcli split",
        "Restore the rollouts first: rolloutcli split --unpad FILES -o OUT.",
    ),
    "shard": ("a shard written by rolloutcli batch", "Load its folder with rolloutcli.shards.ShardDataset."),
}


def _ours(file: Path, safety: SafetyOptions | None) -> RolloutError | None:
    """The one-line error for a dataset file rolloutcli wrote that is no rollout file, else None."""
    try:
        with H5Input(file, safety) as source:
            kind = _OURS.get(str(source.attrs.get("rolloutcli_format")))
    except RolloutError:
        return None
    if kind is None:
        return None
    return RolloutError(f"{file}: {kind[0]}, not a rollout file; expected rollout files in a dataset. {kind[1]}")


def check_agrees(base: Path, expected: Signature, file: Path, found: Signature) -> None:
    """Raise ``RolloutError`` (exit 1, naming both files and the field) unless ``found`` (``file``'s
    signature) equals ``expected`` (``base``'s)."""
    for name in sorted(set(expected) | set(found)):
        ours, theirs = expected.get(name), found.get(name)
        if ours == theirs:
            continue
        if ours is None or theirs is None:
            where, lacks = (base, file) if ours is not None else (file, base)
            raise RolloutError(
                f"{lacks}: field '{name}': expected it as in {where}, found nothing. "
                "Every file of a dataset needs the same fields."
            )
        what = "dtype" if ours[0] != theirs[0] else "trailing shape"
        raise RolloutError(
            f"{file}: field '{name}': expected {what} {_show(ours, what)} as in {base}, "
            f"found {_show(theirs, what)}. Every file of a dataset needs the same fields."
        )


def check_agreement(
    files: Sequence[Path],
    safety: SafetyOptions | None = None,
    *,
    same_steps: str | None = None,
    each: Callable[[RolloutReader], None] | None = None,
    values: int | None = None,
) -> list[tuple[int, int]]:
    """``(T, N)`` of each file, after checking every file's per-step fields agree with the first file's.

    ``same_steps``: what needs one T (e.g. ``batch --recurrent``); files of another T are then refused.
    ``each(reader)``: called on each file while it is open (files are opened one at a time, in order).
    ``values``: each file's values are checked too, when it is opened, in blocks within this many bytes.

    Raises:
        RolloutError: exit 1 naming both files and the field (missing, other trailing shape or dtype, or T).
    """
    sizes: list[tuple[int, int]] = []
    for i, file in enumerate(probing_ahead(files, safety)):
        found, size = signature(file, safety, each, values)
        sizes.append(size)
        if i == 0:
            first = found
            continue
        check_agrees(files[0], first, file, found)
        if same_steps and size[0] != sizes[0][0]:
            raise RolloutError(
                f"{file}: field 'rewards': expected T = {sizes[0][0]} as in {files[0]} ({same_steps} needs one T "
                f"across files), found T = {size[0]}. Export files of one length together."
            )
    return sizes


def _show(signature: tuple[str, tuple[int, ...]], what: str) -> str:
    return signature[0] if what == "dtype" else str(list(signature[1]))


# Files are hashed through one reused buffer that stays in the caches: twice the speed of 8 MiB reads
# (benchmarks/README.md). A small file's buffer is its size (+1, so the second read finds the end): a fresh
# 1 MiB one (mapped and faulted in each time) took 63-81 us a 40 KB file against 43-47, 2 files a dataset unit.
HASH_BLOCK = 1 << 20


def file_hash(path: Path, stop: Event | None = None) -> str:
    """XXH3-128 of a file (``xxh128sum FILE``); ``stop`` set: ends early (the result is then meaningless)."""
    digest = xxhash.xxh3_128()
    try:
        with open(path, "rb", buffering=0) as handle:
            buffer = bytearray(min(HASH_BLOCK, os.fstat(handle.fileno()).st_size + 1))
            view = memoryview(buffer)
            while not (stop is not None and stop.is_set()) and (count := handle.readinto(buffer)):
                digest.update(view[:count])
    except OSError as exc:
        raise RolloutError(
            f"{path}: cannot read the file to hash it: {exc.strerror or exc}.", exit_code=EXIT_IO
        ) from exc
    return digest.hexdigest()
