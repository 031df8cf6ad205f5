"""``rolloutcli batch --history K``: shards of fixed-length history windows ``[B, K, ...]`` and a manifest.

The windows are those a ``CircularBuffer(K, N)`` filled step by step would hold (:mod:`rolloutcli.core.history`):
reset after each done unless ``across_episodes`` (AMP); only windows whose K steps were all recorded. A window
is an export item named by its newest step's row ``t * N + n``; a block of steps ``t0:t1`` is read with the
``K - 1`` steps before it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

from rolloutcli.core.history import gather_windows, history_plan, window_ends, window_mask
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.shards import read_region
from rolloutcli.pipeline.shard_export import Block, ExportJob, Field, Rows, export_fields, usage

ORDER_TEXT = (
    "epoch e: the feistel-cw bijection of W keyed by the e-th torch.randint(0, 2**62) of "
    "torch.Generator().manual_seed(seed) (rolloutcli.core.order), applied to the W "
    "eligible windows in ascending order of their newest step's row t*N+n; M mini-batches whose sizes differ "
    "by at most one window"
)
WINDOW_TEXT = (
    "window_end t, window_env n: steps t-K+1..t of env n, oldest to newest (CircularBuffer.buffer order), "
    "with each step's observations, window_actions, window_rewards, window_dones; "
    "only windows whose K steps were all recorded (t >= K-1, no padding); {episodes}"
)
EPISODES_TEXT = {
    False: "the env's buffer is reset after each done: no done among a window's first K-1 steps",
    True: "never reset (AMP): windows may straddle episode ends (see window_dones)",
}


@dataclass(frozen=True)
class HistoryOptions:
    """What ``batch --history`` exports: windows of ``history`` K steps, ``num_mini_batches`` M shards per
    epoch, a fresh order each epoch; ``groups``: observation groups to export (None: all, in the file's order).
    """

    history: int
    num_mini_batches: int
    epochs: int = 1
    seed: int = 0
    across_episodes: bool = False
    groups: tuple[str, ...] | None = None
    compression: str | None = None


def _groups(reader: RolloutReader, options: HistoryOptions) -> list[str]:
    """The observation groups to export, in the order asked (default: the file's), each once."""
    known = list(reader.schema.observation_keys)
    if options.groups is None:
        return known
    unknown = [g for g in options.groups if g not in reader.schema.observation_keys]
    if unknown:
        raise usage(
            f"--observations: expected groups of {reader.path} ({', '.join(known)}), found "
            f"{', '.join(repr(g) for g in unknown)}."
        )
    return list(dict.fromkeys(options.groups))


def _eligible(reader: RolloutReader, options: HistoryOptions, budget: int) -> torch.Tensor:
    """``[T, N]`` bool window mask from env blocks of dones (a 32nd of ``budget``: the mask's temporaries
    take up to ~19 bytes per step)."""
    mask = torch.empty((reader.T, reader.N), dtype=torch.bool)
    for start, stop in reader.blocks(["dones"], budget=max(budget // 32, 1)):
        dones = reader.tensor("dones", start, stop)
        mask[:, start:stop] = window_mask(dones, options.history, across_episodes=options.across_episodes)
    return mask


def _read_steps(history: int, reader: RolloutReader, field: Field, block: Block) -> torch.Tensor:
    """A block's steps ``t0:t1`` of envs ``n0:n1`` and the ``K - 1`` steps before them (their windows' start),
    as ``[steps, n, *entry_shape]``."""
    t0, t1, n0, n1 = block
    return torch.from_numpy(read_region(reader, field.source, (max(0, t0 - history + 1), t1), (n0, n1)))


def _take_windows(history: int, block: Block, data: Rows, index: torch.Tensor, out: Rows | None) -> Rows:
    """The windows ending at rows ``index`` (``(t - t0) * n + j``) of a block, into ``out`` when given."""
    t0, _, n0, n1 = block
    ends = index + min(t0, history - 1) * (n1 - n0)  # rows of the data read, which starts K - 1 steps earlier
    return {
        name: gather_windows(value, ends, history, out=None if out is None else out[name])
        for name, value in data.items()
    }


def _shard_tensors(plan: Any, pass_index: int, shard: int, rows: Rows, N: int) -> dict[str, torch.Tensor]:
    """A shard's datasets: the gathered windows ``[B, K, ...]`` (observations, actions, rewards, dones) plus
    ``window_env``/``window_end [B]`` int64."""
    ends = plan.passes[pass_index].rows_of(shard)
    return {**rows, "window_env": torch.remainder(ends, N), "window_end": torch.div(ends, N, rounding_mode="floor")}


def _manifest(options: HistoryOptions, groups: list[str], counts: dict[str, Any]) -> dict[str, Any]:
    """The mode's manifest entries (between ``source`` and ``fields``)."""
    return {
        "options": {
            "num_mini_batches": options.num_mini_batches,
            "epochs": options.epochs,
            "seed": options.seed,
            "history": options.history,
            "across_episodes": options.across_episodes,
            "observations": groups,
            "compression": options.compression,
        },
        "order": ORDER_TEXT,
        "history": options.history,
        "across_episodes": options.across_episodes,
        "padding": "none",
        "window": WINDOW_TEXT.format(episodes=EPISODES_TEXT[options.across_episodes]),
        "groups": groups,
        **counts,
        "observation_keys": groups,
        "distribution_order": [],
    }


def history_job(reader: RolloutReader, options: HistoryOptions, budget: int) -> ExportJob:
    """``batch --history``'s export job: the eligible windows, shuffled per epoch."""
    T, N, K = reader.T, reader.N, options.history
    if K > T:
        raise usage(f"--history: expected at most {T} (the file's steps T), found {K}.")
    groups = _groups(reader, options)
    pairs = [(reader.schema.observation_keys[g], f"observations/{g}") for g in groups]
    pairs += [(name, f"window_{name}") for name in ("actions", "rewards", "dones")]  # a_t, r_t, done_t per step
    fields = export_fields(reader, pairs, window=K)
    ends = window_ends(_eligible(reader, options, budget))
    windows = ends.numel()
    if windows == 0:
        raise usage(
            f"--history: no window of {K} steps lies inside one episode of {reader.path} (every recorded episode "
            "is shorter). Use a smaller --history, or --across-episodes."
        )
    if options.num_mini_batches > windows:
        raise usage(
            f"--num-mini-batches: expected at most {windows} (the eligible windows), found {options.num_mini_batches}."
        )
    generator = torch.Generator().manual_seed(options.seed)
    plan = history_plan(ends, options.num_mini_batches, options.epochs, generator=generator)
    counts = {"windows_per_epoch": windows, "rows_per_epoch": windows, "dropped_rows": 0, "dropped_envs": []}
    return ExportJob(
        mode="history",
        fields=fields,
        plan=plan,
        read=partial(_read_steps, K),
        take=partial(_take_windows, K),
        shard_tensors=lambda p, shard, rows: _shard_tensors(plan, p, shard, rows, N),
        read_bytes=sum(f.row_bytes // K for f in fields),
        env_major=True,
        attrs={"history": K, "across_episodes": options.across_episodes},
        compression=options.compression,
        manifest=_manifest(options, groups, counts),
        summary={
            **{key: value for key, value in asdict(options).items() if key != "groups"},
            "groups": groups,
            **counts,
            "order": ORDER_TEXT,
        },
        label="batch --history",
    )
