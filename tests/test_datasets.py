"""Datasets: several files per command (resolve, schema agreement, per-file outputs, dataset.json, --resume)."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.dataset import check_agreement, resolve
from rolloutcli.errors import RolloutError
from rolloutcli.pipeline.dataset_job import partial_folder, run_dataset
from rolloutcli.pipeline.dataset_journal import JOURNAL
from rolloutcli.pipeline.engine import EngineOptions
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.split import SplitOptions, run_split


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    (tmp_path / "runs" / "a").mkdir(parents=True)
    write_rollout(tmp_path / "runs" / "a" / "r1.h5", rollout_arrays(T=12, N=3, seed=1))
    write_rollout(tmp_path / "runs" / "r0.h5", rollout_arrays(T=20, N=2, seed=2))
    write_rollout(tmp_path / "runs" / "r2.h5", rollout_arrays(T=12, N=4, seed=3))
    return tmp_path / "runs"


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def journal_names(partial: Path) -> list[str]:
    """The outputs a partial folder's journal records as finished (its lines after the first)."""
    lines = (partial / JOURNAL).read_bytes().splitlines()[1:]
    return [json.loads(line)["output"]["name"] for line in lines]


def test_resolve_sorts_dedups_and_names(runs: Path, tmp_path: Path) -> None:
    data = resolve([runs])
    assert data.names == ("a/r1.h5", "r0.h5", "r2.h5") and data.many
    assert resolve([str(runs / "r*.h5")]).names == ("r0.h5", "r2.h5")
    one = resolve([runs / "r0.h5"])
    assert not one.many and list(one.files) == [runs / "r0.h5"]
    assert resolve([runs / "r2.h5", runs / "r0.h5"]).names == ("r0.h5", "r2.h5")
    os.symlink(runs / "r0.h5", tmp_path / "link.h5")
    with pytest.raises(RolloutError, match="the same file as") as error:
        resolve([runs / "r0.h5", tmp_path / "link.h5"])
    assert error.value.exit_code == 2
    (tmp_path / "empty").mkdir()
    with pytest.raises(RolloutError, match="empty: expected rollout files") as error:
        resolve([tmp_path / "empty"])
    assert error.value.exit_code == 2  # as a glob matching nothing: one rule (issue 40.9)
    with pytest.raises(RolloutError, match=r"nope\*.h5: expected files matching the pattern, found none") as error:
        resolve([str(tmp_path / "nope*.h5")])
    assert error.value.exit_code == 2


def test_resolve_keeps_each_path_as_pathlib_gives_it(runs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files are held packed (``dataset.Paths``), each read back as the ``Path`` of the name found, however
    the argument was spelt (``./``, doubled or trailing slashes), in order, from either end."""
    monkeypatch.chdir(runs.parent)
    for arg in ("./runs/", "runs//", "runs", str(runs), "./runs//r*.h5"):
        found = resolve([arg]).files
        pattern = arg if "*" in arg else os.path.join(arg, "**", "*.h5")
        expected = sorted(map(Path, glob.glob(pattern, recursive=True)), key=os.path.abspath)
        assert list(found) == expected and [str(p) for p in found] == [str(p) for p in expected], arg
        assert len(found) == len(expected) and found[-1] == expected[-1] and found[0] == expected[0]
        with pytest.raises(IndexError):
            found[len(expected)]


def test_schema_agreement_names_both_files_and_the_field(runs: Path, tmp_path: Path) -> None:
    files = list(resolve([runs]).files)
    assert check_agreement(files) == [(12, 3), (20, 2), (12, 4)]
    with pytest.raises(RolloutError, match=r"r0.h5: field 'rewards': expected T = 12 as in .*r1.h5"):
        check_agreement(files, same_steps="batch --recurrent")
    arrays = rollout_arrays(T=12, N=3, seed=4)
    arrays["actions"] = arrays["actions"].astype(np.float64)
    write_rollout(tmp_path / "f64.h5", arrays)
    with pytest.raises(
        RolloutError, match=r"f64.h5: field 'actions': expected dtype float32 as in .*r1.h5, found float64"
    ):
        check_agreement([files[0], tmp_path / "f64.h5"])
    arrays = rollout_arrays(T=12, N=3, seed=4, obs_dim=5)
    write_rollout(tmp_path / "wide.h5", arrays)
    with pytest.raises(RolloutError, match=r"wide.h5: field 'observations/policy': expected trailing shape \[4\]"):
        check_agreement([files[0], tmp_path / "wide.h5"])
    arrays = rollout_arrays(T=12, N=3, seed=4)
    del arrays["time_outs"]
    write_rollout(tmp_path / "lacks.h5", arrays)
    with pytest.raises(RolloutError, match=r"lacks.h5: field 'time_outs': expected it as in .*r1.h5, found nothing"):
        check_agreement([files[0], tmp_path / "lacks.h5"])


def test_gae_on_a_dataset_equals_per_file_runs(cli, runs: Path, tmp_path: Path) -> None:
    code, out, err = cli("gae", runs, "-o", tmp_path / "out", "--json")
    assert code == 0, err
    assert json.loads(out)["files"] == 3
    for name in ("a/r1.h5", "r0.h5", "r2.h5"):
        assert cli("gae", runs / name, "-o", tmp_path / "single.h5", "--overwrite")[0] == 0
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "single.h5").read_bytes()
    record = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert record["command"] == "gae" and [e["name"] for e in record["inputs"]] == ["a/r1.h5", "r0.h5", "r2.h5"]
    assert [e["name"] for e in record["outputs"]] == ["a/r1.h5", "r0.h5", "r2.h5"]
    assert not partial_folder(tmp_path / "out").exists()
    code, _, err = cli("gae", runs, "-o", tmp_path / "out")
    assert code == 2 and "already exists" in err
    code, _, err = cli("gae", runs, "-o", runs / "inside")
    assert code == 4 and "output folder inside the input folder" in err and not (runs / "inside").exists()


@pytest.mark.parametrize(
    "argv",
    [["returns", "--gamma", "0.9"], ["nstep", "--n", "3", "--timeouts", "ignore"]],
    ids=["returns", "nstep"],
)
def test_derive_commands_on_a_dataset_equal_per_file_runs(cli, runs: Path, tmp_path: Path, argv: list[str]) -> None:
    command, options = argv[0], argv[1:]
    code, _, err = cli(command, runs, "-o", tmp_path / "out", "--workers", "2", *options)
    assert code == 0, err
    for name in ("a/r1.h5", "r0.h5", "r2.h5"):
        assert cli(command, runs / name, "-o", tmp_path / "single.h5", "--overwrite", *options)[0] == 0
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "single.h5").read_bytes()
    assert json.loads((tmp_path / "out" / "dataset.json").read_text())["command"] == command
    code, _, err = cli(command, runs, "--in-place", *options)
    assert code == 2 and err.strip() == "error: --in-place: expected one file, found a dataset; use -o FOLDER."


def test_split_on_a_dataset_workers_and_resume(cli, runs: Path, tmp_path: Path) -> None:
    assert cli("split", runs, "-o", tmp_path / "one", "--workers", "1")[0] == 0
    assert cli("split", runs, "-o", tmp_path / "two", "--workers", "2")[0] == 0
    assert tree(tmp_path / "one") == tree(tmp_path / "two")
    # a run whose last unit fails keeps its partial folder, and --resume redoes only that one
    _split_failing_last(runs, tmp_path / "res")
    partial = partial_folder(tmp_path / "res")
    assert partial.is_dir() and not (tmp_path / "res").exists()
    assert sorted(journal_names(partial)) == ["a/r1.h5", "r0.h5"] and not (partial / "dataset.json").exists()
    code, _, err = cli("split", runs, "-o", tmp_path / "res")
    assert code == 2 and "--resume" in err
    done_a = (partial / "a" / "r1.h5").stat().st_mtime_ns
    # what units killed mid-write leave (a SIGKILL removes nothing): never published by the resumed run
    for stray in (".r2.h5.rolloutcli-tmp-k1ll3d", "a/.r1.h5.rolloutcli-tmp-0ld", ".dataset.journal.rolloutcli-tmp-x"):
        (partial / stray).write_bytes(b"half a file")
    code, out, err = cli("split", runs, "-o", tmp_path / "res", "--resume", "--json")
    assert code == 0, err
    assert json.loads(out)["reused"] == 2 and (tmp_path / "res" / "a" / "r1.h5").stat().st_mtime_ns == done_a
    assert not partial.exists()
    assert tree(tmp_path / "res") == tree(tmp_path / "one")


def test_resume_redoes_an_output_whose_input_changed(cli, runs: Path, tmp_path: Path) -> None:
    _split_failing_last(runs, tmp_path / "res")
    # same schema and size, other rewards: the recorded hash no longer matches, so r0's output is redone
    write_rollout(runs / "r0.h5", rollout_arrays(T=20, N=2, seed=9))
    code, out, err = cli("split", runs, "-o", tmp_path / "res", "--resume", "--json")
    assert code == 0, err
    assert json.loads(out)["reused"] == 1
    assert cli("split", runs, "-o", tmp_path / "fresh")[0] == 0
    assert tree(tmp_path / "res") == tree(tmp_path / "fresh")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_run_that_finished_no_file_leaves_no_partial_folder(runs: Path, tmp_path: Path, workers: int) -> None:
    """Nothing to resume: the corrected rerun is not refused for an empty partial folder (it was, exit 2)."""

    def unit(src: Path, out: Path) -> tuple:
        return (_fail, (src,))

    with pytest.raises(RolloutError, match=r"injected failure"):
        run_dataset(resolve([runs]), tmp_path / "res", "split", {}, unit, EngineOptions(workers=workers))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def _split_failing_last(runs: Path, dst: Path) -> None:
    """``split`` of ``runs`` into ``dst`` whose unit for r2.h5 (the last) fails: the partial folder stays."""
    options, run = SplitOptions(), RunOptions()

    def unit(src: Path, out: Path) -> tuple:
        return (_fail, (src,)) if src.name == "r2.h5" else (run_split, (src, out, options, run))

    record = {"pad_to": "rollout", "max_length": None}
    with pytest.raises(RolloutError, match=r"r2\.h5: injected"):
        run_dataset(resolve([runs]), dst, "split", record, unit, EngineOptions())


def _fail(src: Path) -> None:
    raise RolloutError(f"{src}: injected failure")


def test_inspect_a_dataset_table_totals_and_statistics_over_all_files(cli, runs: Path, tmp_path: Path) -> None:
    code, out, err = cli("inspect", runs, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert [f["name"] for f in report["files"]] == ["a/r1.h5", "r0.h5", "r2.h5"]
    assert [(f["T"], f["N"]) for f in report["files"]] == [(12, 3), (20, 2), (12, 4)]
    # the rows are kept as five numbers a file (pipeline.lazy.Lazy) and made whole as they are printed
    files = resolve([runs]).files
    singles = [json.loads(cli("inspect", f, "--json")[1]) for f in files]
    assert report["files"] == [
        {
            "file": str(f),
            "name": name,
            "size_bytes": f.stat().st_size,
            "T": one["T"],
            "N": one["N"],
            "steps": one["T"] * one["N"],
            "episodes": one["episodes"]["completed"],
            "warnings": 0,
        }
        for f, name, one in zip(files, ["a/r1.h5", "r0.h5", "r2.h5"], singles, strict=True)
    ]
    code, text, _ = cli("inspect", runs)
    assert code == 0 and all(f"\n{name} " in text for name in ("a/r1.h5", "r0.h5", "r2.h5")), text
    assert report["totals"] == {
        "files": 3,
        "steps": 36 + 40 + 48,
        "envs": 9,
        "episodes": sum(
            json.loads(cli("inspect", f, "--json")[1])["episodes"]["completed"] for f in resolve([runs]).files
        ),
        "bytes": sum(f.stat().st_size for f in resolve([runs]).files),
    }
    rewards = np.concatenate(
        [rollout_arrays(T=T, N=N, seed=s)["rewards"].ravel() for T, N, s in [(12, 3, 1), (20, 2, 2), (12, 4, 3)]]
    )
    assert report["rewards"]["count"] == rewards.size
    assert report["rewards"]["mean"] == pytest.approx(rewards.astype(np.float64).mean(), rel=1e-9)
    assert report["rewards"]["std"] == pytest.approx(rewards.astype(np.float64).std(ddof=1), rel=1e-6)
    assert report["rewards"]["min"] == rewards.min() and report["warnings"] == []
    code, out, _ = cli("inspect", runs)
    assert code == 0 and "3 files" in out and "statistics over all files" in out and "a/r1.h5" in out
    arrays = rollout_arrays(T=12, N=3, seed=4)
    del arrays["time_outs"]
    write_rollout(runs / "z.h5", arrays)
    code, out, _ = cli("inspect", runs, "--json")
    assert code == 0 and any("z.h5: field 'time_outs': expected it as in" in w for w in json.loads(out)["warnings"])
    code, _, err = cli("inspect", runs, "--strict", "-q")
    assert code == 1 and "--strict" in err


@pytest.mark.parametrize("size", [0, 1, 1 << 20, (5 << 19) + 3])
def test_file_hash_is_xxh128sum_across_read_blocks(tmp_path: Path, size: int) -> None:
    import threading

    import xxhash

    from rolloutcli.dataset import file_hash

    path = tmp_path / "f.bin"
    path.write_bytes(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes())
    assert file_hash(path) == xxhash.xxh3_128(path.read_bytes()).hexdigest()
    stop = threading.Event()
    stop.set()
    assert file_hash(path, stop) == xxhash.xxh3_128(b"").hexdigest()  # stopped: reads nothing


@pytest.mark.parametrize("workers", [1, 2])
def test_files_that_disagree_are_refused_naming_the_first_one(cli, runs: Path, tmp_path: Path, workers: int) -> None:
    """Each unit checks its own file against the first one; the first disagreeing file in sorted order is named,
    as a serial check would, and nothing is published."""
    arrays = rollout_arrays(T=12, N=3, seed=4)
    arrays["actions"] = arrays["actions"].astype(np.float64)
    write_rollout(runs / "r1.h5", arrays)
    arrays = rollout_arrays(T=12, N=3, seed=5)
    del arrays["time_outs"]
    write_rollout(runs / "r3.h5", arrays)
    code, _, err = cli("gae", runs, "-o", tmp_path / "out", "--workers", workers)
    assert code == 1
    assert err.strip() == (
        f"error: {runs / 'r1.h5'}: field 'actions': expected dtype float32 as in {runs / 'a' / 'r1.h5'}, found "
        "float64. Every file of a dataset needs the same fields."
    )
    assert not (tmp_path / "out").exists()


def test_a_dataset_with_external_storage_is_read_with_allow_external(cli, runs: Path, tmp_path: Path) -> None:
    """The agreement check opens files as the command does: ``--allow-external`` reaches it too."""
    raw = tmp_path / "rewards.bin"
    rewards = np.arange(36, dtype=np.float32)
    raw.write_bytes(rewards.tobytes())
    arrays = rollout_arrays(T=12, N=3, seed=4)
    write_rollout(runs / "r3.h5", arrays)
    with h5py.File(runs / "r3.h5", "a") as handle:
        del handle["rewards"]
        handle.create_dataset("rewards", shape=(12, 3), dtype=np.float32, external=[(str(raw), 0, 36 * 4)])
    code, _, err = cli("gae", runs, "-o", tmp_path / "refused")
    assert code == 4 and "external raw storage" in err and not (tmp_path / "refused").exists()
    code, _, err = cli("gae", runs, "-o", tmp_path / "out", "--allow-external")
    assert code == 0, err
    assert cli("gae", runs / "r3.h5", "-o", tmp_path / "single.h5", "--allow-external")[0] == 0
    assert (tmp_path / "out" / "r3.h5").read_bytes() == (tmp_path / "single.h5").read_bytes()


def test_a_split_dataset_is_undone_as_one_and_named_where_rollouts_are_expected(cli, runs: Path, tmp_path: Path):
    """``split --unpad`` on the folder ``split`` wrote for a dataset restores every rollout (it failed: the
    agreement check read split files as rollouts); commands that need rollouts name a split file as such."""
    assert cli("split", runs, "-o", tmp_path / "split")[0] == 0
    for workers in (1, 2):
        code, _, err = cli(
            "split", "--unpad", tmp_path / "split", "-o", tmp_path / f"back{workers}", "--workers", workers
        )
        assert code == 0, err
    assert tree(tmp_path / "back1") == tree(tmp_path / "back2")
    for name in ("a/r1.h5", "r0.h5", "r2.h5"):
        with h5py.File(runs / name, "r") as source, h5py.File(tmp_path / "back1" / name, "r") as back:
            fields: list[str] = []
            source.visititems(lambda n, o, fields=fields: fields.append(n) if isinstance(o, h5py.Dataset) else None)
            for field in fields:
                np.testing.assert_array_equal(back[field][()], source[field][()], err_msg=f"{name} {field}")
    first = tmp_path / "split" / "a" / "r1.h5"
    said = (
        f"error: {first}: a file written by rolloutcli split, not a rollout file; expected rollout files in a "
        "dataset. Restore the rollouts first: rolloutcli split --unpad FILES -o OUT.\n"
    )
    for argv in (["inspect", tmp_path / "split"], ["gae", tmp_path / "split", "-o", tmp_path / "g"]):
        code, _, err = cli(*argv)
        assert (code, err) == (1, said), argv
