"""``rolloutcli import`` of a D4RL-style file against an h5py copy of the same datasets, and ``inspect`` start-up.

A flat D4RL-style file (observations float32 ``[S, 64]``, next_observations, actions ``[S, 8]``, rewards,
terminals, timeouts; episodes of 1000 steps) of about ``--gigabytes`` is imported with ``--max-memory 256M``;
the references read every dataset with h5py in 256 MB row blocks and write it to a new file, once without and
once with a final fsync (an import fsyncs its output before publishing it). Every run is a fresh subprocess
(peak RSS is the child's), preceded by ``sync`` so the previous run's write-back is not charged to it; each is
repeated ``--repeats`` times, alternating, and the fastest is kept. ``inspect`` on the sample file runs 10 times
(fastest and median) against opening it and listing it with h5py (what h5glance does). Issue 15's floors:
import peak RSS < 1 GB, at least half the speed of the h5py copy (ratio <= 2), inspect of the sample < 0.6 s
idle. Run: ``python benchmarks/bench_import.py [--gigabytes 2] [--repeats 3] [--folder DIR] [--keep]``;
``--quick``: 0.1 GB, one repeat.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "sample_data" / "cartpole_gru.h5"
CLI = [sys.executable, "-m", "rolloutcli"]
OBS, ACT, EPISODE = 64, 8, 1000
_PEAK_WRAPPER = (
    "import resource, subprocess, sys; "
    "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode; "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"
)
_H5PY_COPY = """
import math, os, sys, h5py
BLOCK = 256 << 20
with h5py.File(sys.argv[1], "r") as src, h5py.File(sys.argv[2], "w") as dst:
    for name, data in src.items():
        out = dst.create_dataset(name, shape=(data.shape[0], 1, *data.shape[1:]), dtype=data.dtype)
        step = max(1, BLOCK // max(data.dtype.itemsize * int(math.prod(data.shape[1:])), 1))
        for start in range(0, data.shape[0], step):
            out[start : start + step, 0] = data[start : start + step]
if sys.argv[3] == "fsync":  # the durability import's atomic publish gives its output
    with open(sys.argv[2], "rb+") as done:
        os.fsync(done.fileno())
"""
INSPECT_RUNS = 10


def make_source(path: Path, gigabytes: float) -> int:
    row = (2 * OBS + ACT + 1) * 4 + 2
    steps = int(gigabytes * 1e9 / row)
    block = 1 << 20
    with h5py.File(path, "w") as f:
        datasets = {
            "observations": f.create_dataset("observations", (steps, OBS), np.float32),
            "next_observations": f.create_dataset("next_observations", (steps, OBS), np.float32),
            "actions": f.create_dataset("actions", (steps, ACT), np.float32),
            "rewards": f.create_dataset("rewards", (steps,), np.float32),
        }
        ends = (np.arange(steps) % EPISODE) == EPISODE - 1
        f["terminals"] = ends & (np.arange(steps) // EPISODE % 2 == 0)
        f["timeouts"] = ends & (np.arange(steps) // EPISODE % 2 == 1)
        rng = np.random.default_rng(0)
        for start in range(0, steps, block):
            stop = min(start + block, steps)
            for data in datasets.values():
                data[start:stop] = rng.standard_normal((stop - start, *data.shape[1:]), dtype=np.float32)
    return steps


def timed_peak(argv: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS in KiB) of ``argv`` run as a fresh child."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", _PEAK_WRAPPER, *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(argv)}\n{result.stderr}")
    return seconds, int(result.stdout.strip().splitlines()[-1])


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    """Seconds of ``argv`` run as a fresh child (no wrapper: a start-up figure)."""
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, check=True, env=env)
    return time.perf_counter() - start


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def bench_import(src: Path, folder: Path, repeats: int) -> None:
    out = folder / "out.h5"
    runs = {
        "h5py copy": [sys.executable, "-c", _H5PY_COPY, str(src), str(out), "no-fsync"],
        "h5py copy + fsync": [sys.executable, "-c", _H5PY_COPY, str(src), str(out), "fsync"],
        "import": [*CLI, "import", str(src), "-o", str(out), "--max-memory", "256M", "-q"],
    }
    best: dict[str, tuple[float, int]] = {}
    print(f"before: {load()}")
    for _ in range(repeats):
        for name, argv in runs.items():
            os.sync()
            seconds, rss = timed_peak(argv)
            out.unlink()
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, rss)
    print(f"after:  {load()}")
    for name, (seconds, rss) in best.items():
        print(f"{name + ':':19s} {seconds:6.2f} s  peak RSS {rss / 1024:4.0f} MiB  (fastest of {repeats})")
    t_import, rss_import = best["import"]
    print(
        f"import / h5py copy + fsync: {t_import / best['h5py copy + fsync'][0]:.2f}x, import / h5py copy: "
        f"{t_import / best['h5py copy'][0]:.2f}x (floor: <= 2x); "
        f"peak RSS < 1 GiB with --max-memory 256M: {'yes' if rss_import < 1 << 20 else 'NO'}"
    )


def bench_inspect() -> None:
    print(f"before: {load()}")
    times = {"inspect": [], "h5py open + list": []}
    reference = [sys.executable, "-c", f"import h5py; h5py.File({str(SAMPLE)!r}).visit(print)"]
    # as installed: Python caches rolloutcli's bytecode (a PYTHONDONTWRITEBYTECODE=1 shell recompiles every
    # module on every run, about 0.1 s more); the first run writes the cache and is not counted
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    timed([*CLI, "inspect", str(SAMPLE)], env)
    for _ in range(INSPECT_RUNS):
        times["inspect"].append(timed([*CLI, "inspect", str(SAMPLE)], env))
        times["h5py open + list"].append(timed(reference, env))
    print(f"after:  {load()}")
    for name, found in times.items():
        print(f"{name + ' sample:':24s} fastest {min(found):.3f} s, median {statistics.median(found):.3f} s")
    ratio = min(times["inspect"]) / min(times["h5py open + list"])
    print(f"inspect / h5py open + list: {ratio:.1f}x (floor: inspect < 0.6 s on an idle machine)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--quick", action="store_true", help="0.1 GB smoke run, one repeat")
    parser.add_argument("--skip-import", action="store_true", help="only inspect start-up")
    args = parser.parse_args()
    gigabytes, repeats = (0.1, 1) if args.quick else (args.gigabytes, args.repeats)
    folder = Path(tempfile.mkdtemp(prefix="bench-import-", dir=args.folder))
    try:
        if not args.skip_import:
            src = folder / "d4rl.hdf5"
            steps = make_source(src, gigabytes)
            print(f"source: {src.stat().st_size / 1e9:.2f} GB, {steps} steps")
            bench_import(src, folder, repeats)
        bench_inspect()
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
