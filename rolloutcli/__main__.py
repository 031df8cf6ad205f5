"""``python -m rolloutcli`` and the ``rolloutcli`` console script.

``run`` imports the command line inside a guard, so a Ctrl-C while Python is still starting up (importing
typer and rich) ends with exit 130 and one line, not a KeyboardInterrupt traceback.
"""

import os
import sys


def run() -> None:
    try:
        from rolloutcli.cli import main

        main()  # ends the process itself; a Ctrl-C before its handlers are in place lands below
    except KeyboardInterrupt:
        sys.stderr.write("interrupted: no output was written.\n")
        os._exit(130)


if __name__ == "__main__":
    run()
