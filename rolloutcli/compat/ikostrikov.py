"""``IkostrikovRolloutStorage``: the ``RolloutStorage`` of ikostrikov/pytorch-a2c-ppo-acktr-gail, same API, same
numbers, plus ``to_hdf5`` / ``from_hdf5`` in the rollout format.

Its layout: ``obs``, ``recurrent_hidden_states``, ``value_preds``, ``returns``, ``masks`` and ``bad_masks`` have
T+1 rows (row t+1 of ``masks`` / ``bad_masks`` says whether the episode went on / was not cut by a time limit
after step t); ``rewards``, ``actions`` and ``action_log_probs`` have T rows; every per-step tensor ends in a
trailing dimension (1 for scalars). In the rollout format: ``dones[t] = 1 - masks[t+1]``,
``time_outs[t] = 1 - bad_masks[t+1]``, ``values = value_preds[:T]``, ``last_values = value_preds[T]``,
``last_observations/policy = obs[T]``, ``hidden_states/actor/0 = recurrent_hidden_states[:T]`` as
``[T, 1, N, H]``. Rows 0 of ``masks`` / ``bad_masks`` and row T of the hidden states (carried over by
``after_update``) have no place in the format and travel as the extras ``ikostrikov_first_masks``,
``ikostrikov_first_bad_masks`` and ``ikostrikov_last_hidden``. ``returns`` are not written (derived data).

The generators take an optional ``torch.Generator``; without one they draw from torch's global RNG exactly as
the original does, so a script seeded with ``torch.manual_seed`` keeps its batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

Batch = tuple[torch.Tensor, ...]
_FIELDS = (
    "obs",
    "recurrent_hidden_states",
    "rewards",
    "value_preds",
    "returns",
    "action_log_probs",
    "actions",
    "masks",
    "bad_masks",
)


def proper_returns(
    rewards: torch.Tensor,
    value_preds: torch.Tensor,
    returns: torch.Tensor,
    masks: torch.Tensor,
    bad_masks: torch.Tensor,
    next_value: torch.Tensor,
    use_gae: bool,
    gamma: float,
    gae_lambda: float,
    use_proper_time_limits: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ikostrikov's ``compute_returns`` as a pure function: new ``(returns [T+1], value_preds [T+1])``, with
    ``value_preds[T]`` (GAE) or ``returns[T]`` (Monte-Carlo) set to ``next_value`` and the other row T kept
    from the inputs, as the original does.

    With ``use_proper_time_limits`` a time-limit cut (``bad_masks[t+1] = 0``) restarts the recursion from the
    recorded value: GAE's running sum is zeroed there, and the Monte-Carlo return becomes ``value_preds[t]``.
    The operations are the original's, in its order, so float32 results are equal bit for bit.
    """
    steps = rewards.size(0)
    values, returns = value_preds.clone(), returns.clone()
    if use_gae:
        values[-1] = next_value
        gae: Any = 0
        for t in reversed(range(steps)):
            delta = rewards[t] + gamma * values[t + 1] * masks[t + 1] - values[t]
            gae = delta + gamma * gae_lambda * masks[t + 1] * gae
            if use_proper_time_limits:
                gae = gae * bad_masks[t + 1]
            returns[t] = gae + values[t]
        return returns, values
    returns[-1] = next_value
    for t in reversed(range(steps)):
        kept = returns[t + 1] * gamma * masks[t + 1] + rewards[t]
        if use_proper_time_limits:
            kept = kept * bad_masks[t + 1] + (1 - bad_masks[t + 1]) * values[t]
        returns[t] = kept
    return returns, values


class IkostrikovRolloutStorage:
    """pytorch-a2c-ppo-acktr-gail's ``RolloutStorage`` (see the module docstring)."""

    def __init__(
        self,
        num_steps: int,
        num_processes: int,
        obs_shape: tuple[int, ...],
        action_space: Any,
        recurrent_hidden_state_size: int,
    ) -> None:
        steps, envs = num_steps, num_processes
        self.obs = torch.zeros(steps + 1, envs, *obs_shape)
        self.recurrent_hidden_states = torch.zeros(steps + 1, envs, recurrent_hidden_state_size)
        self.rewards = torch.zeros(steps, envs, 1)
        self.value_preds = torch.zeros(steps + 1, envs, 1)
        self.returns = torch.zeros(steps + 1, envs, 1)
        self.action_log_probs = torch.zeros(steps, envs, 1)
        discrete = type(action_space).__name__ == "Discrete"  # the original's test: gym or gymnasium spaces
        self.actions = torch.zeros(steps, envs, 1 if discrete else action_space.shape[0])
        if discrete:
            self.actions = self.actions.long()
        self.masks = torch.ones(steps + 1, envs, 1)
        self.bad_masks = torch.ones(steps + 1, envs, 1)
        self.num_steps, self.step = num_steps, 0

    def to(self, device: torch.device | str) -> None:
        for name in _FIELDS:
            setattr(self, name, getattr(self, name).to(device))

    def insert(
        self,
        obs: torch.Tensor,
        recurrent_hidden_states: torch.Tensor,
        actions: torch.Tensor,
        action_log_probs: torch.Tensor,
        value_preds: torch.Tensor,
        rewards: torch.Tensor,
        masks: torch.Tensor,
        bad_masks: torch.Tensor,
    ) -> None:
        """Store one step: what follows it at row ``step + 1``, what happened at it at row ``step``."""
        t = self.step
        self.obs[t + 1].copy_(obs)
        self.recurrent_hidden_states[t + 1].copy_(recurrent_hidden_states)
        self.actions[t].copy_(actions)
        self.action_log_probs[t].copy_(action_log_probs)
        self.value_preds[t].copy_(value_preds)
        self.rewards[t].copy_(rewards)
        self.masks[t + 1].copy_(masks)
        self.bad_masks[t + 1].copy_(bad_masks)
        self.step = (t + 1) % self.num_steps

    def after_update(self) -> None:
        """Carry the last row over as the first of the next rollout."""
        for name in ("obs", "recurrent_hidden_states", "masks", "bad_masks"):
            tensor = getattr(self, name)
            tensor[0].copy_(tensor[-1])

    def compute_returns(
        self,
        next_value: torch.Tensor,
        use_gae: bool,
        gamma: float,
        gae_lambda: float,
        use_proper_time_limits: bool = True,
    ) -> None:
        returns, values = proper_returns(
            self.rewards,
            self.value_preds,
            self.returns,
            self.masks,
            self.bad_masks,
            next_value,
            use_gae,
            gamma,
            gae_lambda,
            use_proper_time_limits,
        )
        self.returns.copy_(returns)
        self.value_preds.copy_(values)

    def _rows(self, advantages: torch.Tensor | None) -> list[torch.Tensor | None]:
        """The per-step tensors a batch is cut from, each ``[T, N, ...]``, in the original's yield order."""
        return [
            self.obs[:-1],
            self.recurrent_hidden_states[:-1],
            self.actions,
            self.value_preds[:-1],
            self.returns[:-1],
            self.masks[:-1],
            self.action_log_probs,
            advantages,
        ]

    def feed_forward_generator(
        self,
        advantages: torch.Tensor | None,
        num_mini_batch: int | None = None,
        mini_batch_size: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Iterator[Batch]:
        """Mini-batches of random flat rows (``t * N + n``); the remainder of the permutation is dropped."""
        steps, envs = self.rewards.size()[0:2]
        size = steps * envs
        if mini_batch_size is None:
            if num_mini_batch is None or size < num_mini_batch:
                raise ValueError(
                    f"PPO requires the number of processes ({envs}) * number of steps ({steps}) = {size} to be "
                    f"greater than or equal to the number of PPO mini batches ({num_mini_batch})."
                )
            mini_batch_size = size // num_mini_batch
        order = torch.randperm(size, generator=generator).tolist()
        flat = [None if x is None else x.reshape(size, *x.size()[2:]) for x in self._rows(advantages)]
        for start in range(0, size - mini_batch_size + 1, mini_batch_size):
            indices = order[start : start + mini_batch_size]
            yield tuple(None if x is None else x[indices] for x in flat)  # type: ignore[misc]

    def recurrent_generator(
        self, advantages: torch.Tensor | None, num_mini_batch: int, generator: torch.Generator | None = None
    ) -> Iterator[Batch]:
        """Mini-batches of whole env lanes in a random env order, flattened time-major; the hidden state is the
        lane's first row. Like the original, a remainder of ``N % num_mini_batch`` envs makes a smaller last
        batch whose reshape fails, so pass a ``num_mini_batch`` that divides N."""
        envs = self.rewards.size(1)
        if envs < num_mini_batch:
            raise ValueError(
                f"PPO requires the number of processes ({envs}) to be greater than or equal to the number of "
                f"PPO mini batches ({num_mini_batch})."
            )
        per_batch = envs // num_mini_batch
        perm = torch.randperm(envs, generator=generator)
        rows = self._rows(advantages)
        for start in range(0, envs, per_batch):
            lanes = perm[start : start + per_batch]
            batch = [None if x is None else x[:, lanes].reshape(-1, *x.size()[2:]) for x in rows]
            batch[1] = self.recurrent_hidden_states[0, lanes].reshape(per_batch, -1)
            yield tuple(batch)  # type: ignore[arg-type]

    def to_hdf5(self, path: str | Path, *, overwrite: bool = False) -> None:
        """Write the rollout file (see the module docstring for the mapping)."""
        from rolloutcli.compat.ikostrikov_io import write_storage

        write_storage(self, Path(path), overwrite=overwrite)

    @classmethod
    def from_hdf5(cls, path: str | Path) -> IkostrikovRolloutStorage:
        """A storage holding the rollout file ``path`` (``returns`` zero, ``step`` 0)."""
        from rolloutcli.compat.ikostrikov_io import read_storage

        return read_storage(cls, Path(path))
