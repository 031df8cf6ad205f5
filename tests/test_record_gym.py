"""``rolloutcli.record.gym.RecordRollouts`` on gymnasium's vector CartPole in every autoreset mode."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from rolloutcli.record.gym import RecordRollouts


def _value(obs: np.ndarray) -> np.ndarray:
    return obs.sum(-1).astype(np.float32)


def _env(mode: AutoresetMode, limit: int = 7) -> gym.vector.VectorEnv:
    return gym.make_vec(
        "CartPole-v1",
        num_envs=3,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": mode},
        max_episode_steps=limit,
    )


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP])
def test_records_steps_and_final_observations(tmp_path: Path, mode: AutoresetMode) -> None:
    env = RecordRollouts(_env(mode), tmp_path, steps_per_file=10, value_fn=_value)
    seen = []
    obs, _ = env.reset(seed=1)
    env.action_space.seed(1)
    for _ in range(20):
        before = obs
        obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
        final = info["final_obs"] if "final_obs" in info else None
        seen.append((before, reward, terminated, truncated, obs, final, info.get("_final_obs")))
    env.close()
    assert [p.name for p in env.files] == ["rollout_000000.h5", "rollout_000001.h5"]
    with h5py.File(env.files[0], "r") as first, h5py.File(env.files[1], "r") as second:
        assert bool(first.attrs["recorded_from_reset"]) and first.attrs["recorder"].endswith("RecordRollouts")
        data = {
            k: np.concatenate([first[k][()], second[k][()]])
            for k in (
                "observations/policy",
                "rewards",
                "dones",
                "time_outs",
                "final_observations/policy",
                "values",
                "final_values",
            )
        }
        np.testing.assert_array_equal(first["last_values"][()], _value(seen[9][4]))
    for t, (before, reward, terminated, truncated, after, final, _mask) in enumerate(seen):
        np.testing.assert_array_equal(data["observations/policy"][t], before)
        np.testing.assert_array_equal(data["rewards"][t], reward)
        np.testing.assert_array_equal(data["time_outs"][t], truncated & ~terminated)
        np.testing.assert_array_equal(data["values"][t], _value(before))
        ended = terminated | truncated
        for n in np.flatnonzero(ended):
            expected = final[n] if mode == AutoresetMode.SAME_STEP else after[n]
            np.testing.assert_array_equal(data["final_observations/policy"][t, n], expected)
            assert data["final_values"][t, n] == _value(expected[None])[0]
        assert data["dones"][t][ended].all()
    assert data["time_outs"].any()  # the time limit was reached
    if mode == AutoresetMode.NEXT_STEP:  # the autoreset step is recorded as done and marked
        with h5py.File(env.files[0], "r") as first:
            marked = first["autoreset_steps"][()].astype(bool)
            assert marked.any() and first["dones"][()][marked].all()
