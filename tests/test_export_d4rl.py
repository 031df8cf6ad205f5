"""The D4RL export: the layout D4RL's loaders read (checked against re-implementations of D4RL's own
``qlearning_dataset`` and ``sequence_dataset``: the ``d4rl`` package does not install here), the rows that
differ from D4RL's conventions, and the round trip through rolloutcli's ``import``."""

from __future__ import annotations

import collections
import json
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from episode_chunks import OBS, STANDARD, Spec, kept, make
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutcli.errors import RolloutError
from rolloutcli.hdf5.export_d4rl import export_d4rl

ONE_KEY = {"policy": (np.dtype(np.float32), (3,))}


def get_dataset(path: Path) -> dict[str, np.ndarray]:
    """Every dataset of the file by its path, as D4RL's ``OfflineEnv.get_dataset`` reads an HDF5 file."""
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return found


def qlearning_dataset(dataset: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """D4RL's ``qlearning_dataset`` (Farama-Foundation/D4RL, d4rl/__init__.py, terminate_on_end=False, with
    ``timeouts``): rows 0..N-2; a time-out row is skipped; the next observation is ``observations[i + 1]``."""
    out = collections.defaultdict(list)
    for i in range(dataset["rewards"].shape[0] - 1):
        if dataset["timeouts"][i]:
            continue
        out["observations"].append(dataset["observations"][i].astype(np.float32))
        out["next_observations"].append(dataset["observations"][i + 1].astype(np.float32))
        out["actions"].append(dataset["actions"][i].astype(np.float32))
        out["rewards"].append(dataset["rewards"][i].astype(np.float32))
        out["terminals"].append(bool(dataset["terminals"][i]))
        out["row"].append(i)  # not D4RL's: which row it came from, for the comparison
    return {k: np.array(v) for k, v in out.items()}


def sequence_dataset(dataset: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """D4RL's ``sequence_dataset`` (same file): every key, cut after each row with ``terminals`` or ``timeouts``
    (rows after the last such row are never yielded)."""
    episodes, current = [], collections.defaultdict(list)
    for i in range(dataset["rewards"].shape[0]):
        for k in dataset:
            current[k].append(dataset[k][i])
        if bool(dataset["terminals"][i]) or dataset["timeouts"][i]:
            episodes.append({k: np.array(v) for k, v in current.items()})
            current = collections.defaultdict(list)
    return episodes


def expected(made, number: int, key: str) -> tuple[np.ndarray, np.ndarray]:
    """An episode's kept observations and the observation after each (the next one; after the last, the recorded)."""
    truth, n = made.truth[number], kept(made.plan.episodes[number])
    obs = truth[f"observations/{key}"]
    after = np.concatenate([obs[1:], truth[f"next/{key}"][None]])
    return obs[:n], after[:n]


def kept_episodes(made) -> list[int]:
    return [e.number for e in made.plan.episodes if kept(e) > 0]


def test_sequence_dataset_reads_every_episode(tmp_path: Path) -> None:
    made = make(STANDARD, ONE_KEY)
    out = tmp_path / "d4rl.hdf5"
    warnings = export_d4rl(out, made.plan, made.chunks, None)
    assert warnings == [
        "2 episodes end without the observation after their last step (not recorded): "
        "their last step is left out of d4rl",
        "d4rl has no place for hidden_states, values: not exported",
    ]
    dataset = get_dataset(out)
    assert dataset["observations"].shape == (sum(kept(e) for e in made.plan.episodes), 3)
    episodes = sequence_dataset(dataset)
    assert len(episodes) == len(kept_episodes(made))
    for got, number in zip(episodes, kept_episodes(made), strict=True):
        episode, truth, n = made.plan.episodes[number], made.truth[number], kept(made.plan.episodes[number])
        obs, after = expected(made, number, "policy")
        np.testing.assert_array_equal(got["observations"], obs)
        np.testing.assert_array_equal(got["next_observations"], after)
        np.testing.assert_array_equal(got["actions"], truth["actions"][:n])
        np.testing.assert_array_equal(got["rewards"], truth["rewards"][:n])
        terminal = episode.terminated and episode.has_next
        assert got["terminals"].tolist() == [False] * (n - 1) + [terminal]
        assert got["timeouts"].tolist() == [False] * (n - 1) + [not terminal]
        files = [episode.first_file + j for j, cut in enumerate(STANDARD[number].cuts) for _ in range(cut)]
        assert got["infos/source_file"].tolist() == files[:n]
    with h5py.File(out, "r") as f:
        assert [s.decode() if isinstance(s, bytes) else s for s in f.attrs["source_files"]] == [
            "iter_0.h5",
            "iter_1.h5",
            "iter_2.h5",
        ]
        assert f["observations"].attrs["key"] == "policy"
        starts = np.cumsum([0] + [kept(e) for e in made.plan.episodes])
        assert f.attrs["partial_start_rows"].tolist() == [starts[4]]
        assert f.attrs["partial_end_rows"].tolist() == [starts[5] - 1]


def test_qlearning_dataset_rows_that_differ(tmp_path: Path) -> None:
    """D4RL's qlearning_dataset drops each time-out row and the last row (ours keep them: next_observations
    is explicit) and takes the row after a terminal row, the next episode's first observation, as its next
    observation (ours: the observation the episode ended on). Every other row is the same."""
    made = make(STANDARD, ONE_KEY)
    out = tmp_path / "d4rl.hdf5"
    export_d4rl(out, made.plan, made.chunks, None)
    dataset = get_dataset(out)
    q = qlearning_dataset(dataset)
    rows = len(dataset["rewards"])
    dropped = sorted(set(range(rows)) - set(q["row"].tolist()))
    assert dropped == sorted({*np.flatnonzero(dataset["timeouts"]).tolist(), rows - 1})
    for name in ("observations", "actions", "rewards", "terminals"):
        np.testing.assert_array_equal(q[name], dataset[name][q["row"]].astype(q[name].dtype))
    same = ~q["terminals"]
    np.testing.assert_array_equal(q["next_observations"][same], dataset["next_observations"][q["row"][same]])
    assert not np.array_equal(q["next_observations"][~same], dataset["next_observations"][q["row"][~same]])


def test_round_trip_through_import(tmp_path: Path, cli) -> None:
    """import(export(x)) gives back x's episodes: observation groups (float64, uint8 images), actions,
    rewards (float64), the end of each episode, the observation after it, the source file of each step."""
    obs = {**OBS, "joints": (np.dtype(np.float64), (2,))}
    made = make(STANDARD, obs, reward_dtype=np.float64, action_dtype=np.float64)
    out = tmp_path / "d4rl.hdf5"
    export_d4rl(out, made.plan, made.chunks, None)
    code, _, err = cli("import", out, "-o", tmp_path / "back.h5", "--json")
    assert code == 0, err
    with h5py.File(tmp_path / "back.h5", "r") as f:
        back = {
            name: f[name][()]
            for name in [
                *(f"observations/{k}" for k in obs),
                "actions",
                "rewards",
                "dones",
                "time_outs",
                *(f"final_observations/{k}" for k in obs),
                "infos/source_file",
            ]
        }
    ends = np.flatnonzero(back["dones"][:, 0]).tolist()
    assert len(ends) == len(kept_episodes(made))
    first = 0
    for end, number in zip(ends, kept_episodes(made), strict=True):
        episode, truth, n = made.plan.episodes[number], made.truth[number], kept(made.plan.episodes[number])
        assert end - first + 1 == n
        for key in obs:
            got = back[f"observations/{key}"][first : end + 1, 0]
            assert got.dtype == obs[key][0]
            np.testing.assert_array_equal(got, truth[f"observations/{key}"][:n])
            # import keeps every next_observations row (final_observations, meant where an episode ends)
            np.testing.assert_array_equal(
                back[f"final_observations/{key}"][first : end + 1, 0], expected(made, number, key)[1]
            )
        for name in ("actions", "rewards"):
            got = back[name][first : end + 1, 0]
            assert got.dtype == truth[name].dtype
            np.testing.assert_array_equal(got.reshape(truth[name][:n].shape), truth[name][:n])
        assert bool(back["time_outs"][end, 0]) == (not (episode.terminated and episode.has_next))
        files = [episode.first_file + j for j, cut in enumerate(STANDARD[number].cuts) for _ in range(cut)]
        assert back["infos/source_file"][first : end + 1, 0].tolist() == files[:n]
        first = end + 1


def test_split_writes_two_files(tmp_path: Path) -> None:
    made = make(STANDARD, ONE_KEY)
    out = tmp_path / "d4rl"
    export_d4rl(out, made.plan, made.chunks, lambda e: e.number % 2 == 1)
    assert sorted(p.name for p in out.iterdir()) == ["train.hdf5", "valid.hdf5"]
    for name, side in (("train.hdf5", 0), ("valid.hdf5", 1)):
        numbers = [n for n in kept_episodes(made) if n % 2 == side]
        episodes = sequence_dataset(get_dataset(out / name))
        assert len(episodes) == len(numbers)
        for got, number in zip(episodes, numbers, strict=True):
            np.testing.assert_array_equal(got["observations"], expected(made, number, "policy")[0])


@settings(max_examples=15, deadline=None)
@given(st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3), min_size=1, max_size=4), st.data())
def test_any_cut_gives_the_same_rows(cuts: list[list[int]], data: st.DataObject) -> None:
    """Wherever episodes are cut into chunks, each row and the observation after it land in their place."""
    specs = [
        Spec(c, terminated=data.draw(st.booleans()), has_next=sum(c) > 1 or data.draw(st.booleans())) for c in cuts
    ]
    made = make(specs, ONE_KEY)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "d4rl.hdf5"
        export_d4rl(out, made.plan, made.chunks, None)
        dataset = get_dataset(out)
    numbers = kept_episodes(made)
    want = [expected(made, n, "policy") for n in numbers]
    np.testing.assert_array_equal(dataset["observations"], np.concatenate([w[0] for w in want] or [np.zeros((0, 3))]))
    np.testing.assert_array_equal(
        dataset["next_observations"], np.concatenate([w[1] for w in want] or [np.zeros((0, 3))])
    )


def test_no_observations_refused(tmp_path: Path) -> None:
    made = make(STANDARD[:1], ONE_KEY)
    made.plan.observations = {}
    with pytest.raises(RolloutError) as error:
        export_d4rl(tmp_path / "d4rl.hdf5", made.plan, made.chunks, None)
    assert str(error.value) == (
        f"{tmp_path / 'd4rl.hdf5'}: field 'observations': expected an observation group to export to d4rl, "
        "found none in the dataset. Export a rollout file that records observations."
    )


def test_unwritable_output_is_an_io_error(tmp_path: Path) -> None:
    made = make(STANDARD[:1], ONE_KEY)
    out = tmp_path / "missing" / "d4rl.hdf5"
    with pytest.raises(RolloutError) as error:
        export_d4rl(out, made.plan, made.chunks, None)
    assert error.value.exit_code == 3
    assert str(error.value).startswith(f"{out}: cannot write the output (")


def test_the_commands_warnings_go_to_stderr_and_json_keeps_them(tmp_path: Path, cli) -> None:
    """As every command's: a warning is one line on stderr, none with -q; the summary on stdout holds none."""
    src = Path(__file__).resolve().parent.parent / "sample_data" / "cartpole_gru.h5"
    wanted = "warning: d4rl has no place for actions_log_prob, distribution, hidden_states, last_values, "
    code, out, err = cli("export", src, "--to", "d4rl", "-o", tmp_path / "a.hdf5")
    assert code == 0, err
    assert "warning:" not in out and any(line.startswith(wanted) for line in err.splitlines()), err
    code, out, err = cli("export", src, "--to", "d4rl", "-o", tmp_path / "b.hdf5", "-q")
    assert code == 0 and out == "" and "warning:" not in err, err
    code, out, err = cli("export", src, "--to", "d4rl", "-o", tmp_path / "c.hdf5", "--json")
    assert code == 0 and any(w.startswith(wanted[9:]) for w in json.loads(out)["warnings"]), out
