"""The ``rolloutcli batch`` command: export mini-batch shards and a manifest (see ``pipeline/batch.py``).

Registered on the app by ``cli.py``. Heavy modules (torch, h5py, the pipeline) are imported inside the
command so ``rolloutcli --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rolloutcli.cli_common import (
    MAX_SEED,
    Compression,
    ExternalOpt,
    FolderOutputOpt,
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
from rolloutcli.render import RichProgress, render_batch


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


FileArg = Annotated[
    Path, typer.Argument(metavar="FILE", help="Rollout file (.h5); RL modes need advantages/returns (run gae).")
]
MiniBatchesOpt = Annotated[int, count_option("--num-mini-batches", "-m", text="Mini-batches per epoch.", metavar="M")]
EpochsOpt = Annotated[int, count_option("--epochs", text="Epochs to write.", metavar="E")]
SeedOpt = Annotated[int, count_option("--seed", text="Seed of every shuffle.", low=0, high=MAX_SEED, metavar="S")]
RecurrentOpt = flag("--recurrent", text="Env groups of padded trajectories with hidden states.")
DistillationOpt = flag("--distillation", text="Step ranges of observations, privileged_actions, dones.")
ParityOpt = flag("--rsl-parity", text="Reproduce RSL-RL exactly: one order for all epochs, drop remainder.")
ShuffleEnvsOpt = flag("--shuffle-envs", text="--recurrent: new env groups every epoch.")
CompressionOpt = Annotated[Compression | None, typer.Option("--compression", help="Compress shard datasets.")]
HistoryOpt = Annotated[
    int | None,
    count_option(
        "--history", text="Export history windows [B, K, ...] of observations, actions, rewards.", metavar="K"
    ),
]
OfflineOpt = flag("--offline", text="Export what the file has, without advantages/returns (offline data).")
AcrossOpt = flag("--across-episodes", text="--history: never reset at dones (AMP); windows may straddle episodes.")
GroupsOpt = Annotated[
    str | None, typer.Option("--observations", help="--history: observation groups to export, e.g. policy,critic.")
]


def batch(
    file: FileArg,
    num_mini_batches: MiniBatchesOpt,
    output: FolderOutputOpt = None,
    epochs: EpochsOpt = 1,
    seed: SeedOpt = 0,
    recurrent: RecurrentOpt = False,
    distillation: DistillationOpt = False,
    rsl_parity: ParityOpt = False,
    shuffle_envs: ShuffleEnvsOpt = False,
    compression: CompressionOpt = None,
    history: HistoryOpt = None,
    across_episodes: AcrossOpt = False,
    observations: GroupsOpt = None,
    offline: OfflineOpt = False,
    overwrite: OverwriteOpt = False,
    json_output: JsonOpt = False,
    max_memory: MemoryOpt = "1G",
    allow_external: ExternalOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Export mini-batch shards (one HDF5 file per mini-batch) and a manifest.json into a new folder.

    --history K exports history windows [B, K, ...] of observations, actions, rewards and dones instead
    (never needs advantages); --offline exports feed-forward rows of a file without them.
    """
    if output is None:
        raise RolloutError("batch: expected an output folder (-o SHARDS/), found none.", exit_code=EXIT_USAGE)
    if recurrent and distillation:
        raise RolloutError("batch: expected --recurrent or --distillation, found both.", exit_code=EXIT_USAGE)
    # The export is file I/O and row copies on the CPU (orders are drawn on the CPU so shards are the same
    # on every machine): no --device; ShardDataset picks where batches go.
    run = run_options(max_memory, allow_external)
    compression = compression and compression.value
    from rolloutcli.pipeline.batch import BatchOptions, HistoryOptions, run_batch

    options: BatchOptions | HistoryOptions
    if history is not None:
        flags = [("--recurrent", recurrent), ("--distillation", distillation), ("--rsl-parity", rsl_parity)]
        given = [name for name, on in [*flags, ("--shuffle-envs", shuffle_envs)] if on]
        if given:
            raise RolloutError(
                f"--history: expected none of {', '.join(given)} (history windows are a mode of their own).",
                exit_code=EXIT_USAGE,
            )
        groups = _groups(observations)
        options = HistoryOptions(history, num_mini_batches, epochs, seed, across_episodes, groups, compression)
    else:
        for name, on in (("--across-episodes", across_episodes), ("--observations", observations is not None)):
            if on:
                raise RolloutError(f"{name}: expected --history K with it, found none.", exit_code=EXIT_USAGE)
        mode = "recurrent" if recurrent else "distillation" if distillation else "feedforward"
        options = BatchOptions(num_mini_batches, epochs, seed, mode, rsl_parity, shuffle_envs, compression, offline)
    summary = run_batch(file, output, options, run, overwrite=overwrite, progress=RichProgress(quiet))
    emit(summary, render_batch, json_output, quiet, output)
