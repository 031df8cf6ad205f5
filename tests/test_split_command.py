"""``rolloutcli split``: RSL-RL's split on every field, streaming, layouts, and the exact ``--unpad`` inverse."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import SAMPLE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_factory import rollout_arrays, write_rollout
from rsl_rl.utils import split_and_pad_trajectories as rsl_split


def _datasets(path: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as handle:
        handle.visititems(lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None)
    return out


def _rsl_hidden_at_starts(hidden: np.ndarray, dones: np.ndarray) -> torch.Tensor:
    """RSL-RL's recurrent_mini_batch_generator extraction, transcribed (all envs in one batch)."""
    dones_t = torch.tensor(dones)
    last_was_done = torch.zeros_like(dones_t, dtype=torch.bool)
    last_was_done[1:] = dones_t[:-1].bool()
    last_was_done[0] = True
    last_was_done = last_was_done.permute(1, 0)
    return torch.tensor(hidden).permute(2, 0, 1, 3)[last_was_done].transpose(1, 0).contiguous()


def test_matches_rsl_rl_on_every_field(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=30, N=6, end_rate=0.15, hidden="lstm", layers=2)
    arrays["dones"][0, 1] = 1  # a done at t = 0
    arrays["dones"][-1, 2] = 1  # and at t = T - 1
    source = write_rollout(tmp_path / "in.h5", arrays)
    code, out, err = cli("split", source, "-o", tmp_path / "s.h5", "--json", "-q")
    assert code == 0, err
    summary = json.loads(out)
    result = _datasets(tmp_path / "s.h5")
    dones = torch.tensor(arrays["dones"])
    for name, value in arrays.items():
        if name.startswith("hidden_states") or name == "last_values":
            continue
        expected, masks = rsl_split(torch.tensor(value), dones.unsqueeze(-1))
        assert result[name].dtype == value.dtype, name
        np.testing.assert_array_equal(result[name], expected.numpy(), err_msg=name)
    np.testing.assert_array_equal(result["masks"], masks.numpy())
    assert summary["trajectories"] == masks.shape[1] == result["trajectory_env"].shape[0]
    for path in ("hidden_states/actor/0", "hidden_states/actor/1", "hidden_states/critic/1"):
        np.testing.assert_array_equal(result[path], _rsl_hidden_at_starts(arrays[path], arrays["dones"]).numpy())
    # identifiable observations: trajectory m's first step is (trajectory_start[m], trajectory_env[m])
    first = result["observations/policy"][0, :, 0]
    np.testing.assert_array_equal(first, result["trajectory_start"] * 1000.0 + result["trajectory_env"])
    assert (result["masks"].sum(axis=0) == result["trajectory_length"]).all()
    per_env = np.bincount(result["trajectory_env"], weights=result["trajectory_length"], minlength=6)
    assert (per_env == 30).all()  # masks sum to T per env


@pytest.mark.parametrize(
    "args", [[], ["--pad-to", "longest"], ["--max-length", "4"], ["--pad-to", "longest", "--max-length", "7"]]
)
def test_unpad_is_exact(tmp_path: Path, cli, args: list[str]) -> None:
    arrays = rollout_arrays(T=25, N=5, end_rate=0.1, hidden="gru")
    arrays["observations/image"] = (np.arange(25 * 5 * 3).reshape(25, 5, 3) % 251).astype(np.uint8)
    arrays["extra_flags"] = np.ones((25, 5), bool)
    arrays["extra_meta"] = np.arange(7, dtype=np.int16)
    source = write_rollout(tmp_path / "in.h5", arrays, attrs={"gae_gamma": 0.9})
    assert cli("split", source, "-o", tmp_path / "s.h5", "-q", *args)[0] == 0
    code, _, err = cli("split", "--unpad", tmp_path / "s.h5", "-o", tmp_path / "back.h5", "-q")
    assert code == 0, err
    back = _datasets(tmp_path / "back.h5")
    assert sorted(back) == sorted(arrays)
    for name, value in arrays.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape, name
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    with h5py.File(tmp_path / "back.h5", "r") as handle:
        assert handle.attrs["rolloutcli_format"] == "rollout" and handle.attrs["gae_gamma"] == 0.9
        assert "split_fields" not in handle.attrs


def test_max_length_segments(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=20, N=3, end_rate=0.0, hidden="gru")
    source = write_rollout(tmp_path / "in.h5", arrays)
    assert cli("split", source, "-o", tmp_path / "s.h5", "-q", "--max-length", "6")[0] == 0
    result = _datasets(tmp_path / "s.h5")
    assert result["masks"].shape == (6, 12)  # ceil(20 / 6) = 4 segments per env, L = 6
    assert result["trajectory_start"].tolist() == [0, 6, 12, 18] * 3
    assert result["trajectory_length"].tolist() == [6, 6, 6, 2] * 3
    # each segment carries the hidden state of its own first step
    hidden = arrays["hidden_states/actor/0"]
    expected = hidden[result["trajectory_start"], :, result["trajectory_env"]].transpose(1, 0, 2)
    np.testing.assert_array_equal(result["hidden_states/actor/0"], expected)


def test_tiny_budget_identical(tmp_path: Path, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=40, N=30, end_rate=0.1, hidden="lstm"))
    assert cli("split", source, "-o", tmp_path / "a.h5", "-q")[0] == 0
    code, out, _ = cli("split", source, "-o", tmp_path / "b.h5", "-q", "--max-memory", "8K", "--json")
    assert code == 0 and json.loads(out)["blocks"] == 30
    a, b = _datasets(tmp_path / "a.h5"), _datasets(tmp_path / "b.h5")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name


def test_blowup_warning(tmp_path: Path, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=60, N=4, end_rate=0.5))
    code, _, err = cli("split", source, "-o", tmp_path / "s.h5")
    assert code == 0
    assert "warning: " in err and "use --pad-to longest or --max-length K" in err
    _, _, err = cli("split", source, "-o", tmp_path / "l.h5", "--pad-to", "longest")
    assert "warning" not in err


def test_unpad_refuses_rollout_file(tmp_path: Path, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays())
    code, _, err = cli("split", "--unpad", source, "-o", tmp_path / "o.h5")
    assert code == 1
    assert err.strip() == (
        f"error: {source}: field '/ (attribute rolloutcli_format)': expected 'trajectories' (a "
        "file written by rolloutcli split), found 'rollout'. --unpad reads the output of split."
    )


def test_usage_errors(tmp_path: Path, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays())
    assert cli("split", source, "-o", tmp_path / "o.h5", "--pad-to", "widest")[0] == 2
    assert cli("split", source, "-o", tmp_path / "o.h5", "--max-length", "0")[0] == 2
    assert cli("split", source)[0] == 2
    assert not (tmp_path / "o.h5").exists()


def test_sample(tmp_path: Path, cli) -> None:
    code, out, _ = cli("split", SAMPLE, "-o", tmp_path / "s.h5", "--json", "-q")
    assert code == 0 and json.loads(out)["trajectories"] == 88


DTYPES = [np.float32, np.float16, np.float64, np.uint8, np.int8, np.uint16, np.int32, np.uint64, np.bool_]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    T=st.integers(1, 9),
    N=st.integers(1, 5),
    rate=st.floats(0, 1),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 1000),
    max_length=st.one_of(st.none(), st.integers(1, 5)),
    pad_to=st.sampled_from(["rollout", "longest"]),
)
def test_round_trip_property(
    tmp_path_factory: pytest.TempPathFactory,
    cli,
    T: int,
    N: int,
    rate: float,
    dtype: type,
    seed: int,
    max_length: int | None,
    pad_to: str,
) -> None:
    folder = tmp_path_factory.mktemp("split")
    arrays = rollout_arrays(T, N, seed=seed, end_rate=rate, hidden="gru")
    rng = np.random.default_rng(seed)
    arrays["observations/policy"] = rng.integers(0, 2, size=(T, N, 3)).astype(dtype)
    source = write_rollout(folder / "in.h5", arrays)
    args = ["--pad-to", pad_to] + (["--max-length", str(max_length)] if max_length else [])
    assert cli("split", source, "-o", folder / "s.h5", "-q", *args)[0] == 0
    assert cli("split", "--unpad", folder / "s.h5", "-o", folder / "b.h5", "-q")[0] == 0
    back = _datasets(folder / "b.h5")
    for name, value in arrays.items():
        assert back[name].dtype == value.dtype
        np.testing.assert_array_equal(back[name], value, err_msg=name)


def _dataset_bytes(path: Path) -> dict[str, bytes]:
    return {name: value.tobytes() for name, value in _datasets(path).items()}


def test_extra_step_datasets_stream_at_any_budget(tmp_path: Path, cli) -> None:
    """Issue 12.2: gae's `rewards_raw` and a user's [T, N, 4] extra are split like fields, the same at any budget."""
    assert cli("gae", SAMPLE, "-o", tmp_path / "gae.h5", "-q")[0] == 0
    with h5py.File(tmp_path / "gae.h5", "a") as handle:
        assert "rewards_raw" in handle
        T, N = handle["rewards"].shape[:2]
        handle["user_extra"] = np.arange(T * N * 4, dtype=np.int32).reshape(T, N, 4)
    outputs = {}
    for budget in ("64K", "32K", None):
        out = tmp_path / f"s{budget}.h5"
        code, _, err = cli("split", tmp_path / "gae.h5", "-o", out, "-q", *(["--max-memory", budget] if budget else []))
        assert code == 0, err
        outputs[budget] = _dataset_bytes(out)
    assert outputs["64K"] == outputs[None] == outputs["32K"]
    with h5py.File(tmp_path / "s64K.h5", "r") as handle:
        assert handle["rewards_raw"].shape[:2] == handle["masks"].shape
        assert "user_extra" in handle.attrs["split_fields"]
    assert cli("split", "--unpad", tmp_path / "s64K.h5", "-o", tmp_path / "back.h5", "-q")[0] == 0
    original, back = _datasets(tmp_path / "gae.h5"), _datasets(tmp_path / "back.h5")
    assert sorted(original) == sorted(back)
    for name, value in original.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_internal_error_is_not_blamed_on_the_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug inside split surfaces as itself, never as "data unreadable, file corrupt"."""
    from rolloutcli.pipeline import split
    from rolloutcli.pipeline.options import RunOptions

    source = write_rollout(tmp_path / "in.h5", rollout_arrays())

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("an internal mistake")

    monkeypatch.setattr(split, "scatter_into_trajectories", broken)
    with pytest.raises(ValueError, match="an internal mistake"):
        split.run_split(source, tmp_path / "s.h5", split.SplitOptions(), RunOptions())
    assert not (tmp_path / "s.h5").exists()


def _rich_file(path: Path) -> Path:
    """A rollout whose attributes, datatypes and references split must keep (issues 12.7, 17.5, 17.6)."""
    arrays = rollout_arrays(T=10, N=3, end_rate=0.3, hidden="gru")
    with h5py.File(path, "w", libver="latest") as handle:
        handle.attrs["rolloutcli_format"] = "rollout"
        handle.attrs["big"] = np.arange(50_000, dtype=np.float32)  # 200 KB: dense attribute storage
        handle["float_be"] = np.dtype(">f4")  # a committed datatype
        for name, value in arrays.items():
            dtype = handle["float_be"] if name == "actions" else (">f4" if name == "values" else value.dtype)
            handle.create_dataset(name, data=value, dtype=dtype)
        handle["distribution"].attrs["order"] = ["std", "mean"]  # not the sorted order
        handle["observations"].attrs["source"] = "sim"
        handle["rewards"].attrs["units"] = "points"
        handle["step_index"] = np.arange(10)
        handle["step_index"].make_scale("t")
        handle["rewards"].dims[0].attach_scale(handle["step_index"])
        handle.attrs["main"] = handle["values"].ref
    return path


def test_split_and_unpad_keep_attributes_types_and_references(tmp_path: Path, cli) -> None:
    source = _rich_file(tmp_path / "in.h5")
    code, _, err = cli("split", source, "-o", tmp_path / "s.h5", "-q")
    assert code == 0, err
    with h5py.File(tmp_path / "s.h5", "r") as handle:
        assert list(handle["distribution"].attrs["order"]) == ["std", "mean"]
        assert handle["rewards"].attrs["units"] == "points"
        assert handle["values"].dtype == np.dtype(">f4")
        assert handle["actions"].id.get_type().committed()
        assert handle[handle.attrs["main"]].name == "/values"  # re-pointed, not dangling
        assert handle["rewards"].dims[0][0].name == "/step_index"
        assert handle.attrs["big"].size == 50_000
    code, _, err = cli("split", "--unpad", tmp_path / "s.h5", "-o", tmp_path / "back.h5", "-q")
    assert code == 0, err
    from rolloutcli import RolloutStorage

    assert RolloutStorage.from_hdf5(tmp_path / "back.h5").distribution_names == ["std", "mean"]
    with h5py.File(source, "r") as before, h5py.File(tmp_path / "back.h5", "r") as after:
        for name in ("", "distribution", "observations", "rewards", "values", "actions"):
            old, new = (before[name], after[name]) if name else (before, after)
            assert sorted(old.attrs) == sorted(new.attrs), name
        assert sorted(after.attrs) == sorted(before.attrs)
        assert after[after.attrs["main"]].name == "/values"
        assert after["values"].dtype == np.dtype(">f4") and after["actions"].id.get_type().committed()
        assert after["rewards"].dims[0][0].name == "/step_index"
        assert after["step_index"].attrs["REFERENCE_LIST"][0][0]  # the scale points back, into this file
        assert after[after["step_index"].attrs["REFERENCE_LIST"][0][0]].name == "/rewards"
        for name in ("actions", "values", "rewards", "observations/policy", "distribution/std"):
            np.testing.assert_array_equal(after[name][()], before[name][()], err_msg=name)


def test_equal_runs_write_equal_bytes(tmp_path: Path, cli) -> None:
    """No modification times in the output's object headers: two runs, at any budget, give the same file."""
    import time

    src = SAMPLE
    outputs = []
    for i, budget in enumerate(("1G", "1G", "64K")):
        outputs.append(tmp_path / f"t{i}.h5")
        assert cli("split", src, "-o", outputs[-1], "-q", "--max-memory", budget)[0] == 0
        time.sleep(1.1)  # HDF5 times have one-second resolution
    assert outputs[0].read_bytes() == outputs[1].read_bytes() == outputs[2].read_bytes()
    restored = [tmp_path / "u0.h5", tmp_path / "u1.h5"]
    for path in restored:
        assert cli("split", "--unpad", outputs[0], "-o", path, "-q")[0] == 0
        time.sleep(1.1)
    assert restored[0].read_bytes() == restored[1].read_bytes()


def test_padding_the_disk_cannot_hold_is_refused_before_writing(tmp_path: Path, cli, monkeypatch) -> None:
    """Padding made a 300 KB input a 30 MB output with no look at the disk: now needed, free and where (exit 3)."""
    import shutil

    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=1000, N=8, end_rate=0.1))
    code, out, err = cli("split", source, "-o", tmp_path / "fits.h5", "--json", "-q")
    assert code == 0, err
    padded = json.loads(out)["padded_bytes"]
    assert padded > 8 << 20 and (tmp_path / "fits.h5").stat().st_size > padded
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10 << 30, 0, 4 << 20))
    dst = tmp_path / "out.h5"
    code, _, err = cli("split", source, "-o", dst, "-q")
    assert code == 3 and not dst.exists() and not [p for p in tmp_path.iterdir() if "rolloutcli-tmp" in p.name]
    need = err.split("needs ")[1].split("M ")[0]
    assert int(need) >= padded >> 20
    assert err.strip() == (
        f"error: {dst}: the output needs {need}M of disk (uncompressed), 4M is free on the file system holding "
        f"{tmp_path.resolve()}; free some space or write the output elsewhere."
    )
