"""``rolloutcli.record.gym.RecordRollouts`` on gymnasium's vector CartPole in every autoreset mode."""

from __future__ import annotations

import json
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
        assert first.attrs["timeouts_rule"] == "final-value" and first.attrs["format_version"] == 1.2
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


def test_autoreset_steps_are_no_episodes_and_no_transitions(tmp_path: Path, cli) -> None:
    """NEXT_STEP: the reset step after every episode end (dones = 1 there) is counted by no one."""
    env = RecordRollouts(_env(AutoresetMode.NEXT_STEP), tmp_path / "rec", steps_per_file=30, value_fn=_value)
    env.reset(seed=2)
    env.action_space.seed(2)
    ends = 0
    for _ in range(30):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        ends += int((np.asarray(terminated) | np.asarray(truncated)).sum())
    env.close()
    path = env.files[0]
    with h5py.File(path, "r") as handle:
        reset = handle["autoreset_steps"][()].astype(bool)
    assert reset.sum() > 0
    code, out, _ = cli("inspect", str(path), "--json")
    episodes = json.loads(out)["episodes"]
    assert code == 0 and episodes["autoreset_steps"] == int(reset.sum())
    assert episodes["completed"] == ends and episodes["lengths"]["min"] > 1  # none of one step
    code, out, _ = cli("inspect", str(path))
    assert f"{int(reset.sum())} autoreset steps (no transition: not counted as episodes)" in out
    shards = tmp_path / "shards"
    code, out, _ = cli("batch", str(path), "-o", str(shards), "--transitions", "--num-mini-batches", "2")
    assert code == 0 and f"{int(reset.sum())} autoreset steps left out" in out
    manifest = json.loads((shards / "manifest.json").read_text())
    rows = []
    for shard in manifest["shards"]:
        with h5py.File(shards / shard["file"], "r") as handle:
            rows.append(handle["index"][()])
    index = np.sort(np.concatenate(rows))
    expected = np.flatnonzero(~reset.reshape(-1))  # rows t * N + n of every real step
    np.testing.assert_array_equal(index, expected)
    assert manifest["autoreset_steps"] == int(reset.sum()) and manifest["held_back"] == 0


def test_the_steps_after_the_last_whole_file_are_published_at_close_and_reset(tmp_path: Path) -> None:
    """25 steps in files of 10, a reset, 3 more, close: files of 10, 10, 5 and 3 steps (the last 5 and 3 were
    dropped: recorded data lost without a word)."""
    env = RecordRollouts(_env(AutoresetMode.SAME_STEP), tmp_path, steps_per_file=10, value_fn=_value)
    obs, _ = env.reset(seed=3)
    env.action_space.seed(3)
    rewards, last = [], None
    for t in range(28):
        if t == 25:
            last = obs
            obs, _ = env.reset(seed=4)
        obs, reward, *_ = env.step(env.action_space.sample())
        rewards.append(reward)
    env.close()
    env.close()  # twice: nothing more
    assert [p.name for p in env.files] == [f"rollout_{i:06d}.h5" for i in range(4)]
    lengths, recorded = [], []
    for path in env.files:
        with h5py.File(path, "r") as handle:
            lengths.append(len(handle["rewards"]))
            recorded.append(handle["rewards"][()])
            if path == env.files[2]:
                np.testing.assert_array_equal(handle["last_values"][()], _value(last))
                np.testing.assert_array_equal(handle["last_observations/policy"][()], last)
    assert lengths == [10, 10, 5, 3]
    np.testing.assert_array_equal(np.concatenate(recorded), np.array(rewards, np.float32))
    assert [p.name for p in tmp_path.iterdir() if ".rolloutcli-tmp-" in p.name] == []


def test_a_folder_holding_an_earlier_recording_is_refused(tmp_path: Path) -> None:
    from rolloutcli.errors import RolloutError

    env = RecordRollouts(_env(AutoresetMode.SAME_STEP), tmp_path, steps_per_file=4)
    env.reset(seed=0)
    for _ in range(4):
        env.step(env.action_space.sample())
    env.close()
    with pytest.raises(RolloutError) as caught:
        RecordRollouts(_env(AutoresetMode.SAME_STEP), tmp_path, steps_per_file=4)
    assert str(caught.value).startswith(f"{tmp_path}: RecordRollouts writes rollout_000000.h5 on; expected no such")
    assert caught.value.exit_code == 2
