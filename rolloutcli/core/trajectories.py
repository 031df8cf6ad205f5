"""Split ``[T, N, ...]`` rollouts into zero-padded trajectories (env-major) and back, matching RSL-RL bit for bit.

A *plan* computed once from the dones maps every step ``(t, n)`` to its padded row ``l * M + m``; every field
is then moved with one row scatter (``index_copy_``) or gather. ``pad_to``: ``"rollout"`` (L = T, RSL-RL),
``"longest"`` or an int; ``max_length=K`` cuts trajectories into segments of at most K steps, each then a
trajectory of its own.

Invariants: outputs hold the inputs' bits (rows are moved, never computed); every function is differentiable
in its tensor inputs (RSL-RL users split and unpad inside a loss); tensors follow their inputs' device. A plan
syncs once to learn M (once more for ``max_length`` or ``"longest"``); applying a plan never syncs.
"""

from __future__ import annotations

import math
import mmap
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, NamedTuple, TypeAlias

import torch

PadTo: TypeAlias = Literal["rollout", "longest"] | int  # rows L: T (RSL-RL), the longest trajectory, or an int
Fields: TypeAlias = Any  # a tensor, a (nested) dict of them or a TensorDict, wherever RSL-RL takes a TensorDict


class TrajectorySpans(NamedTuple):
    """Where each of the M trajectories lies, in RSL-RL order (env-major): ``[M]`` int64 on the dones' device."""

    env: torch.Tensor  # its env n
    start: torch.Tensor  # its first time step t
    length: torch.Tensor  # its valid steps (its mask column's sum)


@dataclass(frozen=True)
class TrajectoryPlan:
    """Where every step of one ``[T, N]`` block goes in the padded ``[L, M]`` layout (:func:`plan_trajectories`).

    ``index [T * N]`` maps the source row ``t * N + n`` to the padded row ``l * M + m``; ``flat_start [M]`` is
    each trajectory's env-major first step ``n * T + t`` and ``length [M]`` its valid steps (all int64).
    """

    num_steps: int  # T
    num_envs: int  # N
    num_trajectories: int  # M
    padded_length: int  # L
    index: torch.Tensor
    flat_start: torch.Tensor
    length: torch.Tensor

    @cached_property
    def spans(self) -> TrajectorySpans:
        """Env, start and length of each trajectory, ``[M]`` int64 each."""
        return _spans_from_flat(self.flat_start, self.length, self.num_steps)

    def masks(self) -> torch.Tensor:
        """``[L, M]`` bool, True on valid steps: ``masks[l, m] = l < length[m]`` (RSL-RL's trajectory masks)."""
        return torch.arange(self.padded_length, device=self.index.device).unsqueeze(1) < self.length


def _done_flags(dones: torch.Tensor, max_length: int | None) -> torch.Tensor:
    """``[T, N]`` or ``[T, N, 1]`` dones of any dtype -> ``[T, N]`` bool (nonzero = done, as RSL-RL's nonzero)."""
    if max_length is not None and (isinstance(max_length, bool) or int(max_length) != max_length or max_length < 1):
        raise ValueError(f"max_length must be a positive integer or None, got {max_length!r}")
    if dones.dim() == 3 and dones.shape[2] == 1:
        dones = dones.squeeze(2)
    if dones.dim() != 2:
        raise ValueError(f"dones must be [T, N] or [T, N, 1], got shape {tuple(dones.shape)}")
    if dones.shape[0] == 0:
        raise ValueError("dones has no time steps (T = 0)")
    return dones != 0 if dones.dtype != torch.bool else dones


def _trajectory_starts(done: torch.Tensor, max_length: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Start flags ``[T * N]`` bool, flat start row ``n * T + t`` ``[M]`` and length ``[M]`` of every trajectory.

    ::

        done [T, N]         start flags [N, T] (env-major) + 1 spare    nonzero: starts + end of the last one
        t\\n  0  1           n\\t  0  1  2  3  4  5
        0    .  .           0    S  .  .  .  S  .                       [0, 4, 6, 8, 11, 12]
        1    .  D           1    S  .  S  .  .  S   | S                 length = diff = [4, 2, 2, 3, 1]
        3    D  .
        4    .  D

    A trajectory starts at t = 0 of every env and after every done (RSL-RL's ``dones[-1] = 1``).
    """
    flags = torch.constant_pad_nd(done[:-1].t(), (1, 0), True).reshape(-1)
    bounds = torch.constant_pad_nd(flags, (0, 1), True).nonzero().squeeze(1)  # the sync: M sizes every output
    flat_start = bounds[:-1]
    length = bounds[1:] - flat_start
    if max_length is None:
        return flags, flat_start, length
    # Cut each trajectory into ceil(length / K) segments, working on the M trajectories, not the T * N steps.
    pieces = torch.div(length + (max_length - 1), max_length, rounding_mode="floor")
    first_piece = torch.cumsum(pieces, 0) - pieces
    num_pieces = int(pieces.sum())  # second sync: the number of segments sizes the outputs
    parent = torch.repeat_interleave(
        torch.arange(flat_start.numel(), device=done.device), pieces, output_size=num_pieces
    )
    offset = (torch.arange(num_pieces, device=done.device) - first_piece[parent]) * max_length
    seg_start = flat_start[parent] + offset
    seg_length = torch.clamp(length[parent] - offset, max=max_length)
    seg_flags = torch.zeros(flags.numel(), dtype=torch.bool, device=done.device).index_fill_(0, seg_start, True)
    return seg_flags, seg_start, seg_length


def _spans_from_flat(flat_start: torch.Tensor, length: torch.Tensor, num_steps: int) -> TrajectorySpans:
    env = torch.div(flat_start, num_steps, rounding_mode="floor")
    return TrajectorySpans(env=env, start=torch.remainder(flat_start, num_steps), length=length)


def trajectory_spans(dones: torch.Tensor, max_length: int | None = None) -> TrajectorySpans:
    """Env, start step and length of every trajectory in RSL-RL's order (arguments of :func:`plan_trajectories`)."""
    done = _done_flags(dones, max_length)
    _, flat_start, length = _trajectory_starts(done, max_length)
    return _spans_from_flat(flat_start, length, done.shape[0])


def _padded_index(flags: torch.Tensor, flat_start: torch.Tensor, num_steps: int, num_envs: int) -> torch.Tensor:
    """``[T * N]`` int64: time-major source row ``t * N + n`` -> padded flat row ``l * M + m``.

    ::

        env-major step e = n * T + t    trajectory m = cumsum(start flags)[e] - 1    position l = e - start[m]
        index[e] = l * M + m            then [N, T] -> [T, N] so that it is read in the source's time-major order
    """
    traj = torch.cumsum(flags, 0).sub_(1)
    pos = torch.arange(flags.numel(), device=flags.device).sub_(flat_start.index_select(0, traj))
    index = traj.add_(pos, alpha=flat_start.numel())
    return index.view(num_envs, num_steps).t().contiguous().view(-1)


def _resolve_rows(pad_to: PadTo, num_steps: int, length: torch.Tensor, max_length: int | None) -> int:
    """L for the requested layout; syncs only for ``"longest"`` or an int that may be too short."""
    if pad_to == "rollout":
        return num_steps
    if pad_to != "longest" and (isinstance(pad_to, bool) or not isinstance(pad_to, int)):
        raise ValueError(f"pad_to must be 'rollout', 'longest' or an int, got {pad_to!r}")
    if pad_to != "longest" and pad_to >= min(num_steps, max_length or num_steps):
        return pad_to  # no trajectory can be longer: no sync
    longest = int(length.max()) if length.numel() else 0
    if pad_to != "longest" and pad_to < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest trajectory ({longest} steps)")
    return longest if pad_to == "longest" else pad_to


def plan_trajectories(
    dones: torch.Tensor, *, pad_to: PadTo = "rollout", max_length: int | None = None
) -> TrajectoryPlan:
    """Where every step of a ``[T, N]`` block goes in the padded layout, on the dones' device.

    ``dones``: ``[T, N]`` or ``[T, N, 1]``, any dtype, nonzero = done after that step.
    """
    done = _done_flags(dones, max_length)
    num_steps, num_envs = done.shape
    flags, flat_start, length = _trajectory_starts(done, max_length)
    rows = _resolve_rows(pad_to, num_steps, length, max_length)
    index = _padded_index(flags, flat_start, num_steps, num_envs)
    return TrajectoryPlan(num_steps, num_envs, flat_start.numel(), rows, index, flat_start, length)


def _rows(*pairs: tuple[torch.Tensor, int]) -> list[torch.Tensor]:
    """Each ``(tensor, count)`` as ``[count, -1]`` rows, reinterpreted as the widest element type tiling them all.

    Indexing ops move one element at a time inside a row, and the split pipeline hands over rows of bytes: wide
    elements keep the copy at memory speed, with the same bits. Tensors that need a gradient (a dtype view is not
    differentiable) and empty, strided or misaligned rows keep their dtype.
    """
    rows = [t.reshape(count, -1) for t, count in pairs]
    if any(t.requires_grad or t.numel() == 0 or not r.is_contiguous() for (t, _), r in zip(pairs, rows, strict=True)):
        return rows
    width = rows[0].shape[1] * rows[0].element_size()
    # complex128 is the widest element; torch indexes it on the CPU and CUDA
    for wide in (torch.complex128, torch.int64, torch.int32, torch.int16)[rows[0].device.type not in ("cpu", "cuda") :]:
        if width % wide.itemsize == 0 and all(r.data_ptr() % wide.itemsize == 0 for r in rows):
            return [r.view(torch.uint8).view(wide) for r in rows]
    return rows


def scatter_into_trajectories(
    x: torch.Tensor, plan: TrajectoryPlan, out: torch.Tensor | None = None, *, zero: bool = True
) -> torch.Tensor:
    """Write a ``[T, N, ...]`` field into the padded layout ``[L, M, ...]`` of ``plan``: ``out[l, m] = x[t, n]``.

    ``out``: a contiguous ``[L, M, ...]`` tensor of ``x``'s dtype to reuse, else a fresh zeroed one.
    ``zero=False`` skips zeroing ``out``: only when its padding is already zero (:func:`clear_trajectories`).
    Returns ``out``, zeros where ``plan.masks()`` is False.
    """
    if tuple(x.shape[:2]) != (plan.num_steps, plan.num_envs) or x.device != plan.index.device:
        raise ValueError(
            f"field of shape {tuple(x.shape)} on {x.device} does not start with [T, N] = "
            f"{plan.num_steps, plan.num_envs} on {plan.index.device}"
        )
    shape = (plan.padded_length, plan.num_trajectories, *x.shape[2:])
    if out is None and x.requires_grad:  # a tensor of its own, so that autograd records one index_copy_
        rows = torch.zeros(plan.padded_length * plan.num_trajectories, *x.shape[2:], dtype=x.dtype, device=x.device)
        return rows.index_copy_(0, plan.index, x.reshape(plan.index.numel(), *x.shape[2:])).view(shape)
    if out is None:
        out = padded_zeros(shape, x.dtype, x.device)
    elif tuple(out.shape) != shape or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(
            f"out must be a contiguous {x.dtype} tensor of shape {shape} on {x.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    elif zero:
        out.zero_()
    if out.numel():
        dst, src = _rows((out, plan.padded_length * plan.num_trajectories), (x, plan.index.numel()))
        dst.index_copy_(0, plan.index, src)
    return out


def padded_zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor for a fresh padded output (mostly zeros: making it costs more than filling it).

    On the CPU an output of 4 MiB or more is an anonymous ``mmap`` advised ``MADV_HUGEPAGE``: the kernel hands it
    out already zeroed in 2 MiB pages, where ``torch.zeros`` faults every 4 KiB page and writes every byte
    (benchmarks/bench_split.py). The tensor keeps the mapping alive.
    """
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < (4 << 20) or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype, count=count).view(tuple(shape))


def clear_trajectories(out: torch.Tensor, plan: TrajectoryPlan) -> torch.Tensor:
    """Zero only the ``T * N`` valid rows that ``plan`` wrote into ``out`` (``[L, M, ...]``), leaving all zeros,
    ready for ``scatter_into_trajectories(..., zero=False)`` with any plan that fits."""
    if out.numel():
        (rows,) = _rows((out, plan.padded_length * plan.num_trajectories))
        rows.index_fill_(0, plan.index, 0)
    return out


def trajectory_buffer_view(buffer: torch.Tensor, plan: TrajectoryPlan, feature_shape: Sequence[int]) -> torch.Tensor:
    """View the front of a flat 1-D ``buffer`` as ``[L, M, *feature_shape]`` for ``plan``: a streaming pipeline
    keeps one allocation per field (sized for its largest block) instead of fresh pages for every block."""
    count = plan.padded_length * plan.num_trajectories * math.prod(int(size) for size in feature_shape)
    if buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() < count:
        raise ValueError(f"buffer must be a contiguous 1-D tensor of at least {count} elements")
    return buffer[:count].view(plan.padded_length, plan.num_trajectories, *feature_shape)


def _gather(padded: torch.Tensor, index: torch.Tensor, num_steps: int, num_envs: int) -> torch.Tensor:
    """``out[t, n] = padded.view(L * M, ...)[index[t * N + n]]``, ``[T, N, ...]``: a new tensor, differentiable."""
    shape = (num_steps, num_envs, *padded.shape[2:])
    if math.prod(shape) == 0:
        return padded.new_zeros(shape)
    (rows,) = _rows((padded, padded.shape[0] * padded.shape[1]))
    picked = rows.index_select(0, index.to(padded.device))
    if picked.dtype != padded.dtype:
        picked = picked.view(torch.uint8).view(padded.dtype)
    return picked.view(shape)


def unpad_with_spans(padded: Fields, spans: TrajectorySpans, num_steps: int, num_envs: int) -> Fields:
    """Restore ``[T, N, ...]`` from any padded layout (tensor, dict or TensorDict) given its spans; syncs once."""
    rows = _first_leaf(padded).shape[0]
    total, longest = torch.stack([spans.length.sum(), spans.length.max()]).tolist() if spans.length.numel() else (0, 0)
    if total != num_steps * num_envs or longest > rows:
        raise ValueError(
            f"spans cover {total} steps (longest {longest}) but the rollout has {num_steps * num_envs} steps "
            f"and the padded layout {rows} rows"
        )
    masks = torch.arange(rows, device=spans.length.device).unsqueeze(1) < spans.length
    return unpad_trajectories(padded, masks, num_steps)


def _is_tensordict(obj: object) -> bool:
    """True for a TensorDict without importing tensordict: one can only exist if the module is loaded."""
    module = sys.modules.get("tensordict")
    return module is not None and isinstance(obj, module.TensorDictBase)


def _first_leaf(fields: Fields) -> torch.Tensor:
    if isinstance(fields, torch.Tensor):
        return fields
    if _is_tensordict(fields) or isinstance(fields, Mapping):
        for value in fields.values():
            return _first_leaf(value)
        raise ValueError("cannot split an empty dict of fields")
    raise TypeError(f"expected a tensor, a dict of tensors or a TensorDict, got {type(fields).__name__}")


def _map_fields(fields: Fields, fn: Callable[[torch.Tensor], torch.Tensor], batch_size: tuple[int, int]) -> Fields:
    """Apply ``fn`` to every tensor of a tensor / (nested) dict / (nested) TensorDict, keeping the container."""
    if isinstance(fields, torch.Tensor):
        return fn(fields)
    if _is_tensordict(fields):
        from tensordict import TensorDict  # already imported: ``fields`` is one

        mapped = {key: _map_fields(value, fn, batch_size) for key, value in fields.items()}
        return TensorDict(mapped, batch_size=list(batch_size), device=fields.device)
    if isinstance(fields, Mapping):
        return {key: _map_fields(value, fn, batch_size) for key, value in fields.items()}
    raise TypeError(f"expected a tensor, a dict of tensors or a TensorDict, got {type(fields).__name__}")


def split_and_pad_trajectories(
    tensor: Fields, dones: torch.Tensor, *, pad_to: PadTo = "rollout", max_length: int | None = None
) -> tuple[Fields, torch.Tensor]:
    """Split trajectories at dones, lay them side by side env-major and pad with zeros (RSL-RL's function).

    RSL-RL's signature, bits and gradients with the default options. Example (transposed), T = 6, N = 2::

        Input: [[a1, a2, a3, a4 | a5, a6],
                [b1, b2 | b3, b4, b5 | b6]]

        Output:[[a1, a2, a3, a4, 0, 0],  | [[True, True, True, True, False, False],
                [a5, a6, 0, 0, 0, 0],    |  [True, True, False, False, False, False],
                [b1, b2, 0, 0, 0, 0],    |  [True, True, False, False, False, False],
                [b3, b4, b5, 0, 0, 0],   |  [True, True, True, False, False, False],
                [b6, 0, 0, 0, 0, 0]]     |  [True, False, False, False, False, False]]

    (``pad_to="longest"``; RSL-RL's code pads to T, as ``"rollout"`` does.) ``tensor``: ``[T, N, ...]``, a dict of
    them or a TensorDict (the same container comes back). Returns ``(padded [L, M, ...], masks [L, M] bool)``.
    """
    leaf = _first_leaf(tensor)
    plan = plan_trajectories(dones.to(leaf.device), pad_to=pad_to, max_length=max_length)
    padded = _map_fields(
        tensor, lambda x: scatter_into_trajectories(x, plan), (plan.padded_length, plan.num_trajectories)
    )
    return padded, plan.masks()


def unpad_trajectories(trajectories: Fields, masks: torch.Tensor, num_steps: int | None = None) -> Fields:
    """Inverse of :func:`split_and_pad_trajectories`: ``[L, M, ...]`` + masks ``[L, M]`` -> ``[T, N, ...]``.

    RSL-RL's signature, bits and gradients. RSL-RL takes T from ``trajectories.shape[0]``, right only when
    L = T; pass ``num_steps=T`` for other layouts. Syncs once (``nonzero``)::

        masks.T [M, L] --nonzero--> valid (m, l) in env-major time order --> rows l * M + m, [N, T]
        --transpose--> [T, N] --index_select--> [T, N, ...]
    """
    num_traj = masks.shape[1]
    steps = masks.shape[0] if num_steps is None else num_steps
    traj, pos = masks.t().nonzero(as_tuple=True)
    if steps <= 0 or traj.numel() % steps:
        raise ValueError(f"masks hold {traj.numel()} valid steps, not a whole number of envs of T = {steps} steps")
    num_envs = traj.numel() // steps
    index = (pos * num_traj + traj).view(num_envs, steps).t().contiguous().view(-1)
    return _map_fields(trajectories, lambda x: _gather(x, index, steps, num_envs), (steps, num_envs))


def hidden_states_at_starts(
    hidden: torch.Tensor | Sequence[torch.Tensor], spans: TrajectorySpans
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The recurrent state at the first step of every trajectory (of every segment with ``max_length``).

    ``hidden``: ``[T, layers, N, H]`` (a GRU) or a tuple/list of them (an LSTM's ``(h, c)``). Returns
    ``[layers, M, H]`` contiguous (a tuple for a tuple), equal to RSL-RL's
    ``saved.permute(2, 0, 1, 3)[last_was_done.permute(1, 0)].transpose(1, 0)``.
    """
    if not isinstance(hidden, torch.Tensor):
        return tuple(hidden_states_at_starts(h, spans) for h in hidden)  # type: ignore[misc]
    if hidden.dim() < 3:
        raise ValueError(f"hidden states must be [T, layers, N, ...], got shape {tuple(hidden.shape)}")
    # Advanced indices separated by a slice put the indexed dim first: [M, layers, ...].
    return hidden[spans.start.to(hidden.device), :, spans.env.to(hidden.device)].transpose(0, 1).contiguous()
