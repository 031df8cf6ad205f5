"""The folder a recorder writes ``rollout_<n>.h5`` into: never one holding another recording's later files.

A recorder numbers its files from where it starts (RSL-RL: the runner's iteration; the others: 0) and replaces
a file of the same name. Started in the folder of an earlier run, it would replace that run's files one by
one and leave the rest: a folder mixing two runs that every dataset command then reads as one. A resumed run,
whose numbers continue after the folder's, is welcome.
"""

from __future__ import annotations

import re
from pathlib import Path

from rolloutcli.errors import EXIT_USAGE, RolloutError

_NAME = re.compile(r"rollout_(\d{6,})\.h5")


def recording_folder(out_dir: Path, first: int, recorder: str) -> Path:
    """Create ``out_dir``; refuse it (exit 2) when it holds recorded files numbered ``first`` or later."""
    out_dir.mkdir(parents=True, exist_ok=True)
    later = sorted(
        path.name
        for path in out_dir.iterdir()
        if (match := _NAME.fullmatch(path.name)) and int(match.group(1)) >= first and path.is_file()
    )
    if later:
        more = f" and {len(later) - 1} more" if len(later) > 1 else ""
        raise RolloutError(
            f"{out_dir}: {recorder} writes rollout_{first:06d}.h5 on; expected no such file there, found "
            f"{later[0]}{more} of an earlier recording (they would be replaced one by one, the rest left). "
            "Choose a new folder, or move them.",
            exit_code=EXIT_USAGE,
        )
    return out_dir
