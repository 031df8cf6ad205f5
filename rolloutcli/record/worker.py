"""Write whole recordings in a child process, so the training process only copies them.

A recorder that has a whole rollout at once (the RSL-RL hook, once per iteration) hands it over with
:func:`publish`: its arrays (numpy or torch, any device) are copied into a shared-memory slot (a file in
``/dev/shm``, else in the temporary folder); the slot's descriptor (``socket.send_fds``) and a small message naming
its arrays (framed by ``multiprocessing.connection``) go through a socket pair to one child process,
``python -m rolloutcli.record.worker``, which reads the arrays in place, writes them with
:class:`~rolloutcli.record.writer.RolloutWriter` (the same checks, the same bytes) and publishes the file
atomically. Creating a file's datasets and attributes is libhdf5 work done under the GIL: done in a thread of the
training process it would stall the training loop for as long, and pickling the arrays through the pipe cost the
loop more than copying them (benchmarks/README.md, issue 13). Recordings are written in the order handed over;
at most ``_IN_FLIGHT`` are held at once, one slot each (memory stays bounded: :func:`publish` waits for the
oldest). The child runs only on CPUs the training leaves idle (``SCHED_IDLE`` on Linux). It ignores Ctrl-C
(what it was handed is finished) and ends when this process closes its end (at exit, after the files handed
over are published); on SIGTERM it finishes the file it is writing and ends. A failure comes back as the
future's exception: a ``RolloutError`` naming the file.

Not ``multiprocessing.shared_memory``: its segments have names, which a killed process leaves in ``/dev/shm``.
Not ``reduction.send_handle``: on macOS it waits for the child's acknowledgement, so for the file being written.
Not ``ProcessPoolExecutor``: its thread hands work over (lost if the training process dies first), no descriptors.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.core.host import numpy_storable
from rolloutcli.errors import EXIT_IO, RolloutError
from rolloutcli.record.waiting import wait_at_exit, wait_settled

_IN_FLIGHT = 2  # recordings handed over and not yet published
_ALIGN = 64  # each array of a slot starts on a cache line


class _Ref:
    """Where a slot holds one array: byte offset, shape, numpy dtype string (pickled as its three values)."""

    __slots__ = ("dtype", "offset", "shape")

    def __init__(self, offset: int, shape: tuple[int, ...], dtype: str) -> None:
        self.offset, self.shape, self.dtype = offset, shape, dtype

    def __reduce__(self) -> tuple[type, tuple[int, tuple[int, ...], str]]:
        return (_Ref, (self.offset, self.shape, self.dtype))


def _dtype(value: Any) -> np.dtype:
    return value.dtype if isinstance(value, np.ndarray) else _numpy_dtype(value.dtype)


@functools.cache
def _numpy_dtype(dtype: Any) -> np.dtype:
    """numpy's dtype of a torch dtype (the same name)."""
    return np.dtype(str(dtype).removeprefix("torch."))


def _layout(tree: Any, leaves: list[Any], offset: list[int]) -> Any:
    """``tree`` (dicts, tuples) with each array replaced by its :class:`_Ref`; the arrays go to ``leaves``."""
    if isinstance(tree, dict):
        return {key: _layout(value, leaves, offset) for key, value in tree.items()}
    if isinstance(tree, tuple | list):
        return tuple(_layout(value, leaves, offset) for value in tree)
    if not (isinstance(tree, np.ndarray) or hasattr(tree, "detach")):  # not an array
        return tree
    value = numpy_storable(tree)  # copied into the slot from any device
    ref = _Ref(offset[0], tuple(value.shape), _dtype(value).str)
    offset[0] += -(-max(1, value.nbytes) // _ALIGN) * _ALIGN
    leaves.append((ref, value))
    return ref


def _views(tree: Any, buffer: Any) -> Any:
    """The inverse of :func:`_layout`: each :class:`_Ref` as a numpy view of ``buffer``."""
    if isinstance(tree, dict):
        return {key: _views(value, buffer) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_views(value, buffer) for value in tree)
    if isinstance(tree, _Ref):
        return np.ndarray(tree.shape, np.dtype(tree.dtype), buffer=buffer, offset=tree.offset)
    return tree


def _slot_folders() -> list[str]:
    """Where slots go: shared memory, else (none, or full: a container's /dev/shm is 64 MB) the temporary folder."""
    return [folder for folder in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(folder)]


def _allocate(folder: str, size: int) -> tuple[int, mmap.mmap]:
    """A new file of ``size`` bytes in ``folder``, open and mapped, its name already removed (a killed process
    leaves nothing behind; the child gets the descriptor); its space taken now (no space raises OSError here, not
    SIGBUS while copying; macOS has no posix_fallocate: the file is only sized there)."""
    fd, path = tempfile.mkstemp(prefix="rolloutcli-record-", dir=folder)
    os.unlink(path)
    try:
        allocate = getattr(os, "posix_fallocate", None)
        allocate(fd, 0, size) if allocate else os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


class _Slot:
    """A shared-memory file without a name holding the arrays of one recording handed over (the child reads them
    in place, through the descriptor it is sent); ``folder``: where it is."""

    def __init__(self, size: int) -> None:
        self.size, self.future = size, None  # future: the recording it holds, until published
        failure: OSError | None = None
        for folder in _slot_folders():
            try:
                self.fd, self.map = _allocate(folder, size)
                self.folder = folder
                return
            except OSError as error:
                failure = error
        raise RolloutError(
            f"{' and '.join(_slot_folders())}: no room to hand a recording of {size} bytes to the writing process "
            f"({failure}). Free space there, or set TMPDIR to a folder with room.",
            exit_code=EXIT_IO,
        )

    def fill(self, leaves: list[Any]) -> None:
        for ref, value in leaves:
            view = np.ndarray(ref.shape, np.dtype(ref.dtype), buffer=self.map, offset=ref.offset)
            if hasattr(value, "detach"):
                import torch

                torch.from_numpy(view).copy_(value)
            else:
                np.copyto(view, value)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


def write_recording(job: dict[str, Any]) -> Path:
    """Write ``job`` (``writer``: RolloutWriter's arguments, ``steps``: the step fields as ``[T, ...]`` arrays,
    ``close``: close()'s arguments) as one file; returns its path."""
    from rolloutcli.record.writer import RolloutWriter

    with RolloutWriter(**job["writer"]) as writer:
        writer.add_steps(job["steps"])
        writer.close(**job["close"])
    return writer.path


class _Child:
    """The child process and a thread reading its replies (messages are written by the caller: they are small
    and at most ``_IN_FLIGHT`` are unread, so the socket takes each at once)."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # where this rolloutcli is imported from
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.connection, theirs = Pipe()  # a socket pair: only the child holds the other end
        self.slots = socket.fromfd(self.connection.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)  # for descriptors
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rolloutcli.record.worker", str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                env=env,
                pass_fds=[theirs.fileno()],
            )
        self.waiting: dict[int, tuple[Path, Future[Path]]] = {}
        self.lock = threading.Lock()
        self.alive = True
        threading.Thread(target=self._read, name="rolloutcli-record-read", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                ident, error = self.connection.recv()
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

    def hand(self, ident: int, path: Path, fd: int, message: Any) -> Future[Path]:
        future: Future[Path] = Future()
        future.path, future.pid = path, self.process.pid  # type: ignore[attr-defined]  # for wait_settled
        with self.lock:  # _read fails every waiting future once the child has ended
            alive = self.alive
            if alive:
                self.waiting[ident] = (path, future)
        try:
            if not alive:
                raise OSError("ended")
            socket.send_fds(self.slots, [b"s"], [fd])  # just before the message naming its arrays
            self.connection.send((ident, message))
        except OSError:
            with self.lock:
                self.waiting.pop(ident, None)
            if not future.done():
                future.set_exception(
                    RolloutError(f"{path}: the recording process ended; not published.", exit_code=EXIT_IO)
                )
        return future

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the child's end of file: a close gives none while _read waits on it
            self.slots.shutdown(socket.SHUT_WR)
        # Bounded (at exit too): a stopped child (SIGSTOP) held the interpreter's exit forever.
        wait_at_exit(self.process, lambda: [path for path, _ in list(self.waiting.values())])
        self.slots.close()


class _Publisher:
    def __init__(self) -> None:
        self.child: _Child | None = None
        self.count = 0
        self.held: list[Future[Path]] = []
        self.slots: list[_Slot] = []
        self.lock = threading.Lock()
        atexit.register(self.close)

    def submit(self, job: dict[str, Any]) -> Future[Path]:
        leaves: list[Any] = []
        size = [0]
        skeleton = _layout(job, leaves, size)
        with self.lock:
            self.held = [future for future in self.held if not future.done()]
            while len(self.held) >= _IN_FLIGHT:  # memory stays bounded: wait for the oldest (a bounded wait)
                wait_settled(self.held[0])
                self.held.pop(0)
            slot = self._slot(max(1, size[0]))
            slot.fill(leaves)
            if self.child is None or not self.child.alive:
                self.child = _Child()
            self.count += 1
            # the caller's folder now: a relative path means what it means here (the child started elsewhere)
            message = (slot.size, skeleton, _cwd())
            future = self.child.hand(self.count, Path(job["writer"]["path"]), slot.fd, message)
            slot.future = future
            self.held.append(future)
            return future

    def _slot(self, size: int) -> _Slot:
        """A slot no recording in flight holds, of at least ``size`` bytes (it replaces a smaller free one)."""
        free = [slot for slot in self.slots if slot.future is None or slot.future.done()]
        fitting = [slot for slot in free if slot.size >= size]
        if fitting:
            return fitting[0]
        if len(self.slots) >= _IN_FLIGHT:  # at most _IN_FLIGHT - 1 are held: one is free
            self.slots.remove(free[0])
            free[0].close()
        self.slots.append(_Slot(size))
        return self.slots[-1]

    def close(self) -> None:
        """Publish what was handed over, end the child, remove the slots."""
        with self.lock:
            child, self.child = self.child, None
            slots, self.slots = self.slots, []
        if child is not None:
            child.close()
        for slot in slots:
            slot.close()


@functools.cache
def _publisher() -> _Publisher:
    return _Publisher()


def publish(job: dict[str, Any]) -> Future[Path]:
    """Hand ``job`` (see :func:`write_recording`; numpy arrays or tensors on any device, copied before this
    returns) to the child; the future gives the published path or raises what went wrong."""
    return _publisher().submit(job)


def _cwd() -> str | None:
    """The current folder (None when it was removed: only absolute paths can be written)."""
    with contextlib.suppress(OSError):
        return os.getcwd()
    return None


def _write_slot(fd: int, size: int, skeleton: dict[str, Any], cwd: str | None) -> tuple[str, int] | None:
    """The child's work for one message: the recording the slot ``fd`` holds, written from the training process's
    folder ``cwd``; None or the error."""
    buffer = None
    try:
        if cwd is not None:
            os.chdir(cwd)
        buffer = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        write_recording(_views(skeleton, buffer))
        return None
    except RolloutError as exc:
        return (str(exc), exc.exit_code)
    except Exception as exc:  # reported to the training process, which raises it
        where = skeleton["writer"]["path"]
        return (f"{where}: cannot write the recording ({type(exc).__name__}: {exc}).", EXIT_IO)
    finally:
        if buffer is not None:
            with contextlib.suppress(BufferError):  # a view still held (by a traceback): freed with it
                buffer.close()
        os.close(fd)


class _Stop:
    """SIGTERM (a scheduler ending the job, ``docker stop``): the recording being written is finished and
    published, then the child ends; idle, it ends at once (nothing it holds has a name, nothing is left)."""

    def __init__(self) -> None:
        self.busy = self.asked = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.asked = True
        if not self.busy:
            raise SystemExit(128 + signum)

    def work(self, fn: Any, *args: Any) -> Any:
        self.busy = True
        try:
            return fn(*args)
        finally:
            self.busy = False

    def check(self) -> None:
        if self.asked:
            raise SystemExit(128 + signal.SIGTERM)


def _yield_to_training() -> None:
    """Run (this thread, those it starts and those already started: numpy's BLAS pool) only where the training
    leaves a CPU idle (Linux's SCHED_IDLE; elsewhere normal priority): woken beside torch's threads, the writer would
    hold one up at every parallel region. Held back (other processes keeping every CPU busy), it makes the loop
    wait on the two-recording bound, and the waiting loop's CPU then runs it (benchmarks/README.md)."""
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for task in tasks:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(int(task), os.SCHED_IDLE, os.sched_param(0))


def _serve(connection: Connection) -> int:
    """The child: write each recording received on ``connection`` from the slot descriptor received just before
    it; reply ``(ident, None | (message, exit code))``. Ends when the training process closes its end or is gone
    (its end closed with replies unread: a reset, not an end of file; no descriptor: an end of file)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the training loop: finish what was handed over
    _yield_to_training()
    stop = _Stop()
    slots = socket.fromfd(connection.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
    os.dup2(2, 1)  # anything printed goes to stderr, as the training process's output may be data
    while True:
        try:
            fd = socket.recv_fds(slots, 1, 1)[1][0]
            ident, (size, skeleton, cwd) = connection.recv()
        except (EOFError, OSError, IndexError):
            return 0
        try:
            stop.work(_reply, connection, ident, fd, size, skeleton, cwd)
        except OSError:  # the training process is gone (killed): the file is published, nobody to tell
            return 0
        stop.check()


def _reply(connection: Connection, ident: int, fd: int, size: int, skeleton: dict[str, Any], cwd: str | None) -> None:
    connection.send((ident, _write_slot(fd, size, skeleton, cwd)))


if __name__ == "__main__":  # the module's own copy serves, so that the messages' _Ref is the one it checks for
    from rolloutcli.record import worker

    sys.exit(worker._serve(Connection(int(sys.argv[1]))))
