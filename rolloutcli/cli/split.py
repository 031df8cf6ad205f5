"""The ``rolloutcli split`` command: trajectories padded as RSL-RL pads them, or undone (see ``pipeline/split.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from rolloutcli.cli.common import Common, FileOutputOpt, PadTo, count_option, flag, need_output, with_common
from rolloutcli.cli.dataset import FilesArg, per_file, render_dataset
from rolloutcli.cli.render import _num, _size

EXAMPLE = "rolloutcli split sample_data/cartpole_gru.h5 -o trajectories.h5 --pad-to longest"


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
        progress=common.dataset_progress(),
        rows=common.json_output,  # a row per file only where it is printed
    )
    if "reused" in summary:
        common.emit(summary, render_dataset(render_split), output)


def render_split(console: Console, summary: dict[str, Any]) -> None:
    """Print a ``split`` (or ``split --unpad``) summary."""
    if "padded_length" not in summary:
        console.print(
            f"unpad {summary['input']} -> {summary['output']}: {summary['trajectories']} trajectories "
            f"back to T={summary['T']} x N={summary['N']} ({len(summary['fields'])} fields)"
        )
        console.print(f"done in {summary['seconds']:.2f} s")
        return
    lengths = summary["trajectory_lengths"]
    console.print(
        f"split {summary['input']} -> {summary['output']}: {summary['trajectories']} trajectories from "
        f"N={summary['N']} envs, padded to L={summary['padded_length']} ({summary['pad_to']}"
        + (f", max length {summary['max_length']}" if summary["max_length"] else "")
        + ")"
    )
    console.print(
        f"trajectory length: min {_num(lengths['min'])}  mean {_num(lengths['mean'])}  median "
        f"{_num(lengths['p50'])}  p95 {_num(lengths['p95'])}  max {_num(lengths['max'])}"
    )
    console.print(
        f"padding overhead: {_size(summary['padded_bytes'])} from {_size(summary['input_bytes'])} "
        f"({summary['padding_overhead']:.2f}x)  {len(summary['fields'])} fields, {summary['blocks']} env block(s)"
    )
    console.print(f"done in {summary['seconds']:.2f} s")
