"""The ``rolloutcli stats`` command: normalizer statistics for a trainer (see ``pipeline/normalizer.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from rolloutcli.cli_common import Common, with_common
from rolloutcli.cli_dataset import FilesArg, resolve_inputs

EXAMPLE = "rolloutcli stats sample_data/cartpole_gru.h5 --normalizer obs_norm.pt --group policy"


@with_common(overwrite=True)
def stats(
    files: FilesArg,
    normalizer: Annotated[
        Path,
        typer.Option("--normalizer", metavar="OUT.pt", help="Write RSL-RL's EmpiricalNormalization state dict here."),
    ],
    group: Annotated[
        str | None, typer.Option("--group", help="Observation group (default: policy, or the only one).")
    ] = None,
    *,
    common: Common,
) -> None:
    """Per-dimension observation statistics as an RSL-RL normalizer (torch.load + load_state_dict)."""
    from rolloutcli.pipeline.normalizer import run_normalizer

    common.write(_render, normalizer, run_normalizer, resolve_inputs(files).files, normalizer, group)


def _render(console: Any, summary: dict[str, Any]) -> None:
    from rolloutcli.render_nstep import render_per_dim

    render_per_dim(console, summary["per_dim"])
    console.print(
        f"normalizer of observations/{summary['group']} {summary['shape']} over {summary['count']} rows "
        f"-> {summary['output']}"
    )


def with_per_dim(render: Callable[..., None]) -> Callable[..., None]:
    """``inspect``'s renderer followed by the ``--per-dim`` table."""

    def both(console: Any, report: dict[str, Any]) -> None:
        from rolloutcli.render_nstep import render_per_dim

        render(console, report)
        render_per_dim(console, report["per_dim"])

    return both
