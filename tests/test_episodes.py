"""Episodes joined across consecutive recordings (format contract 1.2): plan_episodes / read_chunks against a
reference walk of one long recording cut into files."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_factory import identifiable, rollout_arrays, write_rollout

from rolloutcli.core.episodes import Segment, lane_segments, valid_side
from rolloutcli.errors import RolloutError
from rolloutcli.pipeline.episodes import plan_episodes, read_chunks

STEP_FIELDS = ("observations/policy", "observations/critic", "actions", "rewards", "dones", "time_outs")


def long_recording(T: int, N: int, seed: int) -> dict[str, np.ndarray]:
    arrays = rollout_arrays(T, N, seed=seed, hidden=None, end_rate=0.15)
    arrays["final_observations/policy"] = identifiable(T, N, 4) + 0.25
    arrays["final_observations/critic"] = identifiable(T, N, 5) + 0.75
    arrays["last_observations/policy"] = identifiable(T + 1, N, 4)[T]
    arrays["last_observations/critic"] = identifiable(T + 1, N, 5)[T] + 0.5
    return arrays


def cut(folder: Path, arrays: dict[str, np.ndarray], sizes: list[int], rid: str = "run-a", **attrs) -> list[Path]:
    """Write ``arrays`` as consecutive files of ``sizes`` steps; names run backwards so names never give the
    order (recording_index does)."""
    folder.mkdir(parents=True, exist_ok=True)
    T = len(arrays["rewards"])
    bounds = np.cumsum([0, *sizes])
    assert bounds[-1] == T
    paths = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        part = {}
        for name, value in arrays.items():
            if name.startswith("last_observations/"):
                key = name.split("/", 1)[1]
                part[name] = value if b == T else arrays[f"observations/{key}"][b]
            elif name == "last_values":
                part[name] = value
            else:
                part[name] = value[a:b]
        extra = {"recording_id": rid, "recording_index": i} if rid else {}
        paths.append(write_rollout(folder / f"it{len(sizes) - i:03d}.h5", part, {**extra, **attrs}))
    return sorted(paths)


def reference(arrays: dict[str, np.ndarray], from_reset: bool) -> list[tuple[int, int, int, bool]]:
    """(start, lane, steps, partial) of every episode of one long recording, by a plain walk."""
    T, N = arrays["dones"].shape
    out = []
    for lane in range(N):
        start = 0
        for t in range(T):
            if arrays["dones"][t, lane]:
                out.append((start, lane, t + 1 - start, start == 0 and not from_reset))
                start = t + 1
        if start < T:
            out.append((start, lane, T - start, True))
    return sorted(out)


@pytest.mark.parametrize("from_reset", [True, False])
def test_episodes_across_files_equal_the_long_recording(tmp_path: Path, from_reset: bool) -> None:
    arrays = long_recording(40, 3, seed=1)
    files = cut(tmp_path / "run", arrays, [7, 10, 13, 10], recorded_from_reset=from_reset)
    whole = reference(arrays, from_reset)
    plan = plan_episodes(files, [f.name for f in files], partial=True)
    assert [(e.start, e.lane, e.steps, e.partial) for e in plan.episodes] == whole
    assert plan.partial == sum(p for *_, p in whole) and plan.left_out == 0
    got: dict[int, dict[str, list[np.ndarray]]] = {}
    for chunk in read_chunks(plan, budget=200):  # a few rows a block: episodes arrive in many chunks
        parts = got.setdefault(chunk.episode.number, {})
        assert sum(len(p) for p in parts.get("rewards", [])) == chunk.offset
        for name, rows in chunk.rows.items():
            parts.setdefault(name, []).append(rows)
        if chunk.last and chunk.episode.has_next:
            ep = chunk.episode
            end = ep.start + ep.steps - 1
            source = "last_observations" if ep.partial_end else "final_observations"
            for key, value in chunk.next_observation.items():
                expected = arrays[f"{source}/{key}"] if ep.partial_end else arrays[f"{source}/{key}"][end]
                np.testing.assert_array_equal(value, expected[ep.lane])
    for ep in plan.episodes:
        for name in STEP_FIELDS:
            joined = np.concatenate(got[ep.number][name])
            expected = arrays[name][ep.start : ep.start + ep.steps, ep.lane]
            np.testing.assert_array_equal(joined, expected.astype(joined.dtype))
        assert ep.terminated == (not ep.partial_end and not arrays["time_outs"][ep.start + ep.steps - 1, ep.lane])


def test_partial_episodes_are_left_out_by_default(tmp_path: Path) -> None:
    arrays = long_recording(30, 2, seed=3)
    files = cut(tmp_path / "run", arrays, [15, 15])
    kept = plan_episodes(files, [f.name for f in files], partial=True)
    plan = plan_episodes(files, [f.name for f in files])
    assert plan.left_out == kept.partial > 0 and plan.partial == kept.partial
    assert [e.number for e in plan.episodes] == list(range(len(plan.episodes)))
    assert len(plan.episodes) == len(kept.episodes) - kept.partial
    assert not any(e.partial for e in plan.episodes)


def test_files_without_a_recording_stand_alone(tmp_path: Path) -> None:
    arrays = long_recording(20, 2, seed=4)
    files = cut(tmp_path / "run", arrays, [10, 10], rid="")
    plan = plan_episodes(files, [f.name for f in files], partial=True)
    assert {e.recording for e in plan.episodes} == {f.name for f in files}
    assert all(e.first_file == e.last_file for e in plan.episodes)


def test_a_missing_index_is_refused(tmp_path: Path) -> None:
    files = cut(tmp_path / "run", long_recording(30, 2, seed=5), [10, 10, 10])
    kept = [files[0], files[2]]  # names run backwards: files[1] holds index 1
    with pytest.raises(RolloutError) as error:
        plan_episodes(kept, [f.name for f in kept])
    assert error.value.exit_code == 1
    assert str(error.value) == (
        f"{files[0]}: attribute 'recording_index': expected 1 after {files[2]} (recording_index 0) in recording "
        "run-a, found recording_index 2. Add the missing file, or export the files of each part of the "
        "recording separately."
    )


def test_a_file_that_does_not_continue_is_refused(tmp_path: Path) -> None:
    arrays = long_recording(20, 3, seed=6)
    files = cut(tmp_path / "run", arrays, [10, 10])
    import h5py

    with h5py.File(files[1], "r+") as f:  # index 0 (names run backwards): its last observation of env 2
        f["last_observations/critic"][2] += 1
    with pytest.raises(RolloutError) as error:
        plan_episodes(files, [f.name for f in files])
    assert str(error.value) == (
        f"{files[0]}: field 'observations' of env 2 at step 0: expected the last_observations of {files[1]} "
        "(the file before it in recording run-a), found other values. Check that no file of the recording is "
        "missing or was replaced."
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=1, max_size=12), min_size=1, max_size=4))
def test_lane_segments_cover_every_step_once(lanes: list[list[int]]) -> None:
    """0: a step, 1: a done, 2: a skipped row (it follows a done, as gymnasium's autoreset steps do)."""
    T = max(len(lane) for lane in lanes)
    codes = np.zeros((T, len(lanes)), int)
    for n, lane in enumerate(lanes):
        fixed = [c if c != 2 or (t > 0 and lane[t - 1] == 1) else 0 for t, c in enumerate(lane)]
        codes[: len(fixed), n] = fixed
    segments = lane_segments(codes >= 1, codes == 2)
    covered = np.zeros_like(codes)
    for s in segments:
        assert isinstance(s, Segment) and s.start < s.stop
        covered[s.start : s.stop, s.lane] += 1
        assert s.ended == (codes[s.stop - 1, s.lane] == 1)
        assert not (codes[s.start : s.stop - 1, s.lane] == 1).any()
    np.testing.assert_array_equal(covered, (codes != 2).astype(int))


def test_valid_side_is_stable_and_near_the_fraction() -> None:
    ids = [f"run\0{lane}\0{start}" for lane in range(50) for start in range(40)]
    sides = [valid_side(7, i, 0.2) for i in ids]
    assert 0.15 < sum(sides) / len(sides) < 0.25
    assert sides == [valid_side(7, i, 0.2) for i in ids]
    assert sides != [valid_side(8, i, 0.2) for i in ids]
    assert not any(valid_side(7, i, 0.0) for i in ids) and all(valid_side(7, i, 1.0) for i in ids)


def test_an_env_done_at_the_files_end_is_not_compared(tmp_path: Path) -> None:
    """TorchRL and gymnasium's DISABLED mode record the observation that ended the episode as last_observations;
    the next file starts from the reset one."""
    arrays = long_recording(20, 2, seed=7)
    arrays["dones"][9, 1] = 1
    files = cut(tmp_path / "run", arrays, [10, 10])
    import h5py

    with h5py.File(files[1], "r+") as f:  # index 0 (names run backwards)
        f["last_observations/policy"][1] += 1
    plan = plan_episodes(files, [f.name for f in files], partial=True)
    assert any(e.lane == 1 and e.start == 10 for e in plan.episodes)
    with h5py.File(files[1], "r+") as f:
        f["last_observations/policy"][0] += 1
    with pytest.raises(RolloutError, match="field 'observations' of env 0 at step 0"):
        plan_episodes(files, [f.name for f in files])


def test_a_files_facts_are_its_segments_and_hashes(tmp_path: Path) -> None:
    """The compact facts (bytes) say what lane_segments and the flags say; hashes only where compared."""
    from rolloutcli.pipeline.episode_facts import END_DONE, END_OPEN, END_TIMEOUT, read_facts

    arrays = long_recording(12, 3, seed=8)
    arrays["dones"][[2, 5, 11], [0, 1, 2]] = 1
    arrays["time_outs"][:] = 0
    arrays["time_outs"][5, 1] = 1
    skip = np.zeros((12, 3), np.uint8)
    skip[3, 0] = 1  # the step after a done of env 0: no step of any episode
    arrays["autoreset_steps"] = skip
    dones = arrays["dones"] != 0
    alone = write_rollout(tmp_path / "alone.h5", arrays)
    facts, _ = read_facts(alone, None, 1 << 20)
    expected = [
        (
            s.lane,
            s.start,
            s.stop,
            END_OPEN if not s.ended else END_TIMEOUT if arrays["time_outs"][s.stop - 1, s.lane] else END_DONE,
        )
        for s in lane_segments(dones, skip != 0)
    ]
    assert facts.rows().tolist() == [list(row) for row in expected]
    assert (facts.T, facts.N, facts.recording, facts.hashes, facts.done_last) == (12, 3, None, None, None)
    one = write_rollout(tmp_path / "one.h5", arrays, {"recording_id": "r", "recording_index": 0})
    facts, _ = read_facts(one, None, 1 << 20)
    assert facts.first().shape == facts.last().shape == (3,) and facts.first().dtype == np.uint64
    assert facts.lanes_done_last().tolist() == np.flatnonzero(dones[-1]).tolist()


def test_interleaved_recordings_and_lone_files_plan_as_each_alone(tmp_path: Path) -> None:
    """Two recordings whose files' names interleave, beside files without a recording: each recording's episodes
    are its long recording's, its pieces tile each episode over consecutive files, and the lone files' episodes
    are theirs; one id string per recording (not one per file)."""
    a, b = long_recording(30, 2, seed=9), long_recording(24, 3, seed=10)
    folder = tmp_path / "mixed"
    files = cut(folder, a, [8, 12, 10], rid="run-a") + cut(folder / "b", b, [9, 6, 9], rid="run-b")
    files += cut(folder / "c", long_recording(10, 2, seed=11), [10], rid="")
    files = sorted(files)
    plan = plan_episodes(files, [str(f.relative_to(folder)) for f in files], partial=True)
    for rid, arrays in (("run-a", a), ("run-b", b)):
        mine = [e for e in plan.episodes if e.recording == rid]
        assert [(e.start, e.lane, e.steps, e.partial) for e in mine] == reference(arrays, False)
        assert len({id(e.recording) for e in mine}) == 1
    alone = [e for e in plan.episodes if e.recording not in ("run-a", "run-b")]
    assert alone and all(e.first_file == e.last_file for e in alone)
    tiles: dict[int, list[tuple[int, int, int, int]]] = {}
    for k, pieces in plan.pieces.items():
        for ep, start, stop, offset in pieces:
            tiles.setdefault(ep.number, []).append((k, start, stop, offset))
    for ep in plan.episodes:
        got = sorted(tiles[ep.number])
        assert [k for k, *_ in got] == list(range(ep.first_file, ep.last_file + 1))
        assert [offset for *_, offset in got] == list(np.cumsum([0] + [stop - start for _, start, stop, _ in got])[:-1])
        assert sum(stop - start for _, start, stop, _ in got) == ep.steps
        assert all(start == 0 for _, start, _, _ in got[1:])
