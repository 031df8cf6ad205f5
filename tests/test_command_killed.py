"""A command SIGKILLed (or crashed) takes every process it started with it: its pool's process server, resource
tracker and workers, the probe helpers and their probers, and closes its stderr (a pipe reading it ends); under
``--engine ray`` with a local cluster it started, a SIGTERM is still the command's own (exit 143, its line).

Before: SIGKILL of a ``--workers 2`` run left the tracker, the server, both workers and their probe helpers
running for ever, ignoring SIGTERM, and a pipe reading the command's stderr never ended. The processes of a
command are found by an environment variable given to it alone (its children inherit it; after the kill they
are no longer its descendants). The small version is here; 50 random kills: tests/fuzz/kill_loop.py --command-kills.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.hdf5.atomic import TEMP_MARKER
from rolloutcli.pipeline.dataset_job import partial_folder
from rolloutcli.pipeline.progress import TEST_PAUSE_ENV

TAG_ENV = "ROLLOUTCLI_TEST_KILL_TAG"  # no rolloutcli code reads it: it only marks the command's processes
SETTLE_S = 30.0  # how long the checks wait for the processes to end (the promise is 5 s: the fuzz loop times it)


def tagged(tag: str) -> dict[int, str]:
    """The running processes (not zombies) whose environment holds ``TAG_ENV=tag``: pid -> command line."""
    found = {}
    mark = f"{TAG_ENV}={tag}".encode() + b"\0"
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark not in Path(f"/proc/{entry}/environ").read_bytes() + b"\0":
                continue
            if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except (OSError, IndexError):
            continue
    return found


class Killed:
    """One command run to be SIGKILLed: ``start``, wait for a moment (``when``), ``kill``; then ``left`` holds
    the processes still running and ``closed`` whether its stderr reached end-of-file, ``seconds`` after it.
    ``env``: variables to set for the command (None: to unset)."""

    def __init__(self, argv: list[str], env: dict[str, str | None] | None = None) -> None:
        self.tag = secrets.token_hex(8)
        self.read, write = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rolloutcli", *argv],
            stdout=subprocess.DEVNULL,
            stderr=write,
            env={k: v for k, v in {**os.environ, **(env or {}), TAG_ENV: self.tag}.items() if v is not None},
            start_new_session=True,
        )
        os.close(write)
        self.seen = b""
        self.left: dict[int, str] = {}
        self.closed = False
        self.seconds = 0.0

    def when(self, ready: Callable[[Killed], bool], timeout: float = 120.0) -> bool:
        """Wait until ``ready(self)`` or the command ended (False then)."""
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            if ready(self):
                return True
            self._drain(0.02)
        return False

    def kill(self, settle: float = SETTLE_S) -> Killed:
        """SIGKILL the command alone; wait up to ``settle`` s for its processes to end and its stderr to close."""
        if self.process.poll() is None:  # not yet reaped: the pid is still the command's
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()
        killed = time.monotonic()
        try:
            while True:
                self.closed = self.closed or self._drain(0.05)
                self.left = tagged(self.tag)
                self.seconds = time.monotonic() - killed
                if (self.closed and not self.left) or self.seconds > settle:
                    break
        finally:
            os.close(self.read)
            for pid in tagged(self.tag):  # a broken promise must not outlive the test
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        return self

    def _drain(self, timeout: float) -> bool:
        """Read what stderr holds (waiting up to ``timeout``); whether it reached end-of-file."""
        if not select.select([self.read], [], [], timeout)[0]:
            return False
        data = os.read(self.read, 1 << 16)
        self.seen += data
        return data == b""


def workers_paused(count: int) -> Callable[[Killed], bool]:
    """Ready once ``count`` units have paused mid-write (the test hook's line on stderr)."""
    return lambda run: run.seen.count(b"rolloutcli: test pause after block 1") >= count


def processes_at_least(count: int) -> Callable[[Killed], bool]:
    return lambda run: len(tagged(run.tag)) >= count


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("killed") / "runs"
    folder.mkdir()
    for i in range(8):
        write_rollout(folder / f"r{i}.h5", rollout_arrays(T=64, N=8, seed=i))
    return folder


# (command, moment): when the command is killed, and the test hook's pause of each unit (seconds)
MOMENTS = {
    ("gae", "pool starting"): (processes_at_least(4), None),  # the command, its probe helper, tracker, server
    ("gae", "units running"): (workers_paused(2), "30"),  # both workers mid-write, with helpers and probers
    ("batch", "workers running"): (processes_at_least(6), None),  # ... and both workers
}


@pytest.mark.parametrize("command, moment", MOMENTS)
def test_every_process_of_a_sigkilled_command_ends_and_its_stderr_closes(
    runs: Path, tmp_path: Path, command: str, moment: str
) -> None:
    ready, pause = MOMENTS[command, moment]
    source = runs
    extra = []
    if command == "batch":  # batch reads gae's outputs
        done = subprocess.run([sys.executable, "-m", "rolloutcli", "gae", str(runs), "-o", str(tmp_path / "gae")])
        assert done.returncode == 0
        # a budget its shards fit (batch refuses one larger: 84 KB with some torch builds' data), still many blocks
        source, extra = tmp_path / "gae", ["-m", "4", "--epochs", "2", "--max-memory", "256K"]
    argv = [command, str(source), "-o", str(tmp_path / "out"), "--workers", "2", *extra]
    run = Killed(argv, {TEST_PAUSE_ENV: pause} if pause else None)
    assert run.when(ready), run.seen.decode(errors="replace")[-2000:]
    run.kill()
    assert run.left == {}, f"left {run.seconds:.1f} s after the kill: {run.left}"
    assert run.closed


def test_sigterm_under_a_local_ray_cluster_is_the_commands_own(runs: Path, tmp_path: Path) -> None:
    """``--engine ray`` without ``--address``: the command starts a local cluster, and Ray replaces the SIGTERM
    handler (in Python and below it, in its core worker). Before: no ``terminated:`` line, exit 15 or an abort
    (-6) with Ray's stack dump. Now: exit 143, the line last, the temporaries of the units it stopped removed,
    and no process of the command's cluster left."""
    pytest.importorskip("ray")
    out = tmp_path / "out"
    partial = partial_folder(out)

    def writing(run: Killed) -> bool:  # a unit paused mid-write by the test hook: its temporary exists
        return partial.is_dir() and any(TEMP_MARKER in path.name for path in partial.rglob("*"))

    run = Killed(["gae", str(runs), "-o", str(out), "--engine", "ray"], {TEST_PAUSE_ENV: "60", "RAY_ADDRESS": None})
    try:
        assert run.when(writing, timeout=180), run.seen.decode(errors="replace")[-2000:]
        os.kill(run.process.pid, signal.SIGTERM)
        code = run.process.wait(timeout=120)
    finally:
        run.kill()  # (it ended: nothing to kill) its processes gone, its stderr read to the end
    lines = run.seen.decode(errors="replace").strip().splitlines()
    assert (code, lines[-1]) == (143, "terminated: no output was written (temporary files removed)."), lines[-12:]
    assert not os.path.lexists(partial) and not os.path.lexists(out)
    assert run.left == {} and run.closed
