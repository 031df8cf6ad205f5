"""``export --to minari``: minari's own ``load_dataset`` reads what the writer wrote, and ``import`` of it gives
back every episode, every field Minari holds bit for bit (synthetic identifiable episodes: tests/minari_factory)."""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from unittest import mock

import h5py
import numpy as np
import pytest
from conftest import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from minari_factory import DICT_OBS, EXTRA_FIELDS, FLOAT_OBS, Spec, build

from rolloutcli.errors import RolloutError
from rolloutcli.hdf5.export_minari import export_minari

minari = pytest.importorskip("minari")

SPECS = [Spec(5), Spec(3, terminated=False, truncated=True), Spec(1), Spec(7, terminated=True, truncated=True)]


def _export(root: Path, name: str, plan, chunks, valid=None) -> list[str]:
    """Export as the command does: into a temporary folder beside ``root/name``, renamed when complete."""
    tmp = root / f".{name}.rolloutcli-tmp-x1y2"
    tmp.mkdir(parents=True)
    lines = export_minari(tmp, plan, chunks, valid, label=root / name)
    tmp.rename(root / name)
    return lines


def _load(root: Path, dataset_id: str):
    """``minari.load_dataset`` with ``MINARI_DATASETS_PATH`` set to ``root``, the folder above the output."""
    with mock.patch.dict(os.environ, {"MINARI_DATASETS_PATH": str(root)}):
        return minari.load_dataset(dataset_id)


def _expected(rows: dict, obs: dict, kept: int) -> dict:
    """What Minari should hold of an episode keeping ``kept`` steps."""
    keys = list(obs)
    observations = {key: rows[f"observations/{key}"][: kept + 1] for key in keys}
    if len(keys) > 1:  # a Dict space, nested where a key holds '/'
        nested: dict = {}
        for key in keys:
            *parents, leaf = key.split("/")
            node = nested
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = observations[key]
        observations = nested
    else:
        observations = observations[keys[0]]
    return {
        "observations": observations,
        "actions": rows["actions"][:kept],
        "rewards": rows["rewards"][:kept],
        "terminations": (rows["dones"] & ~rows["time_outs"])[:kept],
        "truncations": rows["time_outs"][:kept],
    }


def _assert_same(got, want) -> None:
    if isinstance(want, dict):
        assert sorted(got) == sorted(want)
        for key in want:
            _assert_same(got[key], want[key])
    else:
        assert got.dtype == want.dtype and np.array_equal(got, want)


def _check_loaded(dataset, rows: list[dict], obs: dict, kept: list[int]) -> None:
    """Minari's episodes are ``rows`` (every episode kept, ``kept[e]`` steps of episode ``e``)."""
    episodes = list(dataset.iterate_episodes())
    assert [len(e.rewards) for e in episodes] == kept
    for number, episode in enumerate(episodes):
        for name, value in _expected(rows[number], obs, kept[number]).items():
            _assert_same(getattr(episode, name), value)


@pytest.mark.parametrize(
    ("obs", "actions"),
    [
        (FLOAT_OBS, (np.dtype(np.float64), (2,))),
        (DICT_OBS, (np.dtype(np.float32), (2,))),
        (FLOAT_OBS, (np.dtype(np.int64), ())),
    ],
    ids=["box", "dict-image", "integer-actions"],
)
def test_minari_loads_the_export(tmp_path: Path, obs: dict, actions: tuple) -> None:
    plan, chunks, rows = build(SPECS, obs=obs, actions=actions, extra=EXTRA_FIELDS)
    assert _export(tmp_path, "robot-v0", plan, chunks) == ["minari has no place for values: not exported"]
    dataset = _load(tmp_path, "robot-v0")
    assert (dataset.spec.dataset_id, dataset.total_episodes, dataset.total_steps) == ("robot-v0", 4, 16)
    assert dataset.env_spec is None
    _check_loaded(dataset, rows, obs, [s.steps for s in SPECS])
    space = dataset.observation_space
    if obs is DICT_OBS:  # images raw (no JPEG) and bounded by their dtype, floats unbounded
        assert space["camera"]["rgb"].low.min() == 0 and space["camera"]["rgb"].high.max() == 255
        assert np.isinf(space["critic"].low).all() and space["critic"].dtype == np.float64
    else:
        assert space.shape == (3,) and space.dtype == np.float32 and np.isinf(space.high).all()
    assert dataset.action_space.dtype == actions[0] and dataset.action_space.shape == actions[1]
    for episode, speed in zip(dataset.iterate_episodes(), rows, strict=True):
        assert np.array_equal(episode.infos["speed"], speed["infos/speed"])
    with h5py.File(tmp_path / "robot-v0" / "data" / "main_data.hdf5") as f:
        assert list(f.attrs["source_files"]) == ["iter_000.h5", "iter_001.h5", "iter_002.h5"]
        for chunk in chunks:  # every step's source file, where the chunk says
            got = f[f"episode_{chunk.episode.number}/infos/source_file"][chunk.offset : chunk.offset + chunk.steps]
            assert (got == chunk.file).all()


def test_round_trip_through_import(tmp_path: Path, cli) -> None:
    plan, chunks, rows = build(SPECS, obs=DICT_OBS, extra=EXTRA_FIELDS)
    _export(tmp_path, "robot-v0", plan, chunks)
    code, _, err = cli("import", tmp_path / "robot-v0", "-o", tmp_path / "back.h5")
    assert code == 0, err
    with h5py.File(tmp_path / "back.h5") as f:  # import lays the episodes end to end in one lane
        start = 0
        for spec, want in zip(SPECS, rows, strict=True):
            at, end = slice(start, start + spec.steps), start + spec.steps - 1
            for key in DICT_OBS:
                got = f[f"observations/{key}"][at, 0]
                assert got.dtype == want[f"observations/{key}"].dtype
                assert np.array_equal(got, want[f"observations/{key}"][: spec.steps])
                assert np.array_equal(f[f"final_observations/{key}"][end, 0], want[f"observations/{key}"][-1])
            for name in ("actions", "rewards", "infos/speed"):
                assert f[name].dtype == want[name].dtype and np.array_equal(f[name][at, 0], want[name])
            assert np.array_equal(f["dones"][at, 0] != 0, want["dones"])
            assert np.array_equal(f["time_outs"][at, 0] != 0, want["time_outs"])
            assert "values" not in f
            start += spec.steps


def test_last_step_without_next_observation(tmp_path: Path) -> None:
    specs = [Spec(4, has_next=False), Spec(1, has_next=False), Spec(3), Spec(2, terminated=False, has_next=False)]
    plan, chunks, rows = build(specs, actions=(np.dtype(np.float32), (1,)))
    lines = _export(tmp_path, "cut-v0", plan, chunks)
    assert lines == [
        "3 episodes end without the observation after their last step (not recorded): their last step is left "
        "out of minari (1 of one step are left out whole)"
    ]
    dataset = _load(tmp_path, "cut-v0")
    episodes = list(dataset.iterate_episodes())
    assert [len(e.rewards) for e in episodes] == [3, 3, 1]  # the one-step episode is gone; numbering closes up
    for episode, number, kept in zip(episodes, (0, 2, 3), (3, 3, 1), strict=True):
        want = _expected(rows[number], FLOAT_OBS, kept)
        assert np.array_equal(episode.observations, want["observations"])  # the last is a recorded observation
        assert not episode.terminations[-1] or kept == specs[number].steps
    meta = list(dataset.storage.get_episode_metadata(range(3)))
    assert [bool(m["last_step_left_out"]) for m in meta] == [True, False, True]
    assert [int(m["total_steps"]) for m in meta] == [3, 3, 1]


def test_partial_episodes_are_marked(tmp_path: Path) -> None:
    specs = [Spec(3, partial_start=True), Spec(4), Spec(2, terminated=False, partial_end=True)]
    plan, chunks, rows = build(specs)
    _export(tmp_path, "part-v0", plan, chunks)
    dataset = _load(tmp_path, "part-v0")
    _check_loaded(dataset, rows, FLOAT_OBS, [3, 4, 2])
    meta = list(dataset.storage.get_episode_metadata(range(3)))
    assert [(bool(m["partial_start"]), bool(m["partial_end"])) for m in meta] == [(True, False), (False, False),
                                                                                   (False, True)]
    assert [(m["recording"], int(m["lane"]), int(m["start_step"])) for m in meta] == [("rec", 0, 0), ("rec", 1, 10),
                                                                                      ("rec", 2, 20)]


def test_split_writes_two_datasets_minari_lists(tmp_path: Path) -> None:
    specs = [Spec(n + 2) for n in range(6)]
    plan, chunks, rows = build(specs, obs=DICT_OBS)
    _export(tmp_path, "robot", plan, chunks, valid=lambda e: e.number in (1, 4))
    with warnings.catch_warnings(), mock.patch.dict(os.environ, {"MINARI_DATASETS_PATH": str(tmp_path)}):
        warnings.simplefilter("error")  # a dataset whose id does not match its folder is warned about
        assert sorted(minari.list_local_datasets()) == ["robot/train-v0", "robot/valid-v0"]
    for dataset_id, numbers in (("robot/train-v0", [0, 2, 3, 5]), ("robot/valid-v0", [1, 4])):
        dataset = _load(tmp_path, dataset_id)
        assert dataset.spec.namespace == "robot" and dataset.total_steps == sum(specs[n].steps for n in numbers)
        for episode, number in zip(dataset.iterate_episodes(), numbers, strict=True):
            for name, value in _expected(rows[number], DICT_OBS, specs[number].steps).items():
                _assert_same(getattr(episode, name), value)


@pytest.mark.parametrize(
    ("name", "split", "found"),
    [("robot", False, "'robot'"), ("robot v0-v0", False, "'robot v0-v0'"), ("robot-v0/x", True, "'x'")],
)
def test_a_name_minari_cannot_load_is_refused(tmp_path: Path, name: str, split: bool, found: str) -> None:
    plan, chunks, _ = build([Spec(2)])
    out = tmp_path / name
    with pytest.raises(RolloutError) as info:
        export_minari(out, plan, chunks, (lambda e: False) if split else None)
    assert info.value.exit_code == 2
    wanted = "a namespace like 'pusher'" if split else "an id like 'pusher-v0'"
    assert str(info.value).startswith(
        f"{out}: field '-o': expected {wanted} (letters, digits, '-', '_'; at most 95 bytes), since "
        f"minari.load_dataset finds a dataset by its folder name, found {found}. Name the output folder like"
    )
    assert not out.exists()


def test_what_minari_cannot_hold_is_named(tmp_path: Path) -> None:
    plan, chunks, _ = build([Spec(2)], extra=EXTRA_FIELDS)
    plan.not_held = ["last_values", "hidden_states/actor/0"]
    plan.fields["actions_log_prob"] = plan.fields["distribution/mean"] = (np.dtype(np.float32), ())
    assert _export(tmp_path, "held-v0", plan, chunks) == [
        "minari has no place for actions_log_prob, distribution, hidden_states, last_values, values: not exported"
    ]


def test_the_command_exports_a_recording(tmp_path: Path, cli) -> None:
    """``rolloutcli export`` of a real recording: each Minari episode is its env lane's rows in the source."""
    src = REPO / "sample_data" / "cartpole_gru.h5"
    code, out, err = cli("export", src, "--to", "minari", "-o", tmp_path / "cart-v0", "--partial-episodes", "--json")
    assert code == 0, err
    assert json.loads(out)["warnings"][0] == (
        "minari has no place for actions_log_prob, distribution, hidden_states, last_values, privileged_actions, "
        "values: not exported"
    )
    dataset = _load(tmp_path, "cart-v0")
    meta = list(dataset.storage.get_episode_metadata(range(dataset.total_episodes)))
    with h5py.File(src) as f:
        obs = {key: f[f"observations/{key}"][:] for key in ("policy", "critic")}
        actions, rewards, dones = f["actions"][:], f["rewards"][:], f["dones"][:]
    assert dataset.total_steps == dones.size - dataset.total_episodes  # no final observations recorded
    for episode, m in zip(dataset.iterate_episodes(), meta, strict=True):
        lane, start, steps = int(m["lane"]), int(m["start_step"]), int(m["total_steps"])
        at = slice(start, start + steps)
        assert bool(m["last_step_left_out"])
        for key in obs:
            assert np.array_equal(episode.observations[key], obs[key][start : start + steps + 1, lane])
        assert np.array_equal(episode.actions, actions[at, lane]) and np.array_equal(episode.rewards, rewards[at, lane])
        assert not dones[at, lane].any() and not episode.terminations.any() and not episode.truncations.any()


def test_refusals(tmp_path: Path) -> None:
    plan, chunks, _ = build([Spec(3), Spec(2)])
    plan.observations = {}
    with pytest.raises(RolloutError, match=r"^iter_000.h5: field 'observations': expected at least one observation "
                       r"group, found none. Export a recording with observations/<key> datasets.$"):
        export_minari(tmp_path / "a-v0", plan, chunks, None)
    plan, chunks, _ = build([Spec(3), Spec(5)])
    lost = [c for c in chunks if c.episode.number == 1][-1]  # a reader that loses rows is caught, not published
    with pytest.raises(RolloutError, match=rf"b-v0: episode 1: expected 6 rows of observations, found {5 - lost.steps} "
                       r"written; nothing is published. Report this as a bug.$"):
        export_minari(tmp_path / "b-v0", plan, [c for c in chunks if c is not lost], None)
    (tmp_path / "c-v0").mkdir()
    (tmp_path / "c-v0" / "data").write_text("in the way")
    with pytest.raises(RolloutError, match=r"c-v0: cannot write the output") as info:
        export_minari(tmp_path / "c-v0", *build([Spec(2)])[:2], None)
    assert info.value.exit_code == 3


def test_equal_exports_give_equal_bytes(tmp_path: Path) -> None:
    for name in ("a-v0", "b-v0"):
        plan, chunks, _ = build(SPECS, obs=DICT_OBS)
        _export(tmp_path, name, plan, chunks)
    data = [(tmp_path / n / "data" / "main_data.hdf5").read_bytes() for n in ("a-v0", "b-v0")]
    assert data[0] == data[1]
    meta = [json.loads((tmp_path / n / "data" / "metadata.json").read_text()) for n in ("a-v0", "b-v0")]
    assert meta[0] | {"dataset_id": "b-v0"} == meta[1]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.tuples(st.integers(1, 9), st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=6),
    st.integers(1, 4),
    st.integers(0, 2**16),
)
def test_any_episodes_load_back(ends: list, files: int, seed: int) -> None:
    specs = [Spec(n, terminated=term, truncated=trunc, has_next=nxt) for n, term, trunc, nxt in ends]
    plan, chunks, rows = build(specs, files=files, seed=seed)
    kept = [s.steps - (not s.has_next) for s in specs]
    with tempfile.TemporaryDirectory() as root:
        _export(Path(root), "any-v0", plan, chunks)
        dataset = _load(Path(root), "any-v0")
        episodes = list(dataset.iterate_episodes())
        numbers = [n for n, k in enumerate(kept) if k]
        assert len(episodes) == len(numbers)
        for episode, number in zip(episodes, numbers, strict=True):
            for name, value in _expected(rows[number], FLOAT_OBS, kept[number]).items():
                _assert_same(getattr(episode, name), value)


def test_layout_matches_minaris_own_writer(tmp_path: Path) -> None:
    """Minari's DataCollector (the reference) writes the same metadata keys and episode datasets, flags as bool."""
    from import_factory import make_minari

    with mock.patch.dict(os.environ), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its env_spec (a lambda wrapper) is not serialisable
        folder, _ = make_minari(tmp_path / "theirs", 2, dict_obs=True)
    plan, chunks, _ = build([Spec(3)], obs={"pos": FLOAT_OBS["policy"], "vel/v": FLOAT_OBS["policy"]})
    _export(tmp_path / "ours", "mine-v0", plan, chunks)
    meta = [json.loads((f / "data" / "metadata.json").read_text()) for f in (folder, tmp_path / "ours" / "mine-v0")]
    assert set(meta[0]) - {"algorithm_name"} <= set(meta[1])
    assert meta[1]["jpeg_encoding"] is False and meta[0]["minari_version"] == meta[1]["minari_version"]
    listing = []
    for f in (folder, tmp_path / "ours" / "mine-v0"):
        with h5py.File(f / "data" / "main_data.hdf5") as h:
            episode = h["episode_0"]
            names = []
            episode.visititems(lambda n, o, names=names: names.append(n) if isinstance(o, h5py.Dataset) else None)
            flags = {episode[n].dtype for n in ("terminations", "truncations")}
            listing.append((set(names) - {"infos/source_file"}, flags, {"id", "total_steps"} <= set(episode.attrs)))
    assert listing[0] == listing[1] == (
        {"actions", "observations/pos", "observations/vel/v", "rewards", "terminations", "truncations"},
        {np.dtype(bool)},
        True,
    )
