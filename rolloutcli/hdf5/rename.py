"""Publishing renames that never replace what the user put at the destination.

``rename_noreplace`` fails with ``FileExistsError`` when ``dst`` exists at the moment of the rename: with
``renameat2(RENAME_NOREPLACE)`` on Linux (ext4, xfs, btrfs, tmpfs) the kernel checks and renames in one step;
elsewhere (NFS, some FUSE file systems) a file is published by ``link`` + ``unlink`` (``link`` never replaces),
a folder under an exclusive lock file beside it, checked just before ``rename`` (which stops a second rolloutcli
run but leaves a window of microseconds against other programs).

``exchange`` swaps two existing paths in one step (``RENAME_EXCHANGE``), so a replaced folder output is never
missing under its name; where that is not supported, the caller moves the old folder aside first.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from pathlib import Path
from typing import Any

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP)


def libc_function(name: str, *argtypes: Any) -> Any:
    """The C library's function ``name`` (returning an int, setting errno), or None where it is missing."""
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError, TypeError):
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = libc_function("renameat2", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)


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
