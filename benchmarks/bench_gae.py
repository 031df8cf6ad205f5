"""GAE speed: RSL-RL's own loop vs rolloutcli's CPU kernel (compiled, and the numpy loop used where the C file was
not built) and the torch scan, and vs the memory-bandwidth bound.

Run: ``python benchmarks/bench_gae.py [--quick] [--smoke] [--threads N] [--repeats R]``.

* RSL-RL: the real ``PPO.compute_returns`` (called unbound on a minimal object holding a real ``RolloutStorage``),
  advantage normalisation off, so only GAE is timed.
* Bound: GAE must move 17 bytes per element (rewards and values float32 plus dones uint8 read; advantages and
  returns float32 written); bound = T * N * 17 / bandwidth, the bandwidth measured in this run.
* "kernel out=" writes into reused output buffers, as RSL-RL's storage does: no page faults of fresh memory.
* "bits" says whether the kernel's returns and advantages equal RSL-RL's bit for bit (they must).
* Every time is the minimum over repeats. The host may be shared: compare the columns of one run.

Goal checked at the end: the kernel >= 15x RSL-RL at (1000, 1024), with fresh outputs and with ``out=`` buffers.
Exit status 1 if it fails or if any bits differ.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bandwidth import best_time, measure_bandwidth

from rolloutcli.core import native
from rolloutcli.core.gae import compute_gae

SHAPES = [(24, 4096), (1000, 1024), (100000, 16), (1000000, 1)]
SMOKE_SHAPES = [(24, 256), (100, 1024), (2000, 4)]
BYTES_PER_ELEMENT = 17
GAMMA, LAM = 0.99, 0.95


def make_inputs(steps: int, envs: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(steps, envs, generator=g)
    values = torch.randn(steps, envs, generator=g)
    dones = torch.rand(steps, envs, generator=g) < 0.02
    last_values = torch.randn(envs, generator=g)
    return rewards, values, dones, last_values


def rsl_rl_runner(rewards, values, dones, last_values):
    """A callable running RSL-RL's real ``PPO.compute_returns`` on these inputs; returns (advantages, returns)."""
    from rsl_rl.algorithms.ppo import PPO
    from rsl_rl.storage import RolloutStorage
    from tensordict import TensorDict

    steps, envs = rewards.shape
    obs = TensorDict({"policy": torch.zeros(envs, 1)}, batch_size=[envs])
    storage = RolloutStorage("rl", envs, steps, obs, (1,), device="cpu")
    storage.rewards = rewards[..., None].clone()
    storage.values = values[..., None].clone()
    storage.dones = dones[..., None].to(torch.uint8)
    storage.step = steps

    class Critic:
        def __call__(self, _obs):
            return last_values[:, None]

        def get_hidden_state(self):
            return None

        def reset(self, dones=None, hidden_state=None):
            pass

    ppo = SimpleNamespace(
        storage=storage, gamma=GAMMA, lam=LAM, critic=Critic(), normalize_advantage_per_mini_batch=True
    )

    def run():
        PPO.compute_returns(ppo, obs)
        return storage.advantages[..., 0], storage.returns[..., 0]

    return run


def time_budgeted(fn, repeats: int, budget_s: float) -> tuple[float, int]:
    """Min time over up to ``repeats`` runs, stopping once ``budget_s`` is spent (at least one run)."""
    best, spent, runs = float("inf"), 0.0, 0
    while runs < repeats and (runs == 0 or spent < budget_s):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return best, runs


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "skipped"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def without_compiled_kernel(fn):
    """``fn`` run as an install without the C file runs it (the numpy loop)."""

    def run():
        real = native.library
        native.library = lambda: None
        try:
            return fn()
        finally:
            native.library = real

    return run


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip RSL-RL's loop where it takes seconds (T >= 1e5)")
    parser.add_argument("--smoke", action="store_true", help="small shapes only: checks that the script runs")
    parser.add_argument("--repeats", type=int, default=11, help="timed runs per measurement (minimum is reported)")
    parser.add_argument("--rsl-budget", type=float, default=6.0, help="seconds to spend timing RSL-RL per shape")
    parser.add_argument("--threads", type=int, default=None, help="threads of the CPU kernel (default: all CPUs)")
    args = parser.parse_args()
    repeats = 2 if args.smoke else args.repeats
    bandwidth = measure_bandwidth(gib=0.0625 if args.smoke else 0.5, repeats=1 if args.smoke else 5)
    header = (
        f"{'T x N':>14} | {'bound':>8} | {'RSL-RL':>9} | {'kernel':>8} | {'vs RSL':>6} | {'kernel out=':>11} | "
        f"{'vs RSL':>6} | {'no C':>8} | {'torch scan':>10} | bits"
    )
    print(f"torch {torch.__version__}, {bandwidth / 1e9:.1f} GB/s, compiled kernel: {native.library() is not None}")
    print(header)
    print("-" * len(header))
    goals = []
    for steps, envs in SMOKE_SHAPES if args.smoke else SHAPES:
        r, v, d, lv = make_inputs(steps, envs)
        buffers = (torch.empty(steps, envs), torch.empty(steps, envs))

        def kernel(r=r, v=v, d=d, lv=lv, out=None):
            return compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, num_threads=args.threads, out=out)

        rsl = exact = None
        if not (args.quick and steps >= 100_000):
            run_rsl = rsl_rl_runner(r, v, d, lv)
            ref = run_rsl()
            ours = kernel()
            exact = bits_equal(ours[0], ref[0]) and bits_equal(ours[1], ref[1])
            rsl, _ = time_budgeted(run_rsl, repeats, 0.5 if args.smoke else args.rsl_budget)
        t_kernel = best_time(kernel, repeats)
        t_out = best_time(lambda kernel=kernel, buffers=buffers: kernel(out=buffers), repeats)
        t_numpy = best_time(without_compiled_kernel(kernel), max(1, repeats // 3)) if steps <= 10_000 else None
        t_scan = best_time(lambda r=r, v=v, d=d, lv=lv: compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, backend="torch"))
        bound = steps * envs * BYTES_PER_ELEMENT / bandwidth
        print(
            f"{steps:>7} x {envs:<4} | {fmt_time(bound):>8} | {fmt_time(rsl):>9} | {fmt_time(t_kernel):>8} | "
            f"{f'{rsl / t_kernel:.0f}x' if rsl else '-':>6} | {fmt_time(t_out):>11} | "
            f"{f'{rsl / t_out:.0f}x' if rsl else '-':>6} | {fmt_time(t_numpy):>8} | {fmt_time(t_scan):>10} | "
            f"{'-' if exact is None else 'equal' if exact else 'DIFFER'}"
        )
        if exact is not None:
            goals.append((f"kernel bits equal RSL-RL's at {steps} x {envs}", exact))
        if (steps, envs) == (1000, 1024) and rsl:
            for label, t in (("fresh outputs", t_kernel), ("out= buffers", t_out)):
                goals.append((f"kernel >= 15x RSL-RL at 1000 x 1024, {label} ({rsl / t:.0f}x)", rsl / t >= 15))
    print()
    for name, ok in goals:
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(ok for _, ok in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
