"""RolloutStorage: drop-in behaviour against RSL-RL's own storage, and the exact HDF5 round trip."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import SAMPLE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_factory import make_rollout, rollout_arrays, write_rollout
from rsl_rl.storage import RolloutStorage as RslStorage
from tensordict import TensorDict

from rolloutcli import RolloutStorage


def _fill(storage_cls, T: int = 5, N: int = 4, lstm: bool = True, tensordict: bool = True):
    generator = torch.Generator().manual_seed(0)
    obs = {"policy": torch.zeros(N, 3), "critic": torch.zeros(N, 2)}
    if tensordict:
        obs = TensorDict(obs, batch_size=[N])
    storage = storage_cls("rl", N, T, obs, (2,), "cpu")
    for _ in range(T):
        transition = storage_cls.Transition()
        observations = {
            "policy": torch.randn(N, 3, generator=generator),
            "critic": torch.randn(N, 2, generator=generator),
        }
        transition.observations = TensorDict(observations, batch_size=[N]) if tensordict else observations
        transition.actions = torch.randn(N, 2, generator=generator)
        transition.rewards = torch.randn(N, generator=generator)
        transition.dones = (torch.rand(N, generator=generator) < 0.3).to(torch.uint8)
        transition.values = torch.randn(N, 1, generator=generator)
        transition.actions_log_prob = torch.randn(N, generator=generator)
        transition.distribution_params = (torch.randn(N, 2, generator=generator), torch.rand(N, 2, generator=generator))
        h = torch.randn(1, N, 4, generator=generator)
        c = torch.randn(1, N, 4, generator=generator)
        transition.hidden_states = ((h, c) if lstm else h, (c, h) if lstm else c)
        storage.add_transition(transition)
    return storage


@pytest.mark.parametrize("lstm", [True, False])
def test_add_transition_matches_rsl_rl(lstm: bool) -> None:
    ours, theirs = _fill(RolloutStorage, lstm=lstm), _fill(RslStorage, lstm=lstm)
    for key in ("policy", "critic"):
        assert torch.equal(ours.observations[key], theirs.observations[key])
    for name in ("actions", "rewards", "dones", "values", "actions_log_prob", "returns", "advantages"):
        mine, ref = getattr(ours, name), getattr(theirs, name)
        assert mine.dtype == ref.dtype and torch.equal(mine, ref), name
    for mine, ref in zip(ours.distribution_params, theirs.distribution_params, strict=True):
        assert torch.equal(mine, ref)
    for attribute in ("saved_hidden_state_a", "saved_hidden_state_c"):
        mine, ref = getattr(ours, attribute), getattr(theirs, attribute)
        assert len(mine) == len(ref) == (2 if lstm else 1)
        for a, b in zip(mine, ref, strict=True):
            assert torch.equal(a, b)
    assert ours.step == theirs.step == 5


def test_overflow_and_clear() -> None:
    storage = _fill(RolloutStorage, T=2, tensordict=False)
    transition = RolloutStorage.Transition()
    with pytest.raises(OverflowError, match="Rollout buffer overflow"):
        storage.add_transition(transition)
    storage.clear()
    assert storage.step == 0


def test_round_trip_storage_file_storage(tmp_path: Path) -> None:
    storage = _fill(RolloutStorage, lstm=True, tensordict=False)
    storage.distribution_names = ["mean", "std"]
    storage.to_hdf5(tmp_path / "out.h5")
    back = RolloutStorage.from_hdf5(tmp_path / "out.h5")
    for key in ("policy", "critic"):
        assert torch.equal(back.observations[key], storage.observations[key])
    for name in ("actions", "rewards", "dones", "values", "actions_log_prob"):
        assert torch.equal(getattr(back, name), getattr(storage, name)), name
    assert back.distribution_names == ["mean", "std"]
    assert all(torch.equal(a, b) for a, b in zip(back.distribution_params, storage.distribution_params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(back.saved_hidden_state_c, storage.saved_hidden_state_c, strict=True))


def test_to_hdf5_refuses_overwrite(tmp_path: Path) -> None:
    storage = _fill(RolloutStorage, tensordict=False)
    storage.to_hdf5(tmp_path / "out.h5")
    from rolloutcli import RolloutError

    with pytest.raises(RolloutError, match="already exists"):
        storage.to_hdf5(tmp_path / "out.h5")
    storage.to_hdf5(tmp_path / "out.h5", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out.h5"]  # no temporary left behind


DTYPES = [np.float32, np.float16, np.float64, np.uint8, np.int16, np.int64, np.bool_]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    T=st.integers(1, 8),
    N=st.integers(1, 5),
    obs_dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 99),
    hidden=st.sampled_from([None, "gru", "lstm"]),
)
def test_round_trip_file_storage_file(
    tmp_path_factory: pytest.TempPathFactory, T: int, N: int, obs_dtype: type, seed: int, hidden: str | None
) -> None:
    """file -> storage -> file keeps every dataset's values (and observation dtypes) exactly."""
    folder = tmp_path_factory.mktemp("rt")
    arrays = rollout_arrays(T, N, seed=seed, hidden=hidden)
    arrays["observations/policy"] = (arrays["observations/policy"] % 2).astype(obs_dtype)
    source = write_rollout(folder / "in.h5", arrays)
    RolloutStorage.from_hdf5(source).to_hdf5(folder / "out.h5")
    with h5py.File(folder / "out.h5", "r") as handle:
        for name, value in arrays.items():
            stored = handle[name][()]
            assert stored.dtype == value.dtype or name in ("dones", "time_outs"), name
            np.testing.assert_array_equal(stored, value, err_msg=name)


def test_env_slice(tmp_path: Path) -> None:
    path = make_rollout(tmp_path / "r.h5", T=6, N=5)
    part = RolloutStorage.from_hdf5(path, envs=slice(1, 4))
    assert part.num_envs == 3 and part.observations["policy"].shape == (6, 3, 4)
    # identifiable data: env index is the integer part modulo 1000
    assert part.observations["policy"][0, :, 0].tolist() == [1.0, 2.0, 3.0]
    assert part.saved_hidden_state_a[0].shape == (6, 1, 3, 3)


def test_sample_loads() -> None:
    storage = RolloutStorage.from_hdf5(SAMPLE)
    assert storage.num_envs == 16 and storage.num_transitions_per_env == 256
    assert storage.time_outs is not None and storage.last_values is not None
    assert len(storage.saved_hidden_state_a) == 1


def test_to_hdf5_before_compute_returns_writes_no_advantages(tmp_path: Path, cli) -> None:
    """Issue 12.5: the zeros of a fresh storage are not advantages; batch then asks for gae."""
    storage = _fill(RolloutStorage, tensordict=False)
    storage.to_hdf5(tmp_path / "raw.h5")
    with h5py.File(tmp_path / "raw.h5", "r") as handle:
        assert "advantages" not in handle and "returns" not in handle and "values" in handle
    code, _, err = cli("batch", tmp_path / "raw.h5", "-o", tmp_path / "shards", "-m", "2")
    assert code == 1 and "Run `rolloutcli gae` first." in err
    storage.last_values = torch.zeros(4, 1)
    storage.compute_returns()
    storage.to_hdf5(tmp_path / "gae.h5")
    back = RolloutStorage.from_hdf5(tmp_path / "gae.h5")
    assert torch.equal(back.advantages, storage.advantages) and torch.equal(back.returns, storage.returns)
    back.to_hdf5(tmp_path / "again.h5")  # loaded advantages count as computed
    with h5py.File(tmp_path / "again.h5", "r") as handle:
        assert "advantages" in handle and "returns" in handle


def test_from_hdf5_observations_are_a_tensordict(tmp_path: Path) -> None:
    path = make_rollout(tmp_path / "r.h5", T=6, N=5)
    storage = RolloutStorage.from_hdf5(path)
    assert isinstance(storage.observations, TensorDict) and storage.observations.batch_size == (6, 5)
    assert sorted(storage.observations.keys()) == ["critic", "policy"]
    plain = RolloutStorage.from_hdf5(path, tensordict=False)
    assert isinstance(plain.observations, dict)
    assert torch.equal(plain.observations["policy"], storage.observations["policy"])


@pytest.mark.parametrize("recurrent", [False, True])
def test_mini_batches_before_compute_returns_are_refused(tmp_path: Path, recurrent: bool) -> None:
    """Issue 40.13: the zeros of a storage never computed (and a file without advantages) are not advantages."""
    from rolloutcli.errors import RolloutError

    storage = _fill(RolloutStorage, tensordict=False)
    storage.to_hdf5(tmp_path / "raw.h5")
    loaded = RolloutStorage.from_hdf5(tmp_path / "raw.h5")
    name = "recurrent_mini_batch_generator" if recurrent else "mini_batch_generator"
    found = "the zeros of a storage whose compute_returns() was never called (and whose file held none)"
    for where, source in (("RolloutStorage", storage), (str(tmp_path / "raw.h5"), loaded)):
        with pytest.raises(RolloutError) as error:
            next(getattr(source, name)(2, 1))
        assert str(error.value) == (
            f"{where}: field 'advantages': expected advantages and returns computed before mini-batches, found "
            f"{found}. Call storage.compute_returns() first."
        )
    storage.last_values = torch.zeros(4, 1)
    storage.compute_returns()
    assert next(getattr(storage, name)(2, 1)).advantages.abs().sum() > 0


def test_from_hdf5_holds_one_copy_of_a_large_field(tmp_path: Path) -> None:
    """Issue 40.13: a 512 MiB field of compressed zeros loads within one copy of it and a chunk (the storage was
    built with buffers of its own, then given the loaded ones: twice the field); measured in a fresh process
    against its own baseline."""
    import subprocess
    import sys
    import zlib

    T, N, D = 16, 8, (512 << 20) // (4 * 16 * 8)
    arrays = rollout_arrays(T, N, hidden=None)
    path = write_rollout(tmp_path / "zeros.h5", {k: v for k, v in arrays.items() if k != "observations/critic"})
    with h5py.File(path, "a") as handle:
        field = handle.create_dataset(
            "observations/critic", (T, N, D), np.float32, chunks=(1, 8, D), compression="gzip"
        )
        blob = zlib.compress(bytes(4 * 8 * D), 1)
        for t in range(T):
            field.id.write_direct_chunk((t, 0, 0), blob)
    script = (
        "import resource, sys, torch, tensordict\n"
        "from rolloutcli import RolloutStorage\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "storage = RolloutStorage.from_hdf5(sys.argv[1])\n"
        f"assert storage.observations['critic'].shape == (16, 8, {D}) and storage.returns.shape == (16, 8, 1)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True)
    assert int(out.stdout) < (512 << 20) * 1.3, out.stdout
