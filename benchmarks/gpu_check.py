"""Check and time what "GPU when available" means for rolloutcli users; one table, non-zero exit on a mismatch.

Run: ``python benchmarks/gpu_check.py [--quick]`` from the repository root (needs torch, h5py, numpy, tensordict,
typer, rich, xxhash and this repository; not rsl_rl: RSL-RL's GAE loop is written out below). Under 5 minutes on
one GPU. Without CUDA it says so, runs the CPU side, and exits 0.

Checks, and the tolerance of each (README: exact on the CPU, float32 rounding elsewhere):

- ``compute_gae``: the exact CPU kernel vs RSL-RL's loop (bit for bit); the CUDA scan vs the CPU kernel (max abs
  difference <= 1e-4 x the largest abs return), timed against RSL-RL's loop on CUDA, at 24x4096 and 1000x1024.
- split/pad: ``split_and_pad_trajectories`` on CUDA vs CPU (bit for bit), timed.
- ``RolloutStorage.from_hdf5(device="cuda")``: loaded tensors and generator batches (``parity=False``, seeded) vs
  the CPU (bit for bit).
- training loop: ``ShardDataset`` / ``RolloutDataset`` through ``DataLoader(pin_memory=True)`` and
  ``.to(device, non_blocking=True)``: every row once per epoch, time waiting on data per step.
- ``--device auto``: what it picks, and whether split is faster there.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rolloutcli import RolloutDataset, RolloutStorage, ShardDataset, compute_gae, split_and_pad_trajectories
from rolloutcli.hdf5.storage_io import write_rollout
from rolloutcli.pipeline.batch import BatchOptions, run_batch
from rolloutcli.pipeline.options import RunOptions, resolve_device

GAE_TOLERANCE = 1e-4  # relative to the largest |return|: float32 rounding of a scan instead of the serial loop
Row = tuple[str, str, str, str, bool]  # check, size, result, times, passed


def timed(fn: Callable[[], Any], device: str, repeats: int = 3) -> tuple[Any, float]:
    """``fn()``'s result and its best time of ``repeats`` (synchronising CUDA)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return out, best


def rsl_loop(rewards, values, dones, last_values, gamma: float, lam: float) -> torch.Tensor:
    """RSL-RL 5.x's ``compute_returns`` loop (returns), on the inputs' device."""
    advantage = torch.zeros_like(last_values)
    returns = torch.empty_like(values)
    for step in reversed(range(values.shape[0])):
        next_values = last_values if step == values.shape[0] - 1 else values[step + 1]
        not_done = 1.0 - dones[step].float()
        delta = rewards[step] + not_done * gamma * next_values - values[step]
        advantage = delta + not_done * gamma * lam * advantage
        returns[step] = advantage + values[step]
    return returns


def inputs(T: int, N: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "rewards": torch.randn(T, N, generator=g),
        "values": torch.randn(T, N, generator=g),
        "dones": (torch.rand(T, N, generator=g) < 0.02).to(torch.uint8),
        "last_values": torch.randn(N, generator=g),
    }


def check_gae(cuda: bool, sizes: list[tuple[int, int]]) -> list[Row]:
    rows = []
    for T, N in sizes:
        x = inputs(T, N)
        args = (x["rewards"], x["values"], x["dones"], x["last_values"])
        (_, cpu), t_cpu = timed(lambda a=args: compute_gae(*a, gamma=0.99, lam=0.95), "cpu")
        ref, t_loop = timed(lambda a=args: rsl_loop(*a, 0.99, 0.95), "cpu", repeats=1)
        same = torch.equal(cpu, ref)
        rows.append(("compute_gae cpu vs RSL-RL loop", f"{T}x{N}", "bit-equal" if same else "DIFFERS",
                     f"{t_cpu * 1e3:.2f} ms vs loop {t_loop * 1e3:.1f} ms", same))  # fmt: skip
        if not cuda:
            continue
        gpu_args = tuple(a.cuda() for a in args)
        (_, gpu), t_gpu = timed(lambda a=gpu_args: compute_gae(*a, gamma=0.99, lam=0.95), "cuda")
        _, t_gpu_loop = timed(lambda a=gpu_args: rsl_loop(*a, 0.99, 0.95), "cuda", repeats=1)
        diff = float((gpu.cpu() - cpu).abs().max())
        ok = diff <= GAE_TOLERANCE * max(1.0, float(cpu.abs().max()))
        rows.append(("compute_gae cuda vs cpu kernel", f"{T}x{N}", f"max diff {diff:.2e}",
                     f"cuda {t_gpu * 1e3:.2f} ms, cpu {t_cpu * 1e3:.2f} ms, RSL-RL loop on cuda "
                     f"{t_gpu_loop * 1e3:.1f} ms", ok))  # fmt: skip
    return rows


def check_split(cuda: bool, T: int, N: int) -> tuple[list[Row], float, float | None]:
    x = inputs(T, N, seed=1)
    observations = torch.randn(T, N, 48, generator=torch.Generator().manual_seed(2))
    dones = x["dones"].unsqueeze(-1)
    (cpu, cpu_masks), t_cpu = timed(lambda: split_and_pad_trajectories(observations, dones), "cpu")
    rows = [("split/pad cpu", f"{T}x{N}x48", f"{cpu.shape[1]} trajectories", f"{t_cpu * 1e3:.2f} ms", True)]
    if not cuda:
        return rows, t_cpu, None
    obs_gpu, dones_gpu = observations.cuda(), dones.cuda()
    (gpu, gpu_masks), t_gpu = timed(lambda: split_and_pad_trajectories(obs_gpu, dones_gpu), "cuda")
    same = torch.equal(gpu.cpu(), cpu) and torch.equal(gpu_masks.cpu(), cpu_masks)
    rows.append(("split/pad cuda vs cpu", f"{T}x{N}x48", "bit-equal" if same else "DIFFERS",
                 f"cuda {t_gpu * 1e3:.2f} ms, cpu {t_cpu * 1e3:.2f} ms", same))  # fmt: skip
    return rows, t_cpu, t_gpu


def write_source(path: Path, T: int, N: int) -> Path:
    rng = np.random.default_rng(3)
    t = np.arange(T)[:, None, None] * 1000.0 + np.arange(N)[None, :, None]
    tensors = {
        "observations/policy": np.concatenate([t, rng.standard_normal((T, N, 15))], axis=2).astype(np.float32),
        "actions": rng.standard_normal((T, N, 4)).astype(np.float32),
        "rewards": rng.standard_normal((T, N)).astype(np.float32),
        "dones": (rng.random((T, N)) < 0.05).astype(np.uint8),
        "values": rng.standard_normal((T, N)).astype(np.float32),
        "last_values": rng.standard_normal(N).astype(np.float32),
        "actions_log_prob": rng.standard_normal((T, N)).astype(np.float32),
        "advantages": rng.standard_normal((T, N)).astype(np.float32),
        "returns": rng.standard_normal((T, N)).astype(np.float32),
        "hidden_states/actor/0": rng.standard_normal((T, 1, N, 8)).astype(np.float32),
    }
    write_rollout(path, {k: torch.from_numpy(v) for k, v in tensors.items()})
    return path


def _batches_equal(a, b) -> bool:
    for name in ("actions", "values", "advantages", "returns", "old_actions_log_prob", "masks"):
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None) or (x is not None and not torch.equal(x.cpu(), y.cpu())):
            return False
    return all(torch.equal(a.observations[k].cpu(), b.observations[k].cpu()) for k in a.observations.keys())


def check_storage(cuda: bool, src: Path) -> list[Row]:
    (cpu, t_cpu) = timed(lambda: RolloutStorage.from_hdf5(src, device="cpu"), "cpu", repeats=1)
    rows = [("from_hdf5 cpu", "", f"T={cpu.num_transitions_per_env} N={cpu.num_envs}", f"{t_cpu * 1e3:.0f} ms", True)]
    if not cuda:
        return rows
    gpu, t_gpu = timed(lambda: RolloutStorage.from_hdf5(src, device="cuda"), "cuda", repeats=1)
    same = torch.equal(gpu.actions.cpu(), cpu.actions) and torch.equal(gpu.observations["policy"].cpu(),
                                                                         cpu.observations["policy"])  # fmt: skip
    rows.append(("from_hdf5 cuda vs cpu", "", "bit-equal" if same else "DIFFERS",
                 f"cuda {t_gpu * 1e3:.0f} ms, cpu {t_cpu * 1e3:.0f} ms", same))  # fmt: skip
    for name in ("mini_batch_generator", "recurrent_mini_batch_generator"):
        pairs = [
            list(getattr(s, name)(4, 2, parity=False, generator=torch.Generator().manual_seed(5))) for s in (cpu, gpu)
        ]
        ok = len(pairs[0]) == len(pairs[1]) and all(_batches_equal(a, b) for a, b in zip(*pairs, strict=True))
        rows.append((f"{name} cuda vs cpu", "4 x 2 epochs", "bit-equal" if ok else "DIFFERS", "", ok))
    return rows


def _loop(loader, device: str, expected_rows: int) -> tuple[float, int, bool]:
    """Seconds per step waiting on data (including the copy to ``device``), steps, every row seen once."""
    waited, steps, seen = 0.0, 0, []
    iterator = iter(loader)
    while True:
        start = time.perf_counter()
        try:
            batch = next(iterator).to(device, non_blocking=True)
        except StopIteration:
            break
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        waited += time.perf_counter() - start
        steps += 1
        first = batch.observations["policy"][:, 0].round().long().cpu()
        seen += first.tolist()
        (batch.actions @ batch.actions.T).sum()  # the "training" step
    return waited / max(steps, 1), steps, len(seen) == expected_rows and len(set(seen)) == expected_rows


def check_loops(cuda: bool, src: Path, shards: Path, T: int, N: int) -> list[Row]:
    device = "cuda" if cuda else "cpu"
    rows = []
    loaders = {
        "ShardDataset": DataLoader(ShardDataset(shards, shuffle=True), batch_size=None, pin_memory=cuda),
        "RolloutDataset": DataLoader(
            RolloutDataset(src, fields=["observations", "actions"]),
            batch_size=1024,
            shuffle=True,
            num_workers=2,
            pin_memory=cuda,
        ),
    }
    for label, loader in loaders.items():
        per_step, steps, ok = _loop(loader, device, T * N)
        rows.append((f"loop {label} -> {device}", f"{steps} steps", "every row once" if ok else "ROWS WRONG",
                     f"waits {per_step * 1e3:.2f} ms/step (pin_memory={cuda}, non_blocking)", ok))  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds; what the test suite runs)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    sizes = [(24, 256), (100, 64)] if args.quick else [(24, 4096), (1000, 1024)]
    split_size = (24, 256) if args.quick else (24, 4096)
    T, N = (16, 64) if args.quick else (64, 4096)
    rows = check_gae(cuda, sizes)
    split_rows, t_cpu, t_gpu = check_split(cuda, *split_size)
    rows += split_rows
    with tempfile.TemporaryDirectory() as tmp:
        src = write_source(Path(tmp) / "src.h5", T, N)
        run_batch(src, Path(tmp) / "shards", BatchOptions(8), RunOptions())
        rows += check_storage(cuda, src)
        rows += check_loops(cuda, src, Path(tmp) / "shards", T, N)
    auto = resolve_device("auto")
    helps = "n/a" if t_gpu is None else f"split {t_cpu / t_gpu:.1f}x faster on cuda" if t_gpu < t_cpu else "no"
    rows.append(("--device auto", "", f"picks {auto}", helps, True))
    width = [max(len(str(r[i])) for r in rows) for i in range(4)]
    print(" | ".join(h.ljust(w) for h, w in zip(("check", "size", "result", "times"), width, strict=True)) + " | ok")
    for row in rows:
        print(
            " | ".join(str(c).ljust(w) for c, w in zip(row[:4], width, strict=True)) + f" | {'yes' if row[4] else 'NO'}"
        )
    failed = [r[0] for r in rows if not r[4]]
    if not cuda:
        print("no CUDA device: ran the CPU side only (every CUDA check skipped)")
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
