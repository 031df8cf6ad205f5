"""``rolloutcli batch --transitions [--n-step K]``: off-policy transitions ``(s, a, R, s', discount)`` in shards.

A transition is named by its source row ``t * N + n``. Its ``rewards`` are the n-step return of
:func:`rolloutcli.core.nstep.nstep_returns` (the reward itself for K = 1), ``discount`` is ``gamma^m`` (0 when
the window ends on a termination), and ``next_observations/<key>`` is the observation that bootstraps it: the
one K steps on within the episode, ``final_observations`` where the window ends on an episode end (zeros where
the file has none and the end is a termination: its discount is 0), ``last_observations`` past the rollout's
end. Transitions whose bootstrap observation is unknown (past the end without ``last_observations``) are held
back; gymnasium's autoreset steps (``autoreset_steps``) are no transitions and are left out. The eligible rows
are shuffled like every feed-forward export: epoch e cuts the e-th ``torch.randperm``.
The windows of the whole file are computed first, per env block, and kept (26 bytes per row).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import partial

import numpy as np
import torch

from rolloutcli.core.batching import gather_fields
from rolloutcli.core.history import history_plan, window_ends
from rolloutcli.core.nstep import nstep_returns
from rolloutcli.fields import AUTORESET
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.shards import read_region
from rolloutcli.pipeline.nstep import NStepOptions, check_nstep_source
from rolloutcli.pipeline.shard_export import Block, ExportJob, Field, Rows, export_fields, usage

ORDER_TEXT = (
    "epoch e: the e-th torch.randperm(W) drawn from torch.Generator().manual_seed(seed), applied to the W "
    "exported transitions in ascending order of their row t*N+n; M mini-batches whose sizes differ by at most one"
)
NEXT_TEXT = (
    "next_observations: the observation of step t+m (m = rewards summed, at most K) within the episode; "
    "final_observations[t+m-1] where the window ends on an episode end (zeros at a termination when the file "
    "has none); last_observations past the rollout's end (held back without them)"
)


@dataclass(frozen=True)
class TransitionOptions:
    """What ``batch --transitions`` exports: ``n_step`` K rewards per transition discounted by ``gamma``, time-outs
    by ``timeouts`` (``final-value`` or ``ignore``), ``num_mini_batches`` M shards per epoch, or with
    ``batch_size`` B (and M 0) M = ceil(transitions / B), as for the other modes."""

    num_mini_batches: int
    n_step: int = 1
    gamma: float = 0.99
    timeouts: str = "final-value"
    epochs: int = 1
    seed: int = 0
    compression: str | None = None
    batch_size: int | None = None


@dataclass(frozen=True)
class _Windows:
    """The n-step windows of the whole file, ``[T, N]`` each."""

    returns: torch.Tensor
    discount: torch.Tensor
    next_step: torch.Tensor
    last: torch.Tensor  # the window's last step
    terminated: torch.Tensor  # uint8: ends on an episode end without bootstrapping
    truncated: torch.Tensor  # uint8: ends on a time-out


def _windows(reader: RolloutReader, options: NStepOptions, rewards: str, budget: int) -> _Windows:
    T, N = reader.T, reader.N
    out = {name: torch.empty((T, N), dtype=dtype) for name, dtype in _WINDOW_DTYPES.items()}
    flags = [name for name in ("dones", "time_outs") if name in reader.schema.fields]
    for start, stop in reader.blocks([rewards, *flags], budget=max(budget // 16, 1)):
        r = reader.read(rewards, start, stop)
        r = torch.from_numpy(np.ascontiguousarray(r.reshape(r.shape[:2]), dtype=np.float32))
        block = {name: reader.tensor(name, start, stop) for name in flags}
        time_outs = block.get("time_outs")
        result = nstep_returns(r, block["dones"], options.n, options.gamma, time_outs, timeouts=options.timeouts)
        last = torch.arange(T).unsqueeze(1) + result.steps - 1
        ended = result.next_step == -1
        timed_out = ended & time_outs.gather(0, last).bool() if time_outs is not None else torch.zeros_like(ended)
        bootstraps = timed_out if options.timeouts == "final-value" else torch.zeros_like(ended)
        values = {
            "returns": result.returns,
            "discount": result.discount,
            "next_step": result.next_step,
            "last": last,
            "terminated": ended & ~bootstraps,
            "truncated": timed_out,
        }
        for name, value in values.items():
            out[name][:, start:stop] = value
    return _Windows(**out)


_WINDOW_DTYPES = {
    "returns": torch.float32,
    "discount": torch.float32,
    "next_step": torch.int64,
    "last": torch.int64,
    "terminated": torch.uint8,
    "truncated": torch.uint8,
}
_FROM_WINDOWS = {"rewards": "returns", "discount": "discount", "terminated": "terminated", "truncated": "truncated"}


def _read(reader: RolloutReader, field: Field, block: Block, *, windows: _Windows) -> torch.Tensor:
    """A block ``(t0, t1, n0, n1)`` of an exported field as time-major rows ``[steps * envs, *row_shape]``."""
    t0, t1, n0, n1 = block
    rows = (t1 - t0) * (n1 - n0)
    if field.name in _FROM_WINDOWS:
        return getattr(windows, _FROM_WINDOWS[field.name])[t0:t1, n0:n1].reshape(rows).contiguous()
    if field.name.startswith("next_observations/"):
        return _next_observations(reader, windows, field, block).reshape(rows, *field.row_shape)
    return torch.from_numpy(read_region(reader, field.source, (t0, t1), (n0, n1))).reshape(rows, *field.row_shape)


def _next_observations(reader: RolloutReader, windows: _Windows, field: Field, block: Block) -> torch.Tensor:
    """``[t1 - t0, n1 - n0, *shape]``: each transition's bootstrap observation (see the module docstring)."""
    t0, t1, n0, n1 = block
    T, key = reader.T, field.name.split("/", 1)[1]
    nxt, last = windows.next_step[t0:t1, n0:n1], windows.last[t0:t1, n0:n1]
    env = torch.arange(n1 - n0).expand(t1 - t0, n1 - n0)
    out = torch.zeros((t1 - t0, n1 - n0, *field.row_shape), dtype=field.dtype)
    ahead = (nxt >= 0) & (nxt < T)
    if ahead.any():
        lo, hi = int(nxt[ahead].min()), int(nxt[ahead].max()) + 1
        region = torch.from_numpy(read_region(reader, field.source, (lo, hi), (n0, n1)))
        out[ahead] = region[nxt[ahead] - lo, env[ahead]]
    final, final_path = nxt == -1, f"final_observations/{key}"
    if final.any() and final_path in reader.schema.fields:
        lo, hi = int(last[final].min()), int(last[final].max()) + 1
        region = torch.from_numpy(read_region(reader, final_path, (lo, hi), (n0, n1)))
        out[final] = region[last[final] - lo, env[final]].to(field.dtype)
    beyond, last_path = nxt == T, f"last_observations/{key}"
    if beyond.any() and last_path in reader.schema.fields:
        row = torch.from_numpy(reader.array(last_path, n0, n1))
        out[beyond] = row[env[beyond]].to(field.dtype)
    return out


def _take(block: Block, data: Rows, index: torch.Tensor, out: Rows | None) -> Rows:
    if out is None:
        out = {name: value.new_empty((index.numel(), *value.shape[1:])) for name, value in data.items()}
    return gather_fields(data, index, out)


def _fields(reader: RolloutReader) -> list[Field]:
    keys = reader.schema.observation_keys
    observations = export_fields(reader, [(path, f"observations/{key}") for key, path in keys.items()])
    nexts = [replace(f, name=f"next_observations/{f.name.split('/', 1)[1]}") for f in observations]
    scalars = [
        Field("rewards", "rewards", "rewards", torch.float32, ()),
        Field("rewards", "discount", "discount", torch.float32, ()),
        Field("dones", "terminated", "terminated", torch.uint8, ()),
        Field("dones", "truncated", "truncated", torch.uint8, ()),
    ]
    return [*observations, *export_fields(reader, [("actions", "actions")]), *nexts, *scalars]


def transitions_job(reader: RolloutReader, options: TransitionOptions, budget: int) -> ExportJob:
    """``batch --transitions``' export job: every transition whose bootstrap observation is known, shuffled."""
    nstep = NStepOptions(options.n_step, options.gamma, options.timeouts)
    rewards = check_nstep_source(reader, nstep, budget)
    windows = _windows(reader, nstep, rewards, budget)
    known_end = all(f"last_observations/{key}" in reader.schema.fields for key in reader.schema.observation_keys)
    eligible = torch.ones((reader.T, reader.N), dtype=torch.bool) if known_end else windows.next_step != reader.T
    skipped = {}
    if AUTORESET in reader.schema.fields:  # gymnasium's autoreset steps are no transitions
        reset = torch.from_numpy(reader.array(AUTORESET)) != 0
        eligible &= ~reset
        skipped = {"autoreset_steps": int(reset.sum())}
    rows = window_ends(eligible)
    held_back = reader.T * reader.N - rows.numel() - sum(skipped.values())
    known = "(the transitions whose bootstrap observation is known)"
    if options.batch_size is not None and options.batch_size > rows.numel():
        raise usage(
            f"--batch-size: expected at most {rows.numel()} {known}, found {options.batch_size}; a mini-batch cannot "
            "hold more than the data."
        )
    if options.batch_size is not None:
        options = replace(options, num_mini_batches=-(-rows.numel() // options.batch_size))
    if options.num_mini_batches > rows.numel():
        raise usage(f"--num-mini-batches: expected at most {rows.numel()} {known}, found {options.num_mini_batches}.")
    plan = history_plan(
        rows, options.num_mini_batches, options.epochs, generator=torch.Generator().manual_seed(options.seed)
    )
    plan = replace(plan, mode="transitions")
    fields = _fields(reader)
    counts = {"rows_per_epoch": rows.numel(), "held_back": held_back, "dropped_rows": 0, "dropped_envs": [], **skipped}
    record = asdict(options)
    if options.batch_size is None:  # manifests of -m runs stay as they were
        del record["batch_size"]
    return ExportJob(
        mode="transitions",
        fields=fields,
        plan=plan,
        read=partial(_read, windows=windows),
        take=_take,
        shard_tensors=lambda p, shard, rows_: {**rows_, "index": plan.passes[p].rows_of(shard)},
        read_bytes=sum(f.row_bytes * (2 if f.name.startswith("next_") else 1) for f in fields),
        env_major=True,
        attrs={"n_step": options.n_step, "gamma": options.gamma, "timeouts": options.timeouts},
        compression=options.compression,
        manifest={
            "options": record,
            "order": ORDER_TEXT,
            "next_observations": NEXT_TEXT,
            "rewards": rewards,
            **counts,
            "observation_keys": sorted(reader.schema.observation_keys),
            "distribution_order": [],
        },
        summary={**record, **counts, "order": ORDER_TEXT},
        label="batch --transitions",
    )
