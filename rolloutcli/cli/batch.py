"""The ``rolloutcli batch`` command: export mini-batch shards and a manifest (see ``pipeline/batch.py``).

Registered on the app by ``cli/app.py``. Heavy modules (torch, h5py, the pipeline) are imported inside the
command so ``rolloutcli --help`` stays fast.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from rich.console import Console

from rolloutcli.cli.common import (
    MAX_SEED,
    Common,
    Compression,
    FolderOutputOpt,
    SplitBy,
    SplitByOpt,
    ValidFractionOpt,
    count_option,
    flag,
    need_output,
    with_common,
)
from rolloutcli.cli.dataset import (
    FilesArg,
    resolve_inputs,
)
from rolloutcli.cli.derive import NStepTimeouts
from rolloutcli.cli.render import _size
from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.hdf5.atomic import check_output_path

EXAMPLE = "rolloutcli batch run_gae.h5 -o shards --num-mini-batches 4 --recurrent --epochs 2"


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


MiniBatchesOpt = Annotated[
    int | None, count_option("--num-mini-batches", "-m", text="Mini-batches per epoch (or --batch-size).", metavar="M")
]
BatchSizeOpt = Annotated[
    int | None,
    count_option(
        "--batch-size", text="Items per mini-batch: rows, envs (--recurrent), steps (--distillation).", metavar="B"
    ),
]
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
TransitionsOpt = flag("--transitions", text="Off-policy transitions (s, a, R, s', discount, terminated, truncated).")
NStepOpt = Annotated[
    int | None, count_option("--n-step", text="--transitions: K-step returns (default 1).", metavar="K")
]
GammaOpt = Annotated[
    float | None, typer.Option("--gamma", min=0.0, max=1.0, help="--transitions: discount (default 0.99).")
]
TimeoutsOpt = Annotated[
    NStepTimeouts | None,
    typer.Option("--timeouts", help="--transitions: final-value (bootstrap from final_observations) or ignore."),
]
GroupsOpt = Annotated[
    str | None, typer.Option("--observations", help="--history: observation groups to export, e.g. policy,critic.")
]


@with_common(overwrite=True, engine=True)
def batch(
    files: FilesArg,
    num_mini_batches: MiniBatchesOpt = None,
    output: FolderOutputOpt = None,
    batch_size: BatchSizeOpt = None,
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
    transitions: TransitionsOpt = False,
    n_step: NStepOpt = None,
    gamma: GammaOpt = None,
    timeouts: TimeoutsOpt = None,
    offline: OfflineOpt = False,
    valid_fraction: ValidFractionOpt = 0.0,
    split_by: SplitByOpt = SplitBy.episode,
    *,
    common: Common,
) -> None:
    """Export mini-batch shards (one HDF5 file per mini-batch) and a manifest.json into a new folder.

    --history K exports history windows [B, K, ...] of observations, actions, rewards and dones instead
    (never needs advantages); --transitions off-policy transitions; --offline feed-forward rows of a file without
    advantages.
    """
    output = need_output(output, "batch", "an output folder (-o SHARDS/)")
    if (num_mini_batches is None) == (batch_size is None):
        found = "both" if batch_size is not None else "neither"
        raise RolloutError(
            f"batch: expected exactly one of --num-mini-batches/-m M and --batch-size B, found {found}.",
            exit_code=EXIT_USAGE,
        )
    if recurrent and distillation:
        raise RolloutError("batch: expected --recurrent or --distillation, found both.", exit_code=EXIT_USAGE)
    # The export is file I/O and row copies on the CPU (orders are drawn on the CPU so shards are the same
    # on every machine): no --device; ShardDataset picks where batches go.
    compression = compression and compression.value
    if not common.overwrite and os.path.isdir(output):  # a rerun: refused before torch is imported (seconds)
        check_output_path(output, [], overwrite=False, kind="folder")  # (an input as output: refused later)
    from rolloutcli.pipeline.engine import prestart

    prestart(common.engine, ["rolloutcli.pipeline.parallel_export"])  # its imports overlap this process's
    from rolloutcli.pipeline.batch import BatchOptions, HistoryOptions, TransitionOptions, run_batch

    options: BatchOptions | HistoryOptions | TransitionOptions
    modes = {"--recurrent": recurrent, "--distillation": distillation, "--rsl-parity": rsl_parity}
    modes |= {"--shuffle-envs": shuffle_envs, "--history": history is not None, "--batch-size": batch_size is not None}
    if not transitions:
        _need("--transitions", {"--n-step": n_step, "--gamma": gamma, "--timeouts": timeouts})
    if transitions:
        _alone("--transitions", "transitions", {k: v for k, v in modes.items() if k != "--batch-size"})
        rule = (timeouts or NStepTimeouts.final_value).value
        gamma = 0.99 if gamma is None else gamma
        options = TransitionOptions(
            num_mini_batches or 0, n_step or 1, gamma, rule, epochs, seed, compression, batch_size
        )
    elif history is not None:
        _alone("--history", "history windows", {k: v for k, v in modes.items() if k != "--history"})
        groups = _groups(observations)
        _require_mini_batches(num_mini_batches, "--history")
        options = HistoryOptions(history, num_mini_batches, epochs, seed, across_episodes, groups, compression)
    else:
        _need("--history K", {"--across-episodes": across_episodes or None, "--observations": observations})
        mode = "recurrent" if recurrent else "distillation" if distillation else "feedforward"
        options = BatchOptions(
            num_mini_batches or 0, epochs, seed, mode, rsl_parity, shuffle_envs, compression, batch_size, offline
        )
    dataset = resolve_inputs(files)
    source = dataset.files if dataset.many else dataset.files[0]
    del dataset  # its names (~80 B a file) are not needed: the export runs on the files alone
    hold_out = None
    if valid_fraction > 0:
        from rolloutcli.pipeline.batch_split import HoldOut

        hold_out = HoldOut(valid_fraction, split_by.value, seed)
    render = render_batch if hold_out is None else render_split_batch
    common.write(render, output, run_batch, source, output, options, engine=common.engine, hold_out=hold_out)


def _require_mini_batches(num_mini_batches: int | None, mode: str) -> None:
    if num_mini_batches is None:
        raise RolloutError(f"{mode}: expected --num-mini-batches/-m M, found none.", exit_code=EXIT_USAGE)


def _need(mode: str, given: dict[str, object]) -> None:
    """Options that only ``mode`` takes: the first one given (not None) without it is a usage error."""
    for name, value in given.items():
        if value is not None:
            raise RolloutError(f"{name}: expected {mode} with it, found none.", exit_code=EXIT_USAGE)


def _alone(mode: str, what: str, others: dict[str, bool]) -> None:
    """``mode`` is a mode of its own: none of ``others`` may be on with it."""
    given = [name for name, on in others.items() if on]
    if given:
        raise RolloutError(
            f"{mode}: expected none of {', '.join(given)} ({what} are a mode of their own).", exit_code=EXIT_USAGE
        )


_ORDERS = {  # (mode, RSL-RL parity): the order in a user's words; the manifest's "order" spells out the algorithm
    ("feedforward", False): "rows shuffled anew each epoch",
    ("feedforward", True): "RSL-RL's shuffle, one for all epochs",
    ("recurrent", False): "groups of neighbouring envs, the same every epoch",
    ("recurrent", True): "RSL-RL's groups of N // M neighbouring envs, the same every epoch",
    ("distillation", False): "consecutive steps, as RSL-RL's generator(), the same every epoch",
    ("history", False): "windows shuffled anew each epoch",
    ("transitions", False): "transitions shuffled anew each epoch",
}


def order_words(summary: dict[str, Any]) -> str:
    """How the mini-batches were drawn, and the seed where one was used (docs/commands.md: the algorithms)."""
    mode, parity = summary["mode"], bool(summary.get("rsl_parity"))
    if summary.get("shuffle_envs"):
        words = "envs shuffled into new groups each epoch"
    else:
        words = _ORDERS.get((mode, parity)) or _ORDERS[(mode, False)]  # parity where a mode has its own
    seeded = "shuffle" in words
    return f"{words}, seed {summary['seed']}" if seeded else words


# Below this many bytes written a throughput figure says more about start-up than about writing.
_RATE_MIN_BYTES = 64 << 20


def render_split_batch(console: Console, summary: dict[str, Any]) -> None:
    """Print a split ``batch`` summary: the split, then each side's summary."""
    split = summary["split"]
    console.print(
        f"split by {split['by']} into {summary['output']}/train and /valid "
        f"(validation fraction {split['fraction']}, seed {split['seed']})"
    )
    for side in ("train", "valid"):
        record = summary[side]["split"]
        envs = f", {record['envs']} envs" if record["envs"] is not None else ""
        console.print(f"{side}: {record['episodes']} episodes, {record['rows']} rows{envs}")
        render_batch(console, summary[side])


def render_batch(console: Console, summary: dict[str, Any]) -> None:
    """Print a ``batch`` summary: what was written, how rows were ordered, what was dropped, time."""
    source, steps = summary["input"], f"T={summary['T']}"
    if isinstance(source, list):  # a dataset: its file count, not a Python list; files may differ in T
        source = f"{len(source)} files ({source[0]} ...)"
        steps = steps if summary["T"] is not None else "T differs"
    console.print(f"batch {source} -> {summary['output']}  ({summary['mode']}, {steps}, N={summary['N']})")
    unit = "windows" if summary["mode"] == "history" else "rows"
    console.print(
        f"{summary['entries']} mini-batches ({summary['epochs']} epoch(s) x {summary['num_mini_batches']}), "
        f"{summary['rows_per_epoch']} {unit} per epoch"
    )
    console.print(f"  in {summary['files']} shard file(s), {_size(summary['bytes_written'])}")
    if summary["mode"] == "history":
        episodes = "straddling episode ends" if summary["across_episodes"] else "inside one episode"
        console.print(
            f"history windows of {summary['history']} steps ({', '.join(summary['groups'])}), {episodes}, no padding"
        )
    if summary["mode"] == "transitions":
        console.print(
            f"transitions: {summary['n_step']}-step returns, gamma {summary['gamma']}, time-outs: {summary['timeouts']}"
        )
        console.print(
            f"  {summary['held_back']} held back (bootstrap observation unknown)"
            + (f", {summary['autoreset_steps']} autoreset steps left out" if "autoreset_steps" in summary else "")
        )
    console.print(f"order: {order_words(summary)}")
    if summary["dropped_rows"]:
        envs = f" ({len(summary['dropped_envs'])} envs)" if summary["dropped_envs"] else ""
        console.print(f"dropped (RSL-RL parity): {summary['dropped_rows']} rows{envs}")
    gae = summary.get("gae") or {}
    if gae.get("gamma") is not None:
        console.print(
            f"gae from the source: gamma {gae['gamma']}  lambda {gae['lambda']}  "
            f"normalized {gae['advantages_normalized']}"
        )
        if any(isinstance(v, list) for v in gae.values()):
            console.print("  (a list: each file's value, in file order; the files differ)")
    how = f"streamed in {summary['blocks']} blocks" if summary["streamed"] else "in memory"
    seconds, written = summary["seconds"], summary["bytes_written"]
    rate = f", {written / seconds / 1e9:.2f} GB/s written" if written >= _RATE_MIN_BYTES and seconds > 0 else ""
    console.print(f"done in {seconds:.2f} s ({how}{rate})")
