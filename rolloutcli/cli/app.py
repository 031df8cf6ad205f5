"""The ``rolloutcli`` typer app: the commands registered, ``main`` mapping every outcome to an exit code.

Nothing here computes. Heavy modules (torch, h5py, the pipelines) are imported inside the commands so that
``rolloutcli --help`` stays fast. Every outcome maps to an exit code (``errors.py``): a ``RolloutError`` or a
usage error is one line on stderr; Ctrl-C exits 130, SIGHUP 129 and SIGTERM 143, after removing temporary
outputs; ``ROLLOUTCLI_DEBUG=1`` adds the traceback of an error.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import traceback
from typing import Annotated, Any

import typer

from rolloutcli.cli import batch, derive, export, importer, inspect, plot, split, stats
from rolloutcli.cli import signals as cli_signals
from rolloutcli.cli.common import GuardedStdout, RunState, StdoutClosed
from rolloutcli.cli.helpformat import Command
from rolloutcli.cli.signals import say, stopped
from rolloutcli.errors import (
    EXIT_INTERRUPTED,
    EXIT_IO,
    EXIT_USAGE,
    RolloutError,
    Signalled,
    forget_signal,
    out_of_memory,
    stop_if_signalled,
)


def _example(command: str) -> str:
    """A help text's closing example, kept on one line (``\\b``: click does not rewrap it)."""
    return f"\b\nExample:\n  {command}"


app = typer.Typer(
    name="rolloutcli",
    help="Turn recorded RL rollouts (HDF5, [T, N, ...]) into training data, matching RSL-RL.",
    epilog=_example("rolloutcli inspect sample_data/cartpole_gru.h5"),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: option names are never cut at 80 columns
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)


def _version(value: bool) -> None:
    if value:
        from rolloutcli import __version__

        print(f"rolloutcli {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Turn recorded RL rollouts (HDF5, [T, N, ...]) into training data, matching RSL-RL.

    Exit codes: 0 ok, 1 bad data, 2 usage, 3 I/O fault, 4 refused as unsafe, 129/130/143 hangup, Ctrl-C, SIGTERM.
    """


# The commands, in the order of ``--help``; each module declares its options and its example.
app.command(cls=Command, epilog=_example(inspect.EXAMPLE))(inspect.inspect)
app.command(cls=Command, epilog=_example(derive.GAE_EXAMPLE))(derive.gae)
app.command(cls=Command, epilog=_example(split.EXAMPLE))(split.split)
app.command(cls=Command, epilog=_example(batch.EXAMPLE))(batch.batch)
app.command(name="import", cls=Command, epilog=_example(importer.EXAMPLE))(importer.import_command)
app.command(cls=Command, epilog=_example(export.EXAMPLE))(export.export)
app.command(cls=Command, epilog=_example(derive.NSTEP_EXAMPLE))(derive.nstep)
app.command(cls=Command, epilog=_example(stats.EXAMPLE))(stats.stats)
app.command(cls=Command, epilog=_example(plot.EXAMPLE))(plot.plot)
app.command(cls=Command, epilog=_example(derive.RETURNS_EXAMPLE))(derive.returns)


def _usage_line(error: Any) -> str:
    """A usage error from the option parser (click, vendored by typer) as one line like ours."""
    message = error.format_message().replace("Value error, ", "")
    choice = re.search(r"'([^']*)' is not one of (.*)\.$", message)
    opts = getattr(getattr(error, "param", None), "opts", None)
    if choice and opts:
        choices = re.findall(r"'([^']*)'", choice.group(2))
        expected = " or ".join([", ".join(choices[:-1]), choices[-1]] if len(choices) > 1 else choices)
        message = f"{max(opts, key=len)}: expected {expected}, found '{choice.group(1)}'."
    command = getattr(getattr(error, "ctx", None), "command_path", "rolloutcli")
    return f"error: {message} (see {command} --help)"


def _run(args: list[str]) -> int:
    """Run the app on ``args``; the exit code of every outcome but a RolloutError."""
    try:
        result = app(args=args, prog_name="rolloutcli", standalone_mode=False)
        code = result if isinstance(result, int) else 0
        if code == EXIT_INTERRUPTED:  # click turns Ctrl-C into a return of 130
            raise KeyboardInterrupt
        stop_if_signalled()  # a signal whose exception was lost or held back
        sys.stdout.flush()  # a full disk under `> report.json` shows here, as an I/O fault
        return code
    except StdoutClosed:
        return 0  # `| head`: the reader has what it wanted
    except typer.Exit as done:
        return done.exit_code
    except (typer.Abort, KeyboardInterrupt):
        say(stopped(EXIT_INTERRUPTED))
        return EXIT_INTERRUPTED
    except Signalled as stop:
        say(stopped(stop.code))
        return stop.code
    except MemoryError:
        say("error: out of memory; lower --max-memory.")
        return EXIT_IO
    except ImportError as failed:  # a library that cannot be mapped under a low `ulimit -v`
        if not out_of_memory(failed):
            raise
        say("error: out of memory while loading a library; raise the memory limit (ulimit -v).")
        return EXIT_IO
    except Exception as other:
        if not (hasattr(other, "format_message") and hasattr(other, "exit_code")):
            raise
        if type(other).__name__ == "NoArgsIsHelpError":  # plain `rolloutcli`: the help, on stderr
            sys.stderr.write(other.format_message() + "\n")
        else:
            say(_usage_line(other))
        return EXIT_USAGE if other.exit_code == 2 else other.exit_code


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and map every outcome to an exit code.

    Without ``argv`` (the console script) it ends the process itself with ``os._exit`` (see ``_exit_now``);
    with ``argv`` (tests, embedding) it only returns the code.
    """
    RunState.begin()
    own_process = argv is None
    args = list(sys.argv[1:] if argv is None else argv)
    if sys.stderr is None:  # started with 2>&-
        sys.stderr = open(os.devnull, "w")  # for the life of the process
    forget_signal()
    cli_signals.arm(own_process)
    previous = {sig: signal.signal(sig, cli_signals.on_signal) for sig in cli_signals.CODES}
    previous_hook, sys.unraisablehook = sys.unraisablehook, cli_signals.quiet_unraisable(sys.unraisablehook)
    real_stdout = sys.stdout
    sys.stdout = GuardedStdout(real_stdout)
    try:
        code = _run(args)
    except RolloutError as error:
        if os.environ.get("ROLLOUTCLI_DEBUG"):
            traceback.print_exc()
        say(f"error: {error}")
        code = error.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C while the first was being reported
        code = EXIT_INTERRUPTED
    except Signalled as stop:
        code = stop.code
    finally:
        sys.stdout = real_stdout
        cli_signals.cleanup()
        cli_signals.disarm()
        for sig, handler in previous.items():  # the process itself ends now: a late signal changes nothing
            signal.signal(sig, signal.SIG_IGN if own_process else handler)
        sys.unraisablehook = previous_hook
        forget_signal()  # an embedding program's next library call must not stop for this command's signal
    if own_process:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process at once (no interpreter shutdown: h5py may crash there after a failed write)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
