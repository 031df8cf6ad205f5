"""``rolloutcli batch``: export mini-batch shards (feed-forward, recurrent, distillation) and a manifest.

Every mode is a :class:`~rolloutcli.core.batching.ShardPlan`. This module says which fields each mode
exports, how a block of the source becomes time-major rows and how a shard's rows become its datasets;
:func:`~rolloutcli.pipeline.shard_export.run_export` does the rest. Orders never depend on the budget.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rolloutcli.core.batching import ShardPlan, gather_fields, plan_batches
from rolloutcli.core.trajectories import hidden_states_at_starts, plan_trajectories, scatter_into_trajectories
from rolloutcli.errors import RolloutError, problem_line
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.shards import read_region
from rolloutcli.pipeline.history import HistoryOptions, history_job
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import Progress
from rolloutcli.pipeline.shard_export import (
    Block,
    ExportJob,
    Field,
    Rows,
    export_fields,
    run_export,
    usage,
)

ORDER_TEXT = {
    ("feedforward", False): "epoch e: the e-th torch.randperm(T*N) drawn from torch.Generator().manual_seed(seed); "
    "M mini-batches whose sizes differ by at most one row",
    ("feedforward", True): "RSL-RL: one torch.randperm(M*(T*N//M)) from torch.Generator().manual_seed(seed), "
    "reused every epoch; T*N % M rows dropped",
    ("recurrent", False): "contiguous env groups whose sizes differ by at most one env, the same every epoch",
    ("recurrent", True): "RSL-RL: contiguous groups of N//M envs, the same every epoch; N % M envs dropped",
    ("recurrent", "shuffle"): "epoch e: env groups cut from the e-th torch.randperm(N) of "
    "torch.Generator().manual_seed(seed), sizes differing by at most one env, each sorted",
    ("distillation", False): "RSL-RL generator() order: consecutive step ranges of all envs, sizes differing "
    "by at most one step, the same every epoch",
}


@dataclass(frozen=True)
class BatchOptions:
    """What ``batch`` exports: ``num_mini_batches`` M shards per epoch (feed-forward rows, recurrent env
    groups, distillation step ranges); epochs that share an order share their files. ``mode`` is
    ``feedforward``, ``recurrent`` or ``distillation``; ``compression`` None, ``lzf`` or ``gzip``.
    """

    num_mini_batches: int
    epochs: int = 1
    seed: int = 0
    mode: str = "feedforward"
    rsl_parity: bool = False
    shuffle_envs: bool = False
    compression: str | None = None
    offline: bool = False  # feed-forward rows of what the file has: no advantages or returns required


def _check_options(options: BatchOptions) -> None:
    """The combinations the command line cannot rule out (ranges and choices are checked there)."""
    if options.shuffle_envs and options.mode != "recurrent":
        raise usage("--shuffle-envs: expected --recurrent (it reshuffles env groups), found another mode.")
    if options.shuffle_envs and options.rsl_parity:
        raise usage("--shuffle-envs: RSL-RL uses fixed env groups; drop --rsl-parity or --shuffle-envs.")
    if options.offline and options.mode != "feedforward":
        raise usage(f"--offline: expected feed-forward or --history batches, found --{options.mode}.")
    if options.rsl_parity and options.mode == "distillation":
        raise usage("--rsl-parity: distillation shards are always in RSL-RL's generator() order; drop it.")


def _check_source(reader: RolloutReader, options: BatchOptions) -> None:
    fields, path = reader.schema.fields, reader.path
    if options.mode == "distillation":
        if "privileged_actions" not in fields:
            raise RolloutError.field(
                path,
                "privileged_actions",
                "a dataset [T, N, *action_shape] of teacher actions for --distillation",
                "nothing",
                "Record the teacher's actions, or export RL mini-batches without --distillation.",
            )
    elif not options.offline:
        missing = [name for name in ("advantages", "returns") if name not in fields]
        if missing:
            fix = (
                "Run `rolloutcli gae` first. For offline data without a critic, pass --offline (exports what the "
                "file has)."
            )
            problems = [problem_line(path, name, "a dataset [T, N]", "nothing", fix) for name in missing]
            raise RolloutError.many(path, problems)
    limit = {"feedforward": (reader.T * reader.N, "rows (T*N)"), "recurrent": (reader.N, "envs (N)")}.get(
        options.mode, (reader.T, "steps (T)")
    )
    if options.num_mini_batches > limit[0]:
        raise usage(
            f"--num-mini-batches: expected at most {limit[0]} (the file's {limit[1]}), "
            f"found {options.num_mini_batches}."
        )


# What `rolloutcli returns` writes: per-step extras a feed-forward export carries along when present.
OFFLINE_TARGETS = ("returns_to_go", "returns_truncated")


def _fields(reader: RolloutReader, mode: str) -> list[Field]:
    """The fields a mode exports, observations first, each with its row dtype and shape (as read, normalised)."""
    schema = reader.schema
    pairs = [(path, f"observations/{key}") for key, path in schema.observation_keys.items()]
    if mode == "distillation":
        pairs += [("privileged_actions", "privileged_actions"), ("dones", "dones")]
    else:
        observations = set(schema.observation_keys.values())
        names = schema.per_step_names() + [n for n in OFFLINE_TARGETS if n in schema.step_names()]
        pairs += [(n, n) for n in sorted(names) if n not in observations]
        if mode == "recurrent":
            pairs += [(path, path) for net in ("actor", "critic") for path in schema.hidden.get(net, [])]
    return export_fields(reader, pairs)


def read_rows(reader: RolloutReader, field: Field, block: Block) -> torch.Tensor:
    """A block ``(t0, t1, n0, n1)`` of a field as time-major rows ``[steps * envs, *row_shape]``."""
    t0, t1, n0, n1 = block
    data = torch.from_numpy(read_region(reader, field.source, (t0, t1), (n0, n1)))
    if field.hidden:  # [t, layers, n, H] -> [t, n, layers, H]
        data = data.permute(0, 2, 1, 3)
    return data.reshape((t1 - t0) * (n1 - n0), *field.row_shape)


def take_rows(block: Block, data: Rows, index: torch.Tensor, out: Rows | None) -> Rows:
    """Rows ``index`` of a block's rows, into ``out`` when given."""
    if out is None:
        out = {name: value.new_empty((index.numel(), *value.shape[1:])) for name, value in data.items()}
    return gather_fields(data, index, out)


def _shard_tensors(
    mode: str, plan: ShardPlan, shard: int, rows: Rows, fields: list[Field], T: int, N: int
) -> dict[str, torch.Tensor]:
    """Shape one shard's gathered rows ``{name: [rows, ...]}`` into its file's datasets (README: the shard folder)."""
    if mode == "feedforward":
        out = {f.name: rows[f.name] for f in fields}
        out["index"] = plan.rows_of(shard)
        return out
    if mode == "distillation":
        assert plan.steps is not None
        start, stop = plan.steps[shard]
        out = {f.name: rows[f.name].view(stop - start, N, *f.row_shape) for f in fields}
        out["steps"] = torch.arange(start, stop, dtype=torch.int64)
        return out
    assert plan.envs is not None
    envs = plan.envs[shard]
    per_step = {f.name: rows[f.name].view(T, envs.numel(), *f.row_shape) for f in fields}
    trajectories = plan_trajectories(per_step["dones"])
    spans = trajectories.spans
    out = {}
    for f in fields:
        if f.name.startswith("observations/"):
            out[f.name] = scatter_into_trajectories(per_step[f.name], trajectories)
    out["masks"] = trajectories.masks()
    for f in fields:
        if f.hidden:  # the state fed into the network at each trajectory's first step: [layers, M, H]
            out[f.name] = hidden_states_at_starts(per_step[f.name].permute(0, 2, 1, 3), spans)
        elif not f.name.startswith("observations/"):
            out[f.name] = per_step[f.name]
    out["env_ids"] = envs.to(torch.int64)
    out["trajectory_env"] = envs.to(torch.int64)[spans.env]
    out["trajectory_start"] = spans.start
    return out


def _job(reader: RolloutReader, options: BatchOptions) -> ExportJob:
    """``batch``'s export job for this source (checked against the options first)."""
    _check_source(reader, options)
    T, N = reader.T, reader.N
    fields = _fields(reader, options.mode)
    plan = plan_batches(
        options.mode,
        T,
        N,
        options.num_mini_batches,
        options.epochs,
        parity=options.rsl_parity,
        shuffle_envs=options.shuffle_envs,
        generator=torch.Generator().manual_seed(options.seed),
    )
    exported = any(f.name.startswith("distribution/") for f in fields)
    distribution = reader.distribution_order() if exported else []
    order = ORDER_TEXT[(options.mode, "shuffle" if options.shuffle_envs else options.rsl_parity)]
    common = {
        "rows_per_epoch": sum(plan.passes[0].sizes),
        "dropped_rows": plan.dropped_rows,
        "dropped_envs": plan.dropped_envs,
    }
    attrs = reader.schema.attrs  # what a gae run recorded in the source (None where it recorded nothing)
    gae = {"gamma": attrs.get("gae_gamma"), "lambda": attrs.get("gae_lambda")}
    gae |= {name: attrs.get(name) for name in ("advantages_normalized", "timeouts_bootstrapped")}
    options_record = {key: value for key, value in asdict(options).items() if key != "mode"}
    return ExportJob(
        mode=options.mode,
        fields=fields,
        plan=plan,
        read=read_rows,
        take=take_rows,
        shard_tensors=lambda p, shard, rows: _shard_tensors(options.mode, plan.passes[p], shard, rows, fields, T, N),
        read_bytes=sum(f.row_bytes for f in fields),
        env_major=options.mode == "recurrent",
        group_attrs={"distribution": {"order": distribution}} if exported else {},
        compression=options.compression,
        manifest={
            "options": options_record,
            "order": order,
            "gae": gae,
            **common,
            "observation_keys": sorted(reader.schema.observation_keys),
            "distribution_order": distribution,
        },
        summary={**options_record, **common, "gae": gae, "order": order},
        label="batch" if options.mode == "feedforward" else f"batch --{options.mode}",
    )


def run_batch(
    src: Path,
    dst: Path,
    options: BatchOptions | HistoryOptions,
    run: RunOptions,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write the shard folder ``dst`` from the rollout file ``src`` (``HistoryOptions``: history windows).

    Raises:
        RolloutError: bad option combinations, counts too large for the file or ``--max-memory`` below twice
            a chunk (exit 2), missing fields (exit 1), I/O faults (exit 3).
    """
    if isinstance(options, HistoryOptions):
        prepare = partial(history_job, options=options, budget=run.max_memory)
    else:
        _check_options(options)
        prepare = partial(_job, options=options)
    return run_export(src, dst, prepare, run, overwrite=overwrite, progress=progress)
