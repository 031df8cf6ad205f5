"""Benchmark feeding a training loop from shards: the time the loop waits on data, with and without prefetch.

Run: ``python benchmarks/bench_feed.py [--quick]``. A rollout (T x N rows of 256 float32 observations + the RL
fields) is exported as M feed-forward shards (each > 8 MB in the full run), then a loop iterates
``ShardDataset`` twice, with ``prefetch=False`` and ``prefetch=True``; each step "trains" for about as long as
reading one shard takes (a matmul sized once, before the runs). Reported: the time spent waiting for the next
batch (inside ``next()``), per step, and the ratio. Also timed: ``DataLoader(num_workers=2)`` over the same
dataset (workers read ahead), and ``RolloutDataset`` with ``batch_size=256, shuffle=True, num_workers=2``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rolloutcli import RolloutDataset, ShardDataset
from rolloutcli.pipeline.batch import BatchOptions, run_batch
from rolloutcli.pipeline.options import RunOptions


def make_source(path: Path, T: int, N: int, obs: int) -> Path:
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["observations/policy"] = rng.standard_normal((T, N, obs), dtype=np.float32)
        f["actions"] = rng.standard_normal((T, N, 12), dtype=np.float32)
        for name in ("rewards", "values", "actions_log_prob", "advantages", "returns"):
            f[name] = rng.standard_normal((T, N), dtype=np.float32)
        f["dones"] = (rng.random((T, N)) < 0.02).astype(np.uint8)
        f["last_values"] = rng.standard_normal(N, dtype=np.float32)
    return path


def work(matrix: torch.Tensor, repeats: int) -> None:
    for _ in range(repeats):
        matrix @ matrix


def waited(iterable, matrix: torch.Tensor, repeats: int) -> tuple[float, int]:
    """Seconds spent inside ``next()`` after the first item while the loop works ``repeats`` matmuls per step,
    and the number of such steps."""
    total, steps = 0.0, 0
    iterator = iter(iterable)
    while True:
        start = time.perf_counter()
        try:
            next(iterator)
        except StopIteration:
            break
        if steps:  # the first read cannot overlap with anything: steady state only
            total += time.perf_counter() - start
        steps += 1
        work(matrix, repeats)
    return total, max(steps - 1, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run (seconds)")
    args = parser.parse_args()
    T, N, obs, M = (24, 512, 256, 8) if args.quick else (32, 4096, 256, 8)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = make_source(Path(tmp) / "src.h5", T, N, obs)
        run_batch(src, Path(tmp) / "shards", BatchOptions(M), RunOptions())
        dataset = ShardDataset(Path(tmp) / "shards", prefetch=False)
        dataset[0]  # starts the metadata probe's helper process
        start = time.perf_counter()
        dataset[1]
        read = time.perf_counter() - start  # one shard's read, from the page cache
        matrix = torch.randn(256, 256)
        start = time.perf_counter()
        work(matrix, 10)
        repeats = max(1, round(10 * read / (time.perf_counter() - start)))
        shard_mb = (Path(tmp) / "shards" / dataset.entries[0]["file"]).stat().st_size / 1e6
        rows = []
        for label, iterable in [
            ("ShardDataset, prefetch=False", ShardDataset(Path(tmp) / "shards", prefetch=False)),
            ("ShardDataset, prefetch=True", ShardDataset(Path(tmp) / "shards", prefetch=True)),
            ("DataLoader(workers=2)", DataLoader(ShardDataset(Path(tmp) / "shards"), batch_size=None, num_workers=2)),
        ]:
            seconds, steps = waited(iterable, matrix, repeats)
            rows.append((label, seconds / steps))
        rollout = RolloutDataset(src)
        loader = DataLoader(rollout, batch_size=256, shuffle=True, num_workers=2)
        start = time.perf_counter()
        count = sum(b.actions.shape[0] for b in loader)
        rows_per_s = count / (time.perf_counter() - start)
    print(f"shards: {M} of {shard_mb:.1f} MB; one read {read * 1e3:.1f} ms; work per step ~ one read")
    base = rows[0][1]
    for label, per_step in rows:
        print(f"{label:32s} waits {per_step * 1e3:8.2f} ms/step  ({per_step / base:5.2f}x of no prefetch)")
    print(f"RolloutDataset batch 256, shuffle, 2 workers: {rows_per_s:,.0f} rows/s")


if __name__ == "__main__":
    main()
