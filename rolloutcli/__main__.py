"""``python -m rolloutcli`` and the ``rolloutcli`` console script.

``run`` imports the command line inside a guard, so a Ctrl-C, SIGTERM or SIGHUP while Python is still starting
up (importing typer and rich) ends with exit 130, 143 or 129 and one line, not a traceback or a silent death.
When an argument names an existing path, it first starts the metadata probe's helper (``rolloutcli.hdf5.probe``)
and, for a command that will run a local pool, the pool's process server (``rolloutcli.pipeline.preload``),
whose starts then overlap the imports instead of following them.
"""

import os
import signal
import sys


def return_freed_memory() -> None:
    """Make glibc hand freed blocks of 1 MiB and more back to the system at once, for the rest of the process.

    By default glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB); blocks
    below it then come from the heap, which shrinks only from its top. The exports allocate and free blocks of
    a few MB for every block they read, so the heap kept hundreds of MB it no longer used and the peak went past
    ``--max-memory`` (figures: benchmarks/README.md). Fixing the thresholds turns that off. Elsewhere (musl,
    macOS: no ``mallopt``) nothing is changed.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: blocks from 1 MiB up are mapped, and unmapped when freed
    mallopt(-1, 2 << 20)  # M_TRIM_THRESHOLD: a free heap top past 2 MiB is returned


def _names_a_path(args: list[str]) -> bool:
    if any(arg in ("-h", "--help", "--version") for arg in args):
        return False
    return any(not arg.startswith("-") and os.path.exists(arg) for arg in args[1:])


class _StartStopped(BaseException):
    """SIGTERM or SIGHUP before the command line's own handlers are in place (Python still importing)."""


def _start_stopped(signum: int, frame: object) -> None:
    raise _StartStopped(signum)


def run() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):  # replaced by the command line's handlers once it is imported
        signal.signal(sig, _start_stopped)
    try:
        return_freed_memory()
        if _names_a_path(sys.argv[1:]):
            from rolloutcli.hdf5.probe import start_helper

            start_helper()
            from rolloutcli.pipeline.preload import start_early

            start_early(sys.argv[1:])
        from rolloutcli.cli.app import main

        main()  # ends the process itself; a Ctrl-C before its handlers are in place lands below
    except KeyboardInterrupt:
        sys.stderr.write("interrupted: no output was written.\n")
        os._exit(130)
    except _StartStopped as stop:  # ends at once: modules may be half-imported
        what = "hangup" if stop.args[0] == signal.SIGHUP else "terminated"
        sys.stderr.write(f"{what}: no output was written.\n")
        os._exit(128 + stop.args[0])
    except (MemoryError, ImportError) as exc:  # an import under a low `ulimit -v` fails for want of memory
        from rolloutcli.errors import out_of_memory

        if isinstance(exc, ImportError) and not out_of_memory(exc):
            raise
        sys.stderr.write("error: out of memory; raise the memory limit (ulimit -v) or lower --max-memory.\n")
        os._exit(3)


if __name__ == "__main__":
    run()
