"""What a dataset run trusts in its partial folder: only a real folder, only the files its own record lists.

The partial folder (``.<name>.rolloutcli-partial`` beside ``-o``) is renamed onto ``-o`` as a unit, so whatever
it holds is published. ``--resume`` found it as an earlier run left it, or as anyone with write access changed
it since: a partial folder that is a symlink was published as a symlink (to wherever it pointed), a file planted
in it was published beside the outputs, a symlinked subfolder had outputs written through it. So a partial
folder that is not a real folder, or that holds a symlink or a special file (a FIFO hung ``--resume``), is
refused as unsafe (exit 4) before anything is read or written; and the folder holds, when it is published,
only ``dataset.json`` and the outputs it lists (each a regular file, named for an input and hashed there),
or it is refused (exit 4), nothing removed: a file the run did not write is never deleted nor published.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from rolloutcli.errors import EXIT_UNSAFE, RolloutError
from rolloutcli.hdf5.atomic import TEMP_MARKER

KINDS = {stat.S_IFLNK: "a symlink", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}
KINDS |= {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFREG: "a file"}


def kind_of(mode: int) -> str:
    """What an ``lstat`` mode is, in words."""
    return KINDS.get(stat.S_IFMT(mode), "a special file")


def check_partial_folder(tmp: Path, names: Iterable[str]) -> None:
    """Refuse (exit 4) a partial folder that is not a real folder, that holds a symlink or a special file anywhere
    (``--resume`` would follow, read or publish it), or whatever the run cannot write its outputs ``names`` over
    (a folder at an output's name, a file where its folder goes: the run removes only stale outputs)."""
    info = os.lstat(tmp)
    if not stat.S_ISDIR(info.st_mode):
        raise RolloutError(
            f"{tmp}: the partial folder is {kind_of(info.st_mode)}; "
            "expected the folder an earlier run made (--resume never follows a link). Delete it, then rerun.",
            exit_code=EXIT_UNSAFE,
        )

    def unsafe(name: str, mode: int) -> bool:  # temporaries: dropped
        return not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) or TEMP_MARKER in os.path.basename(name))

    stray = _first(tmp, unsafe)
    if stray is not None:
        raise _stray(tmp, stray[0], kind_of(stray[1]))
    names = list(names)
    needed = [*((folder, stat.S_ISDIR) for folder in _folders(names)), *((name, stat.S_ISREG) for name in names)]
    for name, wanted in needed:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # absent: made by the run
            mode = os.lstat(tmp / name).st_mode
            if not wanted(mode):
                raise _stray(tmp, tmp / name, kind_of(mode))


def _folders(names: Iterable[str]) -> set[str]:
    """The folders that hold ``names`` (relative paths)."""
    return {str(parent) for name in names for parent in Path(name).parents if str(parent) != "."}


def check_published(tmp: Path, names: Iterable[str], record: str) -> None:
    """Refuse (exit 4) to publish ``tmp`` unless it holds exactly ``record`` and the outputs ``names`` (the
    inputs' relative names, every one recorded and hashed in ``record``), as regular files, and the folders
    holding them: anything else was planted there and would be published as if the run had written it."""
    allowed = {record, *names}
    folders = _folders(allowed)

    def planted(name: str, mode: int) -> bool:
        return not ((stat.S_ISREG(mode) and name in allowed) or (stat.S_ISDIR(mode) and name in folders))

    stray = _first(tmp, planted)
    if stray is not None:
        raise _stray(tmp, stray[0], kind_of(stray[1]))


def _first(folder: Path, refused: Callable[[str, int], bool]) -> tuple[Path, int] | None:
    """The first entry under ``folder`` that ``refused(its path relative to folder, its lstat mode)``, symlinks
    not followed, with its mode: by name within a folder, a folder's entries before those of the folders in it,
    the last-named of those first. None if none is.

    The listings are streamed, only the folders' names kept: a sorted listing held ~1 KB an entry, the driver's
    peak at the end of a run on many files (3 MB more for 3,000 outputs).
    """
    todo = [(folder, "")]
    while todo:
        where, prefix = todo.pop()
        first: tuple[str, int] | None = None
        inside: list[str] = []
        with os.scandir(where) as scan:
            for entry in scan:
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode):
                    inside.append(entry.name)
                if (first is None or entry.name < first[0]) and refused(prefix + entry.name, mode):
                    first = (entry.name, mode)
        if first is not None:
            return where / first[0], first[1]
        todo.extend((where / name, f"{prefix}{name}/") for name in sorted(inside))
    return None


def drop_temporaries(tmp: Path) -> None:
    """Remove what units of a killed run, or attempts lost with their node, were writing into ``tmp``
    (``.<name>.rolloutcli-tmp-*``, files or symlinks: a SIGKILL removes nothing), so it is never published. The
    listings are streamed, as in ``_first`` (``Path.rglob`` lists each folder whole)."""
    todo, found = [tmp], []
    while todo:
        with os.scandir(todo.pop()) as scan:
            for entry in scan:
                if entry.is_dir(follow_symlinks=False):
                    todo.append(Path(entry.path))
                elif TEMP_MARKER in entry.name and (entry.is_symlink() or entry.is_file(follow_symlinks=False)):
                    found.append(entry.path)  # removed once listed: a listing is not changed while it is read
    for path in found:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _stray(tmp: Path, path: Path, what: str) -> RolloutError:
    return RolloutError(
        f"{path}: {what} in the partial folder that is no output of this run; expected only the outputs its "
        f"record lists (a partial folder is published whole). Move it out of {tmp}, then rerun with --resume.",
        exit_code=EXIT_UNSAFE,
    )


def discard_partial(tmp: Path, names: Iterable[str], own: Iterable[str]) -> None:
    """Remove what a run that finished no file left in ``tmp``: its ``own`` files (journal, record), temporaries
    and files at output ``names``, then the folders left empty. Anything else stays, and so does the folder
    then (``shutil.rmtree`` removed files planted there)."""
    for name in [*own, *names]:
        path = tmp / name
        if os.path.isfile(path) and not os.path.islink(path):
            os.unlink(path)
    for folder, _, files in sorted(os.walk(tmp), key=lambda walked: -len(walked[0])):  # deepest first
        for name in files:
            if TEMP_MARKER in name:
                os.unlink(os.path.join(folder, name))
        with contextlib.suppress(OSError):  # not empty: holds a file this run did not write
            os.rmdir(folder)
