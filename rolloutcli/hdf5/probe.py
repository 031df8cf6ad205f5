"""Read an untrusted file's metadata first in another process, so a libhdf5 crash or hang is caught.

Some corrupt files defeat libhdf5 in C code Python cannot interrupt (a variable-length string whose global-heap
object claims size 0 loops forever in ``H5HG__cache_heap_deserialize``; other corrupt metadata crashes it). So
another process opens the file, audits it and reads what the commands read from the metadata (attributes,
chunk indexes, variable-length datasets); when it dies by a signal or runs out of time, the file is refused as
corrupt (exit 1) and this process never parses it. Data is never read there.

That process, a prober, reads file after file (a fork per file cost ~16 ms of a small file's ~22 ms); it is
forked from a small helper interpreter (h5py only, started on first use: ``rolloutcli.hdf5.probe_helper``), not
from this process, whose page tables (large once torch is loaded) every fork would copy. The helper reads
requests on stdin (a ``multiprocessing.connection`` socket pair) and exits when this process goes away. On Linux
it also listens on an abstract Unix socket (a ``Listener``: nothing on disk to leave behind; only the same user
is answered): the local pool's workers of the same command ask it there (``shared_env``) instead of each
starting a helper of its own (an interpreter and h5py, ~0.2 s of CPU each, which a command on a 2-CPU machine
pays in its wall time). Requests name a path and answers are a few bytes: nothing for ``shared_memory`` or
``send_handle``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any

from rolloutcli.errors import EXIT_BAD_DATA, RolloutError

DEFAULT_PROBE_TIMEOUT = 30.0  # seconds for one file's metadata (real files need milliseconds)
HELPER_SLACK = 15.0  # extra seconds the helper may need to answer (its own start, the fork)
LISTEN_WAIT = 2.0  # seconds a starting helper may take to listen on its socket
SHARED_ENV = "ROLLOUTCLI_PROBE_HELPER"  # the socket name of a helper this process may ask (see ``shared_env``)
HELPER_CODE = "from rolloutcli.hdf5.probe_helper import serve; serve()"  # what the helper interpreter runs


def probe_metadata(path: Path | str, allow_external: bool = False, timeout: float | None = None) -> None:
    """Raise ``RolloutError`` (exit 1) when reading ``path``'s metadata crashes or hangs libhdf5.

    Other problems (not HDF5, unsafe links, corrupt metadata that raises an error) are left to the caller,
    which finds them again with proper messages. Where no helper can run (no ``fork``), nothing is probed.
    """
    timeout = DEFAULT_PROBE_TIMEOUT if timeout is None else timeout
    if not hasattr(os, "fork"):
        return
    request = {"path": os.path.abspath(os.fsdecode(path)), "allow_external": allow_external, "timeout": timeout}
    identity = _identity(request["path"])
    key = (request["path"], allow_external, identity)
    if _PROBED is not None and key in _PROBED:
        return
    # a file a used prober failed on is read again by a fresh one before it is blamed: two deadlines, at most
    answer = _ask(request, 2 * (timeout + HELPER_SLACK))
    if answer is not None and answer["status"] == "ok" and _PROBED is not None and identity is not None:
        _PROBED.add(key)
    if answer is None or answer["status"] == "ok":
        return  # no helper could answer (it is not the file's fault): the caller reads the file directly
    if answer["status"] == "timeout":
        raise RolloutError(
            f"{path}: reading the file's metadata did not finish in {timeout:.0f} s (libhdf5 loops forever on "
            "some corrupt files); the file is corrupt. Re-export it from its source.",
            exit_code=EXIT_BAD_DATA,
        )
    raise RolloutError(
        f"{path}: libhdf5 crashed ({answer['signal']}) while reading the file's metadata; the file is corrupt. "
        "Re-export it from its source.",
        exit_code=EXIT_BAD_DATA,
    )


_PROBED: set[tuple[Any, ...]] | None = None  # inside ``probed_once``: the files found sound, as they were then


@contextlib.contextmanager
def probed_once() -> Iterator[None]:
    """Inside the block, a file found sound is not probed again while it is the same file with the same size
    and modification and change times (a dataset's work unit opens its input twice: a probe is a round trip to
    the helper and a metadata read, a few ms). Outside it, every open probes."""
    global _PROBED
    outer, _PROBED = _PROBED, set()
    try:
        yield
    finally:
        _PROBED = outer


def _identity(path: str) -> tuple[int, ...] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


# --------------------------------------------------------------------------------- this process: the client


class _Helper:
    """The helper interpreter and the connection to it (its stdin), owned by the process that started it."""

    def __init__(self) -> None:
        package_parent = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH", "")) if p)
        env.pop(SHARED_ENV, None)
        self.owner = os.getpid()
        # an abstract socket's name (Linux only); random, and the helper answers only this user's processes
        self.address = f"rolloutcli-probe-{secrets.token_hex(16)}" if sys.platform.startswith("linux") else None
        self.connection, theirs = Pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", HELPER_CODE, *filter(None, [self.address])],
            stdin=theirs.fileno(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # Ctrl-C in a terminal goes to the command, not to the helper
        )
        theirs.close()

    def listening(self) -> bool:
        """Whether the helper takes connections on its socket (waits for it to start listening, which it does
        before its imports: tens of milliseconds; a helper that could not listen is given up after
        ``LISTEN_WAIT`` seconds, and the workers then start helpers of their own)."""
        deadline = time.monotonic() + LISTEN_WAIT
        while self.address is not None and self.process.poll() is None and time.monotonic() < deadline:
            try:
                _connect(self.address).close()
                return True
            except OSError:
                time.sleep(0.005)
        return False

    def close(self) -> None:
        if self.owner != os.getpid():
            return  # inherited through a fork: the helper belongs to the parent
        self.connection.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=1)
        with contextlib.suppress(OSError):
            self.process.kill()
            self.process.wait()


def _connect(address: str) -> Connection:
    """A connection to the helper listening on ``address``; hand-rolled as ``Client`` has no connect timeout."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(HELPER_SLACK)
        connection.connect("\0" + address)
        connection.settimeout(None)
        return Connection(connection.detach())


def _exchange(connection: Connection, request: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    """Send one request; the answer, or None when the helper is gone or did not answer in time. (The helper
    sends each answer in one write once its prober has answered or ended, so a readable connection means it
    all follows.)
    JSON, not pickle: the socket's name is public (/proc/net/unix); who binds it after the helper must not run code."""
    with contextlib.suppress(OSError, EOFError, ValueError):
        connection.send_bytes(json.dumps(request).encode())
        if connection.poll(timeout):
            return json.loads(connection.recv_bytes(1 << 16))
    return None


_HELPER: _Helper | None = None
_LOCK = threading.Lock()


def start_helper() -> bool:
    """Start this process's helper now, if none runs; False when it cannot start.

    The command line calls it before importing anything heavy, so the helper's own start (an interpreter and
    h5py) runs while this process imports typer, numpy and rich instead of after them.
    """
    with _LOCK:
        return _running_helper() is not None


def _running_helper() -> _Helper | None:
    """This process's live helper, started if needed (the caller holds ``_LOCK``); None when none can start."""
    global _HELPER
    if _HELPER is None or _HELPER.owner != os.getpid() or _HELPER.process.poll() is not None:
        try:
            _HELPER = _Helper()
        except OSError:
            _HELPER = None
    return _HELPER


def _ask(request: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    """The answer of the helper this process may share (``SHARED_ENV``), else of its own (started if needed);
    None when no helper could answer."""
    global _HELPER
    with _LOCK:
        answer = _ask_shared(request, timeout)
        if answer is not None:
            return answer
        for _ in range(2):  # a helper that died or got stuck is replaced once
            helper = _running_helper()
            if helper is None:
                return None
            answer = _exchange(helper.connection, request, timeout)
            if answer is not None:
                return answer
            helper.close()
            _HELPER = None
    return None


def shared_env() -> dict[str, str]:
    """The environment under which another process of this command (a local pool's worker) asks this process's
    helper (started if needed) instead of starting its own; empty when none runs."""
    with _LOCK:
        helper = _running_helper()
        if helper is None or not helper.listening():
            return {}
        return {SHARED_ENV: helper.address}


_SHARED: dict[str, Any] = {}  # this process's connection to the shared helper: address, pid, connection


def _ask_shared(request: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    """The shared helper's answer (the caller holds ``_LOCK``); None when there is none or it failed (the
    caller then asks a helper of its own)."""
    address = os.environ.get(SHARED_ENV)
    if not address or (_HELPER is not None and _HELPER.owner == os.getpid() and _HELPER.address == address):
        return None
    if _SHARED.get("address") != address or _SHARED.get("pid") != os.getpid():
        _drop_shared()
        with contextlib.suppress(OSError):
            _SHARED.update(address=address, pid=os.getpid(), connection=_connect(address))
    answer = _exchange(_SHARED["connection"], request, timeout) if _SHARED else None
    if answer is None:
        _drop_shared()
    return answer


def _drop_shared() -> None:
    if _SHARED.get("pid") == os.getpid():
        _SHARED["connection"].close()
    _SHARED.clear()


@atexit.register
def _stop_helper() -> None:
    if _HELPER is not None:
        _HELPER.close()
