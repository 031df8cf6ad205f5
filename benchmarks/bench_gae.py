"""GAE speed: RSL-RL's own loop vs rolloutcli's numba and torch-scan backends, and vs the memory-bandwidth bound.

Run: ``python benchmarks/bench_gae.py [--quick] [--threads N] [--repeats R]``.

* RSL-RL: the real ``PPO.compute_returns`` (called unbound on a minimal object holding a real ``RolloutStorage``),
  advantage normalisation off, so only GAE is timed.
* Bound: GAE must move 17 bytes per element (rewards and values float32 plus dones uint8 read; advantages and
  returns float32 written); bound = T * N * 17 / bandwidth. The bandwidth is measured in this run, in rounds
  interleaved with the numba timings of each shape, so both see the same load on a shared host; the best
  bandwidth of the shape's rounds is used ("GB/s" column).
* Every time is the minimum over repeats, measured in one process with torch imported and its thread pool used.
  "after torch" times compute_gae right after a small multi-threaded torch op, the case where torch's OpenMP
  workers are still spinning (libgomp's default, for milliseconds) when our threads start; setting
  OMP_WAIT_POLICY=PASSIVE before torch is imported removes that contention.
* "numba out=" writes into reused output buffers, as RSL-RL's storage does: no page faults of fresh memory,
  which on a VM can cost more than the computation.
* The host may be shared: compare the columns of one run, not runs with each other.

Goals checked at the end: numba >= 15x RSL-RL at (1000, 1024); numba within 4x of the bound at every shape;
each both with fresh outputs and with reused ``out=`` buffers. Exit status 1 if any fails.
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

from rolloutcli.core.gae import compute_gae

SHAPES = [(24, 4096), (1000, 1024), (100000, 16), (1000000, 1)]
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


_PROBE = torch.ones(1 << 16)  # big enough for torch to use its threads, small enough to leave the caches alone


def time_after_torch_op(fn, repeats: int) -> float:
    """Min time of ``fn`` when it starts right after a multi-threaded torch op (not timed)."""
    a, b = _PROBE, torch.empty_like(_PROBE)
    best = float("inf")
    for _ in range(repeats):
        torch.mul(a, 1.5, out=b)
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "skipped"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip RSL-RL's loop where it takes seconds (T >= 1e5)")
    parser.add_argument("--repeats", type=int, default=11, help="timed runs per measurement (minimum is reported)")
    parser.add_argument("--rsl-budget", type=float, default=6.0, help="seconds to spend timing RSL-RL per shape")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads for the numba backend")
    args = parser.parse_args()

    rows = []
    for steps, envs in SHAPES:
        r, v, d, lv = make_inputs(steps, envs)
        _, ret_nb = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, backend="numba", num_threads=args.threads)
        _, ret_ts = compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, backend="torch")
        rsl = None
        err_nb = err_ts = float("nan")
        if not (args.quick and steps >= 100_000):
            run_rsl = rsl_rl_runner(r, v, d, lv)
            _, ref_ret = run_rsl()
            err_nb = (ret_nb - ref_ret).abs().max().item()
            err_ts = (ret_ts - ref_ret).abs().max().item()
            rsl, _ = time_budgeted(run_rsl, args.repeats, args.rsl_budget)

        def numba_fn(r=r, v=v, d=d, lv=lv):
            return compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, backend="numba", num_threads=args.threads)

        buffers = (torch.empty(steps, envs), torch.empty(steps, envs))

        def numba_out_fn(r=r, v=v, d=d, lv=lv, buffers=buffers):
            return compute_gae(
                r, v, d, lv, gamma=GAMMA, lam=LAM, backend="numba", num_threads=args.threads, out=buffers
            )

        def torch_fn(r=r, v=v, d=d, lv=lv):
            return compute_gae(r, v, d, lv, gamma=GAMMA, lam=LAM, backend="torch")

        bw = 0.0
        t_nb = t_nb_out = t_nb_after = float("inf")
        for _ in range(args.repeats):  # rounds: a bandwidth probe, numba, numba right after a torch op
            bw = max(bw, measure_bandwidth(gib=0.25, repeats=1))
            # The probe's torch ops leave torch's OpenMP workers spinning for a few ms; let them go to sleep so
            # the plain numba time is not an "after torch" time.
            time.sleep(0.05)
            t_nb = min(t_nb, best_time(numba_fn, 1))
            t_nb_out = min(t_nb_out, best_time(numba_out_fn, 1))
            t_nb_after = min(t_nb_after, time_after_torch_op(numba_fn, 1))
        t_ts = best_time(torch_fn, max(1, args.repeats // 3))
        rows.append((steps, envs, bw, rsl, t_nb, t_nb_out, t_nb_after, t_ts, err_nb, err_ts))

    print(f"torch {torch.__version__}, torch threads {torch.get_num_threads()}, numba-backend threads {args.threads}")
    header = (
        f"{'T x N':>14} | {'GB/s':>5} | {'bound':>8} | {'RSL-RL':>9} | {'numba':>8} | {'vs RSL':>6} | "
        f"{'x bound':>7} | {'numba out=':>10} | {'x bound':>7} | {'after torch':>11} | {'x bound':>7} | "
        f"{'torch scan':>10} | {'vs RSL':>6} | {'x bound':>7} | max |returns - RSL-RL's| numba / scan"
    )
    print(header)
    print("-" * len(header))
    goals = []
    for steps, envs, bw, rsl, t_nb, t_nb_out, t_nb_after, t_ts, err_nb, err_ts in rows:
        bound = steps * envs * BYTES_PER_ELEMENT / bw
        speed_nb = f"{rsl / t_nb:.0f}x" if rsl else "-"
        speed_ts = f"{rsl / t_ts:.1f}x" if rsl else "-"
        print(
            f"{steps:>7} x {envs:<4} | {bw / 1e9:>5.1f} | {fmt_time(bound):>8} | {fmt_time(rsl):>9} | "
            f"{fmt_time(t_nb):>8} | {speed_nb:>6} | {t_nb / bound:>7.2f} | {fmt_time(t_nb_out):>10} | "
            f"{t_nb_out / bound:>7.2f} | {fmt_time(t_nb_after):>11} | "
            f"{t_nb_after / bound:>7.2f} | {fmt_time(t_ts):>10} | {speed_ts:>6} | {t_ts / bound:>7.1f} | "
            f"{err_nb:.2g} / {err_ts:.2g}"
        )
        shape = f"{steps} x {envs}"
        goals.append((f"numba within 4x of the bound at {shape}, fresh outputs", t_nb / bound <= 4))
        goals.append((f"numba within 4x of the bound at {shape}, out= buffers", t_nb_out / bound <= 4))
        if (steps, envs) == (1000, 1024) and rsl:
            for label, t in (("fresh outputs", t_nb), ("out= buffers", t_nb_out)):
                goals.append((f"numba >= 15x RSL-RL at {shape}, {label} ({rsl / t:.0f}x)", rsl / t >= 15))
    print()
    for name, ok in goals:
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(ok for _, ok in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
