"""Publishing outputs never destroys data: ``--overwrite`` replaces only an earlier output of ours, and an
output that appears while a command runs is never replaced without ``--overwrite``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from promises import COMMANDS, PAUSE_ENV, PAUSE_MARKER, child_env, digest, error_lines, make_input, temporaries

from rolloutcli.errors import RolloutError
from rolloutcli.hdf5 import atomic, rename

USER = b"the user's own file\n"


def _listing(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): digest(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_batch_overwrite_refuses_the_input_folder(tmp_path: Path, cli) -> None:
    """The reported loss: ``batch data/run_gae.h5 -o data --overwrite`` deleted every file in data/."""
    data = tmp_path / "data"
    data.mkdir()
    src = make_input("gae", data / "run_gae.h5")
    (data / "notes.txt").write_bytes(USER)
    before = _listing(data)
    code, out, err = cli("batch", src, "-o", data, "-m", 2, "--overwrite")
    assert code == 2
    assert error_lines(err) == [
        f"error: {data}: --overwrite replaces only an output folder rolloutcli wrote (with its manifest.json), "
        "found something else; refusing to touch it. Choose a new output folder."
    ]
    assert out == "" and _listing(data) == before


def test_batch_overwrite_refuses_the_current_folder(tmp_path: Path, cli, monkeypatch) -> None:
    src = make_input("gae", tmp_path / "run_gae.h5")
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    code, _, err = cli("batch", "run_gae.h5", "-o", ".", "-m", 2, "--overwrite")
    assert code == 2 and "refusing to touch it" in err
    assert sorted(os.listdir(tmp_path)) == before and digest(src)


def test_batch_overwrite_refuses_a_shard_folder_holding_the_input(tmp_path: Path, cli) -> None:
    shards = tmp_path / "shards"
    src = make_input("gae", tmp_path / "run_gae.h5")
    assert cli("batch", src, "-o", shards, "-m", 2, "-q")[0] == 0
    inner = make_input("gae", shards / "again.h5")
    before = _listing(shards)
    code, _, err = cli("batch", inner, "-o", shards, "-m", 2, "--overwrite")
    assert code == 2
    assert error_lines(err) == [
        f"error: {shards}: output folder holds the input {inner}; refusing to replace it. Choose a new output folder."
    ]
    assert _listing(shards) == before


def test_batch_overwrite_replaces_an_earlier_shard_folder(tmp_path: Path, cli) -> None:
    src = make_input("gae", tmp_path / "run_gae.h5")
    shards = tmp_path / "shards"
    assert cli("batch", src, "-o", shards, "-m", 2, "-q")[0] == 0
    assert cli("batch", src, "-o", shards, "-m", 4, "-q", "--overwrite")[0] == 0
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["options"]["num_mini_batches"] == 4 and temporaries(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == ["run_gae.h5", "shards"]


def _run_and_create(argv: list[str], folder: Path, dst: Path, make: str) -> subprocess.CompletedProcess[str]:
    """Run rolloutcli paused after its first block; create ``dst`` meanwhile; let it finish."""
    env = child_env(**{PAUSE_ENV: "1"})
    process = subprocess.Popen(
        [sys.executable, "-m", "rolloutcli", *argv], cwd=folder, env=env, stderr=subprocess.PIPE, text=True
    )
    assert process.stderr is not None
    lines = []
    for line in process.stderr:
        lines.append(line)
        if line.startswith(PAUSE_MARKER):
            break
    if make == "folder":
        dst.mkdir()
        (dst / "mine.txt").write_bytes(USER)
    else:
        dst.write_bytes(USER)
    lines.append(process.stderr.read())
    process.wait(timeout=120)
    return subprocess.CompletedProcess(argv, process.returncode, "", "".join(lines))


@pytest.mark.parametrize("name", ["gae", "split", "batch"])
@pytest.mark.parametrize("make", ["file", "folder"])
def test_output_created_during_the_run_is_kept(tmp_path: Path, name: str, make: str) -> None:
    command = COMMANDS[name]
    src = make_input(command.source, tmp_path / "in.h5")
    dst = command.output_path(src, tmp_path)
    assert dst is not None
    run = _run_and_create(command.argv(src, dst, "--max-memory", "64K"), tmp_path, dst, make)
    assert run.returncode == 2, run.stderr
    assert [line for line in error_lines(run.stderr) if not line.startswith(PAUSE_MARKER)] == [
        f"error: {dst}: output appeared while the command ran; refusing to overwrite it, nothing was written. "
        "Pass --overwrite to replace it."
    ]
    kept = dst / "mine.txt" if make == "folder" else dst
    assert kept.read_bytes() == USER and temporaries(tmp_path) == []


def test_concurrent_runs_publish_once(tmp_path: Path) -> None:
    src = make_input("rollout", tmp_path / "in.h5")
    dst = tmp_path / "out.h5"
    env = child_env()
    argv = [sys.executable, "-m", "rolloutcli", "gae", str(src), "-o", str(dst), "-q"]
    runs = [subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    codes = sorted(run.wait(timeout=120) for run in runs)
    assert codes[0] == 0 and codes.count(0) + codes.count(2) == 3
    assert temporaries(tmp_path) == []


# ------------------------------------------------------------------ the fallbacks where renameat2 is missing


@pytest.fixture
def no_renameat2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rename, "_RENAMEAT2", None)


@pytest.mark.usefixtures("no_renameat2")
def test_rename_noreplace_fallbacks(tmp_path: Path) -> None:
    for kind in ("file", "folder"):
        src, dst = tmp_path / f"{kind}.new", tmp_path / kind
        src.mkdir() if kind == "folder" else src.write_bytes(b"new")
        dst.write_bytes(USER)
        with pytest.raises(FileExistsError):
            rename.rename_noreplace(src, dst)
        assert dst.read_bytes() == USER and src.exists()
        dst.unlink()
        rename.rename_noreplace(src, dst)
        assert dst.exists() and not src.exists()
    assert sorted(os.listdir(tmp_path)) == ["file", "folder"]  # the folder's lock file is gone
    assert not rename.exchange(tmp_path / "file", tmp_path / "folder")


@pytest.mark.usefixtures("no_renameat2")
def test_folder_overwrite_without_exchange(tmp_path: Path, cli) -> None:
    src = make_input("gae", tmp_path / "run_gae.h5")
    shards = tmp_path / "shards"
    assert cli("batch", src, "-o", shards, "-m", 2, "-q")[0] == 0
    assert cli("batch", src, "-o", shards, "-m", 4, "-q", "--overwrite")[0] == 0
    assert json.loads((shards / "manifest.json").read_text())["options"]["num_mini_batches"] == 4
    assert sorted(os.listdir(tmp_path)) == ["run_gae.h5", "shards"]


# ------------------------------------------------------------------------------------------ names and modes


def test_long_output_name(tmp_path: Path, cli) -> None:
    """A 243-byte name is valid; the temporary beside it must not exceed NAME_MAX."""
    src = make_input("rollout", tmp_path / "in.h5")
    dst = tmp_path / ("x" * 240 + ".h5")
    code, _, err = cli("gae", src, "-o", dst, "-q")
    assert code == 0, err
    assert dst.is_file() and temporaries(tmp_path) == []


def test_in_place_keeps_mode_and_xattrs(tmp_path: Path, cli) -> None:
    src = make_input("rollout", tmp_path / "in.h5")
    src.chmod(0o664)
    try:
        os.setxattr(src, "user.origin", b"robot-7")
    except OSError:
        pytest.skip("this file system has no user xattrs")
    umask = os.umask(0o077)
    try:
        code, _, err = cli("gae", src, "--in-place", "-q")
    finally:
        os.umask(umask)
    assert code == 0, err
    assert (src.stat().st_mode & 0o777) == 0o664
    assert os.getxattr(src, "user.origin") == b"robot-7"


def test_atomic_folder_without_owner_check_refuses_overwrite(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    with pytest.raises(RolloutError) as err, atomic.atomic_folder(dst, overwrite=True):
        pass
    assert err.value.exit_code == 2 and dst.is_dir()
