"""The ``rolloutcli batch`` command: export mini-batch shards and a manifest (see ``pipeline/batch.py``).

Registered on the app at the end of ``cli.py`` (after the shared option aliases exist). Heavy modules
(torch, h5py, the pipeline) are imported inside the command so ``rolloutcli --help`` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from rolloutcli.cli import (
    DebugOpt,
    DeviceOpt,
    ExternalOpt,
    JsonOpt,
    MemoryOpt,
    OutputOpt,
    OverwriteOpt,
    QuietOpt,
    RichProgress,
    _options,
    stdout,
)
from rolloutcli.errors import EXIT_USAGE, RolloutError


def _size(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num) < 1024 or unit == "GiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return str(num)


def render_batch(console: Console, summary: dict[str, Any]) -> None:
    """Print a ``batch`` summary: what was written, how rows were ordered, what was dropped, speed."""
    console.print(
        f"batch {summary['input']} -> {summary['output']}  ({summary['mode']}, T={summary['T']}, N={summary['N']})"
    )
    unit = "windows" if summary["mode"] == "history" else "rows"
    console.print(
        f"{summary['entries']} mini-batches ({summary['epochs']} epoch(s) x {summary['num_mini_batches']}) in "
        f"{summary['files']} shard file(s), {_size(summary['bytes_written'])}, "
        f"{summary['rows_per_epoch']} {unit} per epoch"
    )
    if summary["mode"] == "history":
        episodes = "straddling episode ends" if summary["across_episodes"] else "inside one episode"
        console.print(
            f"history windows of {summary['history']} steps ({', '.join(summary['groups'])}), {episodes}, no padding"
        )
    console.print(f"order: {summary['order']} (seed {summary['seed']})")
    if summary["dropped_rows"]:
        envs = f" ({len(summary['dropped_envs'])} envs)" if summary["dropped_envs"] else ""
        console.print(f"dropped (RSL-RL parity): {summary['dropped_rows']} rows{envs}")
    gae = summary.get("gae") or {}
    if gae.get("gamma") is not None:
        console.print(
            f"gae from the source: gamma {gae['gamma']}  lambda {gae['lambda']}  "
            f"normalized {gae['advantages_normalized']}"
        )
    how = f"streamed in {summary['blocks']} blocks" if summary["streamed"] else "in memory"
    console.print(f"done in {summary['seconds']:.3f} s ({how}, {summary['gb_per_s'] or 0:.2f} GB/s written)")


def _groups(observations: str | None) -> tuple[str, ...] | None:
    """``--observations policy,critic`` as a tuple of group names (None: all groups)."""
    if observations is None:
        return None
    groups = tuple(g.strip() for g in observations.split(",") if g.strip())
    if not groups:
        raise RolloutError(
            f"--observations: expected group names such as policy,critic, found '{observations}'.",
            exit_code=EXIT_USAGE,
        )
    return groups


def batch(
    file: Annotated[Path, typer.Argument(help="Rollout file (.h5); RL modes need advantages/returns (run gae).")],
    output: OutputOpt = None,
    num_mini_batches: Annotated[
        int, typer.Option("--num-mini-batches", "-m", help="Mini-batches (shards) per epoch.")
    ] = 0,
    epochs: Annotated[int, typer.Option("--epochs", help="Epochs to write.")] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Seed of every shuffle.")] = 0,
    recurrent: Annotated[
        bool, typer.Option("--recurrent", help="Env groups of padded trajectories with hidden states.")
    ] = False,
    distillation: Annotated[
        bool, typer.Option("--distillation", help="Step ranges of observations, privileged_actions, dones.")
    ] = False,
    rsl_parity: Annotated[
        bool, typer.Option("--rsl-parity", help="Reproduce RSL-RL exactly: one order for all epochs, drop remainder.")
    ] = False,
    shuffle_envs: Annotated[
        bool, typer.Option("--shuffle-envs", help="--recurrent: new env groups every epoch.")
    ] = False,
    compression: Annotated[
        str | None, typer.Option("--compression", help="lzf or gzip (default: none; gzip is ~100x slower).")
    ] = None,
    history: Annotated[
        int | None,
        typer.Option(
            "--history", help="K: export history windows [B, K, ...] of observations (CircularBuffer semantics)."
        ),
    ] = None,
    across_episodes: Annotated[
        bool,
        typer.Option("--across-episodes", help="--history: never reset at dones (AMP); windows may straddle episodes."),
    ] = False,
    observations: Annotated[
        str | None,
        typer.Option("--observations", help="--history: observation groups to export, e.g. policy,critic (all)."),
    ] = None,
    overwrite: OverwriteOpt = False,
    json_output: JsonOpt = False,
    device: DeviceOpt = "auto",
    max_memory: MemoryOpt = "1G",
    allow_external: ExternalOpt = False,
    debug: DebugOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Export mini-batch shards (one HDF5 file per mini-batch) and a manifest.json into a new folder.

    --history K exports history windows [B, K, ...] of observations instead (README: batch --history).
    """
    if output is None:
        raise RolloutError("batch: expected an output folder (-o SHARDS/), found none.", exit_code=EXIT_USAGE)
    if num_mini_batches < 1:
        raise RolloutError(
            f"--num-mini-batches: expected an integer >= 1, found {num_mini_batches or 'none'}.",
            exit_code=EXIT_USAGE,
        )
    if recurrent and distillation:
        raise RolloutError("batch: expected --recurrent or --distillation, found both.", exit_code=EXIT_USAGE)
    # The export is file I/O and row copies on the CPU (orders are drawn on the CPU so shards are the same
    # on every machine); --device is validated like every command's, then ShardDataset picks the device.
    run = _options(device, max_memory, allow_external)
    progress = RichProgress(quiet)
    summary: dict[str, Any]
    if history is not None:
        flags = [("--recurrent", recurrent), ("--distillation", distillation), ("--rsl-parity", rsl_parity)]
        given = [name for name, on in [*flags, ("--shuffle-envs", shuffle_envs)] if on]
        if given:
            raise RolloutError(
                f"--history: expected none of {', '.join(given)} (history windows are a mode of their own).",
                exit_code=EXIT_USAGE,
            )
        from rolloutcli.pipeline.history import HistoryOptions, run_history

        groups = _groups(observations)
        hist = HistoryOptions(history, num_mini_batches, epochs, seed, across_episodes, groups, compression)
        summary = run_history(file, output, hist, run, overwrite=overwrite, progress=progress)
    else:
        for name, on in (("--across-episodes", across_episodes), ("--observations", observations is not None)):
            if on:
                raise RolloutError(f"{name}: expected --history K with it, found none.", exit_code=EXIT_USAGE)
        from rolloutcli.pipeline.batch import BatchOptions, run_batch

        mode = "recurrent" if recurrent else "distillation" if distillation else "feedforward"
        options = BatchOptions(num_mini_batches, epochs, seed, mode, rsl_parity, shuffle_envs, compression)
        summary = run_batch(file, output, options, run, overwrite=overwrite, progress=progress)
    if json_output:
        print(json.dumps(summary, default=str))
    else:
        render_batch(stdout, summary)
