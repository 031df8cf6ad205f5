"""Publishing renames that never replace what the user put at the destination.

``rename_noreplace`` fails with ``FileExistsError`` when ``dst`` exists at the moment of the rename, so an
output created while a command runs (by the user, or a second run) is never replaced. How that holds:

- Linux with a file system that supports ``renameat2(RENAME_NOREPLACE)`` (ext4, xfs, btrfs, tmpfs): the
  kernel checks and renames in one step, for files and folders.
- Elsewhere (NFS, some FUSE file systems): a file is published by ``link`` + ``unlink`` (``link`` never
  replaces); a folder under an exclusive lock file beside it (``O_EXCL``), checked just before ``rename``,
  which stops a second rolloutcli run but leaves a window of microseconds against other programs.

``exchange`` swaps two existing paths in one step (``RENAME_EXCHANGE``), so a replaced folder output is never
missing under its name; where that is not supported, the old folder is moved aside first.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from pathlib import Path

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP)


def _renameat2() -> ctypes._CFuncPtr | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = _renameat2()


def _call(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2``; False where the system or file system lacks it; OSError for any other failure."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(dst))


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; ``FileExistsError`` if ``dst`` exists (a file, folder or link)."""
    if _call(src, dst, _RENAME_NOREPLACE):
        return
    if not os.path.isdir(src):
        os.link(src, dst, follow_symlinks=False)  # FileExistsError when dst exists
        os.unlink(src)
        return
    lock = dst.parent / f".{dst.name[:96]}.rolloutcli-tmp-lock"
    fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)  # FileExistsError: another run publishes
    try:
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
        os.rename(src, dst)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(lock)


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step; False where the file system cannot (nothing was changed)."""
    return _call(a, b, _RENAME_EXCHANGE)
