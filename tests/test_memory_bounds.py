"""``--max-memory`` bounds one env's slice too: a file one env of which does not fit is refused before reading
(issue: an 8 KB file declaring T = 2**26 unallocated steps made ``inspect --max-memory 16M`` peak at 2.2 GB)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from promises import child_env, error_lines, temporaries

T_LONG = 1 << 24  # 64 MiB of float32 rewards in one env, almost nothing on disk (chunks never written)


def _long_env_file(path: Path) -> Path:
    with h5py.File(path, "w") as handle:
        for name, dtype in (("rewards", "f4"), ("values", "f4"), ("dones", "u1"), ("actions", "f4")):
            handle.create_dataset(name, shape=(T_LONG, 1), dtype=dtype, chunks=(1 << 20, 1))
        handle.create_dataset("observations/policy", shape=(T_LONG, 1, 4), dtype="f4", chunks=(1 << 18, 1, 4))
        handle["last_values"] = np.zeros(1, dtype=np.float32)
    return path


def _peak_child(argv: list[str]) -> tuple[int, str, int]:
    """Run ``python -m rolloutcli argv`` in a child; return its exit code, stderr and peak RSS in KiB."""
    code = (
        "import resource, subprocess, sys; "
        f"r = subprocess.run([sys.executable, '-m', 'rolloutcli', *{argv!r}], capture_output=True, text=True); "
        "sys.stderr.write(r.stderr); "
        "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), check=True)
    returncode, peak = map(int, done.stdout.split())
    return returncode, done.stderr, peak


@pytest.mark.parametrize(
    "command", [["inspect", "{src}", "--json"], ["gae", "{src}", "-o", "{dst}"], ["split", "{src}", "-o", "{dst}"]]
)
def test_an_env_larger_than_the_budget_is_refused_before_reading(tmp_path: Path, command: list[str]) -> None:
    src = _long_env_file(tmp_path / "long.h5")
    dst = tmp_path / "out.h5"
    argv = [arg.format(src=src, dst=dst) for arg in command] + ["--max-memory", "16M", "-q"]
    code, err, peak_kib = _peak_child(argv)
    assert code == 2, err
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith(f"error: {src}: one env needs ")
    assert lines[0].endswith("more than --max-memory 16M; pass --max-memory " + lines[0].split("--max-memory ")[-1])
    assert peak_kib < 400 * 1024, f"peak RSS {peak_kib} KiB: the env was read"
    assert not dst.exists() and temporaries(tmp_path) == []


def _declared_huge_file(path: Path) -> tuple[Path, int]:
    """A few KB declaring 2.3 GB of never-written chunks (2**23 rows of 276 bytes); returns it and a row's bytes."""
    T, N, OBS = 1 << 21, 4, 64
    with h5py.File(path, "w") as handle:
        handle.attrs.update({"rolloutcli_format": "rollout", "format_version": 1})
        for name in ("rewards", "values", "advantages", "returns", "dones"):
            handle.create_dataset(name, (T, N), "u1" if name == "dones" else "f4", chunks=(1 << 16, 1))
        handle.create_dataset("actions", (T, N, 2), "f4", chunks=(1 << 16, 1, 2))
        handle.create_dataset("observations/policy", (T, N, OBS), "f4", chunks=(1 << 12, 1, OBS))
        handle["last_values"] = np.zeros(N, np.float32)
    return path, 4 * OBS + 4 * 2 + 4 * 4 + 1


def test_batch_refuses_a_shard_larger_than_the_budget_before_reading(tmp_path: Path) -> None:
    """Issue 40.7: ``batch --max-memory 64M`` on a 50 KB file declaring 2.3 GB peaked at 2.3 GB: a shard is built
    whole in memory, so one larger than the budget is refused (exit 2, naming the budget it needs)."""
    src, row = _declared_huge_file(tmp_path / "huge.h5")
    assert src.stat().st_size < 64 << 10
    dst = tmp_path / "shards"
    code, err, peak_kib = _peak_child(["batch", str(src), "-o", str(dst), "-m", "4", "--max-memory", "64M", "-q"])
    largest = (1 << 23) // 4 * row  # 2**23 rows in 4 mini-batches
    assert code == 2 and error_lines(err) == [
        f"error: --max-memory: batch builds each shard in memory (the largest holds {largest} bytes); expected a "
        f"budget of at least {-(-largest >> 20)}M, found 67108864 bytes. Raise --max-memory or export more, smaller "
        "mini-batches."
    ], err
    assert peak_kib < 400 * 1024, f"peak RSS {peak_kib} KiB: the source was read"
    assert not dst.exists() and temporaries(tmp_path) == []
