"""``RolloutStorage``: a drop-in for RSL-RL 5.x's storage, plus loading from and saving to HDF5.

Tensors are laid out ``[T, N, ...]`` (``T = num_transitions_per_env``, ``N = num_envs``) exactly as in
RSL-RL: ``rewards``, ``dones``, ``values``, ``actions_log_prob``, ``returns``, ``advantages`` are
``[T, N, 1]``; hidden states are lists (one tensor for a GRU, h and c for an LSTM) of
``[T, layers, N, H]``. Observations are a dict of ``[T, N, ...]`` tensors, or a TensorDict when one was
given. Beyond RSL-RL, a storage loaded from a file also carries ``time_outs [T, N, 1]`` and
``last_values [N, 1]`` (None when the file has none), ``distribution_names`` and ``attrs``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

HiddenState = torch.Tensor | tuple[torch.Tensor, ...] | None


def _is_tensordict(value: object) -> bool:
    return type(value).__name__ == "TensorDict"


class RolloutStorage:
    """Storage for the data collected during a rollout (RSL-RL's API and layout)."""

    class Transition:
        """One step of data, filled by the runner and passed to ``add_transition``."""

        def __init__(self) -> None:
            self.observations: Mapping[str, torch.Tensor] | None = None
            self.actions: torch.Tensor | None = None
            self.rewards: torch.Tensor | None = None
            self.dones: torch.Tensor | None = None
            self.values: torch.Tensor | None = None
            self.actions_log_prob: torch.Tensor | None = None
            self.distribution_params: tuple[torch.Tensor, ...] | None = None
            self.privileged_actions: torch.Tensor | None = None
            self.hidden_states: tuple[HiddenState, HiddenState] = (None, None)

        def clear(self) -> None:
            """Reset all fields to None."""
            self.__init__()

    class Batch:
        """A mini-batch as RSL-RL's generators yield it (fields are None where a mode has none)."""

        def __init__(
            self,
            observations: Mapping[str, torch.Tensor] | None = None,
            actions: torch.Tensor | None = None,
            values: torch.Tensor | None = None,
            advantages: torch.Tensor | None = None,
            returns: torch.Tensor | None = None,
            old_actions_log_prob: torch.Tensor | None = None,
            old_distribution_params: tuple[torch.Tensor, ...] | None = None,
            hidden_states: tuple[HiddenState, HiddenState] = (None, None),
            masks: torch.Tensor | None = None,
            privileged_actions: torch.Tensor | None = None,
            dones: torch.Tensor | None = None,
        ) -> None:
            self.observations = observations
            self.actions = actions
            self.values = values
            self.advantages = advantages
            self.returns = returns
            self.old_actions_log_prob = old_actions_log_prob
            self.old_distribution_params = old_distribution_params
            self.hidden_states = hidden_states
            self.masks = masks
            self.privileged_actions = privileged_actions
            self.dones = dones

    def __init__(
        self,
        training_type: str,
        num_envs: int,
        num_transitions_per_env: int,
        obs: Mapping[str, torch.Tensor],
        actions_shape: tuple[int, ...] | list[int],
        device: str | torch.device = "cpu",
    ) -> None:
        """Allocate ``[T, N, ...]`` buffers; ``obs`` gives one ``[N, ...]`` example per observation group."""
        if training_type not in ("rl", "distillation"):
            raise ValueError(f"training_type must be 'rl' or 'distillation', got {training_type!r}")
        self.training_type = training_type
        self.device = device
        self.num_transitions_per_env = num_transitions_per_env
        self.num_envs = num_envs
        self.actions_shape = tuple(actions_shape)
        T, N = num_transitions_per_env, num_envs
        buffers = {key: torch.zeros(T, *value.shape, dtype=value.dtype, device=device) for key, value in obs.items()}
        if _is_tensordict(obs):
            self.observations: Any = type(obs)(buffers, batch_size=[T, N], device=device)
        else:
            self.observations = buffers
        self.rewards = torch.zeros(T, N, 1, device=device)
        self.actions = torch.zeros(T, N, *self.actions_shape, device=device)
        self.dones = torch.zeros(T, N, 1, device=device).byte()
        if training_type == "distillation":
            self.privileged_actions = torch.zeros(T, N, *self.actions_shape, device=device)
        if training_type == "rl":
            self.values = torch.zeros(T, N, 1, device=device)
            self.actions_log_prob = torch.zeros(T, N, 1, device=device)
            self.distribution_params: tuple[torch.Tensor, ...] | None = None
            self.returns = torch.zeros(T, N, 1, device=device)
            self.advantages = torch.zeros(T, N, 1, device=device)
        self.saved_hidden_state_a: list[torch.Tensor] | None = None
        self.saved_hidden_state_c: list[torch.Tensor] | None = None
        # rolloutcli additions, filled by from_hdf5 (RSL-RL keeps these outside the storage)
        self.time_outs: torch.Tensor | None = None
        self.last_values: torch.Tensor | None = None
        self.distribution_names: list[str] = []
        self.attrs: dict[str, Any] = {}
        self.step = 0

    def add_transition(self, transition: RolloutStorage.Transition) -> None:
        """Copy one step into row ``self.step``; raises OverflowError when the storage is full."""
        if self.step >= self.num_transitions_per_env:
            raise OverflowError("Rollout buffer overflow! You should call clear() before adding new transitions.")
        assert transition.observations is not None and transition.actions is not None
        assert transition.rewards is not None and transition.dones is not None
        for key, value in transition.observations.items():
            self.observations[key][self.step].copy_(value)
        self.actions[self.step].copy_(transition.actions)
        self.rewards[self.step].copy_(transition.rewards.view(-1, 1))
        self.dones[self.step].copy_(transition.dones.view(-1, 1))
        if self.training_type == "distillation":
            assert transition.privileged_actions is not None
            self.privileged_actions[self.step].copy_(transition.privileged_actions)
        if self.training_type == "rl":
            assert transition.values is not None and transition.actions_log_prob is not None
            self.values[self.step].copy_(transition.values)
            self.actions_log_prob[self.step].copy_(transition.actions_log_prob.view(-1, 1))
            params = transition.distribution_params or ()
            if self.distribution_params is None:
                self.distribution_params = tuple(
                    torch.zeros(self.num_transitions_per_env, *p.shape, device=self.device) for p in params
                )
            for buffer, param in zip(self.distribution_params, params, strict=True):
                buffer[self.step].copy_(param)
        self._save_hidden_states(transition.hidden_states)
        self.step += 1

    def clear(self) -> None:
        """Reset the write cursor for the next rollout."""
        self.step = 0

    def _save_hidden_states(self, hidden_states: tuple[HiddenState, HiddenState]) -> None:
        """Store the actor's and critic's recurrent state of this step (a GRU state becomes a 1-tuple)."""
        for which, state in zip(("a", "c"), hidden_states, strict=True):
            if state is None:
                continue
            parts = state if isinstance(state, tuple) else (state,)
            attribute = f"saved_hidden_state_{which}"
            if getattr(self, attribute) is None:
                setattr(
                    self,
                    attribute,
                    [torch.zeros(self.num_transitions_per_env, *p.shape, device=self.device) for p in parts],
                )
            for buffer, part in zip(getattr(self, attribute), parts, strict=True):
                buffer[self.step].copy_(part)

    # --- HDF5 -----------------------------------------------------------------------------------------
    @classmethod
    def from_hdf5(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        envs: slice | None = None,
        *,
        training_type: str | None = None,
        allow_external: bool = False,
    ) -> RolloutStorage:
        """Load a rollout file (validated, read-only) into a full storage; ``envs`` selects an env slice.

        ``training_type`` defaults to ``"rl"`` when the file has ``values``, else ``"distillation"``
        when it has ``privileged_actions``, else ``"rl"``.
        """
        from rolloutcli.hdf5.storage_io import load_storage

        return load_storage(cls, Path(path), device, envs, training_type, allow_external)

    def to_hdf5(self, path: str | Path, *, overwrite: bool = False) -> None:
        """Write the storage as a rollout file (atomically: temporary name, then rename)."""
        from rolloutcli.hdf5.storage_io import save_storage

        save_storage(self, Path(path), overwrite=overwrite)
