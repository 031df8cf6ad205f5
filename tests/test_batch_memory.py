"""``batch --max-memory`` bounds one env's slice too (issue 17.7): envs of 128 MiB each (a small gzip file,
chunked by env) are streamed along T, and a chunk larger than the budget allows is refused before reading."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

T, N, OBS = 1 << 17, 2, 256  # per env: 2**17 steps x 1 KiB of observations = 128 MiB; ~0.3 MB gzipped
CHUNK = 4096  # steps per chunk: 4 MiB of observations

# Runs a command and prints its peak RSS (KiB): measured in a small helper, so the fork of this large test
# process is not charged to the command.
HELPER = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
    "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); print(r.stderr, file=sys.stderr)"
)


@pytest.fixture(scope="module")
def long_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("memory") / "long_env.h5"
    step = np.arange(T * N, dtype=np.float32).reshape(T, N)  # every value is its row t * N + n
    with h5py.File(path, "w") as handle:
        handle.attrs.update({"rolloutcli_format": "rollout", "format_version": 1})
        observations = handle.create_dataset(
            "observations/policy", (T, N, OBS), np.float32, chunks=(CHUNK, 1, OBS), compression="gzip"
        )
        for start in range(0, T, CHUNK):
            block = step[start : start + CHUNK, :, None]
            observations[start : start + CHUNK] = np.broadcast_to(block, (*block.shape[:2], OBS))
        for name in ("actions", "rewards", "values", "advantages", "returns", "dones"):
            shape = (T, N, 2) if name == "actions" else (T, N)
            data = np.zeros(shape, np.uint8 if name == "dones" else np.float32)
            handle.create_dataset(name, data=data, chunks=(CHUNK, 1, *shape[2:]), compression="gzip")
        handle["last_values"] = np.zeros(N, np.float32)
    return path


def _peak(*command: str) -> tuple[int, int, str]:
    """(exit code, peak RSS in MiB, stderr) of ``command`` run in a child process."""
    result = subprocess.run(
        [sys.executable, "-c", HELPER, *command], capture_output=True, text=True, timeout=600, check=False
    )
    code, peak = result.stdout.split()
    return int(code), int(peak) // 1024, result.stderr.strip()


def test_long_envs_stream_along_t_within_the_budget(long_env: Path, tmp_path: Path) -> None:
    _, baseline, _ = _peak(sys.executable, "-c", "import rolloutcli.cli.app, rolloutcli.pipeline.batch")
    out = tmp_path / "shards"
    command = [sys.executable, "-m", "rolloutcli", "batch", str(long_env), "-o", str(out), "-m", "64"]
    code, peak, err = _peak(*command, "--max-memory", "32M", "-q", "--json")
    assert code == 0, err
    # One env alone is 128 MiB; before, an env's slice was read whole (peak over 300 MiB above the imports).
    assert peak - baseline < 120, (peak, baseline)
    manifest = json.loads((out / "manifest.json").read_text())
    assert sum(entry["rows"] for entry in manifest["shards"]) == T * N
    with h5py.File(out / manifest["shards"][0]["file"]) as handle:  # each row holds the row it came from
        index, observations = handle["index"][()], handle["observations/policy"][()]
    assert np.array_equal(observations, np.broadcast_to(index[:, None].astype(np.float32), observations.shape))


def test_a_chunk_larger_than_the_budget_is_refused_before_reading(long_env: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    command = [sys.executable, "-m", "rolloutcli", "batch", str(long_env), "-o", str(out), "-m", "4"]
    code, _, err = _peak(*command, "--max-memory", "4M")
    assert code == 2
    assert err == (
        f"error: --max-memory: batch reads whole chunks of {long_env} (up to 4194304 bytes each); expected a budget "
        "of at least 8M, found 4194304 bytes. Raise --max-memory."
    )
    assert not out.exists()
