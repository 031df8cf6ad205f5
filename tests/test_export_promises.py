"""``export``'s promises beyond the shared tables (``promises.COMMANDS`` holds its rows): a failed write names the
destination the user gave (never the temporary beside it), ``--overwrite`` replaces only a folder an export wrote,
and what a target has no place for is named, not carried.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from promises import COMMANDS, digest, error_lines, make_input, run_rolloutcli, temporaries

EXPORTS = [name for name in COMMANDS if name.startswith("export ")]
BIG = {"T": 64, "N": 48, "obs_dim": 32, "critic_dim": 32}  # every output larger than 64 KiB


@pytest.mark.parametrize("name", EXPORTS)
def test_a_failed_write_names_the_destination(tmp_path: Path, name: str) -> None:
    """A write past the file size limit (as a full disk) names ``-o``'s path (a folder's file inside it), never
    ``.out.rolloutcli-tmp-XXXX``."""
    command = COMMANDS[name]
    src = make_input(command.source, tmp_path / "in.h5", **BIG)
    dst = command.output_path(src, tmp_path)
    assert dst is not None
    run = run_rolloutcli(command.argv(src, dst), cwd=tmp_path, file_size_limit=64 << 10)
    shown = dst / "train.hdf5" if name == "export d4rl --valid-fraction" else dst  # the file that failed
    assert run.returncode == 3 and error_lines(run.stderr) == [
        f"error: {shown}: cannot write the output: File too large. The output exceeds the file size limit "
        "(ulimit -f) or the file system's largest file; write to another file system; nothing was written."
    ], run.stderr
    assert not os.path.lexists(dst) and temporaries(tmp_path) == []


FOLDER_EXPORTS = [name for name in EXPORTS if COMMANDS[name].output == "folder"]
REFUSED = (
    "error: {dst}: --overwrite replaces only an output folder rolloutcli wrote (with an HDF5 file marked "
    "'rolloutcli_export'), found something else; refusing to touch it. Choose a new output folder."
)


def _marked_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as handle:
        handle.attrs["rolloutcli_export"] = "minari"


@pytest.mark.parametrize("kind", ["user files", "a link to a marked file", "an unmarked HDF5 file", "a FIFO"])
@pytest.mark.parametrize("name", FOLDER_EXPORTS)
def test_overwrite_refuses_a_folder_no_export_wrote(tmp_path: Path, cli, name: str, kind: str) -> None:
    command = COMMANDS[name]
    src = make_input(command.source, tmp_path / "in.h5")
    dst = command.output_path(src, tmp_path)
    assert dst is not None
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    inside = dst / ("data/main_data.hdf5" if name == "export minari" else "train.hdf5")
    if kind == "a link to a marked file":  # a link lends nobody's folder our mark
        _marked_file(tmp_path / "elsewhere" / "marked.h5")
        inside.parent.mkdir(exist_ok=True)
        inside.symlink_to(tmp_path / "elsewhere" / "marked.h5")
    elif kind == "an unmarked HDF5 file":
        inside.parent.mkdir(exist_ok=True)
        with h5py.File(inside, "w") as handle:
            handle.attrs["rolloutcli_format"] = "rollout"
    elif kind == "a FIFO":  # never opened (it would block)
        inside.parent.mkdir(exist_ok=True)
        os.mkfifo(inside)
    before = sorted(str(p.relative_to(dst)) for p in dst.rglob("*"))
    code, out, err = cli(*command.argv(src, dst, "--overwrite"))
    assert code == 2 and out == ""
    assert error_lines(err) == [REFUSED.format(dst=dst)]
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*")) == before and temporaries(tmp_path) == []


@pytest.mark.parametrize("name", FOLDER_EXPORTS)
def test_overwrite_replaces_an_earlier_export(tmp_path: Path, cli, name: str) -> None:
    """An export's own output is recognised by its marked files, and replaced whole."""
    command = COMMANDS[name]
    src = make_input(command.source, tmp_path / "in.h5")
    dst = command.output_path(src, tmp_path)
    assert dst is not None
    code, _, err = cli(*command.argv(src, dst))
    assert code == 0, err
    (dst / "stale.txt").write_text("from before")
    code, _, err = cli(*command.argv(src, dst, "--overwrite"))
    assert code == 0, err
    assert not (dst / "stale.txt").exists() and temporaries(tmp_path) == []


@pytest.mark.parametrize("name", ["export robomimic", "export d4rl", "export minari"])
def test_what_a_target_cannot_hold_is_named_not_carried(tmp_path: Path, cli, name: str) -> None:
    """The reference tables of ``test_promises_input`` do not fit export (no dataset of the rollout is carried
    whole): datasets of object references are named in the warning, and none reaches the output."""
    command = COMMANDS[name]
    src = make_input(command.source, tmp_path / "in.h5", end_rate=0.3)
    with h5py.File(src, "a") as handle:
        handle.create_dataset("index", data=np.array([handle["actions"].ref], object), dtype=h5py.ref_dtype)
    before = digest(src)
    dst = command.output_path(src, tmp_path)
    assert dst is not None
    code, out, err = cli(*command.argv(src, dst)[:-1])  # without -q: the warnings
    assert code == 0 and error_lines(err) == [], err
    warning = " ".join(err.split())  # a warning on stderr, as every command's; none with the summary
    assert "has no place for" in warning and " index," in warning and "has no place" not in out
    found = []
    for path in [dst] if dst.is_file() else dst.rglob("*.hdf5"):
        with h5py.File(path) as handle:
            handle.visititems(
                lambda n, o: found.append(n) if isinstance(o, h5py.Dataset) and o.dtype.kind == "O" else None
            )
    assert found == [] and digest(src) == before
