"""A signal the command got stops it before it publishes, wherever the handler's exception went.

A newcomer's trial sent signals in the first second of a run, while torch and numpy were still importing: some
runs ignored SIGTERM and published (exit 0), some noted SIGINT but still published (exit 130 "already
published"), some ended in a traceback (``module 'numpy' has no attribute 'matrix'``: the handler's exception
raised inside an import left numpy half-imported), and a Ctrl-C to the whole job printed the pool's process
server's traceback under the command's one line.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
import weakref
from pathlib import Path

import pytest
from conftest import SAMPLE

from rolloutcli.cli import signals as cli_signals
from rolloutcli.errors import (
    EXIT_TERMINATED,
    Signalled,
    forget_signal,
    note_signal,
    signal_code,
    stop_if_signalled,
)


@pytest.fixture(autouse=True)
def _no_signal_left() -> None:
    forget_signal()
    yield
    forget_signal()


def test_a_signal_inside_an_import_is_held_back_to_the_next_stop_point(tmp_path: Path, monkeypatch) -> None:
    """Raised inside an import, the exception leaves half-imported modules behind; the handler notes it and
    returns there, and the command's next stop point raises it."""
    (tmp_path / "signalled_while_imported.py").write_text(
        "import signal, sys\n"
        "from rolloutcli.cli import signals as cli_signals\n"
        "cli_signals.on_signal(signal.SIGTERM, sys._getframe())\n"
        "COMPLETE = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("signalled_while_imported")
    assert module.COMPLETE and signal_code() == EXIT_TERMINATED
    with pytest.raises(Signalled) as stopped:
        stop_if_signalled()
    assert stopped.value.code == EXIT_TERMINATED
    forget_signal()
    with pytest.raises(Signalled):  # outside an import it raises at once
        cli_signals.on_signal(signal.SIGTERM, sys._getframe())


def test_a_signal_whose_exception_was_lost_publishes_nothing(tmp_path: Path, cli, monkeypatch) -> None:
    """The handler's exception raised inside a weakref callback is lost (Python prints 'Exception ignored' and
    goes on): the run must still publish nothing, exit 143, and print only its one line."""
    import rolloutcli.pipeline.gae as gae_pipeline

    real = gae_pipeline.gae_arrays

    class Anything:
        pass

    def lost(*args, **kwargs):
        note_signal(EXIT_TERMINATED)  # what the handler does before it raises
        thing = Anything()
        weakref.finalize(thing, _raise_signalled)
        del thing  # the finalizer's exception cannot be passed on: Python reports it as unraisable
        return real(*args, **kwargs)

    monkeypatch.setattr(gae_pipeline, "gae_arrays", lost)
    code, _, err = cli("gae", SAMPLE, "-o", tmp_path / "out.h5")
    assert code == EXIT_TERMINATED
    assert err.strip() == "terminated: no output was written (temporary files removed)."
    assert os.listdir(tmp_path) == []


def _raise_signalled() -> None:
    raise Signalled(EXIT_TERMINATED)


def _die() -> None:
    os._exit(1)


def test_workers_killed_by_the_jobs_signal_report_the_signal() -> None:
    """A SIGTERM to the whole job can kill the workers before this process runs its handler: the broken pool is
    the signal (exit 143), not 'a worker process died' (exit 3)."""
    from rolloutcli.pipeline import engine

    note_signal(EXIT_TERMINATED)
    try:
        with pytest.raises(Signalled):
            engine._run_pool([(_die, ())] * 2, engine.EngineOptions(workers=2), lambda i, r: None)
    finally:
        engine.close_pools()


def test_ctrl_c_while_the_pool_server_imports_is_ignored_there(capfd) -> None:
    """The process server ignores Ctrl-C only after its imports in Python 3.11; a Ctrl-C to the whole job while
    it imported torch killed it with a traceback on the command's stderr. It is blocked there until then."""
    from multiprocessing import forkserver

    from rolloutcli.pipeline import engine

    try:
        pool = engine._pool(2, ["torch"])  # the server imports torch: a second or so
        os.kill(forkserver._forkserver._forkserver_pid, signal.SIGINT)
        assert pool.submit(os.getpid).result(timeout=120) > 0
        time.sleep(0.2)
    finally:
        engine.close_pools()
    assert "Traceback" not in capfd.readouterr().err


def test_the_signals_lost_exception_is_not_reported_as_unraisable() -> None:
    """Python would print 'Exception ignored in: ...' and a traceback under the command's one line."""
    from types import SimpleNamespace

    seen = []
    hook = cli_signals.quiet_unraisable(seen.append)
    hook(SimpleNamespace(exc_value=ValueError("other")))
    note_signal(EXIT_TERMINATED)
    hook(SimpleNamespace(exc_value=Signalled(EXIT_TERMINATED)))
    hook(SimpleNamespace(exc_value=KeyboardInterrupt()))
    hook(SimpleNamespace(exc_value=ValueError("still reported")))
    assert [str(info.exc_value) for info in seen] == ["other", "still reported"]


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_an_output_is_not_published_once_a_signal_was_noted(tmp_path: Path, kind: str) -> None:
    from rolloutcli.hdf5.atomic import atomic_file, atomic_folder

    atomic = atomic_file if kind == "file" else atomic_folder
    with pytest.raises(Signalled):
        with atomic(tmp_path / "out") as tmp:
            note_signal(EXIT_TERMINATED)  # the handler's exception lost while the output was written
            (tmp / "shard.h5" if kind == "folder" else tmp).write_bytes(b"data")
    assert os.listdir(tmp_path) == []


LEAK = """
import multiprocessing, os, sys
from rolloutcli.pipeline.preload import start_tracker
start_tracker()
lock = multiprocessing.get_context("forkserver").Lock()  # registered with the tracker, as a pool's queue locks
os._exit(0)  # as the command ends; after a signal killed a worker, a queue's lock can be left registered
"""


def test_the_resource_tracker_keeps_quiet_about_what_it_cleans_up() -> None:
    import subprocess

    from promises import child_env

    run = subprocess.run([sys.executable, "-c", LEAK], capture_output=True, text=True, env=child_env(), timeout=60)
    time.sleep(0.5)  # the tracker cleans up once this process is gone
    assert run.returncode == 0 and run.stderr == ""


@pytest.mark.parametrize(("sig", "code", "what"), [(signal.SIGTERM, 143, "terminated"), (signal.SIGHUP, 129, "hangup")])
def test_a_signal_while_python_starts_up_is_one_line(sig: int, code: int, what: str) -> None:
    """Before the command line's handlers are in place (typer and rich importing), SIGTERM killed the process
    silently and SIGHUP too; now they end with their exit code and one line, as Ctrl-C did."""
    import subprocess

    from promises import child_env

    script = (
        "import builtins, os, signal\n"
        "real = builtins.__import__\n"
        "def signalled(name, *args, **kwargs):\n"
        "    if name == 'rolloutcli.cli.app':\n"
        f"        os.kill(os.getpid(), {int(sig)})\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = signalled\n"
        "from rolloutcli.__main__ import run\n"
        "run()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child_env())
    assert (result.returncode, result.stderr) == (code, f"{what}: no output was written.\n")


def test_the_signal_is_forgotten_when_the_command_returns(tmp_path: Path, cli, monkeypatch) -> None:
    """An embedding program (tests, a notebook) calls the library after ``main(argv)`` returned: a signal that
    stopped the command must not stop the next library call's publish."""
    import rolloutcli.pipeline.gae as gae_pipeline
    from rolloutcli.hdf5.atomic import atomic_file

    real = gae_pipeline.gae_arrays

    def signalled(*args, **kwargs):
        note_signal(EXIT_TERMINATED)
        return real(*args, **kwargs)

    monkeypatch.setattr(gae_pipeline, "gae_arrays", signalled)
    assert cli("gae", SAMPLE, "-o", tmp_path / "out.h5")[0] == EXIT_TERMINATED
    with atomic_file(tmp_path / "later.bin") as tmp:
        tmp.write_bytes(b"published")
    assert (tmp_path / "later.bin").read_bytes() == b"published"


STUCK = """
import os, signal, sys, time
import rolloutcli.pipeline.gae as gae_pipeline
from rolloutcli.cli import app as cli
from rolloutcli.cli import signals as cli_signals

cli_signals.STOP_GRACE_S = 1.0

def stuck(*args, **kwargs):  # a library that swallows every exception, and never returns
    signalled = False
    while True:
        try:
            if not signalled:
                signalled = True
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        except BaseException:
            pass

gae_pipeline.gae_arrays = stuck
sys.argv = ["rolloutcli", "gae", sys.argv[1], "-o", sys.argv[2]]
cli.main()
"""


def test_a_command_that_does_not_stop_after_its_signal_is_ended(tmp_path: Path) -> None:
    """A command stuck after its signal (a library swallowing the exception, a lock a dead worker held) is ended
    by the watchdog ``STOP_GRACE_S`` later: its temporaries removed, the one line, the signal's exit code."""
    import subprocess

    from promises import child_env

    out = tmp_path / "out" / "gae.h5"
    out.parent.mkdir()
    run = subprocess.run(
        [sys.executable, "-c", STUCK, str(SAMPLE), str(out)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,  # for ever before
    )
    assert (run.returncode, run.stderr) == (
        EXIT_TERMINATED,
        "terminated: no output was written (temporary files removed).\n",
    )
    assert os.listdir(out.parent) == []


def test_a_signal_to_the_command_alone_stops_its_workers(tmp_path: Path) -> None:
    """``kill PID`` or ``timeout`` signal the command, not its pool: the workers' running units (paused here for
    300 s) went on to their end before the command could stop. The signal is passed on to them."""
    import subprocess

    from rollout_factory import rollout_arrays, write_rollout
    from test_engine_stops import _kill_group, _paused_job

    from rolloutcli.hdf5.atomic import TEMP_MARKER

    runs = tmp_path / "runs"
    runs.mkdir()
    for i in range(4):
        write_rollout(runs / f"r{i}.h5", rollout_arrays(T=64, N=8, seed=i))
    process = _paused_job(["gae", str(runs), "-o", str(tmp_path / "out"), "--workers", "2"], pause=300)
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        assert line.startswith("rolloutcli: test pause after block 1"), line
        process.send_signal(signal.SIGTERM)  # to the command only
        process.wait(timeout=100)  # 300 s before
        rest = [text for text in process.stderr.read().splitlines() if not text.startswith("rolloutcli: test pause")]
    except subprocess.TimeoutExpired:
        pytest.fail("the command waited for its workers' units")
    finally:
        _kill_group(process.pid)
    assert (process.returncode, rest) == (
        EXIT_TERMINATED,
        ["terminated: no output was written (temporary files removed)."],
    )
    assert not [p for p in tmp_path.rglob("*") if TEMP_MARKER in p.name]
