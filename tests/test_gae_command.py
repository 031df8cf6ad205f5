"""``rolloutcli gae`` end to end: RSL-RL's numbers, streaming, attributes, atomic and in-place outputs."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import SAMPLE
from rollout_factory import rollout_arrays, write_rollout


def rsl_rl_reference(
    arrays: dict[str, np.ndarray], gamma: float, lam: float, bootstrap: bool = True, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """RSL-RL's process_env_step time-out correction + compute_returns, transcribed step by step."""
    rewards = torch.tensor(arrays["rewards"]).reshape(arrays["rewards"].shape[:2]).float().unsqueeze(-1)
    values = torch.tensor(arrays["values"]).float().reshape(rewards.shape)
    dones = torch.tensor(arrays["dones"]).reshape(rewards.shape).byte()
    last_values = torch.tensor(arrays["last_values"]).float().reshape(-1, 1)
    if bootstrap and "time_outs" in arrays:
        time_outs = torch.tensor(arrays["time_outs"]).reshape(rewards.shape).float()
        rewards = rewards + gamma * values * time_outs
    returns = torch.zeros_like(values)
    advantage = 0
    T = rewards.shape[0]
    for step in reversed(range(T)):
        next_values = last_values if step == T - 1 else values[step + 1]
        next_is_not_terminal = 1.0 - dones[step].float()
        delta = rewards[step] + next_is_not_terminal * gamma * next_values - values[step]
        advantage = delta + next_is_not_terminal * gamma * lam * advantage
        returns[step] = advantage + values[step]
    advantages = returns - values
    if normalize:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    return advantages.squeeze(-1), returns.squeeze(-1)


def _read(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as handle:
        out = {}
        handle.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        out["__attrs__"] = dict(handle.attrs)
        return out


@pytest.mark.parametrize("normalize", [True, False])
def test_matches_rsl_rl(tmp_path: Path, cli, normalize: bool) -> None:
    arrays = rollout_arrays(T=40, N=7, end_rate=0.15)
    source = write_rollout(tmp_path / "in.h5", arrays)
    flag = "--normalize" if normalize else "--no-normalize"
    code, _, err = cli("gae", source, "-o", tmp_path / "out.h5", "--gamma", "0.97", "--lam", "0.9", flag, "-q")
    assert code == 0, err
    result = _read(tmp_path / "out.h5")
    advantages, returns = rsl_rl_reference(arrays, 0.97, 0.9, normalize=normalize)
    np.testing.assert_allclose(result["returns"], returns.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result["advantages"], advantages.numpy(), rtol=1e-4, atol=1e-5)
    attrs = result["__attrs__"]
    assert attrs["gae_gamma"] == 0.97 and attrs["gae_lambda"] == 0.9
    assert bool(attrs["advantages_normalized"]) is normalize and bool(attrs["timeouts_bootstrapped"]) is True
    assert result["advantages"].dtype == np.float32 and result["advantages"].shape == (40, 7)
    # every input dataset is carried along; rewards now hold what RSL-RL's storage holds
    for name, value in arrays.items():
        if name != "rewards":
            np.testing.assert_array_equal(result[name], value, err_msg=name)
    np.testing.assert_array_equal(result["rewards_raw"], arrays["rewards"])
    expected_rewards = arrays["rewards"] + np.float32(0.97) * arrays["values"] * arrays["time_outs"]
    np.testing.assert_allclose(result["rewards"], expected_rewards, rtol=1e-6)


def test_tiny_budget_is_bit_identical(tmp_path: Path, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=64, N=50, end_rate=0.1))
    assert cli("gae", source, "-o", tmp_path / "whole.h5", "-q")[0] == 0
    code, out, _ = cli("gae", source, "-o", tmp_path / "tiny.h5", "-q", "--max-memory", "4K", "--json")
    assert code == 0 and json.loads(out)["blocks"] > 5
    whole, tiny = _read(tmp_path / "whole.h5"), _read(tmp_path / "tiny.h5")
    for name in ("advantages", "returns", "rewards"):
        assert whole[name].tobytes() == tiny[name].tobytes(), name


def test_never_bootstraps_twice(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=30, N=4, end_rate=0.3)
    source = write_rollout(tmp_path / "in.h5", arrays)
    assert cli("gae", source, "-o", tmp_path / "once.h5", "-q")[0] == 0
    code, out, _ = cli("gae", tmp_path / "once.h5", "-o", tmp_path / "twice.h5", "--json", "-q")
    assert code == 0
    summary = json.loads(out)
    assert summary["bootstrapped_by_this_run"] is False and summary["timeouts_bootstrapped"] is True
    once, twice = _read(tmp_path / "once.h5"), _read(tmp_path / "twice.h5")
    for name in ("advantages", "returns", "rewards"):
        np.testing.assert_array_equal(once[name], twice[name])


def test_no_bootstrap_option(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=20, N=3, end_rate=0.3)
    source = write_rollout(tmp_path / "in.h5", arrays)
    assert cli("gae", source, "-o", tmp_path / "o.h5", "--no-bootstrap-timeouts", "-q")[0] == 0
    result = _read(tmp_path / "o.h5")
    _, returns = rsl_rl_reference(arrays, 0.99, 0.95, bootstrap=False)
    np.testing.assert_allclose(result["returns"], returns.numpy(), rtol=1e-5, atol=1e-5)
    assert not bool(result["__attrs__"]["timeouts_bootstrapped"]) and "rewards_raw" not in result


def test_missing_last_values(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=10, N=2)
    arrays.pop("last_values")
    source = write_rollout(tmp_path / "in.h5", arrays)
    code, out, err = cli("gae", source, "-o", tmp_path / "o.h5")
    assert code == 1 and out == ""
    assert err.strip() == (
        f"error: {source}: field 'last_values': expected a dataset [N] of V(s_T) to bootstrap "
        "the rollout end, found nothing. Record it, or pass --last-values zero to treat the end "
        "of the rollout as terminal."
    )
    assert not (tmp_path / "o.h5").exists()
    code, _, _ = cli("gae", source, "-o", tmp_path / "o.h5", "--last-values", "zero", "-q")
    assert code == 0
    arrays["last_values"] = np.zeros(2, np.float32)
    _, returns = rsl_rl_reference(arrays, 0.99, 0.95)
    result = _read(tmp_path / "o.h5")
    np.testing.assert_allclose(result["returns"], returns.numpy(), rtol=1e-5, atol=1e-5)
    assert result["__attrs__"]["last_values_mode"] == "zero"


def test_scalar_fields_with_trailing_one(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=15, N=3)
    for name in ("rewards", "values", "dones", "time_outs"):
        arrays[name] = arrays[name][..., None]
    arrays["last_values"] = arrays["last_values"][:, None]
    source = write_rollout(tmp_path / "in.h5", arrays)
    assert cli("gae", source, "-o", tmp_path / "o.h5", "-q")[0] == 0
    _, returns = rsl_rl_reference(arrays, 0.99, 0.95)
    np.testing.assert_allclose(_read(tmp_path / "o.h5")["returns"], returns.numpy(), rtol=1e-5, atol=1e-5)


def test_output_rules(tmp_path: Path, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays())
    before = source.read_bytes()
    code, _, err = cli("gae", source, "-o", source)
    assert code == 4 and "output is the input file" in err
    link = tmp_path / "link.h5"
    link.symlink_to(source)
    assert cli("gae", source, "-o", link)[0] == 4
    hard = tmp_path / "hard.h5"
    hard.hardlink_to(source)
    assert cli("gae", source, "-o", hard)[0] == 4
    assert cli("gae", source, "-o", tmp_path / "o.h5", "-q")[0] == 0
    code, _, err = cli("gae", source, "-o", tmp_path / "o.h5")
    assert code == 2
    assert (
        err.strip() == f"error: {tmp_path / 'o.h5'}: output already exists; refusing to overwrite it. Pass "
        "--overwrite to replace it."
    )
    assert cli("gae", source, "-o", tmp_path / "o.h5", "--overwrite", "-q")[0] == 0
    code, _, err = cli("gae", source, "-o", tmp_path / "missing" / "o.h5")
    assert code == 3 and "does not exist" in err
    assert source.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.h5", "in.h5", "link.h5", "o.h5"]


def test_in_place(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=25, N=3)
    source = write_rollout(tmp_path / "in.h5", arrays)
    assert cli("gae", source, "-o", tmp_path / "copy.h5", "-q")[0] == 0
    code, _, err = cli("gae", source, "--in-place", "-q")
    assert code == 0, err
    in_place, copy = _read(source), _read(tmp_path / "copy.h5")
    for name in ("advantages", "returns", "rewards", "observations/policy"):
        np.testing.assert_array_equal(in_place[name], copy[name])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.h5", "in.h5"]


def test_untouched_datasets_copied_verbatim(tmp_path: Path, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=32, N=4), compression="gzip", shuffle=True, chunks=True)
    assert cli("gae", source, "-o", tmp_path / "o.h5", "-q")[0] == 0
    with h5py.File(source, "r") as a, h5py.File(tmp_path / "o.h5", "r") as b:
        for name in ("observations/policy", "actions", "dones", "hidden_states/actor/0"):
            assert b[name].compression == "gzip" and b[name].chunks == a[name].chunks
            assert b[name].id.get_storage_size() == a[name].id.get_storage_size()


def test_sample(tmp_path: Path, cli) -> None:
    code, out, _ = cli("gae", SAMPLE, "-o", tmp_path / "g.h5", "--json", "-q")
    assert code == 0
    summary = json.loads(out)
    assert summary["bootstrapped_rewards"] == 42
    assert abs(summary["advantages"]["mean"]) < 1e-5 and abs(summary["advantages"]["std"] - 1) < 1e-4
