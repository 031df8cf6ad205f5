"""``rolloutcli batch``: export mini-batch shards (feed-forward, recurrent, distillation) and a manifest.

Every mode is a :class:`~rolloutcli.core.batching.ShardPlan`. This module says which fields each mode
exports, how a block of the source becomes time-major rows and how a shard's rows become its datasets;
:func:`~rolloutcli.pipeline.shard_export.run_export` does the rest. Orders never depend on the budget.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rolloutcli.core.batching import BatchPlan, ShardPlan, gather_fields, plan_batches, side_plan
from rolloutcli.core.order import ALGORITHM, ORDER_VERSION, ROUNDS
from rolloutcli.core.trajectories import hidden_states_at_starts, plan_trajectories, scatter_into_trajectories
from rolloutcli.dataset import Paths, check_agreement
from rolloutcli.errors import RolloutError, problem_line
from rolloutcli.hdf5.atomic import check_output_path
from rolloutcli.hdf5.probe import probed_once
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.shards import is_shard_folder, read_region
from rolloutcli.pipeline.batch_dataset import DatasetFiles, check_files, dataset_gae, gae_record, gae_values
from rolloutcli.pipeline.batch_split import HoldOut, Side, plan_sides, run_split_batch
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
from rolloutcli.pipeline.transitions import TransitionOptions, transitions_job

ORDER_TEXT = {
    ("feedforward", False): "epoch e: the feistel-cw bijection of the T*N rows keyed by the e-th "
    "torch.randint(0, 2**62) of torch.Generator().manual_seed(seed) (rolloutcli.core.order); "
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


def order_record(plan: BatchPlan) -> dict[str, Any]:
    """The manifest's ``order_version`` and, for streamed orders, the algorithm and each pass's key."""
    keys = [p.order.key for p in plan.passes if p.order is not None]
    if not keys:
        return {"order_version": ORDER_VERSION}
    algorithm = {"name": ALGORITHM, "rounds": ROUNDS, "keys": keys}
    return {"order_version": ORDER_VERSION, "order_algorithm": algorithm}


@dataclass(frozen=True)
class BatchOptions:
    """What ``batch`` exports: ``num_mini_batches`` M shards per epoch (feed-forward rows, recurrent env
    groups, distillation step ranges); epochs that share an order share their files. ``mode`` is
    ``feedforward``, ``recurrent`` or ``distillation``; ``compression`` None, ``lzf`` or ``gzip``. With
    ``batch_size`` B (and ``num_mini_batches`` 0), M = ceil(items / B): mini-batches of at most B items whose
    sizes differ by at most one (exactly B when B divides the items).
    """

    num_mini_batches: int
    epochs: int = 1
    seed: int = 0
    mode: str = "feedforward"
    rsl_parity: bool = False
    shuffle_envs: bool = False
    compression: str | None = None
    batch_size: int | None = None  # instead of M: items per mini-batch (rows, envs or steps by mode), M from it
    offline: bool = False  # feed-forward rows of what the file has: no advantages or returns required


def _check_options(options: BatchOptions) -> None:
    """The combinations the command line cannot rule out (ranges and choices are checked there)."""
    if options.shuffle_envs and options.mode != "recurrent":
        raise usage("--shuffle-envs: expected --recurrent (it reshuffles env groups), found another mode.")
    if options.shuffle_envs and options.rsl_parity:
        raise usage("--shuffle-envs: RSL-RL uses fixed env groups; drop --rsl-parity or --shuffle-envs.")
    if (options.num_mini_batches > 0) == (options.batch_size is not None):
        raise usage("batch: expected exactly one of --num-mini-batches/-m M and --batch-size B.")
    if options.batch_size is not None and options.rsl_parity:
        raise usage("--batch-size: RSL-RL is configured by its number of mini-batches; use -m M with --rsl-parity.")
    if options.offline and options.mode != "feedforward":
        raise usage(f"--offline: expected feed-forward or --history batches, found --{options.mode}.")
    if options.rsl_parity and options.mode == "distillation":
        raise usage("--rsl-parity: distillation shards are always in RSL-RL's generator() order; drop it.")


def _check_source(reader: RolloutReader, options: BatchOptions, T: int, N: int, whose: str = "file") -> None:
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
    limit = _items(T, N, options.mode)
    if options.batch_size is not None and options.batch_size > limit[0]:
        raise usage(
            f"--batch-size: expected at most {limit[0]} (the {whose}'s {limit[1]}), found {options.batch_size}; "
            "a mini-batch cannot hold more than the data."
        )
    if options.num_mini_batches > limit[0]:
        raise usage(
            f"--num-mini-batches: expected at most {limit[0]} (the {whose}'s {limit[1]}), "
            f"found {options.num_mini_batches}."
        )


def _items(T: int, N: int, mode: str) -> tuple[int, str]:
    """What a mode cuts into mini-batches: the count and its name."""
    if mode == "feedforward":
        return T * N, "rows (T*N)"
    return (N, "envs (N)") if mode == "recurrent" else (T, "steps (T)")


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


def _check_dataset(
    files: Sequence[Path], options: BatchOptions | HistoryOptions | TransitionOptions, run: RunOptions
) -> DatasetFiles:
    """What a dataset export refuses (exit 2), then the files' agreement (exit 1)."""
    for kind, flag in ((HistoryOptions, "--history"), (TransitionOptions, "--transitions")):
        if isinstance(options, kind):
            raise usage(f"{flag}: expected one rollout file, found a dataset; export each file on its own.")
    assert isinstance(options, BatchOptions)
    if options.rsl_parity:
        raise usage("--rsl-parity: RSL-RL's order is for one file, found a dataset; drop --rsl-parity.")
    return check_files(files, run, None if options.mode == "feedforward" else f"batch --{options.mode}")


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


def _shape(mode: str, fields: list[Field], T: int, N: int, plan: ShardPlan, shard: int, rows: Rows) -> dict:
    """:func:`_shard_tensors` as a picklable work-unit step (``partial`` over the mode, fields and sizes)."""
    return _shard_tensors(mode, plan, shard, rows, fields, T, N)


def _planned(
    reader: RolloutReader, options: BatchOptions, dataset: DatasetFiles | None, side: Side | None
) -> tuple[BatchOptions, BatchPlan, int, int]:
    """The options (M from ``--batch-size``) and the plan over the source's ``T x N``: a dataset is one source of
    ``T x sum(N)`` (files side by side along envs: recurrent, distillation) or, feed-forward, of ``sum(T * N)``
    rows (``1 x rows``: a feed-forward shard never looks at T or N); a side of a split: over its rows or envs."""
    sizes = dataset.sizes if dataset is not None else [(reader.T, reader.N)]
    many = len(sizes) > 1
    T, N = reader.T, sum(n for _, n in sizes)
    if many and options.mode == "feedforward":
        T, N = 1, sum(t * n for t, n in sizes)
    planned = (T, N) if side is None else (1, side.rows.count) if options.mode == "feedforward" else (T, len(side.envs))
    # The first file answers for every file's fields: check_agreement found them all the same.
    whose = f"{side.name} side" if side is not None else "dataset" if many else "file"
    _check_source(reader, options, *planned, whose)
    if options.batch_size is not None:
        options = replace(options, num_mini_batches=-(-_items(*planned, options.mode)[0] // options.batch_size))
    plan = plan_batches(
        options.mode,
        *planned,
        options.num_mini_batches,
        options.epochs,
        parity=options.rsl_parity,
        shuffle_envs=options.shuffle_envs,
        generator=torch.Generator().manual_seed(options.seed),
    )
    if side is not None:
        plan = side_plan(plan, T, N, side.rows, torch.tensor(side.envs, dtype=torch.int64))
    return options, plan, T, N


def _job(
    reader: RolloutReader, options: BatchOptions, dataset: DatasetFiles | None = None, side: Side | None = None
) -> ExportJob:
    """``batch``'s export job for this source or dataset (``reader``: its first file; checked against the options
    first; see :func:`_planned`). ``side``: one side of a split (``batch_split.py``)."""
    many = dataset is not None and len(dataset.sizes) > 1
    options, plan, T, N = _planned(reader, options, dataset, side)
    fields = _fields(reader, options.mode)
    exported = any(f.name.startswith("distribution/") for f in fields)
    distribution = reader.distribution_order() if exported else []
    order = ORDER_TEXT[(options.mode, "shuffle" if options.shuffle_envs else options.rsl_parity)]
    common = {
        "rows_per_epoch": sum(plan.passes[0].sizes),
        "dropped_rows": plan.dropped_rows,
        "dropped_envs": plan.dropped_envs,
    }
    gae = dataset_gae(dataset) if dataset is not None else gae_record([gae_values(reader)])
    record = asdict(options)
    if options.batch_size is None:  # manifests of -m runs stay as they were
        del record["batch_size"]
    options_record = {key: value for key, value in record.items() if key != "mode"}
    return ExportJob(
        mode=options.mode,
        fields=fields,
        plan=plan,
        read=read_rows,
        take=take_rows,
        shard_tensors=lambda p, shard, rows: _shard_tensors(options.mode, plan.passes[p], shard, rows, fields, T, N),
        shape=partial(_shape, options.mode, fields, T, N),
        read_bytes=sum(f.row_bytes for f in fields),
        env_major=options.mode == "recurrent",
        env_concat=many and options.mode != "feedforward",
        row_wise=True,
        group_attrs={"distribution": {"order": distribution}} if exported else {},
        compression=options.compression,
        manifest={
            **({"split": side.record} if side is not None else {}),
            "options": options_record,
            "order": order,
            **order_record(plan),
            "gae": gae,
            **common,
            "observation_keys": sorted(reader.schema.observation_keys),
            "distribution_order": distribution,
        },
        summary={**options_record, **common, "gae": gae, "order": order, **({"split": side.record} if side else {})},
        label="batch" if options.mode == "feedforward" else f"batch --{options.mode}",
    )


def run_batch(
    src: Path | list[Path] | tuple[Path, ...] | Paths,
    dst: Path,
    options: BatchOptions | HistoryOptions | TransitionOptions,
    run: RunOptions,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    engine: Any = None,
    hold_out: HoldOut | None = None,
) -> dict[str, Any]:
    """Write the shard folder ``dst`` from the rollout file ``src`` (``HistoryOptions``: history windows;
    ``TransitionOptions``: off-policy transitions), or from a dataset (a list of files, sorted; feed-forward: one
    shuffle over every row of every file; recurrent and distillation: env groups or step ranges over all files'
    envs, which needs one T). ``hold_out``: ``dst/train`` and ``dst/valid`` instead (``batch_split.py``).

    Raises:
        RolloutError: bad option combinations, counts too large for the file or ``--max-memory`` below twice
            a chunk (exit 2), missing fields (exit 1), I/O faults (exit 3).
    """
    if isinstance(src, (tuple, list)):  # a dataset, packed: a list of Path objects held ~500 B a file
        src = Paths([os.fspath(p) for p in src])
    with probed_once():  # a dataset's files are opened several times here: to check them, then to export them
        if hold_out is not None:
            return _run_split(src, dst, options, run, hold_out, overwrite=overwrite, progress=progress, engine=engine)
        # an output in the way is refused before a dataset's files are checked (and again when it is published)
        check_output_path(dst, src if isinstance(src, Paths) else [src], overwrite=overwrite, kind="folder",
                          owned=is_shard_folder)  # fmt: skip
        dataset = _check_dataset(src, options, run) if isinstance(src, Paths) else None
        if isinstance(options, HistoryOptions):
            prepare = partial(history_job, options=options, budget=run.max_memory)
        elif isinstance(options, TransitionOptions):
            prepare = partial(transitions_job, options=options, budget=run.max_memory)
        else:
            _check_options(options)
            prepare = partial(_job, options=options, dataset=dataset)
        export = {"overwrite": overwrite, "progress": progress, "engine": engine, "checked": dataset is not None}
        return run_export(src, dst, prepare, run, **export)


def _run_split(src: Path | Paths, dst: Path, options: Any, run: RunOptions, hold_out: HoldOut, **export: Any) -> dict:
    """``batch`` once per side of the split, into ``dst/train`` and ``dst/valid``, published together;
    ``export``: ``overwrite``, ``progress``, ``engine``."""
    hold_out.check(getattr(options, "mode", "history" if isinstance(options, HistoryOptions) else "transitions"))
    _check_options(options)
    hold_out.check_parity(options.rsl_parity)
    files = src if isinstance(src, Paths) else [src]
    dataset = _check_dataset(files, options, run) if len(files) > 1 else None
    sizes = dataset.sizes if dataset is not None else check_agreement(files, run.safety)
    sides = plan_sides(files, sizes, hold_out, run, export.get("engine"))
    overwrite = export.pop("overwrite")

    def each(folder: Path, side: Side) -> dict[str, Any]:
        return run_export(src, folder, partial(_job, options=options, dataset=dataset, side=side), run, **export)

    return run_split_batch(files, dst, sides, each, overwrite)
