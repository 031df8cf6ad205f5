"""``RecordRollouts``: a gymnasium vector-env wrapper writing every ``steps_per_file`` steps as a rollout file (and
the steps since the last file as a shorter one at ``close()`` and at a full ``reset()``).

Per step: the observation the action was taken on, the action, the reward, ``dones = terminated | truncated``,
``time_outs = truncated & ~terminated`` (the steps a trainer bootstraps) and, at done steps, the observation
that ended the episode (``final_observations``), in every gymnasium 1.x autoreset mode:

- ``SAME_STEP``: from ``infos["final_obs"]`` (the returned observation is already the reset one);
- ``NEXT_STEP`` (the default): the returned observation is the final one; the env's next step ignores the
  action and only resets. That step is recorded with ``dones = 1`` and marked in the extra dataset
  ``autoreset_steps`` (1 there): it is no transition, so mask it when training;
- ``DISABLED``: the returned observation is the final one; resets (``reset(options={"reset_mask": ...})``)
  only replace the observations of the masked envs.

``value_fn`` (observations -> ``[N]`` values) fills ``values``, ``last_values`` and ``final_values``.

The files between two full resets are one consecutive recording (format 1.2): each ends with
``last_observations``, the first observations of the next, and carries ``recording_id`` (new at each full reset)
and ``recording_index`` (0, 1, ... from it). In DISABLED mode an env reset between two files starts the next
from its reset observation, while the file before ends with the observation that ended its episode.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.record.folder import recording_folder
from rolloutcli.record.writer import RolloutWriter

try:
    import gymnasium as gym
    from gymnasium.vector import AutoresetMode
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError("rolloutcli.record.gym needs gymnasium: pip install 'rolloutcli[record]'") from error


def _select(obs: Any, where: np.ndarray, other: Any) -> Any:
    """``obs`` where ``where`` else ``other`` (dict observations per key)."""
    if isinstance(obs, dict):
        return {k: _select(obs[k], where, other[k]) for k in obs}
    mask = where.reshape(-1, *([1] * (np.ndim(obs) - 1)))
    return np.where(mask, obs, other)


def _zeros(obs: Any) -> Any:
    return {k: _zeros(v) for k, v in obs.items()} if isinstance(obs, dict) else np.zeros_like(obs)


class RecordRollouts(gym.vector.VectorWrapper):
    """Record a vector env; ``files`` lists the files written. See the module docstring."""

    def __init__(
        self,
        env: gym.vector.VectorEnv,
        out_dir: str | Path,
        steps_per_file: int,
        value_fn: Any = None,
        compression: str | None = None,
        gamma: float | None = None,
    ) -> None:
        super().__init__(env)
        self.out_dir, self.steps_per_file, self.value_fn = Path(out_dir), steps_per_file, value_fn
        self.compression, self.gamma, self.files = compression, gamma, []
        self.mode = AutoresetMode(env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))
        recording_folder(self.out_dir, 0, "RecordRollouts")
        self._writer: RolloutWriter | None = None
        self._obs: Any = None
        self._from_reset = False
        self._recording: str | None = None  # the consecutive recording since the last full reset
        self._index = 0  # its next file
        self._pending = np.zeros(self.num_envs, bool)  # NEXT_STEP: envs whose next step is the autoreset

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        mask = (options or {}).get("reset_mask")
        if mask is not None and self._obs is not None:  # a partial reset (DISABLED mode): the episode goes on
            self._obs = _select(obs, np.asarray(mask), self._obs)
            return obs, info
        self._publish()  # the steps before the reset: a shorter file (recorded steps are never dropped)
        self._obs, self._from_reset, self._pending[:] = obs, True, False
        self._recording, self._index = uuid.uuid4().hex, 0  # the envs start over: a new recording
        return obs, info

    def _values(self, obs: Any) -> np.ndarray | None:
        return None if self.value_fn is None else np.asarray(self.value_fn(obs), np.float32).reshape(self.num_envs)

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        obs, rewards, terminated, truncated, info = self.env.step(actions)
        terminated, truncated = np.asarray(terminated, bool), np.asarray(truncated, bool)
        dones = terminated | truncated
        if self.mode == AutoresetMode.SAME_STEP and "final_obs" in info:
            ended = np.asarray(info["_final_obs"], bool)
            final = _select(_stack(info["final_obs"], ended, obs), ended, _zeros(obs))
        else:
            final = _select(obs, dones, _zeros(obs))
        step = {
            "observations": self._obs,
            "actions": np.asarray(actions),
            "rewards": np.asarray(rewards, np.float32),
            "dones": dones | self._pending,
            "time_outs": truncated & ~terminated,
            "final_observations": final,
        }
        if self.mode == AutoresetMode.NEXT_STEP:
            step["extras"] = {"autoreset_steps": self._pending.astype(np.uint8)}
        if self.value_fn is not None:
            step["values"] = self._values(self._obs)
            step["final_values"] = np.where(dones, self._values(final), np.float32(0))
        self._add(step)
        self._obs = obs
        if self.mode == AutoresetMode.NEXT_STEP:
            self._pending = dones.copy()
        if self._writer is not None and self._writer.steps == self.steps_per_file:
            self._publish()
        return obs, rewards, terminated, truncated, info

    def _publish(self) -> None:
        """Close the file being recorded (its steps so far; ``self._obs`` follows the last), if one is."""
        writer, self._writer = self._writer, None
        if writer is not None:
            self.files.append(writer.close(last_values=self._values(self._obs), last_observations=_groups(self._obs)))

    def _add(self, step: dict[str, Any]) -> None:
        if self._writer is None:
            path = self.out_dir / f"rollout_{len(self.files):06d}.h5"
            self._writer = RolloutWriter(
                path,
                num_envs=self.num_envs,
                num_steps=self.steps_per_file,
                compression=self.compression,
                gamma=self.gamma,
                recorded_from_reset=self._from_reset and not self._pending.any(),
                recorder="rolloutcli.record.gym.RecordRollouts",
                timeouts_rule="final-value",  # gymnasium trainers bootstrap a truncation from the final observation
                recording_id=self._recording,
                recording_index=None if self._recording is None else self._index,
                overwrite=True,
            )
            self._from_reset, self._index = False, self._index + 1
        self._writer.add({**step, "observations": _groups(step["observations"])})

    def close(self, **kwargs: Any) -> None:
        """Publish the steps recorded since the last file (a file shorter than ``steps_per_file``), then close."""
        try:
            self._publish()
        finally:
            super().close(**kwargs)


def _groups(obs: Any) -> Any:
    return dict(obs) if isinstance(obs, dict) else {"policy": obs}


def _stack(finals: Any, ended: np.ndarray, like: Any) -> Any:
    """gymnasium's object array of final observations (None where the env did not end) as one array."""
    if isinstance(like, dict):
        return {
            k: _stack(
                np.array([f[k] if e else None for f, e in zip(finals, ended, strict=True)], object), ended, like[k]
            )
            for k in like
        }
    return np.stack(
        [np.asarray(f) if e else np.zeros_like(like[i]) for i, (f, e) in enumerate(zip(finals, ended, strict=True))]
    )
