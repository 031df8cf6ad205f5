"""The CPU path of ``rolloutcli gae``: the numpy kernel API equals the torch API bit for bit, the compiled C file
changes no byte of the output, the command never imports torch, and the file copy is exact and fails loudly."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.core import gae_numpy, native
from rolloutcli.core.gae import bootstrap_time_outs, compute_gae
from rolloutcli.core.gae_numpy import bootstrap_rewards, gae_arrays, normalize_array
from rolloutcli.hdf5 import filecopy
from rolloutcli.hdf5.filecopy import copy_file_bytes
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
    assert np.array_equal(_bits(bootstrap_rewards(r, v, to, gamma)), _bits(expected))
    # float64 rewards: the same promotion as torch (the product in float32, the sum in float64)
    r64 = r.astype(np.float64) * (1 + 1e-9)
    expected64 = torch.from_numpy(r64) + gamma * (torch.from_numpy(v) * torch.from_numpy(to != 0))
    assert np.array_equal(bootstrap_rewards(r64, v, to, gamma), expected64.numpy())


@pytest.mark.parametrize(("mean", "std"), [(0.1234567891, 2.718281828), (-1e6, 1e-9), (0.0, 0.0), (5.0, 3e30)])
def test_numpy_normalisation_is_rsl_rl_expression_bits(mean: float, std: float) -> None:
    a = _awkward_floats((50, 20), 4)
    t = torch.from_numpy(a)
    expected = (t - torch.tensor(mean, dtype=torch.float32)) / (torch.tensor(std, dtype=torch.float32) + 1e-8)
    assert np.array_equal(_bits(normalize_array(a, mean, std)), _bits(expected))


@pytest.mark.parametrize(("T", "N"), [(1, 1), (300, 1), (57, 40), (1000, 3)])
def test_gae_arrays_equal_compute_gae_bits(T: int, N: int) -> None:
    r, v = _awkward_floats((T, N), T), _awkward_floats((T, N), N)
    d = (np.random.default_rng(5).random((T, N)) < 0.1).astype(np.uint8)
    lv = _awkward_floats((N,), 6)
    adv, ret = gae_arrays(r, v, d, lv, 0.99, 0.95)
    ref_adv, ref_ret = compute_gae(*(torch.from_numpy(x) for x in (r, v, d, lv)), gamma=0.99, lam=0.95)
    assert np.array_equal(_bits(adv), _bits(ref_adv)) and np.array_equal(_bits(ret), _bits(ref_ret))


def test_gae_arrays_refuse_what_c_would_misread() -> None:
    r = np.zeros((10, 4), np.float32)
    d = np.zeros((10, 4), np.uint8)
    lv = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"values: expected a C-contiguous float32 array of shape \[10, 4\]"):
        gae_arrays(r, r.astype(np.float64), d, lv, 0.99, 0.95)
    with pytest.raises(ValueError, match=r"last_values: expected a C-contiguous float32 array of shape \[4\]"):
        gae_arrays(r, r, d, lv[:3], 0.99, 0.95)
    with pytest.raises(ValueError, match="dones: expected a C-contiguous uint8"):
        gae_arrays(r, r, np.asfortranarray(d), lv, 0.99, 0.95)
    with pytest.raises(ValueError, match="advantages: expected a writeable array"):
        frozen = np.zeros((10, 4), np.float32)
        frozen.flags.writeable = False
        gae_arrays(r, r, d, lv, 0.99, 0.95, out=(frozen, np.zeros((10, 4), np.float32)))


def test_ci_builds_the_c_kernel() -> None:
    # .ci/run sets this: there the kernel must have been compiled, so the compiled paths really ran.
    if os.environ.get("ROLLOUTCLI_REQUIRE_NATIVE") == "1":
        assert native.library() is not None, "the C kernels (rolloutcli/core/_native.c) were not compiled"


def _datasets(path: Path) -> dict[str, bytes]:
    with h5py.File(path, "r") as handle:
        return {name: handle[name][()].tobytes() for name in ("advantages", "returns", "rewards", "rewards_raw")}


@pytest.mark.parametrize("max_memory", ["1G", "16K"])
def test_without_the_c_kernel_the_command_writes_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli, max_memory: str
) -> None:
    if native.library() is None:
        pytest.skip("the C kernel was not compiled in this install")
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=300, N=37, end_rate=0.05, seed=9))
    assert cli("gae", source, "-o", tmp_path / "compiled.h5", "--max-memory", max_memory, "-q")[0] == 0
    monkeypatch.setattr(native, "library", lambda: None)
    calls = []
    real_loop = gae_numpy._gae_loop
    monkeypatch.setattr(gae_numpy, "_gae_loop", lambda *args: calls.append(1) or real_loop(*args))
    assert cli("gae", source, "-o", tmp_path / "numpy.h5", "--max-memory", max_memory, "-q")[0] == 0
    assert calls, "the numpy loop did not run"
    assert _datasets(tmp_path / "compiled.h5") == _datasets(tmp_path / "numpy.h5")


def test_gae_command_does_not_import_torch(tmp_path: Path) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=20, N=4, end_rate=0.2))
    code = (
        "import sys; from rolloutcli.cli.app import main; "
        f"rc = main(['gae', {str(source)!r}, '-o', {str(tmp_path / 'out.h5')!r}, '-q']); "
        "assert rc == 0, rc; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
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


def test_copy_error_reaches_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(b"x" * 10000)

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filecopy.os, "copy_file_range", full)
    with pytest.raises(OSError) as error:
        copy_file_bytes(source, tmp_path / "dst.bin")
    assert error.value.errno == errno.ENOSPC


def test_disk_full_during_the_copy_is_exit_3_and_leaves_nothing(tmp_path: Path, monkeypatch, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=20, N=4))

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filecopy.os, "copy_file_range", full)
    code, _, err = cli("gae", source, "-o", tmp_path / "o.h5")
    assert code == 3 and "No space left on device" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5"]


def test_run_gae_library_entry_point(tmp_path: Path) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=30, N=5, seed=2))
    summary = run_gae(source, tmp_path / "o.h5", GaeOptions(gamma=0.9), RunOptions(max_memory=2048))
    assert summary["gamma"] == 0.9 and summary["blocks"] > 1
    assert summary["advantages"]["count"] == 150
