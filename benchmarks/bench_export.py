"""``rolloutcli export`` of a dataset of consecutive recordings against an h5py copy + fsync of the same bytes.

The dataset: ``--files`` consecutive recordings of N=64 envs (one ``recording_id``, ``recording_index`` 0, 1,
...), each ``--steps`` steps of observations float32 ``[64]``, ``final_observations``, actions ``[8]``, rewards,
dones, time_outs, values, ``last_observations``; episodes of 150-1200 steps run across files. Each target is
exported with ``--max-memory 256M``; the reference reads every dataset of every file with h5py in 256 MB blocks,
writes it to one new file and fsyncs it (an export fsyncs its output before publishing it). Every run is a fresh
subprocess (peak RSS is the child's), preceded by ``sync``; each repeated ``--repeats`` times, alternating, the
fastest kept. Issue 42's figures: export speed against the copy, peak RSS under ``--max-memory 256M``.
Run: ``python benchmarks/bench_export.py [--gigabytes 2] [--repeats 2] [--folder DIR] [--targets minari,d4rl]``;
``--quick``: 0.1 GB, one repeat.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
from bench_import import CLI, load, timed_peak

N, OBS, ACT = 64, 64, 8
STEP_BYTES = (2 * OBS + ACT + 3) * 4 + 2  # per env and step: obs, final obs, actions, rewards, values, flags
_H5PY_COPY = """
import math, os, sys, h5py
BLOCK = 256 << 20
with h5py.File(sys.argv[1], "w") as dst:
    for i, path in enumerate(sys.argv[2:]):
        with h5py.File(path, "r") as src:
            def copy(name, data):
                if not isinstance(data, h5py.Dataset):
                    return
                out = dst.create_dataset(f"{i}/{name}", shape=data.shape, dtype=data.dtype)
                step = max(1, BLOCK // max(data.dtype.itemsize * int(math.prod(data.shape[1:])), 1))
                for start in range(0, max(data.shape[0], 1), step):
                    out[start : start + step] = data[start : start + step]
            src.visititems(copy)
with open(sys.argv[1], "rb+") as done:
    os.fsync(done.fileno())
"""


def make_dataset(folder: Path, gigabytes: float, steps: int) -> list[Path]:
    """Consecutive recordings whose episodes (150-1200 steps, a third cut by time-outs) cross files."""
    files = max(2, round(gigabytes * 1e9 / (steps * N * STEP_BYTES)))
    rng = np.random.default_rng(0)
    T = files * steps
    dones = np.zeros((T, N), bool)
    for n in range(N):
        t = int(rng.integers(150, 1200))
        while t < T:
            dones[t - 1, n] = True
            t += int(rng.integers(150, 1200))
    time_outs = dones & (rng.random((T, N)) < 0.33)
    first = rng.standard_normal((N, OBS), dtype=np.float32)  # each file's first observations: the last before
    paths = []
    for k in range(files):
        body = rng.standard_normal((steps, N, OBS), dtype=np.float32)
        body[0] = first
        nxt = first = rng.standard_normal((N, OBS), dtype=np.float32)
        rows = slice(k * steps, (k + 1) * steps)
        path = folder / f"iteration_{k:05d}.h5"
        with h5py.File(path, "w") as f:
            f.attrs.update(rolloutcli_format="rollout", format_version=1.2, recording_id="bench", recording_index=k)
            f.attrs["recorded_from_reset"] = k == 0
            f["observations/policy"] = body
            f["final_observations/policy"] = body + np.float32(0.5)
            f["last_observations/policy"] = nxt
            f["actions"] = rng.standard_normal((steps, N, ACT), dtype=np.float32)
            f["rewards"] = rng.standard_normal((steps, N), dtype=np.float32)
            f["values"] = rng.standard_normal((steps, N), dtype=np.float32)
            f["dones"], f["time_outs"] = dones[rows], time_outs[rows]
        paths.append(path)
    return paths


def bench(paths: list[Path], folder: Path, targets: list[str], repeats: int) -> None:
    runs = {"h5py copy + fsync": (folder / "copy.h5", [sys.executable, "-c", _H5PY_COPY, str(folder / "copy.h5")])}
    runs["h5py copy + fsync"][1].extend(map(str, paths))
    for target in targets:
        out = folder / ("export-v0" if target == "minari" else f"export_{target}.hdf5")
        runs[target] = (
            out,
            [*CLI, "export", str(paths[0].parent), "--to", target, "-o", str(out), "-q", "--max-memory", "256M"],
        )
    best: dict[str, tuple[float, int]] = {}
    print(f"before: {load()}")
    for _ in range(repeats):
        for name, (out, argv) in runs.items():
            os.sync()
            seconds, rss = timed_peak(argv)
            shutil.rmtree(out) if out.is_dir() else out.unlink()
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, rss)
    print(f"after:  {load()}")
    reference = best["h5py copy + fsync"][0]
    for name, (seconds, rss) in best.items():
        print(
            f"{name + ':':19s} {seconds:6.2f} s  {seconds / reference:5.2f}x the copy  peak RSS {rss / 1024:5.0f} MiB"
            f"  (fastest of {repeats})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=1000, help="steps per file")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--targets", default="minari,robomimic,d4rl")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--quick", action="store_true", help="0.1 GB smoke run, one repeat")
    args = parser.parse_args()
    gigabytes, repeats = (0.1, 1) if args.quick else (args.gigabytes, args.repeats)
    folder = Path(tempfile.mkdtemp(prefix="bench-export-", dir=args.folder))
    try:
        (folder / "runs").mkdir()
        paths = make_dataset(folder / "runs", gigabytes, args.steps)
        size = sum(p.stat().st_size for p in paths)
        print(f"dataset: {len(paths)} files, {size / 1e9:.2f} GB, N={N}, {args.steps} steps a file")
        bench(paths, folder, args.targets.split(","), repeats)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
