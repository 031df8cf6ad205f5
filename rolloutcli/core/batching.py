"""Index plans for mini-batches: which source rows (``t * N + n``, time-major) go into which mini-batch, in order.

Every mode is one :class:`ShardPlan`: the source rows of each mini-batch, mini-batch after mini-batch, in slot order::

    rows  = [ rows of mini-batch 0 | rows of mini-batch 1 | ... ]        sizes = [B0, B1, ...]
    feed-forward:  a slice of a permutation of the rows                   (slot i = i-th row drawn)
                   (default: a :class:`~rolloutcli.core.order.RowOrder`, computed per slice, never held whole)
    recurrent:     t * N + env_ids[j] for t < T, j < G  (slot t * G + j)  -> viewed as [T, G, ...]
    distillation:  t * N + n for t in [start, stop), n < N                -> viewed as [steps, N, ...]

Randomness comes only from the ``torch.Generator`` passed in (the global RNG only where ``RolloutStorage``'s
RSL-RL parity asks for it with ``generator=None``). Orders are drawn on the CPU, the same on every device.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from rolloutcli.core.order import RowOrder, draw_key
from rolloutcli.core.split_rows import SideOrder, SideRows

MODES = ("feedforward", "recurrent", "distillation")


def split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` pieces of ``total`` items differing by at most one: ``split_sizes(10, 3) == [4, 3, 3]``."""
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
    """The mini-batches of one pass (one epoch, or every epoch when they all share one order)."""

    sizes: tuple[int, ...]  # rows of each mini-batch
    rows: torch.Tensor | None  # [sum(sizes)] int64 source rows t * N + n, mini-batch after mini-batch, slot order
    envs: tuple[torch.Tensor, ...] | None = None  # recurrent: each mini-batch's env ids ([G] int64, ascending)
    steps: tuple[tuple[int, int], ...] | None = None  # distillation: each mini-batch's (start, stop) steps
    order: RowOrder | None = None  # instead of rows: row at position p is order.rows(p) (streamed, no per-row state)

    def all_rows(self) -> torch.Tensor:
        """``rows``, computed from ``order`` when the plan has no per-row array."""
        if self.rows is not None:
            return self.rows
        assert self.order is not None
        return self.order.rows(0, self.offsets[-1])

    @cached_property
    def offsets(self) -> list[int]:
        """``[M + 1]`` start of each mini-batch in ``rows`` (and the total at the end)."""
        return list(itertools.accumulate(self.sizes, initial=0))

    def rows_of(self, shard: int) -> torch.Tensor:
        """``[sizes[shard]]`` int64 source rows of one mini-batch in slot order."""
        if self.rows is None:
            assert self.order is not None
            return self.order.rows(self.offsets[shard], self.offsets[shard + 1])
        return self.rows[self.offsets[shard] : self.offsets[shard + 1]]

    def positions(self, num_rows: int) -> torch.Tensor:
        """Inverse of ``rows``: ``[num_rows]`` int64, the position of each source row in ``rows``, -1 if unused."""
        if self.rows is None:
            return self.positions_of(torch.arange(num_rows, dtype=torch.int64))
        out = torch.full((num_rows,), -1, dtype=torch.int64)
        out[self.rows] = torch.arange(self.rows.numel(), dtype=torch.int64)
        return out

    def positions_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The position of each of ``rows`` (any shape, int64) in a pass with an ``order`` (streamed)."""
        assert self.order is not None, "positions_of needs a streamed order; use positions()"
        return self.order.positions(rows)


@dataclass(frozen=True)
class BatchPlan:
    """Every epoch's mini-batches. Epochs that share an order share a pass (written once, listed per epoch)."""

    mode: str  # feedforward, recurrent, distillation or history
    passes: list[ShardPlan]  # the distinct passes
    epoch_pass: list[int]  # for each epoch, the index of its pass
    dropped_rows: int = 0  # source rows in no mini-batch (RSL-RL parity only)
    dropped_envs: list[int] = field(default_factory=list)  # env ids in no mini-batch (recurrent parity only)


def feedforward_order(
    num_rows: int, num_mini_batches: int, *, parity: bool, generator: torch.Generator | None
) -> torch.Tensor:
    """One epoch's order: with parity RSL-RL's ``torch.randperm`` of the first ``M * (rows // M)`` rows; else the
    :class:`RowOrder` of all rows keyed by the next draw of ``generator`` (``batch --seed S``'s epoch order)."""
    if parity:
        return torch.randperm(num_mini_batches * (num_rows // num_mini_batches), generator=generator)
    return RowOrder(draw_key(generator), num_rows).rows()


def feedforward_plan(
    num_steps: int, num_envs: int, num_mini_batches: int, num_epochs: int, *, parity: bool, generator: torch.Generator
) -> BatchPlan:
    """Feed-forward: epoch e cuts the e-th :class:`RowOrder` of ``T * N`` rows (keyed by the e-th
    :func:`draw_key` of ``generator``) into ``M`` near-equal mini-batches; with ``parity``,
    RSL-RL's one ``randperm(M * (T * N // M))`` reused every epoch, ``T * N % M`` rows dropped."""
    num_rows = num_steps * num_envs
    if parity:
        order = feedforward_order(num_rows, num_mini_batches, parity=True, generator=generator)
        plan = ShardPlan(tuple(parity_sizes(num_rows, num_mini_batches)), order)
        return BatchPlan("feedforward", [plan], [0] * num_epochs, dropped_rows=num_rows - order.numel())
    sizes = tuple(split_sizes(num_rows, num_mini_batches))
    passes = [ShardPlan(sizes, None, order=RowOrder(draw_key(generator), num_rows)) for _ in range(num_epochs)]
    return BatchPlan("feedforward", passes, list(range(num_epochs)))


def side_plan(
    plan: BatchPlan, num_steps: int, num_envs: int, side: SideRows | None = None, envs: torch.Tensor | None = None
) -> BatchPlan:
    """``plan``, made over one side of a split (its rows numbered ``0 .. side.count``, its envs ``0 .. G``), in
    the source's rows and envs (``num_steps`` x ``num_envs``): feed-forward orders become :class:`SideOrder` s,
    recurrent env groups ``envs[group]``. Rows of the other side are in no shard."""
    if plan.mode == "feedforward" and side is not None:
        return replace(plan, passes=[replace(p, order=SideOrder(p.order, side)) for p in plan.passes])
    if plan.mode == "recurrent" and envs is not None:

        def remap(p: ShardPlan) -> ShardPlan:
            groups = tuple(envs[g] for g in p.envs or ())
            rows = torch.cat([recurrent_rows(num_steps, num_envs, g) for g in groups])
            return replace(p, rows=rows, envs=groups)

        return replace(plan, passes=[remap(p) for p in plan.passes])
    return plan


def recurrent_groups(
    num_envs: int, num_mini_batches: int, *, parity: bool, shuffle: bool = False, generator: torch.Generator | None
) -> list[torch.Tensor]:
    """One epoch's env groups, each ``[G]`` int64 ascending: contiguous, of near-equal sizes, or with ``parity``
    RSL-RL's ``N // M`` envs each (the last ``N % M`` dropped); ``shuffle`` draws them from ``randperm(N)``,
    each sorted (ascending keeps trajectories env-major like RSL-RL)."""
    if parity and shuffle:
        raise ValueError("RSL-RL parity uses fixed contiguous env groups; it cannot be combined with shuffling")
    sizes = parity_sizes(num_envs, num_mini_batches) if parity else split_sizes(num_envs, num_mini_batches)
    envs = torch.randperm(num_envs, generator=generator) if shuffle else torch.arange(num_envs)
    return [torch.sort(group).values if shuffle else group for group in torch.split(envs[: sum(sizes)], sizes)]


def block_rows(
    block: tuple[int, int, int, int], num_envs: int, offsets: tuple[int, int], env_concat: bool, total_envs: int
) -> torch.Tensor:
    """``[steps * envs]`` int64 dataset rows of a block ``(t0, t1, n0, n1)`` of a file of ``num_envs`` envs, time-major:
    ``row_offset + t * num_envs + n``, or with ``env_concat`` (files side by side along envs, one T)
    ``t * total_envs + env_offset + n``, where ``offsets = (row_offset, env_offset)``. One file: ``t * N + n``."""
    t0, t1, n0, n1 = block
    steps = torch.arange(t0, t1, dtype=torch.int64).unsqueeze(1)
    envs = torch.arange(n0, n1, dtype=torch.int64).unsqueeze(0)
    if env_concat:
        return (steps * total_envs + offsets[1] + envs).reshape(-1)
    return (offsets[0] + steps * num_envs + envs).reshape(-1)


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
    """Recurrent mini-batches: env groups (:func:`recurrent_groups`, one pass unless ``shuffle``), all steps."""

    def make_pass() -> ShardPlan:
        groups = recurrent_groups(num_envs, num_mini_batches, parity=parity, shuffle=shuffle, generator=generator)
        rows = torch.cat([recurrent_rows(num_steps, num_envs, g) for g in groups])
        return ShardPlan(tuple(num_steps * g.numel() for g in groups), rows, envs=tuple(groups))

    passes = [make_pass() for _ in range(num_epochs if shuffle else 1)]
    dropped = list(range(num_mini_batches * (num_envs // num_mini_batches), num_envs)) if parity else []
    epoch_pass = list(range(num_epochs)) if shuffle else [0] * num_epochs
    return BatchPlan("recurrent", passes, epoch_pass, dropped_rows=num_steps * len(dropped), dropped_envs=dropped)


def distillation_plan(num_steps: int, num_envs: int, num_mini_batches: int, num_epochs: int) -> BatchPlan:
    """RSL-RL's ``generator()`` order (time steps in order, all envs) cut into ``M`` step ranges (one pass)."""
    bounds = list(itertools.accumulate(split_sizes(num_steps, num_mini_batches), initial=0))
    ranges = list(itertools.pairwise(bounds))
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
            num_steps, num_envs, num_mini_batches, num_epochs, parity=parity, shuffle=shuffle_envs, generator=generator
        )
    if mode == "distillation":
        return distillation_plan(num_steps, num_envs, num_mini_batches, num_epochs)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``[R, ...]`` contiguous -> ``[R, row_bytes]`` viewed as the widest element type that tiles a row.

    ``index_select`` copies element by element inside a row: wide elements move the same bits in fewer copies.
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
    """``out[i] = source[rows[i]]`` for ``source [R, ...]`` on wide row views; ``out`` (contiguous) is reused when
    given: a warm buffer avoids the page faults of a fresh allocation."""
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

    ``rows`` must not repeat (a mini-batch's rows). On the CPU the compiled kernels of
    :mod:`rolloutcli.core.native` read fields of at most ``NARROW_ROW_BYTES`` per row in ascending row order (one
    sort of ``rows`` shared by all of them) and copy wider ones row by row with prefetching; elsewhere, or where
    the C file was not compiled, ``index_select``. Returns ``outs`` as a dict.
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
