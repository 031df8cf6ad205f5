"""Index plans for mini-batches: which source rows go into which mini-batch, in which order.

A rollout holds ``T * N`` rows; row ``t * N + n`` is step t of env n (time-major, as RSL-RL flattens
``[T, N, ...]``). Every mode is described by the same object, a :class:`ShardPlan`: the source rows of each
mini-batch, concatenated mini-batch after mini-batch, each in the order its slots are filled::

    rows  = [ rows of mini-batch 0 | rows of mini-batch 1 | ... ]        sizes = [B0, B1, ...]
    feed-forward:  a slice of a permutation of the rows                   (slot i = i-th row drawn)
    recurrent:     t * N + env_ids[j] for t < T, j < G  (slot t * G + j)  -> viewed as [T, G, ...]
    distillation:  t * N + n for t in [start, stop), n < N                -> viewed as [steps, N, ...]

The same plan drives the in-memory generators (gather ``rows``), the streamed shard export (its inverse,
:meth:`ShardPlan.positions`, sends each row of an env block to its mini-batch and slot) and the manifest.

Randomness comes only from the ``torch.Generator`` passed in (never the global RNG, except where RSL-RL
parity asks for it explicitly with ``generator=None`` in ``RolloutStorage``). Orders are drawn on the CPU,
so they are the same whatever device the data lives on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch

MODES = ("feedforward", "recurrent", "distillation")


def split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` consecutive pieces of ``total`` items that differ by at most one (none lost).

    The first ``total % parts`` pieces get one extra item: ``split_sizes(10, 3) == [4, 3, 3]``.
    """
    if parts < 1 or total < parts:
        raise ValueError(f"cannot cut {total} items into {parts} non-empty pieces")
    base, extra = divmod(total, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def parity_sizes(total: int, parts: int) -> list[int]:
    """RSL-RL's sizes: ``parts`` pieces of ``total // parts`` items; the last ``total % parts`` are dropped."""
    if parts < 1 or total < parts:
        raise ValueError(f"cannot cut {total} items into {parts} non-empty pieces")
    return [total // parts] * parts


@dataclass(frozen=True)
class ShardPlan:
    """The mini-batches of one pass (one epoch, or every epoch when they all share one order).

    Attributes:
        sizes: rows of each mini-batch.
        rows: ``[sum(sizes)]`` int64 source rows ``t * N + n``, mini-batch after mini-batch, in slot order.
        envs: recurrent only: the env ids of each mini-batch (``[G]`` int64, ascending).
        steps: distillation only: the ``(start, stop)`` step range of each mini-batch.
    """

    sizes: tuple[int, ...]
    rows: torch.Tensor
    envs: tuple[torch.Tensor, ...] | None = None
    steps: tuple[tuple[int, int], ...] | None = None

    @cached_property
    def offsets(self) -> list[int]:
        """``[M + 1]`` start of each mini-batch in ``rows`` (and the total at the end)."""
        out = [0]
        for size in self.sizes:
            out.append(out[-1] + size)
        return out

    def rows_of(self, shard: int) -> torch.Tensor:
        """``[sizes[shard]]`` int64 source rows of one mini-batch in slot order (a view of ``rows``)."""
        return self.rows[self.offsets[shard] : self.offsets[shard + 1]]

    def positions(self, num_rows: int) -> torch.Tensor:
        """Inverse of ``rows``: ``[num_rows]`` int64, the position of each source row in ``rows``, -1 if unused.

        Position p lies in mini-batch ``s`` with ``offsets[s] <= p < offsets[s + 1]``, at slot
        ``p - offsets[s]``. Costs 8 bytes per source row.
        """
        out = torch.full((num_rows,), -1, dtype=torch.int64)
        out[self.rows] = torch.arange(self.rows.numel(), dtype=torch.int64)
        return out


@dataclass(frozen=True)
class BatchPlan:
    """Every epoch's mini-batches. Epochs that share an order share a pass (written once, listed per epoch).

    Attributes:
        mode: ``feedforward``, ``recurrent`` or ``distillation``.
        passes: the distinct passes.
        epoch_pass: for each epoch, the index of its pass.
        dropped_rows: source rows in no mini-batch (RSL-RL parity only).
        dropped_envs: env ids in no mini-batch (recurrent RSL-RL parity only).
    """

    mode: str
    passes: list[ShardPlan]
    epoch_pass: list[int]
    dropped_rows: int = 0
    dropped_envs: list[int] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------
# Feed-forward
# ----------------------------------------------------------------------------------------------------------


def feedforward_order(
    num_rows: int, num_mini_batches: int, *, parity: bool, generator: torch.Generator | None
) -> torch.Tensor:
    """One epoch's order of rows: ``torch.randperm`` of all rows, or of RSL-RL's ``M * (rows // M)`` with parity.

    RSL-RL draws ``torch.randperm(num_mini_batches * mini_batch_size)``: a permutation of the *first*
    ``M * (rows // M)`` rows (the last ``rows % M`` rows are never used). With ``generator=None`` this draws
    from the global CPU RNG exactly as RSL-RL does on the CPU.
    """
    count = num_mini_batches * (num_rows // num_mini_batches) if parity else num_rows
    return torch.randperm(count, generator=generator)


def feedforward_plan(
    num_steps: int, num_envs: int, num_mini_batches: int, num_epochs: int, *, parity: bool, generator: torch.Generator
) -> BatchPlan:
    """Feed-forward mini-batches of the ``T * N`` rows.

    * default: epoch e uses the e-th ``torch.randperm(T * N, generator=generator)`` (consecutive draws), cut
      into ``M`` mini-batches whose sizes differ by at most one: every row exactly once per epoch.
    * ``parity``: RSL-RL's ``mini_batch_generator``: one ``randperm(M * (T * N // M))`` drawn once and reused
      for every epoch, ``T * N % M`` rows dropped.
    """
    num_rows = num_steps * num_envs
    if parity:
        order = feedforward_order(num_rows, num_mini_batches, parity=True, generator=generator)
        plan = ShardPlan(tuple(parity_sizes(num_rows, num_mini_batches)), order)
        return BatchPlan("feedforward", [plan], [0] * num_epochs, dropped_rows=num_rows - order.numel())
    sizes = tuple(split_sizes(num_rows, num_mini_batches))
    passes = [
        ShardPlan(sizes, feedforward_order(num_rows, num_mini_batches, parity=False, generator=generator))
        for _ in range(num_epochs)
    ]
    return BatchPlan("feedforward", passes, list(range(num_epochs)))


# ----------------------------------------------------------------------------------------------------------
# Recurrent
# ----------------------------------------------------------------------------------------------------------


def recurrent_groups(
    num_envs: int, num_mini_batches: int, *, parity: bool, shuffle: bool = False, generator: torch.Generator | None
) -> list[torch.Tensor]:
    """One epoch's env groups, each ``[G]`` int64 ascending.

    * ``parity``: RSL-RL's ``recurrent_mini_batch_generator``: contiguous groups of ``N // M`` envs, the last
      ``N % M`` envs dropped.
    * default: contiguous groups whose sizes differ by at most one (no env dropped).
    * ``shuffle``: groups of the same sizes drawn from ``torch.randperm(N, generator=generator)``, each sorted
      (the order of envs inside a group does not change what a recurrent network learns; ascending keeps
      trajectories env-major like RSL-RL).
    """
    if parity and shuffle:
        raise ValueError("RSL-RL parity uses fixed contiguous env groups; it cannot be combined with shuffling")
    sizes = parity_sizes(num_envs, num_mini_batches) if parity else split_sizes(num_envs, num_mini_batches)
    envs = torch.randperm(num_envs, generator=generator) if shuffle else torch.arange(num_envs)
    groups, start = [], 0
    for size in sizes:
        group = envs[start : start + size]
        groups.append(torch.sort(group).values if shuffle else group)
        start += size
    return groups


def recurrent_rows(num_steps: int, num_envs: int, envs: torch.Tensor) -> torch.Tensor:
    """``[T * G]`` int64 source rows of an env group in slot order ``t * G + j`` (so it views as ``[T, G]``)."""
    steps = torch.arange(num_steps, dtype=torch.int64).unsqueeze(1) * num_envs
    return (steps + envs.to(torch.int64).unsqueeze(0)).reshape(-1)


def recurrent_plan(
    num_steps: int,
    num_envs: int,
    num_mini_batches: int,
    num_epochs: int,
    *,
    parity: bool,
    shuffle: bool,
    generator: torch.Generator,
) -> BatchPlan:
    """Recurrent mini-batches: env groups (see :func:`recurrent_groups`), every step of their envs.

    Without ``shuffle`` every epoch uses the same groups (one pass); with it, epoch e uses the e-th
    ``torch.randperm(N, generator=generator)``.
    """

    def make_pass() -> ShardPlan:
        groups = recurrent_groups(num_envs, num_mini_batches, parity=parity, shuffle=shuffle, generator=generator)
        rows = torch.cat([recurrent_rows(num_steps, num_envs, g) for g in groups])
        return ShardPlan(tuple(num_steps * g.numel() for g in groups), rows, envs=tuple(groups))

    passes = [make_pass() for _ in range(num_epochs if shuffle else 1)]
    dropped = list(range(num_mini_batches * (num_envs // num_mini_batches), num_envs)) if parity else []
    epoch_pass = list(range(num_epochs)) if shuffle else [0] * num_epochs
    return BatchPlan("recurrent", passes, epoch_pass, dropped_rows=num_steps * len(dropped), dropped_envs=dropped)


# ----------------------------------------------------------------------------------------------------------
# Distillation
# ----------------------------------------------------------------------------------------------------------


def distillation_ranges(num_steps: int, num_mini_batches: int) -> list[tuple[int, int]]:
    """Consecutive step ranges ``[(start, stop)]`` covering ``range(T)``, sizes differing by at most one."""
    ranges, start = [], 0
    for size in split_sizes(num_steps, num_mini_batches):
        ranges.append((start, start + size))
        start += size
    return ranges


def distillation_plan(num_steps: int, num_envs: int, num_mini_batches: int, num_epochs: int) -> BatchPlan:
    """RSL-RL's ``generator()`` order (time steps in order, all envs) cut into ``M`` step ranges.

    No randomness: every epoch reads the same ranges (one pass).
    """
    ranges = distillation_ranges(num_steps, num_mini_batches)
    rows = torch.arange(num_steps * num_envs, dtype=torch.int64)
    plan = ShardPlan(tuple((b - a) * num_envs for a, b in ranges), rows, steps=tuple(ranges))
    return BatchPlan("distillation", [plan], [0] * num_epochs)


def plan_batches(
    mode: str,
    num_steps: int,
    num_envs: int,
    num_mini_batches: int,
    num_epochs: int,
    *,
    parity: bool = False,
    shuffle_envs: bool = False,
    generator: torch.Generator,
) -> BatchPlan:
    """The plan of any mode; ``generator`` is the only source of randomness (seed it for reproducible orders)."""
    if mode == "feedforward":
        return feedforward_plan(num_steps, num_envs, num_mini_batches, num_epochs, parity=parity, generator=generator)
    if mode == "recurrent":
        return recurrent_plan(
            num_steps,
            num_envs,
            num_mini_batches,
            num_epochs,
            parity=parity,
            shuffle=shuffle_envs,
            generator=generator,
        )
    if mode == "distillation":
        return distillation_plan(num_steps, num_envs, num_mini_batches, num_epochs)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


# ----------------------------------------------------------------------------------------------------------
# Row gathers (the hot path of the feed-forward export)
# ----------------------------------------------------------------------------------------------------------


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``[R, ...]`` contiguous -> ``[R, row_bytes]`` viewed as the widest element type that tiles a row.

    ``index_select`` copies element by element inside a row; moving a 192-byte row of 48 float32 as 12
    complex128 moves the same bits with a quarter of the element copies. Works for every dtype (bool too).
    """
    rows = x.reshape(x.shape[0], -1) if x.dim() != 2 else x
    if rows.shape[1] == 0:
        return rows
    as_bytes = rows.view(torch.uint8)
    for wide in (torch.complex128, torch.int64, torch.int32, torch.int16):
        if as_bytes.shape[1] % wide.itemsize == 0 and as_bytes.data_ptr() % wide.itemsize == 0:
            return as_bytes.view(wide)
    return as_bytes


def gather_rows(source: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = source[rows[i]]`` for ``source [R, ...]``, through ``index_select(out=)`` on wide row views.

    ``out`` (``[len(rows), ...]``, contiguous, ``source``'s dtype) is reused when given: a warm buffer avoids
    the page faults of a fresh allocation, which cost more than the copy itself.
    """
    shape = (rows.numel(), *source.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=source.dtype, device=source.device)
    if out.numel() == 0:
        return out
    src, dst = as_rows(source), as_rows(out)
    if src.dtype != dst.dtype or src.shape[1] != dst.shape[1]:
        src, dst = source.reshape(source.shape[0], -1), out.view(rows.numel(), -1)
    torch.index_select(src, 0, rows, out=dst)
    return out


# Rows of at most this many bytes are gathered in ascending source order (rolloutcli.core.native).
NARROW_ROW_BYTES = 8


def gather_fields(
    sources: Mapping[str, torch.Tensor], rows: torch.Tensor, outs: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``outs[name][i] = sources[name][rows[i]]`` for every field; byte-identical to :func:`gather_rows` per field.

    ``sources[name]`` ``[R, ...]``; ``outs[name]`` ``[len(rows), ...]`` contiguous, same dtype. ``rows`` must
    not repeat (a mini-batch's rows). On the CPU, with the compiled kernels of :mod:`rolloutcli.core.native`:
    fields of at most ``NARROW_ROW_BYTES`` per row are read in ascending row order and written to their slots
    (one sort of ``rows`` shared by all of them; 20 -> 3 ms per scalar field of a 128k-row shard of 1M rows),
    wider ones are copied row by row with prefetching (2x ``index_select`` at 192-byte rows). Elsewhere, or
    where the C file was not compiled, ``index_select``. Returns ``outs`` as a dict.
    """
    from rolloutcli.core import native

    compiled = [
        name
        for name, out in outs.items()
        if out.device.type == "cpu"
        and sources[name].device.type == "cpu"
        and out.is_contiguous()
        and sources[name].is_contiguous()
        and out.numel() > 0
    ]
    rows_np = rows.to(torch.int64).contiguous().numpy() if compiled else None
    sorted_np = slots_np = None
    for name in compiled:
        # as raw rows of an integer type: numpy has no bfloat16, and the kernels only move bytes
        source, out = as_rows(sources[name]).numpy(), as_rows(outs[name]).numpy()
        if out[:1].nbytes <= NARROW_ROW_BYTES:
            if sorted_np is None:
                sorted_rows, slots = torch.sort(rows.to(torch.int64))
                sorted_np, slots_np = sorted_rows.numpy(), slots.numpy()
            done = native.gather_sorted(source, sorted_np, slots_np, out)
        else:
            done = native.gather_rows(source, rows_np, out)
        if not done:  # the C file was not compiled
            gather_rows(sources[name], rows, out=outs[name])
    for name, out in outs.items():
        if name not in compiled:
            gather_rows(sources[name], rows, out=out)
    return dict(outs)


def scatter_rows(out: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[slots[i]] = rows[i]`` for ``out [R, ...]`` and ``rows [len(slots), ...]``, on wide row views."""
    if rows.numel() == 0:
        return out
    dst, src = as_rows(out), as_rows(rows)
    if dst.dtype != src.dtype or dst.shape[1] != src.shape[1]:
        dst, src = out.view(out.shape[0], -1), rows.reshape(rows.shape[0], -1)
    dst.index_copy_(0, slots, src)
    return out
