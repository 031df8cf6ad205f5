"""Atomic outputs: write to a temporary name beside the destination, rename only when complete.

A crash or Ctrl-C therefore leaves either the old file or no file under the final name, never half a
file. Temporary names carry the pattern ``.<name>.rolloutcli-tmp-<random>`` so they are recognisable and
are removed on any exception (including KeyboardInterrupt / SystemExit raised by signal handlers).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from rolloutcli.errors import EXIT_IO, EXIT_UNSAFE, EXIT_USAGE, RolloutError

TEMP_MARKER = ".rolloutcli-tmp-"

# Temporary paths currently being written, so a signal handler can remove them before exiting.
_LIVE_TEMPS: set[str] = set()


def live_temporaries() -> set[str]:
    """Paths of temporary outputs still being written (for cleanup on SIGTERM/SIGINT)."""
    return set(_LIVE_TEMPS)


def remove_live_temporaries() -> None:
    """Delete every temporary output still being written (files or folders); never raises."""
    for path in list(_LIVE_TEMPS):
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        _LIVE_TEMPS.discard(path)


def same_file(a: Path, b: Path) -> bool:
    """True when ``a`` and ``b`` name the same file (same path, a symlink to it, or a hard link)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output_path(
    dst: Path, inputs: Sequence[Path], *, overwrite: bool, kind: str = "file", replace_input: bool = False
) -> None:
    """Refuse unsafe destinations before anything is opened for writing.

    Refuses (exit 4) an output that is one of the inputs (same path, symlink or hard link) unless
    ``replace_input`` (an in-place update, which still goes through a temporary file); refuses (exit 2)
    an existing output without ``overwrite``, and a missing or non-writable parent folder (exit 3).
    """
    for src in [] if replace_input else inputs:
        if same_file(dst, src) or os.path.abspath(dst) == os.path.abspath(src):
            raise RolloutError(
                f"{dst}: output is the input file {src}; refusing to overwrite the input. "
                "Choose another output path (or use --in-place where the command offers it).",
                exit_code=EXIT_UNSAFE,
            )
    if os.path.lexists(dst) and not overwrite:
        raise RolloutError(
            f"{dst}: output already exists; refusing to overwrite it. Pass --overwrite to replace it.",
            exit_code=EXIT_USAGE,
        )
    if os.path.isdir(dst) and not os.path.islink(dst) and kind == "file":
        raise RolloutError(
            f"{dst}: output is a folder, expected a file path. Choose a file name such as {dst}/out.h5.",
            exit_code=EXIT_USAGE,
        )
    parent = dst.parent if str(dst.parent) else Path(".")
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


def _fsync_dir(folder: Path) -> None:
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


def _publish_error(dst: Path, exc: OSError) -> RolloutError:
    """A failed chmod / fsync / rename of a finished output (disk full at fsync, EIO, folder removed)."""
    return RolloutError(
        f"{dst}: cannot write the output: {exc.strerror or exc}; nothing was written.", exit_code=EXIT_IO
    )


@contextlib.contextmanager
def atomic_file(
    dst: Path, *, inputs: Sequence[Path] = (), overwrite: bool = False, replace_input: bool = False
) -> Iterator[Path]:
    """Yield a temporary path beside ``dst``; on success fsync it and ``os.replace`` it onto ``dst``.

    On any exception the temporary file is removed and ``dst`` is left as it was. If ``dst`` is a
    symlink, the link itself is replaced by the new file (its target is untouched). ``replace_input``
    allows ``dst`` to be one of ``inputs`` (in-place update: the input is replaced only when complete).
    """
    dst = Path(dst)
    inputs = [Path(p) for p in inputs]
    check_output_path(dst, inputs, overwrite=overwrite or replace_input, replace_input=replace_input)
    parent = dst.parent if str(dst.parent) else Path(".")
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}{TEMP_MARKER}", dir=parent)
    except OSError as exc:
        raise RolloutError(f"{dst}: cannot create a file in {parent}: {exc.strerror}.", exit_code=EXIT_IO) from exc
    os.close(fd)
    _LIVE_TEMPS.add(tmp_name)
    tmp = Path(tmp_name)
    try:
        yield tmp
        try:
            os.chmod(tmp, _mode_for(inputs))
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, dst)
        except OSError as exc:
            raise _publish_error(dst, exc) from exc
        _LIVE_TEMPS.discard(tmp_name)
        _fsync_dir(parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        _LIVE_TEMPS.discard(tmp_name)
        raise


@contextlib.contextmanager
def atomic_folder(dst: Path, *, inputs: Sequence[Path] = (), overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``dst``; publish it by renaming when the block completes.

    An existing ``dst`` (with ``overwrite``) is moved aside first and removed only after the new folder
    is in place, so an interruption leaves the old folder or no folder, never a half-written one.
    """
    dst = Path(dst)
    inputs = [Path(p) for p in inputs]
    check_output_path(dst, inputs, overwrite=overwrite, kind="folder")
    parent = dst.parent if str(dst.parent) else Path(".")
    try:
        tmp_name = tempfile.mkdtemp(prefix=f".{dst.name}{TEMP_MARKER}", dir=parent)
    except OSError as exc:
        raise RolloutError(f"{dst}: cannot create a folder in {parent}: {exc.strerror}.", exit_code=EXIT_IO) from exc
    _LIVE_TEMPS.add(tmp_name)
    tmp = Path(tmp_name)
    old: Path | None = None  # the previous output while it is moved aside (never in _LIVE_TEMPS: it is user data)
    try:
        yield tmp
        try:
            mode = _mode_for(inputs)
            children = list(tmp.iterdir())
            for child in children:  # every chmod first: the first fsync then commits them all at once
                os.chmod(child, mode)
            for child in children:
                with open(child, "rb+") as handle:
                    os.fsync(handle.fileno())
            os.chmod(tmp, mode | ((mode & 0o444) >> 2))  # folders need x where they have r
            _fsync_dir(tmp)
            if os.path.lexists(dst):
                old = Path(tempfile.mkdtemp(prefix=f".{dst.name}{TEMP_MARKER}old-", dir=parent))
                os.replace(dst, old / "previous")
            os.replace(tmp, dst)
        except OSError as exc:
            raise _publish_error(dst, exc) from exc
        _LIVE_TEMPS.discard(tmp_name)
        _fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _LIVE_TEMPS.discard(tmp_name)
        if old is not None and os.path.lexists(old / "previous") and not os.path.lexists(dst):
            with contextlib.suppress(OSError):  # put the previous output back: old output or nothing
                os.replace(old / "previous", dst)
                os.rmdir(old)
        raise
