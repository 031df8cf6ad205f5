"""``bench_datasets.py --many-files``: the per-file cost of every dataset command against h5py doing the same per-file
work, measured in the same run, and the peak RSS on 100 files against the peak on all of them.

A training run recorded by the RSL-RL hook is one small file per iteration. The files here are made the same way
(``RolloutWriter``, T=16, N=4, 48 observations, 12 actions: ~28 KB each). The references, per file, in one
process after its imports:

- ``inspect``: open the file, visit every object, read ``rewards``;
- ``gae``, ``returns``, ``nstep``, ``split`` (one output per input): that, plus read every dataset, create an
  output with the same datasets beside the destination, fsync it and rename it (the durability the commands give);
- ``batch`` and ``export --to d4rl`` (one output for every input): open the file and read every dataset.

``batch`` runs twice: ``-m 16`` (the wall figure) and ``--batch-size 400`` (shards of one size on 100 files and on
all of them: the memory figure of the file count alone; ``-m 16`` also holds a shard 100 times larger, and
twice that while the first is laid out).
Each command runs as a CLI subprocess with ``--workers 1`` (and ``gae`` with ``--workers 2``, for the CPU
efficiency: CPU(workers 2) / CPU(workers 1), every process counted, goal at most 1.3x). Goals (issue 39): wall
time per file at most 2x the reference's; peak RSS of the driver and of the other processes on all files within
1.2x of the peak on 100 files.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import h5py

T, N, OBS, ACT = 16, 4, 48, 12
SUBSET = 100  # the memory figure's small dataset


def make_recordings(folder: Path, count: int) -> None:
    """``count`` recordings as the RSL-RL hook writes them (``RolloutWriter``), fixed seeds."""
    import torch

    from rolloutcli.record import RolloutWriter

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for i in range(count):
        writer = RolloutWriter(folder / f"iteration_{i:05d}.h5", num_envs=N)
        writer.add_steps(
            {
                "observations": {"policy": torch.randn(T, N, OBS, generator=g)},
                "actions": torch.randn(T, N, ACT, generator=g),
                "rewards": torch.randn(T, N, generator=g),
                "dones": (torch.rand(T, N, generator=g) < 0.05).float(),
                "time_outs": torch.zeros(T, N),
                "values": torch.randn(T, N, generator=g),
            }
        )
        writer.close(last_values=torch.randn(N, generator=g))


def _visit(handle: h5py.File) -> list[str]:
    names: list[str] = []
    handle.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names


def _reference_file(path: Path, kind: str, out: Path) -> None:
    with h5py.File(path, "r") as source:
        names = _visit(source)
        source["rewards"][()]
        if kind == "inspect":
            return
        arrays = {name: source[name][()] for name in names}
    if kind == "read":
        return
    tmp = out / f".{path.name}.tmp"
    with h5py.File(tmp, "w") as target:
        for name, array in arrays.items():
            target.create_dataset(name, data=array)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, out / path.name)


def reference(files: list[Path], kind: str, out: Path) -> tuple[float, float]:
    """Seconds per file, wall and CPU, of plain h5py doing ``kind``'s per-file work (inspect, read, write)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started, cpu = time.perf_counter(), time.process_time()
    for path in files:
        _reference_file(path, kind, out)
    if kind == "write":
        fd = os.open(out, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    seconds = (time.perf_counter() - started) / len(files), (time.process_time() - cpu) / len(files)
    shutil.rmtree(out)
    return seconds


# a label: the command and its arguments after the input, the reference kind, the input (recordings or their gae
# outputs). ``batch -m 16`` makes shards 100 times larger on all the files than on 100 of them, holds one while
# it writes, and the file image of one while the first is laid out; ``batch --batch-size 400`` makes shards of one
# size on both (400 rows: 16 of them on 100 files),
# so its memory figure is what the file count alone adds.
COMMANDS: dict[str, tuple[list[str], str, str]] = {
    "inspect": (["inspect", "--json"], "inspect", "runs"),
    "gae": (["gae"], "write", "runs"),
    "returns": (["returns"], "write", "runs"),
    "nstep": (["nstep"], "write", "runs"),
    "split": (["split"], "write", "runs"),
    "batch": (["batch", "-m", "16"], "read", "gae"),
    "batch-rows": (["batch", "--batch-size", "400"], "read", "gae"),
    "export": (["export", "--to", "d4rl"], "read", "runs"),  # whole episodes into one file (no wall goal: memory's)
}


def many_files(folder: Path, count: int, measured: Any, load: Any, only: list[str] | None = None) -> None:
    """Every command (or those in ``only``) on ``count`` small files and on the first 100 of them; figures against
    the references."""
    runs, small = folder / "runs", folder / "runs-100"
    started = time.perf_counter()
    make_recordings(runs, count)
    small.mkdir()
    for path in sorted(runs.iterdir())[:SUBSET]:
        os.link(path, small / path.name)
    size = sum(p.stat().st_size for p in runs.iterdir()) / 2**20
    made = time.perf_counter() - started
    print(f"many files: {count} recordings of T={T}, N={N}, {size:.1f} MiB, made in {made:.0f} s; {load()}", flush=True)
    inputs = {"runs": (runs, small)}
    for name, ((command, *extra), kind, source) in COMMANDS.items():
        if only and name not in only:
            continue
        if source == "gae" and "gae" not in inputs:
            inputs["gae"] = tuple(folder / f"gae-in-{i}" for i in range(2))
            for src, dst in zip(inputs["runs"], inputs["gae"], strict=True):
                measured("gae", src, "-o", dst)
        big_in, small_in = inputs[source]
        ref = reference(sorted(Path(big_in).glob("**/*.h5")), kind, folder / "reference")
        out = [] if name == "inspect" else ["-o", folder / (f"{name}-out" + (".hdf5" if name == "export" else ""))]
        figures = {}
        for label, src, workers in (("all", big_in, 1), ("100", small_in, 1), ("all-w2", big_in, 2)):
            if workers == 2 and name != "gae":
                continue
            if out and out[1].is_file():
                out[1].unlink()
            elif out:
                shutil.rmtree(out[1], ignore_errors=True)
            engine = ["--workers", workers] if out else []  # inspect runs in the driver
            figures[label] = measured(command, src, *extra, *out, *engine)
        _report(name, count, ref, figures, load)


def _report(name: str, count: int, ref: tuple[float, float], figures: dict[str, dict], load: Any) -> None:
    run, small = figures["all"], figures["100"]
    per_file, cpu = run["wall"] / count, run["cpu"] / count
    line = (
        f"{name}: {per_file * 1e3:.2f} ms a file vs h5py {ref[0] * 1e3:.2f} ms: {per_file / ref[0]:.2f}x "
        f"({'no goal' if name in ('export', 'batch-rows') else 'goal <= 2x'}), "
        f"CPU {cpu * 1e3:.2f} ms vs {ref[1] * 1e3:.2f} ms ({cpu / ref[1]:.2f}x, every process); "
        f"each file past the first {SUBSET} (start-up left out): {_marginal(run, small, count, 'wall', ref[0])} wall, "
        f"{_marginal(run, small, count, 'cpu', ref[1])} CPU; "
        f"peak RSS driver {run['driver_rss']:.0f} MiB vs {small['driver_rss']:.0f} on {SUBSET} files "
        f"({run['driver_rss'] / small['driver_rss']:.2f}x), others {run['others_rss']:.0f} vs "
        f"{small['others_rss']:.0f} MiB ({_ratio(run['others_rss'], small['others_rss'])}; goal <= 1.2x)"
    )
    if "all-w2" in figures:
        two = figures["all-w2"]
        line += (
            f"; --workers 2: {two['wall'] / count * 1e3:.2f} ms a file, CPU {two['cpu']:.1f} s vs "
            f"{run['cpu']:.1f} s ({two['cpu'] / run['cpu']:.2f}x, goal <= 1.3x)"
        )
    print(f"{line}; {load()}", flush=True)


def _marginal(run: dict, small: dict, count: int, key: str, ref: float) -> str:
    """The cost of each file past the first ``SUBSET`` (what the per-file figure tends to on many files)."""
    if count <= SUBSET:
        return "-"
    per_file = (run[key] - small[key]) / (count - SUBSET)
    return f"{per_file * 1e3:.2f} ms ({per_file / ref:.2f}x)"


def _ratio(big: float, small: float) -> str:
    return f"{big / small:.2f}x" if small else "-"


if __name__ == "__main__":  # a quick look at the references alone
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        make_recordings(Path(tmp) / "runs", int(sys.argv[1]) if len(sys.argv) > 1 else 200)
        paths = sorted((Path(tmp) / "runs").iterdir())
        for kind in ("inspect", "read", "write"):
            print(kind, f"{reference(paths, kind, Path(tmp) / 'ref')[0] * 1e3:.2f} ms a file")
