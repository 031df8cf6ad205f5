"""``batch --valid-fraction``: two shard folders whose rows (or envs) partition the source's, each episode or env
whole on one side, the same sides whatever files are added, the same bytes on every engine."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
from test_episodes import cut, long_recording

from rolloutcli.shards import ShardDataset

GAE = {"advantages", "returns"}


def gae_recording(folder: Path, T: int = 60, N: int = 4, sizes=(20, 20, 20), seed: int = 2) -> list[Path]:
    arrays = long_recording(T, N, seed)
    arrays["advantages"] = np.arange(T * N, dtype=np.float32).reshape(T, N)  # identifiable: row t * N + n
    arrays["returns"] = -arrays["advantages"]
    return cut(folder, arrays, list(sizes), recorded_from_reset=True)


def shard_rows(folder: Path) -> np.ndarray:
    """Every row's dataset row number (the manifest's index of each shard), in shard order."""
    rows = [np.asarray(item["index"]) for item in ShardDataset(folder, as_dict=True)]
    return np.concatenate(rows)


def episodes_by_row(files: list[Path]) -> dict[int, tuple]:
    """Dataset row (feed-forward numbering over the files in sorted order) -> (recording index, row, lane) of
    the first step of its episode in the long recording the files were cut from."""
    from rolloutcli.pipeline.episodes import plan_episodes

    plan = plan_episodes(files, [f.name for f in files], partial=True)
    order = {p: i for i, p in enumerate(sorted(files))}
    sizes = []
    for f in sorted(files):
        with h5py.File(f) as h:
            sizes.append(h["rewards"].shape)
    offsets = np.concatenate([[0], np.cumsum([t * n for t, n in sizes])])
    out = {}
    for k, pieces in plan.pieces.items():
        i = order[plan.files[k]]
        for ep, start, stop, _ in pieces:
            for t in range(start, stop):
                out[int(offsets[i] + t * sizes[i][1] + ep.lane)] = (ep.origin, ep.lane)
    return out


def test_the_sides_partition_the_rows_by_episode(tmp_path: Path, cli) -> None:
    files = gae_recording(tmp_path / "runs")
    code, out, err = cli("batch", tmp_path / "runs", "-o", tmp_path / "sp", "-m", "2", "--valid-fraction", "0.3")
    assert code == 0, err
    assert "split by episode into" in out and "valid: " in out
    train, valid = shard_rows(tmp_path / "sp" / "train"), shard_rows(tmp_path / "sp" / "valid")
    both = np.concatenate([train, valid])
    assert len(valid) and len(train)
    assert sorted(both.tolist()) == list(range(60 * 4))  # every row once
    episode = episodes_by_row(files)
    assert not {episode[r] for r in train.tolist()} & {episode[r] for r in valid.tolist()}  # episodes whole
    manifest = json.loads((tmp_path / "sp" / "valid" / "manifest.json").read_text())
    assert manifest["split"] | {} == manifest["split"] and manifest["split"]["side"] == "valid"
    assert manifest["split"]["rows"] == len(valid)
    flat = np.concatenate([h5py.File(f)["advantages"][()].reshape(-1) for f in sorted(files)])
    for item in ShardDataset(tmp_path / "sp" / "valid", as_dict=True):  # the rows' data are the source's rows
        np.testing.assert_array_equal(np.asarray(item["advantages"]), flat[np.asarray(item["index"])])


def test_adding_files_moves_no_episode(tmp_path: Path, cli) -> None:
    files = gae_recording(tmp_path / "all", T=80, sizes=(20, 20, 20, 20))
    (tmp_path / "some").mkdir()
    for f in sorted(files, key=lambda p: h5py.File(p).attrs["recording_index"])[:2]:
        (tmp_path / "some" / f.name).write_bytes(f.read_bytes())
    sides = {}
    for name in ("some", "all"):
        assert (
            cli("batch", tmp_path / name, "-o", tmp_path / f"sp_{name}", "-m", "2", "--valid-fraction", "0.4")[0] == 0
        )
        episode = episodes_by_row(sorted((tmp_path / name).iterdir()))
        sides[name] = {episode[r] for r in shard_rows(tmp_path / f"sp_{name}" / "valid").tolist()}
    # an episode of the first two files is on the same side in both datasets
    first_two = set(episodes_by_row(sorted((tmp_path / "some").iterdir())).values())
    assert {e for e in sides["all"] if e in first_two} == {e for e in sides["some"] if e in first_two}


def test_recurrent_by_env_and_the_refusals(tmp_path: Path, cli) -> None:
    gae_recording(tmp_path / "runs", N=8)
    args = ["batch", tmp_path / "runs", "-o", tmp_path / "sp", "--recurrent", "-m", "1", "--valid-fraction", "0.4"]
    code, _, err = cli(*args)
    assert code == 2 and err.strip() == (
        "error: --split-by episode: recurrent batches hold whole envs, so a held-out episode would leave a hole "
        "in its env; use --split-by env."
    )
    assert cli(*args, "--split-by", "env")[0] == 0
    envs = {}
    for side in ("train", "valid"):
        items = list(ShardDataset(tmp_path / "sp" / side, as_dict=True))
        envs[side] = set(np.concatenate([np.asarray(i["trajectory_env"]).ravel() for i in items]).tolist())
    assert envs["train"].isdisjoint(envs["valid"]) and envs["train"] | envs["valid"] == set(range(8 * 3)) - set()
    code, _, err = cli(
        "batch", tmp_path / "runs", "-o", tmp_path / "d", "--distillation", "-m", "1", "--valid-fraction", "0.4"
    )
    assert code == 2 and "expected feed-forward or --recurrent batches, found --distillation" in err


def test_same_bytes_on_two_workers(tmp_path: Path, cli) -> None:
    gae_recording(tmp_path / "runs")
    args = ["-m", "3", "--valid-fraction", "0.3", "--epochs", "2", "--max-memory", "16K"]
    assert cli("batch", tmp_path / "runs", "-o", tmp_path / "w1", *args)[0] == 0
    assert cli("batch", tmp_path / "runs", "-o", tmp_path / "w2", *args, "--workers", "2")[0] == 0
    for side in ("train", "valid"):
        for shard in sorted((tmp_path / "w1" / side).glob("*.h5")):
            assert shard.read_bytes() == (tmp_path / "w2" / side / shard.name).read_bytes()
