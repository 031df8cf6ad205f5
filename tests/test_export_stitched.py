"""Issue 42's acceptance: a real gymnasium run recorded once as consecutive files and once as one file gives the
same episodes, whole, through the reader and through every export target."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from record_factory import consecutive_recordings

from rolloutcli.pipeline.episodes import plan_episodes, read_chunks

pytest.importorskip("gymnasium")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[list[Path], Path]:
    return consecutive_recordings(tmp_path_factory.mktemp("cartpole"), files=5, steps_per_file=24, num_envs=3, seed=3)


def _episodes(files: list[Path]) -> list[tuple[tuple, dict[str, np.ndarray]]]:
    plan = plan_episodes(files, [f.name for f in files], partial=True)
    rows: dict[int, dict[str, list[np.ndarray]]] = {}
    for chunk in read_chunks(plan, budget=4096):
        for name, value in chunk.rows.items():
            rows.setdefault(chunk.episode.number, {}).setdefault(name, []).append(value)
    described = [
        (e.start, e.lane, e.steps, e.partial_start, e.partial_end, e.terminated, e.truncated, e.has_next)
        for e in plan.episodes
    ]
    joined = [{k: np.concatenate(v) for k, v in rows[e.number].items()} for e in plan.episodes]
    return list(zip(described, joined, strict=True))


def test_the_files_give_the_long_recordings_episodes(run) -> None:
    many, one = run
    stitched, whole = _episodes(many), _episodes([one])
    assert [d for d, _ in stitched] == [d for d, _ in whole]
    crossing = [d for d, _ in stitched if d[0] // 24 != (d[0] + d[2] - 1) // 24]
    assert crossing and any(d[5] for d, _ in stitched) and any(d[6] for d, _ in stitched)
    for (_, a), (_, b) in zip(stitched, whole, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _tree(path: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    files = [path] if path.is_file() else sorted(path.rglob("*.hdf5"))
    for file in files:
        with h5py.File(file, "r") as f:
            f.visititems(lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None)
    return out


@pytest.mark.parametrize("target", ["minari", "robomimic", "d4rl"])
def test_every_target_gets_the_same_episodes(run, cli, tmp_path: Path, target: str) -> None:
    many, one = run
    name = "out-v0" if target == "minari" else "out.hdf5"
    outs = []
    for label, files in (("many", many), ("one", [one])):
        out = tmp_path / label / name
        out.parent.mkdir()
        code, _, err = cli("export", *files, "--to", target, "-o", out)
        assert code == 0, err
        outs.append(_tree(out))
    stitched, whole = outs
    assert stitched.keys() == whole.keys() and stitched
    for key in stitched:
        if not key.endswith("source_file"):  # the step's file index: 0-4 against 0
            np.testing.assert_array_equal(stitched[key], whole[key], err_msg=key)


@pytest.mark.parametrize("target", ["minari", "d4rl"])
def test_two_workers_give_the_same_bytes(run, cli, tmp_path: Path, target: str) -> None:
    """The plan reads each file as a unit of the engine; one process writes: the same bytes as --workers 1."""
    many, _ = run
    name = "out-v0" if target == "minari" else "out.hdf5"
    for workers in ("1", "2"):
        (tmp_path / workers).mkdir()
        args = ("--to", target, "-o", tmp_path / workers / name, "--workers", workers, "--valid-fraction", "0.3")
        code, _, err = cli("export", *many, *args)
        assert code == 0, err
    one = sorted(p.relative_to(tmp_path / "1") for p in (tmp_path / "1").rglob("*") if p.is_file())
    assert one == sorted(p.relative_to(tmp_path / "2") for p in (tmp_path / "2").rglob("*") if p.is_file())
    for path in one:
        assert (tmp_path / "1" / path).read_bytes() == (tmp_path / "2" / path).read_bytes(), path
