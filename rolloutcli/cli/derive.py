"""The per-file commands that add datasets to a copy of their input: ``gae``, ``returns``, ``nstep``.

Each hands ``(run_<name>, args)`` to ``dataset.derive_command`` (one file, or every file of a dataset) and has
its human summary here. The pipelines are imported inside the commands so ``--help`` stays fast.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import typer
from rich.console import Console

from rolloutcli.cli.common import Common, FileOutputOpt, LastValues, Timeouts, count_option, with_common
from rolloutcli.cli.dataset import FilesArg, derive_command
from rolloutcli.cli.render import _stats_line, derived_header
from rolloutcli.errors import EXIT_USAGE, RolloutError

GAE_EXAMPLE = "rolloutcli gae sample_data/cartpole_gru.h5 -o run_gae.h5 --gamma 0.99 --lam 0.95"
RETURNS_EXAMPLE = "rolloutcli returns sample_data/cartpole_gru.h5 -o run_returns.h5 --gamma 0.99"
NSTEP_EXAMPLE = "rolloutcli nstep sample_data/cartpole_gru.h5 -o run_nstep.h5 --n 5 --gamma 0.99"
UnitFloat = dict(min=0.0, max=1.0)


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
            help="Time-out rule: rsl (r += gamma * V(s_t), RSL-RL), final-value (r += gamma * final_values, as "
            "SB3/TorchRL), proper (ikostrikov: advantage 0 at time-outs), ignore (time-outs terminate). Default: "
            "the file's timeouts_rule, else rsl.",
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

    if timeouts is not None and bootstrap_timeouts is not None:
        raise RolloutError(
            "gae: expected either --timeouts or --[no-]bootstrap-timeouts, found both.", exit_code=EXIT_USAGE
        )
    rule = None if timeouts is None else timeouts.value
    options = GaeOptions(gamma, lam, normalize, bootstrap_timeouts, last_values.value, rule)
    unit = (run_gae, (options, common.run()))
    derive_command("gae", files, output, asdict(options), unit, render_gae, common)


def render_gae(console: Console, summary: dict[str, Any]) -> None:
    """Print a ``gae`` summary: where it went, what was applied (the time-out rule and where it came from),
    statistics, time."""
    from rolloutcli.pipeline.timeouts_rule import describe

    derived_header(console, "gae", summary)
    bootstrap = (
        f"{summary['bootstrapped_rewards']} rewards bootstrapped"
        if summary["bootstrapped_by_this_run"]
        else "rewards already bootstrapped"
        if summary["timeouts_bootstrapped"]
        else "no bootstrapping"
    )
    console.print(
        f"gamma {summary['gamma']}  lambda {summary['lambda']}  normalized {summary['normalized']}  "
        f"last values: {summary['last_values']}"
    )
    files = summary.get("timeouts_files")  # a dataset whose files had different rules
    rule = (
        describe(summary["timeouts"], summary["timeouts_from"])
        if not files
        else "; ".join(f"{described} in {n} file{'s' * (n != 1)}" for described, n in files.items())
    )
    console.print(f"time-outs: {rule}; {bootstrap}")
    console.print(_stats_line("advantages", summary["advantages"]))
    console.print(_stats_line("returns", summary["returns"]))
    console.print(f"done in {summary['seconds']:.2f} s")


def render_returns(console: Console, summary: dict[str, Any]) -> None:
    """Print a ``returns`` summary."""
    derived_header(console, "returns", summary)
    stats = summary["returns"]
    console.print(
        f"gamma {summary['gamma']}  rewards from {summary['rewards_from']}  {summary['episodes']} episodes, "
        f"{summary['truncated_episodes']} truncated (marked in returns_truncated)"
    )
    console.print(f"returns_to_go  mean {stats['mean']:.6g}  std {stats['std']:.6g}")
    console.print(f"done in {summary['seconds']:.2f} s")


@with_common(in_place=True, overwrite=True, engine=True, resume=True)
def returns(
    files: FilesArg,
    output: FileOutputOpt = None,
    gamma: Annotated[float, typer.Option("--gamma", help="Discount factor.", **UnitFloat)] = 0.99,
    *,
    common: Common,
) -> None:
    """Monte-Carlo discounted returns-to-go per episode, without a critic; write FILE + returns_to_go,
    returns_truncated (episodes cut by a time-out or the end of the recording)."""
    from rolloutcli.pipeline.returns import run_returns

    unit = (run_returns, (gamma, common.run()))
    derive_command("returns", files, output, {"gamma": gamma}, unit, render_returns, common)


class NStepTimeouts(str, enum.Enum):
    final_value = "final-value"
    ignore = "ignore"


@with_common(in_place=True, overwrite=True, engine=True, resume=True)
def nstep(
    files: FilesArg,
    output: FileOutputOpt = None,
    n: Annotated[int, count_option("--n", text="Rewards per window (K).", metavar="K")] = 5,
    gamma: Annotated[float, typer.Option("--gamma", help="Discount factor.", **UnitFloat)] = 0.99,
    timeouts: Annotated[
        NStepTimeouts,
        typer.Option(
            "--timeouts", help="final-value: bootstrap time-outs from final_observations; ignore: they end episodes."
        ),
    ] = NStepTimeouts.final_value,
    *,
    common: Common,
) -> None:
    """n-step returns for off-policy learning; write FILE + nstep_returns, nstep_discount, nstep_next_step."""
    from rolloutcli.pipeline.nstep import NStepOptions, run_nstep

    options = NStepOptions(n, gamma, timeouts.value)
    options.check()
    record, unit = {"n": n, "gamma": gamma, "timeouts": timeouts.value}, (run_nstep, (options, common.run()))
    derive_command("nstep", files, output, record, unit, render_nstep, common)


def render_nstep(console: Console, summary: dict[str, Any]) -> None:
    """Print an ``nstep`` summary: where it went, the windows by how they end, the returns' statistics."""
    derived_header(console, "nstep", summary)
    windows = summary["windows"]
    console.print(
        f"n {summary['n']}  gamma {summary['gamma']}  time-outs: {summary['timeouts']}  rewards: {summary['rewards']}"
    )
    console.print(
        f"windows ending on a termination {windows['terminated']}, on a time-out (final observation) "
        f"{windows['final_observation']}, past the rollout's end {windows['rollout_end']}"
    )
    console.print(_stats_line("nstep_returns", summary["returns"]))
    console.print(f"done in {summary['seconds']:.2f} s")
