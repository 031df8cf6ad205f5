"""The hostile partial folders of ``--resume``: each way a partial folder can be found changed (a record nested
thousands deep or too large, a FIFO, a symlink where a folder or file was, a file planted among the outputs) is
one row, and every row must end with one line and its exit code, publish nothing, follow no link and read no
FIFO. Before: a RecursionError traceback, a hang, the planted file or the symlink published."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from rollout_factory import rollout_arrays, write_rollout
from test_datasets import _split_failing_last, tree

from rolloutcli.errors import RolloutError
from rolloutcli.pipeline.dataset_job import partial_folder
from rolloutcli.pipeline.dataset_journal import JOURNAL, MAX_DEPTH, RECORD


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """test_datasets' three files (``_split_failing_last`` fails on r2.h5, the last)."""
    (tmp_path / "runs" / "a").mkdir(parents=True)
    for name, (T, N, seed) in {"a/r1.h5": (12, 3, 1), "r0.h5": (20, 2, 2), "r2.h5": (12, 4, 3)}.items():
        write_rollout(tmp_path / "runs" / name, rollout_arrays(T=T, N=N, seed=seed))
    return tmp_path / "runs"


def _deep_record(partial: Path, outside: Path) -> None:
    (partial / JOURNAL).unlink()
    (partial / RECORD).write_text("[" * 100_000 + "]" * 100_000)


def _record_just_too_deep(partial: Path, outside: Path) -> None:
    (partial / JOURNAL).unlink()
    (partial / RECORD).write_text('{"inputs": ' + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "}")


def _huge_record(partial: Path, outside: Path) -> None:
    (partial / JOURNAL).unlink()
    (partial / RECORD).write_bytes(b"{" + b" " * (4 << 20) + b"}")


def _fifo(name: str) -> Callable[[Path, Path], None]:
    def make(partial: Path, outside: Path) -> None:
        (partial / name).unlink(missing_ok=True)
        os.mkfifo(partial / name)

    return make


def _planted(name: str) -> Callable[[Path, Path], None]:
    def make(partial: Path, outside: Path) -> None:
        (partial / name).parent.mkdir(parents=True, exist_ok=True)
        (partial / name).write_text("#!/bin/sh\necho planted\n")

    return make


def _folder_at_an_output(partial: Path, outside: Path) -> None:
    (partial / "r2.h5").mkdir()  # the output not yet done
    (partial / "r2.h5" / "x").write_text("planted")


def _file_at_a_folder(partial: Path, outside: Path) -> None:
    shutil.rmtree(partial / "a")
    (partial / "a").write_text("planted")


def _symlinked_journal(partial: Path, outside: Path) -> None:
    shutil.move(partial / JOURNAL, outside / "journal")
    (partial / JOURNAL).symlink_to(outside / "journal")


def _symlinked_subfolder(partial: Path, outside: Path) -> None:
    shutil.move(partial / "a", outside / "a")  # its output a/r1.h5, as recorded
    (partial / "a").symlink_to(outside / "a")


def _symlinked_output(partial: Path, outside: Path) -> None:
    shutil.move(partial / "r0.h5", outside / "r0.h5")
    (partial / "r0.h5").symlink_to(outside / "r0.h5")


def _symlinked_partial(partial: Path, outside: Path) -> None:
    shutil.move(partial, outside / "partial")
    partial.symlink_to(outside / "partial")


def _partial_is_a_file(partial: Path, outside: Path) -> None:
    shutil.rmtree(partial)
    partial.write_text("not a folder")


# name: (how the partial folder is changed, exit code, what the one line says)
HOSTILE = {
    "record nested 100,000 deep": (_deep_record, 1, f"expected a record nested at most {MAX_DEPTH} levels deep"),
    "record nested 17 deep": (_record_just_too_deep, 1, f"nested at most {MAX_DEPTH} levels deep"),
    "record of 4 MB": (_huge_record, 1, "for 3 input files, found a larger file"),
    "record a FIFO": (_fifo(RECORD), 4, "a FIFO in the partial folder"),
    "journal a FIFO": (_fifo(JOURNAL), 4, "a FIFO in the partial folder"),
    "journal a symlink": (_symlinked_journal, 4, "a symlink in the partial folder"),
    "file planted": (_planted("run-me.sh"), 4, "run-me.sh: a file in the partial folder that is no output"),
    "file planted in a folder": (_planted("x/y.h5"), 4, "x: a folder in the partial folder that is no output"),
    "file planted beside an output": (_planted("a/r9.h5"), 4, "a/r9.h5: a file in the partial folder"),
    "folder at an output's name": (_folder_at_an_output, 4, "r2.h5: a folder in the partial folder"),
    "file at a folder's name": (_file_at_a_folder, 4, "a: a file in the partial folder"),
    "subfolder a symlink": (_symlinked_subfolder, 4, "a: a symlink in the partial folder"),
    "output a symlink": (_symlinked_output, 4, "r0.h5: a symlink in the partial folder"),
    "partial folder a symlink": (_symlinked_partial, 4, "the partial folder is a symlink"),
    "partial folder a file": (_partial_is_a_file, 4, "the partial folder is a file"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_partial_folder_is_refused_in_one_line_and_nothing_is_published(
    runs: Path,
    tmp_path: Path,
    case: str,
) -> None:
    change, code, says = HOSTILE[case]
    out, outside = tmp_path / "res", tmp_path / "outside"
    outside.mkdir()
    _split_failing_last(runs, out)
    partial = partial_folder(out)
    change(partial, outside)
    before = tree(outside)
    # a subprocess: a FIFO read hung the command for ever (the timeout fails the row instead)
    done = subprocess.run(
        [sys.executable, "-m", "rolloutcli", "split", str(runs), "-o", str(out), "--resume"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stderr.strip().splitlines()
    assert (done.returncode, len(lines)) == (code, 1), done.stderr
    assert lines[0].startswith("error: ") and says in lines[0], lines[0]
    assert not os.path.lexists(out)  # nothing published
    assert tree(outside) == before  # nothing written or removed through a link
    assert os.path.lexists(partial)  # kept as found, planted files included: not the run's to delete


def test_a_journal_line_nested_deep_is_ignored_as_a_garbled_line(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "res"
    _split_failing_last(runs, out)
    with open(partial_folder(out) / JOURNAL, "ab") as journal:
        journal.write(b"[" * 100_000 + b"]" * 100_000 + b"\n" + b"x" * (3 << 20) + b"\n")
    done = subprocess.run(
        [sys.executable, "-m", "rolloutcli", "split", str(runs), "-o", str(out), "--resume", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    fresh = subprocess.run([sys.executable, "-m", "rolloutcli", "split", str(runs), "-o", str(tmp_path / "fresh")])
    assert fresh.returncode == 0 and tree(out) == tree(tmp_path / "fresh")


def test_the_output_of_an_input_removed_since_is_dropped_not_refused(runs: Path, tmp_path: Path) -> None:
    """An output an earlier run wrote for an input no longer in the dataset (still as recorded: the run's own)
    is removed before publishing; it is not refused as planted."""
    out = tmp_path / "res"
    _split_failing_last(runs, out)
    assert (partial_folder(out) / "r0.h5").is_file()
    (runs / "r0.h5").unlink()
    done = subprocess.run(
        [sys.executable, "-m", "rolloutcli", "split", str(runs), "-o", str(out), "--resume", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(tree(out)) == ["a/r1.h5", "dataset.json", "r2.h5"]


def test_a_planted_file_moved_out_the_resumed_run_keeps_every_output(runs: Path, tmp_path: Path) -> None:
    """Refused at publishing (every output done), the folder keeps its record: once the planted file is moved
    out, --resume keeps all outputs and publishes them."""
    out = tmp_path / "res"
    _split_failing_last(runs, out)
    partial = partial_folder(out)
    _planted("run-me.sh")(partial, tmp_path)
    argv = [sys.executable, "-m", "rolloutcli", "split", str(runs), "-o", str(out), "--resume", "--json"]
    assert subprocess.run(argv, capture_output=True, timeout=120).returncode == 4
    (partial / "run-me.sh").unlink()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["reused"] == 3
    fresh = subprocess.run([sys.executable, "-m", "rolloutcli", "split", str(runs), "-o", str(tmp_path / "fresh")])
    assert fresh.returncode == 0 and tree(out) == tree(tmp_path / "fresh")


def test_the_first_stray_is_named_and_temporaries_dropped_as_listed_in_order(tmp_path: Path) -> None:
    """The checks stream each folder's listing (a sorted listing held ~1 KB an entry in the driver): with several
    strays, the one named is still the first by name within a folder, a folder's entries before those of its
    folders; temporaries (files, symlinks) are removed at any depth, nothing else is."""
    from rolloutcli.pipeline.dataset_partial import check_partial_folder, check_published, drop_temporaries

    folder = tmp_path / "partial"
    for name in ("r0.h5", "a/r1.h5", "a/b/r2.h5", RECORD, "z.sh", "c.sh", "a/b.sh", "a/b/0.sh", "d/e.sh"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(name)
    names = ["r0.h5", "a/r1.h5", "a/b/r2.h5"]
    for stray in ("c.sh", "d", "z.sh", "a/b.sh", "a/b/0.sh"):
        with pytest.raises(RolloutError, match=f"{folder / stray}: a (file|folder) in the partial folder") as error:
            check_published(folder, names, RECORD)
        assert error.value.exit_code == 4
        if stray == "d":
            shutil.rmtree(folder / stray)
        else:
            (folder / stray).unlink()
    check_published(folder, names, RECORD)
    os.mkfifo(folder / "a" / "b" / "f")
    os.mkfifo(folder / "a" / "e")
    with pytest.raises(RolloutError, match=f"{folder / 'a' / 'e'}: a FIFO in the partial folder"):
        check_partial_folder(folder, names)
    os.unlink(folder / "a" / "e")
    temporaries = [".r0.h5.rolloutcli-tmp-1", "a/b/.r2.h5.rolloutcli-tmp-2", "a/.link.rolloutcli-tmp-3"]
    (folder / temporaries[0]).write_text("half")
    (folder / temporaries[1]).write_text("half")
    os.symlink(folder / "nowhere", folder / temporaries[2])
    os.mkfifo(folder / "a" / ".fifo.rolloutcli-tmp-4")  # no file: not the run's to remove
    with pytest.raises(RolloutError, match=f"{folder / 'a' / 'b' / 'f'}: a FIFO"):
        check_partial_folder(folder, names)  # temporaries pass (dropped next); the FIFO does not
    drop_temporaries(folder)
    assert not any(os.path.lexists(folder / name) for name in temporaries)
    assert (folder / "a" / ".fifo.rolloutcli-tmp-4").is_fifo() and (folder / "a" / "b" / "r2.h5").is_file()
