"""The metadata probe's helper interpreter: long-lived probers, forked from it, read untrusted files one by one.

``rolloutcli.hdf5.probe`` (the client) starts it and says why (a libhdf5 crash or hang on a corrupt file must not
take the command down). Each connection, the owner's stdin or a pool worker's on the abstract socket, gets a
prober of its own: a child forked from this small interpreter (h5py only) that reads one requested file's
metadata after another, each under its own deadline (an alarm), and answers after each. When it dies by a signal
or overruns, the file is read once more by a fresh prober before it is blamed (an earlier file may have damaged
libhdf5's global state in the old one); the next file goes to a fresh prober too. Data is never read there.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import signal
import socket
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener, Pipe, wait
from pathlib import Path
from typing import Any

from rolloutcli.errors import RolloutError
from rolloutcli.hdf5.identity import identity
from rolloutcli.pipeline.lifeline import die_with_parent, loaded_prctl

VLEN_PROBE_BYTES = 64 << 20  # variable-length datasets up to this declared size are read by the probe
LISTING_BYTES = 48 << 10  # a longer listing is not sent (the client reads answers of up to 64 KiB)
PROBER_SLACK = 5.0  # seconds past a file's alarm before the helper kills a prober that is still alive itself


def serve() -> None:
    """The helper's loop: requests on its stdin (a socket pair) and on each connection to the socket
    ``sys.argv[1]`` (when given), each connection on a thread of its own; ends when its owner closes stdin."""
    listener = None
    if len(sys.argv) > 1:  # listening before the imports: a worker's first connection waits in the backlog
        with contextlib.suppress(OSError):  # no socket (a sandbox may forbid it): the owner is still served
            listener = Listener("\0" + sys.argv[1], "AF_UNIX", backlog=64)
    import h5py  # noqa: F401 - imported once, before the forks

    import rolloutcli.hdf5.audit  # noqa: F401

    if listener is not None:
        threading.Thread(target=_accept, args=(listener,), daemon=True).start()
    _answer(Connection(sys.stdin.fileno()))
    for pid in list(_PROBERS):  # the workers' probers end with the helper too, even one in a file's C loop
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _accept(listener: Listener) -> None:
    while True:
        threading.Thread(target=_connection, args=(listener.accept(),), daemon=True).start()


def _connection(connection: Connection) -> None:
    with connection, socket.fromfd(connection.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as peer:
        _, uid, _ = struct.unpack("3i", peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        # the uid, not an authkey: ``Listener.accept`` checks that on its one thread, which a silent peer stalls
        if uid == os.getuid():  # an abstract socket has no file permissions: another user is not answered
            _answer(connection)


def _answer(connection: Connection) -> None:
    """Answer each request on ``connection`` (JSON, as in ``probe._exchange``) until it closes, in order, through a
    prober of its own that reads file after file. Each request goes to the prober as soon as it comes, so the
    prober starts on a file sent ahead while this thread passes on the answer before (in turn, it waited ~0.5 ms
    a file for this thread: issue 39). A prober that ended on a file it was not the first to read may have been
    damaged by an earlier file (libhdf5's global state): that file and those sent after it go to a fresh prober,
    whose verdict stands, so an innocent file is never blamed."""
    prober: _Prober | None = None
    sent: collections.deque[dict[str, Any]] = collections.deque()  # sent to ``prober``, unanswered, in order
    with connection, contextlib.suppress(OSError, EOFError, ValueError):
        try:
            while True:
                if prober is None or not sent or connection.poll(0):
                    request = json.loads(connection.recv_bytes())
                    prober = prober or _Prober()
                    prober.send(request, first=not sent)
                    sent.append(request)
                    continue
                answer = prober.receive(sent[0], connection)
                if answer is None:  # the client sent more: read it
                    continue
                if not prober.ended:
                    connection.send_bytes(answer)
                    sent.popleft()
                    continue
                if not prober.answered:  # its first file since it was forked: the verdict stands
                    connection.send_bytes(answer)
                    sent.popleft()
                prober = _Prober() if sent else None
                for index, request in enumerate(sent):
                    prober.send(request, first=index == 0)
        finally:
            if prober is not None:
                prober.end()


_FORK = threading.Lock()  # one fork at a time (see ``_Prober``); the child touches nothing the helper's threads hold
_PROBERS: set[int] = set()  # the live probers' pids, killed when the helper ends


class _Prober:
    """A child of the helper that reads the metadata of file after file, each under its own deadline, and answers
    after each (JSON: the identity of the file its audit found clean and its listing, or null). (Not a
    ``concurrent.futures`` pool: its worker cannot be killed at one file's deadline, and a crash breaks the
    pool.) Idle, it waits on its socket; it ends when the helper closes it or goes away."""

    def __init__(self) -> None:
        # the socket pair is made and the prober's end closed under the lock, so no other prober forked by another
        # thread holds a copy of that end: its end-of-file here then means this prober has ended
        helper = os.getpid()
        loaded_prctl()  # here, not in the child: see there
        with _FORK:
            self.connection, theirs = Pipe()
            pid = os.fork()
            if pid != 0:
                theirs.close()
        if pid == 0:
            # killed with the helper, which may itself be killed (a prober forked later holds a copy of the
            # helper's end of this one's pipe: no end-of-file would come); this thread outlives the prober
            die_with_parent(helper)
            self.connection.close()
            _read_requests(theirs)
        self.pid, self.ended, self.answered, self.since = pid, False, False, time.monotonic()
        _PROBERS.add(pid)

    def send(self, request: dict[str, Any], first: bool) -> None:
        """Send a request (``first``: none before it is unanswered, so the prober starts on it now)."""
        if first:
            self.since = time.monotonic()
        with contextlib.suppress(OSError, ValueError):  # a prober gone: ``receive`` finds it ended
            self.connection.send_bytes(json.dumps(request).encode())

    def receive(self, request: dict[str, Any], client: Connection) -> bytes | None:
        """The answer for ``request``, the oldest unanswered one, JSON: ``{"status": "ok" | "timeout" | "signal",
        "signal": name, "clean": identity, "listing": ...}`` (``clean``: the audit found the file with that
        identity clean; ``listing``: ``listing.to_json``'s), the prober's own bytes when it answered (not decoded
        and encoded again here); ``ended`` is set when it did not (it is then gone, and the status says how it
        ended). None when ``client`` sent a request meanwhile."""
        overran = False
        with contextlib.suppress(OSError, EOFError, ValueError):
            # its own alarm ends it at the file's deadline; this wait is the backstop (a stopped prober)
            left = self.since + _alarm(float(request["timeout"])) + PROBER_SLACK - time.monotonic()
            ready = wait([self.connection, client], max(left, 0.0))
            if self.connection in ready:
                answer = self.connection.recv_bytes()  # or end-of-file when it died (EOFError)
                self.answered, self.since = True, time.monotonic()
                return answer
            if ready:
                return None
            overran = True
        return json.dumps(self.end(overran)).encode()

    def end(self, overran: bool = False) -> dict[str, Any]:
        """Kill the prober (an idle one, or one past its backstop) and say how it ended."""
        self.ended = True
        self.connection.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)  # not reaped yet: the pid is still this child's
        _, status = os.waitpid(self.pid, 0)
        _PROBERS.discard(self.pid)
        if overran or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM):
            return {"status": "timeout"}
        if not os.WIFSIGNALED(status):
            return {"status": "ok"}  # only a signal or an overrun blames the file (as with a child per file)
        number = os.WTERMSIG(status)
        return {"status": "signal", "signal": signal.Signals(number).name}


def _alarm(timeout: float) -> int:
    return max(1, math.ceil(timeout))


def _read_requests(connection: Connection) -> None:
    """The prober's loop (in the forked child; never returns): read each requested file's metadata and answer."""
    try:
        # SIGALRM's default action ends the process even inside a C loop of libhdf5
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        with contextlib.suppress(BaseException):
            while True:
                request = json.loads(connection.recv_bytes())
                signal.alarm(_alarm(float(request["timeout"])))
                answer = b'{"status": "ok"}'
                with contextlib.suppress(BaseException):
                    answer = _read_metadata(Path(request["path"]), request)
                signal.alarm(0)
                connection.send_bytes(answer)
    finally:
        os._exit(0)


def _read_metadata(path: Path, request: dict[str, Any]) -> bytes:
    """In the prober: open, audit, then touch what commands read from the metadata (hard links). The answer
    (``_Prober.receive``'s), with, when the audit under the request's options found the file clean, the identity of
    the file it read (``probe.identity``) and its listing (``listing.to_json``; None when JSON cannot hold it or
    it is longer than ``LISTING_BYTES``)."""
    from rolloutcli.hdf5.access import open_read
    from rolloutcli.hdf5.limits import SafetyOptions
    from rolloutcli.hdf5.listing import to_json
    from rolloutcli.hdf5.probe_walk import quick_walk

    options = SafetyOptions(**request["options"])
    with open_read(path) as handle:
        found = quick_walk(handle, options) or _full_walk(path, handle, options)
        if found is None:
            return b'{"status": "ok"}'  # refused: the caller refuses it too, without reading more
        answer = {"status": "ok", "clean": identity(os.fstat(handle.id.get_vfd_handle())), "listing": to_json(found)}
        text = json.dumps(answer)
        if len(text) > LISTING_BYTES:  # the listing is most of it
            text = json.dumps({**answer, "listing": None})
        return text.encode()


def _full_walk(path: Path, handle: Any, options: Any) -> Any:
    """The walk of a file the quick one does not vouch for: the audit, then every hard link's metadata. Its
    listing, or None when the audit refuses the file."""
    import h5py

    from rolloutcli.hdf5.audit import LAYOUT_KINDS, audit_file
    from rolloutcli.hdf5.listing import Listing, list_datasets, read_attrs

    try:
        objects = audit_file(path, handle, options)
    except RolloutError:
        return None
    # split copies committed datatypes object by object (H5Ocopy), which crashes on some corrupt ones
    types = [obj for obj in objects.values() if isinstance(obj, h5py.Datatype)]
    if types:
        with h5py.File("probe", "w", driver="core", backing_store=False) as scratch:
            for obj in types:
                handle.copy(obj, scratch, name=str(len(scratch)))
    attrs = read_attrs(handle)  # variable-length strings live in the global heap
    for obj in objects.values():
        read_attrs(obj)
        if not isinstance(obj, h5py.Dataset) or obj.external or obj.is_virtual:
            continue
        if obj.chunks is not None and obj.dtype.kind not in LAYOUT_KINDS:
            obj.id.chunk_iter(lambda info: None)  # walks the chunk index (the audit walked the others')
        if h5py.check_vlen_dtype(obj.dtype) is not None or obj.dtype.kind == "O":
            if obj.size * obj.dtype.itemsize <= VLEN_PROBE_BYTES:
                obj[()]
    return Listing(*list_datasets(handle), attrs)
