"""Recording costs, as ratios against references measured in the same run.

1. The RSL-RL hook: an ``OnPolicyRunner`` iteration (N=64 envs, T=24 steps, CPU, one torch thread unless
   ``--threads``) with and without ``rolloutcli.record.rsl_rl.attach``, interleaved runs of several iterations
   each, minimum of several (issue 13's ceiling: +5%); the one-off wait for the last file at the end of
   ``learn()`` is reported apart. Two runners: RSL-RL's defaults (PPO's 5 epochs of 4 mini-batches, actor and
   critic MLPs of 256-256-256) on a legged robot's sizes (48 observations, 12 actions), what an RSL-RL iteration
   is; and the tests' tiny one (3 observations, 16 hidden units, 1 epoch), where the fixed cost per file shows.
2. ``RolloutWriter`` adding ``[N, 48]`` float32 observations step by step vs h5py writing the same ``[T, N, 48]``
   array sequentially to a new file (issue 13's floor: half of h5py's speed).

    python benchmarks/bench_record.py [--quick] [--hook-only] [--network default|tiny|both] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


NETWORKS = {  # observations, actions, hidden units (None: RSL-RL's default), PPO's settings (None: its defaults)
    "default": (48, 12, None, None),
    "tiny": (3, 2, [16], {"num_learning_epochs": 1, "num_mini_batches": 2}),
}


def _runner(num_envs: int, steps: int, network: str):
    import test_record_rsl_rl as fake  # the VecEnv of the tests (its sizes are module globals)
    from rsl_rl.runners import OnPolicyRunner

    obs, actions, hidden, ppo = NETWORKS[network]
    fake.N, fake.T, fake.OBS, fake.ACT = num_envs, steps, obs, actions
    config = fake._config(rnn=False)
    config["algorithm"] = {"class_name": "PPO", **(ppo or {})}  # gamma, lam and the rest: RSL-RL's defaults
    for net in ("actor", "critic"):
        if hidden is None:
            del config[net]["hidden_dims"]
        else:
            config[net]["hidden_dims"] = hidden
    return OnPolicyRunner(fake.FakeEnv(), config, log_dir=None, device="cpu")


def bench_hook(network: str, rounds: int, iterations: int, folder: Path) -> float:
    """Each timed run is ``iterations`` iterations of ``OnPolicyRunner.learn``'s loop, on one runner with the
    hook attached and detached in turn (two runners differ by a few percent by themselves: their networks sit at
    other addresses), the order rotated every round. The hooked run's files are written by the writing process
    while the loop goes on (that work competes for the machine inside the timed run); the wait for the last
    file at the end of the run, which ``learn`` does once per call, is timed apart and reported, and is over
    before the next run starts. A third variant times the plain loop again: the difference between the two plain
    variants is what the host's noise alone gives, the floor under which no overhead can be told apart."""
    from rsl_rl.runners import OnPolicyRunner

    from rolloutcli.record.rsl_rl import attach

    runner = _runner(64, 24, network)
    recorder = attach(runner, folder / network)
    runner.learn(1)  # warm-up (starts the writing process)
    recorder.detach()
    runner.learn(1)
    times: dict[str, list[float]] = {"plain": [], "hooked": [], "control": []}  # control: plain again (A/A)
    cpu: dict[str, list[float]] = {name: [] for name in times}  # the loop thread's CPU time
    tails = []
    names = list(times)
    for r in range(rounds):
        for name in names[r % 3 :] + names[: r % 3]:  # each variant takes each place in turn
            recorder = attach(runner, folder / network) if name == "hooked" else None
            start, start_cpu = time.perf_counter(), time.thread_time()
            OnPolicyRunner.learn(runner, iterations)  # the loop, without the hook's wait at the end
            times[name].append((time.perf_counter() - start) / iterations)
            cpu[name].append((time.thread_time() - start_cpu) / iterations)
            if recorder is not None:
                start = time.perf_counter()
                recorder.detach()  # waits for the last file (learn() does this)
                tails.append(time.perf_counter() - start)
    best = {k: min(v) for k, v in times.items()}
    ratio = best["hooked"] / best["plain"]
    print(
        f"RSL-RL iteration N=64 T=24, {network} network (runs of {iterations} iterations): "
        f"plain {best['plain'] * 1e3:.1f} ms, "
        f"hooked {best['hooked'] * 1e3:.1f} ms, overhead {100 * (ratio - 1):+.1f}% (ceiling +5%); the same plain "
        f"loop timed again (A/A control: what this host's noise alone gives) "
        f"{100 * (best['control'] / best['plain'] - 1):+.1f}%; waiting for the last file at the end of learn(): "
        f"median {1e3 * sorted(tails)[len(tails) // 2]:.1f} ms once per call"
    )
    paired = {k: _median([a / b for a, b in zip(times[k], times["plain"], strict=True)]) for k in ("hooked", "control")}
    print(  # a round's three runs follow one another within a second: a slow spell slows both sides of a pair
        f"  median over the {rounds} rounds of each round's ratio to its plain run: hooked "
        f"{100 * (paired['hooked'] - 1):+.1f}%, A/A control {100 * (paired['control'] - 1):+.1f}%"
    )
    low = {k: min(v) for k, v in cpu.items()}  # CPU time: not lengthened by other tenants taking the CPU
    print(
        f"  the loop thread's CPU time per iteration: plain {low['plain'] * 1e3:.2f} ms, hooked "
        f"{low['hooked'] * 1e3:.2f} ms ({100 * (low['hooked'] / low['plain'] - 1):+.1f}%), A/A control "
        f"{100 * (low['control'] / low['plain'] - 1):+.1f}%"
    )
    return ratio


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def bench_handover(envs: int, rounds: int, folder: Path) -> float:
    """How long ``publish`` holds the training loop for an Isaac Lab-sized rollout (T=24, two observation groups
    of 235 floats, 12 actions), against copying the same tensors (``clone``) in the same run."""
    from rolloutcli.record.worker import publish

    g = torch.Generator().manual_seed(0)
    steps = {
        "observations": {k: torch.randn(24, envs, 235, generator=g) for k in ("policy", "critic")},
        "actions": torch.randn(24, envs, 12, generator=g),
        "rewards": torch.randn(24, envs, generator=g),
        "dones": torch.zeros(24, envs, dtype=torch.uint8),
        "values": torch.randn(24, envs, generator=g),
        "actions_log_prob": torch.randn(24, envs, generator=g),
        "distribution": {"mean": torch.randn(24, envs, 12, generator=g), "std": torch.rand(24, envs, 12, generator=g)},
    }
    leaves = [*steps["observations"].values(), *steps["distribution"].values()]
    leaves += [v for k, v in steps.items() if k not in ("observations", "distribution")]
    blocked, copied, published = [], [], []
    for r in range(rounds):
        start = time.perf_counter()
        copies = [leaf.clone() for leaf in leaves]
        copied.append(time.perf_counter() - start)
        del copies
        job = {
            "writer": {"path": folder / f"big_{r}.h5", "num_envs": envs, "num_steps": 24, "overwrite": True},
            "steps": steps,
            "close": {"last_values": torch.zeros(envs)},
        }
        start = time.perf_counter()
        future = publish(job)
        blocked.append(time.perf_counter() - start)
        future.result()
        published.append(time.perf_counter() - start)
        (folder / f"big_{r}.h5").unlink()
    mb = sum(leaf.nbytes for leaf in leaves) / 1e6
    ratio = min(blocked) / min(copied)
    print(
        f"handing over a [24, {envs}] rollout ({mb:.0f} MB): the loop waits {min(blocked) * 1e3:.1f} ms, a clone of it "
        f"takes {min(copied) * 1e3:.1f} ms ({ratio:.2f}x); published after {min(published) * 1e3:.0f} ms"
    )
    return ratio


def bench_writer(steps: int, envs: int, rounds: int, folder: Path) -> float:
    import h5py

    from rolloutcli.record import RolloutWriter

    data = np.random.default_rng(0).standard_normal((steps, envs, 48)).astype(np.float32)
    best_h5, best_sync, best_writer = float("inf"), float("inf"), float("inf")
    for r in range(rounds):
        start = time.perf_counter()
        with h5py.File(folder / f"h5_{r}.h5", "w") as handle:
            dataset = handle.create_dataset("observations", shape=data.shape, dtype=np.float32)
            for t in range(steps):
                dataset[t] = data[t]
        best_h5 = min(best_h5, time.perf_counter() - start)
        with open(folder / f"h5_{r}.h5", "rb+") as raw:  # the durability the writer's publish has
            os.fsync(raw.fileno())
        best_sync = min(best_sync, time.perf_counter() - start)
        start = time.perf_counter()
        with RolloutWriter(folder / f"w_{r}.h5", num_envs=envs, num_steps=steps) as writer:
            zeros, flags = np.zeros(envs, np.float32), np.zeros(envs, np.uint8)
            for t in range(steps):
                writer.add({"observations": data[t], "actions": zeros[:, None], "rewards": zeros, "dones": flags})
            writer.close()
        best_writer = min(best_writer, time.perf_counter() - start)
    ratio = best_h5 / best_writer
    mb = data.nbytes / 1e6
    print(
        f"[T={steps}, N={envs}, 48] float32 ({mb:.0f} MB): h5py {mb / best_h5:.0f} MB/s, h5py + fsync "
        f"{mb / best_sync:.0f} MB/s, writer {mb / best_writer:.0f} MB/s; writer/h5py {ratio:.2f} (floor 0.5), "
        f"writer/(h5py + fsync) {best_sync / best_writer:.2f}"
    )
    return ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: few rounds, small arrays")
    parser.add_argument("--rounds", type=int, default=60, help="interleaved runs of each hook variant (tiny network)")
    parser.add_argument("--network", choices=["default", "tiny", "both"], default="both", help="the hook's runner")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (the writing process shares the CPUs)")
    parser.add_argument("--hook-only", action="store_true", help="skip the writer benchmark")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        folder = Path(tmp)
        if args.network in ("default", "both"):  # iterations of about half a second: fewer, shorter runs
            bench_hook("default", 2 if args.quick else max(3, args.rounds // 4), 1 if args.quick else 2, folder)
        if args.network in ("tiny", "both"):
            bench_hook("tiny", 3 if args.quick else args.rounds, 2 if args.quick else 8, folder)
        if not args.hook_only:
            bench_handover(256 if args.quick else 4096, 2 if args.quick else 5, folder)
            bench_writer(24 if args.quick else 1000, 64 if args.quick else 1024, 2 if args.quick else 5, folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
