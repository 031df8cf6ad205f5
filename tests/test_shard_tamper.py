"""A tampered shard folder gives ``RolloutError`` (one line naming the file and field), never a Python error, a
hang, or data read from outside the folder (issue 17.10)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import h5py
import pytest
from rollout_factory import write_rollout
from test_batching import full_arrays

from rolloutcli import RolloutError, ShardDataset
from rolloutcli.pipeline.batch import BatchOptions, run_batch
from rolloutcli.pipeline.options import RunOptions


@pytest.fixture(scope="module")
def originals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("originals")
    src = write_rollout(root / "src.h5", full_arrays(8, 4, hidden=None))
    out = {}
    for mode in ("feedforward", "distillation"):
        out[mode] = root / mode
        run_batch(src, out[mode], BatchOptions(2, mode=mode), RunOptions())
    return out


@pytest.fixture
def folder(originals: dict[str, Path], tmp_path: Path) -> Callable[[str], Path]:
    def copy(mode: str) -> Path:
        target = tmp_path / "shards" / mode
        shutil.copytree(originals[mode], target)
        return target

    return copy


def _edit_manifest(folder: Path, edit: Callable[[dict], None]) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _first_shard(folder: Path) -> Path:
    return folder / json.loads((folder / "manifest.json").read_text())["shards"][0]["file"]


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda m: m["source"].update(N=0), "source.N"),
        (lambda m: m.pop("source"), "source"),
        (lambda m: m["source"].update(T="8"), "source.T"),
    ],
)
def test_manifest_source_problems(folder, edit, field: str) -> None:
    target = folder("distillation")
    _edit_manifest(target, edit)
    with pytest.raises(RolloutError) as info:
        len(ShardDataset(target))
    assert f"field '{field}'" in str(info.value) and "manifest.json" in str(info.value)


def test_shard_without_actions(folder) -> None:
    target = folder("feedforward")
    with h5py.File(_first_shard(target), "a") as handle:
        del handle["actions"]
    with pytest.raises(RolloutError, match="field 'actions': expected a dataset of every feedforward shard"):
        list(ShardDataset(target))


def test_distribution_order_naming_a_missing_dataset(folder) -> None:
    target = folder("feedforward")
    with h5py.File(_first_shard(target), "a") as handle:
        handle["distribution"].attrs["order"] = ["mean", "nope"]
    with pytest.raises(RolloutError, match="field 'distribution/nope'"):
        list(ShardDataset(target))


def test_distillation_shard_with_other_steps_than_the_manifest(folder) -> None:
    target = folder("distillation")
    _edit_manifest(target, lambda m: m["shards"][0].update(rows=m["shards"][0]["rows"] * 2))
    with pytest.raises(RolloutError, match="field 'dones'"):
        list(ShardDataset(target))


def test_deeply_nested_manifest(folder) -> None:
    target = folder("feedforward")
    (target / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(RolloutError, match="nested too deeply"):
        ShardDataset(target)


def test_fifo_manifest_does_not_hang(folder) -> None:
    target = folder("feedforward")
    (target / "manifest.json").unlink()
    os.mkfifo(target / "manifest.json")
    script = (
        "import sys\nfrom rolloutcli import RolloutError, ShardDataset\n"
        f"try:\n    ShardDataset({str(target)!r})\nexcept RolloutError as exc:\n    print(exc)\n    sys.exit(7)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 7, result.stderr
    assert "not a regular file" in result.stdout


def test_shard_resolving_outside_the_folder_is_refused(folder, tmp_path: Path) -> None:
    target = folder("feedforward")
    shard = _first_shard(target)
    outside = tmp_path / "elsewhere.h5"
    shutil.move(shard, outside)
    shard.symlink_to(outside)  # the same bytes, so only the location gives it away
    with pytest.raises(RolloutError, match="expected a shard file inside the folder"):
        ShardDataset(target)
    assert len(list(ShardDataset(folder("distillation")))) == 8  # untouched folders still load
