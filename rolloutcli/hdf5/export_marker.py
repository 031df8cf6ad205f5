"""How an export's output is recognised as rolloutcli's own: every HDF5 file the export writers write carries the
root attribute ``rolloutcli_export`` (the target's name). ``export --overwrite`` replaces a folder (a Minari
dataset, a D4RL split) only where one of the files an export writes there carries it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import h5py

from rolloutcli.hdf5.safety import HDF5_ERRORS

MARKER = "rolloutcli_export"
# Where the folder exports put their files: Minari (one dataset, or a split's two) and a D4RL split.
_MARKED_FILES = (
    "data/main_data.hdf5",
    "train-v0/data/main_data.hdf5",
    "valid-v0/data/main_data.hdf5",
    "train.hdf5",
    "valid.hdf5",
)
# How the refusal names what makes a folder ours (atomic_folder's ``mark``).
MARK = f"an HDF5 file marked '{MARKER}'"


def _marked(path: Path) -> bool:
    """``path`` is a regular file (not a link: a link would lend us someone else's folder; not a FIFO: opening it
    would block) of HDF5 carrying the marker."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        with h5py.File(path, "r", locking=False) as handle:
            return MARKER in handle.attrs
    except HDF5_ERRORS:
        return False


def is_export_folder(folder: Path) -> bool:
    """True for a folder ``rolloutcli export`` wrote: one of the files it writes there carries the marker."""
    return any(_marked(Path(folder) / name) for name in _MARKED_FILES)
