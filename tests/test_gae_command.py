"""``rolloutcli gae`` end to end: RSL-RL's numbers, streaming, attributes, atomic and in-place outputs."""

from __future__ import annotations

import json
import os
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


# ----------------------------------------------------------------------------------------------------------------
# RSL-RL's bits, exact statistics, and what a re-run may not mix
# ----------------------------------------------------------------------------------------------------------------


def _rsl_rl(arrays: dict[str, np.ndarray], gamma: float, lam: float) -> tuple[torch.Tensor, ...]:
    """RSL-RL's real PPO.process_env_step + compute_returns on the file's arrays: (advantages, returns, rewards)."""
    from test_gae_core import rsl_rl_gae

    shape = arrays["values"].shape[:2]
    rewards = torch.from_numpy(arrays["rewards"].reshape(shape))
    tensors = [torch.from_numpy(arrays[n].reshape(shape)) for n in ("values", "dones", "time_outs")]
    last_values = torch.from_numpy(arrays["last_values"])
    return rsl_rl_gae(rewards, tensors[0], tensors[1], last_values, gamma, lam, time_outs=tensors[2])


def _bits(x: np.ndarray | torch.Tensor) -> bytes:
    return np.ascontiguousarray(np.asarray(x, np.float32)).tobytes()


@pytest.mark.parametrize("rewards_dtype", [np.float32, np.float64])
def test_unnormalised_output_is_rsl_rl_bits(tmp_path: Path, cli, rewards_dtype) -> None:
    arrays = rollout_arrays(T=40, N=7, end_rate=0.15, seed=3)
    arrays["rewards"] = arrays["rewards"].astype(rewards_dtype) * rewards_dtype(1 + 1e-9)
    source = write_rollout(tmp_path / "in.h5", arrays)
    assert cli("gae", source, "-o", tmp_path / "o.h5", "--gamma", "0.97", "--no-normalize", "-q")[0] == 0
    result = _read(tmp_path / "o.h5")
    advantages, returns, rewards = _rsl_rl(arrays, 0.97, 0.95)
    assert _bits(result["returns"]) == _bits(returns) and _bits(result["advantages"]) == _bits(advantages)
    assert _bits(result["rewards"]) == _bits(rewards)  # float64 rewards bootstrapped in float64, then rounded
    assert result["rewards_raw"].dtype == rewards_dtype
    assert "advantages_normalization" not in result["__attrs__"]


def test_normalisation_uses_exactly_rounded_statistics(tmp_path: Path, cli) -> None:
    from fractions import Fraction

    arrays = rollout_arrays(T=50, N=9, end_rate=0.1, seed=4)
    source = write_rollout(tmp_path / "in.h5", arrays)
    assert cli("gae", source, "-o", tmp_path / "o.h5", "-q")[0] == 0
    result = _read(tmp_path / "o.h5")
    raw, _, _ = _rsl_rl(arrays, 0.99, 0.95)
    exact = [Fraction(float(x)) for x in raw.reshape(-1).tolist()]
    mean = sum(exact) / len(exact)
    std = float(sum((x - mean) ** 2 for x in exact) / (len(exact) - 1)) ** 0.5
    attrs = result["__attrs__"]
    assert attrs["advantages_normalization"] == "exact" and attrs["advantages_raw_mean"] == float(mean)
    assert attrs["advantages_raw_std"] == pytest.approx(std, rel=1e-15)
    expected = (raw - np.float32(float(mean))) / (np.float32(attrs["advantages_raw_std"]) + np.float32(1e-8))
    assert _bits(result["advantages"]) == _bits(expected)


def test_single_step_single_env_normalises_to_nan_like_the_library(tmp_path: Path, cli) -> None:
    from rolloutcli import RolloutStorage

    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=1, N=1, seed=5))
    code, out, _ = cli("gae", source, "-o", tmp_path / "o.h5", "--json", "-q")
    assert code == 0
    assert np.isnan(_read(tmp_path / "o.h5")["advantages"]).all()
    assert json.loads(out)["advantages_raw_std"] is None
    storage = RolloutStorage.from_hdf5(source)
    storage.compute_returns()
    assert torch.isnan(storage.advantages).all()


def test_summary_is_the_same_with_many_env_blocks(tmp_path: Path, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=8, N=8, end_rate=0.2, seed=6))
    summaries = []
    for budget in ("1G", "1K"):
        code, out, _ = cli("gae", source, "-o", tmp_path / f"{budget}.h5", "--max-memory", budget, "--json", "-q")
        assert code == 0
        summaries.append(json.loads(out))
    assert summaries[0]["blocks"] == 1 and summaries[1]["blocks"] > 1
    for key in ("advantages", "returns", "advantages_raw_mean", "advantages_raw_std"):
        assert summaries[0][key] == summaries[1][key], key
    assert summaries[1]["advantages"]["count"] == 64 and abs(summaries[1]["advantages"]["std"] - 1) < 1e-6


def test_rerun_with_another_gamma_recomputes_from_raw_rewards(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=30, N=6, end_rate=0.3, seed=7)
    source = write_rollout(tmp_path / "in.h5", arrays)
    assert cli("gae", source, "-o", tmp_path / "g98.h5", "--gamma", "0.98", "-q")[0] == 0
    assert cli("gae", tmp_path / "g98.h5", "-o", tmp_path / "again.h5", "--gamma", "0.99", "-q")[0] == 0
    assert cli("gae", source, "-o", tmp_path / "fresh.h5", "--gamma", "0.99", "-q")[0] == 0
    again, fresh = _read(tmp_path / "again.h5"), _read(tmp_path / "fresh.h5")
    for name in ("advantages", "returns", "rewards", "rewards_raw"):
        assert again[name].tobytes() == fresh[name].tobytes(), name
    assert again["__attrs__"]["gae_gamma"] == 0.99
    # --no-bootstrap-timeouts undoes the earlier bootstrap: the raw rewards are the rewards again
    flags = ("--gamma", "0.99", "--no-bootstrap-timeouts", "-q")
    assert cli("gae", tmp_path / "g98.h5", "-o", tmp_path / "plain.h5", *flags)[0] == 0
    assert cli("gae", source, "-o", tmp_path / "plain_fresh.h5", *flags)[0] == 0
    plain, plain_fresh = _read(tmp_path / "plain.h5"), _read(tmp_path / "plain_fresh.h5")
    assert "rewards_raw" not in plain and not plain["__attrs__"]["timeouts_bootstrapped"]
    for name in ("advantages", "returns", "rewards"):
        assert plain[name].tobytes() == plain_fresh[name].tobytes(), name


def test_rerun_with_another_gamma_without_raw_rewards_is_refused(tmp_path: Path, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=10, N=3, end_rate=0.3))
    assert cli("gae", source, "-o", tmp_path / "g98.h5", "--gamma", "0.98", "-q")[0] == 0
    with h5py.File(tmp_path / "g98.h5", "r+") as handle:
        del handle["rewards_raw"]
    code, _, err = cli("gae", tmp_path / "g98.h5", "-o", tmp_path / "o.h5", "--gamma", "0.99")
    assert code == 1 and not (tmp_path / "o.h5").exists()
    assert err.strip() == (
        f"error: {tmp_path / 'g98.h5'}: field 'rewards_raw': expected the raw rewards to bootstrap with --gamma "
        "0.99 (the rewards hold a time-out bootstrap with gae_gamma 0.98), found nothing. Pass --gamma 0.98, or "
        "run gae on the recording with its raw rewards."
    )
    assert cli("gae", tmp_path / "g98.h5", "-o", tmp_path / "o.h5", "--gamma", "0.98", "-q")[0] == 0
    with h5py.File(tmp_path / "g98.h5", "r+") as handle:
        handle["rewards_raw"] = np.zeros(10, np.float32)  # not rewards of shape [T, N]
    code, _, err = cli("gae", tmp_path / "g98.h5", "-o", tmp_path / "o2.h5", "--gamma", "0.99")
    assert code == 1 and not (tmp_path / "o2.h5").exists()
    assert err.strip() == (
        f"error: {tmp_path / 'g98.h5'}: field 'rewards_raw': expected float raw rewards of the shape of rewards "
        "[10, 3], found float32 [10]. Store the recorded rewards there, or run gae on the recording."
    )


@pytest.mark.parametrize(("value", "shown"), [("false", "'false'"), ([False], "[False]"), (2, "2"), (0.5, "0.5")])
def test_timeouts_bootstrapped_must_be_a_boolean(tmp_path: Path, cli, value, shown) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=10, N=3), {"timeouts_bootstrapped": value})
    code, _, err = cli("gae", source, "-o", tmp_path / "o.h5")
    assert code == 1 and not (tmp_path / "o.h5").exists()
    assert err.strip() == (
        f"error: {source}: attribute 'timeouts_bootstrapped': expected a boolean (true/false or 0/1), found "
        f"{shown}. Set it to a boolean (h5py: f.attrs['timeouts_bootstrapped'] = False)."
    )
    for good in (True, 0, np.uint8(1)):
        other = write_rollout(tmp_path / "ok.h5", rollout_arrays(T=10, N=3), {"timeouts_bootstrapped": good})
        assert cli("gae", other, "-o", tmp_path / "o.h5", "--overwrite", "-q")[0] == 0


@pytest.mark.parametrize("change", ["mtime", "size"])
def test_input_rewritten_during_the_run_is_exit_3_and_publishes_nothing(
    tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    from rolloutcli.pipeline import gae as pipeline

    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=20, N=4))
    real = pipeline.gae_arrays

    def rewrite_then_compute(*args, **kwargs):
        if change == "size":
            with open(source, "ab") as handle:
                handle.write(b"\0" * 10)
        else:
            info = source.stat()
            os.utime(source, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000_000))
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "gae_arrays", rewrite_then_compute)
    code, _, err = cli("gae", source, "-o", tmp_path / "o.h5")
    assert code == 3 and "the input changed while gae ran" in err and "nothing was written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5"]
