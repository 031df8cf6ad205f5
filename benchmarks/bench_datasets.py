"""Datasets and engines (issue 14): several files per command, local workers vs one, Ray vs local, Ray's costs.

- ``gae`` and ``batch`` on a dataset of 8 files of ~256 MB (``--quick``: ~9 MB), ``--workers 2`` vs
  ``--workers 1`` as CLI subprocesses, the kernels' own threads set to one in both (``OMP_NUM_THREADS=1``
  etc.), so the ratio measures the engine. Goal: CPU(workers 2) / CPU(workers 1) at most 1.15x (the engine's
  overhead; the wall-time ratio, whose 1.6x goal a shared 2-CPU machine cannot judge, is printed beside it), and
  the wall time against ``cp -r`` + ``sync`` of the same files in the same run. Each run prints its wall time and
  the CPU time (user + sys) of every process it started - the driver, the pool's forkserver and workers -
  collected exactly: each run is started from a small launcher that is the child subreaper of the run and
  reaps every process of it with ``wait4``. On a loaded machine wall ratios are distorted; CPU totals are not
  (``2 x cpu(w1) / cpu(w2)`` bounds the speed-up two idle CPUs could give). The load average is printed.
- Ray: ``ray.init`` start-up, the per-task overhead (no-op tasks, warm workers), and ``gae`` and ``batch`` on
  the dataset with ``--engine ray`` vs ``local --workers 2`` in one process after start-up (goal: within
  1.5x), plus a cold ``--engine ray`` CLI run (start-up included).
- ``--big``: a feed-forward ``batch`` export over 1e8 rows (RSL-RL's ``randperm`` of them: 800 MB, 1.6 GB with
  its sort) with ``--max-memory 512M`` and ``--workers 1`` and ``2``; peak RSS of the driver and of the
  largest other process (goal: each under ``--max-memory`` + 300 MB). Writes ~3.5 GB in ``--folder``.

- ``--many-files``: the per-file cost of every dataset command on ``--files`` (10,000) small recordings against
  h5py doing the same per-file work, and the peak RSS on 100 of them against all (``_many_files.py``).

Usage: python benchmarks/bench_datasets.py [--quick] [--big] [--no-ray] [--repeats R] [--folder F] [--keep]
       python benchmarks/bench_datasets.py --many-files [--files N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _many_files import many_files
from bench_commands import make_rollout

THREADS = {k: "1" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")}
ENV = {**os.environ, **THREADS}
SMALL = {"rewards": ((), np.float32), "values": ((), np.float32), "dones": ((), np.uint8)}

# The launcher: the run's child subreaper (orphans - the forkserver, Ray's daemons - are re-parented to it), so
# ``wait4`` collects the CPU time and peak RSS of every process once. A small interpreter of its own: a child
# forked from this benchmark would start with this process's peak RSS as its own.
LAUNCHER = r"""
import ctypes, json, os, signal, subprocess, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
started = time.perf_counter()
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, driver = os.wait4(child.pid, 0)
wall = time.perf_counter() - started
others, user, system, peak = 0, 0.0, 0.0, 0
signal.alarm(120)  # a process that outlives the run by two minutes: reported as not reaped
try:
    while True:
        _, _, usage = os.wait4(-1, 0)
        others, user, system = others + 1, user + usage.ru_utime, system + usage.ru_stime
        peak = max(peak, usage.ru_maxrss)
except ChildProcessError:
    pass
print(json.dumps({"rc": os.waitstatus_to_exitcode(status), "wall": wall,
    "driver_cpu": driver.ru_utime + driver.ru_stime, "driver_rss": driver.ru_maxrss / 1024, "others": others,
    "others_cpu": user + system, "others_rss": peak / 1024}))
"""


def load() -> str:
    """The load average and the memory available: with little free memory (old outputs left on tmpfs, whose
    pages cannot be reclaimed), writing into tmpfs reclaims the page cache first, and the map/reduce path, which
    writes every row twice, took twice the CPU of the in-process export (benchmarks/README.md)."""
    one, five, fifteen = os.getloadavg()
    memory = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                memory = f", {int(line.split()[1]) / 2**20:.1f} GiB available"
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}{memory}"


def measured(*args: object) -> dict:
    """One ``rolloutcli`` run: wall seconds, CPU seconds and peak RSS (MiB) of the driver and of the rest."""
    argv = [sys.executable, "-c", LAUNCHER, sys.executable, "-m", "rolloutcli", *map(str, args), "-q"]
    result = subprocess.run(argv, env=ENV, capture_output=True, text=True, check=True)
    run = json.loads(result.stdout.splitlines()[-1])
    if run["rc"] != 0:
        raise RuntimeError(f"rolloutcli {args} failed: {result.stderr}")
    run["cpu"] = run["driver_cpu"] + run["others_cpu"]
    return run


def describe(run: dict) -> str:
    return (
        f"{run['wall']:.2f} s wall, {run['cpu']:.2f} s CPU (driver {run['driver_cpu']:.2f}, "
        f"{run['others']} others {run['others_cpu']:.2f}), peak RSS driver {run['driver_rss']:.0f} MiB, "
        f"others {run['others_rss']:.0f} MiB"
    )


def cp_sync(src: Path, dst: Path) -> float:
    """Seconds of ``cp -r src dst`` + ``sync``: the reference of a command that writes what it reads."""
    shutil.rmtree(dst, ignore_errors=True)
    started = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    subprocess.run(["sync"], check=True)
    seconds = time.perf_counter() - started
    shutil.rmtree(dst)
    return seconds


def compare(name: str, command: list[object], out: Path, repeats: int, reference: float) -> dict[int, dict]:
    """``command -o out --workers K`` for K = 1, 2, alternated ``repeats`` times; the fastest run of each."""
    fastest: dict[int, dict] = {}
    for repeat in range(repeats):
        for workers in (1, 2):
            shutil.rmtree(out, ignore_errors=True)
            run = measured(*command, "-o", out, "--workers", workers)
            print(f"  {name} --workers {workers} (run {repeat + 1}): {describe(run)}; {load()}", flush=True)
            if workers not in fastest or run["wall"] < fastest[workers]["wall"]:
                fastest[workers] = run
    one, two = fastest[1], fastest[2]
    print(
        f"{name}: CPU(workers 2) / CPU(workers 1) {two['cpu']:.1f} s / {one['cpu']:.1f} s = "
        f"{two['cpu'] / one['cpu']:.2f}x (goal <= 1.15x); wall {one['wall']:.2f} s / {two['wall']:.2f} s = "
        f"{one['wall'] / two['wall']:.2f}x faster with 2 (bound on 2 idle CPUs: {2 * one['cpu'] / two['cpu']:.2f}x); "
        f"--workers 1 vs cp + sync ({reference:.2f} s): {one['wall'] / reference:.2f}x; {load()}",
        flush=True,
    )
    return fastest


def ray_costs() -> None:
    import ray

    started = time.perf_counter()
    ray.init(num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False, log_to_driver=False)
    startup = time.perf_counter() - started

    @ray.remote
    def noop(x: int) -> int:
        return x

    started = time.perf_counter()
    ray.get([noop.remote(i) for i in range(2)])
    first = time.perf_counter() - started
    ray.get([noop.remote(i) for i in range(50)])  # warm the worker pool
    started = time.perf_counter()
    ray.get([noop.remote(i) for i in range(1000)])
    per_task = (time.perf_counter() - started) / 1000
    print(
        f"ray.init start-up {startup:.2f} s; first 2 tasks (worker start) {first:.2f} s; per-task overhead "
        f"{per_task * 1e3:.2f} ms (1000 no-op tasks, warm workers, 2 CPUs); {load()}",
        flush=True,
    )


def ray_vs_local(folder: Path, runs: Path, gae_out: Path, budget: str, repeats: int) -> None:
    """``gae`` and ``batch`` on a running Ray (started in ``ray_costs``) vs a local pool of 2, in this process."""
    import ray

    from rolloutcli.dataset import resolve
    from rolloutcli.pipeline.batch import BatchOptions, run_batch
    from rolloutcli.pipeline.dataset_job import run_dataset
    from rolloutcli.pipeline.engine import EngineOptions
    from rolloutcli.pipeline.gae import GaeOptions, run_gae
    from rolloutcli.pipeline.options import RunOptions, parse_size

    gae_options, run = GaeOptions(), RunOptions()
    data, shards = resolve([runs]), resolve([gae_out]).files
    batch_run = RunOptions(max_memory=parse_size(budget))
    jobs = {
        "gae": lambda out, engine: run_dataset(
            data, out, "gae", {}, lambda s, o: (run_gae, (s, o, gae_options, run)), engine
        ),
        "batch": lambda out, engine: run_batch(shards, out, BatchOptions(16), batch_run, engine=engine),
    }
    for job, fn in jobs.items():
        times: dict[str, list[float]] = {"local": [], "ray": []}
        for _ in range(repeats):
            for name, engine in (("local", EngineOptions(workers=2)), ("ray", EngineOptions(engine="ray"))):
                out = folder / f"{job}-{name}"
                shutil.rmtree(out, ignore_errors=True)
                started = time.perf_counter()
                fn(out, engine)
                times[name].append(time.perf_counter() - started)
                shutil.rmtree(out)
        local, ray_s = min(times["local"]), min(times["ray"])
        print(
            f"{job} in-process: ray {', '.join(f'{t:.2f}' for t in times['ray'])} s vs local --workers 2 "
            f"{', '.join(f'{t:.2f}' for t in times['local'])} s: {ray_s / local:.2f}x (best; goal <= 1.5x, after "
            f"start-up); {load()}",
            flush=True,
        )
    ray.shutdown()


def big(folder: Path) -> None:
    """1e8 rows in 4 files, feed-forward shards with ``--max-memory 512M``: peak RSS of every process."""
    rows_per_file, files = 25_000_000, 4
    src = folder / "big"
    src.mkdir(exist_ok=True)
    fields = {**SMALL, **{name: ((1,), np.float32) for name in ("observations", "actions")}}
    fields |= {"advantages": ((), np.float32), "returns": ((), np.float32)}
    for i in range(files):
        make_rollout(src / f"b{i}.h5", rows_per_file // 1000, 1000, 0.02, fields=fields, seed=i)
    print(f"big: 4 files of 25M rows (T=25000, N=1000, 25 bytes a row); {load()}", flush=True)
    for workers in (1, 2):
        out = folder / "big-shards"
        shutil.rmtree(out, ignore_errors=True)
        run = measured("batch", src, "-o", out, "-m", 64, "--max-memory", "512M", "--workers", workers)
        print(
            f"batch over 1e8 rows, --max-memory 512M, --workers {workers}: {describe(run)} "
            f"(goal: each < 812 MiB); {load()}",
            flush=True,
        )
        shutil.rmtree(out)
    shutil.rmtree(src)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 files of ~9 MB instead of ~256 MB")
    parser.add_argument("--big", action="store_true", help="also the 1e8-row feed-forward export (~3.5 GB)")
    parser.add_argument("--only-big", action="store_true", help="only the 1e8-row export")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray figures")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration (the fastest counts)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/rolloutcli-datasets"))
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--many-files", action="store_true", help="only the per-file cost on --files small files")
    parser.add_argument("--files", type=int, default=10_000, help="how many small files --many-files makes")
    parser.add_argument("--commands", help="--many-files: only these commands, e.g. gae,batch")
    args = parser.parse_args()
    folder = args.folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        if args.many_files:
            many_files(folder, args.files, measured, load, args.commands.split(",") if args.commands else None)
        elif not args.only_big:
            engines(folder, args)
        if args.big or args.only_big:
            big(folder)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


def engines(folder: Path, args: argparse.Namespace) -> None:
    runs = folder / "runs"
    runs.mkdir()
    T, N = (1000, 16) if args.quick else (2000, 224)  # ~590 bytes a step: ~9 MB or ~252 MiB a file
    sizes = [make_rollout(runs / f"run{i:02d}.h5", T, N, 0.02, seed=i) for i in range(8)]
    print(f"dataset: 8 files of {sizes[0] / 2**20:.0f} MiB (T={T}, N={N}), {THREADS}; {load()}", flush=True)
    gae_out = folder / "gae"
    reference = cp_sync(runs, folder / "copy")
    print(f"cp -r + sync of the 8 files: {reference:.2f} s; {load()}", flush=True)
    compare("gae", ["gae", runs], gae_out, args.repeats, reference)
    budget = "64M" if args.quick else "512M"  # streamed: several blocks per file
    compare("batch", ["batch", gae_out, "-m", 16, "--max-memory", budget], folder / "shards", args.repeats, reference)
    if args.no_ray:
        return
    ray_costs()
    ray_vs_local(folder, runs, gae_out, budget, args.repeats)
    out = folder / "gae-ray-cli"
    run = measured("gae", runs, "-o", out, "--engine", "ray", "--workers", 2)
    print(f"gae --engine ray CLI, cold (a new local cluster): {run['wall']:.2f} s wall; {load()}", flush=True)


if __name__ == "__main__":
    main()
