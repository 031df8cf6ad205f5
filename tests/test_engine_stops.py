"""A local pool's run that fails or is stopped ends: signals to the whole job, a worker dying after a failure.

Python 3.11's ``ProcessPoolExecutor`` raises in its manager thread when a worker dies while a future it still
holds is cancelled (CPython gh-107219), and a wait for the running futures then never ends. The engine skips
the units of a failed run through a stop file instead of cancelling them; these tests hung before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.hdf5.atomic import TEMP_MARKER
from rolloutcli.pipeline.dataset_job import partial_folder
from rolloutcli.pipeline.progress import TEST_PAUSE_ENV

HERE = Path(__file__).parent


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    folder = tmp_path / "runs"
    folder.mkdir()
    for i in range(6):
        write_rollout(folder / f"r{i}.h5", rollout_arrays(T=64, N=8, seed=i))
    return folder


FAIL_THEN_DIE = """
import os, signal, sys, time
from rolloutcli.errors import RolloutError
from rolloutcli.pipeline.engine import EngineOptions, close_pools, run_units

def unit(i, log):
    with open(log, "a") as f:
        f.write(f"{i}\\n")
    if i == 0:
        raise RolloutError("unit 0 failed", exit_code=1)
    if i == 1:
        time.sleep(0.5)  # the driver has seen unit 0 fail by now
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)

if __name__ == "__main__":
    try:
        run_units([(unit, (i, sys.argv[1])) for i in range(12)], EngineOptions(workers=2))
    except RolloutError as error:
        print("failed:", error, flush=True)
    finally:
        close_pools()
"""


def test_a_worker_dying_after_a_unit_failed_does_not_hang_the_run(tmp_path: Path) -> None:
    script, log = tmp_path / "fail_then_die.py", tmp_path / "ran.txt"
    script.write_text(FAIL_THEN_DIE)
    before = set(os.listdir(tempfile.gettempdir()))
    run = subprocess.run(
        [sys.executable, str(script), str(log)],
        capture_output=True,
        text=True,
        timeout=120,  # hung for ever before
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])},
    )
    assert run.stdout.strip() == "failed: unit 0 failed", run.stderr
    assert "InvalidStateError" not in run.stderr
    ran = log.read_text().split()
    assert len(ran) <= 4, ran  # the units not started when unit 0 failed skipped themselves
    assert not [name for name in set(os.listdir(tempfile.gettempdir())) - before if name.startswith("rolloutcli-stop")]


@pytest.mark.parametrize(
    ("sig", "code", "said"),
    [(signal.SIGTERM, 143, "terminated"), (signal.SIGHUP, 129, "hangup"), (signal.SIGINT, 130, "interrupted")],
)
def test_a_signal_to_the_whole_job_ends_a_pool_run(runs: Path, tmp_path: Path, sig: int, code: int, said: str):
    """A scheduler's SIGTERM, a closed terminal's SIGHUP, Ctrl-C: to the driver and its pool at once (the process
    group), while the workers are mid-write. The command ends with the signal's code and one line, nothing is
    published, and no process of the job is left."""
    out = tmp_path / "out"
    process = _paused_job(["gae", str(runs), "-o", str(out), "--workers", "2"], pause=300)
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        assert line.startswith("rolloutcli: test pause after block 1"), line
        time.sleep(0.3)  # the other worker reaches its pause too, or is still writing
        os.killpg(process.pid, sig)
        process.wait(timeout=60)  # hung for ever before (SIGTERM, SIGHUP)
        rest = process.stderr.read().splitlines()
    finally:
        _kill_group(process.pid)
    lines = [text for text in rest if not text.startswith("rolloutcli: test pause after block 1")]
    assert (process.returncode, lines) == (code, [f"{said}: no output was written (temporary files removed)."]), rest
    assert not out.exists()
    partial = partial_folder(out)  # kept for --resume, without what the workers were writing
    assert not [p.name for p in partial.rglob("*") if TEMP_MARKER in p.name]


def _paused_job(args: list[str], pause: float) -> subprocess.Popen:
    """``rolloutcli ARGS`` in a process group of its own, every unit pausing ``pause`` s after its first block."""
    return subprocess.Popen(
        [sys.executable, "-m", "rolloutcli", *args],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, TEST_PAUSE_ENV: str(pause)},
    )


def _kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_signal_after_finished_files_names_the_partial_folder(runs: Path, tmp_path: Path) -> None:
    """SIGTERM once some files of a dataset are done: the command says nothing was published and where the
    finished outputs are kept for --resume (it said "no output was written (temporary files removed)" while the
    partial folder stayed, and a plain rerun was then refused); --resume finishes the same bytes."""
    out = tmp_path / "out"
    process = _paused_job(["gae", str(runs), "-o", str(out)], pause=0.2)
    try:
        assert process.stderr is not None
        for _ in range(3):  # the third unit has started: the first two files are done
            line = process.stderr.readline()
            assert line.startswith("rolloutcli: test pause after block 1"), line
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
        rest = [text for text in process.stderr.read().splitlines() if not text.startswith("rolloutcli: test pause")]
    finally:
        _kill_group(process.pid)
    partial = partial_folder(out)
    said = f"terminated: nothing was published; the finished outputs are kept in {partial} (--resume continues)."
    assert (process.returncode, rest) == (143, [said])
    assert not out.exists() and {"r0.h5", "r1.h5"} <= {p.name for p in partial.iterdir()}
    done = subprocess.run(
        [sys.executable, "-m", "rolloutcli", "gae", str(runs), "-o", str(out), "--resume"], capture_output=True
    )
    assert done.returncode == 0, done.stderr
    whole = subprocess.run([sys.executable, "-m", "rolloutcli", "gae", str(runs), "-o", str(tmp_path / "whole")])
    assert whole.returncode == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {
        p.name: p.read_bytes() for p in (tmp_path / "whole").iterdir()
    }


PAUSED = "rolloutcli: test pause after block 1"


def test_a_pool_worker_killed_mid_unit_exits_3_and_resume_gives_the_same_bytes(runs: Path, tmp_path: Path, cli):
    """SIGKILL to one worker of a local pool while it writes its unit's output (the OOM killer, ``kill -9``),
    once a file is done: exit 3 with one line, nothing published, no process of the command left (workers, their
    process server, the probe helper); ``--resume`` keeps the finished file (also when the other worker's earlier
    unit, cut short by the pool's end, comes first), drops the dead unit's temporary and finishes the bytes of one
    worker."""
    out = tmp_path / "out"
    process = _paused_job(["gae", str(runs), "-o", str(out), "--workers", "2"], pause=2)
    try:
        assert process.stderr is not None
        lines: list[str] = []
        while len(lines) < 3:  # the third unit has started: a worker finished its first file, whichever it was
            line = process.stderr.readline()
            assert line.startswith(PAUSED), line
            if f"(pid {process.pid}," not in line:  # the driver's own progress pauses once too
                lines.append(line)
        started = _descendants(process.pid)
        pid = lines[2].split("(pid ", 1)[1].split(",", 1)[0]
        os.kill(int(pid), signal.SIGKILL)  # in its unit's pause
        finished = next(line for line in lines[:2] if f"(pid {pid}," in line).split("writing .", 1)[1].split(".h5")[0]
        process.wait(timeout=60)
        rest = [text for text in process.stderr.read().splitlines() if not text.startswith(PAUSED)]
    finally:
        _kill_group(process.pid)
    died = "--engine local: a worker process died (out of memory or killed); nothing was published."
    assert process.returncode == 3 and len(rest) == 1 and died in rest[0], rest
    assert _still_running(started) == []
    assert not out.exists() and f"{finished}.h5" in os.listdir(partial_folder(out))  # even when it was not r0
    assert cli("gae", runs, "-o", out, "--resume", "--workers", 2)[0] == 0
    assert cli("gae", runs, "-o", tmp_path / "one")[0] == 0
    assert _files(out) == _files(tmp_path / "one")


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _descendants(pid: int) -> set[int]:
    """The processes ``pid`` started, and the ones they started (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _still_running(pids: set[int], within: float = 30.0) -> list[int]:
    """Those of ``pids`` still running (not zombies) after waiting up to ``within`` seconds for them to end."""
    deadline = time.monotonic() + within
    while True:
        running = []
        for pid in sorted(pids):
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                running.append(pid)
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


def _die() -> None:
    os._exit(1)


def test_a_pool_broken_before_submitting_is_reported_as_a_dead_worker() -> None:
    """A worker that died before the next step's units are submitted (a pool already broken): submit raises
    BrokenProcessPool, which is the one-line exit 3 of a dead worker, not a traceback (newcomer trial)."""
    from rolloutcli.errors import RolloutError
    from rolloutcli.pipeline import engine

    options = engine.EngineOptions(workers=2)
    try:
        with pytest.raises(RolloutError, match="a worker process died"):
            engine.run_units([(_die, ())] * 2, options)
        pool = engine._pool(2, [])  # kept for the next step, as the map step's pool is for the reduce step
        pool.submit(_die).exception()
        with pytest.raises(RolloutError, match="a worker process died") as failed:
            engine.run_units([(os.getpid, ())] * 2, options)
        assert failed.value.exit_code == 3
    finally:
        engine.close_pools()


def _stuck(started: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(started).write_text(str(os.getpid()))
    time.sleep(60)


def test_closing_the_pools_ends_a_worker_that_does_not_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that does not end when the pool shuts down (after a SIGTERM to the whole job, one waited for
    ever on a queue lock a dead worker held) is killed after the grace time; the pool's own shutdown waited for
    it for ever (1 in ~30 group SIGTERMs to a newcomer's `batch --workers 2` hung)."""
    from rolloutcli.pipeline import engine

    monkeypatch.setattr(engine, "CLOSE_GRACE_S", 0.5)
    pool = engine._pool(2, [])
    processes = []
    try:
        started = tmp_path / "started"
        future = pool.submit(_stuck, str(started))
        while not started.exists():
            time.sleep(0.01)
        processes = list(pool._processes.values())
    finally:
        engine.close_pools()
    # killed, not waited for: the unit sleeps 60 s, and the old shutdown waited until it ended (exit code 0);
    # the pool's manager thread may read the status first, and the process then says 255
    stuck = [p for p in processes if p.pid == int(started.read_text())]
    assert len(stuck) == 1 and stuck[0].exitcode in (-signal.SIGKILL, 255)
    assert future.done()
