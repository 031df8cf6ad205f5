"""The ``rolloutcli`` command line: parse options, call one pipeline function, render its result.

Nothing here computes. Heavy modules (torch, h5py, the pipelines) are imported inside the commands so
that ``rolloutcli --help`` stays fast. Errors: a ``RolloutError`` is printed as one line on stderr and
exits with its code (1 bad data, 2 usage, 3 I/O fault, 4 refused as unsafe); Ctrl-C exits 130 and
SIGTERM 143, after removing temporary outputs; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from rolloutcli.errors import EXIT_INTERRUPTED, EXIT_IO, EXIT_TERMINATED, EXIT_USAGE, RolloutError, one_line

app = typer.Typer(
    name="rolloutcli",
    help="Turn recorded RL rollouts (HDF5, [T, N, ...]) into training data, matching RSL-RL.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

stdout = Console(highlight=False, soft_wrap=True)
stderr = Console(stderr=True, highlight=False)

# Options every command shares.
DeviceOpt = Annotated[str, typer.Option("--device", help="auto (CUDA when available), cpu, cuda or cuda:<i>.")]
GaeDeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        help="auto (= cpu: GAE on a file runs at memory speed there, a GPU would add two PCIe copies), cpu, "
        "cuda or cuda:<i>.",
    ),
]
MemoryOpt = Annotated[str, typer.Option("--max-memory", help="Block budget for streaming, e.g. 64K, 256M, 2G.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the traceback of an error.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")]
ExternalOpt = Annotated[
    bool,
    typer.Option("--allow-external", help="Trust soft/external links, external storage and virtual datasets."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object to stdout.")]


# Test hook (documented in docs/promises.md): when set to a number of seconds, the first block of every
# command prints one line "rolloutcli: test pause after block 1 ..." on stderr and sleeps, so a test can
# signal the process while its output is half written.
TEST_PAUSE_ENV = "ROLLOUTCLI_TEST_PAUSE_AFTER_BLOCK"


class RichProgress:
    """A ``Progress`` that draws a rich bar on stderr (nothing when quiet or not a terminal)."""

    def __init__(self, quiet: bool) -> None:
        self.enabled = not quiet and stderr.is_terminal  # rich would still print a blank line into a pipe
        self._bar: Any = None
        self._task: Any = None
        self._pause = float(os.environ.get(TEST_PAUSE_ENV) or 0)

    def start(self, description: str, total: int) -> None:
        if not self.enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.finish()
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=stderr,
            transient=True,
        )
        self._bar.start()
        self._task = self._bar.add_task(description, total=total)

    def advance(self, amount: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, amount)
        if self._pause > 0:
            self._test_pause()

    def _test_pause(self) -> None:
        """The ``ROLLOUTCLI_TEST_PAUSE_AFTER_BLOCK`` hook: announce the first block on stderr, then sleep."""
        import time

        from rolloutcli.hdf5.atomic import live_temporaries

        pause, self._pause = self._pause, 0.0
        writing = " ".join(sorted(os.path.basename(p) for p in live_temporaries())) or "nothing"
        sys.stderr.write(f"rolloutcli: test pause after block 1 (writing {writing})\n")
        sys.stderr.flush()
        time.sleep(pause)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def warn(self, message: str) -> None:
        """Warnings are shown even with --quiet: they are about the data, not progress."""
        stderr.print(f"warning: {message}", markup=False, highlight=False, soft_wrap=True)


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

    Exit codes: 0 ok, 1 bad data, 2 usage, 3 I/O fault, 4 refused as unsafe, 130/143 interrupted.
    """


def _options(device: str, max_memory: str, allow_external: bool, auto: str | None = None) -> Any:
    from rolloutcli.pipeline.options import RunOptions

    return RunOptions.from_cli(device, max_memory, allow_external, auto=auto)


@app.command()
def inspect(
    file: Annotated[Path, typer.Argument(help="Rollout file (.h5).")],
    json_output: JsonOpt = False,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 when the data has problems.")] = False,
    device: DeviceOpt = "auto",
    max_memory: MemoryOpt = "1G",
    allow_external: ExternalOpt = False,
    debug: DebugOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Show what a rollout file holds: fields, episodes, reward/value statistics, warnings."""
    from rolloutcli.pipeline.inspect import run_inspect
    from rolloutcli.render import render_inspect

    report = run_inspect(file, _options(device, max_memory, allow_external), RichProgress(quiet))
    if json_output:
        print(json.dumps(report, default=str))
    else:
        render_inspect(stdout, report)
    if strict and report["warnings"]:
        raise RolloutError(f"{file}: --strict: {len(report['warnings'])} warnings (listed above).")


OutputOpt = Annotated[Path | None, typer.Option("--output", "-o", help="Output file (never the input).")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output.")]


@app.command()
def gae(
    file: Annotated[Path, typer.Argument(help="Rollout file (.h5) with values and last_values.")],
    output: OutputOpt = None,
    gamma: Annotated[float, typer.Option("--gamma", help="Discount factor.")] = 0.99,
    lam: Annotated[float, typer.Option("--lam", help="GAE lambda.")] = 0.95,
    normalize: Annotated[
        bool, typer.Option("--normalize/--no-normalize", help="Normalise advantages (mean 0, std 1).")
    ] = True,
    bootstrap_timeouts: Annotated[
        bool | None,
        typer.Option(
            "--bootstrap-timeouts/--no-bootstrap-timeouts",
            help="r += gamma * V * time_out (default: on when time_outs exists; never twice).",
        ),
    ] = None,
    last_values: Annotated[
        str, typer.Option("--last-values", help="recorded (require the dataset) or zero (end is terminal).")
    ] = "recorded",
    in_place: Annotated[bool, typer.Option("--in-place", help="Add the results to FILE itself (atomically).")] = False,
    overwrite: OverwriteOpt = False,
    json_output: JsonOpt = False,
    device: GaeDeviceOpt = "auto",
    max_memory: MemoryOpt = "1G",
    allow_external: ExternalOpt = False,
    debug: DebugOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Compute GAE advantages and returns exactly as RSL-RL does; write FILE + advantages, returns."""
    from rolloutcli.pipeline.gae import GaeOptions, run_gae
    from rolloutcli.render import render_gae

    if in_place and output is not None:
        raise RolloutError("gae: expected either -o OUT.h5 or --in-place, found both.", exit_code=EXIT_USAGE)
    options = GaeOptions(gamma, lam, normalize, bootstrap_timeouts, last_values)
    summary = run_gae(
        file,
        output,
        options,
        _options(device, max_memory, allow_external, auto="cpu"),
        overwrite=overwrite,
        in_place=in_place,
        progress=RichProgress(quiet),
    )
    if json_output:
        print(json.dumps(summary, default=str))
    else:
        render_gae(stdout, summary)


@app.command()
def split(
    file: Annotated[Path, typer.Argument(help="Rollout file (.h5), or with --unpad a file written by split.")],
    output: OutputOpt = None,
    pad_to: Annotated[
        str, typer.Option("--pad-to", help="rollout (L = T, as RSL-RL) or longest (L = longest trajectory).")
    ] = "rollout",
    max_length: Annotated[
        int | None, typer.Option("--max-length", help="Cut trajectories into segments of at most K steps.")
    ] = None,
    unpad: Annotated[bool, typer.Option("--unpad", help="Restore the [T, N, ...] rollout from split output.")] = False,
    overwrite: OverwriteOpt = False,
    json_output: JsonOpt = False,
    device: DeviceOpt = "auto",
    max_memory: MemoryOpt = "1G",
    allow_external: ExternalOpt = False,
    debug: DebugOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Split every per-step field into trajectories at dones, padded as RSL-RL does (or undo it)."""
    from rolloutcli.pipeline.split import SplitOptions, run_split, run_unpad
    from rolloutcli.render import render_split

    if output is None:
        raise RolloutError("split: expected an output path (-o OUT.h5), found none.", exit_code=EXIT_USAGE)
    run = _options(device, max_memory, allow_external)
    progress = RichProgress(quiet)
    if unpad:
        summary = run_unpad(file, output, run, overwrite=overwrite, progress=progress)
    else:
        summary = run_split(file, output, SplitOptions(pad_to, max_length), run, overwrite=overwrite, progress=progress)
    if json_output:
        print(json.dumps(summary, default=str))
    else:
        render_split(stdout, summary)


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(EXIT_TERMINATED)


class _GuardedStdout:
    """``sys.stdout`` while a command runs: a failed write (disk full, EFBIG, closed pipe) becomes an I/O fault.

    ``rolloutcli inspect --json > report.json`` on a full disk must end with one line and exit 3, not a
    traceback or Python's "Exception ignored" at exit.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _guard(self, action: str, *args: Any) -> Any:
        try:
            return getattr(self._stream, action)(*args)
        except OSError as exc:
            raise RolloutError(
                f"cannot write the results to stdout: {exc.strerror or exc}.", exit_code=EXIT_IO
            ) from exc

    def write(self, text: str) -> int:
        return self._guard("write", text)

    def flush(self) -> None:
        self._guard("flush")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and map every outcome to an exit code.

    Called without ``argv`` (the console script, ``python -m rolloutcli``) it owns the process and ends it
    with ``os._exit`` after cleaning up and flushing: h5py can crash the interpreter at exit after a failed
    write (disk full), and after a success the shutdown would only spend time freeing memory. Called with
    ``argv`` (tests, embedding) it only returns the code.
    """
    own_process = argv is None
    args = list(sys.argv[1:] if argv is None else argv)
    # Transparent huge pages for torch's large CPU allocations: fresh multi-MB output buffers (split's padded
    # trajectories, shard buffers) page-fault 3-5x faster. Read once by torch, so set before it is imported.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    # torch's OpenMP workers otherwise spin for milliseconds after each op, stealing the core that the
    # GAE kernel's second thread runs on (measured: up to 8 ms per call).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    debug = "--debug" in args
    previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    real_stdout = sys.stdout
    sys.stdout = _GuardedStdout(real_stdout)
    code = 0
    try:
        result = app(args=args, prog_name="rolloutcli", standalone_mode=False)
        code = result if isinstance(result, int) else 0
        if code == EXIT_INTERRUPTED:  # typer turns Ctrl-C into a silent return of 130
            stderr.print("interrupted: no output was written (temporary files removed).")
        sys.stdout.flush()  # a full disk under `> report.json` shows here, as an I/O fault
    except RolloutError as error:
        if debug:
            traceback.print_exc()
        stderr.print(f"error: {one_line(str(error))}", markup=False, highlight=False, soft_wrap=True)
        code = error.exit_code
    except typer.Exit as done:
        code = done.exit_code
    except (typer.Abort, KeyboardInterrupt):
        stderr.print("interrupted: no output was written (temporary files removed).")
        code = EXIT_INTERRUPTED
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
        if code == EXIT_TERMINATED:
            stderr.print("terminated: no output was written (temporary files removed).")
    except MemoryError:
        stderr.print("error: out of memory; lower --max-memory.")
        code = EXIT_IO
    except Exception as other:
        if not (hasattr(other, "show") and hasattr(other, "exit_code")):
            raise
        other.show(file=sys.stderr)  # a usage error from the option parser (click, vendored or not)
        code = EXIT_USAGE if other.exit_code == 2 else other.exit_code
    finally:
        from rolloutcli.hdf5.atomic import remove_live_temporaries

        sys.stdout = real_stdout
        # A second Ctrl-C / SIGTERM must not interrupt the cleanup itself.
        previous_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        remove_live_temporaries()
        signal.signal(signal.SIGINT, previous_sigint)
        signal.signal(signal.SIGTERM, previous_sigterm)
    if own_process:
        # Success too: every output is published (fsynced, renamed) and closed by now, and the interpreter's
        # shutdown only frees memory (with numba and LLVM loaded: ~0.15 s, measured on `gae`).
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process at once (no interpreter shutdown: h5py may crash there after a failed write)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


from rolloutcli.cli_batch import batch  # noqa: E402 - registered after the shared options exist

app.command()(batch)
