"""The metadata probe's helper interpreter: it forks a throwaway child per file to read the file's metadata.

``rolloutcli.hdf5.probe`` (the client) starts it and says why (a libhdf5 crash or hang on a corrupt file must not
take the command down). Data is never read there.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import struct
import sys
import threading
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from rolloutcli.errors import RolloutError

VLEN_PROBE_BYTES = 64 << 20  # variable-length datasets up to this declared size are read by the probe


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
    """Answer each request on ``connection`` (JSON, as in ``probe._exchange``) until it closes."""
    with connection, contextlib.suppress(OSError, EOFError, ValueError):
        while True:
            request = json.loads(connection.recv_bytes())
            answer = _probe_in_child(Path(request["path"]), bool(request["allow_external"]), float(request["timeout"]))
            connection.send_bytes(json.dumps(answer).encode())


_FORK = threading.Lock()  # one fork at a time; the forked child touches nothing the helper's threads hold


def _probe_in_child(path: Path, allow_external: bool, timeout: float) -> dict[str, Any]:
    """Fork a child that reads the metadata; ``{"status": "ok" | "timeout" | "signal", "signal": name}``. (Not a
    ``concurrent.futures`` pool: its worker cannot be killed at one file's deadline, and a crash breaks the pool.)"""
    with _FORK:
        pid = os.fork()
    if pid == 0:
        try:
            # SIGALRM's default action ends the process even inside a C loop of libhdf5
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(max(1, math.ceil(timeout)))
            with contextlib.suppress(BaseException):
                _read_metadata(path, allow_external)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    if not os.WIFSIGNALED(status):
        return {"status": "ok"}
    number = os.WTERMSIG(status)
    if number == signal.SIGALRM:
        return {"status": "timeout"}
    return {"status": "signal", "signal": signal.Signals(number).name}


def _read_metadata(path: Path, allow_external: bool) -> None:
    """In the throwaway child: open, audit, then touch what commands read from the metadata (hard links)."""
    import h5py

    from rolloutcli.hdf5.audit import audit_file
    from rolloutcli.hdf5.limits import SafetyOptions

    with h5py.File(path, "r") as handle:
        try:
            audit_file(path, handle, SafetyOptions(allow_external=allow_external))
        except RolloutError:
            return  # refused: the caller refuses it too, without reading more
        names: list[str] = []
        handle.visititems_links(lambda name, link: names.append(name) if isinstance(link, h5py.HardLink) else None)
        objects = [handle, *(handle[name] for name in names)]
        # split copies committed datatypes object by object (H5Ocopy), which crashes on some corrupt ones
        with h5py.File("probe", "w", driver="core", backing_store=False) as scratch:
            for obj in objects:
                if isinstance(obj, h5py.Datatype):
                    handle.copy(obj, scratch, name=str(len(scratch)))
        for obj in objects:
            for key in obj.attrs:
                obj.attrs[key]  # variable-length strings live in the global heap
            if not isinstance(obj, h5py.Dataset) or obj.external or obj.is_virtual:
                continue
            if obj.chunks is not None:
                obj.id.chunk_iter(lambda info: None)  # walks the chunk index
            if h5py.check_vlen_dtype(obj.dtype) is not None or obj.dtype.kind == "O":
                if obj.size * obj.dtype.itemsize <= VLEN_PROBE_BYTES:
                    obj[()]
