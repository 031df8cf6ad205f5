"""Format 1.2's consecutive recordings from real training loops: files of one recording carry one ``recording_id``
and ``recording_index`` 0, 1, ...; each file's ``last_observations`` are the next file's first observations, and
the files joined along T are the steps the loop took (``record_factory.consecutive_recordings``, an RSL-RL
``OnPolicyRunner`` whose env logs what it returned, SB3's PPO)."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from record_factory import consecutive_recordings


def _datasets(path: Path) -> dict[str, np.ndarray]:
    """Every dataset of ``path`` by its name."""
    found: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as handle:
        handle.visititems(lambda name, obj: found.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return found


def _attrs(path: Path) -> dict[str, Any]:
    with h5py.File(path, "r") as handle:
        return dict(handle.attrs)


def _check_chained(files: list[Path]) -> tuple[str, list[dict[str, np.ndarray]]]:
    """One recording_id over ``files``, indices 0, 1, ... and every env's last observations equal to the next file's
    first ones; returns the id and the files' datasets."""
    attrs, data = [_attrs(p) for p in files], [_datasets(p) for p in files]
    ids = {a["recording_id"] for a in attrs}
    assert len(ids) == 1 and [int(a["recording_index"]) for a in attrs] == list(range(len(files)))
    for before, after in itertools.pairwise(data):
        groups = [name for name in before if name.startswith("last_observations/")]
        assert groups
        for name in groups:
            first = after[name.replace("last_observations/", "observations/")][0]
            np.testing.assert_array_equal(before[name], first)
    return ids.pop(), data


@pytest.mark.parametrize(("seed", "num_envs", "steps_per_file"), [(0, 4, 16), (1, 3, 24), (2, 5, 32)])
def test_gym_consecutive_files_join_into_the_one_file(tmp_path: Path, seed: int, num_envs: int, steps_per_file: int):
    many, one = consecutive_recordings(tmp_path, files=4, steps_per_file=steps_per_file, num_envs=num_envs, seed=seed)
    assert len(many) == 4
    recording, data = _check_chained(many)
    whole = _datasets(one)
    assert _attrs(one)["recording_id"] != recording and int(_attrs(one)["recording_index"]) == 0
    per_step = [name for name in whole if not name.startswith(("last_observations/", "last_values"))]
    assert {"observations/policy", "actions", "rewards", "dones", "time_outs", "final_observations/policy"} <= set(
        per_step
    )
    for name in per_step:
        assert all(name in part for part in data)
        np.testing.assert_array_equal(np.concatenate([part[name] for part in data]), whole[name], err_msg=name)
    for name in ("last_observations/policy", "last_values"):
        np.testing.assert_array_equal(data[-1][name], whole[name])
    # the run is what the helper promises: time-outs and terminations, episodes crossing every file's end
    assert whole["time_outs"].any() and (whole["dones"] & ~whole["time_outs"]).any()
    assert all((part["dones"][-1] == 0).any() for part in data[:-1])


def test_gym_full_reset_starts_a_new_recording(tmp_path: Path) -> None:
    import gymnasium as gym

    from rolloutcli.record.gym import RecordRollouts

    env = RecordRollouts(gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync"), tmp_path, 3)
    env.reset(seed=0)
    for _ in range(5):  # a whole file, then 2 steps published by the reset
        env.step(np.zeros(2, np.int64))
    env.reset(seed=1)
    for _ in range(4):
        env.step(np.ones(2, np.int64))
    env.close()
    attrs = [_attrs(p) for p in env.files]
    assert [int(a["recording_index"]) for a in attrs] == [0, 1, 0, 1]
    assert attrs[0]["recording_id"] == attrs[1]["recording_id"] != attrs[2]["recording_id"] == attrs[3]["recording_id"]
    _check_chained(env.files[:2])
    _check_chained(env.files[2:])


def _logging_runner(every: int = 1):
    """An RSL-RL ``OnPolicyRunner`` on ``test_record_rsl_rl``'s env, which logs the observations, rewards, dones and
    time-outs it returns (the first entry: the observations before the first step)."""
    import torch
    from rsl_rl.runners import OnPolicyRunner
    from test_record_rsl_rl import FakeEnv, _config

    log: list[dict[str, np.ndarray]] = []

    class Logging(FakeEnv):
        def step(self, actions: torch.Tensor):
            obs, rewards, dones, extras = super().step(actions)
            log.append({"obs": obs["policy"].numpy().copy(), "rewards": rewards.numpy().copy(),
                        "dones": dones.numpy().copy(), "time_outs": extras["time_outs"].numpy().copy()})  # fmt: skip
            return obs, rewards, dones, extras

    torch.manual_seed(0)
    env = Logging()
    log.append({"obs": env.get_observations()["policy"].numpy().copy()})
    return OnPolicyRunner(env, copy.deepcopy(_config(False)), log_dir=None, device="cpu"), log


def test_rsl_rl_files_chain_into_the_steps_the_env_took(tmp_path: Path) -> None:
    from rolloutcli.record.rsl_rl import attach

    runner, log = _logging_runner()
    recorder = attach(runner, tmp_path / "rec")
    runner.learn(4)
    recording, data = _check_chained(recorder.files)
    steps = log[1:]
    assert len(steps) == sum(len(part["rewards"]) for part in data)
    joined = {name: np.concatenate([part[name] for part in data]) for name in ("rewards", "dones", "time_outs")}
    for name, value in joined.items():
        np.testing.assert_array_equal(value, np.stack([step[name] for step in steps]).astype(value.dtype))
    observations = np.concatenate([part["observations/policy"] for part in data])
    np.testing.assert_array_equal(observations, np.stack([entry["obs"] for entry in log[:-1]]))
    np.testing.assert_array_equal(data[-1]["last_observations/policy"], log[-1]["obs"])
    assert joined["time_outs"].any() and (joined["dones"] & ~joined["time_outs"].astype(bool)).any()
    # the same hook goes on over learn() calls; attached again (a resumed run): a new recording from index 0
    runner.learn(1)
    assert _attrs(recorder.files[-1])["recording_id"] == recording
    _check_chained(recorder.files)
    recorder.detach()
    again = attach(runner, tmp_path / "rec")
    runner.learn(2)
    attrs = [_attrs(p) for p in again.files]
    assert [int(a["recording_index"]) for a in attrs] == [0, 1]
    assert attrs[0]["recording_id"] == attrs[1]["recording_id"] != recording


def test_rsl_rl_every_other_iteration_writes_no_recording_attributes(tmp_path: Path) -> None:
    from rolloutcli.record.rsl_rl import attach

    runner, _ = _logging_runner()
    recorder = attach(runner, tmp_path / "rec", every=2)
    runner.learn(3)
    assert len(recorder.files) == 2
    for path in recorder.files:
        attrs = _attrs(path)
        assert "recording_id" not in attrs and "recording_index" not in attrs


def test_sb3_rollouts_chain_and_a_reset_starts_a_new_recording(tmp_path: Path) -> None:
    pytest.importorskip("stable_baselines3")
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    from rolloutcli.record.sb3 import RolloutRecorderCallback

    env = make_vec_env("CartPole-v1", n_envs=3, seed=0, env_kwargs={"max_episode_steps": 20})
    model = PPO("MlpPolicy", env, n_steps=16, batch_size=48, n_epochs=1, seed=0, device="cpu")
    callback = RolloutRecorderCallback(tmp_path / "rec")
    model.learn(total_timesteps=3 * 16 * 3, callback=callback)
    model.learn(total_timesteps=16 * 3, callback=callback, reset_num_timesteps=False)  # goes on
    first, data = _check_chained(callback.files)
    assert len(data) == 4 and any((part["dones"][-1] == 0).any() for part in data[:-1])
    model.learn(total_timesteps=2 * 16 * 3, callback=callback)  # reset_num_timesteps: SB3 resets the envs
    attrs = [_attrs(p) for p in callback.files[4:]]
    assert [int(a["recording_index"]) for a in attrs] == [0, 1] and attrs[0]["recording_id"] != first
    _check_chained(callback.files[4:])
