"""How pipelines report progress without printing: they call a ``Progress`` the caller provides.

Test hook: with ``ROLLOUTCLI_TEST_PAUSE_AFTER_BLOCK`` set to a number of seconds, the first block of every command
(the CLI's bar) and of every unit of a local pool (:func:`unit_progress`) prints one line "rolloutcli: test pause
after block 1 (pid P, writing ...)" on stderr and sleeps, so a test can signal the process (P: the one writing)
while its output is half written (tests/test_promises_faults.py, tests/test_engine_stops.py).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

TEST_PAUSE_ENV = "ROLLOUTCLI_TEST_PAUSE_AFTER_BLOCK"


class Progress:
    """Receives progress events and ignores them (library use); the CLI's ``RichProgress`` draws bars."""

    def start(self, description: str, total: int) -> None:
        pass

    def advance(self, amount: int = 1) -> None:
        pass

    def describe(self, description: str) -> None:
        """A new description for the running bar (a dataset's files done)."""

    def finish(self) -> None:
        pass

    def warn(self, message: str) -> None:
        pass


def pause_for_test(seconds: float) -> None:
    """The test hook: announce the first block on stderr (this process and the temporaries it writes), then sleep."""
    from rolloutcli.hdf5.atomic import live_temporaries

    writing = " ".join(sorted(os.path.basename(p) for p in live_temporaries())) or "nothing"
    sys.stderr.write(f"rolloutcli: test pause after block 1 (pid {os.getpid()}, writing {writing})\n")
    sys.stderr.flush()
    # short sleeps: a signal the kernel hands to another thread still reaches the main thread's handler
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)


class TestPause(Progress):
    """The test hook as a ``Progress``: the first ``advance`` pauses as ``TEST_PAUSE_ENV`` asks, the others do
    nothing (the CLI's bar and a pool unit's progress both use it)."""

    __test__ = False  # not a pytest class

    def __init__(self) -> None:
        self.seconds = float(os.environ.get(TEST_PAUSE_ENV) or 0)

    def advance(self, amount: int = 1) -> None:
        seconds, self.seconds = self.seconds, 0.0
        if seconds > 0:
            pause_for_test(seconds)


def unit_progress() -> dict[str, Any]:
    """Keyword arguments for a pool unit's command function: ``progress`` pausing as the test hook asks, or none."""
    pause = TestPause()
    return {"progress": pause} if pause.seconds > 0 else {}
