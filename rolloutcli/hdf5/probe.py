"""Read an untrusted file's metadata first in another process, so a libhdf5 crash or hang is caught.

Some corrupt files defeat libhdf5 in C code Python cannot interrupt (a variable-length string whose global-heap
object claims size 0 loops forever in ``H5HG__cache_heap_deserialize``; other corrupt metadata crashes it). So
another process opens the file, audits it and reads what the commands read from the metadata (attributes,
chunk indexes, variable-length datasets); when it dies by a signal or runs out of time, the file is refused as
corrupt (exit 1) and this process never parses it. Data is never read there.

That process, a prober, reads file after file (a fork per file cost ~16 ms of a small file's ~22 ms); it is
forked from a small helper interpreter (h5py only, started on first use: ``rolloutcli.hdf5.probe_helper``), not
from this process, whose page tables (large once torch is loaded) every fork would copy. The helper reads
requests on stdin (a socket pair) and exits when this process goes away. On Linux it also listens on an abstract
Unix socket (nothing on disk; only the same user is answered): the local pool's workers ask it there
(``shared_env``) instead of each starting a helper (~0.2 s of CPU each). Requests and answers are a few bytes.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from rolloutcli.errors import EXIT_BAD_DATA, RolloutError
from rolloutcli.hdf5.identity import path_identity
from rolloutcli.hdf5.limits import SafetyOptions
from rolloutcli.hdf5.probe_cache import ProbeCache

DEFAULT_PROBE_TIMEOUT = 30.0  # seconds for one file's metadata (real files need milliseconds)
HELPER_SLACK = 15.0  # extra seconds the helper may need to answer (its own start, the fork)
LISTEN_WAIT = 2.0  # seconds a starting helper may take to listen on its socket
SHARED_ENV = "ROLLOUTCLI_PROBE_HELPER"  # the socket name of a helper this process may ask (see ``shared_env``)
P = TypeVar("P", Path, str)
HELPER_CODE = "from rolloutcli.hdf5.probe_helper import serve; serve()"  # what the helper interpreter runs


class Probed(NamedTuple):
    """A probe's verdict on a sound file: the identity of the file the prober's audit found clean under the
    options (None: not clean, or not probed), and the listing it read (``listing.to_json``'s; None: none)."""

    clean: list[int] | None
    listing: dict[str, Any] | None


def probe_metadata(path: Path | str, options: SafetyOptions | None = None, timeout: float | None = None) -> Probed:
    """Raise ``RolloutError`` (exit 1) when reading ``path``'s metadata crashes or hangs libhdf5; else return what
    the prober found (``Probed``).

    The caller need not audit a file it opened with the ``clean`` identity again, nor list it. Other problems (not
    HDF5, unsafe links, corrupt metadata that raises an error) are left to the caller, which finds them again
    with proper messages. Where no helper can run (no ``fork``), nothing is probed.
    """
    request, key = _request(path, options, timeout)
    if request is None:
        return Probed(None, None)
    kept = _PROBED.get(key) if _PROBED is not None else None
    if kept is not None:
        return Probed(*kept)
    ahead = _AHEAD.pop(key, None)
    answer = ahead.answer() if ahead is not None else None
    if answer is None:
        answer = _ask(request, _deadline(request))
    if answer is None:
        return Probed(None, None)  # no helper (it is not the file's fault): the caller reads and audits the file
    if answer["status"] == "ok":
        if _PROBED is not None and len(key) > 2:  # packed: ~0.1 KB a small file, not ~5 as objects
            _PROBED.put(key, answer.get("clean"), answer.get("listing") or None)
        return Probed(answer.get("clean"), answer.get("listing"))
    if answer["status"] == "timeout":
        raise RolloutError(
            f"{path}: reading the file's metadata did not finish in {request['timeout']:.0f} s (libhdf5 loops "
            "forever on some corrupt files); the file is corrupt. Re-export it from its source.",
            exit_code=EXIT_BAD_DATA,
        )
    raise RolloutError(
        f"{path}: libhdf5 crashed ({answer['signal']}) while reading the file's metadata; the file is corrupt. "
        "Re-export it from its source.",
        exit_code=EXIT_BAD_DATA,
    )


def _request(
    path: Path | str, options: SafetyOptions | None, timeout: float | None
) -> tuple[dict[str, Any] | None, tuple[Any, ...]]:
    """The request for ``path`` (None where nothing is probed: no ``fork``) and its key: path, options and the
    file's identity now (none when it cannot be read)."""
    if not hasattr(os, "fork"):
        return None, ()
    options = options or SafetyOptions()
    timeout = DEFAULT_PROBE_TIMEOUT if timeout is None else timeout
    # ``vars``: the flat fields ``asdict`` gives, without its deep copy (~15 us, paid twice a file by ``batch``)
    request = {"path": os.path.abspath(os.fsdecode(path)), "options": dict(vars(options)), "timeout": timeout}
    return request, (request["path"], options, *(path_identity(request["path"]) or ()))


def _deadline(request: dict[str, Any]) -> float:
    # a file a used prober failed on is read again by a fresh one before it is blamed: two deadlines, at most
    return 2 * (float(request["timeout"]) + HELPER_SLACK)


class _Ahead:
    """A probe sent while this process works on the file before (``probe_ahead``), its answer read when needed
    or before a later request's. No thread: one took the GIL whenever the command let it go for a system call,
    which then waited for it (on a loaded machine, up to a switch interval: 5 ms)."""

    def __init__(self, request: dict[str, Any], connection: Connection) -> None:
        self.request, self.connection, self.received, self._answer = request, connection, False, None

    def answer(self) -> dict[str, Any] | None:
        """The answer; None when the helper failed before it (the caller asks again)."""
        with _LOCK:
            _receive_through(self)
        return self._answer


_SENT: collections.deque[_Ahead] = collections.deque()  # probes sent ahead, answer not read yet, in order


def _receive_through(ahead: _Ahead | None) -> None:
    """Read the answers of the probes sent ahead, in order, up to ``ahead``'s (None: all; the caller holds
    ``_LOCK``). A helper that fails one (gone, stuck) is given up: the others are answered None too."""
    while _SENT and (ahead is None or not ahead.received):
        first = _SENT.popleft()
        first._answer, first.received = _receive(first.connection, _deadline(first.request)), True
        if first._answer is None:
            for other in _SENT:
                other.received = True
            _SENT.clear()
            _give_up(first.connection)


def _after_fork_in_child() -> None:
    """A forked child asks its own helper: probes sent ahead are forgotten, the lock (held?) is a new one."""
    global _LOCK
    _LOCK = threading.Lock()
    _AHEAD.clear()
    _SENT.clear()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork (nothing is probed there)
    os.register_at_fork(after_in_child=_after_fork_in_child)


_AHEAD: dict[tuple[Any, ...], _Ahead] = {}  # files probed ahead -> their probes (the next ones, the one before)
AHEAD_KEPT = 3
AHEAD_FILES = 2  # ``probing_ahead``'s reach: the prober starts on the second while the first's answer comes back


def probe_ahead(path: Path | str, options: SafetyOptions | None = None) -> None:
    """Send the probe of ``path`` now, for the ``probe_metadata`` that comes next: the prober reads it while this
    process works on the file before. The answer counts while the file is the same one (its identity); at most
    three are kept (the oldest dropped) or unread on the connection (the oldest read first: none piles up)."""
    request, key = _request(path, options, None)
    if request is None or len(key) <= 2 or key in _AHEAD or (_PROBED is not None and key in _PROBED):
        return  # nothing to probe, or probed already
    if not os.path.isfile(request["path"]):
        return  # not a regular file (a FIFO would hold a prober until its deadline): the open refuses it
    while len(_AHEAD) >= AHEAD_KEPT:
        del _AHEAD[next(iter(_AHEAD))]  # the oldest (its answer, if sent, is read and dropped in turn)
    with _LOCK:
        while len(_SENT) >= AHEAD_KEPT:
            _receive_through(_SENT[0])
        connection = _send_ahead(request)
        if connection is not None:
            _AHEAD[key] = _Ahead(request, connection)
            _SENT.append(_AHEAD[key])


def probing_ahead(files: Sequence[P], options: SafetyOptions | None = None) -> Iterator[P]:
    """Each of ``files`` in turn, the next two probed meanwhile (``probe_ahead``), for a loop opening them in turn."""
    for i, path in enumerate(files):
        for k in range(i + 1 if i == 0 else i + AHEAD_FILES, min(i + 1 + AHEAD_FILES, len(files))):  # each once
            probe_ahead(files[k], options)
        yield path


# inside ``probed_once``: the files found sound, as they were then -> the identity found clean (or None) and the
# listing (or None)
_PROBED: ProbeCache | None = None


@contextlib.contextmanager
def probed_once() -> Iterator[None]:
    """Inside the block, a file found sound is not probed again while it is the same file with the same size
    and modification and change times (``batch`` opens a dataset's files to check them, then to export them: a
    probe is a round trip to the helper and a metadata read, a few ms), and its listing is kept (packed: ~0.1 KB
    a file, ``probe_cache``) for the next reader, which then does not list it again. Outside it, every open probes."""
    global _PROBED
    outer, _PROBED = _PROBED, ProbeCache()
    try:
        yield
    finally:
        _PROBED = outer


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
        """Whether the helper takes connections on its socket (waits for it to listen, before its imports: tens of
        ms; given up after ``LISTEN_WAIT`` seconds, and the workers then start helpers of their own)."""
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
        return _receive(connection, timeout)
    return None


def _receive(connection: Connection, timeout: float) -> dict[str, Any] | None:
    """The next answer on ``connection`` (the caller holds ``_LOCK``); None when the helper is gone or did not
    answer in time. Interrupted (Ctrl-C), the helper is given up: its answer would be taken for the next file's."""
    try:
        with contextlib.suppress(OSError, EOFError, ValueError):
            if connection.poll(timeout):
                return json.loads(connection.recv_bytes(1 << 16))
    except BaseException:
        _give_up(connection)
        raise
    return None


def _send_ahead(request: dict[str, Any]) -> Connection | None:
    """Send ``request`` to the helper ``_ask`` asks first (the caller holds ``_LOCK``); the connection it went on,
    None when there is none or the send failed (the request is then asked when it is needed)."""
    connection = _shared_connection()
    if connection is None and (helper := _running_helper()) is not None:
        connection = helper.connection
    if connection is None:
        return None
    try:
        connection.send_bytes(json.dumps(request).encode())
    except (OSError, ValueError):
        _give_up(connection)
        return None
    return connection


def _give_up(connection: Connection) -> None:
    """Stop using the helper behind ``connection`` (the caller holds ``_LOCK``): it failed a request."""
    global _HELPER
    if _SHARED.get("connection") is connection:
        _drop_shared()
    elif _HELPER is not None and _HELPER.connection is connection:
        _HELPER.close()
        _HELPER = None


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
    with _LOCK:
        _receive_through(None)  # the answers to requests sent ahead come first on the connection
        answer = _ask_shared(request, timeout)
        for _ in range(2 if answer is None else 0):  # a helper that died or got stuck is replaced once
            helper = _running_helper()
            answer = _exchange(helper.connection, request, timeout) if helper is not None else None
            if answer is not None or helper is None:
                break
            _give_up(helper.connection)
    return answer


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
    connection = _shared_connection()
    answer = _exchange(connection, request, timeout) if connection is not None else None
    if answer is None:
        _drop_shared()
    return answer


def _shared_connection() -> Connection | None:
    """The connection to the helper this process may share (``SHARED_ENV``; the caller holds ``_LOCK``), made
    on first use; None when there is none."""
    address = os.environ.get(SHARED_ENV)
    if not address or (_HELPER is not None and _HELPER.owner == os.getpid() and _HELPER.address == address):
        return None
    if _SHARED.get("address") != address or _SHARED.get("pid") != os.getpid():
        _drop_shared()
        with contextlib.suppress(OSError):
            _SHARED.update(address=address, pid=os.getpid(), connection=_connect(address))
    return _SHARED.get("connection")


def _drop_shared() -> None:
    if _SHARED.get("pid") == os.getpid():
        _SHARED["connection"].close()
    _SHARED.clear()


@atexit.register
def _stop_helper() -> None:
    if _HELPER is not None:
        _HELPER.close()
