"""GAE core: both backends against RSL-RL's own code and against a float64 per-step loop written here."""

from __future__ import annotations

import threading
import warnings
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rsl_rl.algorithms.ppo import PPO
from rsl_rl.storage import RolloutStorage
from tensordict import TensorDict

from rolloutcli.core import gae_kernels
from rolloutcli.core.gae import (
    bootstrap_time_outs,
    compute_gae,
    normalize_advantages,
    normalize_with,
)
from rolloutcli.core.stats import EnvMoments

BACKENDS = ["numba", "torch"]
GAMMA, LAM = 0.99, 0.95


# ----------------------------------------------------------------------------------------------------------------
# Oracles
# ----------------------------------------------------------------------------------------------------------------


class _Critic:
    """Stands in for RSL-RL's critic: ``critic(obs)`` is ``V(s_T)``; recurrent-state hooks do nothing."""

    def __init__(self, last_values: torch.Tensor) -> None:
        self.last_values = last_values

    def __call__(self, obs):
        return self.last_values

    def get_hidden_state(self):
        return None

    def reset(self, dones=None, hidden_state=None):
        pass


def rsl_rl_gae(rewards, values, dones, last_values, gamma, lam, time_outs=None, normalize=False):
    """RSL-RL's real code: a real ``RolloutStorage`` filled step by step through ``PPO.process_env_step`` (which
    applies the time-out bootstrap), then ``PPO.compute_returns``; both called unbound on a minimal object.

    Inputs ``[T, N]`` (float32 where RSL-RL's storage is float32); returns the storage's ``(advantages, returns,
    rewards)`` as ``[T, N]``.
    """
    steps, envs = rewards.shape
    obs = TensorDict({"policy": torch.zeros(envs, 1)}, batch_size=[envs])
    storage = RolloutStorage("rl", envs, steps, obs, (1,), device="cpu")
    ppo = SimpleNamespace(
        storage=storage,
        transition=RolloutStorage.Transition(),
        gamma=gamma,
        lam=lam,
        rnd=None,
        device="cpu",
        actor=_Critic(None),
        critic=_Critic(last_values.reshape(envs, 1).float()),
        normalize_advantage_per_mini_batch=not normalize,
    )
    for t in range(steps):
        tr = ppo.transition
        tr.observations = obs
        tr.actions = torch.zeros(envs, 1)
        tr.values = values[t].reshape(envs, 1).float().clone()
        tr.actions_log_prob = torch.zeros(envs)
        tr.distribution_params = (torch.zeros(envs, 1),)
        extras = {} if time_outs is None else {"time_outs": time_outs[t]}
        PPO.process_env_step(ppo, obs, rewards[t].float(), dones[t], extras)
    PPO.compute_returns(ppo, obs)
    return storage.advantages[..., 0], storage.returns[..., 0], storage.rewards[..., 0]


def naive_gae(rewards, values, dones, last_values, gamma, lam, time_outs=None):
    """The recurrence step by step in float64 numpy, written independently of the code under test."""
    r = np.asarray(rewards, np.float64).copy()
    v = np.asarray(values, np.float64)
    d = np.asarray(dones).astype(bool)
    lv = np.asarray(last_values, np.float64).reshape(-1)
    if time_outs is not None:
        r += gamma * v * np.asarray(time_outs).astype(bool)
    steps = r.shape[0]
    adv = np.zeros_like(r)
    a = np.zeros(r.shape[1])
    for t in reversed(range(steps)):
        next_v = lv if t == steps - 1 else v[t + 1]
        not_done = 1.0 - d[t]
        delta = r[t] + not_done * gamma * next_v - v[t]
        a = delta + not_done * gamma * lam * a
        adv[t] = a
    return adv, adv + v


def assert_close(actual, expected, scale, rtol=2e-5):
    """``|actual - expected| <= rtol * scale``: the scan reorders float32 ops, so errors scale with the magnitudes
    involved, not with each element."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    err = np.abs(actual - expected).max(initial=0.0)
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol} * {scale:.3g}"


def term_scale(rewards, values, dones, last_values, gamma, lam, time_outs=None) -> float:
    """Largest sum of absolute terms behind any ``A_t`` (the recurrence on |delta|): float32 rounding errors of
    any evaluation order are a small multiple of eps times this."""
    r = np.abs(np.asarray(rewards, np.float64)) + (0 if time_outs is None else gamma * np.abs(np.asarray(values)))
    v = np.abs(np.asarray(values, np.float64))
    next_v = np.concatenate([v[1:], np.abs(np.asarray(last_values, np.float64)).reshape(1, -1)])
    b = r + gamma * next_v + v
    c = gamma * lam * (1.0 - np.asarray(dones).astype(bool))
    m = np.zeros(b.shape[1])
    best = 1.0
    for t in reversed(range(b.shape[0])):
        m = b[t] + c[t] * m
        best = max(best, float(m.max(initial=0.0)), float(v[t].max(initial=0.0)))
    return best


def magnitude(*arrays) -> float:
    return max(1.0, *(float(np.abs(np.asarray(a, np.float64)).max(initial=0.0)) for a in arrays))


def make_rollout(steps, envs, done_rate=0.05, timeout_rate=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(steps, envs, generator=g)
    values = torch.randn(steps, envs, generator=g) * 3
    dones = torch.rand(steps, envs, generator=g) < done_rate
    last_values = torch.randn(envs, generator=g) * 3
    time_outs = dones & (torch.rand(steps, envs, generator=g) < timeout_rate) if timeout_rate else None
    return rewards, values, dones, last_values, time_outs


# ----------------------------------------------------------------------------------------------------------------
# Parity with RSL-RL
# ----------------------------------------------------------------------------------------------------------------


def _dones_case(name, steps, envs):
    if name == "none":
        return torch.zeros(steps, envs, dtype=torch.bool)
    if name == "all":
        return torch.ones(steps, envs, dtype=torch.bool)
    if name == "first_last":
        d = torch.zeros(steps, envs, dtype=torch.bool)
        d[0] = True
        d[-1] = True
        return d
    return torch.rand(steps, envs, generator=torch.Generator().manual_seed(7)) < 0.1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dones_case", ["none", "all", "first_last", "random"])
@pytest.mark.parametrize(("steps", "envs"), [(1, 1), (1, 5), (40, 1), (37, 6), (33, 20)])
def test_matches_rsl_rl(backend, dones_case, steps, envs):
    r, v, _, lv, _ = make_rollout(steps, envs)
    d = _dones_case(dones_case, steps, envs)
    ref_adv, ref_ret, _ = rsl_rl_gae(r, v, d, lv, GAMMA, LAM)
    adv, ret = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, backend=backend)
    assert adv.dtype == ret.dtype == torch.float32
    assert adv.shape == ret.shape == (steps, envs)
    scale = magnitude(ref_ret, v)
    assert_close(ret, ref_ret, scale)
    # RSL-RL stores returns - values; ours is A itself: equal up to rounding at the scale of the returns.
    assert_close(adv, ref_adv, scale)


def test_numba_returns_bit_identical_to_rsl_rl():
    # The numba kernel performs RSL-RL's float32 operations in RSL-RL's order, so its returns agree exactly.
    r, v, d, lv, to = make_rollout(50, 24, done_rate=0.1, timeout_rate=0.5)
    _, ref_ret, _ = rsl_rl_gae(r, v, d, lv, GAMMA, LAM, time_outs=to)
    _, ret = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, time_outs=to, backend="numba", num_threads=1)
    assert torch.equal(ret, ref_ret)


@pytest.mark.parametrize("backend", BACKENDS)
def test_time_outs_match_rsl_rl(backend):
    r, v, d, lv, to = make_rollout(60, 9, done_rate=0.15, timeout_rate=0.5)
    assert to is not None and to.any() and (d & ~to).any()
    ref_adv, ref_ret, _ = rsl_rl_gae(r, v, d, lv, GAMMA, LAM, time_outs=to)
    adv, ret = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, time_outs=to, backend=backend)
    scale = magnitude(ref_ret, v)
    assert_close(ret, ref_ret, scale)
    assert_close(adv, ref_adv, scale)
    # Without the bootstrap the answer must differ, or this test proves nothing.
    plain, _ = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, backend=backend)
    assert (plain - adv).abs().max() > 1e-2


def test_bootstrap_time_outs_is_rsl_rl_reward():
    r, v, d, lv, to = make_rollout(20, 7, done_rate=0.3, timeout_rate=0.5)
    _, _, stored_rewards = rsl_rl_gae(r, v, d, lv, GAMMA, LAM, time_outs=to)
    r_before = r.clone()
    out = bootstrap_time_outs(r, v, to, GAMMA)
    assert torch.equal(out, stored_rewards)
    assert torch.equal(r, r_before)
    # A bootstrapped reward with no time-outs in the recurrence gives what time_outs= gives.
    a1, _ = compute_gae(out, v, d, lv, gamma=GAMMA, lam=LAM)
    a2, _ = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, time_outs=to)
    assert torch.equal(a1, a2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_normalised_matches_rsl_rl(backend):
    r, v, d, lv, _ = make_rollout(45, 11)
    ref_adv, _, _ = rsl_rl_gae(r, v, d, lv, GAMMA, LAM, normalize=True)
    adv, _ = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, backend=backend)
    norm = normalize_advantages(adv)
    assert_close(norm, ref_adv, magnitude(ref_adv), rtol=1e-4)
    # And unnormalised differs: normalisation is a separate, explicit step.
    assert (adv - norm).abs().max() > 1e-2


def test_normalize_advantages_is_rsl_rl_expression():
    a = torch.randn(30, 8) * 5 + 2
    assert torch.equal(normalize_advantages(a), (a - a.mean()) / (a.std() + 1e-8))
    assert torch.isclose(normalize_advantages(a).std(), torch.tensor(1.0), atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_trailing_one_shapes(backend):
    r, v, d, lv, to = make_rollout(25, 4, done_rate=0.2, timeout_rate=0.5)
    flat = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, time_outs=to, backend=backend)
    shaped = compute_gae(
        r[..., None],
        v[..., None],
        d[..., None].to(torch.uint8),
        lv[:, None],
        gamma=GAMMA,
        lam=LAM,
        time_outs=to[..., None],
        backend=backend,
    )
    for x, y in zip(flat, shaped, strict=True):
        assert y.shape == (25, 4)
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_input_upcast_like_rsl_rl_storage(backend, dtype):
    r, v, d, lv, _ = make_rollout(30, 5)
    r16, v16, lv16 = r.to(dtype), v.to(dtype), lv.to(dtype)
    # RSL-RL's storage is float32: half inputs are upcast when copied in.
    ref_adv, ref_ret, _ = rsl_rl_gae(r16.float(), v16.float(), d, lv16.float(), GAMMA, LAM)
    adv, ret = compute_gae(r16, v16, d, lv16, gamma=GAMMA, lam=LAM, backend=backend)
    assert adv.dtype == ret.dtype == torch.float32
    scale = magnitude(ref_ret)
    assert_close(ret, ref_ret, scale)
    assert_close(adv, ref_adv, scale)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int64, torch.float32, torch.float64])
def test_dones_dtypes_agree(dtype):
    r, v, d, lv, _ = make_rollout(30, 5, done_rate=0.2)
    ref = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM)
    got = compute_gae(r, v, d.to(dtype), lv, gamma=GAMMA, lam=LAM)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_float64_inputs_rounded_to_float32_first():
    r, v, d, lv, _ = make_rollout(30, 5)
    a32 = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM)
    a64 = compute_gae(r.double(), v.double(), d, lv.double(), gamma=GAMMA, lam=LAM)
    assert a64[0].dtype == torch.float32
    assert torch.equal(a32[0], a64[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_unchanged(backend):
    r, v, d, lv, to = make_rollout(40, 6, done_rate=0.2, timeout_rate=0.5)
    r3, v3 = r[..., None].clone(), v[..., None].clone()
    before = [x.clone() for x in (r, v, d, lv, to, r3, v3)]
    compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, time_outs=to, backend=backend)
    compute_gae(r3, v3, d, lv, gamma=GAMMA, lam=LAM, time_outs=to, backend=backend)
    bootstrap_time_outs(r, v, to, GAMMA)
    for x, y in zip(before, (r, v, d, lv, to, r3, v3), strict=True):
        assert torch.equal(x, y)


def test_non_contiguous_inputs():
    r, v, d, lv, _ = make_rollout(12, 10, done_rate=0.2)
    ref = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM)
    rt, vt, dt = (x.t().contiguous().t() for x in (r, v, d))  # same values, column-major strides
    assert not rt.is_contiguous()
    got = compute_gae(rt, vt, dt, lv, gamma=GAMMA, lam=LAM)
    assert torch.equal(ref[0], got[0])


def test_empty_rollouts():
    for steps, envs in [(0, 3), (4, 0)]:
        for backend in BACKENDS:
            adv, ret = compute_gae(
                torch.zeros(steps, envs),
                torch.zeros(steps, envs),
                torch.zeros(steps, envs, dtype=torch.bool),
                torch.zeros(envs),
                gamma=GAMMA,
                lam=LAM,
                backend=backend,
            )
            assert adv.shape == ret.shape == (steps, envs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_buffers(backend):
    r, v, d, lv, to = make_rollout(30, 20, done_rate=0.1, timeout_rate=0.5)
    expected = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, time_outs=to, backend=backend)
    buffers = (torch.full((30, 20), float("nan")), torch.full((30, 20), float("nan")))
    got = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, time_outs=to, backend=backend, out=buffers)
    assert got[0] is buffers[0] and got[1] is buffers[1]
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with pytest.raises(ValueError, match=r"out\[1\]"):
        compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, out=(buffers[0], torch.empty(20, 30).t()))
    with pytest.raises(ValueError, match=r"out\[0\]"):
        compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, out=(torch.empty(30, 20, dtype=torch.float64), buffers[1]))


def test_bad_arguments():
    r, v, d, lv, _ = make_rollout(5, 3)
    with pytest.raises(ValueError, match="values"):
        compute_gae(r, v[:4], d, lv, gamma=GAMMA, lam=LAM)
    with pytest.raises(ValueError, match="last_values"):
        compute_gae(r, v, d, lv[:2], gamma=GAMMA, lam=LAM)
    with pytest.raises(ValueError, match="rewards"):
        compute_gae(r[None], v, d, lv, gamma=GAMMA, lam=LAM)
    with pytest.raises(ValueError, match="time_outs"):
        compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, time_outs=d[:, :2])
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(r, v, d, lv, gamma=1.5, lam=LAM)
    with pytest.raises(ValueError, match="lam"):
        compute_gae(r, v, d, lv, gamma=GAMMA, lam=-0.1)
    with pytest.raises(ValueError, match="backend"):
        compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, backend="jax")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------------
# The fast paths: time chunks with a carry fix-up, several threads
# ----------------------------------------------------------------------------------------------------------------


def small_chunks(min_chunk=3):
    """Make the numba backend cut even small rollouts into time chunks and run them on threads."""
    return mock.patch.multiple(gae_kernels, _MIN_CHUNK=min_chunk, _PARALLEL_MIN_ELEMENTS=0)


@pytest.mark.parametrize(
    ("steps", "envs", "gamma", "lam", "done_rate"),
    [
        (3000, 1, 0.99, 0.95, 0.002),  # N = 1: four interleaved chains per thread
        (3000, 1, 1.0, 1.0, 0.0),  # no decay, no dones: the fix-up must run through whole chunks
        (2000, 3, 0.9, 0.5, 0.0),  # fast decay: the fix-up stops early once the product underflows
        (1500, 16, 0.99, 0.95, 0.01),  # one env block, time chunks
        (400, 20, 0.99, 0.95, 0.05),  # two env blocks, one partial; chunked on three threads
    ],
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_chunked_numba_matches_naive(steps, envs, gamma, lam, done_rate, threads):
    r, v, d, lv, to = make_rollout(steps, envs, done_rate=done_rate, timeout_rate=0.5, seed=steps + envs)
    ref_adv, ref_ret = naive_gae(r, v, d, lv, gamma, lam, to)
    with small_chunks(min_chunk=50):
        adv, ret = compute_gae(r, v, d, lv, gamma=gamma, lam=lam, time_outs=to, backend="numba", num_threads=threads)
        _, n_chunks, _, _ = gae_kernels._plan(steps, envs, threads)
    if envs == 1 or threads > len(range(0, envs, 16)):
        assert n_chunks > 1  # the chunked path really ran
    scale = magnitude(ref_adv, ref_ret)
    assert_close(adv, ref_adv, scale, rtol=1e-5)
    assert_close(ret, ref_ret, scale, rtol=1e-5)


def test_default_thresholds_large_single_env():
    # The production plan (no patching) for a long single-env rollout, against the unchunked torch-free oracle.
    r, v, d, lv, _ = make_rollout(20000, 1, done_rate=0.001, seed=3)
    ref_adv, _ = naive_gae(r, v, d, lv, GAMMA, LAM)
    adv, _ = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, backend="numba", num_threads=2)
    assert_close(adv, ref_adv, magnitude(ref_adv), rtol=1e-5)


def test_concurrent_calls_from_threads():
    r, v, d, lv, _ = make_rollout(600, 64, done_rate=0.02)
    expected = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, num_threads=1)[0]
    results: list[torch.Tensor] = []
    with small_chunks(min_chunk=20):

        def work():
            results.append(compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, num_threads=3)[0])

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 4
    for got in results:
        assert_close(got, expected, magnitude(expected), rtol=1e-5)


def test_torch_backend_is_device_agnostic_without_host_syncs():
    # Meta tensors have shapes but no data: any .item(), data-dependent shape or CPU-only call would raise.
    steps, envs = 1000, 8
    meta = torch.device("meta")
    r = torch.empty(steps, envs, 1, device=meta)
    d = torch.empty(steps, envs, dtype=torch.bool, device=meta)
    adv, ret = compute_gae(r, r, d, torch.empty(envs, device=meta), gamma=GAMMA, lam=LAM, time_outs=d)
    assert adv.device == ret.device == meta
    assert adv.shape == ret.shape == (steps, envs)
    assert adv.dtype == torch.float32
    with pytest.raises(ValueError, match="CPU"):
        compute_gae(r, r, d, torch.empty(envs, device=meta), gamma=GAMMA, lam=LAM, backend="numba")


def test_tolerance_catches_small_errors():
    # The comparisons above must be able to fail: a lambda off by 1e-3 is detected.
    r, v, d, lv, _ = make_rollout(40, 6)
    ref_adv, ref_ret, _ = rsl_rl_gae(r, v, d, lv, GAMMA, LAM)
    adv, _ = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM - 1e-3)
    with pytest.raises(AssertionError):
        assert_close(adv, ref_adv, magnitude(ref_ret, v))


@settings(max_examples=60, deadline=None)
@given(
    steps=st.integers(1, 70),
    envs=st.integers(1, 20),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    done_rate=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    timeout_rate=st.sampled_from([0.0, 0.5, 1.0]),
    threads=st.integers(1, 3),
    min_chunk=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_property_backends_agree_with_naive(steps, envs, gamma, lam, done_rate, timeout_rate, threads, min_chunk, seed):
    r, v, d, lv, to = make_rollout(steps, envs, done_rate=done_rate, timeout_rate=timeout_rate, seed=seed)
    ref_adv, ref_ret = naive_gae(r, v, d, lv, gamma, lam, to)
    scale = term_scale(r, v, d, lv, gamma, lam, to)
    with small_chunks(min_chunk=min_chunk):
        for backend in BACKENDS:
            adv, ret = compute_gae(
                r, v, d, lv, gamma=gamma, lam=lam, time_outs=to, backend=backend, num_threads=threads
            )
            assert_close(adv, ref_adv, scale, rtol=1e-5)
            assert_close(ret, ref_ret, scale, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Streaming normalisation
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", [1, 3, 7])
def test_streaming_moments_equal_whole_tensor(blocks):
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(200, 70, generator=g) * 4 + 100  # |mean| >> std: the naive sum-of-squares would cancel
    moments = EnvMoments()
    for part in torch.tensor_split(adv, blocks, dim=1):  # env blocks, as a file is read
        moments.add(part)
    mean, std = moments.mean_std()
    a64 = adv.double().numpy()
    assert mean == pytest.approx(a64.mean(), rel=1e-12)
    assert std == pytest.approx(a64.std(ddof=1), rel=1e-10)
    whole_block = EnvMoments()
    whole_block.add(adv)
    assert whole_block.mean_std() == (mean, std)  # bit-identical whatever the env-block partition
    streamed = normalize_with(adv, mean, std)
    assert streamed.dtype == torch.float32
    whole = normalize_advantages(adv)
    # float64 statistics vs RSL-RL's float32 ones: float32 rounding at the scale of |A - mean| / std.
    assert_close(streamed, whole, magnitude(whole), rtol=5e-5)


def test_moments_edge_cases():
    one = EnvMoments()
    one.add(torch.tensor([[3.0]]))
    assert one.mean_std() == (3.0, 0.0)  # one value: std 0 (torch gives NaN), so it normalises to 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about zero degrees of freedom
        assert np.isnan(torch.tensor([3.0]).std().item())
    both = EnvMoments()
    both.add(torch.tensor([[3.0, 5.0]]))
    mean, std = both.mean_std()
    assert mean == 4.0 and std == pytest.approx(np.std([3.0, 5.0], ddof=1))
