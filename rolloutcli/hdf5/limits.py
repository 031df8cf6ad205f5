"""Limits and checks that need neither h5py nor numpy (the memory budget, what the audit allows, the regular-file
check), so that ``gae`` can check its paths and start its file copy before the heavy imports."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from rolloutcli.errors import EXIT_IO, EXIT_UNSAFE, EXIT_USAGE, RolloutError

DEFAULT_MAX_MEMORY = 1 << 30  # 1 GiB block budget
DEFAULT_MAX_DATASET_BYTES = 1 << 40  # 1 TiB declared: larger is a hostile or corrupt header
DEFAULT_MAX_CHUNK_BYTES = 256 << 20  # a chunk is decompressed whole: over 256 MiB is absurd for a rollout


@dataclass(frozen=True)
class SafetyOptions:
    """What the audit allows.

    Attributes:
        allow_external: follow soft/external links, external raw storage and virtual datasets.
        max_dataset_bytes: largest declared (uncompressed) size of one dataset.
        max_chunk_bytes: largest uncompressed chunk.
    """

    allow_external: bool = False
    max_dataset_bytes: int = DEFAULT_MAX_DATASET_BYTES
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES


def check_regular_file(path: Path) -> None:
    """Require an existing regular file (a FIFO or device as input would hang or flood)."""
    try:
        info = os.stat(path)
    except FileNotFoundError as exc:
        raise RolloutError(f"{path}: no such file. Check the path.", exit_code=EXIT_IO) from exc
    except OSError as exc:
        raise RolloutError(f"{path}: cannot stat the file: {exc.strerror}.", exit_code=EXIT_IO) from exc
    if stat.S_ISDIR(info.st_mode):
        raise RolloutError(f"{path}: is a folder, expected an HDF5 file.", exit_code=EXIT_IO)
    if not stat.S_ISREG(info.st_mode):
        raise RolloutError(
            f"{path}: not a regular file (a FIFO, socket or device); refusing to read it. "
            "Copy the data into a regular .h5 file.",
            exit_code=EXIT_UNSAFE,
        )


def budget_text(size: int) -> str:
    """Bytes as ``--max-memory`` spells them, rounded up to whole KiB or MiB."""
    if size < 1 << 20:
        return f"{-(-size // 1024)}K"
    return f"{-(-size // (1 << 20))}M"


def check_one_env_fits(path: Path, per_env: int, budget: int, max_memory: int) -> None:
    """Refuse, before anything is read, a file one env of which does not fit in its share of the budget.

    Blocks never cut an env along T, so an env larger than ``budget`` (the command's share of ``max_memory``)
    would be read whole whatever ``--max-memory`` says. The message names the ``--max-memory`` that fits.
    """
    if per_env > budget:
        need = max(-(-per_env * max_memory // max(budget, 1)), max_memory + 1)
        raise RolloutError(
            f"{path}: one env needs {budget_text(need)} of memory, more than --max-memory {budget_text(max_memory)}; "
            f"pass --max-memory {budget_text(need)} or more.",
            exit_code=EXIT_USAGE,
        )
