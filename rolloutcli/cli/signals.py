"""The command line's signals: Ctrl-C (130), SIGHUP (129) and SIGTERM (143) stop the command, remove its
temporaries and say so in one line.

The handler notes the signal (``errors.note_signal``) and raises its exception, except inside an import: there
the exception would leave half-imported modules that later code trips on, so the command's next stop point
raises it (``errors.stop_if_signalled``: its progress, every finished unit, before anything is published, when it
returns). It also passes the signal on to the local pool's workers, which remove what they write and end: a
signal to the command alone (``kill PID``, ``timeout``) waited for their running units. Should the command still
run ``STOP_GRACE_S`` after the signal (a stuck lock, a library that swallowed it), a watchdog ends it: workers
killed, temporaries removed, the one line, the signal's exit code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any

from rolloutcli.cli.common import RunState
from rolloutcli.cli.render import stderr
from rolloutcli.errors import (
    EXIT_HANGUP,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    Signalled,
    note_signal,
    one_line,
    signal_code,
    signals_are_held,
    stop_if_signalled,
)
from rolloutcli.hdf5.atomic import remove_live_temporaries

CODES = {signal.SIGINT: EXIT_INTERRUPTED, signal.SIGHUP: EXIT_HANGUP, signal.SIGTERM: EXIT_TERMINATED}
STOP_GRACE_S = 30.0  # a signalled command still running after this is ended by the watchdog


class _Watch:
    """The watchdog of the command in flight (only when the command is its own process)."""

    armed: bool = False
    timer: threading.Timer | None = None


def on_signal(signum: int, frame: Any) -> None:
    """The handler of SIGINT, SIGTERM and SIGHUP while a command runs."""
    note_signal(CODES[signal.Signals(signum)])
    _forward(signum)
    _start_watchdog()
    if signals_are_held():  # in C code that cannot take an exception (Ray's): raised when it returns
        return
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return
        frame = frame.f_back
    stop_if_signalled()


def _engine(name: str) -> Any:
    """The local engine's function ``name``, if the engine is imported (it may be half-imported: no pools yet)."""
    return getattr(sys.modules.get("rolloutcli.pipeline.engine"), name, None)


def _forward(signum: int) -> None:
    signal_workers = _engine("signal_workers")
    if signal_workers is not None:
        signal_workers(signum)


def arm(own_process: bool) -> None:
    """Whether a signal may end this process by the watchdog (not when the command line is embedded)."""
    _Watch.armed = own_process


def disarm() -> None:
    _Watch.armed = False
    if _Watch.timer is not None:
        _Watch.timer.cancel()
        _Watch.timer = None


def _start_watchdog() -> None:
    if _Watch.armed and _Watch.timer is None:
        _Watch.timer = threading.Timer(STOP_GRACE_S, _end_now)
        _Watch.timer.daemon = True
        _Watch.timer.start()


def _end_now() -> None:
    """The watchdog: the command did not stop within ``STOP_GRACE_S`` of its signal."""
    code = signal_code() or EXIT_TERMINATED
    kill_workers = _engine("kill_workers")
    if kill_workers is not None:
        kill_workers()
    remove_live_temporaries()
    say(stopped(code))
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    os._exit(code)


def quiet_unraisable(hook: Any) -> Any:
    """``sys.unraisablehook`` that keeps quiet about the signal's exception raised where Python cannot pass it on
    (a weakref callback, a ``__del__``): the noted signal stops the command at its next stop point."""

    def quiet(info: Any) -> None:
        if not (signal_code() is not None and isinstance(info.exc_value, (KeyboardInterrupt, Signalled))):
            hook(info)

    return quiet


def say(message: str) -> None:
    """One line on stderr; a terminal that went away (SIGHUP) must not turn it into a new failure."""
    try:
        stderr.print(one_line(message))
    except (OSError, ValueError):
        pass


def stopped(code: int) -> str:
    """What a signal's one line says: what was published, kept, or removed."""
    what = {EXIT_INTERRUPTED: "interrupted", EXIT_HANGUP: "hangup", EXIT_TERMINATED: "terminated"}[code]
    if RunState.published:
        return f"{what}: the output {RunState.published} was already published and is complete."
    if RunState.kept:
        return f"{what}: nothing was published; the finished outputs are kept in {RunState.kept} (--resume continues)."
    return f"{what}: no output was written (temporary files removed)."


def cleanup() -> None:
    """Remove the command's temporaries; a second Ctrl-C or signal must not interrupt it."""
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in CODES}
    remove_live_temporaries()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
