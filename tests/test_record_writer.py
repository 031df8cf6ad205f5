"""``rolloutcli.record.RolloutWriter``: round trip, blocks, validation messages, atomic publish."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from rollout_factory import rollout_arrays, write_rollout
from tensordict import TensorDict

from rolloutcli.errors import RolloutError
from rolloutcli.record import RolloutWriter
from rolloutcli.record import writer as writer_module


def _step(arrays: dict[str, np.ndarray], t: int) -> dict:
    return {
        "observations": {"policy": arrays["observations/policy"][t], "critic": arrays["observations/critic"][t]},
        "actions": arrays["actions"][t],
        "rewards": arrays["rewards"][t],
        "dones": arrays["dones"][t],
        "time_outs": arrays["time_outs"][t],
        "values": arrays["values"][t],
        "actions_log_prob": arrays["actions_log_prob"][t],
        "distribution": {"mean": arrays["distribution/mean"][t], "std": arrays["distribution/std"][t]},
        "hidden_states": {"actor": arrays["hidden_states/actor/0"][t], "critic": arrays["hidden_states/critic/0"][t]},
    }


def _record(path: Path, arrays: dict[str, np.ndarray], **kwargs) -> Path:
    T, N = arrays["rewards"].shape
    with RolloutWriter(path, num_envs=N, num_steps=T, **kwargs) as writer:
        for t in range(T):
            writer.add(_step(arrays, t))
        writer.close(last_values=torch.tensor(arrays["last_values"]))
    return path


def _read(path: Path) -> dict:
    out = {}
    with h5py.File(path, "r") as handle:
        handle.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        out["__attrs__"] = dict(handle.attrs)
    return out


@pytest.mark.parametrize("block_bytes", [1, 1 << 30])
def test_round_trip_and_gae(tmp_path: Path, cli, monkeypatch, block_bytes: int) -> None:
    monkeypatch.setattr(writer_module, "_BLOCK_BYTES", block_bytes)  # a block per step, or one block
    arrays = rollout_arrays(T=17, N=5, seed=1)
    recorded = _read(_record(tmp_path / "rec.h5", arrays, gamma=0.99, lam=0.95, compression="gzip"))
    for name, value in arrays.items():
        assert recorded[name].tobytes() == value.tobytes(), name
    attrs = recorded["__attrs__"]
    assert attrs["recorder"] == "rolloutcli.record.RolloutWriter" and attrs["gamma"] == 0.99
    assert not attrs["timeouts_bootstrapped"] and not attrs["recorded_from_reset"] and "numpy" in attrs["versions"]
    code, out, err = cli("inspect", tmp_path / "rec.h5", "--strict")  # a recording as written: nothing to warn
    assert code == 0 and "warning" not in out + err, out + err
    write_rollout(tmp_path / "ref.h5", arrays)
    for source in ("rec", "ref"):
        assert cli("gae", tmp_path / f"{source}.h5", "-o", tmp_path / f"{source}_gae.h5", "-q")[0] == 0
    a, b = _read(tmp_path / "rec_gae.h5"), _read(tmp_path / "ref_gae.h5")
    for name in ("advantages", "returns", "rewards"):
        assert a[name].tobytes() == b[name].tobytes()


def test_tensordict_steps_sparse_final_observations(tmp_path: Path) -> None:
    N = 3
    with RolloutWriter(tmp_path / "td.h5", num_envs=N) as writer:
        for t in range(4):
            step = TensorDict(
                {
                    "observations": torch.full((N, 2), float(t)),
                    "actions": torch.zeros(N, 1),
                    "rewards": torch.ones(N),
                    "dones": torch.tensor([t == 2, False, False]),
                },
                batch_size=[N],
            )
            writer.add(step)
        writer.close(last_observations=torch.ones(N, 2))
    with RolloutWriter(tmp_path / "sparse.h5", num_envs=N) as writer:
        for t in range(4):
            step = {
                "observations": np.zeros((N, 2), np.float32),
                "actions": np.zeros((N, 1), np.float32),
                "rewards": np.zeros(N, np.float32),
                "dones": np.array([t == 2, 0, 0]),
            }
            if t == 2:
                step["final_observations"] = np.full((N, 2), 7, np.float32)
                step["final_values"] = np.full(N, 3, np.float32)
            writer.add(step)
        writer.close()
    data = _read(tmp_path / "sparse.h5")
    assert data["final_observations/policy"].shape == (4, N, 2) and (data["final_observations/policy"][2] == 7).all()
    assert (data["final_observations/policy"][[0, 1, 3]] == 0).all() and data["final_values"][2, 0] == 3
    assert _read(tmp_path / "td.h5")["last_observations/policy"].shape == (N, 2)


def _valid(N: int = 2) -> dict:
    return {
        "observations": np.zeros((N, 3), np.float32),
        "actions": np.zeros((N, 1), np.float32),
        "rewards": np.zeros(N, np.float32),
        "dones": np.zeros(N, np.uint8),
        "time_outs": np.zeros(N, np.uint8),
        "values": np.zeros(N, np.float32),
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rewards": np.zeros(3, np.float32)}, "field 'rewards': expected shape [2] (one per env), found [3]."),
        ({"values": np.zeros(2, np.int64)}, "field 'values': expected a float dtype, found int64."),
        ({"dones": np.array([0, 2])}, "field 'dones': expected flags 0/1 (or bool), found [0, 2]."),
        (
            {"time_outs": np.array([1, 0], np.uint8)},
            "field 'time_outs': expected time-outs only where dones is 1, found a time-out where dones is 0. Set dones",
        ),
        (
            {"actions": np.zeros((2, 2), np.float32)},
            "field 'actions': expected float32 [2, 1] as at step 0, found float32 [2, 2].",
        ),
        ({"rewardz": np.zeros(2)}, "field 'rewardz': expected one of rewards"),
    ],
)
def test_bad_steps_name_step_and_field(tmp_path: Path, change: dict, message: str) -> None:
    writer = RolloutWriter(tmp_path / "bad.h5", num_envs=2)
    writer.add(_valid())
    with pytest.raises(RolloutError) as caught:
        writer.add({**_valid(), **change})
    assert str(caught.value).startswith(f"{tmp_path / 'bad.h5'}: step 1: {message}")
    writer.add(_valid())  # a refused step leaves the writer usable
    writer.close(last_values=np.zeros(2, np.float32))
    assert _read(tmp_path / "bad.h5")["rewards"].shape == (2, 2)


def test_limits_and_close(tmp_path: Path) -> None:
    path = tmp_path / "lim.h5"
    writer = RolloutWriter(path, num_envs=2, num_steps=1)
    writer.add(_valid())
    with pytest.raises(RolloutError, match=r"step 1: field 'step': expected at most num_steps=1 steps, found one"):
        writer.add(_valid())
    with pytest.warns(UserWarning, match="values were recorded but close\\(\\) got no last_values; none written"):
        writer.close()
    assert "last_values" not in _read(path)
    with pytest.raises(RolloutError, match=r"step 1: field 'step': expected add\(\) before close\(\), found add"):
        writer.add(_valid())
    with pytest.raises(RolloutError) as refused:  # an existing file is kept; the fix is named as Python spells it
        RolloutWriter(path, num_envs=2)
    assert (
        str(refused.value)
        == f"{path}: output already exists; refusing to overwrite it. Pass overwrite=True to replace it."
    )
    assert refused.value.exit_code == 2 and "last_values" not in _read(path)
    with pytest.raises(RolloutError, match="output is a folder, expected a file path"):
        RolloutWriter(tmp_path, num_envs=2)
    appeared = tmp_path / "appeared.h5"
    writer = RolloutWriter(appeared, num_envs=2)
    writer.add(_valid())
    appeared.write_bytes(b"theirs")  # another program's file, made while recording: kept
    with pytest.raises(RolloutError, match=r"output appeared while the command ran; .* Pass overwrite=True to"):
        writer.close(last_values=np.zeros(2, np.float32))
    assert appeared.read_bytes() == b"theirs"


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_interrupted_recording_publishes_nothing(tmp_path: Path, error: type) -> None:
    with pytest.raises(error), RolloutWriter(tmp_path / "x.h5", num_envs=2) as writer:
        writer.add(_valid())
        raise error
    assert os.listdir(tmp_path) == []


def test_full_disk_publishes_nothing(tmp_path: Path, monkeypatch) -> None:
    from rolloutcli.hdf5 import append

    def full(*args, **kwargs):
        raise RolloutError(f"{tmp_path / 'x.h5'}: cannot write the output: No space left on device", exit_code=3)

    monkeypatch.setattr(writer_module, "_BLOCK_BYTES", 1)
    monkeypatch.setattr(append.AppendFile, "extend", full)
    writer = RolloutWriter(tmp_path / "x.h5", num_envs=2)
    writer.add(_valid())  # the block is written on the I/O thread: its error is raised by the next call
    with pytest.raises(RolloutError, match="No space left"):
        writer.add(_valid())
    assert os.listdir(tmp_path) == [] and writer.closed
    closing = RolloutWriter(tmp_path / "y.h5", num_envs=2)
    closing.add(_valid())
    with pytest.raises(RolloutError, match="No space left"):
        closing.close(last_values=np.zeros(2, np.float32))
    assert os.listdir(tmp_path) == [] and closing.closed


def test_dropped_writer_leaves_nothing(tmp_path: Path) -> None:
    writer = RolloutWriter(tmp_path / "x.h5", num_envs=2)
    writer.add(_valid())
    del writer
    import gc

    gc.collect()
    assert os.listdir(tmp_path) == []


def test_background_close(tmp_path: Path, monkeypatch) -> None:
    from rolloutcli.hdf5 import append

    writer = RolloutWriter(tmp_path / "bg.h5", num_envs=2)
    writer.add(_valid())
    assert writer.close(last_values=np.zeros(2, np.float32), background=True) == tmp_path / "bg.h5"
    assert writer.wait().exists() and _read(tmp_path / "bg.h5")["rewards"].shape == (1, 2)

    def broken(self):
        raise RolloutError("disk gone", exit_code=3)

    monkeypatch.setattr(append.AppendFile, "commit", broken)
    failing = RolloutWriter(tmp_path / "fail.h5", num_envs=2)
    failing.add(_valid())
    failing.close(last_values=np.zeros(2, np.float32), background=True)
    with pytest.raises(RolloutError, match="disk gone"):
        failing.wait()
    assert sorted(os.listdir(tmp_path)) == ["bg.h5"]


def _block(arrays: dict[str, np.ndarray], start: int, stop: int) -> dict:
    """Steps ``[start, stop)`` as one ``add_steps`` block (hidden states ``[k, layers, N, H]``)."""
    steps = [_step(arrays, t) for t in range(start, stop)]

    def stack(*parts):
        return {k: stack(*(p[k] for p in parts)) for k in parts[0]} if isinstance(parts[0], dict) else np.stack(parts)

    return stack(*steps)


@pytest.mark.parametrize("block_bytes", [1, 300, 1 << 30])
def test_add_steps_writes_the_bytes_of_add(tmp_path: Path, monkeypatch, block_bytes: int) -> None:
    monkeypatch.setattr(writer_module, "_BLOCK_BYTES", block_bytes)  # blocks of 1 step, a few steps, all
    arrays = rollout_arrays(T=17, N=5, seed=2)
    _record(tmp_path / "add.h5", arrays)
    with RolloutWriter(tmp_path / "steps.h5", num_envs=5, num_steps=17) as writer:
        for start, stop in ((0, 1), (1, 9), (9, 17)):  # across block boundaries
            writer.add_steps(_block(arrays, start, stop))
        writer.close(last_values=torch.tensor(arrays["last_values"]))
    assert (tmp_path / "add.h5").read_bytes() == (tmp_path / "steps.h5").read_bytes()


def test_add_steps_names_the_bad_step(tmp_path: Path) -> None:
    def block(k: int = 3, **change) -> dict:
        return {name: np.stack([v] * k) for name, v in {**_valid(), **change}.items()}

    writer = RolloutWriter(tmp_path / "bad.h5", num_envs=2, num_steps=6)
    writer.add(_valid())
    bad = block()
    bad["dones"][2, 1] = 2
    with pytest.raises(RolloutError, match=r"bad\.h5: step 3: field 'dones': expected flags 0/1 \(or bool\), found"):
        writer.add_steps(bad)
    bad = block(dones=np.ones(2, np.uint8))
    bad["time_outs"][1, 0] = 1
    bad["dones"][1, 0] = 0
    with pytest.raises(RolloutError, match=r"step 2: field 'time_outs': expected time-outs only where dones is 1"):
        writer.add_steps(bad)
    ragged = {**block(), "rewards": np.zeros((2, 2), np.float32)}
    with pytest.raises(RolloutError, match=r"step 1: field 'steps': expected one leading number of steps"):
        writer.add_steps(ragged)
    writer.add_steps(block())
    with pytest.raises(RolloutError, match=r"step 6: field 'step': expected at most num_steps=6 steps, found 2 more"):
        writer.add_steps(block(4))
    writer.close(last_values=np.zeros(2, np.float32))
    assert _read(tmp_path / "bad.h5")["rewards"].shape == (4, 2)


def _small(rewards=None, values=None, dones=None, extras=None) -> dict:
    step = {"observations": torch.zeros(3, 2), "actions": torch.zeros(3, 1), "values": torch.zeros(3),
            "rewards": torch.zeros(3) if rewards is None else torch.tensor(rewards),
            "dones": torch.zeros(3) if dones is None else torch.tensor(dones)}  # fmt: skip
    return {**step, "extras": extras} if extras is not None else step


@pytest.mark.parametrize(
    ("key", "fix"),
    [
        ("timeouts_bootstrapped", "It is reserved: the writer records raw rewards (False). Remove it from attrs."),
        ("rolloutcli_format", "It is reserved: the writer sets it. Remove it from attrs."),
        ("format_version", "It is reserved: the writer sets it. Remove it from attrs."),
        ("timeouts_rule", "Pass timeouts_rule=... to RolloutWriter instead."),
        ("recording_id", "Pass recording_id=... to RolloutWriter instead."),
        ("recording_index", "Pass recording_index=... to RolloutWriter instead."),
        ("gamma", "Pass gamma=... to RolloutWriter instead."),
    ],
)
def test_attrs_cannot_set_what_the_writer_sets(tmp_path: Path, key: str, fix: str) -> None:
    path = tmp_path / "rec.h5"
    with pytest.raises(RolloutError) as error:
        RolloutWriter(path, num_envs=3, attrs={key: True})
    expected = f"{path}: field 'attrs.{key}': expected attributes the writer does not set, found '{key}'. {fix}"
    assert str(error.value) == expected
    assert not list(tmp_path.iterdir())


def test_attrs_name_with_nul_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RolloutError) as error:
        RolloutWriter(tmp_path / "rec.h5", num_envs=3, attrs={"a\x00b": 1})
    assert str(error.value) == (
        f"{tmp_path / 'rec.h5'}: field 'attrs': expected non-empty attribute names without NUL bytes, "
        "found 'a\\x00b'. Rename the attribute."
    )


@pytest.mark.parametrize("name", ["a\x00b", "rewards", "observations/x", "", "a//b"])
def test_extras_names_that_would_be_cut_or_collide_are_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / "rec.h5"
    writer = RolloutWriter(path, num_envs=3)
    with pytest.raises(RolloutError) as error:
        writer.add(_small(extras={name: torch.zeros(3)}))
    writer.abort()
    assert str(error.value) == (
        f"{path}: step 0: field 'extras': expected names without NUL bytes, empty or '.' parts, other than the "
        f"format's fields, found {name!r}. Rename the extra."
    )


_NONFINITE = "Fix the reward or critic, or pass allow_nonfinite=True to keep them (gae then refuses the file)."


def test_nonfinite_rewards_values_are_refused_naming_step_and_env(tmp_path: Path) -> None:
    path = tmp_path / "rec.h5"
    writer = RolloutWriter(path, num_envs=3)
    writer.add(_small())
    with pytest.raises(RolloutError) as error:
        writer.add(_small(rewards=[0.0, 0.0, float("nan")]))
    assert (
        str(error.value)
        == f"{path}: step 1: field 'rewards': expected finite numbers, found nan at env 2. {_NONFINITE}"
    )
    block = {**{k: v[None].repeat(4, *[1] * v.ndim) for k, v in _small().items()}}
    block["values"][2, 1] = float("-inf")
    with pytest.raises(RolloutError) as error:
        writer.add_steps(block)
    assert (
        str(error.value)
        == f"{path}: step 3: field 'values': expected finite numbers, found -inf at env 1. {_NONFINITE}"
    )
    writer.add(_small())
    with pytest.raises(RolloutError) as error:
        writer.close(last_values=torch.tensor([float("inf"), 0.0, 0.0]))
    assert str(error.value) == (
        f"{path}: close(): field 'last_values': expected finite numbers, found inf at env 0. {_NONFINITE}"
    )
    writer.abort()
    assert not path.exists()


def test_final_values_are_checked_at_done_steps_only(tmp_path: Path) -> None:
    path = tmp_path / "rec.h5"
    with RolloutWriter(path, num_envs=3) as writer:
        writer.add({**_small(dones=[0.0, 1.0, 0.0]), "final_values": torch.tensor([float("nan"), 1.0, float("nan")])})
        with pytest.raises(RolloutError) as error:
            writer.add({**_small(dones=[1.0, 0.0, 0.0]), "final_values": torch.tensor([float("nan"), 0.0, 0.0])})
        writer.abort()
    assert str(error.value) == (
        f"{path}: step 1: field 'final_values': expected finite numbers, found nan at env 0. {_NONFINITE}"
    )


def test_allow_nonfinite_keeps_them_and_gae_refuses_the_file(tmp_path: Path, cli) -> None:
    path = tmp_path / "rec.h5"
    with RolloutWriter(path, num_envs=3, allow_nonfinite=True) as writer:
        writer.add(_small(rewards=[0.0, float("nan"), 0.0]))
        writer.close(last_values=torch.zeros(3))
    with h5py.File(path, "r") as handle:
        assert np.isnan(handle["rewards"][0, 1])
    code, _, err = cli("gae", path, "-o", tmp_path / "out.h5")
    assert code == 1 and "field 'rewards': expected finite numbers, found 1 NaN/Inf values" in err


@pytest.mark.parametrize(("field", "key"), [("observations", "a\x00b"), ("observations", "a/b"), ("distribution", "")])
def test_group_keys_that_would_be_cut_or_split_are_refused(tmp_path: Path, field: str, key: str) -> None:
    path = tmp_path / "rec.h5"
    writer = RolloutWriter(path, num_envs=3)
    step = _small()
    step[field] = {key: torch.zeros(3, 2)}
    with pytest.raises(RolloutError) as error:
        writer.add(step)
    writer.abort()
    assert str(error.value) == (
        f"{path}: step 0: field '{field}': expected keys without NUL bytes or '/', not empty or '.', found {key!r}. "
        "Rename the key."
    )


def test_recording_id_and_index_are_root_attributes(tmp_path: Path) -> None:
    for index, path in enumerate([tmp_path / "a.h5", tmp_path / "b.h5"]):
        with RolloutWriter(path, num_envs=3, recording_id="run-7", recording_index=index) as writer:
            writer.add({**_small(), "values": None})
    for index, path in enumerate([tmp_path / "a.h5", tmp_path / "b.h5"]):
        with h5py.File(path, "r") as handle:
            assert handle.attrs["recording_id"] == "run-7" and handle.attrs["recording_index"] == index
    with RolloutWriter(tmp_path / "c.h5", num_envs=3) as writer:  # neither: a file that stands alone
        writer.add({**_small(), "values": None})
    with h5py.File(tmp_path / "c.h5", "r") as handle:
        assert "recording_id" not in handle.attrs and "recording_index" not in handle.attrs


@pytest.mark.parametrize(
    ("recording_id", "recording_index", "message"),
    [
        ("run", None, "field 'recording_index': expected a value beside recording_id (both or neither), found None. "
         "Pass recording_index too, or neither."),
        (None, 0, "field 'recording_id': expected a value beside recording_index (both or neither), found None. "
         "Pass recording_id too, or neither."),
        ("", 0, "field 'recording_id': expected a non-empty str without NUL bytes, found ''. "
         "Pass one id (uuid.uuid4().hex) for all files of one recording."),
        ("a\x00b", 0, "field 'recording_id': expected a non-empty str without NUL bytes, found 'a\\x00b'. "
         "Pass one id (uuid.uuid4().hex) for all files of one recording."),
        (7, 0, "field 'recording_id': expected a non-empty str without NUL bytes, found 7. "
         "Pass one id (uuid.uuid4().hex) for all files of one recording."),
        ("run", -1, "field 'recording_index': expected an int >= 0, found -1. "
         "Count the recording's files 0, 1, 2, ... in the order they are written."),
        ("run", True, "field 'recording_index': expected an int >= 0, found True. "
         "Count the recording's files 0, 1, 2, ... in the order they are written."),
        ("run", 1.0, "field 'recording_index': expected an int >= 0, found 1.0. "
         "Count the recording's files 0, 1, 2, ... in the order they are written."),
    ],
)  # fmt: skip
def test_recording_id_and_index_are_checked(tmp_path: Path, recording_id, recording_index, message: str) -> None:
    path = tmp_path / "rec.h5"
    with pytest.raises(RolloutError) as error:
        RolloutWriter(path, num_envs=3, recording_id=recording_id, recording_index=recording_index)
    assert str(error.value) == f"{path}: {message}"
    assert not list(tmp_path.iterdir())
