"""Datasets and engines: several files per command, local workers vs one, Ray vs local, Ray's fixed costs.

- ``gae`` on a dataset of 8 files, ``--workers 2`` vs ``--workers 1`` (CLI subprocesses, kernels' own threads
  set to one: ``OMP_NUM_THREADS=1``, so the ratio measures the engine). Goal: at least 1.6x on 2 CPUs.
- ``batch`` on the same dataset (one global shuffle over every row of every file), ``--workers 2`` vs 1.
- Ray: ``ray.init`` start-up on this machine, the per-task overhead (no-op tasks), and ``gae`` on the dataset
  with ``--engine ray`` vs ``local`` with the same workers, after start-up (goal: within 1.5x).
- ``--big``: a feed-forward export over 1e8 rows (a 1.6 GB ``randperm`` before the Feistel order) and its peak
  RSS against ``--max-memory`` (goal: under the budget + 300 MB). Writes ~2.5 GB; off by default.

Usage: python benchmarks/bench_datasets.py [--quick] [--big] [--folder /tmp/rolloutcli-datasets] [--keep]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_commands import make_rollout

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
SMALL = {"rewards": ((), np.float32), "values": ((), np.float32), "dones": ((), np.uint8)}


def cli(*args: object) -> float:
    """Seconds one ``rolloutcli`` subprocess takes (it must succeed)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rolloutcli", *map(str, args), "-q"], check=True, env=ENV)
    return time.perf_counter() - started


def peak_rss_mib(*args: object) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of one ``rolloutcli`` subprocess."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rolloutcli", *map(str, args), "-q"], check=True, env=ENV)
    return time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def engines(folder: Path, runs: Path) -> None:
    import ray

    from rolloutcli.dataset import resolve
    from rolloutcli.pipeline.dataset_job import run_dataset
    from rolloutcli.pipeline.engine import EngineOptions
    from rolloutcli.pipeline.gae import GaeOptions, run_gae
    from rolloutcli.pipeline.options import RunOptions

    started = time.perf_counter()
    ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False, log_to_driver=False)
    startup = time.perf_counter() - started

    @ray.remote
    def noop(x: int) -> int:
        return x

    ray.get([noop.remote(i) for i in range(20)])  # warm the worker pool
    started = time.perf_counter()
    ray.get([noop.remote(i) for i in range(500)])
    per_task = (time.perf_counter() - started) / 500
    print(f"ray.init start-up {startup:.2f} s; per-task overhead {per_task * 1e3:.2f} ms (500 no-op tasks, 2 CPUs)")
    options, run = GaeOptions(), RunOptions()
    data = resolve([runs])
    times = {}
    for name, engine in (("local", EngineOptions(workers=2)), ("ray", EngineOptions(engine="ray"))):
        best = float("inf")
        for repeat in range(2):
            out = folder / f"gae-{name}-{repeat}"
            started = time.perf_counter()
            run_dataset(data, out, "gae", {}, lambda s, o: (run_gae, (s, o, options, run)), engine)
            best = min(best, time.perf_counter() - started)
            shutil.rmtree(out)
        times[name] = best
    print(
        f"gae, 8 files: ray {times['ray']:.2f} s vs local --workers 2 {times['local']:.2f} s: "
        f"{times['ray'] / times['local']:.2f}x (goal <= 1.5x, after start-up)"
    )
    ray.shutdown()


def big(folder: Path) -> None:
    rows_per_file, files = 25_000_000, 4  # 1e8 rows; randperm of them: 800 MB int64 (1.6 GB with its inverse)
    src = folder / "big"
    src.mkdir(exist_ok=True)
    fields = {**SMALL, "advantages": ((), np.float32), "returns": ((), np.float32)}
    for i in range(files):
        make_rollout(src / f"b{i}.h5", rows_per_file // 1000, 1000, 0.02, fields=fields, seed=i)
    seconds, rss = peak_rss_mib("batch", src, "-o", folder / "big-shards", "-m", 64, "--max-memory", "512M")
    print(f"batch over 1e8 rows, --max-memory 512M: {seconds:.1f} s, peak RSS {rss:.0f} MiB (goal < 812 MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 files of ~8 MB instead of ~256 MB")
    parser.add_argument("--big", action="store_true", help="also the 1e8-row feed-forward export (~2.5 GB)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/rolloutcli-datasets"))
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    folder = args.folder
    shutil.rmtree(folder, ignore_errors=True)
    runs = folder / "runs"
    runs.mkdir(parents=True)
    T, N = (1000, 16) if args.quick else (2000, 256)  # ~600 bytes a step: ~9.6 MB or ~300 MB a file
    sizes = [make_rollout(runs / f"run{i:02d}.h5", T, N, 0.02, seed=i) for i in range(8)]
    print(f"dataset: 8 files of {sizes[0] / 2**20:.0f} MiB (T={T}, N={N}); the machine may be loaded")
    one = cli("gae", runs, "-o", folder / "gae1", "--workers", 1)
    two = cli("gae", runs, "-o", folder / "gae2", "--workers", 2)
    print(f"gae: --workers 1 {one:.2f} s, --workers 2 {two:.2f} s: {one / two:.2f}x (goal >= 1.6x)")
    rows, budget = 8 * T * N, "64M" if args.quick else "512M"  # streamed: several blocks per file
    one = cli("batch", folder / "gae1", "-o", folder / "shards1", "-m", 16, "--max-memory", budget, "--workers", 1)
    two = cli("batch", folder / "gae1", "-o", folder / "shards2", "-m", 16, "--max-memory", budget, "--workers", 2)
    print(
        f"batch, one shuffle over {rows} rows of 8 files: --workers 1 {one:.2f} s, --workers 2 {two:.2f} s: "
        f"{one / two:.2f}x (goal >= 1.6x)"
    )
    engines(folder, runs)
    if args.big:
        big(folder)
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
