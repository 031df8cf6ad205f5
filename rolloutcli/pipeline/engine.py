"""Engines: run a list of work units (pure functions of their arguments) and return their results in order.

``local`` runs them in this process (``workers=1``) or on a pool of K processes; ``ray`` submits each as a
Ray Core task (``pip install "rolloutcli[ray]"``). A unit writes only where its arguments say and returns plain
data, so a retried unit (a worker that died, Ray's ``max_retries``) gives the same bytes, and the results do not
depend on the engine, the worker count or the order units finish in. The driver publishes last.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import secrets
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from rolloutcli.errors import EXIT_IO, EXIT_USAGE, RolloutError, signals_held, stop_if_signalled
from rolloutcli.pipeline import ray_connect
from rolloutcli.pipeline.preload import server_preload, start_server, start_tracker
from rolloutcli.pipeline.ray_connect import import_ray  # noqa: F401 - the engines' API

ENGINES = ("local", "ray")
RETRIES = 3  # Ray task retries (units are pure: a retry rewrites the same bytes)
RAY_WAIT_S = 0.25  # the driver looks at a noted signal at least this often while Ray's wait blocks

Unit = tuple[Callable[..., Any], tuple[Any, ...]]  # (module-level function, its arguments): picklable
STOP_ENV = "ROLLOUTCLI_STOP_FILE"  # a local pool's failed run: its driver creates this file


@dataclass(frozen=True)
class EngineOptions:
    """``--engine``, ``--workers``, ``--address`` (ray), ``--hdf5-locking`` (None: HDF5's default; False for
    file systems without locks, e.g. NFS: ``HDF5_USE_FILE_LOCKING=FALSE`` while each unit runs; the driver's own
    opens follow the driver's environment)."""

    engine: str = "local"
    workers: int = 1
    address: str | None = None
    hdf5_locking: bool | None = None

    def env(self) -> dict[str, str]:
        """Environment every worker gets."""
        if self.hdf5_locking is None:
            return {}
        return {"HDF5_USE_FILE_LOCKING": "TRUE" if self.hdf5_locking else "FALSE"}


def check_engine(options: EngineOptions) -> None:
    """Refuse combinations the command line cannot (exit 2)."""
    if options.engine not in ENGINES:
        raise RolloutError(f"--engine: expected local or ray, found '{options.engine}'.", exit_code=EXIT_USAGE)
    if options.address is not None and options.engine != "ray":
        raise RolloutError("--address: expected --engine ray with it, found --engine local.", exit_code=EXIT_USAGE)
    if options.workers < 1:
        raise RolloutError(f"--workers: expected at least 1, found {options.workers}.", exit_code=EXIT_USAGE)


@dataclass(frozen=True)
class _Failed:
    """A unit's ``RolloutError`` as plain data (exceptions lose their attributes when pickled)."""

    message: str
    exit_code: int
    problems: tuple[str, ...]


def _call(fn: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str]) -> Any:
    """Run one unit; an ``OSError`` (a flaky file system) is retried up to ``RETRIES`` times, safe because a unit
    rewrites its whole output; a worker that dies is retried by Ray (``max_retries``), fails a local run. A local
    pool's unit does nothing once its run has failed (``STOP_ENV``'s file exists)."""
    if STOP_ENV in env and os.path.exists(env[STOP_ENV]):
        return None
    with _environment(env):
        for attempt in range(RETRIES + 1):
            try:
                return fn(*args)
            except RolloutError as error:
                return _Failed(str(error), error.exit_code, tuple(error.problems))
            except OSError:
                if attempt == RETRIES:
                    raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set while a unit runs (restored after: the unit may run in the driver's own process)."""
    old = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_engine(options: EngineOptions) -> None:
    """Connect to Ray now (``--engine ray``), so an unreachable cluster fails before anything is written."""
    check_engine(options)
    if options.engine == "ray":
        connect_ray(options)


def run_units(units: Sequence[Unit], options: EngineOptions, done: Callable[[int, Any], None] | None = None) -> list:
    """Run ``units``; results in order, or, with ``done``, ``done(i, result)`` called in the driver as each finishes
    (any order) and no result kept (10,000 units' results in the driver for the whole run)."""
    check_engine(options)
    results: list[Any] = [None] * (len(units) if done is None else 0)

    def finished(index: int, result: Any) -> None:
        stop_if_signalled()  # the command's signal, whose exception may have been lost
        if isinstance(result, _Failed):
            raise RolloutError(result.message, exit_code=result.exit_code, problems=result.problems)
        if done is None:
            results[index] = result
        else:
            done(index, result)

    if options.engine == "ray":
        _run_ray(units, options, finished)
    elif options.workers == 1 or len(units) <= 1:
        for index, (fn, args) in enumerate(units):
            finished(index, _call(fn, args, options.env()))
    else:
        _run_pool(units, options, finished)
    return results


_POOLS: dict[int, ProcessPoolExecutor] = {}  # reused by the steps of one command (map, then reduce)


def _pool(workers: int, modules: list[str]) -> ProcessPoolExecutor:
    """A pool of ``workers`` processes forked from a clean server (no driver threads) that imports ``modules``
    once (the first pool's units' modules)."""
    if workers not in _POOLS:
        start_tracker()  # before the server: started by it, the tracker would die with a closed terminal
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(server_preload(modules))
        try:
            start_server()  # here, not from a pool thread: Ctrl-C must be blocked in it while it starts
        except OSError as exc:  # no process to spare (a process limit, no memory)
            raise RolloutError(
                f"--engine local: cannot start the worker processes: {exc.strerror or exc}. Lower --workers.",
                exit_code=EXIT_IO,
            ) from exc
        _POOLS[workers] = ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_signals)
    return _POOLS[workers]


def _worker_signals() -> None:
    """In each pool worker: Ctrl-C, SIGTERM and SIGHUP (to the whole job: a terminal, a scheduler) remove the
    temporary the unit is writing and end the worker quietly, as the command does for its own (SIGTERM's default
    action left the temporaries in the partial folder; Ctrl-C in an idle worker printed a traceback)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _worker_stopped)


def _worker_stopped(signum: int, frame: object) -> None:
    from rolloutcli.hdf5.atomic import remove_live_temporaries

    remove_live_temporaries()
    os._exit(128 + signum)


_WARMING: list[threading.Thread] = []  # prestart's threads starting workers (joined before the pools close)


def prestart(options: EngineOptions, modules: list[str]) -> None:
    """Start the local pool now (``--workers`` > 1): its process server imports ``modules`` (the units'; seconds,
    with torch) and its workers start while this process imports and plans, instead of after. The workers are
    started from a thread: each start waits for the server."""
    if options.engine == "local" and options.workers > 1:
        pool = _pool(options.workers, modules)
        thread = threading.Thread(target=_warm, args=(pool, options.workers), name="rolloutcli-warm", daemon=True)
        thread.start()
        _WARMING.append(thread)


def _warm(pool: ProcessPoolExecutor, workers: int) -> None:
    with contextlib.suppress(Exception):  # a pool that cannot start fails the units that need it, with its reason
        wait([pool.submit(_warm_worker) for _ in range(workers)])


def _warm_worker() -> None:
    """Nothing: submitting it starts a worker (they probe files through the driver's helper: ``_run_pool``)."""


CLOSE_GRACE_S = 5.0  # an idle worker, or a cancelled Ray task, ends within this once told to; else it is killed


def close_pools() -> None:
    """Shut the local pools down (a command calls it when its units are done: idle workers must not outlive it).
    A worker still alive ``CLOSE_GRACE_S`` after being told to end is killed: after a signal to the whole job, a
    worker started as another died can wait for ever on a queue lock the dead one held, and the pool's own
    shutdown then waited for it for ever (1 in ~30 group SIGTERMs to ``batch --workers 2``)."""
    while _WARMING:
        _WARMING.pop().join(CLOSE_GRACE_S)  # a daemon thread; its futures end when the pool is shut
    while _POOLS:
        _shut(_POOLS.popitem()[1])
    ray_connect.shutdown()  # a local Ray cluster the command started, with its processes


def _shut(pool: ProcessPoolExecutor) -> None:
    processes = _workers(pool)  # the pool drops them in shutdown
    manager = pool._executor_manager_thread
    pool.shutdown(wait=False, cancel_futures=True)
    _end(processes, CLOSE_GRACE_S)
    if manager is not None:
        manager.join()  # returns now: every worker it joins has ended


def _workers(pool: ProcessPoolExecutor) -> list[Any]:
    with contextlib.suppress(RuntimeError):  # the pool's manager thread may change its table meanwhile
        return list((pool._processes or {}).values())
    return []


def _end(processes: list[Any], grace: float) -> None:
    """Wait up to ``grace`` seconds in all for ``processes`` to end; kill those that have not."""
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join()


def _live_workers() -> list[Any]:
    return [process for pool in list(_POOLS.values()) for process in _workers(pool) if process.exitcode is None]


def signal_workers(signum: int) -> None:
    """Pass the command's signal on to the local pools' workers (the command's signal handler calls it): they
    remove what they are writing and end, so the run stops now, not when their units would have ended."""
    for process in _live_workers():
        with contextlib.suppress(OSError):
            os.kill(process.pid, signum)


def kill_workers() -> None:
    """End every worker of the local pools: SIGTERM (each removes its temporary), then SIGKILL after a moment."""
    workers = _live_workers()
    signal_workers(signal.SIGTERM)
    _end(workers, 1.0)


def unit_modules(units: Sequence[Unit]) -> list[str]:
    """The modules of the units' functions and of the functions they take as arguments (a wrapped unit)."""
    functions = [f for fn, args in units for f in (fn, *args) if callable(f) and hasattr(f, "__module__")]
    return sorted({f.__module__ for f in functions if isinstance(f.__module__, str)})


AHEAD_PER_WORKER = 4  # units in flight a local worker or a Ray cluster CPU (the local pool: ahead of the oldest)


def _run_pool(units: Sequence[Unit], options: EngineOptions, finished: Callable[[int, Any], None]) -> None:
    """The units on the local pool, at most ``AHEAD_PER_WORKER`` per worker submitted at a time (a future per
    unit of 10,000 held their arguments and results in the driver). On a failure (a unit's, a signal's) the units
    submitted and not yet started are skipped through a stop file, not cancelled: Python 3.11's pool, when a
    worker then dies (a SIGTERM to the whole job), raises in its manager thread on a cancelled future and the wait
    for the running units never ends (CPython gh-107219, fixed in 3.12)."""
    from rolloutcli.hdf5.probe import shared_env

    workers = options.workers  # the pool prestart started, if it did
    pool = _pool(workers, unit_modules(units))
    stop = os.path.join(tempfile.gettempdir(), f"rolloutcli-stop-{os.getpid()}-{secrets.token_hex(8)}")
    env = {**options.env(), **shared_env(), STOP_ENV: stop}  # the workers ask this process's metadata probe helper
    futures: dict[Future[Any], int] = {}  # submitted, not yet finished, in submission order
    completed = False
    try:  # a pool broken before or while the units are submitted raises in submit
        for i, (fn, args) in enumerate(units):
            futures[pool.submit(_call, fn, args, env)] = i
            if len(futures) >= workers * AHEAD_PER_WORKER:
                _finish_oldest(futures, finished)
        while futures:  # in submission order: a failure is the first failing unit's
            _finish_oldest(futures, finished)
        completed = True
    except BrokenProcessPool as exc:
        _POOLS.pop(workers, None)
        stop_if_signalled()  # a signal to the whole job: its workers died of it, maybe before this process saw it
        _keep_finished(futures, finished)
        raise RolloutError(
            "--engine local: a worker process died (out of memory or killed); nothing was published. "
            "Rerun with --resume to continue.",
            exit_code=EXIT_IO,
        ) from exc
    finally:  # on a failure, let running units end before the caller removes the folder they write into
        if not completed:
            _stop(stop, list(futures))
        wait(list(futures))
        with contextlib.suppress(OSError):
            os.unlink(stop)


def _keep_finished(futures: dict[Future[Any], int], finished: Callable[[int, Any], None]) -> None:
    """Pass on the units that finished before the pool broke, whatever their order: an earlier unit, killed with
    its worker, fails first, and their outputs were dropped (``--resume`` then redid them)."""
    wait(list(futures))  # a broken pool's workers are ended: every future is done
    for future, index in list(futures.items()):
        if not future.cancelled() and future.exception() is None:
            with contextlib.suppress(RolloutError):  # a unit's own failure: this error is the worker's death
                finished(index, future.result())
            del futures[future]


def _finish_oldest(futures: dict[Future[Any], int], finished: Callable[[int, Any], None]) -> None:
    future = next(iter(futures))
    finished(futures[future], future.result())
    del futures[future]  # after ``finished``: a failure still waits for it below


def _stop(path: str, futures: Iterable[Future[Any]]) -> None:
    """Have the units not yet started skip themselves (cancelled, where the stop file cannot be made)."""
    try:
        with open(path, "x"):
            pass
    except OSError:
        for future in futures:
            future.cancel()


def connect_ray(options: EngineOptions) -> Any:
    """``ray`` connected to ``--address`` (or a new local cluster, the command's own: ``close_pools`` ends it)."""
    return ray_connect.connect(options.address, options.env())


def _run_ray(units: Sequence[Unit], options: EngineOptions, finished: Callable[[int, Any], None]) -> None:
    """The units as Ray tasks. On a failure (a unit's, a task's past its retries, a signal) the tasks not done are
    cancelled and have ended (``ray_connect.end_tasks``: killed after ``CLOSE_GRACE_S``) before the caller removes
    or keeps the folder they write into; they ran on after the command had failed."""
    ray = connect_ray(options)
    task = ray.remote(max_retries=RETRIES, scheduling_strategy="SPREAD")(ray_connect.interruptible(_call))
    # at most AHEAD_PER_WORKER tasks a cluster CPU in flight: a ref and its arguments per unit of 10,000 were held
    # in the driver (and in Ray's object store) for the whole run
    window = max(1, int(ray.cluster_resources().get("CPU", 1))) * AHEAD_PER_WORKER
    todo = iter(enumerate(units))
    index: dict[Any, int] = {}  # the tasks in flight -> their unit
    try:
        while True:
            for i, (fn, args) in itertools.islice(todo, max(0, window - len(index))):
                index[task.remote(fn, args, options.env())] = i
            if not index:
                break
            with signals_held():  # Ray's wait runs the handler itself, and broke when it raised
                ready, _ = ray.wait(list(index), num_returns=1, timeout=RAY_WAIT_S)
            stop_if_signalled()
            for ref in ready:
                try:
                    with signals_held():
                        result = ray.get(ref)
                except ray.exceptions.RayError as exc:  # a task that failed past its retries, or a lost node
                    raise RolloutError(
                        f"--engine ray: a task failed past {RETRIES} retries ({type(exc).__name__}); nothing was "
                        "published. Rerun with --resume to continue.",
                        exit_code=EXIT_IO,
                    ) from exc
                finished(index.pop(ref), result)
    except BaseException:
        with signals_held():
            ray_connect.end_tasks(ray, list(index), CLOSE_GRACE_S)
        raise
