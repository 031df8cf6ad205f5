"""Tiny recordings by every recorder of ``rolloutcli.record``, for the ``RECORDERS`` table of ``promises.py``.

Each ``record_*(folder, nan_at=None, fail_at=None)`` runs a small training loop of ``N`` envs for ``FILES``
files of ``T`` steps into ``folder`` (``rollout_000000.h5``, ...) the way its docs show, and returns the files
published. The loop counts the env steps it takes, from 0 over all files: ``nan_at=(step, env)`` makes that
env's reward NaN at that step; ``fail_at=step`` raises :class:`Boom` there (as a crashing simulator or a Ctrl-C
would). The trainers' libraries are imported inside each function, so the table costs nothing to import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

N, T, FILES = 3, 4, 2


class Boom(RuntimeError):
    """The exception a training loop raises mid-recording."""


class Injector:
    """Counts env steps; edits a step's rewards (NaN at ``nan_at``) or raises :class:`Boom` at ``fail_at``."""

    def __init__(self, nan_at: tuple[int, int] | None, fail_at: int | None) -> None:
        self.nan_at, self.fail_at, self.step = nan_at, fail_at, 0

    def __call__(self, rewards: Any) -> Any:
        step, self.step = self.step, self.step + 1
        if step == self.fail_at:
            raise Boom(f"the training loop failed at step {step}")
        if self.nan_at is not None and step == self.nan_at[0]:
            rewards = rewards.clone() if hasattr(rewards, "clone") else np.array(rewards, np.float32)
            rewards[self.nan_at[1]] = float("nan")
        return rewards


def record_writer(folder: Path, nan_at: tuple[int, int] | None = None, fail_at: int | None = None) -> list[Path]:
    """A plain loop: one ``RolloutWriter`` per file, used as a context manager (an exception discards it), the files
    one consecutive recording (each ends with the observations the next starts from)."""
    import uuid

    import torch

    from rolloutcli.record import RolloutWriter

    inject, files, generator = Injector(nan_at, fail_at), [], torch.Generator().manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    recording, obs = uuid.uuid4().hex, torch.randn(N, 3, generator=generator)
    for n in range(FILES):
        path = folder / f"rollout_{n:06d}.h5"
        with RolloutWriter(path, N, T, gamma=0.99, recording_id=recording, recording_index=n) as writer:
            for _ in range(T):
                done = torch.rand(N, generator=generator) < 0.3
                writer.add({
                    "observations": {"policy": obs},
                    "actions": torch.randn(N, 2, generator=generator),
                    "rewards": inject(torch.randn(N, generator=generator)),
                    "dones": done, "time_outs": done & (torch.rand(N, generator=generator) < 0.5),
                    "values": torch.randn(N, generator=generator),
                })  # fmt: skip
                obs = torch.randn(N, 3, generator=generator)
            files.append(writer.close(last_values=torch.zeros(N), last_observations={"policy": obs}))
    return files


def record_rsl_rl(folder: Path, nan_at: tuple[int, int] | None = None, fail_at: int | None = None) -> list[Path]:
    """RSL-RL's ``OnPolicyRunner`` (an MLP PPO) on a fake VecEnv, hooked by ``attach``."""
    import torch
    from rsl_rl.runners import OnPolicyRunner
    from tensordict import TensorDict

    from rolloutcli.record.rsl_rl import attach

    inject = Injector(nan_at, fail_at)

    class Env:  # as docs/recording.md's stand-in for an Isaac Lab VecEnv
        num_envs, num_actions, max_episode_length, device, cfg = N, 2, 3, "cpu", {}
        episode_length_buf = torch.zeros(N)
        generator = torch.Generator().manual_seed(0)

        def get_observations(self) -> TensorDict:
            return TensorDict({"policy": torch.randn(N, 3, generator=self.generator)}, batch_size=[N])

        def step(self, actions: torch.Tensor) -> tuple[Any, ...]:
            rewards = inject(-actions.detach().pow(2).sum(-1))
            ended = torch.rand(N, generator=self.generator) < 0.3
            time_outs = ended & (torch.rand(N, generator=self.generator) < 0.5)
            return self.get_observations(), rewards, ended.long(), {"time_outs": time_outs}

    torch.manual_seed(0)
    net = {"class_name": "MLPModel", "hidden_dims": [8]}
    cfg = {
        "num_steps_per_env": T, "obs_groups": {"actor": ["policy"], "critic": ["policy"]}, "multi_gpu": None,
        "algorithm": {"class_name": "PPO", "num_learning_epochs": 1, "num_mini_batches": 1},
        "critic": net, "actor": {**net, "distribution_cfg": {"class_name": "GaussianDistribution"}},
        "check_for_nan": False,  # RSL-RL's own NaN check (not its Inf) would refuse the step before the hook sees it
    }  # fmt: skip
    runner = OnPolicyRunner(Env(), cfg, log_dir=None, device="cpu")
    recorder = attach(runner, folder)
    runner.learn(FILES)
    return recorder.files


def record_gym(folder: Path, nan_at: tuple[int, int] | None = None, fail_at: int | None = None) -> list[Path]:
    """gymnasium's vector CartPole wrapped by ``RecordRollouts`` (closed in a ``finally``, as envs are)."""
    import gymnasium as gym

    from rolloutcli.record.gym import RecordRollouts

    inject = Injector(nan_at, fail_at)

    class Inject(gym.vector.VectorWrapper):
        def step(self, actions: Any) -> tuple[Any, ...]:
            obs, rewards, terminated, truncated, info = self.env.step(actions)
            return obs, inject(rewards), terminated, truncated, info

    inner = gym.make_vec("CartPole-v1", num_envs=N, vectorization_mode="sync", max_episode_steps=3)
    env = RecordRollouts(Inject(inner), folder, steps_per_file=T, value_fn=lambda obs: obs.sum(-1), gamma=0.99)
    try:
        env.reset(seed=0)
        env.action_space.seed(0)
        for _ in range(FILES * T):
            env.step(env.action_space.sample())
    finally:
        env.close()
    return env.files


def record_sb3(folder: Path, nan_at: tuple[int, int] | None = None, fail_at: int | None = None) -> list[Path]:
    """SB3's PPO on a vector CartPole with ``RolloutRecorderCallback``."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecEnvWrapper

    from rolloutcli.record.sb3 import RolloutRecorderCallback

    inject = Injector(nan_at, fail_at)

    class Inject(VecEnvWrapper):
        def reset(self) -> Any:
            return self.venv.reset()

        def step_wait(self) -> tuple[Any, ...]:
            obs, rewards, dones, infos = self.venv.step_wait()
            return obs, inject(rewards), dones, infos

    env = Inject(make_vec_env("CartPole-v1", n_envs=N, seed=0, env_kwargs={"max_episode_steps": 3}))
    model = PPO("MlpPolicy", env, n_steps=T, batch_size=N * T, n_epochs=1, seed=0, device="cpu")
    callback = RolloutRecorderCallback(folder)
    model.learn(total_timesteps=FILES * T * N, callback=callback)
    return callback.files


def record_torchrl(folder: Path, nan_at: tuple[int, int] | None = None, fail_at: int | None = None) -> list[Path]:
    """``write_tensordict`` of a collector-layout ``[N, T]`` batch per file, each starting where the last stopped
    (one recording); ``fail_at`` raises while the batch's step is being written (in ``RolloutWriter.add``:
    TorchRL's loop has no env step inside the call)."""
    from unittest import mock

    import torch
    from tensordict import TensorDict

    import rolloutcli.record.torchrl as adapter

    inject, files, generator = Injector(nan_at, None), [], torch.Generator().manual_seed(0)

    class Failing(adapter.RolloutWriter):
        def add(self, step: Any) -> None:
            if inject.step - T + self.steps == fail_at:  # the batch's steps were counted as it was made
                raise Boom(f"the training loop failed at step {fail_at}")
            super().add(step)

    folder.mkdir(parents=True, exist_ok=True)

    last = torch.randn(N, 1, 3, generator=generator)
    for n in range(FILES):
        obs = torch.cat([last, torch.randn(N, T, 3, generator=generator)], 1)
        last = obs[:, -1:]
        ended = torch.rand(N, T, generator=generator) < 0.3
        truncated = ended & (torch.rand(N, T, generator=generator) < 0.5)
        rewards = torch.stack([inject(torch.randn(N, generator=generator)) for _ in range(T)], 1)
        td = TensorDict({
            "observation": obs[:, :-1], "action": torch.randn(N, T, 2, generator=generator),
            "state_value": obs[:, :-1].sum(-1, keepdim=True),
            "next": {"observation": obs[:, 1:], "reward": rewards[..., None], "done": ended[..., None],
                     "terminated": (ended & ~truncated)[..., None], "truncated": truncated[..., None],
                     "state_value": obs[:, 1:].sum(-1, keepdim=True)},
        }, batch_size=[N, T])  # fmt: skip
        with mock.patch.object(adapter, "RolloutWriter", Failing):
            path = folder / f"rollout_{n:06d}.h5"
            files.append(
                adapter.write_tensordict(td, path, gamma=0.99, lam=0.95, recording_id="torchrl", recording_index=n)
            )
    return files


def _cartpole_run(folder: Path, steps: int, steps_per_file: int, num_envs: int, seed: int) -> list[Path]:
    """``steps`` steps of a vector CartPole (sync, 32-step time limit) recorded by ``RecordRollouts`` into files of
    ``steps_per_file`` steps. The policy balances the pole, but takes the other action half of the time, drawn from
    its own generator seeded with ``seed``: episodes of 10-32 steps, some ended by the time limit."""
    import gymnasium as gym

    from rolloutcli.record.gym import RecordRollouts

    inner = gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync", max_episode_steps=32)
    env = RecordRollouts(inner, folder, steps_per_file=steps_per_file, value_fn=lambda obs: obs.sum(-1), gamma=0.99)
    generator = np.random.default_rng(seed)
    try:
        obs, _ = env.reset(seed=seed)
        for _ in range(steps):
            balance = obs[:, 2] + 0.5 * obs[:, 3] > 0
            obs = env.step(np.where(generator.random(num_envs) < 0.5, ~balance, balance).astype(np.int64))[0]
    finally:
        env.close()
    return env.files


def consecutive_recordings(
    folder: Path, files: int, steps_per_file: int, num_envs: int, seed: int
) -> tuple[list[Path], Path]:
    """One run recorded twice: as ``files`` consecutive files of ``steps_per_file`` steps (``folder/many``: one
    ``recording_id``, ``recording_index`` 0, 1, ...) and as one file of all its steps (``folder/one``). Episodes
    (10-32 steps) cross the files' ends, so use ``steps_per_file`` of about 16-32 to have some that do."""
    many = _cartpole_run(folder / "many", files * steps_per_file, steps_per_file, num_envs, seed)
    (one,) = _cartpole_run(folder / "one", files * steps_per_file, files * steps_per_file, num_envs, seed)
    return many, one
