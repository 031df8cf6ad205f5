"""What every ``rolloutcli`` command shares: option declarations, choices, and how a result reaches stdout.

Choices are enums and ranges are typer's: a bad value is a usage error (exit 2) before any file is touched.
"""

from __future__ import annotations

import enum
import functools
import inspect
import sys
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from rolloutcli.cli.render import json_pieces, printable, stdout
from rolloutcli.errors import EXIT_IO, EXIT_USAGE, RolloutError

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


def not_stdout(option: str, what: str) -> Callable[[Path | None], Path | None]:
    """A callback refusing ``-`` for the output path ``option`` (exit 2): ``what`` the output is instead; stdout
    carries the summary, and binary data there would mix with it (a file named ``-`` would surprise)."""

    def check(value: Path | None) -> Path | None:
        if value is not None and str(value) == "-":
            raise RolloutError(f"{option}: expected a path, found '-' ({what}, never stdout).", exit_code=EXIT_USAGE)
        return value

    return check


_not_stdout = not_stdout("-o", "outputs are HDF5 files or folders")


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
OverwriteFileOpt = flag("--overwrite", text="Replace an earlier output file (never an input).")
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


EngineOpt = Annotated[str, typer.Option("--engine", metavar="local|ray", help="Run work units locally or on Ray.")]
WorkersOpt = Annotated[int, typer.Option("--workers", min=1, max=1024, help="Processes of the local engine.")]
AddressOpt = Annotated[
    str | None, typer.Option("--address", metavar="ADDR", help="--engine ray: cluster address (auto, ray://h:p).")
]
LockingOpt = Annotated[
    bool | None,
    typer.Option(
        "--hdf5-locking/--no-hdf5-locking",
        help="HDF5 file locking in every worker (off for network file systems).",
        show_default=False,
    ),
]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue a dataset run's partial output folder.")]

InPlaceOpt = flag("--in-place", text="Add the results to FILE itself (atomically).")


class SplitBy(str, enum.Enum):
    episode = "episode"
    env = "env"


ValidFractionOpt = Annotated[
    float,
    typer.Option("--valid-fraction", metavar="F", min=0.0, max=0.999999, help="Share held out for validation."),
]
SplitByOpt = Annotated[SplitBy, typer.Option("--split-by", help="Hold out whole episodes or whole envs.")]

# The option groups `with_common` appends to a command: (parameter, declaration, default).
_IN_PLACE = [("in_place", InPlaceOpt, False)]
_OVERWRITE = [("overwrite", OverwriteOpt, False)]
_OVERWRITE_FILE = [("overwrite", OverwriteFileOpt, False)]  # commands whose output is always one file
_DEVICE = [("device", DeviceOpt, "auto")]
_RESUME = [("resume", ResumeOpt, False)]
_ENGINE = [("engine", EngineOpt, "local"), ("workers", WorkersOpt, 1), ("address", AddressOpt, None)]
_ENGINE += [("hdf5_locking", LockingOpt, None)]
_BASE = [("json_output", JsonOpt, False), ("max_memory", MemoryOpt, "1G"), ("allow_external", ExternalOpt, False)]
_BASE += [("quiet", QuietOpt, False)]


@dataclass(frozen=True)
class Common:
    """The options every command shares, as one argument ``common`` of the command function."""

    json_output: bool
    max_memory: str
    allow_external: bool
    quiet: bool
    engine: Any = None  # EngineOptions, checked, for the commands that run datasets on an engine
    resume: bool = False
    in_place: bool = False
    overwrite: bool = False
    device: str = "cpu"  # --device where a command has it; the others compute on the CPU

    def run(self) -> Any:
        return run_options(self.max_memory, self.allow_external, self.device)

    def progress(self) -> Any:
        from rolloutcli.cli.render import RichProgress

        return RichProgress(self.quiet)

    def dataset_progress(self) -> Any:
        from rolloutcli.cli.render import DatasetProgress

        return DatasetProgress(self.quiet)

    def emit(self, summary: dict[str, Any], render: Callable[..., None], output: Path | None = None) -> None:
        emit(summary, render, self.json_output, self.quiet, output)

    def write(
        self, render: Callable[..., None], output: Path | None, fn: Callable[..., Any], *args: Any, **more: Any
    ) -> Any:
        """An output command's tail: ``fn(*args, run, overwrite=, progress=, **more)``, then its summary on
        stdout (``output`` is what it published, if anything)."""
        summary = fn(*args, self.run(), overwrite=self.overwrite, progress=self.progress(), **more)
        self.emit(summary, render, output)
        return summary


def need_output(output: Path | None, command: str, what: str) -> Path:
    """``output``, or a usage error (exit 2) naming what ``-o`` should have given."""
    if output is None:
        raise RolloutError(f"{command}: expected {what}, found none.", exit_code=EXIT_USAGE)
    return output


def with_common(
    *,
    in_place: bool = False,
    overwrite: bool | str = False,
    device: bool = False,
    engine: bool = False,
    resume: bool = False,
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command function ``fn(..., common: Common)`` the shared options as typer parameters after its own:
    ``--in-place``, ``--overwrite`` (``"file"``: its help speaks of a file only), ``--device``, ``--resume``,
    the engine's, then ``--json``, ``--max-memory``, ``--allow-external``, ``-q``."""
    replace = _OVERWRITE_FILE if overwrite == "file" else _OVERWRITE
    wanted = ((in_place, _IN_PLACE), (overwrite, replace), (device, _DEVICE), (resume, _RESUME), (engine, _ENGINE))
    groups = [option for on, group in wanted if on for option in group] + _BASE

    def wrap(fn: Callable[..., None]) -> Callable[..., None]:
        hints = typing.get_type_hints(fn, include_extras=True)
        own = [p.replace(annotation=hints[p.name]) for p in inspect.signature(fn).parameters.values()]
        own = [p for p in own if p.name != "common"]
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        added = [inspect.Parameter(name, kind, default=default, annotation=ann) for name, ann, default in groups]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> None:
            shared = {name: kwargs.pop(name) for name, _, _ in groups}
            if not engine:
                fn(**kwargs, common=Common(**shared))
                return
            from rolloutcli.pipeline.engine import close_pools

            shared["engine"] = engine_options(*[shared.pop(name) for name, _, _ in _ENGINE])
            try:
                fn(**kwargs, common=Common(**shared))
            finally:  # also a pool started early for a command that then failed
                close_pools()

        command.__signature__ = inspect.Signature(own + added)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in own + added}
        return command

    return wrap


def engine_options(engine: str, workers: int, address: str | None, locking: bool | None) -> Any:
    """The engine options, checked (exit 2)."""
    from rolloutcli.pipeline.engine import EngineOptions, check_engine

    options = EngineOptions(engine, workers, address, locking)
    check_engine(options)
    return options


def run_options(max_memory: str, allow_external: bool, device: str = "cpu") -> Any:
    """The shared options resolved (sizes parsed, the device checked) before any file is opened."""
    from rolloutcli.pipeline.options import RunOptions

    return RunOptions.from_cli(device, max_memory, allow_external)


class RunState:
    """What ``main`` needs to know about the command in flight: when it started, what it published."""

    started: float = time.perf_counter()
    published: str | None = None
    kept: str | None = None  # a dataset run's partial folder, kept with its finished outputs for --resume

    @classmethod
    def begin(cls) -> None:
        cls.started, cls.published, cls.kept = time.perf_counter(), None, None


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
            for piece in json_pieces(summary):  # never the whole text at once: a dataset's report is large
                sys.stdout.write(piece)
            sys.stdout.write("\n")
        elif not quiet:
            render(stdout, printable(summary))
        sys.stdout.flush()  # a full disk under `> summary.txt` shows here
    except RolloutError as error:
        if output is None:
            raise
        raise RolloutError(f"{error} The output {output} is complete.", exit_code=error.exit_code) from error
