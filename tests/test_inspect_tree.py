"""``inspect`` never refuses an HDF5 file it can open safely: the tree, the recognised layout and the one line
that says what to do; env-major and flat warnings; non-finite locations; no torch import; 80 columns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
from conftest import SAMPLE
from import_factory import make_d4rl, make_ikostrikov, make_minari, make_robomimic, write_arrays
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.split import SplitOptions, run_split


def _report(cli, path: Path, *extra: str) -> dict:
    code, out, err = cli("inspect", path, "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def test_recognised_layouts_name_the_import_command(tmp_path: Path, cli) -> None:
    sources = {
        "d4rl": make_d4rl(tmp_path / "d4rl.hdf5", [3, 4]),
        "robomimic": make_robomimic(tmp_path / "demo.hdf5", [3, 2]),
        "ikostrikov": write_arrays(tmp_path / "storage.h5", make_ikostrikov(4, 2)),
        "minari": make_minari(tmp_path / "minari", 2)[0] / "data" / "main_data.hdf5",
    }
    for layout, src in sources.items():
        report = _report(cli, src)
        assert not report["contract"] and report["kind"] == layout
        assert report["problem"] == (
            f"{src}: a file in the {layout} layout, not a rollout file; convert it: rolloutcli import {src} -o OUT.h5"
        )
        code, text, _ = cli("inspect", src)
        assert code == 0 and f"rolloutcli import {src}" in text and "(not a rollout file)" in text


def test_tree_shows_groups_datasets_attributes(tmp_path: Path, cli) -> None:
    src = make_robomimic(tmp_path / "demo.hdf5", [3])
    with h5py.File(src, "a") as f:
        f.create_dataset("data/demo_0/zipped", data=np.zeros((8, 2)), chunks=(4, 2), compression="gzip")
    report = _report(cli, src)
    tree = {entry["path"]: entry for entry in report["tree"]}
    assert tree["/data"] == {"path": "/data", "kind": "group", "attrs": {"env_args": '{"env_name": "Lift"}'}}
    zipped = tree["/data/demo_0/zipped"]
    assert (zipped["shape"], zipped["dtype"], zipped["chunks"], zipped["compression"]) == (
        [8, 2],
        "float64",
        [4, 2],
        "gzip",
    )
    assert tree["/data/demo_0"]["attrs"] == {"num_samples": 3}
    _, text, _ = cli("inspect", src)
    assert "/data/demo_0/zipped" in text and "gzip" in text and "num_samples = 3" in text


def test_unknown_file_says_what_is_missing(tmp_path: Path, cli) -> None:
    src = write_arrays(tmp_path / "x.h5", {"foo": np.zeros(3), "observations/policy": np.zeros((4, 2, 3))})
    report = _report(cli, src)
    assert report["kind"] == "unknown"
    assert "not a rollout file (missing actions, rewards, dones)" in report["problem"]
    assert "rolloutcli import" in report["problem"]
    # --strict turns it into exit 1
    code, _, err = cli("inspect", src, "--strict", "-q")
    assert code == 1 and "--strict" in err


def test_split_file_and_shard_folder(tmp_path: Path, cli) -> None:
    rollout = write_rollout(tmp_path / "r.h5", rollout_arrays())
    split = tmp_path / "split.h5"
    run_split(rollout, split, SplitOptions(), RunOptions())
    report = _report(cli, split)  # was refused (exit 1) before: intended change
    assert report["kind"] == "split" and f"rolloutcli split --unpad {split} -o OUT.h5" in report["problem"]
    gae = tmp_path / "gae.h5"
    assert cli("gae", rollout, "-o", gae, "-q")[0] == 0
    assert cli("batch", gae, "-o", tmp_path / "shards", "-m", "2", "-q")[0] == 0
    report = _report(cli, tmp_path / "shards")
    assert report["kind"] == "shards" and "ShardDataset" in report["problem"] and "2 shards" in report["problem"]
    shard = next((tmp_path / "shards").glob("*.h5"))
    assert _report(cli, shard)["kind"] == "shard"


def test_flat_and_env_major_warnings(tmp_path: Path, cli) -> None:
    flat = write_arrays(
        tmp_path / "flat.h5",
        {
            "observations": np.zeros((40, 3)),
            "actions": np.zeros((40, 1)),
            "rewards": np.zeros(40),
            "dones": np.zeros(40, np.uint8),
        },
    )
    assert any("looks flat ([T*N])" in w for w in _report(cli, flat)["warnings"])
    arrays = rollout_arrays(T=16, N=6, end_rate=0.1)
    arrays["dones"][:, 2] = 1  # read as [T, N]: "env" 2 ends an episode at every step (a time-limit column)
    arrays["time_outs"][:] = 0
    env_major = write_rollout(tmp_path / "nt.h5", arrays)
    assert any("looks env-major ([N, T])" in w for w in _report(cli, env_major)["warnings"])
    said = write_rollout(tmp_path / "said.h5", rollout_arrays(), {"dim_order": "[N, T]"})
    warning = next(w for w in _report(cli, said)["warnings"] if "env-major" in w)
    assert "attribute 'dim_order'" in warning
    assert not any("env-major" in w for w in _report(cli, SAMPLE)["warnings"])


def test_root_attributes_and_nonfinite_locations(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=10, N=3)
    arrays["observations/policy"][4, 2, 1] = np.nan
    arrays["observations/policy"][7, 0, 0] = np.inf
    src = write_rollout(tmp_path / "nan.h5", arrays, {"recorded_with": "test"})
    report = _report(cli, src)
    assert report["attrs"]["recorded_with"] == "test"
    assert report["nonfinite"] == [{"dataset": "observations/policy", "count": 2, "first_step": 4, "first_env": 2}]
    _, text, _ = cli("inspect", src)
    assert "recorded_with = test" in text and "observations/policy: 2 values, first at step 4, env 2" in text
    tree_file = write_arrays(tmp_path / "t.h5", {"x": np.array([[0, 1], [np.nan, 2]])})
    assert _report(cli, tree_file)["nonfinite"][0] == {"dataset": "x", "count": 1, "first_step": 1, "first_env": 0}


def test_inspect_does_not_import_torch(tmp_path: Path) -> None:
    src = make_robomimic(tmp_path / "demo.hdf5", [2])
    code = (
        "import sys; from rolloutcli.cli.app import main; "
        f"assert main(['inspect', {str(SAMPLE)!r}, '-q']) == 0; assert main(['inspect', {str(src)!r}, '-q']) == 0; "
        "from rolloutcli.pipeline.inspect import run_inspect; from rolloutcli.pipeline.options import RunOptions; "
        f"run_inspect(__import__('pathlib').Path({str(SAMPLE)!r}), RunOptions()); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_tables_fit_80_columns_when_redirected(tmp_path: Path) -> None:
    src = make_robomimic(tmp_path / "demo.hdf5", [2])
    for path in (SAMPLE, src):
        result = subprocess.run(
            [sys.executable, "-m", "rolloutcli", "inspect", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**__import__("os").environ, "COLUMNS": ""},
        )
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        table = [line for line in lines if not line.startswith(("warning:", str(path), "episodes:", "  length"))]
        assert max(len(line) for line in table) <= 80, max(table, key=len)
