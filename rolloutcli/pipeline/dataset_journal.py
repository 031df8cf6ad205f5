"""A dataset run's progress: an append-only journal in the partial folder, compacted once into ``dataset.json``.

Each finished output appends one line to ``.dataset.journal`` (its input's entry and its own), so recording a file
costs the same with 10 or 10,000 files done (rewriting ``dataset.json`` after each file cost 18 ms at 1,000
entries, 152 ms at 10,000). The first line names the command and its options. Lines are flushed, not fsynced: an
output is fsynced before it is renamed into the folder, so before its line is written, and ``--resume`` keeps no
output without checking both hashes against the files, so a line a crash loses only redoes its file. A line
without its newline (a kill mid-write, a full disk) is ignored, and a resumed run writes the journal anew with the
entries it keeps before appending, so no line ever follows a torn one. The driver keeps one offset per file; at the
end the lines are read back in input order into ``dataset.json`` (byte for byte ``json.dumps(record, indent=2,
sort_keys=True)``), and the journal is removed before the folder is published.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from array import array
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from rolloutcli.errors import EXIT_IO, EXIT_UNSAFE, EXIT_USAGE, RolloutError
from rolloutcli.hdf5.atomic import atomic_file, fsync_tree
from rolloutcli.pipeline.dataset_partial import kind_of

JOURNAL = ".dataset.journal"
RECORD = "dataset.json"
JOURNAL_FORMAT = "rolloutcli.dataset-journal"
JOURNAL_VERSION = 1


def _line(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode() + b"\n"


class Journal:
    """The progress of one run over ``count`` input files, in ``folder``'s journal. ``head``: ``dataset.json``'s
    fields other than its lists (format, format_version, command, options)."""

    def __init__(self, folder: Path, head: dict[str, Any], count: int) -> None:
        self.folder, self.path, self.head = folder, folder / JOURNAL, head
        self.offsets = array("q", [-1]) * count  # where input i's line starts (-1: not done): 8 bytes a file
        self.done = 0  # files recorded (kept and finished)
        self.bytes_written = 0  # their outputs' sizes
        self._handle: IO[bytes] | None = None
        self._end = 0

    def start(self, kept: Iterable[tuple[int, dict[str, Any]]]) -> None:
        """Write the journal anew (its first line, then each ``(index, entry)`` of ``kept``, checked by the caller),
        replacing an earlier one only once complete, and open it for appending."""
        first = {"format": JOURNAL_FORMAT, "format_version": JOURNAL_VERSION}
        first |= {key: self.head[key] for key in ("command", "options")}
        try:
            with atomic_file(self.path, overwrite=True) as tmp, open(tmp, "wb") as handle:
                handle.write(_line(first))
                for index, entry in kept:
                    if self.offsets[index] < 0:  # one line per file (an earlier journal holds no duplicate)
                        self._note(index, handle.tell(), entry)
                        handle.write(_line(entry))
                self._end = handle.tell()
            (self.folder / RECORD).unlink(missing_ok=True)  # a previous version's record: the journal replaces it
            self._handle = open(self.path, "ab")
        except OSError as exc:
            raise self._error(exc) from exc

    def add(self, index: int, entry: dict[str, Any]) -> None:
        """Record input ``index``'s finished output (``entry``: ``{"input": ..., "output": ...}``)."""
        assert self._handle is not None
        line = _line(entry)
        try:
            self._handle.write(line)
            self._handle.flush()  # in the kernel: a killed driver loses nothing; a crash, only the newest lines
        except OSError as exc:
            raise self._error(exc) from exc
        self._note(index, self._end, entry)
        self._end += len(line)

    def _note(self, index: int, offset: int, entry: dict[str, Any]) -> None:
        self.offsets[index] = offset
        self.done += 1
        self.bytes_written += entry["output"]["size_bytes"]

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def compact(self) -> None:
        """Write ``dataset.json`` from the journal (every file recorded), then remove the journal."""
        self.close()
        try:
            with open(self.path, "rb") as journal, atomic_file(self.folder / RECORD, overwrite=True) as tmp:
                with open(tmp, "w") as out:
                    lists = {"inputs": self._reader(journal, "input"), "outputs": self._reader(journal, "output")}
                    write_json(out, self.head, lists)
            self.path.unlink()
        except OSError as exc:
            raise self._error(exc) from exc
        # the journal's removal and every output's rename (the units defer their folder syncs) are on disk before
        # the folder is published
        fsync_tree(self.folder)

    def _reader(self, journal: IO[bytes], key: str) -> Callable[[], Iterator[Any]]:
        def entries() -> Iterator[Any]:  # in input order; one line in memory at a time
            for offset in self.offsets:
                journal.seek(offset)
                yield json.loads(journal.readline())[key]

        return entries

    def _error(self, exc: OSError) -> RolloutError:
        return RolloutError(
            f"{self.path}: cannot record the run's progress: {exc.strerror or exc}. Free space, then --resume.",
            exit_code=EXIT_IO,
        )


def write_json(out: IO[str], record: dict[str, Any], lists: dict[str, Callable[[], Iterator[Any]]]) -> None:
    """Write ``json.dumps({**record, **lists}, indent=2, sort_keys=True) + "\\n"`` with each list's items made one
    at a time by its function (``json.dumps`` needs the whole lists in memory)."""
    out.write("{")
    for k, key in enumerate(sorted([*record, *lists])):
        out.write(("," if k else "") + "\n  " + json.dumps(key) + ": ")
        if key not in lists:
            out.write(_nested(record[key], 1))
            continue
        empty = True
        for item in lists[key]():
            out.write(("[" if empty else ",") + "\n    " + _nested(item, 2))
            empty = False
        out.write("[]" if empty else "\n  ]")
    out.write("\n}\n")


def _nested(value: Any, level: int) -> str:
    """``value`` as ``json.dumps(indent=2, sort_keys=True)`` writes it ``level`` levels deep (a string holds no
    newline: JSON escapes it)."""
    return json.dumps(value, indent=2, sort_keys=True).replace("\n", "\n" + "  " * level)


LINE_MAX_BYTES = 1 << 20  # a journal line: two entries whose paths and names are at most PATH_MAX, escaped
RECORD_BYTES_PER_FILE = 16 << 10  # the previous version's dataset.json: at most 1 MiB and this much per input
MAX_DEPTH = 16  # how deep a record nests (its entries: 3 levels; options: a few)


def earlier_entries(folder: Path, head: dict[str, Any], count: int) -> Iterator[dict[str, Any]]:
    """The entries ``{"input": ..., "output": ...}`` an earlier run recorded in ``folder`` (its journal, else the
    ``dataset.json`` of a partial folder the previous version wrote, which rewrote it after each file) for a
    dataset of ``count`` files, not yet checked against the files; none without a readable record. Only regular
    files are read (a FIFO hung), of bounded size and depth: a line past them is ignored as a garbled one is.

    Raises:
        RolloutError: at once where the record names another command or other options (exit 2), is no regular
            file (exit 4), or is a ``dataset.json`` larger or nested deeper than a record can be (exit 1).
    """
    try:
        handle = _open_regular(folder / JOURNAL)
    except FileNotFoundError:
        return _record_entries(folder, head, count)
    except OSError:
        return iter(())
    with handle:
        first = handle.readline(LINE_MAX_BYTES)
    if not _same_run(folder, _parsed(first), head, (JOURNAL_FORMAT, JOURNAL_VERSION)):
        return iter(())
    return _journal_entries(folder / JOURNAL)


def _open_regular(path: Path) -> IO[bytes]:
    """``path`` opened for reading if it is a regular file (a symlink not followed, a FIFO not waited for);
    exit 4 if it is anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        fd = None
    mode = os.fstat(fd).st_mode if fd is not None else stat.S_IFLNK
    if not stat.S_ISREG(mode):
        if fd is not None:
            os.close(fd)
        raise RolloutError(
            f"{path}: {kind_of(mode)}; expected the regular file rolloutcli wrote (--resume reads no other). "
            "Delete it, then --resume (the outputs it listed are redone).",
            exit_code=EXIT_UNSAFE,
        )
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _journal_entries(path: Path) -> Iterator[dict[str, Any]]:
    with _open_regular(path) as handle:
        handle.readline(LINE_MAX_BYTES)
        for line in _lines(handle):
            entry = _parsed(line)  # None for a torn line (no newline: a kill, a full disk) or a garbled one
            if entry is not None:
                yield entry


def _lines(handle: IO[bytes]) -> Iterator[bytes]:
    """``handle``'s lines, each read at most ``LINE_MAX_BYTES`` at a time: a longer one (no record's) is read
    through to its end and given as ``b""``, which no entry parses from."""
    while line := handle.readline(LINE_MAX_BYTES):
        if len(line) == LINE_MAX_BYTES and not line.endswith(b"\n"):
            while (rest := handle.readline(LINE_MAX_BYTES)) and not rest.endswith(b"\n"):
                pass
            line = b""
        yield line


def _record_entries(folder: Path, head: dict[str, Any], count: int) -> Iterator[dict[str, Any]]:
    path = folder / RECORD
    limit = (1 << 20) + RECORD_BYTES_PER_FILE * count
    try:
        with _open_regular(path) as handle:
            text = handle.read(limit + 1)
    except OSError:
        return iter(())
    if len(text) > limit:
        raise RolloutError.field(
            path,
            "(file)",
            f"at most {limit} bytes for {count} input files",
            "a larger file",
            "Delete it, then --resume (the outputs it listed are redone).",
        )
    try:
        old = json.loads(text)
        deep = _depth(old) > MAX_DEPTH
    except ValueError:
        return iter(())  # garbled: nothing kept, as before
    except RecursionError:  # json's C parser stops at the interpreter's recursion limit
        deep = True
    if deep:
        raise RolloutError.field(
            path,
            "(file)",
            f"a record nested at most {MAX_DEPTH} levels deep",
            "one nested deeper",
            "Delete it, then --resume (the outputs it listed are redone).",
        )
    if not _same_run(folder, old, head, (head["format"], head["format_version"])):
        return iter(())
    inputs = {entry.get("name"): entry for entry in old.get("inputs", []) if isinstance(entry, dict)}
    outputs = [entry for entry in old.get("outputs", []) if isinstance(entry, dict)]
    return iter([{"input": inputs.get(entry.get("name")), "output": entry} for entry in outputs])


def _depth(value: Any) -> int:
    """How deep ``value`` (parsed JSON) nests, without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        deepest = max(deepest, level)
        if isinstance(item, dict):
            todo.extend((child, level + 1) for child in item.values())
        elif isinstance(item, list):
            todo.extend((child, level + 1) for child in item)
    return deepest


def _parsed(line: bytes) -> dict[str, Any] | None:
    """A whole journal line's object; None for a line cut short, garbled, nested too deeply or not an object."""
    if not line.endswith(b"\n"):
        return None
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) and _depth(value) <= MAX_DEPTH else None


def _same_run(folder: Path, found: Any, head: dict[str, Any], kind: tuple[str, int]) -> bool:
    """Whether ``found`` (a record's first fields) is a record of ``kind`` (format, version) of this command with
    these options; another command or other options are refused (exit 2), a record of another kind is ignored."""
    if not isinstance(found, dict) or (found.get("format"), found.get("format_version")) != kind:
        return False
    options = json.loads(json.dumps(head["options"]))  # as read back (a tuple is a list)
    if found.get("command") != head["command"] or found.get("options") != options:
        raise RolloutError(
            f"{folder}: --resume: expected the options of the run that left it ({found.get('options')}), found "
            f"{head['options']}. Rerun with the same options, or delete the folder.",
            exit_code=EXIT_USAGE,
        )
    return True
