"""History windows of a rollout: which windows exist, how they are shuffled, and gathering them.

A *window* of ``K`` steps ending at step ``t`` of env ``n`` holds env ``n``'s steps ``t-K+1 .. t``, oldest to
newest: exactly what ``CircularBuffer(K, N).buffer[n]`` holds (keys ``K-1 .. 0`` of ``buffer[key]``) right
after the rollout's steps ``0 .. t`` were appended one by one::

    steps of env n:    ... t-K+1  t-K+2  ...  t-1   t   ...
    window [K, ...]:       [0]    [1]    ...  [K-2] [K-1]          (buffer order: oldest -> newest)

Which windows are *eligible* (exported), with ``dones[t, n] == 1`` meaning the episode ended at step ``t``
(step ``t + 1`` is the first of the next episode):

* always: ``t >= K - 1``. Only windows whose ``K`` steps were all recorded are exported; there is no
  synthetic padding (``CircularBuffer``'s first append fills the whole history with its entry, so a buffer
  read at ``t < K - 1`` would repeat step 0; those windows are left out).
* default (the buffer of an env is reset after each done): no done among the window's first ``K - 1``
  steps, ``dones[t-K+1 : t, n] == 0``. The window lies inside one episode; a done at ``t`` itself is allowed
  (the window then holds an episode's last ``K`` steps).
* ``across_episodes`` (AMP's training code never resets its buffers): every window with ``t >= K - 1``; it may
  straddle episode ends.

Windows are enumerated by the flat row of their newest step, ``t * N + n`` (time-major, as RSL-RL flattens
``[T, N, ...]``), ascending. Per env, a recorded stretch of ``L`` steps without an episode end inside it
yields ``max(0, L - K + 1)`` windows (default); with ``across_episodes`` every env yields ``max(0, T - K + 1)``.

Everything here is pure torch on the inputs' device; randomness comes only from the generator passed in.
"""

from __future__ import annotations

import torch

from rolloutcli.core.batching import BatchPlan, ShardPlan, gather_rows, split_sizes


def window_mask(dones: torch.Tensor, history: int, *, across_episodes: bool = False) -> torch.Tensor:
    """Which windows of ``history`` steps are eligible, by their newest step.

    Args:
        dones: ``[T, n]`` episode ends (any numeric or bool dtype; nonzero = done).
        history: K, steps per window (>= 1).
        across_episodes: allow windows that straddle episode ends.

    Returns:
        ``[T, n]`` bool: ``mask[t, j]`` is True when the window of steps ``t-K+1 .. t`` of env ``j`` is
        eligible (see the module docstring).
    """
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
    """Source rows of windows: ``[W, K]`` int64, ``rows[w, k] = ends[w] - (K - 1 - k) * N``.

    ``ends [W]`` are flat rows ``t * N + n`` (in a ``[T, N]`` block, ``N = num_envs``); entry ``k`` of a window
    is step ``t - K + 1 + k`` of env ``n`` (oldest first). Every end must have ``t >= K - 1``.
    """
    back = (torch.arange(history - 1, -1, -1, dtype=torch.int64, device=ends.device) * num_envs).unsqueeze(0)
    return ends.to(torch.int64).unsqueeze(1) - back


def gather_windows(
    block: torch.Tensor, ends: torch.Tensor, history: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Windows ``[W, K, ...]`` of a ``[T, n, ...]`` block, for window ends ``[W]`` (rows ``t * n + j`` of the block).

    ``out`` (``[W, K, ...]``, contiguous, ``block``'s dtype) is filled when given (reused warm memory).
    """
    steps, envs = block.shape[0], block.shape[1]
    rows = window_rows(ends, envs, history).reshape(-1)
    flat = block.reshape(steps * envs, *block.shape[2:])
    target = None if out is None else out.view(rows.numel(), *block.shape[2:])
    return gather_rows(flat, rows, out=target).view(ends.numel(), history, *block.shape[2:])


def history_plan(
    ends: torch.Tensor, num_mini_batches: int, num_epochs: int, *, generator: torch.Generator
) -> BatchPlan:
    """Mini-batches of history windows: epoch e takes the e-th ``torch.randperm(W, generator=generator)``.

    The permutation orders the ``W`` eligible windows (``ends``, ascending flat rows of their newest steps); it
    is cut into ``num_mini_batches`` mini-batches whose sizes differ by at most one (the first ``W % M`` are
    one larger): every eligible window exactly once per epoch, none dropped. Each epoch is a pass of its own
    (a fresh order); a pass's ``rows`` are window ends, so :meth:`ShardPlan.positions` over ``T * N`` rows
    places each window in its mini-batch and slot.

    Raises:
        ValueError: fewer windows than mini-batches.
    """
    sizes = tuple(split_sizes(ends.numel(), num_mini_batches))
    passes = [ShardPlan(sizes, ends[torch.randperm(ends.numel(), generator=generator)]) for _ in range(num_epochs)]
    return BatchPlan("history", passes, list(range(num_epochs)))
