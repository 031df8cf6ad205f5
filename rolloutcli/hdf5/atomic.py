"""Atomic outputs: write to a temporary name beside the destination, rename only when complete.

A crash or Ctrl-C leaves the old output or none under the final name, never half of one. Temporaries are
named ``.<name>.rolloutcli-tmp-<random>`` and removed on any exception (KeyboardInterrupt, SystemExit too).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from rolloutcli.errors import EXIT_IO, EXIT_UNSAFE, EXIT_USAGE, RolloutError, stop_if_signalled
from rolloutcli.hdf5.rename import exchange, rename_noreplace

TEMP_MARKER = ".rolloutcli-tmp-"

# Temporary paths currently being written, so a signal handler can remove them before exiting.
_LIVE_TEMPS: set[str] = set()


def live_temporaries() -> set[str]:
    """Paths of temporary outputs still being written (for cleanup on SIGTERM/SIGINT)."""
    return set(_LIVE_TEMPS)


def remove_live_temporaries() -> None:
    """Delete every temporary output still being written (files or folders); never raises."""
    for path in list(_LIVE_TEMPS):
        _remove(Path(path))
        _LIVE_TEMPS.discard(path)


def same_file(a: Path, b: Path) -> bool:
    """True when ``a`` and ``b`` name the same file (same path, a symlink to it, or a hard link)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _holds(folder: Path, src: Path) -> bool:
    """True when ``src`` lies inside ``folder`` (after resolving links)."""
    try:
        return os.path.commonpath([os.path.realpath(folder), os.path.realpath(src)]) == os.path.realpath(folder)
    except ValueError:
        return False


def _check_replaceable(
    dst: Path, inputs: Sequence[Path], owned: Callable[[Path], bool] | None, mark: str = "its manifest.json"
) -> None:
    """``--overwrite`` on a folder output replaces only a link or an earlier output of ours holding no input
    (``mark``: how ``owned`` recognises one, named in the message)."""
    if os.path.islink(dst):
        return  # the link itself is replaced; its target is never touched
    if not os.path.isdir(dst) or owned is None or not owned(dst):
        raise RolloutError(
            f"{dst}: --overwrite replaces only an output folder rolloutcli wrote (with {mark}), "
            "found something else; refusing to touch it. Choose a new output folder.",
            exit_code=EXIT_USAGE,
        )
    for src in inputs:
        if _holds(dst, src):
            raise RolloutError(
                f"{dst}: output folder holds the input {src}; refusing to replace it. Choose a new output folder.",
                exit_code=EXIT_USAGE,
            )


def check_output_path(
    dst: Path,
    inputs: Sequence[Path],
    *,
    overwrite: bool,
    kind: str = "file",
    replace_input: bool = False,
    owned: Callable[[Path], bool] | None = None,
    overwrite_option: str = "--overwrite",
    mark: str = "its manifest.json",
) -> None:
    """Refuse unsafe destinations before anything is opened for writing (``overwrite_option``: how the caller's
    user asks to replace an output, named in the message).

    Refuses (exit 4) an output that is one of the inputs (same path, symlink or hard link) unless
    ``replace_input`` (an in-place update, which still goes through a temporary file); refuses (exit 2)
    a folder where a file is expected, an existing output without ``overwrite``, and, for a folder output,
    anything but a link or a folder ``owned`` says we wrote (``mark``: how it knows); a missing or non-writable
    parent folder (exit 3).
    """
    for src in [] if replace_input else inputs:
        if same_file(dst, src) or os.path.abspath(dst) == os.path.abspath(src):
            raise RolloutError(
                f"{dst}: output is the input file {src}; refusing to overwrite the input. "
                "Choose another output path (or use --in-place where the command offers it).",
                exit_code=EXIT_UNSAFE,
            )
    if os.path.isdir(dst) and not os.path.islink(dst) and kind == "file":
        raise RolloutError(
            f"{dst}: output is a folder, expected a file path. Choose a file name such as {dst}/out.h5.",
            exit_code=EXIT_USAGE,
        )
    if os.path.lexists(dst) and not overwrite:
        raise RolloutError(
            f"{dst}: output already exists; refusing to overwrite it. Pass {overwrite_option} to replace it.",
            exit_code=EXIT_USAGE,
        )
    if kind == "folder" and os.path.lexists(dst):
        _check_replaceable(dst, inputs, owned, mark)
    parent = _parent(dst)
    if not parent.is_dir():
        raise RolloutError(
            f"{dst}: output folder {parent} does not exist. Create it first (mkdir -p {parent}).",
            exit_code=EXIT_IO,
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RolloutError(
            f"{dst}: output folder {parent} is not writable. Choose a writable folder.",
            exit_code=EXIT_IO,
        )


def _remove(path: Path) -> None:
    """Delete a file, link or folder (a link's target is never followed); never raises."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _parent(dst: Path) -> Path:
    return Path(os.path.dirname(os.path.abspath(dst)))


def _temp_prefix(dst: Path) -> str:
    """``.<name>.rolloutcli-tmp-``, the name cut so the temporary stays within NAME_MAX (255 bytes)."""
    name = os.path.basename(os.path.abspath(dst)).encode()[:96].decode(errors="ignore")
    return f".{name}{TEMP_MARKER}"


_FOLDER_SYNC = [True]  # False inside ``folder_sync_deferred``


@contextlib.contextmanager
def folder_sync_deferred() -> Iterator[None]:
    """Inside the block, ``atomic_file`` does not fsync the folder after its rename: the caller commits the
    folder once (``fsync_tree``) before it is published (a dataset's units write into a partial folder whose
    record is checked against the files on ``--resume``, so a rename a crash loses only redoes its file). One
    fsync an output instead of two."""
    outer, _FOLDER_SYNC[0] = _FOLDER_SYNC[0], False
    try:
        yield
    finally:
        _FOLDER_SYNC[0] = outer


def fsync_tree(folder: Path) -> None:
    """``fsync_dir`` on ``folder`` and every folder in it (never raises)."""
    for parent, _, _ in os.walk(folder):
        fsync_dir(Path(parent))


def fsync_dir(folder: Path) -> None:
    """Commit ``folder``'s entries (a rename, a removal in it) to disk; never raises."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _mode_for(inputs: Sequence[Path]) -> int:
    """Permissions no wider than the inputs' (and than the umask allows)."""
    umask = os.umask(0)
    os.umask(umask)
    mode = 0o666 & ~umask
    for src in inputs:
        with contextlib.suppress(OSError):
            mode &= stat.S_IMODE(os.stat(src).st_mode)
    return mode


def _publish_error(dst: Path, exc: OSError, overwrite_option: str = "--overwrite") -> RolloutError:
    """A failed chmod / fsync / rename of a finished output (disk full at fsync, EIO, folder removed)."""
    if isinstance(exc, FileExistsError):
        return RolloutError(
            f"{dst}: output appeared while the command ran; refusing to overwrite it, nothing was written. "
            f"Pass {overwrite_option} to replace it.",
            exit_code=EXIT_USAGE,
        )
    return RolloutError(
        f"{dst}: cannot write the output: {exc.strerror or exc}; nothing was written.", exit_code=EXIT_IO
    )


def _keep_identity(tmp: Path, dst: Path) -> None:
    """An in-place replacement keeps the replaced file's mode, owner (where permitted) and extended attributes."""
    info = os.stat(dst)
    os.chmod(tmp, stat.S_IMODE(info.st_mode))
    with contextlib.suppress(OSError):
        os.chown(tmp, info.st_uid, info.st_gid)
    with contextlib.suppress(OSError):
        for name in os.listxattr(dst):
            with contextlib.suppress(OSError):
                os.setxattr(tmp, name, os.getxattr(dst, name))


@contextlib.contextmanager
def _temporary(shown: Path, parent: Path, kind: str) -> Iterator[Path]:
    """A new temporary file or folder in ``parent``, listed in the live temporaries while the block runs and
    removed if it raises (the block publishes it)."""
    try:
        if kind == "folder":
            name = tempfile.mkdtemp(prefix=_temp_prefix(shown), dir=parent)
        else:
            fd, name = tempfile.mkstemp(prefix=_temp_prefix(shown), dir=parent)
            os.close(fd)
    except OSError as exc:
        raise RolloutError(f"{shown}: cannot create a {kind} in {parent}: {exc.strerror}.", exit_code=EXIT_IO) from exc
    _LIVE_TEMPS.add(name)
    try:
        yield Path(name)
    except BaseException:
        _remove(Path(name))
        raise
    finally:
        _LIVE_TEMPS.discard(name)


@contextlib.contextmanager
def atomic_file(
    dst: Path,
    *,
    inputs: Sequence[Path] = (),
    overwrite: bool = False,
    replace_input: bool = False,
    overwrite_option: str = "--overwrite",
) -> Iterator[Path]:
    """Yield a temporary path beside ``dst``; on success fsync it and rename it onto ``dst``.

    On any exception the temporary file is removed and ``dst`` is left as it was. Without ``overwrite`` the
    rename never replaces a path that appeared meanwhile (exit 2). If ``dst`` is a symlink, the link itself
    is replaced by the new file (its target is untouched). ``replace_input`` allows ``dst`` to be one of
    ``inputs`` (in-place update: the input is replaced only when complete, keeping its mode, owner, xattrs).
    ``inputs`` are used as given, never copied: a dataset's thousands of paths are held once, by the caller.
    """
    dst = Path(dst)
    check_output_path(
        dst,
        inputs,
        overwrite=overwrite or replace_input,
        replace_input=replace_input,
        overwrite_option=overwrite_option,
    )
    parent = _parent(dst)
    with _temporary(dst, parent, "file") as tmp:
        yield tmp
        stop_if_signalled()  # a command's signal whose exception was lost: publish nothing
        try:
            if replace_input:
                _keep_identity(tmp, dst)
            else:
                os.chmod(tmp, _mode_for(inputs))
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
            if overwrite or replace_input:
                os.replace(tmp, dst)
            else:
                rename_noreplace(tmp, Path(os.path.abspath(dst)))
        except OSError as exc:
            raise _publish_error(dst, exc, overwrite_option) from exc
    if _FOLDER_SYNC[0]:
        fsync_dir(parent)


def _seal_folder(tmp: Path, mode: int) -> None:
    """chmod then fsync every file (the first fsync commits every chmod at once), then the folder itself; a
    folder inside (an export's layout) is sealed the same way first."""
    children = list(tmp.iterdir())
    folders = [child for child in children if child.is_dir() and not child.is_symlink()]
    for folder in folders:
        _seal_folder(folder, mode)
    for child in children:
        if child not in folders:
            os.chmod(child, mode)
    for child in children:
        if child not in folders:
            with open(child, "rb+") as handle:
                os.fsync(handle.fileno())
    os.chmod(tmp, mode | ((mode & 0o444) >> 2))  # folders need x where they have r
    fsync_dir(tmp)


def _replace_folder(tmp: Path, dst: Path) -> None:
    """Put ``tmp`` in place of ``dst`` (checked replaceable); the old output ends under ``tmp`` or is gone."""
    if exchange(tmp, dst):
        return
    old = Path(tempfile.mkdtemp(prefix=_temp_prefix(dst) + "old-", dir=dst.parent))
    os.replace(dst, old / "previous")
    try:
        os.rename(tmp, dst)
    except OSError:
        with contextlib.suppress(OSError):  # put the previous output back: old output or nothing
            os.replace(old / "previous", dst)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)  # a link inside is removed, its target never followed


@contextlib.contextmanager
def atomic_folder(
    dst: Path,
    *,
    inputs: Sequence[Path] = (),
    overwrite: bool = False,
    owned: Callable[[Path], bool] | None = None,
    mark: str = "its manifest.json",
) -> Iterator[Path]:
    """Yield a temporary folder beside ``dst``; publish it by renaming when the block completes.

    Without ``overwrite`` nothing at ``dst`` is ever replaced, even one that appeared during the run (exit 2).
    With it, only a link or a folder that ``owned`` recognises as an earlier output (holding no input) is
    replaced (``mark`` says how it is recognised), checked at the start and again at publish; the swap is one
    step where the file system allows, so an interruption leaves the old folder or the new one, never a
    half-written one. ``inputs`` are used as given, never copied (see :func:`atomic_file`).
    """
    shown = Path(dst)
    dst = Path(os.path.abspath(dst))
    check_output_path(shown, inputs, overwrite=overwrite, kind="folder", owned=owned, mark=mark)
    with _temporary(shown, dst.parent, "folder") as tmp:
        yield tmp
        stop_if_signalled()
        try:
            _seal_folder(tmp, _mode_for(inputs))
            if overwrite and os.path.lexists(dst):
                _check_replaceable(shown, inputs, owned, mark)
                _replace_folder(tmp, dst)
            else:
                rename_noreplace(tmp, dst)
        except OSError as exc:
            raise _publish_error(shown, exc) from exc
        fsync_dir(dst.parent)
        _remove(tmp)  # the replaced output, if any
