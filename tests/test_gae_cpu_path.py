"""The torch-free CPU path of ``rolloutcli gae``: numpy kernels equal the torch API bit for bit, the command
never imports torch, and the background file copy is exact, reports progress and fails loudly."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path
from unittest import mock

import h5py
import numpy as np
import pytest
import torch
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.core import gae_kernels, native
from rolloutcli.core.gae import bootstrap_time_outs, compute_gae, normalize_with
from rolloutcli.core.gae_kernels import bootstrap_time_outs_array, cpu_threads, gae_into, normalize_array
from rolloutcli.core.moments import EnvMoments, Moments
from rolloutcli.hdf5 import filecopy
from rolloutcli.hdf5.filecopy import BackgroundCopy, copy_file_bytes
from rolloutcli.pipeline.gae import GaeOptions, run_gae
from rolloutcli.pipeline.options import RunOptions


def _bits(x: np.ndarray | torch.Tensor) -> np.ndarray:
    array = x.numpy() if isinstance(x, torch.Tensor) else x
    return np.ascontiguousarray(array).view(np.uint32)


def _awkward_floats(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random float32 with huge, tiny, subnormal and negative-zero entries sprinkled in."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 6, shape)).astype(np.float32)
    specials = np.array([3e38, -3e38, 1e-40, -0.0, 1e-30], np.float32)
    mask = rng.random(shape) < 0.05
    x[mask] = rng.choice(specials, int(mask.sum()))
    return x


@pytest.mark.parametrize("gamma", [0.99, 0.3, 1.0, 0.0])
def test_numpy_bootstrap_equals_torch_bits(gamma: float) -> None:
    r, v = _awkward_floats((64, 33), 1), _awkward_floats((64, 33), 2)
    to = (np.random.default_rng(3).random((64, 33)) < 0.3).astype(np.uint8)
    expected = bootstrap_time_outs(torch.from_numpy(r), torch.from_numpy(v), torch.from_numpy(to), gamma)
    assert np.array_equal(_bits(bootstrap_time_outs_array(r, v, to, gamma)), _bits(expected))


@pytest.mark.parametrize(("mean", "std"), [(0.1234567891, 2.718281828), (-1e6, 1e-9), (0.0, 0.0), (5.0, 3e30)])
def test_numpy_normalisation_equals_torch_bits(mean: float, std: float) -> None:
    a = _awkward_floats((50, 20), 4)
    expected = normalize_with(torch.from_numpy(a), mean, std)
    assert np.array_equal(_bits(normalize_array(a, mean, std)), _bits(expected))


@pytest.mark.parametrize(("T", "N"), [(1, 1), (300, 1), (57, 40), (1000, 3)])
def test_gae_into_equals_compute_gae_bits(T: int, N: int) -> None:
    arrays = rollout_arrays(T=T, N=N, end_rate=0.1, seed=T + N)
    r = arrays["rewards"].reshape(T, N).astype(np.float32)
    v = arrays["values"].reshape(T, N).astype(np.float32)
    d = arrays["dones"].reshape(T, N).astype(np.uint8)
    to = arrays["time_outs"].reshape(T, N).astype(np.uint8)
    lv = arrays["last_values"].reshape(N).astype(np.float32)
    adv, ret = np.empty((T, N), np.float32), np.empty((T, N), np.float32)
    gae_into(r, v, d, lv, to, 0.99, 0.95, cpu_threads(), adv, ret)
    tensors = [torch.from_numpy(x) for x in (r, v, d, lv)]
    ref_adv, ref_ret = compute_gae(*tensors, gamma=0.99, lam=0.95, time_outs=torch.from_numpy(to))
    assert np.array_equal(_bits(adv), _bits(ref_adv)) and np.array_equal(_bits(ret), _bits(ref_ret))


NATIVE = native.gae_kernel()
needs_native = pytest.mark.skipif(NATIVE is None, reason="the C kernel was not compiled in this install")


def _rollout(T: int, N: int, seed: int) -> tuple[np.ndarray, ...]:
    arrays = rollout_arrays(T=T, N=N, end_rate=0.1, seed=seed)
    r = arrays["rewards"].reshape(T, N).astype(np.float32)
    v = arrays["values"].reshape(T, N).astype(np.float32)
    d = arrays["dones"].reshape(T, N).astype(np.uint8)
    to = arrays["time_outs"].reshape(T, N).astype(np.uint8)
    lv = arrays["last_values"].reshape(N).astype(np.float32)
    return r, v, d, to, lv


def _rsl_rl_loop(r, v, d, to, lv, gamma, lam):
    """RSL-RL's process_env_step bootstrap + compute_returns, step by step in torch float32."""
    rewards, values = torch.from_numpy(r).clone(), torch.from_numpy(v)
    if to is not None:
        rewards += gamma * values * torch.from_numpy(to).float()
    dones, last = torch.from_numpy(d), torch.from_numpy(lv)
    advantage = torch.zeros_like(last)
    returns = torch.zeros_like(values)
    for step in reversed(range(r.shape[0])):
        next_values = last if step == r.shape[0] - 1 else values[step + 1]
        not_terminal = 1.0 - dones[step].float()
        delta = rewards[step] + not_terminal * gamma * next_values - values[step]
        advantage = delta + not_terminal * gamma * lam * advantage
        returns[step] = advantage + values[step]
    return returns


@needs_native
@pytest.mark.parametrize(("T", "N"), [(1, 1), (1, 5), (300, 1), (57, 40), (3000, 2), (8, 1000)])
@pytest.mark.parametrize("with_time_outs", [True, False])
def test_native_kernel_returns_are_rsl_rl_bits(T: int, N: int, with_time_outs: bool) -> None:
    r, v, d, to, lv = _rollout(T, N, seed=T * N)
    to = to if with_time_outs else None
    adv, ret = np.empty((T, N), np.float32), np.empty((T, N), np.float32)
    NATIVE(r, v, d, to, lv, 0.99, 0.95, adv, ret)
    assert np.array_equal(_bits(ret), _bits(_rsl_rl_loop(r, v, d, to, lv, 0.99, 0.95)))
    assert np.array_equal(_bits(ret), _bits(adv + v))  # returns = A + V, in float32
    # The numba kernel unchunked (one thread, no time chunks) computes the same operations in the same order.
    nb_adv, nb_ret = np.empty_like(adv), np.empty_like(ret)
    with mock.patch.multiple(gae_kernels, _MIN_CHUNK=1 << 30):
        gae_into(r, v, d, lv, to, 0.99, 0.95, 1, nb_adv, nb_ret)
    assert np.array_equal(_bits(adv), _bits(nb_adv)) and np.array_equal(_bits(ret), _bits(nb_ret))


def test_ci_builds_the_c_kernel() -> None:
    # .ci/run sets this: there the kernel must have been compiled, so the tests above really ran.
    if os.environ.get("ROLLOUTCLI_REQUIRE_NATIVE") == "1":
        assert NATIVE is not None, "the C kernels (rolloutcli/core/_native.c) were not compiled by the install"


@needs_native
def test_native_kernel_refuses_what_it_would_misread() -> None:
    r, v, d, to, lv = _rollout(10, 4, seed=1)
    adv, ret = np.empty((10, 4), np.float32), np.empty((10, 4), np.float32)
    with pytest.raises(ValueError, match=r"values: expected a C-contiguous float32 array of shape \[10, 4\]"):
        NATIVE(r, v.astype(np.float64), d, to, lv, 0.99, 0.95, adv, ret)
    with pytest.raises(ValueError, match=r"last_values: expected a C-contiguous float32 array of shape \[4\]"):
        NATIVE(r, v, d, to, lv[:3], 0.99, 0.95, adv, ret)
    with pytest.raises(ValueError, match="dones: expected a C-contiguous uint8"):
        NATIVE(r, v, np.asfortranarray(d), to, lv, 0.99, 0.95, adv, ret)


def test_without_the_c_kernel_the_command_falls_back_to_numba(tmp_path: Path, monkeypatch) -> None:
    arrays = rollout_arrays(T=30, N=5, end_rate=0.1, seed=9)
    source = write_rollout(tmp_path / "in.h5", arrays)
    run_gae(source, tmp_path / "native.h5", GaeOptions(), RunOptions())
    monkeypatch.setattr(native, "gae_kernel", lambda: None)
    calls = []
    real_gae_into = gae_kernels.gae_into
    monkeypatch.setattr(gae_kernels, "gae_into", lambda *args: calls.append(1) or real_gae_into(*args))
    run_gae(source, tmp_path / "numba.h5", GaeOptions(), RunOptions())
    assert calls, "the numba fallback did not run"
    with h5py.File(tmp_path / "native.h5") as a, h5py.File(tmp_path / "numba.h5") as b:
        for name in ("advantages", "returns"):
            assert np.array_equal(a[name][()].view(np.uint32), b[name][()].view(np.uint32)), name


def test_moments_take_arrays_and_tensors_alike() -> None:
    a = np.array([[1.0, np.nan], [3.0, np.inf]], np.float32)
    from_array, from_tensor = Moments.of(a), Moments.of(torch.from_numpy(a))
    assert from_array == from_tensor
    assert (from_array.count, from_array.mean, from_array.nonfinite) == (2, 2.0, 2)
    assert from_array.std == pytest.approx(np.std([1.0, 3.0], ddof=1))
    left, right = EnvMoments(), EnvMoments()
    b = np.random.default_rng(0).standard_normal((30, 6)).astype(np.float32)
    left.add(b)
    right.add(torch.from_numpy(b[:, :2]))
    right.add(b[:, 2:])
    assert left.mean_std() == right.mean_std()


def test_cpu_path_equals_torch_path_bit_for_bit(tmp_path: Path) -> None:
    # "cpu:0" is not "cpu": it takes the torch branch (compute_gae on tensors), here on the CPU.
    arrays = rollout_arrays(T=64, N=9, end_rate=0.1, seed=5)
    source = write_rollout(tmp_path / "in.h5", arrays)
    outputs = {}
    for device in ("cpu", "cpu:0"):
        out = tmp_path / f"{device.replace(':', '_')}.h5"
        run_gae(source, out, GaeOptions(), RunOptions(device=device, max_memory=4096))
        with h5py.File(out, "r") as handle:
            outputs[device] = {name: handle[name][()] for name in ("advantages", "returns", "rewards")}
    for name in ("advantages", "returns", "rewards"):
        assert np.array_equal(outputs["cpu"][name].view(np.uint32), outputs["cpu:0"][name].view(np.uint32)), name


def test_gae_command_imports_neither_torch_nor_numba(tmp_path: Path) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=20, N=4, end_rate=0.2))
    code = (
        "import sys; from rolloutcli.cli import main; "
        f"rc = main(['gae', {str(source)!r}, '-o', {str(tmp_path / 'out.h5')!r}, '-q']); "
        "assert rc == 0, rc; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    # numba is loaded only as the fallback where the C kernel was not compiled
    code += "; from rolloutcli.core.native import gae_kernel; "
    code += "assert 'numba' not in sys.modules or gae_kernel() is None, 'numba was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out.h5").exists()


def test_copy_file_bytes_is_exact_and_reports_every_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(filecopy, "COPY_STEP", 4096)  # many steps
    source = tmp_path / "src.bin"
    payload = np.random.default_rng(0).integers(0, 256, 4096 * 5 + 123, dtype=np.uint8).tobytes()
    source.write_bytes(payload)
    steps: list[int] = []
    copy_file_bytes(source, tmp_path / "dst.bin", steps.append)
    assert (tmp_path / "dst.bin").read_bytes() == payload
    assert sum(steps) == len(payload) and len(steps) == 6


def test_background_copy_waits_reports_and_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(filecopy, "COPY_STEP", 1024)
    source = tmp_path / "src.bin"
    payload = bytes(range(256)) * 40
    source.write_bytes(payload)
    reported: list[int] = []
    with BackgroundCopy(source, tmp_path / "dst.bin") as copy:
        copy.wait(reported.append, poll=0.001)
        assert copy.done
    assert (tmp_path / "dst.bin").read_bytes() == payload and sum(reported) == len(payload)
    # Leaving the block early stops the copy and joins the thread: nothing writes afterwards.
    release = threading.Event()
    real = filecopy.os.copy_file_range

    def slow(*args: object) -> int:
        release.wait(5)
        return real(*args)

    monkeypatch.setattr(filecopy.os, "copy_file_range", slow)
    with pytest.raises(RuntimeError), BackgroundCopy(source, tmp_path / "stopped.bin") as copy:
        release.set()
        raise RuntimeError("validation failed")
    assert not copy._thread.is_alive()
    assert (tmp_path / "stopped.bin").stat().st_size < len(payload)


def test_background_copy_raises_the_copy_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(b"x" * 10000)

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filecopy.os, "copy_file_range", full)
    with BackgroundCopy(source, tmp_path / "dst.bin") as copy, pytest.raises(OSError) as error:
        copy.wait()
    assert error.value.errno == errno.ENOSPC
