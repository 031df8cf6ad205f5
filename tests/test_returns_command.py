"""``rolloutcli returns``: Monte-Carlo returns-to-go without a critic, truncation marks, streaming, errors."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.core import returns_to_go as rtg
from rolloutcli.core.returns_to_go import returns_to_go


def naive(rewards, dones, time_outs, gamma):
    """Episode by episode, env by env, in float32: G = r at the episode's last step, then r + gamma * G."""
    T, N = rewards.shape
    g = np.float32(gamma)
    returns, truncated = np.zeros((T, N), np.float32), np.zeros((T, N), np.uint8)
    for n in range(N):
        start = 0
        for t in range(T):
            if not (dones[t, n] or t == T - 1):
                continue
            cut = (not dones[t, n]) or (time_outs is not None and bool(time_outs[t, n]))
            G = np.float32(rewards[t, n])
            returns[t, n] = G
            for s in range(t - 1, start - 1, -1):
                G = np.float32(rewards[s, n]) + g * G
                returns[s, n] = G
            truncated[start : t + 1, n] = cut
            start = t + 1
    return returns, truncated


def test_core_equals_naive_loop():
    a = rollout_arrays(T=40, N=7, end_rate=0.2, seed=3)
    r, d, to = a["rewards"], a["dones"], a["time_outs"]
    got = returns_to_go(r, d, to, 0.97)
    ref = naive(r, d, to, 0.97)
    assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])
    assert got[1].any() and not got[1].all()


def test_core_hand_example():
    rewards = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)
    dones = np.array([[0], [1], [1], [0]], np.uint8)
    time_outs = np.array([[0], [0], [1], [0]], np.uint8)
    returns, truncated = returns_to_go(rewards, dones, time_outs, 0.5)
    assert returns[:, 0].tolist() == [2.0, 2.0, 3.0, 4.0]
    assert truncated[:, 0].tolist() == [0, 0, 1, 1]  # terminated, cut by a time-out, cut by the recording's end


@settings(max_examples=60, deadline=None)
@given(
    T=st.integers(1, 12),
    N=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    gamma=st.floats(0.0, 1.0),
    with_time_outs=st.booleans(),
)
def test_property_equals_naive_and_recursion_holds(T, N, seed, gamma, with_time_outs):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(T, N)).astype(np.float32)
    dones = (rng.random((T, N)) < 0.3).astype(np.uint8)
    time_outs = (dones & (rng.random((T, N)) < 0.5)).astype(np.uint8) if with_time_outs else None
    returns, truncated = returns_to_go(rewards, dones, time_outs, gamma)
    ref = naive(rewards, dones, time_outs, gamma)
    assert np.array_equal(returns, ref[0]) and np.array_equal(truncated, ref[1])
    for t in range(T - 1):  # one episode: the same mark and G_t = r_t + gamma * G_{t+1}
        inside = dones[t] == 0
        assert np.array_equal(truncated[t][inside], truncated[t + 1][inside])
        expect = rewards[t] + np.float32(gamma) * returns[t + 1]
        assert np.array_equal(returns[t][inside], expect[inside])
    assert np.array_equal(truncated[-1] == 1, (dones[-1] == 0) | ((time_outs[-1] != 0) if with_time_outs else False))


@settings(max_examples=60, deadline=None)
@given(
    T=st.integers(1, 30), N=st.integers(1, 4), seed=st.integers(0, 10_000), end_rate=st.sampled_from([0, 0.1, 0.5, 1])
)
def test_both_paths_give_the_naive_bits(T, N, seed, end_rate):
    """By step and by episode step (whichever the episodes' lengths pick): the same bits, -0.0 and inf too."""
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(T, N)).astype(np.float32)
    rewards[rng.random((T, N)) < 0.1] = -0.0
    rewards[rng.random((T, N)) < 0.05] = np.inf
    dones = (rng.random((T, N)) < end_rate).astype(np.uint8)
    time_outs = (dones & (rng.random((T, N)) < 0.5)).astype(np.uint8)
    ref = naive(rewards, dones, time_outs, 0.97)
    ended, cut_here, g = dones != 0, time_outs != 0, np.float32(0.97)
    with np.errstate(all="ignore"):
        paths = [
            rtg._by_step(rewards, ended, cut_here, g),
            rtg._by_episode_step(rewards, ended, cut_here, g, *rtg._episodes(ended)),
        ]
    for returns, truncated in paths:  # (the naive loop starts an open episode at r, not r + gamma * 0: -0.0)
        assert np.array_equal(returns, ref[0]) and np.array_equal(truncated, ref[1])
    assert paths[0][0].tobytes() == paths[1][0].tobytes()


def test_one_env_of_many_short_episodes_runs_by_episode_step():
    rewards = np.arange(20_050, dtype=np.float32).reshape(-1, 1) % 7
    dones = np.zeros((20_050, 1), np.uint8)
    dones[99::100] = 1
    assert rtg._episodes(dones != 0)[1].max() == 100  # 100 rounds instead of 20,050
    returns, truncated = returns_to_go(rewards, dones, None, 0.9)
    ref = naive(rewards[:300], dones[:300], None, 0.9)
    assert returns[:300].tobytes() == ref[0].tobytes()
    assert not truncated[:-50].any() and truncated[-50:].all()  # the last 50 steps: cut by the recording's end


def _offline(path: Path, seed: int = 5, T: int = 30, N: int = 9) -> tuple[Path, dict[str, np.ndarray]]:
    """A rollout without values or last_values (offline data)."""
    arrays = rollout_arrays(T=T, N=N, end_rate=0.2, seed=seed)
    arrays = {k: v for k, v in arrays.items() if k not in ("values", "last_values")}
    return write_rollout(path, arrays), arrays


def test_command_writes_returns_and_marks(tmp_path, cli):
    source, arrays = _offline(tmp_path / "in.h5")
    code, out, err = cli("returns", source, "-o", tmp_path / "out.h5", "--gamma", "0.9", "--json")
    assert code == 0, err
    summary = json.loads(out)
    ref = naive(arrays["rewards"].reshape(30, 9), arrays["dones"].reshape(30, 9), arrays["time_outs"], 0.9)
    with h5py.File(tmp_path / "out.h5") as f:
        assert np.array_equal(f["returns_to_go"][()], ref[0]) and f["returns_to_go"].dtype == np.float32
        assert np.array_equal(f["returns_truncated"][()], ref[1]) and f["returns_truncated"].dtype == np.uint8
        assert f.attrs["returns_gamma"] == 0.9 and f.attrs["returns_kind"] == "monte-carlo"
        assert "values" not in f
    dones, time_outs = arrays["dones"].reshape(30, 9), arrays["time_outs"]
    assert summary["episodes"] == int(dones.sum() + (dones[-1] == 0).sum())
    assert summary["truncated_episodes"] == int((time_outs & dones).sum() + (dones[-1] == 0).sum())
    assert summary["rewards_from"] == "rewards"


def test_same_bytes_for_any_budget(tmp_path, cli):
    source, _ = _offline(tmp_path / "in.h5", T=20, N=16)
    blocks = []
    for budget in ("1G", "1K"):
        code, out, err = cli("returns", source, "-o", tmp_path / f"{budget}.h5", "--max-memory", budget, "--json")
        assert code == 0, err
        blocks.append(json.loads(out)["blocks"])
    assert blocks[0] == 1 and blocks[1] > 1
    assert (tmp_path / "1G.h5").read_bytes() == (tmp_path / "1K.h5").read_bytes()


def test_in_place_and_rerun(tmp_path, cli):
    source, arrays = _offline(tmp_path / "in.h5", T=10, N=3)
    assert cli("returns", source, "--in-place", "-q")[0] == 0
    assert cli("returns", source, "--in-place", "-q", "--gamma", "0.5")[0] == 0
    ref = naive(arrays["rewards"].reshape(10, 3), arrays["dones"].reshape(10, 3), arrays["time_outs"], 0.5)
    with h5py.File(source) as f:
        assert np.array_equal(f["returns_to_go"][()], ref[0])


def test_bootstrapped_rewards_use_rewards_raw(tmp_path, cli):
    arrays = rollout_arrays(T=12, N=4, seed=2)
    source = write_rollout(tmp_path / "in.h5", arrays)
    assert cli("gae", source, "-o", tmp_path / "gae.h5", "-q")[0] == 0
    code, out, _ = cli("returns", tmp_path / "gae.h5", "-o", tmp_path / "out.h5", "--json")
    assert code == 0 and json.loads(out)["rewards_from"] == "rewards_raw"
    ref = naive(arrays["rewards"].reshape(12, 4), arrays["dones"].reshape(12, 4), arrays["time_outs"], 0.99)
    with h5py.File(tmp_path / "out.h5") as f:
        assert np.array_equal(f["returns_to_go"][()], ref[0])


def test_bootstrapped_rewards_without_raw_exit_1(tmp_path, cli):
    arrays = rollout_arrays(T=6, N=2, seed=2)
    source = write_rollout(tmp_path / "in.h5", arrays, {"timeouts_bootstrapped": True})
    code, _, err = cli("returns", source, "-o", tmp_path / "out.h5")
    assert code == 1 and not (tmp_path / "out.h5").exists()
    assert err.strip() == (
        f"error: {source}: field 'rewards_raw': expected float raw rewards [T, N] = [6, 2] (the rewards hold a "
        "time-out bootstrap: timeouts_bootstrapped is true), found nothing. Run returns on the recording, before gae."
    )


@pytest.mark.parametrize("extra", [[], ["-o", "x.h5", "--in-place"]])
def test_output_usage_errors(tmp_path, cli, extra):
    source, _ = _offline(tmp_path / "in.h5", T=4, N=2)
    code, _, err = cli("returns", source, *extra)
    assert code == 2
    expected = (
        "returns: expected either -o OUT.h5 or --in-place, found both."
        if extra
        else "returns: expected an output path (-o OUT.h5) or --in-place, found neither."
    )
    assert expected in err


def test_a_return_past_float32_is_kept_and_named_in_a_warning(tmp_path, cli):
    """Issue 40.9: discounted sums past float32's range were written as inf without a word. Chosen: warn (the
    rewards are valid; inf is what float32 arithmetic gives, kept, never clipped), naming the first env and step,
    whatever the blocks."""
    arrays = rollout_arrays(T=20, N=3, seed=1, end_rate=0.0)
    arrays["rewards"][:] = 1.0
    arrays["rewards"][10:15, 2] = 3e38  # env 2 (in the second block of 1K): each finite, their sum is not
    source = write_rollout(tmp_path / "in.h5", arrays)
    warning = (
        f"warning: {source}: returns_to_go overflows float32 on 14 step(s), first in env 2 at step 0; stored as inf. "
        "Scale the rewards down or lower --gamma.\n"
    )
    for budget in ("1G", "1K"):
        code, out, err = cli("returns", source, "-o", tmp_path / f"{budget}.h5", "--max-memory", budget, "--json")
        assert (code, err) == (0, warning)
        assert json.loads(out)["overflowed_steps"] == 14 and json.loads(out)["blocks"] == (1 if budget == "1G" else 2)
        with h5py.File(tmp_path / f"{budget}.h5") as f:
            returns = f["returns_to_go"][()]
        assert np.array_equal(np.argwhere(np.isinf(returns)), [[t, 2] for t in range(14)])
        with np.errstate(over="ignore"):
            expected = naive(arrays["rewards"], arrays["dones"], None, 0.99)[0]
        assert np.array_equal(returns, expected)
    assert cli("returns", source, "-o", tmp_path / "q.h5", "-q") == (0, "", "")  # --quiet: no warning
