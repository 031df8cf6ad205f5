"""``RolloutRecorderCallback`` on a real SB3 PPO run: ``gae --timeouts final-value`` gives SB3's returns."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback, CallbackList
from stable_baselines3.common.env_util import make_vec_env

from rolloutcli.record.sb3 import RolloutRecorderCallback


class Capture(BaseCallback):
    def __init__(self) -> None:
        super().__init__()
        self.buffers: list[tuple[np.ndarray, np.ndarray]] = []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        buffer = self.model.rollout_buffer
        self.buffers.append((buffer.returns.copy(), buffer.advantages.copy()))


def test_sb3_rollouts_reproduce_its_gae(tmp_path: Path, cli) -> None:
    env = make_vec_env("CartPole-v1", n_envs=4, seed=0, env_kwargs={"max_episode_steps": 9})
    model = PPO("MlpPolicy", env, n_steps=32, batch_size=64, n_epochs=1, seed=0, device="cpu")
    recorder, capture = RolloutRecorderCallback(tmp_path / "rec"), Capture()
    model.learn(total_timesteps=256, callback=CallbackList([recorder, capture]))
    assert len(recorder.files) == 2
    for path, (returns, advantages) in zip(recorder.files, capture.buffers, strict=True):
        with h5py.File(path, "r") as handle:
            assert handle["time_outs"][()].any() and handle.attrs["gamma"] == model.gamma
            assert handle.attrs["timeouts_rule"] == "final-value"  # so plain gae applies SB3's rule (issue 41)
        out = tmp_path / f"{path.stem}_gae.h5"
        flags = ("--gamma", str(model.gamma), "--lam", str(model.gae_lambda), "--no-normalize", "-q")
        code, _, err = cli("gae", path, "-o", out, *flags)
        assert code == 0, err
        with h5py.File(out, "r") as handle:
            assert handle["returns"][()].tobytes() == returns.tobytes()
            np.testing.assert_allclose(handle["advantages"][()], advantages, rtol=0, atol=1e-5)
