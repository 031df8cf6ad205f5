"""The ``rolloutcli nstep`` command: n-step returns, discounts and bootstrap steps (see ``pipeline/nstep.py``).

Registered on the app by ``cli.py``. The pipeline is imported inside the command so ``--help`` stays fast.
"""

from __future__ import annotations

import enum
from typing import Annotated

import typer

from rolloutcli.cli_common import Common, FileOutputOpt, count_option, with_common
from rolloutcli.cli_dataset import FilesArg, derive_command

EXAMPLE = "rolloutcli nstep sample_data/cartpole_gru.h5 -o run_nstep.h5 --n 5 --gamma 0.99"


class NStepTimeouts(str, enum.Enum):
    final_value = "final-value"
    ignore = "ignore"


@with_common(in_place=True, overwrite=True, engine=True, resume=True)
def nstep(
    files: FilesArg,
    output: FileOutputOpt = None,
    n: Annotated[int, count_option("--n", text="Rewards per window (K).", metavar="K")] = 5,
    gamma: Annotated[float, typer.Option("--gamma", help="Discount factor.", min=0.0, max=1.0)] = 0.99,
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
    from rolloutcli.render_nstep import render_nstep

    options = NStepOptions(n, gamma, timeouts.value)
    options.check()
    record, unit = {"n": n, "gamma": gamma, "timeouts": timeouts.value}, (run_nstep, (options, common.run()))
    derive_command("nstep", files, output, record, unit, render_nstep, common)
