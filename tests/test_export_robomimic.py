"""The robomimic export: robomimic's own ``SequenceDataset`` reads it (sequences with padding, the train and
validation masks), and rolloutcli's ``import`` gives back the episodes bit for bit.

robomimic is installed by ``.ci/run`` in a step of its own (``pip install --no-deps robomimic==0.3.0 ...``: its
``torchvision`` requirement would replace the pinned CPU torch), not by ``[test]``; without it the tests that
need it are skipped, saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from episode_chunks import OBS, STANDARD, kept, make

from rolloutcli.errors import RolloutError
from rolloutcli.hdf5.export_robomimic import export_robomimic
from rolloutcli.hdf5.writer import RolloutOutput

WHY = "robomimic is not installed: .ci/run installs it (pip install --no-deps robomimic==0.3.0 tqdm termcolor)"


def kept_episodes(made) -> list[int]:
    return [e.number for e in made.plan.episodes if kept(e) > 0]


def expected(made, number: int) -> dict[str, np.ndarray]:
    """What demo ``number`` should hold: obs, next_obs (the next observation; after the last step the recorded
    one), actions, rewards, dones (1 at the last step of a terminated episode that kept it)."""
    episode, truth, n = made.plan.episodes[number], made.truth[number], kept(made.plan.episodes[number])
    want = {}
    for key in made.plan.observations:
        obs = truth[f"observations/{key}"]
        want[f"obs/{key}"] = obs[:n]
        want[f"next_obs/{key}"] = np.concatenate([obs[1:], truth[f"next/{key}"][None]])[:n]
    want["actions"], want["rewards"] = truth["actions"][:n], truth["rewards"][:n]
    want["dones"] = np.zeros(n, np.uint8)
    want["dones"][-1] = episode.terminated and episode.has_next
    return want


def sequence(rows: np.ndarray, start: int, length: int) -> np.ndarray:
    """Rows ``start : start + length``, the last row repeated past the end (robomimic's pad_seq_length)."""
    index = np.minimum(np.arange(start, start + length), len(rows) - 1)
    return rows[index]


@pytest.fixture
def exported(tmp_path: Path):
    made = make(STANDARD)
    out = tmp_path / "robomimic.hdf5"
    warnings = export_robomimic(out, made.plan, made.chunks, lambda e: e.number in (1, 5))
    return made, out, warnings


def test_layout_attributes_and_warnings(exported) -> None:
    made, out, warnings = exported
    assert warnings == [
        "2 episodes end without the observation after their last step (not recorded): "
        "their last step is left out of robomimic",
        "robomimic has no place for hidden_states, values: not exported",
    ]
    numbers = kept_episodes(made)
    with h5py.File(out, "r") as f:
        assert sorted(f["data"]) == [f"demo_{k}" for k in range(len(numbers))]
        assert f["data"].attrs["total"] == sum(kept(made.plan.episodes[n]) for n in numbers)
        assert json.loads(f["data"].attrs["env_args"]) == {"env_name": "unknown", "type": 2, "env_kwargs": {}}
        assert [n.decode() for n in f["mask/train"][()]] == ["demo_0", "demo_2", "demo_3"]
        assert [n.decode() for n in f["mask/valid"][()]] == ["demo_1", "demo_4"]
        for k, number in enumerate(numbers):
            demo, episode = f[f"data/demo_{k}"], made.plan.episodes[number]
            assert demo.attrs["num_samples"] == kept(episode)
            for name, want in expected(made, number).items():
                assert demo[name].dtype == want.dtype, name
                np.testing.assert_array_equal(demo[name][()], want, err_msg=name)
            cuts = STANDARD[number].cuts
            files = [episode.first_file + j for j, cut in enumerate(cuts) for _ in range(cut)]
            assert demo["source_file"][()].tolist() == files[: kept(episode)]
            partial = {a: bool(demo.attrs.get(a, False)) for a in ("partial_start", "partial_end")}
            assert partial == {"partial_start": episode.partial_start, "partial_end": episode.partial_end}
        assert list(f["data"].attrs["source_files"]) == ["iter_0.h5", "iter_1.h5", "iter_2.h5"]


def test_sequence_dataset_reads_it(exported) -> None:
    """robomimic's SequenceDataset: low-dim and image keys as stored (the image processing happens later, in
    its training loop), actions, rewards, dones, sequences of 3 padded at a demo's end, the train and valid
    masks."""
    pytest.importorskip("robomimic", reason=WHY)
    import robomimic.utils.obs_utils as ObsUtils
    from robomimic.utils.dataset import SequenceDataset

    made, out, _ = exported
    ObsUtils.initialize_obs_utils_with_obs_specs({"obs": {"low_dim": ["policy"], "rgb": ["camera"]}})
    numbers = kept_episodes(made)
    demos = {f"demo_{k}": number for k, number in enumerate(numbers)}
    for side, names in (("train", ["demo_0", "demo_2", "demo_3"]), ("valid", ["demo_1", "demo_4"]), (None, demos)):
        data = SequenceDataset(
            str(out),
            obs_keys=["policy", "camera"],
            dataset_keys=["actions", "rewards", "dones"],
            seq_length=3,
            pad_seq_length=True,
            filter_by_attribute=side,
        )
        assert data.demos == list(names)
        assert len(data) == sum(kept(made.plan.episodes[demos[d]]) for d in names)
        index = 0
        for name in names:
            want = expected(made, demos[name])
            for start in range(len(want["actions"])):
                item = data[index]
                for k in ("actions", "rewards", "dones"):
                    np.testing.assert_array_equal(item[k], sequence(want[k], start, 3))
                for prefix in ("obs", "next_obs"):
                    for key in ("policy", "camera"):  # as stored: images are uint8 until robomimic's training loop
                        got = item[prefix][key]
                        assert got.dtype == want[f"{prefix}/{key}"].dtype
                        np.testing.assert_array_equal(got, sequence(want[f"{prefix}/{key}"], start, 3))
                index += 1


def test_round_trip_through_import(tmp_path: Path, cli) -> None:
    """import(export(x)) gives back x's episodes: observation groups (float32, float64, uint8 images), actions
    and rewards (float64), how each ended (terminated, else truncated), the observation after the last step."""
    obs = {**OBS, "joints": (np.dtype(np.float64), (2,))}
    made = make(STANDARD, obs, reward_dtype=np.float64, action_dtype=np.float64)
    out = tmp_path / "robomimic.hdf5"
    export_robomimic(out, made.plan, made.chunks, None)
    code, _, err = cli("import", out, "-o", tmp_path / "back.h5", "--json")
    assert code == 0, err
    with h5py.File(tmp_path / "back.h5", "r") as f:
        back = {name: f[name][()] for name in f if isinstance(f[name], h5py.Dataset)}
        back.update({f"{g}/{k}": f[g][k][()] for g in ("observations", "final_observations") for k in f[g]})
    ends = np.flatnonzero(back["dones"][:, 0]).tolist()
    first = 0
    for end, number in zip(ends, kept_episodes(made), strict=True):
        episode, want = made.plan.episodes[number], expected(made, number)
        assert end - first + 1 == kept(episode)
        for key in obs:
            got = back[f"observations/{key}"][first : end + 1, 0]
            assert got.dtype == want[f"obs/{key}"].dtype
            np.testing.assert_array_equal(got, want[f"obs/{key}"])
            np.testing.assert_array_equal(back[f"final_observations/{key}"][end, 0], want[f"next_obs/{key}"][-1])
        for name in ("actions", "rewards"):
            got = back[name][first : end + 1, 0]
            assert got.dtype == want[name].dtype
            np.testing.assert_array_equal(got.reshape(want[name].shape), want[name])
        assert bool(back["time_outs"][end, 0]) == (not want["dones"][-1])
        np.testing.assert_array_equal(back["recorded_dones"][first : end + 1, 0], want["dones"])
        files = [episode.first_file + j for j, cut in enumerate(STANDARD[number].cuts) for _ in range(cut)]
        assert back["source_file"][first : end + 1, 0].tolist() == files[: kept(episode)]
        first = end + 1
    assert first == len(back["dones"])


def test_no_split_no_masks(tmp_path: Path) -> None:
    made = make(STANDARD[:2])
    export_robomimic(tmp_path / "r.hdf5", made.plan, made.chunks, None)
    with h5py.File(tmp_path / "r.hdf5", "r") as f:
        assert "mask" not in f
        assert "partial_start" not in f["data/demo_0"].attrs


def test_an_empty_side_has_an_empty_mask(tmp_path: Path) -> None:
    made = make(STANDARD[:2])
    export_robomimic(tmp_path / "r.hdf5", made.plan, made.chunks, lambda e: False)
    with h5py.File(tmp_path / "r.hdf5", "r") as f:
        assert f["mask/valid"].shape == (0,)
        assert [n.decode() for n in f["mask/train"][()]] == ["demo_0", "demo_1"]


def test_complete_demos_are_let_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The datasets of a demo whose last chunk was written are released: open datasets stay those of the
    episodes being written, not all of them (each holds libhdf5 memory)."""
    left = []
    close = RolloutOutput.__exit__

    def recording_exit(self, *args):
        left.append(len(self._objects))
        return close(self, *args)

    monkeypatch.setattr(RolloutOutput, "__exit__", recording_exit)
    made = make(STANDARD)
    export_robomimic(tmp_path / "r.hdf5", made.plan, made.chunks, None)
    assert left == [0]


def test_a_stream_that_stops_early_is_refused(tmp_path: Path) -> None:
    made = make(STANDARD[:2])
    with pytest.raises(RolloutError) as error:
        export_robomimic(tmp_path / "r.hdf5", made.plan, made.chunks[:-1], None)
    assert str(error.value) == (
        f"{tmp_path / 'r.hdf5'}: field 'episodes': expected 7 steps of episode 0, found 3 read. "
        "The dataset changed while it was exported; export it again."
    )
