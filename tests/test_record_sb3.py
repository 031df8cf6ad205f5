"""``RolloutRecorderCallback`` on a real SB3 PPO run: ``gae --timeouts final-value`` gives SB3's returns."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
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


@pytest.mark.parametrize(("gamma", "lam", "bitwise"), [(0.99, 0.95, True), (0.99, 0.92, False), (0.9, 0.9, False)])
def test_sb3_returns_are_bitwise_where_gamma_lambda_rounds_alike(gamma: float, lam: float, bitwise: bool) -> None:
    """What the sb3 module's docstring says (issue 41.8): SB3 rounds gamma * gae_lambda once (a float64 product),
    RSL-RL's GAE (``rolloutcli gae``) rounds each to float32 first; the returns are equal bit for bit exactly when
    the two coefficients are, and within float32 rounding otherwise."""
    import torch
    from gymnasium import spaces
    from stable_baselines3.common.buffers import RolloutBuffer

    from rolloutcli import compute_gae

    T, N = 64, 4
    rng = np.random.default_rng(0)
    buffer = RolloutBuffer(T, spaces.Box(-1, 1, (2,)), spaces.Discrete(2), "cpu", lam, gamma, N)
    buffer.rewards[:] = rng.standard_normal((T, N), dtype=np.float32)
    buffer.values[:] = rng.standard_normal((T, N), dtype=np.float32)
    dones = (rng.random((T, N)) < 0.05).astype(np.float32)
    buffer.episode_starts[1:] = dones[:-1]  # SB3 stores "the previous step ended an episode"
    last_values = rng.standard_normal(N, dtype=np.float32)
    buffer.compute_returns_and_advantage(torch.from_numpy(last_values), dones[-1])
    as_t = torch.from_numpy
    _, returns = compute_gae(
        as_t(buffer.rewards), as_t(buffer.values), as_t(dones), as_t(last_values), gamma=gamma, lam=lam
    )
    coefficients_agree = np.float32(gamma * lam) == np.float32(np.float32(gamma) * np.float32(lam))
    assert coefficients_agree == bitwise
    assert (returns.numpy().tobytes() == buffer.returns.tobytes()) == bitwise
    np.testing.assert_allclose(returns.numpy(), buffer.returns, rtol=1e-5, atol=1e-5)
