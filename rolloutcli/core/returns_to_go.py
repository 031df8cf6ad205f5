"""Monte-Carlo discounted returns-to-go per episode, without a critic (offline data).

Reversed over ``t``, in float32, per env column (each column depends on itself alone, so any env blocking
gives the same bits)::

    G_t = r_t if done_t else r_t + gamma * G_{t+1}          (G_T = 0: nothing is known past the recording)
    cut_t = time_out_t if done_t else cut_{t+1}            (cut_T = 1: the rollout's end cuts every open episode)

``cut_t = 1`` marks every step of an episode that did not end by termination (a time-out, or the end of the
recording): its return-to-go misses the rewards after the cut.

Episodes depend on nothing outside themselves either, so the recursion can run over the steps of every episode
at once: as many rounds as the longest episode instead of one per step (an offline dataset of one env and
millions of steps has episodes of about a thousand). Each element sees the same float32 operations in the same
order on either path: the bits do not depend on the path.
"""

from __future__ import annotations

import numpy as np


def returns_to_go(
    rewards: np.ndarray, dones: np.ndarray, time_outs: np.ndarray | None, gamma: float
) -> tuple[np.ndarray, np.ndarray]:
    """``(returns [T, n] float32, truncated [T, n] uint8)`` of ``[T, n]`` rewards, dones and time-outs."""
    steps, envs = rewards.shape[:2]
    rewards = np.asarray(rewards, np.float32).reshape(steps, envs)
    ended = np.asarray(dones).reshape(steps, envs) != 0
    cut_here = np.zeros((steps, envs), bool) if time_outs is None else np.asarray(time_outs).reshape(steps, envs) != 0
    ends, lengths = _episodes(ended)
    with np.errstate(all="ignore"):  # overflow gives inf, as float32 arithmetic does anywhere
        if 2 * int(lengths.max(initial=0)) <= steps:
            return _by_episode_step(rewards, ended, cut_here, np.float32(gamma), ends, lengths)
        return _by_step(rewards, ended, cut_here, np.float32(gamma))


def _episodes(ended: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each episode's last step as a flat index ``t * n + j`` and its length (an env's last episode ends at
    ``T - 1``), column by column."""
    steps, envs = ended.shape
    last = ended.copy()
    last[-1:] = True
    flat_tn = np.flatnonzero(last.T.reshape(-1))  # column-major: j * T + t, in time order within each column
    column, t_end = flat_tn // steps, flat_tn % steps
    starts = np.zeros_like(t_end)
    starts[1:] = np.where(column[1:] == column[:-1], t_end[:-1] + 1, 0)
    return t_end * envs + column, t_end - starts + 1


def _by_step(rewards: np.ndarray, ended: np.ndarray, cut_here: np.ndarray, g: np.float32) -> tuple:
    steps, envs = rewards.shape
    returns, truncated = np.empty((steps, envs), np.float32), np.empty((steps, envs), np.uint8)
    running, cut = np.zeros(envs, np.float32), np.ones(envs, bool)
    for t in range(steps - 1, -1, -1):
        running = np.where(ended[t], rewards[t], rewards[t] + g * running)  # no inf * 0 across episodes
        cut = np.where(ended[t], cut_here[t], cut)
        returns[t], truncated[t] = running, cut
    return returns, truncated


def _by_episode_step(
    rewards: np.ndarray, ended: np.ndarray, cut_here: np.ndarray, g: np.float32, ends: np.ndarray, lengths: np.ndarray
) -> tuple:
    """Round ``k`` takes step ``k`` back from the end of every episode longer than ``k`` (longest first, so the
    episodes still running are a prefix)."""
    steps, envs = rewards.shape
    order = np.argsort(-lengths, kind="stable")
    at_end, ascending = ends[order], lengths[order][::-1]
    flat = (rewards.reshape(-1), ended.reshape(-1), cut_here.reshape(-1))
    returns, truncated = np.empty(steps * envs, np.float32), np.empty(steps * envs, np.uint8)
    running, cut = np.zeros(len(order), np.float32), np.ones(len(order), bool)
    for k in range(int(lengths.max(initial=0))):
        count = len(order) - int(np.searchsorted(ascending, k, side="right"))
        at = at_end[:count] - k * envs
        r, e = flat[0][at], flat[1][at]
        running[:count] = np.where(e, r, r + g * running[:count])
        cut[:count] = np.where(e, flat[2][at], cut[:count])
        returns[at], truncated[at] = running[:count], cut[:count]
    return returns.reshape(steps, envs), truncated.reshape(steps, envs)
