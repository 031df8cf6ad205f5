"""The ``rolloutcli nstep`` command: n-step returns, discounts and bootstrap steps (see ``pipeline/nstep.py``).

Registered on the app by ``cli.py``. The pipeline is imported inside the command so ``--help`` stays fast.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated

import typer

from rolloutcli.cli_common import (
    ExternalOpt,
    FileOutputOpt,
    JsonOpt,
    MemoryOpt,
    OverwriteOpt,
    QuietOpt,
    count_option,
    emit,
    flag,
    run_options,
)
from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.render import RichProgress

EXAMPLE = "rolloutcli nstep sample_data/cartpole_gru.h5 -o run_nstep.h5 --n 5 --gamma 0.99"


class NStepTimeouts(str, enum.Enum):
    final_value = "final-value"
    ignore = "ignore"


def nstep(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="Rollout file (.h5).")],
    output: FileOutputOpt = None,
    n: Annotated[int, count_option("--n", text="Rewards per window (K).", metavar="K")] = 5,
    gamma: Annotated[float, typer.Option("--gamma", help="Discount factor.", min=0.0, max=1.0)] = 0.99,
    timeouts: Annotated[
        NStepTimeouts,
        typer.Option(
            "--timeouts", help="final-value: bootstrap time-outs from final_observations; ignore: they end episodes."
        ),
    ] = NStepTimeouts.final_value,
    in_place: flag("--in-place", text="Add the results to FILE itself (atomically).") = False,
    overwrite: OverwriteOpt = False,
    json_output: JsonOpt = False,
    max_memory: MemoryOpt = "1G",
    allow_external: ExternalOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """n-step returns for off-policy learning; write FILE + nstep_returns, nstep_discount, nstep_next_step."""
    from rolloutcli.pipeline.nstep import NStepOptions, run_nstep
    from rolloutcli.render_nstep import render_nstep

    if in_place and output is not None:
        raise RolloutError("nstep: expected either -o OUT.h5 or --in-place, found both.", exit_code=EXIT_USAGE)
    options = NStepOptions(n, gamma, timeouts.value)
    options.check()
    run = run_options(max_memory, allow_external)
    summary = run_nstep(
        file, output, options, run, overwrite=overwrite, in_place=in_place, progress=RichProgress(quiet)
    )
    emit(summary, render_nstep, json_output, quiet, file if in_place else output)
