"""The n-step core against a naive loop (hypothesis) and TorchRL's ``MultiStep`` on the same data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutcli.core.nstep import kernel, nstep_returns, nstep_torch


def naive(rewards, dones, time_outs, n, gamma, timeouts="final-value"):
    """One step at a time: returns, discount, next step, as the module docstring defines them (float32 sums,
    float64 powers of gamma)."""
    steps, envs = rewards.shape
    out = np.zeros((steps, envs), np.float32), np.zeros((steps, envs), np.float32), np.zeros((steps, envs), np.int64)
    for e in range(envs):
        for t in range(steps):
            total, weight, j = np.float32(0.0), 1.0, t
            while True:
                total = total + rewards[j, e] * np.float32(weight)  # float32 throughout
                weight *= gamma
                end = bool(dones[j, e]) or bool(time_outs[j, e])
                if end or j - t + 1 == n or j == steps - 1:
                    break
                j += 1
            terminal = end and (timeouts == "ignore" or not time_outs[j, e])
            out[0][t, e], out[1][t, e] = total, 0.0 if terminal else weight
            out[2][t, e] = -1 if end else j + 1
    return out


@st.composite
def rollouts(draw):
    steps, envs = draw(st.integers(1, 12)), draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    rewards = rng.standard_normal((steps, envs)).astype(np.float32)
    rewards[rng.random((steps, envs)) < 0.1] = -0.0
    dones = rng.random((steps, envs)) < draw(st.sampled_from([0.0, 0.2, 0.5]))
    time_outs = dones & (rng.random((steps, envs)) < 0.5)
    return rewards, dones.astype(np.uint8), time_outs.astype(np.uint8)


@settings(max_examples=150, deadline=None)
@given(
    rollouts(),
    st.integers(1, 14),
    st.sampled_from([0.0, 0.5, 0.99, 1.0, 0.9371]),
    st.sampled_from(["final-value", "ignore"]),
)
def test_matches_naive_loop_bit_for_bit(data, n, gamma, timeouts):
    """Both paths: the compiled kernel (where built) and torch."""
    rewards, dones, time_outs = data
    want = naive(rewards, dones, time_outs, n, gamma, timeouts)
    for path in (nstep_returns, nstep_torch):
        args = (torch.from_numpy(rewards), torch.from_numpy(dones), n, gamma)
        for outs in (torch.from_numpy(time_outs), None):
            got = path(*args, outs, timeouts=timeouts)
            expected = want if outs is not None else naive(rewards, dones, 0 * time_outs, n, gamma, timeouts)
            assert got.returns.numpy().tobytes() == expected[0].tobytes()
            assert got.discount.numpy().tobytes() == expected[1].tobytes()
            np.testing.assert_array_equal(got.next_step.numpy(), expected[2])


def test_the_kernel_is_built_where_required():
    import os

    if os.environ.get("ROLLOUTCLI_REQUIRE_NATIVE") == "1":
        assert kernel() is not None


# 2100 envs: more columns than the kernel's lanes; (600, 1037): blocks large enough to be streamed out, rows of an odd
# width (the stores' unaligned heads and tails)
@pytest.mark.parametrize("shape", [(300, 700), (40, 2100), (600, 1037)])
def test_compiled_and_torch_paths_agree_on_a_large_rollout(shape):
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(*shape, generator=g)
    rewards[torch.rand(*shape, generator=g) < 0.01] = -0.0
    dones = (torch.rand(*shape, generator=g) < 0.05).to(torch.uint8)
    time_outs = dones * (torch.rand(*shape, generator=g) < 0.5)
    for timeouts in ("final-value", "ignore"):
        a = nstep_returns(rewards, dones, 7, 0.97, time_outs, timeouts=timeouts)
        b = nstep_torch(rewards, dones, 7, 0.97, time_outs, timeouts=timeouts)
        for x, y, name in zip(a, b, a._fields, strict=True):
            assert x.numpy().tobytes() == y.numpy().tobytes(), name


@pytest.mark.parametrize("compiled", [True, False])
def test_out_buffers_are_filled_and_returned(compiled, monkeypatch):
    import rolloutcli.core.nstep as module

    if not compiled:
        monkeypatch.setattr(module, "kernel", lambda: None)
    g = torch.Generator().manual_seed(2)
    rewards, dones = torch.randn(30, 6, generator=g), (torch.rand(30, 6, generator=g) < 0.2).to(torch.uint8)
    want = nstep_torch(rewards, dones, 4, 0.9)
    out = module.NStep(*(torch.full((30, 6), 7, dtype=dtype) for dtype in module._DTYPES))
    got = nstep_returns(rewards, dones, 4, 0.9, out=out)
    assert all(a is b for a, b in zip(got, out, strict=True))
    for a, b, name in zip(out, want, want._fields, strict=True):
        assert torch.equal(a, b), name


def test_out_buffers_of_the_wrong_kind_are_refused():
    rewards, dones = torch.zeros(5, 2), torch.zeros(5, 2)
    good = nstep_returns(rewards, dones, 2, 0.9)
    with pytest.raises(ValueError, match=r"out\.next_step: expected torch.int64 \(5, 2\)"):
        nstep_returns(rewards, dones, 2, 0.9, out=good._replace(next_step=torch.zeros(5, 2)))
    with pytest.raises(ValueError, match=r"out\.returns: expected a contiguous tensor"):
        nstep_returns(rewards, dones, 2, 0.9, out=good._replace(returns=torch.zeros(2, 5).T))


def test_env_blocks_do_not_change_bytes():
    rng = np.random.default_rng(3)
    rewards = torch.from_numpy(rng.standard_normal((50, 9)).astype(np.float32))
    dones = torch.from_numpy(rng.random((50, 9)) < 0.1)
    whole = nstep_returns(rewards, dones, 5, 0.97)
    parts = [nstep_returns(rewards[:, a:b], dones[:, a:b], 5, 0.97) for a, b in ((0, 4), (4, 5), (5, 9))]
    for i, name in enumerate(whole._fields):
        assert torch.equal(whole[i], torch.cat([p[i] for p in parts], 1)), name


def test_worked_example():
    rewards = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]])
    dones = torch.tensor([[0], [1], [0], [0], [0]])
    got = nstep_returns(rewards, dones, 2, 0.5)
    assert got.returns[:, 0].tolist() == [2.0, 2.0, 5.0, 6.5, 5.0]
    assert got.discount[:, 0].tolist() == [0.0, 0.0, 0.25, 0.25, 0.5]
    assert got.next_step[:, 0].tolist() == [-1, -1, 4, 5, 5]


@pytest.mark.parametrize("bad", [dict(n=0), dict(gamma=1.5), dict(gamma=-0.1), dict(timeouts="rsl")])
def test_rejects_bad_arguments(bad):
    args = dict(n=3, gamma=0.9, timeouts="ignore") | bad
    with pytest.raises(ValueError):
        nstep_returns(torch.zeros(4, 2), torch.zeros(4, 2), args["n"], args["gamma"], timeouts=args["timeouts"])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n", [1, 3, 7])
def test_matches_torchrl_multistep(seed, n):
    """TorchRL's MultiStep (time last): its summed reward, steps_to_next_obs and gathered next observation."""
    from tensordict import TensorDict
    from torchrl.data.postprocs import MultiStep

    steps, envs, gamma = 30, 5, 0.95
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(steps, envs, generator=g)
    dones = torch.rand(steps, envs, generator=g) < 0.15
    time_outs = dones & (torch.rand(steps, envs, generator=g) < 0.5)
    step_ids = torch.arange(steps).unsqueeze(1).expand(steps, envs)
    # a "next" observation that says where it comes from: step + 1, or -(step + 1) for a final observation
    next_obs = torch.where(dones, -(step_ids + 1), step_ids + 1).to(torch.float32)
    td = TensorDict(
        {
            "obs": step_ids.T.float(),
            "next": {"reward": rewards.T[..., None], "done": dones.T[..., None], "obs": next_obs.T},
        },
        batch_size=[envs, steps],
    )
    out = MultiStep(gamma, n)(td)
    got = nstep_returns(rewards, dones, n, gamma, time_outs)
    torch.testing.assert_close(got.returns, out["next", "reward"][..., 0].T, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.steps, out["steps_to_next_obs"].T.to(torch.int64))
    last = step_ids + got.steps - 1
    ours = torch.where(got.next_step == -1, -(last + 1), got.next_step).float()
    assert torch.equal(ours, out["next", "obs"].T)
    terminal = (dones & ~time_outs).gather(0, last)  # TorchRL keeps gamma^m there and says so in "terminated"
    want = torch.where(terminal, 0.0, out["gamma"].T.to(torch.float64))
    torch.testing.assert_close(got.discount.double(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.int64, torch.float32])
def test_any_nonzero_flag_is_set(dtype):
    g = torch.Generator().manual_seed(4)
    rewards = torch.randn(40, 5, generator=g)
    ends = torch.rand(40, 5, generator=g) < 0.2
    want = nstep_torch(rewards, ends.to(torch.uint8), 3, 0.9, ends & (torch.rand(40, 5, generator=g) < 0.5))
    g = torch.Generator().manual_seed(4)
    torch.randn(40, 5, generator=g), torch.rand(40, 5, generator=g)
    outs = ends & (torch.rand(40, 5, generator=g) < 0.5)
    scale = 1 if dtype == torch.bool else 7  # 7: any nonzero byte means set
    got = nstep_returns(rewards, (ends * scale).to(dtype), 3, 0.9, (outs * scale).to(dtype))
    for a, b, name in zip(got, want, want._fields, strict=True):
        assert torch.equal(a, b), name


def _returns_in_child(rewards, dones):
    # numpy in and out: only the kernel runs in the child (torch's own thread pool is not safe after a fork)
    return nstep_returns(torch.from_numpy(rewards), torch.from_numpy(dones), 5, 0.99).returns.numpy().copy()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_runs_the_threaded_kernel():
    # the kernel's thread pool is kept per process: a child forked after a threaded call must not wait on
    # threads it does not have
    import multiprocessing

    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(600, 1037, generator=g)
    dones = (torch.rand(600, 1037, generator=g) < 0.05).to(torch.uint8)
    expected = nstep_returns(rewards, dones, 5, 0.99).returns.numpy()
    with multiprocessing.get_context("fork").Pool(1) as pool:
        result = pool.apply_async(_returns_in_child, (rewards.numpy(), dones.numpy()))
        assert result.get(timeout=60).tobytes() == expected.tobytes()
