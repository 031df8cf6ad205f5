"""History windows of a rollout: which windows exist, how they are shuffled, and gathering them.

A window of ``K`` steps ending at step ``t`` of env ``n`` holds env ``n``'s steps ``t-K+1 .. t``, oldest to newest:
what ``CircularBuffer(K, N).buffer[n]`` holds right after steps ``0 .. t`` were appended. Only windows whose
``K`` steps were all recorded (``t >= K - 1``) are eligible, and by default only those with no episode end
among their first ``K - 1`` steps (``across_episodes``, as AMP's never-reset buffers, allows any). Windows are
enumerated by the flat row ``t * N + n`` of their newest step, ascending. Pure torch on the inputs' device.
"""

from __future__ import annotations

import torch

from rolloutcli.core.batching import BatchPlan, ShardPlan, gather_rows, split_sizes
from rolloutcli.core.order import RowOrder, draw_key


def window_mask(dones: torch.Tensor, history: int, *, across_episodes: bool = False) -> torch.Tensor:
    """``[T, n]`` bool: whether the window of ``history`` steps ending at ``(t, j)`` is eligible (``dones`` nonzero =
    the episode ended at that step)."""
    if history < 1:
        raise ValueError(f"history must be at least 1, got {history}")
    steps = dones.shape[0]
    mask = torch.zeros(dones.shape, dtype=torch.bool, device=dones.device)
    if history > steps:
        return mask
    mask[history - 1 :] = True
    if across_episodes or history == 1:
        return mask
    # counts[i] = dones among steps 0 .. i-1, so dones among steps a .. b-1 = counts[b] - counts[a].
    counts = torch.zeros((steps + 1, *dones.shape[1:]), dtype=torch.int32, device=dones.device)
    counts[1:] = torch.cumsum((dones != 0).to(torch.int32), dim=0)
    newest = torch.arange(history - 1, steps, device=dones.device)
    inside = counts[newest] - counts[newest - history + 1]  # dones at steps t-K+1 .. t-1
    mask[history - 1 :] = inside == 0
    return mask


def window_ends(mask: torch.Tensor) -> torch.Tensor:
    """``[W]`` int64 flat rows ``t * N + n`` of the eligible windows' newest steps, ascending (``mask [T, N]``)."""
    return torch.nonzero(mask.reshape(-1), as_tuple=False).reshape(-1)


def window_rows(ends: torch.Tensor, num_envs: int, history: int) -> torch.Tensor:
    """Source rows of windows: ``[W, K]`` int64, ``rows[w, k] = ends[w] - (K - 1 - k) * N`` (oldest first)."""
    back = (torch.arange(history - 1, -1, -1, dtype=torch.int64, device=ends.device) * num_envs).unsqueeze(0)
    return ends.to(torch.int64).unsqueeze(1) - back


def gather_windows(
    block: torch.Tensor, ends: torch.Tensor, history: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Windows ``[W, K, ...]`` of a ``[T, n, ...]`` block for window ends ``[W]``; fills ``out`` when given."""
    steps, envs = block.shape[0], block.shape[1]
    rows = window_rows(ends, envs, history).reshape(-1)
    flat = block.reshape(steps * envs, *block.shape[2:])
    target = None if out is None else out.view(rows.numel(), *block.shape[2:])
    return gather_rows(flat, rows, out=target).view(ends.numel(), history, *block.shape[2:])


def history_plan(
    ends: torch.Tensor, num_mini_batches: int, num_epochs: int, *, generator: torch.Generator
) -> BatchPlan:
    """Mini-batches of the eligible windows ``ends``: epoch e cuts ``ends`` in the e-th :class:`RowOrder` of ``W``
    (keyed by the e-th :func:`draw_key` of ``generator``) into near-equal mini-batches (every window once per
    epoch); a pass's ``rows`` are window ends. ValueError: fewer windows than mini-batches."""
    sizes = tuple(split_sizes(ends.numel(), num_mini_batches))
    orders = [RowOrder(draw_key(generator), ends.numel()) for _ in range(num_epochs)]
    passes = [ShardPlan(sizes, ends[order.rows()]) for order in orders]
    return BatchPlan("history", passes, list(range(num_epochs)))
