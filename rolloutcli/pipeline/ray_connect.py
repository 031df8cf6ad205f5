"""``--engine ray``'s connection: to the cluster at ``--address``, or to a local cluster the command starts itself.

``ray.init`` replaces the process's SIGTERM handler with its own: Python's (``sys.exit(15)``) and, below
Python, its core worker's (a C++ handler that printed a stack and aborted): the command exited 15 or -6 with
no ``terminated:`` line, its temporaries left in place. So the handlers in place before ``ray.init`` (the
command's: exit 143, the line, temporaries removed) are put back once it returns. A local cluster the command
started is its own, and so are its processes (GCS, raylet, workers, agents): ``shutdown`` ends them when the
command's units are done, failed or stopped; a cluster at ``--address``, or a Ray the embedding program had
initialised, is left as it was.

Ray retries an absent cluster for minutes and writes its own log lines and tracebacks on stderr while it does
(its C++ core writes to the process's stderr itself): the address (``--address``, or ``RAY_ADDRESS`` where Ray
takes it over ``auto``) is probed first, within ``RAY_TIMEOUT_S``, and whatever Ray writes while it connects
goes to a temporary file, dropped, so only our line reaches the user.

A unit's task that is cancelled must end before the command removes or keeps the folder it writes into
(``end_tasks``); Ray interrupts it through its SIGINT handler, which its worker may lack (``interruptible``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

from rolloutcli.errors import EXIT_IO, EXIT_USAGE, RolloutError, signals_held, stop_if_signalled

RAY_INSTALL = 'pip install "rolloutcli[ray]"'
RAY_TIMEOUT_S = 10.0  # an unreachable --address is reported within this
RAY_ADDRESS_ENV = "RAY_ADDRESS"  # Ray connects there instead of --address auto
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_OWNED: list[Any] = []  # the ray module, when this process's ``connect`` initialised it (its to shut down)


def import_ray() -> Any:
    """``ray``, or exit 2 saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise RolloutError(
            f"--engine ray: expected Ray to be installed, found none. Install it: {RAY_INSTALL}", exit_code=EXIT_USAGE
        ) from exc
    return ray


def _unreachable(address: str, why: object) -> RolloutError:
    return RolloutError(
        f"{address}: cannot reach the Ray cluster ({why}). Check --address (auto, host:6379, ray://host:10001) "
        "and that the cluster runs.",
        exit_code=EXIT_IO,
    )


def _target(address: str | None) -> tuple[str, str] | None:
    """``(address Ray will connect to, how the message names it)``; None where Ray starts a local cluster, or finds
    one itself (``auto`` without ``RAY_ADDRESS``: Ray fails at once when it finds none)."""
    env = os.environ.get(RAY_ADDRESS_ENV, "")
    if address == "auto" and env:  # Ray takes RAY_ADDRESS over auto
        return env, f"{RAY_ADDRESS_ENV}={env}"
    if address in (None, "auto"):
        return None
    return address, address


def _probe(address: str, named: str) -> None:
    """Connect to ``host:port`` within ``RAY_TIMEOUT_S``: Ray itself retries an absent cluster for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=RAY_TIMEOUT_S):
            pass
    except ValueError:
        raise _unreachable(named, "expected host:port") from None
    except OSError as exc:
        raise _unreachable(named, exc.strerror or exc) from exc


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """The process's stderr (file descriptor 2, which Ray's C++ core writes to) into a dropped temporary file."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def connect(address: str | None, env: dict[str, str]) -> Any:
    """``ray`` connected to ``address`` (None: a new local cluster), each worker given ``env``; unreachable:
    exit 3 naming the address. This process's signal handlers are the same after as before."""
    ray = import_ray()
    target = _target(address)
    if target is not None:
        _probe(*target)
    if ray.is_initialized():
        return ray
    runtime = {"env_vars": env} if env else None
    _OWNED.append(ray)  # before: a signal inside ray.init may leave a local cluster half started
    with _handlers_kept(ray), signals_held():  # a signal meanwhile: raised once ray.init returned
        try:
            with _quiet_stderr():
                if address is None:
                    with _own_cluster_env():  # "local": a new cluster, even where `ray start` left its address
                        ray.init(address="local", include_dashboard=False, runtime_env=runtime, log_to_driver=False)
                else:
                    ray.init(address=address, runtime_env=runtime, log_to_driver=False)
        except (ConnectionError, TimeoutError) as exc:
            named = target[1] if target is not None else str(address)
            raise _unreachable(named, str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    stop_if_signalled()
    return ray


# A local cluster's processes take this from their environment (Ray reads RAY_<setting>). Its agents, once the
# raylet is gone (the command SIGKILLed: Linux kills its GCS and raylet with it), report that to the GCS, which is
# gone too, and retried it for Ray's default 60 s; with this they end within a few seconds. A local GCS that is
# gone does not come back: nothing waits for it in vain.
OWN_CLUSTER_ENV = {"RAY_gcs_rpc_server_reconnect_timeout_s": "2"}


@contextlib.contextmanager
def _own_cluster_env() -> Any:
    """``OWN_CLUSTER_ENV`` (where not set already) while the local cluster starts: its processes inherit it."""
    added = {key: value for key, value in OWN_CLUSTER_ENV.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextlib.contextmanager
def _handlers_kept(ray: Any) -> Any:
    """Keep this process's handlers of ``SIGNALS`` through the block: Ray's way of setting its own is made to do
    nothing meanwhile (a private function: a signal during ``ray.init``, seconds for a local cluster, then finds
    the command's), and what was replaced all the same is put back after. Only the main thread has handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    setter = getattr(utils, "set_sigterm_handler", None)
    if setter is not None:
        utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if setter is not None:
            utils.set_sigterm_handler = setter
        for sig, handler in handlers.items():  # set again even where Python still names it: Ray's core worker
            if handler is not None:  # replaced SIGTERM's below Python (a C++ handler that aborted, exit -6)
                signal.signal(sig, handler)


def shutdown() -> None:
    """Disconnect from the Ray this process initialised: a local cluster it started ends with its processes
    (Ray's ``shutdown`` kills only the processes this process started). Signals are ignored meanwhile: a second
    Ctrl-C must not leave half of the cluster running."""
    while _OWNED:
        ray = _OWNED.pop()
        main = threading.current_thread() is threading.main_thread()
        handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in SIGNALS} if main else {}
        try:
            with contextlib.suppress(Exception):  # a cluster already gone: nothing of it left to end
                _shutdown(ray)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


def _shutdown(ray: Any) -> None:
    try:
        ray.shutdown(wait_for_processes=True)  # returns once its GCS and raylet ended (the raylet ends its workers)
    except TypeError:  # an older Ray: no waiting
        ray.shutdown()


def interruptible(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a Ray task's function that ``ray.cancel`` interrupts (KeyboardInterrupt: it removes what it
    writes). Ray interrupts a running task with ``_thread.interrupt_main()``, which does nothing where SIGINT is
    ignored, and a cluster started with SIGINT ignored (``ray start`` in a script's background job, where the
    shell ignores it; a test run started so) has workers that inherit that: a cancelled task ran on to its end,
    writing into the folder the failed command was removing. (A closure: cloudpickle sends ``fn`` with it, as
    the driver sees it.)"""

    def task(*args: Any) -> Any:
        with _sigint_handled():
            return fn(*args)

    return task


@contextlib.contextmanager
def _sigint_handled() -> Iterator[None]:
    """Python's SIGINT handler (KeyboardInterrupt) through the block where SIGINT is ignored or left to the
    system; the process's own is put back after (an idle worker is as Ray made it)."""
    inert = (signal.SIG_IGN, signal.SIG_DFL)
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) not in inert:
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def end_tasks(ray: Any, refs: list[Any], grace: float) -> None:
    """Cancel the tasks of ``refs`` and return once each has ended, or after ``2 * grace`` seconds at most.

    Ray resolves a running task's ref only when the task has returned (its ``finally`` blocks, which remove
    what it writes, have run); a task not yet started is dropped at once. A running task is interrupted
    (``interruptible``); one still running ``grace`` seconds later (it holds the interrupt back, or is inside a
    C call that does not return) is killed with its worker (``force``: what it wrote stays as a temporary,
    which a ``--resume`` removes) and waited for up to ``grace`` seconds more."""
    if not refs:
        return
    for ref in refs:
        ray.cancel(ref)
    _, running = ray.wait(refs, num_returns=len(refs), timeout=grace, fetch_local=False)
    for ref in running:
        ray.cancel(ref, force=True)
    if running:
        ray.wait(running, num_returns=len(running), timeout=grace, fetch_local=False)
