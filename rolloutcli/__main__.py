"""``python -m rolloutcli`` and the ``rolloutcli`` console script.

``run`` imports the command line inside a guard, so a Ctrl-C while Python is still starting up (importing
typer and rich) ends with exit 130 and one line, not a KeyboardInterrupt traceback. A command that reads HDF5
files starts its metadata probe's helper interpreter first (``probe.start_helper``), so the helper's own start-up
runs on another CPU while this process imports the command line.
"""

import os
import sys

# The commands that open HDF5 files (each file's metadata is probed first, in the helper's children).
READS_FILES = frozenset({"inspect", "gae", "split", "batch", "import", "nstep", "stats", "plot", "returns"})


def reads_files(args: list[str]) -> bool:
    """Whether ``rolloutcli ARGS`` runs a command that opens files (not its help)."""
    return bool(args) and args[0] in READS_FILES and not {"-h", "--help"}.intersection(args)


def run() -> None:
    try:
        if reads_files(sys.argv[1:]):
            from rolloutcli.hdf5.probe import start_helper

            start_helper()
        from rolloutcli.cli import main

        main()  # ends the process itself; a Ctrl-C before its handlers are in place lands below
    except KeyboardInterrupt:
        sys.stderr.write("interrupted: no output was written.\n")
        os._exit(130)
    except (MemoryError, ImportError) as exc:  # an import under a low `ulimit -v` fails for want of memory
        from rolloutcli.errors import out_of_memory

        if isinstance(exc, ImportError) and not out_of_memory(exc):
            raise
        sys.stderr.write("error: out of memory; raise the memory limit (ulimit -v) or lower --max-memory.\n")
        os._exit(3)


if __name__ == "__main__":
    run()
