"""GAE core: the CPU kernel bit for bit against RSL-RL's own code (with and without the compiled C file), the torch
scan against RSL-RL and a float64 per-step loop written here, and the exact statistics against fractions."""

from __future__ import annotations

import math
import threading
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rsl_rl.algorithms.ppo import PPO
from rsl_rl.storage import RolloutStorage
from tensordict import TensorDict

from rolloutcli.core import native
from rolloutcli.core.gae import bootstrap_time_outs, compute_gae, normalize_advantages
from rolloutcli.core.gae_numpy import gae_arrays, normalize_array
from rolloutcli.core.moments import ExactMoments

BACKENDS = ["cpu", "torch"]
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

    Inputs ``[T, N]`` (float64 rewards are handed to RSL-RL as float64, everything else as float32); returns the
    storage's ``(advantages, returns, rewards)`` as ``[T, N]``.
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
        reward = rewards[t] if rewards.dtype == torch.float64 else rewards[t].float()  # as the env hands them
        PPO.process_env_step(ppo, obs, reward, dones[t], extras)
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


def rsl_rl_returns(rewards, values, dones, last_values, gamma, lam):
    """RSL-RL's own ``PPO.compute_returns`` on a real storage filled directly (fast for long rollouts)."""
    steps, envs = rewards.shape
    obs = TensorDict({"policy": torch.zeros(envs, 1)}, batch_size=[envs])
    storage = RolloutStorage("rl", envs, steps, obs, (1,), device="cpu")
    storage.rewards.copy_(rewards[..., None])
    storage.values.copy_(values[..., None])
    storage.dones.copy_(dones[..., None])
    ppo = SimpleNamespace(
        storage=storage,
        gamma=gamma,
        lam=lam,
        critic=_Critic(last_values.reshape(envs, 1)),
        normalize_advantage_per_mini_batch=True,
    )
    PPO.compute_returns(ppo, obs)
    return storage.advantages[..., 0], storage.returns[..., 0]


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


def bits_equal(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.fixture(params=["compiled", "numpy"])
def kernel(request, monkeypatch):
    """Run a test with the compiled C kernel and with the numpy loop used where the C file was not built."""
    if request.param == "compiled" and native.library() is None:
        pytest.skip("the C kernel was not compiled in this install")
    if request.param == "numpy":
        monkeypatch.setattr(native, "library", lambda: None)
    return request.param


# ----------------------------------------------------------------------------------------------------------------
# The CPU kernel: RSL-RL's bits
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("steps", "envs"), [(30000, 16), (30000, 1), (24, 4096), (1000, 1024)])
def test_default_settings_are_rsl_rl_bits_at_long_and_wide_shapes(kernel, steps, envs):
    # No thread pinning: the default thread count, whatever the machine.
    r, v, d, lv, _ = make_rollout(steps, envs, done_rate=0.002, seed=steps + envs)
    ref_adv, ref_ret = rsl_rl_returns(r, v, d, lv, GAMMA, LAM)
    adv, ret = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM)
    assert bits_equal(ret, ref_ret) and bits_equal(adv, ref_adv)


@pytest.mark.parametrize("threads", [1, 2, 3, 7, 64])
def test_thread_count_never_changes_a_bit(threads):
    r, v, d, lv, to = make_rollout(300, 1000, done_rate=0.05, timeout_rate=0.5, seed=threads)
    expected = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, time_outs=to, num_threads=1)
    got = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, time_outs=to, num_threads=threads)
    assert bits_equal(got[0], expected[0]) and bits_equal(got[1], expected[1])


@pytest.mark.parametrize("dones_case", ["none", "all", "first_last", "random"])
@pytest.mark.parametrize(("steps", "envs"), [(1, 1), (1, 5), (40, 1), (37, 6), (33, 20)])
def test_cpu_matches_rsl_rl_bit_for_bit(kernel, dones_case, steps, envs):
    r, v, _, lv, _ = make_rollout(steps, envs)
    d = _dones_case(dones_case, steps, envs)
    ref_adv, ref_ret, _ = rsl_rl_gae(r, v, d, lv, GAMMA, LAM)
    adv, ret = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM)
    assert adv.dtype == ret.dtype == torch.float32 and adv.shape == (steps, envs)
    assert bits_equal(ret, ref_ret) and bits_equal(adv, ref_adv)


def test_time_outs_are_rsl_rl_bits(kernel):
    r, v, d, lv, to = make_rollout(60, 9, done_rate=0.15, timeout_rate=0.5)
    assert to is not None and to.any() and (d & ~to).any()
    ref_adv, ref_ret, ref_rewards = rsl_rl_gae(r, v, d, lv, GAMMA, LAM, time_outs=to)
    adv, ret = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, time_outs=to)
    assert bits_equal(ret, ref_ret) and bits_equal(adv, ref_adv)
    assert bits_equal(bootstrap_time_outs(r, v, to, GAMMA), ref_rewards)
    plain, _ = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM)  # without the bootstrap the answer differs
    assert (plain - adv).abs().max() > 1e-2


def test_float64_rewards_are_bootstrapped_in_float64_like_rsl_rl(kernel):
    r, v, d, lv, to = make_rollout(50, 7, done_rate=0.2, timeout_rate=0.6, seed=4)
    r64 = r.double() * (1 + 1e-9)  # digits float32 cannot hold: rounding first would differ
    ref_adv, ref_ret, ref_rewards = rsl_rl_gae(r64, v, d, lv, GAMMA, LAM, time_outs=to)
    assert not bits_equal(r64.float() + GAMMA * (v * to), ref_rewards)  # the order of rounding shows
    assert bits_equal(bootstrap_time_outs(r64, v, to, GAMMA), ref_rewards)
    adv, ret = compute_gae(r64, v, d, lv, gamma=GAMMA, lam=LAM, time_outs=to)
    assert bits_equal(ret, ref_ret) and bits_equal(adv, ref_adv)


def test_normalised_is_rsl_rl_code():
    r, v, d, lv, _ = make_rollout(45, 11)
    ref_adv, _, _ = rsl_rl_gae(r, v, d, lv, GAMMA, LAM, normalize=True)
    adv, _ = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM)
    assert bits_equal(normalize_advantages(adv[..., None])[..., 0], ref_adv)


def test_one_element_normalises_to_nan_as_rsl_rl():
    ref_adv, _, _ = rsl_rl_gae(*make_rollout(1, 1)[:4], GAMMA, LAM, normalize=True)
    assert torch.isnan(ref_adv).all()
    adv, _ = compute_gae(*make_rollout(1, 1)[:4], gamma=GAMMA, lam=LAM)
    assert torch.isnan(normalize_advantages(adv)).all()
    moments = ExactMoments.of(adv)
    assert math.isnan(moments.std) and np.isnan(normalize_array(adv.numpy(), moments.mean, moments.std)).all()


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
        assert y.shape == (25, 4) and torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_input_upcast_like_rsl_rl_storage(dtype):
    r, v, d, lv, _ = make_rollout(30, 5)
    r16, v16, lv16 = r.to(dtype), v.to(dtype), lv.to(dtype)
    # RSL-RL's storage is float32: half inputs are upcast when copied in.
    ref_adv, ref_ret, _ = rsl_rl_gae(r16.float(), v16.float(), d, lv16.float(), GAMMA, LAM)
    adv, ret = compute_gae(r16, v16, d, lv16, gamma=GAMMA, lam=LAM)
    assert bits_equal(ret, ref_ret) and bits_equal(adv, ref_adv)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int64, torch.float32, torch.float64])
def test_dones_dtypes_agree(dtype):
    r, v, d, lv, _ = make_rollout(30, 5, done_rate=0.2)
    ref = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM)
    got = compute_gae(r, v, d.to(dtype), lv, gamma=GAMMA, lam=LAM)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_float64_inputs_without_time_outs_are_rounded_first():
    r, v, d, lv, _ = make_rollout(30, 5)
    a32 = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM)
    a64 = compute_gae(r.double(), v.double(), d, lv.double(), gamma=GAMMA, lam=LAM)
    assert a64[0].dtype == torch.float32 and torch.equal(a32[0], a64[0])


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


def test_non_contiguous_inputs_and_autograd_leaves():
    r, v, d, lv, _ = make_rollout(12, 10, done_rate=0.2)
    ref = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM)
    rt, vt, dt = (x.t().contiguous().t() for x in (r, v, d))  # same values, column-major strides
    assert not rt.is_contiguous()
    got = compute_gae(rt, vt.requires_grad_(), dt, lv, gamma=GAMMA, lam=LAM)
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
        compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, backend="numba")  # type: ignore[arg-type]


def test_concurrent_calls_from_threads():
    r, v, d, lv, _ = make_rollout(600, 640, done_rate=0.02)
    expected = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, num_threads=1)[0]
    results: list[torch.Tensor] = []

    def work():
        results.append(compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, num_threads=3)[0])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(bits_equal(got, expected) for got in results)


# ----------------------------------------------------------------------------------------------------------------
# The torch scan (non-CPU devices): RSL-RL to float32 rounding at the scale of the terms
# ----------------------------------------------------------------------------------------------------------------


def test_torch_scan_matches_rsl_rl_within_its_tolerance():
    r, v, d, lv, to = make_rollout(60, 9, done_rate=0.15, timeout_rate=0.5)
    ref_adv, ref_ret, _ = rsl_rl_gae(r, v, d, lv, GAMMA, LAM, time_outs=to)
    adv, ret = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, time_outs=to, backend="torch")
    scale = term_scale(r, v, d, lv, GAMMA, LAM, to)
    assert_close(ret, ref_ret, scale, rtol=1e-5)
    assert_close(adv, ref_adv, scale, rtol=1e-5)


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
        compute_gae(r, r, d, torch.empty(envs, device=meta), gamma=GAMMA, lam=LAM, backend="cpu")


def test_tolerance_catches_small_errors():
    # The comparisons above must be able to fail: a lambda off by 1e-3 is detected.
    r, v, d, lv, _ = make_rollout(40, 6)
    ref_adv, ref_ret, _ = rsl_rl_gae(r, v, d, lv, GAMMA, LAM)
    adv, _ = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM - 1e-3, backend="torch")
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
    seed=st.integers(0, 2**16),
)
def test_property_backends_agree_with_naive(steps, envs, gamma, lam, done_rate, timeout_rate, threads, seed):
    r, v, d, lv, to = make_rollout(steps, envs, done_rate=done_rate, timeout_rate=timeout_rate, seed=seed)
    ref_adv, ref_ret = naive_gae(r, v, d, lv, gamma, lam, to)
    scale = term_scale(r, v, d, lv, gamma, lam, to)
    for backend in BACKENDS:
        adv, ret = compute_gae(r, v, d, lv, gamma=gamma, lam=lam, time_outs=to, backend=backend, num_threads=threads)
        assert_close(adv, ref_adv, scale, rtol=1e-5)
        assert_close(ret, ref_ret, scale, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Exact statistics (the gae command's normalisation)
# ----------------------------------------------------------------------------------------------------------------


def _correctly_rounded_sqrt(value: float, square: Fraction) -> bool:
    below, above = np.nextafter(value, 0.0), np.nextafter(value, np.inf)
    return ((Fraction(below) + Fraction(value)) / 2) ** 2 <= square <= ((Fraction(value) + Fraction(above)) / 2) ** 2


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=2, max_size=60),
    cut=st.integers(0, 60),
)
def test_exact_moments_are_exactly_rounded_and_blind_to_blocks(values, cut):
    x = np.array(values, np.float32)
    exact = [Fraction(float(v)) for v in x]
    mean = sum(exact) / len(exact)
    variance = sum((v - mean) ** 2 for v in exact) / (len(exact) - 1)
    whole = ExactMoments.of(x)
    parts = ExactMoments.of(x[cut:]).merge(ExactMoments.of(torch.from_numpy(x[:cut])))
    assert whole == parts
    assert whole.mean == float(mean)
    assert _correctly_rounded_sqrt(whole.std, variance)


def test_exact_moments_where_float64_sums_cancel():
    # |mean| >> std: float64 sums of squares would lose every digit of the variance
    x = (np.random.default_rng(1).standard_normal(5000) * 1e-3 + 1e4).astype(np.float32)
    exact = [Fraction(float(v)) for v in x]
    mean = sum(exact) / len(exact)
    moments = ExactMoments.of(x)
    assert moments.mean == float(mean)
    assert _correctly_rounded_sqrt(moments.std, sum((v - mean) ** 2 for v in exact) / (len(exact) - 1))


def test_exact_moments_edge_cases():
    assert math.isnan(ExactMoments.of(np.array([3.0], np.float32)).std)  # as torch's std of one value
    assert math.isnan(ExactMoments().mean)
    poisoned = ExactMoments.of(np.array([1.0, np.inf, 2.0], np.float32))
    assert math.isnan(poisoned.mean) and math.isnan(poisoned.std)  # as torch's mean/std
    summary = poisoned.as_dict()
    assert summary["count"] == 2 and summary["nonfinite"] == 1 and summary["mean"] == 1.5
    tiny = np.array([1e-45, -1e-45, 3e-39, 0.0, -0.0], np.float32)  # subnormals and signed zeros
    assert ExactMoments.of(tiny).mean == float(sum(Fraction(float(v)) for v in tiny) / 5)
    assert ExactMoments.of(np.full(7, 2.5, np.float32)).std == 0.0


def _numpy_rollout():
    rng = np.random.default_rng(1)
    r, v = rng.standard_normal((2, 300, 2048), dtype=np.float32)
    return r, v, (rng.random((300, 2048)) < 0.05).astype(np.uint8), rng.standard_normal(2048, dtype=np.float32)


def _gae_in_child(queue):
    queue.put(gae_arrays(*_numpy_rollout(), GAMMA, LAM, threads=4)[1].tobytes())  # no torch op: libgomp is not


def test_a_forked_child_computes_after_the_parent_used_the_threads():
    import multiprocessing

    expected = gae_arrays(*_numpy_rollout(), GAMMA, LAM, threads=4)[1].tobytes()  # the parent's pool starts here
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_gae_in_child, args=(queue,))
    child.start()
    result = queue.get(timeout=60)
    child.join(10)
    assert child.exitcode == 0 and result == expected
