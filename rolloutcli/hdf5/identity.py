"""A file's identity: what says it is still the same file, unchanged, without reading it."""

from __future__ import annotations

import os


def identity(info: os.stat_result) -> list[int]:
    """Device, inode, size, modification and change times (ns) of a ``stat``/``fstat`` result: a rewrite, an
    append, a truncation or a replacement under the same name changes at least one of them. A list: it travels
    as JSON between the metadata probe and its client."""
    return [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def path_identity(path: str | os.PathLike[str]) -> list[int] | None:
    """``identity`` of the file at ``path`` (symlinks followed), None when it cannot be read."""
    try:
        return identity(os.stat(path))
    except OSError:
        return None
