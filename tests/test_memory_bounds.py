"""``--max-memory`` bounds one env's slice too: a file one env of which does not fit is refused before reading
(issue: an 8 KB file declaring T = 2**26 unallocated steps made ``inspect --max-memory 16M`` peak at 2.2 GB).

What is measured is what the command adds over its own start-up: the same command on a one-step file of the
same layout, run the same way. An absolute limit failed with a CUDA build of torch, whose libraries load at
import (issue 41: a refused ``split`` peaked at 549 MB); ``STARTUP_BALLAST`` simulates such a start-up."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from promises import child_env, error_lines, temporaries

T_LONG = 1 << 24  # 64 MiB of float32 rewards in one env, almost nothing on disk (chunks never written)
ADDED_LIMIT_KIB = 48 * 1024  # reading the env would add at least 64 MiB (its rewards alone)
# Imported first by the child (sitecustomize): touches 600 MiB before rolloutcli starts, as CUDA torch does.
STARTUP_BALLAST = "_ballast = b'\\x01' * (600 << 20)\n"


def _env_file(path: Path, steps: int) -> Path:
    with h5py.File(path, "w") as handle:
        for name, dtype in (("rewards", "f4"), ("values", "f4"), ("dones", "u1"), ("actions", "f4")):
            handle.create_dataset(name, shape=(steps, 1), dtype=dtype, chunks=(min(steps, 1 << 20), 1))
        chunks = (min(steps, 1 << 18), 1, 4)
        handle.create_dataset("observations/policy", shape=(steps, 1, 4), dtype="f4", chunks=chunks)
        handle["last_values"] = np.zeros(1, dtype=np.float32)
    return path


def _peak_child(argv: list[str], **env: str) -> tuple[int, str, int]:
    """Run ``python -m rolloutcli argv`` in a child; return its exit code, stderr and peak RSS in KiB."""
    code = (
        "import resource, subprocess, sys; "
        f"r = subprocess.run([sys.executable, '-m', 'rolloutcli', *{argv!r}], capture_output=True, text=True); "
        "sys.stderr.write(r.stderr); "
        "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=child_env(**env), check=True
    )
    returncode, peak = map(int, done.stdout.split())
    return returncode, done.stderr, peak


def _ballast_env(folder: Path) -> dict[str, str]:
    site = folder / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STARTUP_BALLAST)
    return {"PYTHONPATH": f"{site}:{child_env().get('PYTHONPATH', '')}".rstrip(":")}


@pytest.mark.parametrize("startup", ["plain", "ballast"])
@pytest.mark.parametrize(
    "command", [["inspect", "{src}", "--json"], ["gae", "{src}", "-o", "{dst}"], ["split", "{src}", "-o", "{dst}"]]
)
def test_an_env_larger_than_the_budget_is_refused_before_reading(
    tmp_path: Path, command: list[str], startup: str
) -> None:
    env = _ballast_env(tmp_path) if startup == "ballast" else {}
    small, src = _env_file(tmp_path / "small.h5", 1), _env_file(tmp_path / "long.h5", T_LONG)
    dst = tmp_path / "out.h5"
    options = ["--max-memory", "16M", "-q"]
    code, err, baseline_kib = _peak_child([arg.format(src=small, dst=dst) for arg in command] + options, **env)
    assert code == 0, err
    shutil.rmtree(dst) if dst.is_dir() else dst.unlink(missing_ok=True)
    code, err, peak_kib = _peak_child([arg.format(src=src, dst=dst) for arg in command] + options, **env)
    assert code == 2, err
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith(f"error: {src}: one env needs ")
    assert lines[0].endswith("more than --max-memory 16M; pass --max-memory " + lines[0].split("--max-memory ")[-1])
    if startup == "ballast":
        assert baseline_kib > 600 * 1024, "the ballast did not load"
    added = peak_kib - baseline_kib
    assert added < ADDED_LIMIT_KIB, f"{added} KiB over its start-up ({baseline_kib} KiB): the env was read"
    assert not dst.exists() and temporaries(tmp_path) == []


def _declared_huge_file(path: Path, T: int = 1 << 21) -> tuple[Path, int]:
    """A few KB declaring 2.3 GB of never-written chunks (2**23 rows of 276 bytes); returns it and a row's bytes.
    (A small ``T``: the same layout, for a baseline.)"""
    N, OBS = 4, 64
    with h5py.File(path, "w") as handle:
        handle.attrs.update({"rolloutcli_format": "rollout", "format_version": 1})
        for name in ("rewards", "values", "advantages", "returns", "dones"):
            handle.create_dataset(name, (T, N), "u1" if name == "dones" else "f4", chunks=(min(T, 1 << 16), 1))
        handle.create_dataset("actions", (T, N, 2), "f4", chunks=(min(T, 1 << 16), 1, 2))
        handle.create_dataset("observations/policy", (T, N, OBS), "f4", chunks=(min(T, 1 << 12), 1, OBS))
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
    # against the same export of 64 steps of that layout, which reads its data: whatever torch build starts up
    small, _ = _declared_huge_file(tmp_path / "small.h5", T=64)
    base_code, base_err, baseline_kib = _peak_child(["batch", str(small), "-o", str(tmp_path / "b"), "-m", "4", "-q"])
    assert base_code == 0, base_err
    added = peak_kib - baseline_kib
    assert added < ADDED_LIMIT_KIB, f"{added} KiB over the start-up ({baseline_kib} KiB): the source was read"
    assert not dst.exists() and temporaries(tmp_path) == []


EXPORT_T = 1 << 21  # one env's single episode: 178 MiB of steps (observations 128 MiB), 11 times the budget
EXPORT_ADDED_LIMIT_KIB = 96 * 1024  # holding the episode whole would add at least 178 MiB


def _episode_file(path: Path, steps: int) -> Path:
    """One env, one episode of ``steps`` steps (no done: a partial episode), every chunk written."""
    block = 1 << 16
    with h5py.File(path, "w") as handle:
        fields = {"rewards": ((), "f4"), "values": ((), "f4"), "dones": ((), "u1"), "actions": ((4,), "f4")}
        fields["observations/policy"] = ((16,), "f4")
        for name, (shape, dtype) in fields.items():
            data = handle.create_dataset(name, (steps, 1, *shape), dtype, chunks=(min(steps, block), 1, *shape))
            for start in range(0, steps, block):
                rows = np.arange(start, min(start + block, steps)) % 251 * (name != "dones")
                data[start : start + len(rows)] = rows.reshape(-1, 1, *([1] * len(shape))).astype(dtype)
        handle["last_values"] = np.zeros(1, np.float32)
    return path


@pytest.mark.parametrize("target", ["d4rl", "minari", "robomimic"])
def test_export_streams_an_episode_larger_than_the_budget(tmp_path: Path, target: str) -> None:
    """``export --max-memory 16M`` of an episode of 178 MiB: its steps stream in blocks (the episode is never
    held whole), against the same export of a 64-step file. What remains over the budget is libhdf5's (the value
    check's and the writes' buffers, growing slowly with the file's length), not the episode."""
    small, src = _episode_file(tmp_path / "small.h5", 64), _episode_file(tmp_path / "long.h5", EXPORT_T)
    name = "out-v0" if target == "minari" else "out.h5"
    options = ["--to", target, "--partial-episodes", "--max-memory", "16M", "-q"]
    code, err, baseline_kib = _peak_child(["export", str(small), "-o", str(tmp_path / f"small-{name}"), *options])
    assert code == 0, err
    code, err, peak_kib = _peak_child(["export", str(src), "-o", str(tmp_path / name), *options])
    assert code == 0, err
    added = peak_kib - baseline_kib
    assert added < EXPORT_ADDED_LIMIT_KIB, f"{added} KiB over the start-up ({baseline_kib} KiB): the episode was held"
    assert temporaries(tmp_path) == []
