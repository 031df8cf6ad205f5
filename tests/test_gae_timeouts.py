"""``gae --timeouts rsl|final-value|proper|ignore`` against independent references: SB3's
``RolloutBuffer.compute_returns_and_advantage``, TorchRL's ``generalized_advantage_estimate`` and a loop
transcribed from ikostrikov's ``RolloutStorage.compute_returns`` (``use_gae``, ``use_proper_time_limits``)."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
import torch
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.core import native
from rolloutcli.core.gae_numpy import gae_arrays
from rolloutcli.core.timeouts import apply_timeouts

GAMMA, LAM = 0.99, 0.95  # float32(gamma * lam) is the product of the float32s: the libraries' order agrees


def _arrays(seed: int = 3, T: int = 40, N: int = 7) -> dict[str, np.ndarray]:
    arrays = rollout_arrays(T=T, N=N, end_rate=0.25, seed=seed, time_out_rate=0.5)
    final = np.random.default_rng(seed + 1).standard_normal((T, N)).astype(np.float32)
    final[arrays["dones"] == 0] = np.nan  # undefined where no episode ended
    arrays["final_values"] = final
    return arrays


def _gae(cli, tmp_path: Path, arrays: dict[str, np.ndarray], *flags: str) -> dict:
    source = write_rollout(tmp_path / "in.h5", arrays)
    out = tmp_path / "out.h5"
    code, text, err = cli("gae", source, "-o", out, "--no-normalize", "--overwrite", "--json", "-q", *flags)
    assert code == 0, err
    with h5py.File(out, "r") as handle:
        result = {name: handle[name][()] for name in ("advantages", "returns", "rewards")}
        result["attrs"] = dict(handle.attrs)
    result["summary"] = json.loads(text)
    return result


def _sb3_returns(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """SB3's time-out bootstrap (``collect_rollouts``) then its buffer's GAE."""
    from stable_baselines3.common.buffers import RolloutBuffer

    T, N = arrays["rewards"].shape
    buffer = RolloutBuffer(T, gym.spaces.Box(-1, 1, (1,)), gym.spaces.Discrete(2), "cpu", LAM, GAMMA, N)
    dones, time_outs = arrays["dones"], arrays["time_outs"]
    for t in range(T):
        rewards = arrays["rewards"][t].copy()
        for idx in np.flatnonzero(time_outs[t]):
            rewards[idx] += GAMMA * torch.tensor(arrays["final_values"][t, idx])
        starts = np.ones(N, np.float32) if t == 0 else dones[t - 1].astype(np.float32)
        values = torch.tensor(arrays["values"][t])
        buffer.add(np.zeros((N, 1)), np.zeros((N, 1)), rewards, starts, values, torch.zeros(N))
    buffer.compute_returns_and_advantage(torch.tensor(arrays["last_values"]), dones[-1].astype(bool))
    return buffer.advantages, buffer.returns


def test_final_value_matches_sb3(tmp_path: Path, cli) -> None:
    arrays = _arrays()
    result = _gae(cli, tmp_path, arrays, "--gamma", str(GAMMA), "--lam", str(LAM), "--timeouts", "final-value")
    advantages, returns = _sb3_returns(arrays)
    assert result["returns"].tobytes() == returns.astype(np.float32).tobytes()
    np.testing.assert_allclose(result["advantages"], advantages, rtol=0, atol=1e-5)
    assert result["attrs"]["gae_timeouts"] == "final-value" and result["summary"]["timeouts"] == "final-value"
    assert bool(result["attrs"]["timeouts_bootstrapped"])


def test_final_value_matches_torchrl(tmp_path: Path, cli) -> None:
    from torchrl.objectives.value.functional import generalized_advantage_estimate

    arrays = _arrays(seed=5)
    result = _gae(cli, tmp_path, arrays, "--gamma", str(GAMMA), "--lam", str(LAM), "--timeouts", "final-value")
    T = arrays["rewards"].shape[0]
    values = torch.tensor(arrays["values"])
    nxt = torch.cat([values[1:], torch.tensor(arrays["last_values"])[None]])
    ended = torch.tensor(arrays["dones"] != 0)
    time_outs = torch.tensor(arrays["time_outs"] != 0)
    final = torch.nan_to_num(torch.tensor(arrays["final_values"]))
    nxt = torch.where(ended, final, nxt)  # TorchRL's ("next", value) is V of the observation before the reset
    terminated = ended & ~time_outs
    as_ntf = [x.T.unsqueeze(-1) for x in (values, nxt, torch.tensor(arrays["rewards"]), ended, terminated)]
    adv, target = generalized_advantage_estimate(GAMMA, LAM, *as_ntf[:3], done=as_ntf[3], terminated=as_ntf[4])
    assert target.shape == (arrays["rewards"].shape[1], T, 1)
    np.testing.assert_allclose(result["returns"], target.squeeze(-1).T.numpy(), rtol=0, atol=2e-5)
    np.testing.assert_allclose(result["advantages"], adv.squeeze(-1).T.numpy(), rtol=0, atol=2e-5)


def _ikostrikov(arrays: dict[str, np.ndarray]) -> torch.Tensor:
    """ikostrikov/pytorch-a2c-ppo-acktr-gail ``RolloutStorage.compute_returns`` (use_gae, proper time limits)."""
    T, N = arrays["rewards"].shape
    rewards = torch.tensor(arrays["rewards"]).unsqueeze(-1)
    value_preds = torch.zeros(T + 1, N, 1)
    value_preds[:T] = torch.tensor(arrays["values"]).unsqueeze(-1)
    masks, bad_masks = torch.ones(T + 1, N, 1), torch.ones(T + 1, N, 1)
    masks[1:] = 1.0 - torch.tensor(arrays["dones"] | arrays["time_outs"]).float().unsqueeze(-1)
    bad_masks[1:] = 1.0 - torch.tensor(arrays["time_outs"]).float().unsqueeze(-1)
    returns = torch.zeros(T + 1, N, 1)
    value_preds[-1] = torch.tensor(arrays["last_values"]).unsqueeze(-1)
    gae = 0
    for step in reversed(range(T)):
        delta = rewards[step] + GAMMA * value_preds[step + 1] * masks[step + 1] - value_preds[step]
        gae = delta + GAMMA * LAM * masks[step + 1] * gae
        gae = gae * bad_masks[step + 1]
        returns[step] = gae + value_preds[step]
    return returns[:T].squeeze(-1)


def test_proper_matches_ikostrikov(tmp_path: Path, cli) -> None:
    arrays = _arrays(seed=11)
    result = _gae(cli, tmp_path, arrays, "--gamma", str(GAMMA), "--lam", str(LAM), "--timeouts", "proper")
    assert result["returns"].tobytes() == _ikostrikov(arrays).numpy().tobytes()
    hit = arrays["time_outs"] != 0
    assert hit.any() and (result["advantages"][hit] == 0).all()
    np.testing.assert_array_equal(result["rewards"], arrays["rewards"])  # proper never changes the rewards
    assert result["attrs"]["gae_timeouts"] == "proper" and not bool(result["attrs"]["timeouts_bootstrapped"])


@pytest.mark.parametrize(("flag", "rule"), [("--bootstrap-timeouts", "rsl"), ("--no-bootstrap-timeouts", "ignore")])
def test_old_flags_are_aliases(tmp_path: Path, cli, flag: str, rule: str) -> None:
    arrays = _arrays(seed=2)
    old = _gae(cli, tmp_path, arrays, flag)
    new = _gae(cli, tmp_path, arrays, "--timeouts", rule)
    for name in ("advantages", "returns", "rewards"):
        assert old[name].tobytes() == new[name].tobytes()
    assert old["attrs"]["gae_timeouts"] == rule


def test_ignore_treats_time_outs_as_terminations(tmp_path: Path, cli) -> None:
    arrays = _arrays(seed=4)
    result = _gae(cli, tmp_path, arrays, "--timeouts", "ignore")
    ended = (arrays["dones"] | arrays["time_outs"]).astype(np.uint8)
    _, returns = gae_arrays(arrays["rewards"], arrays["values"], ended, arrays["last_values"], 0.99, 0.95)
    assert result["returns"].tobytes() == returns.tobytes()


def test_rules_switch_from_raw_rewards(tmp_path: Path, cli) -> None:
    """A file bootstrapped under one rule is recomputed from rewards_raw under another, never stacked."""
    arrays = _arrays(seed=8)
    rsl = write_rollout(tmp_path / "src.h5", arrays)
    assert cli("gae", rsl, "-o", tmp_path / "rsl.h5", "-q")[0] == 0
    for rule in ("final-value", "proper", "ignore"):
        fresh = _gae(cli, tmp_path, arrays, "--timeouts", rule)
        code, _, err = cli(
            "gae", tmp_path / "rsl.h5", "-o", tmp_path / f"{rule}.h5", "--no-normalize", "-q", "--timeouts", rule
        )
        assert code == 0, err
        with h5py.File(tmp_path / f"{rule}.h5", "r") as handle:
            assert handle["returns"][()].tobytes() == fresh["returns"].tobytes(), rule


def test_final_value_without_final_values(tmp_path: Path, cli) -> None:
    arrays = _arrays()
    arrays.pop("final_values")
    source = write_rollout(tmp_path / "in.h5", arrays)
    code, _, err = cli("gae", source, "-o", tmp_path / "o.h5", "--timeouts", "final-value")
    assert code == 1
    assert f"{source}: field 'final_values': expected a dataset [T, N] of V(final observation)" in err
    assert not (tmp_path / "o.h5").exists()


def test_both_options_are_a_usage_error(tmp_path: Path, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", _arrays())
    code, _, err = cli("gae", source, "-o", tmp_path / "o.h5", "--timeouts", "rsl", "--no-bootstrap-timeouts")
    assert code == 2 and "expected either --timeouts or --[no-]bootstrap-timeouts" in err


@pytest.mark.parametrize("rule", ["rsl", "final-value", "proper", "ignore"])
def test_rules_bit_exact_without_the_c_kernel(rule: str, monkeypatch) -> None:
    arrays = _arrays(seed=9, T=33, N=37)
    r, d = apply_timeouts(
        rule, arrays["rewards"], arrays["values"], arrays["dones"], arrays["time_outs"], GAMMA, arrays["final_values"]
    )
    r = np.ascontiguousarray(r, np.float32)
    compiled = gae_arrays(r, arrays["values"], d, arrays["last_values"], GAMMA, LAM)
    monkeypatch.setattr(native, "library", lambda: None)
    fallback = gae_arrays(r, arrays["values"], d, arrays["last_values"], GAMMA, LAM)
    for a, b in zip(compiled, fallback, strict=True):
        assert a.tobytes() == b.tobytes()
    assert not np.isnan(r).any()  # undefined final values never leak
