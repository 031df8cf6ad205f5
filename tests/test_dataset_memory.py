"""Memory flat in the number of files: a dataset command's peak RSS on ten times the files stays within 1.2x
(issue "A training run is thousands of files": every file of ``batch``'s dataset was held open, ~0.5 MB of
libhdf5 caches each, and every (file, shard) piece waited in memory; 1,000 small files took 1.07 GB)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from promises import child_env
from rollout_factory import rollout_arrays, write_rollout

FEW, MANY = 20, 200

# Runs a command and prints its exit code and peak RSS (KiB): measured in a small helper, so the fork of this
# large test process is not charged to the command.
HELPER = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
    "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); print(r.stderr, file=sys.stderr)"
)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """``{files: folder}``: FEW and MANY small rollouts (T=8, N=2, with advantages and returns)."""
    root = tmp_path_factory.mktemp("memory_files")
    for count in (FEW, MANY):
        folder = root / f"d{count}"
        folder.mkdir()
        for i in range(count):
            arrays = rollout_arrays(T=8, N=2, seed=i, hidden=None)
            rng = np.random.default_rng(i)
            arrays |= {name: rng.standard_normal((8, 2)).astype(np.float32) for name in ("advantages", "returns")}
            write_rollout(folder / f"r{i:04d}.h5", arrays)
    return {count: root / f"d{count}" for count in (FEW, MANY)}


def _peak(tmp_path: Path, folder: Path, options: list[str]) -> int:
    """Peak RSS (KiB) of ``rolloutcli batch folder -o out options`` in a fresh process (its workers aside)."""
    out = tmp_path / f"out-{folder.name}"
    command = [sys.executable, "-m", "rolloutcli", "batch", str(folder), "-o", str(out), *options, "-q"]
    result = subprocess.run(
        [sys.executable, "-c", HELPER, *command], capture_output=True, text=True, env=child_env(), check=True
    )
    code, peak = map(int, result.stdout.split())
    assert code == 0, result.stderr
    return peak


@pytest.mark.parametrize("options", [["-m", "4"], ["-m", "4", "--recurrent", "--workers", "2"]])
def test_batch_peak_is_flat_in_the_number_of_files(
    datasets: dict[int, Path], tmp_path: Path, options: list[str]
) -> None:
    few, many = (_peak(tmp_path, datasets[count], options) for count in (FEW, MANY))
    # Before, each file added ~0.5 MB (the 180 more files: ~100 MB over a ~250 MB peak); the data itself is under 1 MB.
    assert many <= 1.2 * few, f"peak RSS {many} KiB on {MANY} files, {few} KiB on {FEW}"
