"""``batch`` on a dataset: one shuffle over every row of every file, env groups over every (file, env) pair."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.cli.render import fit

SIZES = [(12, 3), (20, 2), (12, 4)]


def gae_dataset(cli, folder: Path, sizes: list[tuple[int, int]]) -> Path:
    (folder / "raw").mkdir(parents=True)
    arrays = []
    for i, (T, N) in enumerate(sizes):
        arrays.append(rollout_arrays(T=T, N=N, seed=i))
        write_rollout(folder / "raw" / f"r{i}.h5", arrays[-1])
    assert cli("gae", folder / "raw", "-o", folder / "gae")[0] == 0
    return folder / "gae"


def shard_files(folder: Path) -> list[dict[str, np.ndarray]]:
    manifest = json.loads((folder / "manifest.json").read_text())
    out = []
    for entry in manifest["shards"]:
        with h5py.File(folder / entry["file"], "r") as handle:
            names: list[str] = []
            handle.visititems(
                lambda name, obj, names=names: names.append(name) if isinstance(obj, h5py.Dataset) else None
            )
            out.append({name: handle[name][()] for name in names})
    return out


def tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_feedforward_one_shuffle_over_every_row_of_every_file(cli, tmp_path: Path) -> None:
    gae = gae_dataset(cli, tmp_path, SIZES)
    code, _, err = cli("batch", gae, "-o", tmp_path / "s", "-m", 4, "--epochs", 2, "--seed", 3)
    assert code == 0, err
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    files = manifest["source"]["files"]
    assert [f["row_offset"] for f in files] == [0, 36, 76] and manifest["order_algorithm"]["name"] == "feistel-cw"
    sources = []
    for i in range(3):
        with h5py.File(gae / f"r{i}.h5", "r") as handle:
            sources.append(handle["observations/policy"][()].reshape(-1, 4))
    every = np.concatenate(sources)  # dataset row g = row_offset + t * N + n
    shards = shard_files(tmp_path / "s")
    for epoch in range(2):
        index = np.concatenate([s["index"] for s in shards[4 * epoch : 4 * epoch + 4]])
        assert sorted(index.tolist()) == list(range(124))  # every row of every file once per epoch
        obs = np.concatenate([s["observations/policy"] for s in shards[4 * epoch : 4 * epoch + 4]])
        assert np.array_equal(obs, every[index])
    first = np.concatenate([s["index"] for s in shards[:4]])
    assert first[:36].max() >= 36 and not np.array_equal(first, np.arange(124))  # files are mixed
    # the same bytes whatever the budget (streamed block by block) and the argument order
    args = ["-m", 4, "--epochs", 2, "--seed", 3, "--max-memory", "8K"]
    assert cli("batch", gae / "r2.h5", gae / "r0.h5", gae / "r1.h5", "-o", tmp_path / "t", *args)[0] == 0
    assert tree(tmp_path / "s") == tree(tmp_path / "t")


def _concat(arrays: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    def axis(name: str) -> int:
        return 2 if name.startswith("hidden_states/") else 0 if name.startswith("last_") else 1

    return {k: np.concatenate([a[k] for a in arrays], axis=axis(k)) for k in arrays[0]}


@pytest.mark.parametrize("mode", ["--recurrent", "--shuffle-envs"])
def test_recurrent_env_groups_equal_the_files_side_by_side(cli, tmp_path: Path, mode: str) -> None:
    sizes = [(12, 3), (12, 2), (12, 4)]
    raw = [rollout_arrays(T=T, N=N, seed=i) for i, (T, N) in enumerate(sizes)]
    (tmp_path / "raw").mkdir()
    for i, arrays in enumerate(raw):
        write_rollout(tmp_path / "raw" / f"r{i}.h5", arrays)
    write_rollout(tmp_path / "wide.h5", _concat(raw))
    opts = ["-m", 3, "--epochs", 2, "--seed", 1, "--recurrent", *(["--shuffle-envs"] if mode != "--recurrent" else [])]
    # gae per file equals gae of the side-by-side file (GAE never crosses envs; no normalisation across files)
    assert cli("gae", tmp_path / "raw", "-o", tmp_path / "gae", "--no-normalize")[0] == 0
    assert cli("gae", tmp_path / "wide.h5", "-o", tmp_path / "wide_gae.h5", "--no-normalize")[0] == 0
    assert cli("batch", tmp_path / "gae", "-o", tmp_path / "d", *opts)[0] == 0
    assert cli("batch", tmp_path / "wide_gae.h5", "-o", tmp_path / "w", *opts)[0] == 0
    ours, wide = shard_files(tmp_path / "d"), shard_files(tmp_path / "w")
    assert len(ours) == len(wide) == 6
    for a, b in zip(ours, wide, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert np.array_equal(a[key], b[key]), key
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["source"]["T"] == 12 and manifest["source"]["N"] == 9
    assert manifest["source"]["rows"] == "t * N_total + env_offset + n"


def test_files_of_other_gae_options_are_recorded_per_file(cli, tmp_path: Path) -> None:
    """Two files from gae runs with other lambdas and normalisation: the manifest and the summary give each
    file's value (it gave the first file's for all rows)."""
    from conftest import SAMPLE

    assert cli("gae", SAMPLE, "-o", tmp_path / "it1.h5")[0] == 0
    assert cli("gae", SAMPLE, "-o", tmp_path / "it2.h5", "--lam", 0.9, "--no-normalize")[0] == 0
    code, out, err = cli("batch", tmp_path / "it*.h5", "-o", tmp_path / "s", "-m", 4)
    assert code == 0, err
    gae = {"gamma": 0.99, "lambda": [0.95, 0.9], "advantages_normalized": [True, False], "timeouts_bootstrapped": True}
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["gae"] == gae
    lines = out.splitlines()  # within 80 columns (issue 41.5)
    at = lines.index("gae from the source: gamma 0.99  lambda [0.95, 0.9]  normalized [True, False]")
    assert lines[at + 1] == "  (a list: each file's value, in file order; the files differ)"
    assert cli("batch", tmp_path / "it1.h5", "-o", tmp_path / "one", "-m", 4)[0] == 0
    assert json.loads((tmp_path / "one" / "manifest.json").read_text())["gae"]["lambda"] == 0.95


def test_dataset_refusals(cli, tmp_path: Path) -> None:
    gae = gae_dataset(cli, tmp_path, SIZES)
    code, _, err = cli("batch", gae, "-o", tmp_path / "r", "-m", 2, "--recurrent")
    assert code == 1 and "r1.h5: field 'rewards': expected T = 12 as in" in err and "batch --recurrent" in err
    code, _, err = cli("batch", gae, "-o", tmp_path / "p", "-m", 2, "--rsl-parity")
    assert code == 2 and "--rsl-parity: RSL-RL's order is for one file, found a dataset" in err
    code, _, err = cli("batch", gae, "-o", tmp_path / "h", "-m", 2, "--history", 2)
    assert code == 2 and "--history: expected one rollout file, found a dataset" in err
    code, _, err = cli("batch", gae, "-o", tmp_path / "t", "-m", 2, "--transitions")  # an AttributeError before
    assert (code, err) == (
        2,
        "error: --transitions: expected one rollout file, found a dataset; export each file on its own.\n",
    )
    code, _, err = cli("batch", gae, "-o", tmp_path / "m", "-m", 125)
    assert code == 2 and "expected at most 124 (the dataset's rows (T*N))" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gae", "raw"]  # nothing published, no temporaries


def test_an_existing_output_is_refused_before_the_files_are_checked(cli, tmp_path: Path, monkeypatch) -> None:
    from rolloutcli.errors import RolloutError
    from rolloutcli.pipeline import batch
    from rolloutcli.pipeline.options import RunOptions

    gae = gae_dataset(cli, tmp_path, SIZES)
    assert cli("batch", gae, "-o", tmp_path / "shards", "-m", 2)[0] == 0
    before = tree(tmp_path / "shards")
    monkeypatch.setattr(batch, "_check_dataset", lambda *args: pytest.fail("the files were checked"))
    code, _, err = cli("batch", gae, "-o", tmp_path / "shards", "-m", 2)
    assert (code, err) == (
        2,
        f"error: {tmp_path / 'shards'}: output already exists; refusing to overwrite it. Pass --overwrite to "
        "replace it.\n",
    )
    assert tree(tmp_path / "shards") == before
    with pytest.raises(RolloutError, match="output already exists"):  # the library refuses it first too
        batch.run_batch(sorted(gae.glob("*.h5")), tmp_path / "shards", batch.BatchOptions(2), RunOptions())
    assert tree(tmp_path / "shards") == before


def test_the_summary_of_a_dataset_names_its_files_in_words(cli, tmp_path: Path) -> None:
    """The first summary line of a dataset's batch: the file count and the first file, and "T differs" for files
    of several lengths (it printed the Python list of paths and T=None)."""
    data = gae_dataset(cli, tmp_path, [(12, 3), (20, 2)])
    code, out, err = cli("batch", data, "-o", tmp_path / "shards", "-m", 2)
    assert code == 0, err
    first = [
        line.plain
        for line in fit(
            f"batch 2 files ({data / 'r0.h5'} ...) -> {tmp_path / 'shards'}  (feedforward, T differs, N=5)", 80
        )
    ]  # wrapped at spaces (issue 41.5)
    assert out.splitlines()[: len(first)] == first
