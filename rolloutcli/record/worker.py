"""Write whole recordings in a child process, so the training process only copies them.

A recorder that has a whole rollout at once (the RSL-RL hook, once per iteration) hands it over with
:func:`publish`: a background thread of this process sends it (pickled, through a pipe) to one child process,
``python -m rolloutcli.record.worker``, which writes it with :class:`~rolloutcli.record.writer.RolloutWriter`
(the same checks, the same bytes) and publishes it atomically. Creating a file's datasets and attributes is
libhdf5 work done under the GIL: done in a thread of the training process it would stall the training loop
for as long (benchmarks/README.md, issue 13). Recordings are written in the order handed over; at most
``_IN_FLIGHT`` are held at once (memory stays bounded: :func:`publish` waits for the oldest). The child ignores
Ctrl-C (what it was handed is finished) and ends when this process closes the pipe (at exit, after the files
handed over are published). A failure comes back as the future's exception: a ``RolloutError`` naming the file.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

from rolloutcli.errors import EXIT_IO, RolloutError

try:
    import fcntl
except ImportError:  # not POSIX: the pipe keeps its size
    fcntl = None  # type: ignore[assignment]

_IN_FLIGHT = 2  # recordings handed over and not yet published
_HEADER = struct.Struct("<Q")
_PIPE_BYTES = 1 << 20


def _frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _send(stream: IO[bytes], frame: bytes) -> None:
    stream.write(frame)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(_HEADER.size)
    size = _HEADER.unpack(head)[0] if len(head) == _HEADER.size else -1
    data = stream.read(size) if size >= 0 else b""
    if size < 0 or len(data) < size:  # the other end closed the pipe (a partial message is dropped)
        raise EOFError
    return pickle.loads(data)


def _at(tree: Any, t: int) -> Any:
    """Step ``t`` of a tree (dicts, tuples) of ``[T, ...]`` arrays."""
    if isinstance(tree, dict):
        return {key: _at(value, t) for key, value in tree.items()}
    if isinstance(tree, tuple | list):
        return tuple(_at(value, t) for value in tree)
    return tree[t]


def write_recording(job: dict[str, Any]) -> Path:
    """Write ``job`` (``writer``: RolloutWriter's arguments, ``steps``: the step fields as ``[T, ...]`` arrays,
    ``close``: close()'s arguments) as one file; returns its path."""
    from rolloutcli.record.writer import RolloutWriter

    with RolloutWriter(**job["writer"]) as writer:
        for t in range(job["writer"]["num_steps"]):
            writer.add(_at(job["steps"], t))
        writer.close(**job["close"])
    return writer.path


class _Child:
    """The child process, a thread feeding it and a thread reading its replies."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # where this rolloutcli is imported from
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rolloutcli.record.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        if hasattr(fcntl, "F_SETPIPE_SZ"):  # a recording fits in the pipe: the feeding thread writes it at once
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.process.stdin.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)  # type: ignore[union-attr]
        self.outbox: queue.Queue[bytes | None] = queue.Queue()
        self.waiting: dict[int, tuple[Path, Future[Path]]] = {}
        self.lock = threading.Lock()
        self.alive = True
        threading.Thread(target=self._feed, name="rolloutcli-record-feed", daemon=True).start()
        threading.Thread(target=self._read, name="rolloutcli-record-read", daemon=True).start()

    def _feed(self) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        try:
            while (item := self.outbox.get()) is not None:
                _send(stdin, item)
        except OSError:  # the child is gone: _read fails what is waiting
            pass
        finally:
            stdin.close()

    def _read(self) -> None:
        assert self.process.stdout is not None
        try:
            while True:
                ident, error = _receive(self.process.stdout)
                with self.lock:
                    path, future = self.waiting.pop(ident)
                if error is None:
                    future.set_result(path)
                else:
                    future.set_exception(RolloutError(error[0], exit_code=error[1]))
        except (EOFError, OSError):
            code = self.process.wait()
            with self.lock:
                self.alive = False
                lost, self.waiting = self.waiting, {}
            for path, future in lost.values():
                future.set_exception(
                    RolloutError(
                        f"{path}: the recording process ended (exit code {code}) before publishing it; nothing was "
                        "published under that name.",
                        exit_code=EXIT_IO,
                    )
                )

    def hand(self, ident: int, path: Path, job: dict[str, Any]) -> Future[Path]:
        future: Future[Path] = Future()
        with self.lock:  # _read fails every waiting future once the child has ended
            alive = self.alive
            if alive:
                self.waiting[ident] = (path, future)
        if alive:
            self.outbox.put(_frame((ident, job)))  # pickled here: the feeding thread only writes bytes
        else:
            future.set_exception(
                RolloutError(f"{path}: the recording process ended; not published.", exit_code=EXIT_IO)
            )
        return future

    def close(self) -> None:
        self.outbox.put(None)
        self.process.wait()


class _Publisher:
    def __init__(self) -> None:
        self.child: _Child | None = None
        self.count = 0
        self.held: list[Future[Path]] = []
        self.lock = threading.Lock()
        atexit.register(self.close)

    def submit(self, job: dict[str, Any]) -> Future[Path]:
        with self.lock:
            self.held = [future for future in self.held if not future.done()]
            while len(self.held) >= _IN_FLIGHT:  # memory stays bounded: wait for the oldest
                self.held.pop(0).exception()
            if self.child is None or not self.child.alive:
                self.child = _Child()
            self.count += 1
            future = self.child.hand(self.count, Path(job["writer"]["path"]), job)
            self.held.append(future)
            return future

    def close(self) -> None:
        """Publish what was handed over, then end the child."""
        with self.lock:
            child, self.child = self.child, None
        if child is not None:
            child.close()


@functools.cache
def _publisher() -> _Publisher:
    return _Publisher()


def publish(job: dict[str, Any]) -> Future[Path]:
    """Hand ``job`` (see :func:`write_recording`; numpy arrays only) to the child; the future gives the
    published path or raises what went wrong."""
    return _publisher().submit(job)


def _serve() -> int:
    """The child: write each recording received on stdin, reply ``(ident, None | (message, exit code))``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the training loop: finish what was handed over
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the replies
    requests = os.fdopen(0, "rb")
    while True:
        try:
            ident, job = _receive(requests)
        except EOFError:
            return 0
        try:
            write_recording(job)
            error = None
        except RolloutError as exc:
            error = (str(exc), exc.exit_code)
        except Exception as exc:  # reported to the training process, which raises it
            error = (f"{job['writer']['path']}: cannot write the recording ({type(exc).__name__}: {exc}).", EXIT_IO)
        _send(replies, _frame((ident, error)))


if __name__ == "__main__":
    sys.exit(_serve())
