"""The ``rolloutcli stats`` command: normalizer statistics for a trainer (see ``pipeline/normalizer.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from rolloutcli.cli.common import Common, not_stdout, with_common
from rolloutcli.cli.dataset import ReadFilesArg, resolve_inputs
from rolloutcli.cli.render import _num, print_grid

EXAMPLE = "rolloutcli stats sample_data/cartpole_gru.h5 --normalizer obs_norm.pt --group policy"

NormalizerOpt = Annotated[
    Path | None,
    typer.Option(
        "--normalizer",
        metavar="OUT.pt",
        callback=not_stdout("--normalizer", "the normalizer is a torch.save file"),
        help="Also write RSL-RL's EmpiricalNormalization state dict here.",
    ),
]


@with_common(overwrite="file")
def stats(
    files: ReadFilesArg,
    normalizer: NormalizerOpt = None,
    group: Annotated[
        str | None,
        typer.Option("--group", metavar="NAME", help="Observation group (default: policy, or the only one)."),
    ] = None,
    *,
    common: Common,
) -> None:
    """Per-dimension observation statistics; --normalizer: also as an RSL-RL normalizer (load_state_dict)."""
    from rolloutcli.pipeline.normalizer import run_normalizer

    common.write(_render, normalizer, run_normalizer, resolve_inputs(files).files, normalizer, group)


def _render(console: Any, summary: dict[str, Any]) -> None:
    render_per_dim(console, summary["per_dim"])
    what = f"observations/{summary['group']} {summary['shape']} over {summary['count']} rows"
    if summary["output"] is None:
        console.print(f"statistics of {what}")
    else:
        console.print(f"normalizer of {what} -> {summary['output']}")


def with_per_dim(render: Callable[..., None]) -> Callable[..., None]:
    """``inspect``'s renderer followed by the ``--per-dim`` table."""

    def both(console: Any, report: dict[str, Any]) -> None:
        render(console, report)
        render_per_dim(console, report["per_dim"])

    return both


def render_per_dim(console: Console, per_dim: dict[str, Any]) -> None:
    """One table per observation group / actions: a row per dimension (mean, std, min, max, non-finite)."""
    for label, stats in per_dim.items():
        rows = [
            (d, *(_num(v) for v in row), stats["nonfinite"][d])
            for d, row in enumerate(zip(stats["mean"], stats["std"], stats["min"], stats["max"], strict=True))
        ]
        columns = ("dim", "mean", "std", "min", "max", "non-finite")
        print_grid(console, f"{label} {stats['shape']} per dimension", columns, rows, columns)
        if stats["nonfinite_total"]:
            console.print(f"{label}: {stats['nonfinite_total']} non-finite values counted, not averaged in")
