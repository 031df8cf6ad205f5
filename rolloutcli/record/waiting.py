"""Bounded waits on the writing process: a recording not published in time is reported with the process's state
(a stopped process is named as such), never waited for forever; at interpreter exit too (:func:`wait_at_exit`)."""

from __future__ import annotations

import subprocess
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from rolloutcli.errors import EXIT_IO, RolloutError

PUBLISH_WAIT_S = 600.0  # how long the training waits for one recording to be published
# At exit: how long a stopped (SIGSTOP) writing process is waited for, stopped all along (it may be resumed).
EXIT_STOPPED_WAIT_S = 10.0
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


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in "Tt"
    except (OSError, IndexError):
        return False


def wait_at_exit(process: subprocess.Popen, unpublished: Callable[[], list[Path]]) -> bool:
    """Wait for the writing process to end (it publishes what it was handed, then ends): up to
    ``PUBLISH_WAIT_S`` while it runs, ``EXIT_STOPPED_WAIT_S`` while it stays stopped. True once it ended; else
    False, after a warning saying what happened and which recordings (``unpublished()``) are not published."""
    started = time.monotonic()
    stopped_since = None
    while True:
        try:
            process.wait(timeout=0.1)
            return True
        except subprocess.TimeoutExpired:
            now = time.monotonic()
        stopped_since = (stopped_since or now) if _stopped(process.pid) else None
        stopped_too_long = stopped_since is not None and now - stopped_since >= EXIT_STOPPED_WAIT_S
        if now - started >= PUBLISH_WAIT_S or stopped_too_long:
            break
    warnings.warn(
        f"rolloutcli: not waiting any longer at exit for the recording process (pid {process.pid}): after "
        f"{now - started:.0f} s it is {process_state(process.pid)}; not published: {listing(unpublished())}.",
        RuntimeWarning,
        stacklevel=2,
    )
    return False


def listing(paths: list[Path]) -> str:
    """Files named exactly (the first and last of more than 20, with their count)."""
    if not paths:
        return "none"
    if len(paths) <= 20:
        return ", ".join(str(p) for p in paths)
    return f"{len(paths)} files, {paths[0]} to {paths[-1]}"
