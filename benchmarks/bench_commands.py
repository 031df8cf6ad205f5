"""End-to-end benchmarks of the file commands, as ratios against references measured in the same run.

- ``gae`` on a ~1 GB rollout vs ``cp`` of that file, and vs ``cp`` + ``sync FILE`` (the durability gae's
  fsynced output has; floor: within 1.5x). Timed in-process (``run_gae``) and as a CLI subprocess (which adds
  interpreter start-up and imports). Every run writes a fresh output (deleted untimed before each run).
- ``gae`` peak memory on a ~2 GB rollout with ``--max-memory 256M`` (goal: under 1 GB), from the child's
  maximum RSS.
- ``split`` at (T=1000, N=1024, end rate 1/50, obs 48 float32) vs writing the same padded datasets with h5py
  and its peak RSS with ``--max-memory 256M``.

Usage: python benchmarks/bench_commands.py [--folder /tmp/rolloutcli-bench] [--skip-split] [--keep]
Files are created in --folder (several GB) and removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _bandwidth import measure_bandwidth

ROW = {  # name -> (feature shape, dtype): ~600 bytes per step, an Isaac Lab-like locomotion rollout
    "observations/policy": ((48,), np.float32),
    "observations/critic": ((60,), np.float32),
    "actions": ((12,), np.float32),
    "rewards": ((), np.float32),
    "values": ((), np.float32),
    "dones": ((), np.uint8),
    "time_outs": ((), np.uint8),
    "actions_log_prob": ((), np.float32),
    "distribution/mean": ((12,), np.float32),
    "distribution/std": ((12,), np.float32),
}


def make_rollout(path: Path, T: int, N: int, end_rate: float, fields: dict = ROW, seed: int = 0) -> int:
    """Write a rollout of random data, block by block (bounded memory); return its size in bytes."""
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as handle:
        handle.attrs["rolloutcli_format"] = "rollout"
        handle.attrs["format_version"] = 1
        datasets = {
            name: handle.create_dataset(name, shape=(T, N, *shape), dtype=dtype)
            for name, (shape, dtype) in fields.items()
        }
        handle["last_values"] = rng.standard_normal(N).astype(np.float32)
        step = max(1, (1 << 26) // (N * 600))
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            dones = (rng.random((t1 - t0, N)) < end_rate).astype(np.uint8)
            for name, (shape, dtype) in fields.items():
                if name == "dones":
                    block = dones
                elif name == "time_outs":
                    block = dones & (rng.random(dones.shape) < 0.5)
                else:
                    block = rng.standard_normal((t1 - t0, N, *shape), dtype=np.float32).astype(dtype)
                datasets[name][t0:t1] = block
    return path.stat().st_size


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


_PEAK_WRAPPER = (
    "import resource, subprocess, sys; "
    "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode; "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"
)


def child_peak_rss(argv: list[str]) -> tuple[float, int]:
    """Run a command; return (seconds, its peak RSS in bytes).

    The command is started from a small wrapper interpreter: a child forked straight from this (large)
    benchmark process would count the parent's pages in its own peak RSS until it execs.
    """
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", _PEAK_WRAPPER, *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{argv} failed: {result.stderr}")
    return seconds, int(result.stdout.split()[-1]) * 1024


def best(fn, repeats: int = 3) -> float:
    return min(timed(fn) for _ in range(repeats))


def best_fresh(fn, output: Path, repeats: int = 3) -> float:
    """Min seconds of ``fn`` writing ``output``, which is deleted (and synced away) before each run, untimed."""
    times = []
    for _ in range(repeats):
        if output.exists():
            os.unlink(output)
        os.sync()
        times.append(timed(fn))
    os.unlink(output)
    return min(times)


def bench_gae(folder: Path, results: dict) -> None:
    """``gae`` on a ~1 GB rollout against copying that file, every command writing a fresh output.

    References: ``cp`` (the copy sits in the page cache when cp exits) and ``cp`` + ``sync FILE`` (the copy is
    on disk, as gae's output is: gae fsyncs its output before renaming it into place).
    """
    from rolloutcli.pipeline.gae import GaeOptions, run_gae
    from rolloutcli.pipeline.options import RunOptions

    src = folder / "gae_1g.h5"
    size = make_rollout(src, T=1000, N=1792, end_rate=0.02)
    out = folder / "gae_out.h5"
    copy = folder / "gae_copy.h5"

    def cp() -> None:
        subprocess.run(["cp", str(src), str(copy)], check=True)

    def cp_sync() -> None:
        subprocess.run(["cp", str(src), str(copy)], check=True)
        subprocess.run(["sync", str(copy)], check=True)

    def in_process() -> None:
        run_gae(src, out, GaeOptions(), RunOptions())

    def cli() -> None:
        subprocess.run(
            [sys.executable, "-m", "rolloutcli", "gae", str(src), "-o", str(out), "-q"],
            check=True,
            capture_output=True,
        )

    in_process()  # warm the page cache
    cp_s, cp_sync_s = best_fresh(cp, copy), best_fresh(cp_sync, copy)
    run_s, cli_s = best_fresh(in_process, out), best_fresh(cli, out)
    results["gae_1GB"] = {
        "file_bytes": size,
        "cp_s": cp_s,
        "cp_sync_s": cp_sync_s,
        "run_gae_s": run_s,
        "cli_s": cli_s,
        "cli_over_cp": cli_s / cp_s,
        "cli_over_cp_sync": cli_s / cp_sync_s,
    }
    print(f"gae on {size / 1e9:.2f} GB, fresh outputs: cp {cp_s:.3f} s | cp + sync {cp_sync_s:.3f} s")
    print(
        f"  run_gae {run_s:.3f} s ({run_s / cp_s:.2f}x cp, {run_s / cp_sync_s:.2f}x cp + sync) | "
        f"CLI {cli_s:.3f} s ({cli_s / cp_s:.2f}x cp, {cli_s / cp_sync_s:.2f}x cp + sync; incl. start-up)"
    )
    os.unlink(src)

    src2 = folder / "gae_2g.h5"
    size2 = make_rollout(src2, T=1000, N=3584, end_rate=0.02)
    command = [sys.executable, "-m", "rolloutcli", "gae", str(src2), "-o", str(out), "-q", "--max-memory", "256M"]
    seconds, peak = child_peak_rss(command)
    results["gae_2GB_256M"] = {"file_bytes": size2, "seconds": seconds, "peak_rss_bytes": peak}
    print(f"gae on {size2 / 1e9:.2f} GB with --max-memory 256M: {seconds:.2f} s, peak RSS {peak / 2**20:.0f} MiB")
    os.unlink(src2)
    os.unlink(out)


def bench_split(folder: Path, results: dict) -> None:
    import torch

    from rolloutcli.core.trajectories import plan_trajectories
    from rolloutcli.pipeline.options import RunOptions
    from rolloutcli.pipeline.split import SplitOptions, run_split

    fields = {
        "observations/policy": ((48,), np.float32),
        "actions": ((12,), np.float32),
        "rewards": ((), np.float32),
        "dones": ((), np.uint8),
    }
    src = folder / "split_in.h5"
    make_rollout(src, T=1000, N=1024, end_rate=1 / 50, fields=fields)
    out = folder / "split_out.h5"
    ref = folder / "split_ref.h5"
    with h5py.File(src, "r") as handle:
        dones = torch.from_numpy(handle["dones"][()])
        data = {name: handle[name][()] for name in fields}
    plan = plan_trajectories(dones)
    L, M = plan.padded_length, plan.num_trajectories
    padded = {name: np.zeros((L, M, *shape), dtype) for name, (shape, dtype) in fields.items()}
    padded_bytes = sum(a.nbytes for a in padded.values()) + L * M
    for name, array in data.items():
        padded[name].reshape(L * M, -1)[plan.index.numpy()] = array.reshape(1000 * 1024, -1)
    masks = plan.masks().numpy()

    def h5py_write() -> None:
        with h5py.File(ref, "w") as handle:
            for name, array in padded.items():
                handle.create_dataset(name, data=array)
            handle.create_dataset("masks", data=masks)
        os.unlink(ref)

    def ours() -> None:
        run_split(src, out, SplitOptions(), RunOptions(), overwrite=True)
        os.unlink(out)

    ours()
    ref_s, ours_s = best(h5py_write), best(ours)
    results["split_1000x1024_rate50"] = {
        "padded_bytes": padded_bytes,
        "h5py_write_s": ref_s,
        "split_s": ours_s,
        "split_over_h5py": ours_s / ref_s,
    }
    print(
        f"split (T=1000, N=1024, 1/50): padded {padded_bytes / 1e9:.2f} GB | h5py write {ref_s:.2f} s | "
        f"split {ours_s:.2f} s ({ours_s / ref_s:.2f}x)"
    )
    padded.clear()  # free the reference arrays before the peak-memory run
    data.clear()
    seconds, peak = child_peak_rss(
        [
            sys.executable,
            "-m",
            "rolloutcli",
            "split",
            str(src),
            "-o",
            str(out),
            "--overwrite",
            "-q",
            "--max-memory",
            "256M",
        ]
    )
    results["split_cli_256M"] = {"seconds": seconds, "peak_rss_bytes": peak}
    print(
        f"split CLI with --max-memory 256M: {seconds:.2f} s, peak RSS {peak / 2**20:.0f} MiB "
        f"(padded output {padded_bytes / 2**20:.0f} MiB)"
    )
    os.unlink(out)
    os.unlink(src)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/rolloutcli-bench"))
    parser.add_argument("--skip-split", action="store_true")
    parser.add_argument("--skip-gae", action="store_true")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    bandwidth = measure_bandwidth()
    results: dict = {"bandwidth_GBs": bandwidth / 1e9}
    print(f"memory bandwidth (same run): {bandwidth / 1e9:.1f} GB/s")
    try:
        if not args.skip_gae:
            bench_gae(args.folder, results)
        if not args.skip_split:
            bench_split(args.folder, results)
    finally:
        if not args.keep:
            shutil.rmtree(args.folder, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
