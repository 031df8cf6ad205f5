"""``RolloutRecorderCallback``: record each rollout an SB3 on-policy algorithm (PPO, A2C) collects.

Per step it reads SB3's own locals: the observations the policy acted on, actions, values, log-probs, the raw
rewards (``on_step`` runs before SB3 adds ``gamma * V(terminal observation)`` on truncations), ``dones``,
``time_outs`` (SB3's ``TimeLimit.truncated``: truncated and not terminated), the terminal observations and
their values (``final_values``). ``last_values`` are SB3's own at the rollout's end. ``rolloutcli gae
--timeouts final-value`` with the algorithm's gamma and gae_lambda then gives SB3's returns bit for bit when
SB3's trace coefficient, ``gamma * gae_lambda`` multiplied in float64 and rounded once to float32, equals
RSL-RL's, ``float32(gamma) * float32(gae_lambda)`` rounded to float32 (so for 0.99 and 0.95, SB3's defaults;
not for 0.99 and 0.92 or 0.9 and 0.9), and within float32 rounding otherwise (tests/test_record_sb3.py).
Advantages are RSL-RL's ``returns - values``, within one float32 rounding of SB3's.

Rollouts that follow each other (SB3 keeps its envs' last observation from one to the next) are one consecutive
recording (format 1.2): each file ends with ``last_observations`` (the observations the next rollout starts from)
and carries ``recording_id`` and ``recording_index`` (0, 1, ...); a rollout starting from other observations (SB3
reset the envs: a new ``learn`` with ``reset_num_timesteps``) starts a new recording.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.record.folder import recording_folder
from rolloutcli.record.writer import RolloutWriter

try:
    import torch
    from stable_baselines3.common.callbacks import BaseCallback
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError("rolloutcli.record.sb3 needs stable-baselines3: pip install stable-baselines3") from error


def _groups(obs: Any) -> dict[str, Any]:
    return dict(obs) if isinstance(obs, dict) else {"policy": obs}


class RolloutRecorderCallback(BaseCallback):
    """Write every rollout to ``out_dir/rollout_<n>.h5``; ``files`` lists them."""

    def __init__(self, out_dir: str | Path, compression: str | None = None, verbose: int = 0) -> None:
        super().__init__(verbose)
        self.out_dir, self.compression, self.files = Path(out_dir), compression, []
        self.writer: RolloutWriter | None = None
        self.recording_id: str | None = None  # the consecutive recording, its next file's index
        self._index = 0
        self._last: tuple[Any, dict[str, np.ndarray]] | None = None  # SB3's last observation object, a copy of it

    def _continues(self, obs: Any) -> bool:
        """Whether the rollout starting from ``obs`` continues the last one: SB3 kept its last observation (the
        same object, holding the same values: a VecEnv may reset into the buffer it returned)."""
        if self._last is None or obs is not self._last[0]:
            return False
        return all(np.array_equal(np.asarray(v), self._last[1][k]) for k, v in _groups(obs).items())

    def _on_rollout_start(self) -> None:
        if not self.files:  # this callback's first rollout: the folder must not hold another recording's
            recording_folder(self.out_dir, 0, "RolloutRecorderCallback")
        model = self.model
        if self.recording_id is None or not self._continues(model._last_obs):
            self.recording_id, self._index = uuid.uuid4().hex, 0  # uuid4: not the global RNG
        self.writer = RolloutWriter(
            self.out_dir / f"rollout_{len(self.files):06d}.h5",
            num_envs=model.n_envs,
            num_steps=model.n_steps,
            compression=self.compression,
            gamma=float(model.gamma),
            lam=float(getattr(model, "gae_lambda", 1.0)),
            recorder="rolloutcli.record.sb3.RolloutRecorderCallback",
            timeouts_rule="final-value",  # collect_rollouts: r += gamma * V(terminal_observation)
            recording_id=self.recording_id,
            recording_index=self._index,
            overwrite=True,
        )
        self._index += 1

    def _final(self, infos: list[dict[str, Any]], dones: np.ndarray, like: Any) -> tuple[Any, np.ndarray]:
        """Terminal observations at done steps (zeros elsewhere) and their values (SB3's predict_values)."""
        policy = self.model.policy
        groups = {k: np.zeros_like(np.asarray(v)) for k, v in _groups(like).items()}
        for n in np.flatnonzero(dones):
            terminal = infos[n].get("terminal_observation")
            if terminal is not None:
                for key, value in _groups(terminal).items():
                    groups[key][n] = value
        values = np.zeros(len(dones), np.float32)
        for n in np.flatnonzero(dones):  # one at a time, as SB3 does (a batch may round differently)
            terminal = infos[n].get("terminal_observation")
            if terminal is not None:
                with torch.no_grad():
                    values[n] = policy.predict_values(policy.obs_to_tensor(terminal)[0])[0].item()
        return groups, values

    def _on_step(self) -> bool:
        try:
            self._record()
        except BaseException:  # a refused step (NaN reward, a new field) ends the recording: no temporary stays
            if self.writer is not None:
                writer, self.writer = self.writer, None
                writer.abort()
            raise
        return True

    def _record(self) -> None:
        local = self.locals
        dones, infos = np.asarray(local["dones"], bool), local["infos"]
        time_outs = np.array(
            [bool(d and i.get("TimeLimit.truncated", False)) for d, i in zip(dones, infos, strict=True)]
        )
        final_obs, final_values = self._final(infos, dones, local["new_obs"])
        assert self.writer is not None
        self.writer.add(
            {
                "observations": _groups(self.model._last_obs),
                "actions": local["actions"],
                "rewards": np.asarray(local["rewards"], np.float32),
                "dones": dones,
                "time_outs": time_outs,
                "values": local["values"],
                "actions_log_prob": local["log_probs"],
                "final_observations": final_obs,
                "final_values": final_values,
            }
        )

    def _on_rollout_end(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            last = self.model._last_obs  # the observations after the last step: the next rollout's first
            self._last = (last, {k: np.array(v) for k, v in _groups(last).items()})
            self.files.append(writer.close(last_values=self.locals["values"], last_observations=_groups(last)))
