"""``write_tensordict``: a TorchRL collector-layout batch as a rollout file; ``gae --timeouts final-value``
gives TorchRL's ``generalized_advantage_estimate``."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import torch
from tensordict import TensorDict
from torchrl.objectives.value.functional import generalized_advantage_estimate

from rolloutcli.record.torchrl import write_tensordict

N, T = 5, 30


def _batch(seed: int = 0) -> TensorDict:
    """A collector's ``[N, T]`` batch: next observations are the pre-reset ones at done steps."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(N, T + 1, 3, generator=g)
    ended = torch.rand(N, T, generator=g) < 0.2
    truncated = ended & (torch.rand(N, T, generator=g) < 0.5)
    terminated = ended & ~truncated
    final = torch.randn(N, T, 3, generator=g)
    next_obs = torch.where(ended[..., None], final, obs[:, 1:])
    value = lambda o: o.sum(-1, keepdim=True) * 0.3  # noqa: E731
    return TensorDict(
        {
            "observation": obs[:, :-1],
            "action": torch.randn(N, T, 2, generator=g),
            "state_value": value(obs[:, :-1]),
            "sample_log_prob": torch.randn(N, T, generator=g),
            "loc": torch.randn(N, T, 2, generator=g),
            "scale": torch.rand(N, T, 2, generator=g),
            "next": {
                "observation": next_obs,
                "reward": torch.randn(N, T, 1, generator=g),
                "done": ended[..., None],
                "terminated": terminated[..., None],
                "truncated": truncated[..., None],
                "state_value": value(next_obs),
            },
        },
        batch_size=[N, T],
    )


def test_torchrl_batch_reproduces_its_gae(tmp_path: Path, cli) -> None:
    td = _batch()
    path = write_tensordict(td, tmp_path / "trl.h5", gamma=0.99, lam=0.95)
    with h5py.File(path, "r") as handle:
        assert handle["observations/policy"].shape == (T, N, 3) and handle["time_outs"][()].any()
        np.testing.assert_array_equal(handle["rewards"][()], td["next", "reward"].squeeze(-1).T.numpy())
        assert list(handle["distribution"].attrs["order"]) == ["loc", "scale"]
        assert handle.attrs["timeouts_rule"] == "final-value"  # so plain gae applies TorchRL's rule (issue 41)
    code, _, err = cli("gae", path, "-o", tmp_path / "g.h5", "--no-normalize", "-q")
    assert code == 0, err
    adv, target = generalized_advantage_estimate(
        0.99,
        0.95,
        td["state_value"],
        td["next", "state_value"],
        td["next", "reward"],
        done=td["next", "done"],
        terminated=td["next", "terminated"],
    )
    with h5py.File(tmp_path / "g.h5", "r") as handle:
        np.testing.assert_allclose(handle["returns"][()], target.squeeze(-1).T.numpy(), rtol=0, atol=2e-5)
        np.testing.assert_allclose(handle["advantages"][()], adv.squeeze(-1).T.numpy(), rtol=0, atol=2e-5)


def test_real_collector_batch_reproduces_torchrl_gae_module(tmp_path: Path, cli) -> None:
    """A batch from TorchRL's own ``Collector`` over 3 gymnasium CartPoles (episodes cut at 15 steps by
    ``StepCounter``: truncations and terminations), valued and advantaged by TorchRL's ``GAE`` module."""
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv, SerialEnv, StepCounter, TransformedEnv
    from torchrl.objectives.value import GAE

    torch.manual_seed(0)
    env = SerialEnv(3, lambda: TransformedEnv(GymEnv("CartPole-v1"), StepCounter(max_steps=15)))
    env.set_seed(0)
    collector = Collector(env, None, frames_per_batch=150, total_frames=150)
    td = next(iter(collector))
    collector.shutdown()
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    critic = TensorDictModule(net, in_keys=["observation"], out_keys=["state_value"])
    with torch.no_grad():
        GAE(gamma=0.99, lmbda=0.95, value_network=critic)(td)  # fills state_value, ("next", state_value)
    truncated, terminated = td["next", "truncated"].squeeze(-1), td["next", "terminated"].squeeze(-1)
    assert (truncated & ~terminated).any() and terminated.any()  # both rules are exercised
    path = write_tensordict(td, tmp_path / "collector.h5", gamma=0.99, lam=0.95)
    with h5py.File(path, "r") as handle:
        assert handle["observations/policy"].shape == (50, 3, 4) and handle["actions"].shape == (50, 3, 2)
        np.testing.assert_array_equal(handle["time_outs"][()], (truncated & ~terminated).T.numpy())
        done = td["next", "done"].squeeze(-1).T.numpy()
        final = handle["final_observations/policy"][()]
        np.testing.assert_array_equal(final[done], td["next", "observation"].transpose(0, 1).numpy()[done])
    code, _, err = cli("gae", path, "-o", tmp_path / "g.h5", "--timeouts", "final-value", "--no-normalize", "-q")
    assert code == 0, err
    with h5py.File(tmp_path / "g.h5", "r") as handle:
        np.testing.assert_allclose(handle["advantages"][()], td["advantage"].squeeze(-1).T.numpy(), rtol=0, atol=2e-5)
        np.testing.assert_allclose(handle["returns"][()], td["value_target"].squeeze(-1).T.numpy(), rtol=0, atol=2e-5)


def test_consecutive_collector_batches_carry_one_recording(tmp_path: Path) -> None:
    """Two batches of one ``Collector`` written as files 0 and 1 of one recording: file 0's last observations are
    file 1's first ones, except at an env done at the batch's last step (the observation that ended its episode:
    the collector resets it after the batch)."""
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv, SerialEnv, StepCounter, TransformedEnv

    torch.manual_seed(0)
    env = SerialEnv(3, lambda: TransformedEnv(GymEnv("CartPole-v1"), StepCounter(max_steps=15)))
    env.set_seed(0)
    collector = Collector(env, None, frames_per_batch=45, total_frames=90)
    paths = [
        write_tensordict(td, tmp_path / f"rollout_{n:06d}.h5", recording_id="abc", recording_index=n)
        for n, td in enumerate(collector)
    ]
    collector.shutdown()
    assert len(paths) == 2
    with h5py.File(paths[0], "r") as first, h5py.File(paths[1], "r") as second:
        assert [dict(h.attrs)["recording_index"] for h in (first, second)] == [0, 1]
        assert first.attrs["recording_id"] == second.attrs["recording_id"] == "abc"
        last, start = first["last_observations/policy"][()], second["observations/policy"][0]
        done = first["dones"][-1].astype(bool)
        assert done.any() and not done.all()  # both cases are exercised
        np.testing.assert_array_equal(last[~done], start[~done])
        np.testing.assert_array_equal(last[done], first["final_observations/policy"][-1][done])
