"""Record RSL-RL's rollouts: ``attach(runner, out_dir)`` hooks an ``OnPolicyRunner`` (or Isaac Lab's) so that
every ``every``-th iteration is written as ``out_dir/rollout_<iteration>.h5``, with nothing else changed.

The hook wraps the algorithm's ``process_env_step`` and ``compute_returns`` on the instance (no user
monkeypatching) and only reads what RSL-RL computed: the transition ``act()`` filled (observations, actions,
values, log-probs, distribution parameters in RSL-RL's order, hidden states: zeros where RSL-RL's state is
still None), the env's raw rewards (RSL-RL's storage holds them bootstrapped), ``extras["time_outs"]``
verbatim, and the critic's output of RSL-RL's own ``last_values`` forward (the critic is run no extra time, so
training is bit-identical with and without the hook).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from rolloutcli.record.writer import RolloutWriter

RECORDER = "rolloutcli.record.rsl_rl"


def _zeros_like(state: Any, fallback: Any) -> Any:
    """``state``, or zeros shaped as ``fallback`` (the model's state after its first step) where it is None."""
    import torch

    if state is not None:
        return state
    if isinstance(fallback, tuple | list):
        return tuple(torch.zeros_like(part) for part in fallback)
    return torch.zeros_like(fallback)


def _names(actor: Any, count: int) -> list[str]:
    """Names of the distribution parameters in RSL-RL's order: Gaussian (mean, std), Beta (alpha, beta)."""
    distribution = getattr(actor, "distribution", None)
    kind = type(distribution).__name__.lower()
    if "beta" in kind and count == 2:
        return ["alpha", "beta"]
    if "gaussian" in kind and count == 2:
        return ["mean", "std"]
    return [f"param{i}" for i in range(count)]


@functools.cache
def _rsl_rl_version() -> str:
    import importlib.metadata as metadata

    try:
        return metadata.version("rsl-rl-lib")
    except metadata.PackageNotFoundError:
        return "unknown"


class RslRlRecorder:
    """The hook :func:`attach` installs; ``files`` lists the files written so far."""

    def __init__(self, runner: Any, out_dir: str | Path, every: int = 1, compression: str | None = None) -> None:
        if every < 1:
            raise ValueError(f"every: expected a positive number of iterations, found {every}")
        self.runner, self.alg, self.out_dir, self.every = runner, runner.alg, Path(out_dir), every
        self.compression, self._files, self._closing = compression, [], []
        self.iteration = int(getattr(runner, "current_learning_iteration", 0))
        self.writer: RolloutWriter | None = None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._process, self._returns = self.alg.process_env_step, self.alg.compute_returns
        self.alg.process_env_step, self.alg.compute_returns = self.process_env_step, self.compute_returns

    @property
    def files(self) -> list[Path]:
        """The files written so far (waits for the one being published; raises its error)."""
        while self._closing:
            self._files.append(self._closing.pop(0).wait())
        return list(self._files)

    def detach(self) -> None:
        """Remove the hook (an unfinished recording is discarded; published ones are waited for)."""
        self.files  # noqa: B018 - surfaces a failed background publish
        self.alg.process_env_step, self.alg.compute_returns = self._process, self._returns
        if self.writer is not None:
            self.writer.abort()
            self.writer = None

    def _attrs(self) -> dict[str, Any]:
        config = json.dumps(getattr(self.runner, "cfg", {}), default=repr, sort_keys=True)
        return {"rsl_rl_version": _rsl_rl_version(), "runner_config": config, "iteration": self.iteration}

    def _open(self) -> RolloutWriter:
        path = self.out_dir / f"rollout_{self.iteration:06d}.h5"
        return RolloutWriter(
            path,
            num_envs=self.alg.storage.num_envs,
            num_steps=self.alg.storage.num_transitions_per_env,
            compression=self.compression,
            gamma=float(self.alg.gamma),
            lam=float(self.alg.lam),
            recorder=RECORDER,
            attrs=self._attrs(),
            overwrite=True,
        )

    def process_env_step(self, obs: Any, rewards: Any, dones: Any, extras: dict[str, Any]) -> Any:
        if self.iteration % self.every == 0:
            if self.writer is None:
                self.writer = self._open()
            self.writer.add(self._step(rewards, dones, extras))
        return self._process(obs, rewards, dones, extras)

    def _step(self, rewards: Any, dones: Any, extras: dict[str, Any]) -> dict[str, Any]:
        """The step RSL-RL's transition holds, with the env's raw rewards and time-outs."""
        transition, alg = self.alg.transition, self.alg
        params = transition.distribution_params or ()
        step = {
            "observations": dict(transition.observations.items()),
            "actions": transition.actions,
            "rewards": rewards,
            "dones": dones,
            "values": transition.values,
            "actions_log_prob": transition.actions_log_prob,
            "distribution": dict(zip(_names(alg.actor, len(params)), params, strict=True)),
        }
        if "time_outs" in extras:
            step["time_outs"] = extras["time_outs"]  # verbatim: RSL-RL bootstraps wherever it is set
        actor_state, critic_state = transition.hidden_states or (None, None)
        hidden = {}
        if getattr(alg.actor, "is_recurrent", False):
            hidden["actor"] = _zeros_like(actor_state, alg.actor.get_hidden_state())
        if getattr(alg.critic, "is_recurrent", False):
            hidden["critic"] = _zeros_like(critic_state, alg.critic.get_hidden_state())
        if hidden:
            step["hidden_states"] = hidden
        return step

    def compute_returns(self, obs: Any) -> Any:
        if self.writer is None:
            self.iteration += 1
            return self._returns(obs)
        critic, captured = self.alg.critic, []
        forward = critic.forward

        def spy(*args: Any, **kwargs: Any) -> Any:  # RSL-RL's own last-values forward, seen once
            out = forward(*args, **kwargs)
            captured.append(out.detach().clone())
            return out

        critic.forward = spy
        try:
            result = self._returns(obs)
        finally:
            del critic.forward
        writer, self.writer = self.writer, None
        last = captured[0] if captured else None
        self.files  # noqa: B018 - one file in flight at a time; an earlier failure surfaces here
        writer.close(last_values=last, last_observations=dict(obs.items()), background=True)
        self._closing.append(writer)
        self.iteration += 1
        return result


def attach(runner: Any, out_dir: str | Path, every: int = 1, compression: str | None = None) -> RslRlRecorder:
    """Record every ``every``-th iteration of ``runner`` (an RSL-RL ``OnPolicyRunner``) into ``out_dir``."""
    return RslRlRecorder(runner, out_dir, every, compression)
