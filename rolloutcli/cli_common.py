"""What every ``rolloutcli`` command shares: option declarations, choices, and how a result reaches stdout.

Choices are enums and ranges are typer's: a bad value is a usage error (exit 2) before any file is touched.
"""

from __future__ import annotations

import enum
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from rolloutcli.errors import EXIT_IO, EXIT_USAGE, RolloutError
from rolloutcli.render import printable, stdout, to_json

MAX_COUNT = (1 << 62) - 1  # upper bound of counts and lengths: far beyond any file, inside int64
MAX_SEED = (1 << 63) - 1  # torch seeds and HDF5 int64 attributes hold it


class Compression(str, enum.Enum):
    lzf = "lzf"
    gzip = "gzip"


class PadTo(str, enum.Enum):
    rollout = "rollout"
    longest = "longest"


class LastValues(str, enum.Enum):
    recorded = "recorded"
    zero = "zero"


class Timeouts(str, enum.Enum):
    rsl = "rsl"
    final_value = "final-value"
    proper = "proper"
    ignore = "ignore"


def flag(*names: str, text: str) -> Any:
    """A boolean option (a type alias, for a parameter defaulting to False)."""
    return Annotated[bool, typer.Option(*names, help=text)]


def count_option(*names: str, text: str, low: int = 1, high: int = MAX_COUNT, **more: Any) -> Any:
    """An integer option in [low, high]; the upper bound keeps huge values (10**30) from overflowing later."""

    def at_most(value: int | None) -> int | None:
        if value is not None and value > high:
            raise typer.BadParameter(f"expected at most {high}, found {value}.")
        return value

    return typer.Option(*names, min=low, callback=at_most, help=text, **more)


def _not_stdout(value: Path | None) -> Path | None:
    if value is not None and str(value) == "-":
        raise RolloutError(
            "-o: expected a path, found '-' (outputs are HDF5 files or folders, never stdout).", exit_code=EXIT_USAGE
        )
    return value


FileOutputOpt = Annotated[
    Path | None,
    typer.Option("--output", "-o", metavar="OUT.h5", callback=_not_stdout, help="Output file (never the input)."),
]
FolderOutputOpt = Annotated[
    Path | None,
    typer.Option(
        "--output", "-o", metavar="FOLDER", callback=_not_stdout, help="Output folder: shards and manifest.json."
    ),
]
OverwriteOpt = flag(
    "--overwrite", text="Replace an earlier output (a folder only if rolloutcli wrote it, holding no input)."
)
JsonOpt = flag("--json", text="Print one JSON object to stdout (NaN and Inf as null).")
QuietOpt = flag("--quiet", "-q", text="Print nothing but errors and --json output.")
MemoryOpt = Annotated[
    str, typer.Option("--max-memory", metavar="SIZE", help="Memory budget of one block: 64K, 256M, 2G ...")
]
ExternalOpt = flag("--allow-external", text="Trust soft/external links, external storage and virtual datasets.")
DeviceOpt = Annotated[
    str,
    typer.Option("--device", metavar="DEVICE", help="auto (CUDA when available), cpu, cuda, cuda:<i>."),
]


def run_options(max_memory: str, allow_external: bool, device: str = "cpu") -> Any:
    """The shared options resolved (sizes parsed, the device checked) before any file is opened."""
    from rolloutcli.pipeline.options import RunOptions

    return RunOptions.from_cli(device, max_memory, allow_external)


class RunState:
    """What ``main`` needs to know about the command in flight: when it started, what it published."""

    started: float = time.perf_counter()
    published: str | None = None
    interrupted: bool = False

    @classmethod
    def begin(cls) -> None:
        cls.started, cls.published, cls.interrupted = time.perf_counter(), None, False


class StdoutClosed(Exception):
    """The reader of stdout went away (``| head``): the command ends quietly, as other Unix tools do."""


class GuardedStdout:
    """``sys.stdout`` while a command runs: a failed write (disk full, closed fd) is an I/O fault (exit 3),
    a closed pipe raises ``StdoutClosed``; a closed descriptor fails only when something is written.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _guard(self, action: str, *args: Any) -> Any:
        if self._stream is None:
            raise RolloutError("cannot write the results to stdout: it is closed.", exit_code=EXIT_IO)
        try:
            return getattr(self._stream, action)(*args)
        except BrokenPipeError as exc:
            raise StdoutClosed from exc
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise RolloutError(f"cannot write the results to stdout: {reason}.", exit_code=EXIT_IO) from exc

    def write(self, text: str) -> int:
        return self._guard("write", text)

    def flush(self) -> None:
        if self._stream is not None:  # nothing to flush into a closed descriptor until something is written
            self._guard("flush")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def emit(
    summary: dict[str, Any], render: Callable[..., None], json_output: bool, quiet: bool, output: Path | None = None
) -> None:
    """Print a command's result: JSON, the human summary, or nothing with ``--quiet``. ``seconds`` is the
    whole command's time; a failure to print after ``output`` was published says the output is complete."""
    RunState.published = str(output) if output is not None else None
    seconds = summary["seconds"] = time.perf_counter() - RunState.started
    if "gb_per_s" in summary:
        summary["gb_per_s"] = summary["bytes_written"] / seconds / 1e9 if seconds > 0 else None
    try:
        if json_output:
            print(to_json(summary))
        elif not quiet:
            render(stdout, printable(summary))
        sys.stdout.flush()  # a full disk under `> summary.txt` shows here
    except RolloutError as error:
        if output is None:
            raise
        raise RolloutError(f"{error} The output {output} is complete.", exit_code=error.exit_code) from error
