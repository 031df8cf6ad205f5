"""Time-out rules of ``gae --timeouts``: what a time-out (``time_outs[t] = 1``, the training code bootstrapped
there) does to the rewards and dones the GAE kernel sees. Pure: numpy arrays in, new arrays out.

- ``rsl``: RSL-RL's ``r_t += gamma * V(s_t)`` (the value at the step stands in for the lost next state).
- ``final-value``: ``r_t += gamma * final_values_t`` (V of the observation that ended the episode), as SB3's
  ``collect_rollouts`` and TorchRL's value estimators do; the time-out step is done, so nothing else flows.
- ``proper``: ikostrikov's ``use_proper_time_limits`` with GAE: ``gae_t *= bad_mask``, so at a time-out step
  the advantage is 0 and the return is the value, and nothing flows back through it. The kernel computes that
  exactly with ``r_t = V(s_t)`` and the step done: ``A_t = (V - V) + 0 = 0``, ``returns_t = V``.
- ``ignore``: a time-out ends the episode like a termination.

The rules act on the kernel's inputs only, so the C kernel and its numpy twin give the same bits under every
rule.
"""

from __future__ import annotations

import numpy as np

from rolloutcli.core.gae_numpy import bootstrap_rewards

RULES = ("rsl", "final-value", "proper", "ignore")
BOOTSTRAPPING = ("rsl", "final-value")  # the rules whose rewards hold a bootstrap (written as ``rewards``)
DEFAULT_RULE = "rsl"  # the 1.1 default, applied where neither the user nor the file names a rule


def decide_rule(explicit: str | None, recorded: str | None) -> tuple[str, str]:
    """``(rule, source)``: the rule ``gae`` applies and where it came from, in the contract's order (1.2): the
    user's ``explicit`` option (``"option"``), the file's ``timeouts_rule`` attribute (``"file"``), else
    :data:`DEFAULT_RULE` (``"default"``)."""
    if explicit is not None:
        return explicit, "option"
    if recorded is not None:
        return recorded, "file"
    return DEFAULT_RULE, "default"


def apply_timeouts(
    rule: str,
    rewards: np.ndarray,
    values: np.ndarray,
    dones: np.ndarray,
    time_outs: np.ndarray | None,
    gamma: float,
    final_values: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(rewards, dones)`` for the GAE kernel under ``rule`` (``[T, N]`` arrays; ``dones`` uint8).

    Rewards keep their dtype (float64 rewards are bootstrapped in float64; the caller rounds). Without
    ``time_outs`` every rule leaves both unchanged.
    """
    if rule not in RULES:
        raise ValueError(f"timeouts: expected one of {', '.join(RULES)}, found {rule!r}")
    if time_outs is None:
        return rewards, dones
    hit = time_outs != 0
    if rule == "rsl":
        return bootstrap_rewards(rewards, values, time_outs, gamma), dones
    if rule == "final-value":
        if final_values is None:
            raise ValueError("timeouts final-value: final_values is required")
        # final_values is undefined where the step is no time-out (NaN there must not leak in)
        final = np.where(hit, final_values, np.zeros((), final_values.dtype))
        return bootstrap_rewards(rewards, final, time_outs, gamma), dones
    ended = (dones != 0) | hit
    ended = ended.astype(np.uint8)
    if rule == "proper":
        return np.where(hit, values.astype(rewards.dtype, copy=False), rewards), ended
    return rewards, ended
