"""RolloutStorage.compute_returns calls the GAE core and equals RSL-RL's PPO on the same data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from rollout_factory import rollout_arrays, write_rollout
from test_gae_command import rsl_rl_reference

from rolloutcli import RolloutStorage


def test_compute_returns_matches_rsl_rl(tmp_path: Path) -> None:
    arrays = rollout_arrays(T=30, N=5, end_rate=0.2)
    storage = RolloutStorage.from_hdf5(write_rollout(tmp_path / "r.h5", arrays))
    storage.compute_returns(gamma=0.98, lam=0.9)
    advantages, returns = rsl_rl_reference(arrays, 0.98, 0.9)
    np.testing.assert_allclose(storage.returns.squeeze(-1).numpy(), returns.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(storage.advantages.squeeze(-1).numpy(), advantages.numpy(), rtol=1e-4, atol=1e-5)
    assert storage.attrs["timeouts_bootstrapped"] is True
    assert storage.returns.shape == (30, 5, 1)
    before = storage.returns.clone()
    storage.compute_returns(gamma=0.98, lam=0.9)  # a second call must not bootstrap again
    assert torch.equal(storage.returns, before)


def test_compute_returns_without_normalisation_or_bootstrap(tmp_path: Path) -> None:
    arrays = rollout_arrays(T=12, N=3, end_rate=0.3)
    storage = RolloutStorage.from_hdf5(write_rollout(tmp_path / "r.h5", arrays))
    storage.compute_returns(gamma=0.9, lam=0.8, normalize_advantage=False, bootstrap_time_outs=False)
    advantages, returns = rsl_rl_reference(arrays, 0.9, 0.8, bootstrap=False, normalize=False)
    np.testing.assert_allclose(storage.returns.squeeze(-1).numpy(), returns.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(storage.advantages.squeeze(-1).numpy(), advantages.numpy(), rtol=1e-5, atol=1e-5)


def test_compute_returns_needs_last_values(tmp_path: Path) -> None:
    arrays = rollout_arrays(T=5, N=2)
    arrays.pop("last_values")
    storage = RolloutStorage.from_hdf5(write_rollout(tmp_path / "r.h5", arrays))
    with pytest.raises(ValueError, match="needs last_values"):
        storage.compute_returns()
    storage.compute_returns(torch.zeros(2))
    assert torch.isfinite(storage.returns).all()


def test_compute_returns_is_rsl_rl_bit_for_bit_normalisation_included(tmp_path: Path) -> None:
    from test_gae_core import rsl_rl_gae

    arrays = rollout_arrays(T=64, N=33, end_rate=0.1, seed=11)
    storage = RolloutStorage.from_hdf5(write_rollout(tmp_path / "r.h5", arrays))
    storage.compute_returns(gamma=0.98, lam=0.9)
    tensors = [torch.from_numpy(arrays[n]) for n in ("rewards", "values", "dones", "last_values", "time_outs")]
    r, v, d, lv, to = tensors
    for normalize, ours in ((True, storage.advantages), (False, storage.returns - storage.values)):
        advantages, returns, rewards = rsl_rl_gae(r, v, d, lv, 0.98, 0.9, time_outs=to, normalize=normalize)
        assert torch.equal(storage.returns[..., 0].view(torch.int32), returns.view(torch.int32))
        assert torch.equal(ours[..., 0].view(torch.int32), advantages.view(torch.int32))
        assert torch.equal(storage.rewards[..., 0].view(torch.int32), rewards.view(torch.int32))


def test_compute_returns_refuses_to_mix_two_gammas(tmp_path: Path) -> None:
    arrays = rollout_arrays(T=10, N=3, end_rate=0.3)
    storage = RolloutStorage.from_hdf5(write_rollout(tmp_path / "r.h5", arrays))
    storage.compute_returns(gamma=0.98)
    with pytest.raises(ValueError, match=r"bootstrap with gamma 0.98; compute_returns\(gamma=0.99\) would mix"):
        storage.compute_returns(gamma=0.99)
