"""The ``rolloutcli`` command line: parse options, call one pipeline function, render its result.

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
from pathlib import Path
from typing import Annotated, Any

import typer

from rolloutcli import cli_nstep, cli_plot, cli_signals, cli_stats
from rolloutcli.cli_batch import batch
from rolloutcli.cli_common import (
    Common,
    FileOutputOpt,
    GuardedStdout,
    LastValues,
    PadTo,
    RunState,
    StdoutClosed,
    Timeouts,
    count_option,
    flag,
    need_output,
    with_common,
)
from rolloutcli.cli_dataset import (
    FilesArg,
    derive_command,
    per_file,
    render_dataset,
    render_inspect_dataset,
    resolve_inputs,
)
from rolloutcli.cli_import import import_command
from rolloutcli.cli_returns import EXAMPLE as RETURNS_EXAMPLE
from rolloutcli.cli_returns import returns
from rolloutcli.cli_signals import say, stopped
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

FileArg = Annotated[Path, typer.Argument(metavar="FILE", help="Rollout file (.h5).", show_default=False)]
UnitFloat = dict(min=0.0, max=1.0)


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


@app.command(epilog=_example("rolloutcli inspect sample_data/cartpole_gru.h5 --json"))
@with_common()
def inspect(
    files: FilesArg,
    strict: flag("--strict", text="Exit 1 when the data has problems.") = False,
    per_dim: flag("--per-dim", text="Per-dimension mean/std/min/max of observations and actions.") = False,
    *,
    common: Common,
) -> None:
    """Show what a rollout file holds: fields, episodes, reward/value statistics, warnings."""
    from rolloutcli.pipeline.inspect import run_inspect
    from rolloutcli.render import render_inspect

    if len(files) == 1 and (Path(files[0]) / "manifest.json").is_file():  # a shard folder, not a dataset
        dataset, file = None, Path(files[0])
    else:
        dataset = resolve_inputs(files)
        file = dataset.files[0] if not dataset.many else dataset.root
    if dataset is not None and dataset.many:
        from rolloutcli.pipeline.inspect_dataset import run_inspect_dataset

        report, render = (
            run_inspect_dataset(dataset, common.run(), common.progress(), per_dim=per_dim),
            render_inspect_dataset,
        )
    else:
        report, render = run_inspect(file, common.run(), common.progress(), per_dim=per_dim), render_inspect
    common.emit(report, cli_stats.with_per_dim(render) if per_dim else render)
    if strict and report["warnings"]:
        where = "run without -q to see them" if common.quiet and not common.json_output else "listed above"
        raise RolloutError(f"{file}: --strict: {len(report['warnings'])} warnings ({where}).")


@app.command(epilog=_example("rolloutcli gae sample_data/cartpole_gru.h5 -o run_gae.h5 --gamma 0.99 --lam 0.95"))
@with_common(in_place=True, overwrite=True, engine=True, resume=True)
def gae(
    files: FilesArg,
    output: FileOutputOpt = None,
    gamma: Annotated[float, typer.Option("--gamma", help="Discount factor.", **UnitFloat)] = 0.99,
    lam: Annotated[float, typer.Option("--lam", help="GAE lambda.", **UnitFloat)] = 0.95,
    normalize: Annotated[
        bool, typer.Option("--normalize/--no-normalize", help="Normalise advantages (mean 0, std 1).")
    ] = True,
    bootstrap_timeouts: Annotated[
        bool | None,
        typer.Option(
            "--bootstrap-timeouts/--no-bootstrap-timeouts",
            help="Aliases of --timeouts rsl / --timeouts ignore.",
            show_default=False,
        ),
    ] = None,
    timeouts: Annotated[
        Timeouts | None,
        typer.Option(
            "--timeouts",
            help="Time-out rule: rsl (r += gamma * V(s_t), default), final-value (r += gamma * final_values, as "
            "SB3/TorchRL), proper (ikostrikov: advantage 0 at time-outs), ignore (time-outs terminate).",
            show_default=False,
        ),
    ] = None,
    last_values: Annotated[
        LastValues, typer.Option("--last-values", help="recorded: require the dataset; zero: the end is terminal.")
    ] = LastValues.recorded,
    *,
    common: Common,
) -> None:
    """Compute GAE advantages and returns as RSL-RL does; write FILE + advantages, returns."""
    from dataclasses import asdict

    from rolloutcli.pipeline.gae import GaeOptions, run_gae
    from rolloutcli.render import render_gae

    if timeouts is not None and bootstrap_timeouts is not None:
        raise RolloutError(
            "gae: expected either --timeouts or --[no-]bootstrap-timeouts, found both.", exit_code=EXIT_USAGE
        )
    rule = None if timeouts is None else timeouts.value
    options = GaeOptions(gamma, lam, normalize, bootstrap_timeouts, last_values.value, rule)
    unit = (run_gae, (options, common.run()))
    derive_command("gae", files, output, asdict(options), unit, render_gae, common)


@app.command(epilog=_example("rolloutcli split sample_data/cartpole_gru.h5 -o trajectories.h5 --pad-to longest"))
@with_common(overwrite=True, device=True, engine=True, resume=True)
def split(
    files: FilesArg,
    output: FileOutputOpt = None,
    pad_to: Annotated[
        PadTo, typer.Option("--pad-to", help="rollout: L = T, as RSL-RL; longest: L = the longest trajectory.")
    ] = PadTo.rollout,
    max_length: Annotated[
        int | None,
        count_option("--max-length", metavar="K", text="Cut trajectories at K steps."),
    ] = None,
    unpad: flag("--unpad", text="Restore the [T, N, ...] rollout from split output.") = False,
    *,
    common: Common,
) -> None:
    """Split every per-step field into trajectories at dones, padded as RSL-RL does (or undo it)."""
    from rolloutcli.pipeline.split import SplitOptions, run_split, run_unpad
    from rolloutcli.render import render_split

    output = need_output(output, "split", "an output path (-o OUT.h5)")
    run, options, overwrite = common.run(), SplitOptions(pad_to.value, max_length), common.overwrite

    def unit(src: Path, out: Path) -> Any:
        return (run_unpad, (src, out, run)) if unpad else (run_split, (src, out, options, run))

    def single(file: Path) -> dict[str, Any]:
        fn, args = unit(file, output)
        summary = fn(*args, overwrite=overwrite, progress=common.progress())
        common.emit(summary, render_split, output)
        return summary

    record = {"unpad": True} if unpad else {"pad_to": options.pad_to, "max_length": options.max_length}
    engine, resume = common.engine, common.resume
    summary = per_file(
        "split",
        files,
        output,
        record,
        unit,
        engine,
        overwrite=overwrite,
        resume=resume,
        single=single,
        safety=run.safety,
        rollouts=not unpad,
    )
    if "reused" in summary:
        common.emit(summary, render_dataset, output)


app.command(
    epilog=_example("rolloutcli batch run_gae.h5 -o shards --num-mini-batches 4 --recurrent --epochs 2"),
)(batch)
app.command(name="import", epilog=_example("rolloutcli import d4rl_hopper.hdf5 -o hopper.h5 --max-memory 256M"))(
    import_command
)
app.command(epilog=_example(cli_nstep.EXAMPLE))(cli_nstep.nstep)
app.command(epilog=_example(cli_stats.EXAMPLE))(cli_stats.stats)
app.command(epilog=_example(cli_plot.EXAMPLE))(cli_plot.plot)
app.command(epilog=_example(RETURNS_EXAMPLE))(returns)


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
