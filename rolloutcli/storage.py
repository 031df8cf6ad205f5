"""``RolloutStorage``: a drop-in for RSL-RL 5.x's storage (its ``[T, N, ...]`` layout, signatures and, by default,
exactly what its generators yield), plus loading from and saving to HDF5.

Beyond RSL-RL, a storage loaded from a file also carries ``time_outs [T, N, 1]`` and ``last_values [N, 1]``
(None when the file has none), ``distribution_names`` and ``attrs``. Keyword options of the generators
(``parity=False``, ``shuffle_envs``, ``generator``) give ``rolloutcli batch``'s default behaviour instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from rolloutcli.core.batching import feedforward_order, parity_sizes, recurrent_groups, split_sizes
from rolloutcli.core.trajectories import hidden_states_at_starts, split_and_pad_trajectories, trajectory_spans
from rolloutcli.minibatch import Batch, HiddenState


def _is_tensordict(value: object) -> bool:
    return type(value).__name__ == "TensorDict"


def _select(observations: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply an indexing ``fn`` to observations: to the TensorDict itself, or to each tensor of a dict."""
    if _is_tensordict(observations):
        return fn(observations)
    return {key: fn(value) for key, value in observations.items()}


class RolloutStorage:
    """Storage for the data collected during a rollout (RSL-RL's API and layout)."""

    class Transition:
        """One step of data, filled by the runner and passed to ``add_transition`` (as RSL-RL's, built empty)."""

        def __init__(self) -> None:
            self.clear()

        def clear(self) -> None:
            """Reset all fields to None."""
            self.observations: Mapping[str, torch.Tensor] | None = None
            self.actions: torch.Tensor | None = None
            self.rewards: torch.Tensor | None = None
            self.dones: torch.Tensor | None = None
            self.values: torch.Tensor | None = None
            self.actions_log_prob: torch.Tensor | None = None
            self.distribution_params: tuple[torch.Tensor, ...] | None = None
            self.privileged_actions: torch.Tensor | None = None
            self.hidden_states: tuple[HiddenState, HiddenState] = (None, None)

    Batch = Batch  # RSL-RL's mini-batch type (rolloutcli.minibatch: a pytree dataclass with .to() and .pin_memory())

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
            self._blank = (self.returns, self.advantages)  # still these zeros: never computed (see to_hdf5)
        self.saved_hidden_state_a: list[torch.Tensor] | None = None
        self.saved_hidden_state_c: list[torch.Tensor] | None = None
        # rolloutcli additions, filled by from_hdf5 (RSL-RL keeps these outside the storage)
        self.time_outs: torch.Tensor | None = None
        self.last_values: torch.Tensor | None = None
        self.distribution_names: list[str] = []
        self.attrs: dict[str, Any] = {}
        self.path: str | None = None  # the file from_hdf5 loaded
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
                zeros = [torch.zeros(self.num_transitions_per_env, *p.shape, device=self.device) for p in parts]
                setattr(self, attribute, zeros)
            for buffer, part in zip(getattr(self, attribute), parts, strict=True):
                buffer[self.step].copy_(part)

    # --- generators (RSL-RL's signatures; thin over rolloutcli.core.batching) ----------------------------
    def compute_returns(
        self,
        last_values: torch.Tensor | None = None,
        gamma: float = 0.99,
        lam: float = 0.95,
        normalize_advantage: bool = True,
        *,
        bootstrap_time_outs: bool | None = None,
    ) -> None:
        """Fill ``returns`` and ``advantages`` ``[T, N, 1]`` with GAE, exactly as RSL-RL's PPO computes them.

        The normalisation is RSL-RL's own line (torch's float32 ``mean()``/``std()``), so in one process the result
        is RSL-RL's bit for bit; ``rolloutcli gae`` uses exactly rounded statistics instead (its bytes must not
        depend on threads or devices).

        Args:
            last_values: V(s_T), ``[N]`` or ``[N, 1]``; defaults to the ``last_values`` loaded from a file.
            bootstrap_time_outs: apply ``rewards += gamma * values * time_outs`` to ``self.rewards`` first
                (RSL-RL does this in ``process_env_step``). Default: when ``time_outs`` were loaded and the
                ``timeouts_bootstrapped`` attribute is not set; it is set afterwards, so a second call never
                bootstraps twice.

        Raises:
            ValueError: no last values, or the rewards hold a bootstrap with another gamma (``gae_gamma``).
        """
        from rolloutcli.core.gae import bootstrap_time_outs as bootstrap
        from rolloutcli.core.gae import compute_gae

        if self.training_type != "rl":
            raise ValueError("compute_returns is only available for reinforcement learning training.")
        if last_values is None:
            last_values = self.last_values
        if last_values is None:
            raise ValueError("compute_returns needs last_values: V(s_T) of the state after the last step.")
        already = bool(self.attrs.get("timeouts_bootstrapped", False))
        recorded = self.attrs.get("gae_gamma")
        if already and isinstance(recorded, (int, float)) and float(recorded) != float(gamma):
            raise ValueError(
                f"the rewards hold a time-out bootstrap with gamma {recorded}; compute_returns(gamma={gamma}) "
                f"would mix two gammas. Pass gamma={recorded}, or load the recording with its raw rewards."
            )
        if bootstrap_time_outs is None:
            bootstrap_time_outs = self.time_outs is not None and not already
        if bootstrap_time_outs and not already:
            if self.time_outs is None:
                raise ValueError("bootstrap_time_outs=True but the storage has no time_outs.")
            self.rewards = bootstrap(self.rewards, self.values, self.time_outs, gamma).reshape(self.rewards.shape)
            self.attrs["timeouts_bootstrapped"] = True
            self.attrs["gae_gamma"] = gamma
        advantages, returns = compute_gae(
            self.rewards, self.values, self.dones, last_values.reshape(-1), gamma=gamma, lam=lam
        )
        self.returns = returns.unsqueeze(-1)
        self.advantages = advantages.unsqueeze(-1)
        if normalize_advantage:  # RSL-RL's line, on the [T, N, 1] tensor as RSL-RL's storage holds it
            self.advantages = (self.advantages - self.advantages.mean()) / (self.advantages.std() + 1e-8)

    def generator(self) -> Iterator[RolloutStorage.Batch]:
        """Distillation: one ``Batch(observations, privileged_actions, dones)`` per time step (RSL-RL's)."""
        if self.training_type != "distillation":
            raise ValueError("This function is only available for distillation training.")
        for i in range(self.num_transitions_per_env):
            yield RolloutStorage.Batch(
                observations=_select(self.observations, lambda x, i=i: x[i]),
                privileged_actions=self.privileged_actions[i],
                dones=self.dones[i],
            )

    def mini_batch_generator(
        self,
        num_mini_batches: int,
        num_epochs: int = 8,
        *,
        parity: bool = True,
        generator: torch.Generator | None = None,
    ) -> Iterator[RolloutStorage.Batch]:
        """Feed-forward mini-batches of the ``T * N`` rows flattened time-major (row ``t * N + n``).

        ``parity`` (default, RSL-RL's behaviour): one ``torch.randperm(M * (T * N // M))`` drawn on the first
        ``next()`` and reused every epoch, ``T * N % M`` rows never used; with ``generator=None`` it is drawn from
        the global RNG on ``self.device``, exactly as RSL-RL does. ``parity=False``: every epoch a fresh
        :class:`~rolloutcli.core.order.RowOrder` of the ``T * N`` rows keyed by the next draw of ``generator``
        (on the CPU), every row used once per epoch (the order of ``rolloutcli batch`` with the same seed).
        """
        if self.training_type != "rl":
            raise ValueError("This function is only available for reinforcement learning training.")
        self._check_computed()
        total = self.num_envs * self.num_transitions_per_env
        indices: torch.Tensor | None = None
        if parity:
            sizes = parity_sizes(total, num_mini_batches)
            if generator is None:
                indices = torch.randperm(sum(sizes), requires_grad=False, device=self.device)
            else:
                indices = feedforward_order(total, num_mini_batches, parity=True, generator=generator).to(self.device)
        else:
            sizes = split_sizes(total, num_mini_batches)
        observations = _select(self.observations, lambda x: x.flatten(0, 1))
        actions, values = self.actions.flatten(0, 1), self.values.flatten(0, 1)
        advantages, returns = self.advantages.flatten(0, 1), self.returns.flatten(0, 1)
        log_prob = self.actions_log_prob.flatten(0, 1)
        params = tuple(p.flatten(0, 1) for p in self.distribution_params) if self.distribution_params else None
        for _ in range(num_epochs):
            if not parity:
                order = feedforward_order(total, num_mini_batches, parity=False, generator=generator)
                indices = order.to(self.device)
            assert indices is not None
            for batch_idx in torch.split(indices, sizes):
                yield RolloutStorage.Batch(
                    observations=_select(observations, lambda x, idx=batch_idx: x[idx]),
                    actions=actions[batch_idx],
                    values=values[batch_idx],
                    advantages=advantages[batch_idx],
                    returns=returns[batch_idx],
                    old_actions_log_prob=log_prob[batch_idx],
                    old_distribution_params=tuple(p[batch_idx] for p in params) if params is not None else None,
                )

    def recurrent_mini_batch_generator(
        self,
        num_mini_batches: int,
        num_epochs: int = 8,
        *,
        parity: bool = True,
        shuffle_envs: bool = False,
        generator: torch.Generator | None = None,
    ) -> Iterator[RolloutStorage.Batch]:
        """Mini-batches of env groups for recurrent networks (RSL-RL's ``recurrent_mini_batch_generator``).

        ``parity`` (default, RSL-RL's behaviour): contiguous groups of ``N // M`` envs, the last ``N % M`` never
        used; False: groups differing by at most one env. ``shuffle_envs`` (``parity=False`` only): new groups
        each epoch, drawn from ``generator``.
        """
        if self.training_type != "rl":
            raise ValueError("This function is only available for reinforcement learning training.")
        self._check_computed()
        fixed: list[dict[str, Any]] | None = None
        for _ in range(num_epochs):
            if fixed is None or shuffle_envs:
                groups = recurrent_groups(
                    self.num_envs, num_mini_batches, parity=parity, shuffle=shuffle_envs, generator=generator
                )
                batches = [self._recurrent_batch(group) for group in groups]
                fixed = None if shuffle_envs else batches
            for fields in fixed or batches:
                yield RolloutStorage.Batch(**fields)

    def _check_computed(self) -> None:
        """Refuse to yield the zeros a storage starts with as advantages and returns."""
        from rolloutcli.errors import RolloutError
        from rolloutcli.storage_fields import computed

        if not computed(self):
            raise RolloutError.field(
                self.path or "RolloutStorage", "advantages", "advantages and returns computed before mini-batches",
                "the zeros of a storage whose compute_returns() was never called (and whose file held none)",
                "Call storage.compute_returns() first.",
            )  # fmt: skip

    def _recurrent_batch(self, envs: torch.Tensor) -> dict[str, Any]:
        """The fields of one recurrent mini-batch over the env ids ``envs`` (ascending)."""
        first, count = int(envs[0]), envs.numel()
        contiguous = int(envs[-1]) - first + 1 == count  # then views, like RSL-RL's slices
        columns = slice(first, first + count) if contiguous else envs.to(self.device)

        def take(x: Any) -> Any:
            return x[:, columns]

        dones = take(self.dones)
        observations, masks = split_and_pad_trajectories(_select(self.observations, take), dones)
        spans = trajectory_spans(dones)
        hidden: list[HiddenState] = []
        for saved in (self.saved_hidden_state_a, self.saved_hidden_state_c):
            if saved is None:
                hidden.append(None)
                continue
            states = hidden_states_at_starts([take(state.transpose(1, 2)).transpose(1, 2) for state in saved], spans)
            hidden.append(states[0] if len(states) == 1 else tuple(states))  # RSL-RL's: a GRU's state bare
        params = self.distribution_params
        return {
            "observations": observations,
            "actions": take(self.actions),
            "values": take(self.values),
            "advantages": take(self.advantages),
            "returns": take(self.returns),
            "old_actions_log_prob": take(self.actions_log_prob),
            "old_distribution_params": tuple(take(p) for p in params) if params else None,
            "hidden_states": (hidden[0], hidden[1]),
            "masks": masks,
        }

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
        tensordict: bool = True,
    ) -> RolloutStorage:
        """Load a rollout file (with the commands' checks) into a full storage; ``envs`` selects an env slice.

        ``training_type`` defaults to ``"distillation"`` when the file has ``privileged_actions`` and no
        ``values``, else ``"rl"``. Observations are a ``TensorDict`` (RSL-RL's type), or a dict with
        ``tensordict=False``.
        """
        from rolloutcli.hdf5.limits import SafetyOptions
        from rolloutcli.hdf5.storage_io import read_rollout
        from rolloutcli.storage_fields import fill_storage

        loaded = read_rollout(path, device, envs, SafetyOptions(allow_external=allow_external))
        tensors = loaded.tensors
        if training_type is None:
            training_type = "distillation" if "privileged_actions" in tensors and "values" not in tensors else "rl"
        example: Any = {key: tensors[name][0] for key, name in loaded.observations.items()}
        if tensordict:
            from tensordict import TensorDict

            example = TensorDict(example, batch_size=[loaded.N], device="meta")
        # built on the meta device (nothing allocated: the loaded tensors replace its buffers), then on ``device``
        storage = cls(training_type, loaded.N, loaded.T, example, tuple(tensors["actions"].shape[2:]), "meta")
        storage.device = device
        fill_storage(storage, loaded)
        storage.path = str(path)
        return storage

    def to_hdf5(self, path: str | Path, *, overwrite: bool = False) -> None:
        """Write the storage as a rollout file (atomically: temporary name, then rename).

        ``advantages`` and ``returns`` are written only once computed (``compute_returns`` or loaded from a
        file): the zeros a fresh storage holds would pass for real advantages.
        """
        from rolloutcli.hdf5.storage_io import write_rollout
        from rolloutcli.storage_fields import storage_tensors

        tensors, group_attrs = storage_tensors(self)
        write_rollout(path, tensors, self.attrs, group_attrs=group_attrs, overwrite=overwrite)
