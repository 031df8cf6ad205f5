"""Bounded waits on the writing process: a recording not published in time is reported with the process's state
(a stopped process is named as such), never waited for forever."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

from rolloutcli.errors import EXIT_IO, RolloutError

PUBLISH_WAIT_S = 600.0  # how long the training waits for one recording to be published
_STATES = {"R": "running", "S": "running (waiting)", "D": "waiting on the disk", "Z": "ended", "X": "ended"}


def process_state(pid: int | None) -> str:
    """What the process ``pid`` is doing, as Linux's ``/proc`` says (elsewhere: unknown)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "in an unknown state"
    if state in "Tt":
        return f"stopped (SIGSTOP or a debugger): resume it with `kill -CONT {pid}`"
    return _STATES.get(state, f"in state {state}")


def wait_settled(future: Future[Any], timeout: float | None = None) -> BaseException | None:
    """The recording's error (None: published) once settled; a ``RolloutError`` after ``PUBLISH_WAIT_S``."""
    wait = PUBLISH_WAIT_S if timeout is None else timeout
    try:
        return future.exception(timeout=wait)
    except TimeoutError:
        pid = getattr(future, "pid", None)
        raise RolloutError(
            f"{getattr(future, 'path', 'a recording')}: not published after {wait:g} s: the recording process "
            f"(pid {pid}) is {process_state(pid)}.",
            exit_code=EXIT_IO,
        ) from None


def listing(paths: list[Path]) -> str:
    """Files named exactly (the first and last of more than 20, with their count)."""
    if not paths:
        return "none"
    if len(paths) <= 20:
        return ", ".join(str(p) for p in paths)
    return f"{len(paths)} files, {paths[0]} to {paths[-1]}"
