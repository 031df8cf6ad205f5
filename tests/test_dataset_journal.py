"""A dataset run's journal: dataset.json as before, byte for byte; --resume after a kill, a torn line, an altered
output, a partial folder of the previous version (which rewrote dataset.json after each file)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from rollout_factory import rollout_arrays, write_rollout
from test_engine_stops import _kill_group, _paused_job

from rolloutcli.dataset import resolve
from rolloutcli.errors import RolloutError
from rolloutcli.pipeline.dataset_job import partial_folder, run_dataset
from rolloutcli.pipeline.dataset_journal import JOURNAL, write_json
from rolloutcli.pipeline.engine import EngineOptions
from rolloutcli.pipeline.gae import GaeOptions, run_gae
from rolloutcli.pipeline.options import RunOptions

NAMES = ["a/r1.h5", "b/r6.h5", "r0.h5", "r2.h5", "r3.h5", "r4.h5", "r5.h5"]
OPTIONS = {"gamma": 0.99, "lam": 0.95, "nested": {"b": [1, 2.5], "a": None}, "unicode": "λ"}


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    folder = tmp_path / "runs"
    for i, name in enumerate(NAMES):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        write_rollout(folder / name, rollout_arrays(T=8 + i, N=2 + i % 3, seed=i))
    return folder


def gae_unit(src: Path, out: Path) -> tuple:
    return (run_gae, (src, out, GaeOptions(), RunOptions()))


def failing_on(name: str):
    def unit(src: Path, out: Path) -> tuple:
        return (_fail, (src,)) if src.name == name else gae_unit(src, out)

    return unit


def _fail(src: Path) -> None:
    raise RolloutError(f"{src}: injected failure")


def gae(runs: Path, dst: Path, unit=gae_unit, workers: int = 1, **kwargs) -> dict:
    return run_dataset(resolve([runs]), dst, "gae", OPTIONS, unit, EngineOptions(workers=workers), **kwargs)


def partial_run(runs: Path, dst: Path) -> Path:
    """A run whose unit for the last file fails: the partial folder with the journal of the six others."""
    with pytest.raises(RolloutError, match="injected failure"):
        gae(runs, dst, failing_on("r5.h5"))
    return partial_folder(dst)


def lines(partial: Path) -> list[bytes]:
    return (partial / JOURNAL).read_bytes().splitlines(keepends=True)


def inodes(folder: Path) -> dict[str, tuple[int, int]]:
    """Each output's identity: a redone file may get the inode its removed predecessor freed, not its mtime."""
    stats = {name: (folder / name).stat() for name in NAMES if (folder / name).exists()}
    return {name: (stat.st_ino, stat.st_mtime_ns) for name, stat in stats.items()}


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def old_record(runs: Path, out: Path, inputs: list[str], outputs: list[str]) -> str:
    """``dataset.json`` as the previous version wrote it: ``json.dumps`` of the whole record, in input order."""

    def entry(path: Path, name: str) -> dict:
        digest = xxhash.xxh3_128(path.read_bytes()).hexdigest()
        return {"name": name, "size_bytes": path.stat().st_size, "xxh3_128": digest}

    record = {
        "format": "rolloutcli.dataset",
        "format_version": 1,
        "command": "gae",
        "options": OPTIONS,
        "inputs": [{"path": str(runs / name), **entry(runs / name, name)} for name in inputs],
        "outputs": [entry(out / name, name) for name in outputs],
    }
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


@pytest.mark.parametrize(
    "record",
    [
        {"format": "x", "inputs": [], "outputs": []},
        {"command": "gae", "options": OPTIONS, "inputs": [{"name": 'ä/\n"q".h5', "size_bytes": 3}], "outputs": []},
        {"z": {}, "a": [], "inputs": [{"b": [], "a": {"c": [1, {"d": 1e-300}]}}, {}, []], "outputs": [1, "x"]},
    ],
)
def test_the_streamed_record_is_json_dumps_byte_for_byte(record: dict) -> None:
    out = io.StringIO()
    head = {key: value for key, value in record.items() if key not in ("inputs", "outputs")}
    write_json(out, head, {key: (lambda key=key: iter(record[key])) for key in ("inputs", "outputs")})
    assert out.getvalue() == json.dumps(record, indent=2, sort_keys=True) + "\n"


@pytest.mark.parametrize("workers", [1, 2])
def test_dataset_json_is_the_previous_versions_byte_for_byte_and_no_journal_is_published(
    runs: Path, tmp_path: Path, workers: int
) -> None:
    summary = gae(runs, tmp_path / "out", workers=workers)
    out = tmp_path / "out"
    assert (out / "dataset.json").read_text() == old_record(runs, out, NAMES, NAMES)
    assert sorted(tree(out)) == sorted([*NAMES, "dataset.json"])  # no journal, no temporary
    assert not partial_folder(out).exists()
    assert summary["bytes_written"] == sum((out / name).stat().st_size for name in NAMES)


def test_a_killed_run_resumes_redoing_only_what_is_missing(runs: Path, tmp_path: Path) -> None:
    """SIGKILL (nothing cleaned up) while the third file is written: the journal holds the first two, which
    --resume keeps untouched; the result is a whole run's, byte for byte."""
    out = tmp_path / "out"
    process = _paused_job(["gae", str(runs), "-o", str(out)], pause=2)
    try:
        assert process.stderr is not None
        for _ in range(3):  # the first two units are done and recorded; the third pauses mid-write
            line = process.stderr.readline()
            assert line.startswith("rolloutcli: test pause after block 1"), line
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        _kill_group(process.pid)
    partial = partial_folder(out)
    recorded = [json.loads(line)["output"]["name"] for line in lines(partial)[1:]]
    assert recorded == NAMES[:2]
    kept = inodes(partial)
    done = subprocess.run(
        [sys.executable, "-m", "rolloutcli", "gae", str(runs), "-o", str(out), "--resume", "--json"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["reused"] == 2
    assert {name: inodes(out)[name] for name in NAMES[:2]} == {name: kept[name] for name in NAMES[:2]}
    whole = subprocess.run([sys.executable, "-m", "rolloutcli", "gae", str(runs), "-o", str(tmp_path / "whole")])
    assert whole.returncode == 0 and tree(out) == tree(tmp_path / "whole")


@pytest.mark.parametrize("cut", [5, 1], ids=["torn", "newline-lost"])
def test_a_torn_last_line_is_never_trusted_and_its_file_is_redone(runs: Path, tmp_path: Path, cut: int) -> None:
    """A kill or a full disk mid-append: the last line cut short (``cut`` 1: only its newline lost, the object
    still whole) is ignored and its file redone; a resumed run failing again leaves only whole lines."""
    partial = partial_run(runs, tmp_path / "out")
    journal = partial / JOURNAL
    journal.write_bytes(journal.read_bytes()[:-cut])
    kept = inodes(partial)
    with pytest.raises(RolloutError, match="injected failure"):  # r4's line is rewritten whole, r5 fails again
        gae(runs, tmp_path / "out", failing_on("r5.h5"), resume=True)
    assert [json.loads(line)["output"]["name"] for line in lines(partial)[1:]] == NAMES[:6]
    assert all(line.endswith(b"\n") for line in lines(partial))
    assert inodes(partial)["r4.h5"] != kept["r4.h5"]  # redone
    assert {name: inodes(partial)[name] for name in NAMES[:5]} == {name: kept[name] for name in NAMES[:5]}
    assert gae(runs, tmp_path / "out", resume=True)["reused"] == 6
    out = tmp_path / "out"
    assert (out / "dataset.json").read_text() == old_record(runs, out, NAMES, NAMES)


@pytest.mark.parametrize("damage", ["altered", "missing", "input changed"])
def test_an_entry_whose_files_no_longer_match_is_redone(runs: Path, tmp_path: Path, damage: str) -> None:
    partial = partial_run(runs, tmp_path / "out")
    if damage == "altered":  # same size, one byte changed: only the hash tells
        data = bytearray((partial / "r2.h5").read_bytes())
        data[-1] ^= 0xFF
        (partial / "r2.h5").write_bytes(bytes(data))
    elif damage == "missing":
        (partial / "r2.h5").unlink()
    else:  # same schema and size, other rewards
        write_rollout(runs / "r2.h5", rollout_arrays(T=11, N=2, seed=42))
    summary = gae(runs, tmp_path / "out", resume=True)
    assert summary["reused"] == 5
    gae(runs, tmp_path / "fresh")
    out = tmp_path / "out"
    assert tree(out) == tree(tmp_path / "fresh")
    assert (out / "dataset.json").read_text() == old_record(runs, out, NAMES, NAMES)


def test_a_partial_folder_of_the_previous_version_resumes(runs: Path, tmp_path: Path) -> None:
    """The previous version left ``dataset.json`` (rewritten after each file) in the partial folder, no journal:
    --resume keeps its outputs, and the journal then replaces it."""
    partial = partial_run(runs, tmp_path / "out")
    (partial / JOURNAL).unlink()
    (partial / "dataset.json").write_text(old_record(runs, partial, NAMES[:6], NAMES[:6]))
    kept = inodes(partial)
    summary = gae(runs, tmp_path / "out", resume=True)
    out = tmp_path / "out"
    assert summary["reused"] == 6 and {name: inodes(out)[name] for name in NAMES[:6]} == kept
    assert (out / "dataset.json").read_text() == old_record(runs, out, NAMES, NAMES)


def test_resume_with_other_options_is_refused_and_changes_nothing(runs: Path, tmp_path: Path) -> None:
    partial = partial_run(runs, tmp_path / "out")
    before = tree(partial)
    with pytest.raises(RolloutError, match=r"--resume: expected the options of the run that left it") as error:
        run_dataset(
            resolve([runs]), tmp_path / "out", "gae", {**OPTIONS, "gamma": 0.9}, gae_unit, EngineOptions(), resume=True
        )
    assert error.value.exit_code == 2 and tree(partial) == before
