"""``inspect`` never refuses an HDF5 file it can open safely: the tree, the recognised layout and the one line
that says what to do (alone, for a layout it knows); env-major and flat warnings; non-finite locations; no torch
import; every command's human output within 80 columns, names never broken (issue 41.5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
from conftest import SAMPLE
from import_factory import make_d4rl, make_ikostrikov, make_minari, make_robomimic, write_arrays
from promises import assert_fits
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.cli.inspect import histogram_lines
from rolloutcli.cli.render import command_lines, fit, grid
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
        # the hint alone: no contract warning ("Record it; see the format contract") contradicts it
        assert report["warnings"] == [report["problem"]]
        code, text, _ = cli("inspect", src)
        lines = text.splitlines()
        hint = lines.index(f"  rolloutcli import {src} -o OUT.h5" if len(str(src)) < 50 else "  rolloutcli import \\")
        assert code == 0 and "(not a rollout file)" in " ".join(text.split())
        assert "warning" not in "\n".join(lines[hint + 1 :]) and "Record it" not in text


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
    """A real pipe: 80 columns whatever the terminal the command was started from (issue 41.5)."""
    src = make_robomimic(tmp_path / "demo.hdf5", [2])
    for path in (SAMPLE, src):
        result = subprocess.run(
            [sys.executable, "-m", "rolloutcli", "inspect", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "COLUMNS": ""},
        )
        assert result.returncode == 0, result.stderr
        assert_fits(result.stdout, [str(path), "/data/demo_0/actions"])


LONG_GROUP = "observations/proprioception_of_the_whole_robot_arm"  # too long for the fields table's name column


def test_every_command_fits_80_columns_and_never_breaks_a_name(tmp_path: Path, cli, monkeypatch) -> None:
    """Each command's human output, captured (not a terminal), on sample_data/*.h5, a dataset folder whose
    files hold a long observation group, and foreign layouts: 80 columns, no name broken (issue 41.5)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.chdir(tmp_path)  # paths as a user types them: each fits a line (a longer one could not)
    work = Path("w")  # a dataset's summary names its resolved folder: tmp_path + 10 columns
    (dataset := work / "dataset").mkdir(parents=True)
    for i in range(3):
        arrays = rollout_arrays(T=16, N=4, seed=i)
        arrays[LONG_GROUP] = arrays["observations/policy"][..., :3].copy()
        write_rollout(dataset / f"recording_number_{i}.h5", arrays)
    d4rl, minari = (
        make_d4rl(work / "d4rl.hdf5", [3, 4]),
        make_minari(tmp_path / work / "minari", 2)[0].relative_to(tmp_path),
    )
    runs: list[tuple] = []
    for src in [*sorted(SAMPLE.parent.glob("*.h5")), dataset]:
        (out := work / f"{src.stem}_outputs").mkdir()
        gae = out / "gae" if src.is_dir() else out / "gae.h5"
        runs += [
            ("inspect", src),
            ("inspect", src, "--per-dim"),
            ("stats", src),
            ("gae", src, "-o", gae),
            ("returns", src, "-o", out / "returns"),
            ("nstep", src, "-o", out / "nstep", "--timeouts", "ignore"),
            ("split", src, "-o", out / "split"),
            ("batch", gae, "-o", out / "ff", "-m", 2),
        ]
        if not src.is_dir():
            runs += [
                ("split", "--unpad", out / "split", "-o", out / "unpadded.h5"),
                ("batch", gae, "-o", out / "parity", "-m", 2, "--rsl-parity"),
                ("batch", gae, "-o", out / "history", "-m", 2, "--history", 3),
                ("batch", gae, "-o", out / "recurrent", "-m", 2, "--recurrent", "--shuffle-envs"),
                ("batch", gae, "-o", out / "distillation", "-m", 2, "--distillation"),
                ("inspect", out / "split"),
                ("inspect", out / "ff"),
            ]
    runs += [("inspect", d4rl), ("inspect", minari), ("inspect", minari / "data" / "main_data.hdf5")]
    runs += [
        ("import", d4rl, "-o", work / "d4rl.h5"),
        ("plot", work / "cartpole_gru_outputs" / "gae.h5", "-o", work / "p.png"),
    ]
    for args in runs:
        code, text, err = cli(*args)
        assert code == 0, (args, err)
        paths = [a for a in args if isinstance(a, Path)]
        assert_fits(text, [*_object_names(paths[0]), *map(str, paths), *(p.name for p in paths)])


def _object_names(path: Path) -> list[str]:
    """The names of the groups and datasets of ``path`` (of its first HDF5 file, for a folder)."""
    files = sorted(p for p in path.rglob("*") if p.suffix in (".h5", ".hdf5")) if path.is_dir() else [path]
    names: list[str] = []
    with h5py.File(files[0], "r") as handle:
        handle.visit(names.append)
    return names


def test_a_name_too_long_for_its_column_takes_a_line_of_its_own() -> None:
    rows = [("actions", "16x4x2", "float32"), (LONG_GROUP, "16x4x3", "float32")]
    assert grid(50, "fields", ("dataset", "shape", "dtype"), rows, ("shape",)) == [
        "fields",
        f"{'dataset':33}   shape  dtype",  # 50 columns less the others' 6 + 7 and two gaps: 33 for names
        "─" * 50,
        f"{'actions':33}  16x4x2  float32",
        LONG_GROUP,
        f"{'':33}  16x4x3  float32",
    ]
    n = len(LONG_GROUP)  # where it fits, the name column is as wide as its longest name
    assert grid(80, "t", ("dataset", "dtype"), [(LONG_GROUP, "float32")])[1:] == [
        f"{'dataset':{n}}  dtype",
        "─" * (n + 9),
        f"{LONG_GROUP}  float32",
    ]


def test_text_wraps_at_spaces_and_commands_with_continuations() -> None:
    line = "  length of 57 fully recorded episodes: " + "x" * 60 + " end"
    assert [t.plain for t in fit(line, 50)] == ["  length of 57 fully recorded episodes:", "    " + "x" * 60, "    end"]
    command = f"rolloutcli import /{'d' * 60}/d4rl.hdf5 -o OUT.h5"
    assert command_lines(command, 80) == ["  rolloutcli import \\", f"    /{'d' * 60}/d4rl.hdf5 \\", "    -o OUT.h5"]
    assert command_lines("rolloutcli import x.h5 -o OUT.h5", 80) == ["  rolloutcli import x.h5 -o OUT.h5"]


def test_histogram_collapses_runs_of_empty_bins() -> None:
    counts = [2, 0, 0, 0, 1, 0, 4]
    bins = [{"from": 10 * i, "to": 10 * i + 9, "count": c} for i, c in enumerate(counts)]
    assert histogram_lines(bins) == [
        "          0-9 | " + "█" * 20 + " 2",
        "        10-39 | 0",
        "        40-49 | " + "█" * 10 + " 1",
        "        50-59 | 0",
        "        60-69 | " + "█" * 40 + " 4",
    ]


def test_inspect_texts_at_80_columns(cli) -> None:
    code, text, _ = cli("inspect", SAMPLE)
    assert code == 0
    lines = text.splitlines()
    start = lines.index("episodes: 73 completed (31 terminations, 42 time-outs)")
    assert lines[start + 1 : start + 4] == [
        "  16 started before the recording, 15 unfinished at the end",
        "  length of 57 fully recorded episodes: min 23  mean 54.9  max 64",
        "  percentiles: p5 30  p25 45  median 64  p75 64  p95 64",
    ]
    assert "hidden_states/actor/0  256x1x16x16  float32  64x1x16x16  gzip+shuffle  256.0 KiB" in lines
    assert lines[lines.index("hidden_states/critic/0") + 1] == (
        "                       256x1x16x16  float32  64x1x16x16  gzip+shuffle  256.0 KiB"
    )


def test_batch_names_its_order_in_words(cli, tmp_path: Path) -> None:
    """The summary says how rows were drawn; the algorithm is in the manifest and docs/commands.md."""
    gae = tmp_path / "gae.h5"
    assert cli("gae", SAMPLE, "-o", gae, "-q")[0] == 0
    expected = {
        (): "order: rows shuffled anew each epoch, seed 3",
        ("--rsl-parity",): "order: RSL-RL's shuffle, one for all epochs, seed 3",
        ("--recurrent",): "order: groups of neighbouring envs, the same every epoch",
        ("--recurrent", "--rsl-parity"): "order: RSL-RL's groups of N // M neighbouring envs, the same every epoch",
        ("--recurrent", "--shuffle-envs"): "order: envs shuffled into new groups each epoch, seed 3",
        ("--distillation",): "order: consecutive steps, as RSL-RL's generator(), the same every epoch",
        ("--history", "2"): "order: windows shuffled anew each epoch, seed 3",
        ("--transitions", "--timeouts", "ignore"): "order: transitions shuffled anew each epoch, seed 3",
    }
    for i, (extra, line) in enumerate(expected.items()):
        code, text, err = cli("batch", gae, "-o", tmp_path / f"s{i}", "-m", 2, "--seed", 3, *extra)
        assert code == 0, err
        assert line in text.splitlines() and "feistel" not in text and "torch." not in text
