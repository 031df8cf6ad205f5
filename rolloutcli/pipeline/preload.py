"""What a command's local pool imports before its first unit, known from the command line alone.

``rolloutcli``'s entry point calls :func:`start_early` before it imports typer, rich and the command: a command
that will run a local pool (``--workers`` > 1, ``--engine local``, and for the per-file commands a dataset) has
its pool's process server started at once, so the server's imports (the units' modules; torch for ``batch``) run
on the second CPU while this process imports, instead of after (figures: benchmarks/README.md). The command's
own ``engine.prestart`` later finds the server running. A guess that is wrong costs only that start: the pool,
when one is made, still imports whatever its units need. This module imports nothing heavy.
"""

from __future__ import annotations

import atexit
import glob
import os
import signal
import sys

from rolloutcli.pipeline import lifeline

PER_FILE = "rolloutcli.pipeline.dataset_job"  # the per-file commands' dataset job wraps every unit
PRELOAD: dict[str, tuple[str, ...]] = {  # command -> the modules its pool's units run (tests check them)
    "gae": (PER_FILE, "rolloutcli.pipeline.gae"),
    "split": (PER_FILE, "rolloutcli.pipeline.split"),
    "returns": (PER_FILE, "rolloutcli.pipeline.returns"),
    "nstep": (PER_FILE, "rolloutcli.pipeline.nstep"),
    "batch": ("rolloutcli.pipeline.parallel_export",),
}


def _option(args: list[str], name: str) -> str | None:
    """The last value given to ``name`` (``--name V`` or ``--name=V``), else None."""
    value = None
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _dataset(args: list[str]) -> bool:
    """Whether the arguments look like a dataset: a directory, a glob, or several existing files."""
    files = 0
    for arg in args:
        if arg.startswith("-"):
            continue
        if glob.has_magic(arg) or os.path.isdir(arg):
            return True
        files += os.path.isfile(arg)
    return files > 1


def pool_modules(args: list[str]) -> tuple[str, ...]:
    """The modules to preload when ``args`` (``sys.argv[1:]``) run a local pool; empty when they do not."""
    command = args[0] if args else ""
    workers = _option(args, "--workers")
    if command not in PRELOAD or not (workers or "").isdigit() or int(workers or 0) < 2:
        return ()
    if (_option(args, "--engine") or "local") != "local" or "--help" in args:
        return ()
    if command != "batch" and not _dataset(args[1:]):  # one file runs in this process
        return ()
    return PRELOAD[command]


def start_early(args: list[str]) -> bool:
    """Start the pool's process server now with the modules ``args`` call for; whether it was started."""
    modules = pool_modules(args)
    if not modules:
        return False
    import multiprocessing
    import multiprocessing.forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(server_preload(modules))
    try:
        start_tracker()
        start_server()
    except OSError:  # no process to spare now: the command's own pool start reports it, with its reason
        return False
    return True


def start_server() -> None:
    """Start multiprocessing's process server with Ctrl-C blocked in it until it ignores it (this module's
    import there, below). Python's server ignores SIGINT only once its imports are done: a Ctrl-C to the whole
    job while it started or imported torch printed its traceback, or a 'Fatal Python error', under the command's
    one line. The signal stays pending in this thread while the server is spawned, so this process still gets it."""
    import threading
    from multiprocessing import forkserver

    # the server dies with this process (lifeline), asked only of the main thread: Linux kills it when the thread
    # that started it ends, and a library caller's thread may end before the pool is done
    main = threading.current_thread() is threading.main_thread()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    if main:
        os.environ[lifeline.PARENT_ENV] = str(os.getpid())
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(lifeline.PARENT_ENV, None)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def start_tracker() -> None:
    """Start multiprocessing's resource tracker (the pool's server starts it, else) with SIGHUP blocked in it.
    Python 3.11's tracker ignores SIGINT and SIGTERM only: a closed terminal killed it, and the command, cleaning
    up its pool, started another with a warning of three lines on stderr. The signal stays pending in this
    thread while the tracker is spawned, so this process still gets it.

    The tracker runs with its warnings off (``-W``, which it takes from ``sys.warnoptions``): when a signal to the
    whole job kills a worker holding a queue's lock, it warned of 'leaked semaphore objects' on the command's
    stderr, under the command's one line, and then cleaned them up as it should."""
    from multiprocessing import resource_tracker

    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    sys.warnoptions.append(TRACKER_QUIET)
    try:
        resource_tracker.ensure_running()
    finally:
        sys.warnoptions.remove(TRACKER_QUIET)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


TRACKER_QUIET = "ignore::UserWarning"


def server_preload(modules: tuple[str, ...] | list[str]) -> list[str]:
    """The process server's preload for a pool whose units run ``modules``: this module first (below)."""
    return [__name__, *modules]


def _in_process_server() -> bool:
    """Whether this import runs in multiprocessing's process server (its ``main`` is on the stack). Elsewhere
    the server's module is usually not even imported (importing it costs the command's start ~25 ms)."""
    server = sys.modules.get("multiprocessing.forkserver")
    if server is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is server.main.__code__:
            return True
        frame = frame.f_back
    return False


def _end_server() -> None:
    os._exit(0)


_FORKED = False  # in a worker: it has asked to die with the server (its own children do not ask)


def _worker_forked() -> None:
    """In each worker, just forked by the server: die with the server (whose only thread forked it), so with
    the command (see ``lifeline``)."""
    global _FORKED
    if not _FORKED:
        _FORKED = True
        lifeline.die_with_parent(SERVER)


# In the process server only: end with os._exit when the command is gone. Its interpreter shutdown with the
# units' modules imported (torch for batch) took 0.3-0.75 s after the command had finished, with the command's
# stdout and stderr still open in it (a pipe reading them waited that long). The server has nothing to flush or
# clean up; its children (the workers) end with os._exit already and never run atexit functions.
IN_SERVER = _in_process_server()  # also True in the workers, which the server forks after its imports
SERVER = os.getpid()  # in the process server (and its workers, forked after this import): the server's pid
if IN_SERVER:
    atexit.register(_end_server)
    _COMMAND = lifeline.parent_from_env()
    if _COMMAND is not None:  # the command's main thread started the server: end with it, however it ends
        lifeline.die_with_parent(_COMMAND)
        os.register_at_fork(after_in_child=_worker_forked)
    # Ctrl-C (blocked since the server's start: start_server) is the command's to handle; each worker handles
    # its own (engine._worker_signals).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
