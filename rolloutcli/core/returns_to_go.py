"""Monte-Carlo discounted returns-to-go per episode, without a critic (offline data).

Reversed over ``t``, in float32, per env column (each column depends on itself alone, so any env blocking
gives the same bits)::

    G_t = r_t if done_t else r_t + gamma * G_{t+1}          (G_T = 0: nothing is known past the recording)
    cut_t = time_out_t if done_t else cut_{t+1}            (cut_T = 1: the rollout's end cuts every open episode)

``cut_t = 1`` marks every step of an episode that did not end by termination (a time-out, or the end of the
recording): its return-to-go misses the rewards after the cut.
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
    g = np.float32(gamma)
    returns, truncated = np.empty((steps, envs), np.float32), np.empty((steps, envs), np.uint8)
    running, cut = np.zeros(envs, np.float32), np.ones(envs, bool)
    with np.errstate(all="ignore"):  # overflow gives inf, as float32 arithmetic does anywhere
        for t in range(steps - 1, -1, -1):
            running = np.where(ended[t], rewards[t], rewards[t] + g * running)  # no inf * 0 across episodes
            cut = np.where(ended[t], cut_here[t], cut)
            returns[t], truncated[t] = running, cut
    return returns, truncated
