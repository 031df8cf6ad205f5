"""``rolloutcli import`` of a D4RL-style file against an h5py copy of the same datasets, and ``inspect`` start-up.

A flat D4RL-style file (observations float32 ``[S, 64]``, next_observations, actions ``[S, 8]``, rewards,
terminals, timeouts; episodes of 1000 steps) of about ``--gigabytes`` is imported with ``--max-memory 256M``;
the reference reads every dataset with h5py in 256 MB row blocks and writes it to a new file, then fsyncs it
(what an import must at least do). Both run as fresh subprocesses; peak RSS is the child's. Also ``inspect``
on the sample file against opening it and listing it with h5py (what h5glance does). Issue 15's floors:
import peak RSS < 1 GB, at least half the speed of the h5py copy (ratio <= 2), inspect of the sample < 0.6 s idle.
Run: ``python benchmarks/bench_import.py [--gigabytes 2] [--folder DIR] [--keep]``; ``--quick``: 0.1 GB.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "sample_data" / "cartpole_gru.h5"
OBS, ACT, EPISODE = 64, 8, 1000
_PEAK_WRAPPER = (
    "import resource, subprocess, sys; "
    "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode; "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"
)
_H5PY_COPY = """
import sys, h5py
BLOCK = 256 << 20
with h5py.File(sys.argv[1], "r") as src, h5py.File(sys.argv[2], "w") as dst:
    for name, data in src.items():
        out = dst.create_dataset(name, shape=(data.shape[0], 1, *data.shape[1:]), dtype=data.dtype)
        step = max(1, BLOCK // max(data.dtype.itemsize * int(__import__("math").prod(data.shape[1:])), 1))
        for start in range(0, data.shape[0], step):
            out[start : start + step, 0] = data[start : start + step]
with open(sys.argv[2], "rb+") as done:  # the durability import's atomic publish gives its output
    __import__("os").fsync(done.fileno())
"""


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=2.0)
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--quick", action="store_true", help="0.1 GB smoke run")
    args = parser.parse_args()
    gigabytes = 0.1 if args.quick else args.gigabytes
    folder = Path(tempfile.mkdtemp(prefix="bench-import-", dir=args.folder))
    try:
        src = folder / "d4rl.hdf5"
        steps = make_source(src, gigabytes)
        size = src.stat().st_size
        print(f"source: {size / 1e9:.2f} GB, {steps} steps")
        cli = [sys.executable, "-m", "rolloutcli"]
        t_copy, rss_copy = timed_peak([sys.executable, "-c", _H5PY_COPY, str(src), str(folder / "copy.h5")])
        t_import, rss_import = timed_peak(
            [*cli, "import", str(src), "-o", str(folder / "out.h5"), "--max-memory", "256M", "-q"]
        )
        print(f"h5py copy + fsync: {t_copy:.2f} s  peak RSS {rss_copy / 1024:.0f} MiB")
        print(f"import:           {t_import:.2f} s  peak RSS {rss_import / 1024:.0f} MiB (--max-memory 256M)")
        print(
            f"import / h5py copy time: {t_import / t_copy:.2f}x (floor: <= 2x); peak RSS < 1 GiB: "
            f"{'yes' if rss_import < 1 << 20 else 'NO'}"
        )
        t_ref, _ = timed_peak([sys.executable, "-c", f"import h5py; h5py.File({str(SAMPLE)!r}).visit(print)"])
        t_inspect, _ = timed_peak([*cli, "inspect", str(SAMPLE)])
        print(f"inspect sample: {t_inspect:.2f} s; h5py open + list: {t_ref:.2f} s ({t_inspect / t_ref:.1f}x)")
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
