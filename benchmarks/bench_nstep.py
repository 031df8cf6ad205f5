"""n-step core speed vs the memory-bandwidth bound, measured in the same run.

Run: ``python benchmarks/bench_nstep.py [--quick] [--repeats R]``.

* Bound: the core must read rewards (float32), dones and time_outs (uint8) and write returns and discount
  (float32) and next_step (int64): 22 bytes per element; bound = T * N * 22 / bandwidth, the bandwidth measured
  in this run the way ``shared/tools/bandwidth.py`` does (best of torch ``copy_`` and ``add(out=)``).
* Paths: the compiled kernel (``_nstep.c``, where built; what ``nstep_returns`` runs on the CPU) with fresh
  outputs and with ``out=`` buffers (as the bandwidth probe has: no page faults on new memory), and torch.
* Every time is the minimum over repeats. The host may be shared: compare the columns of one run.

Goal: within 4x of the bound at (1000, 1024), K = 5.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bandwidth import best_time, measure_bandwidth

from rolloutcli.core.nstep import _DTYPES, NStep, kernel, nstep_returns, nstep_torch

BYTES_PER_ELEMENT = 22


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and a smaller bandwidth probe")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--n", type=int, default=5)
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 9)
    bandwidth = measure_bandwidth(0.25 if args.quick else 0.5, repeats)
    print(f"bandwidth {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")
    shapes = [(1000, 1024)] if args.quick else [(24, 4096), (1000, 1024), (100000, 16)]
    for steps, envs in shapes:
        g = torch.Generator().manual_seed(0)
        rewards = torch.randn(steps, envs, generator=g)
        dones = torch.rand(steps, envs, generator=g) < 0.02
        time_outs = dones & (torch.rand(steps, envs, generator=g) < 0.5)
        dones, time_outs = dones.to(torch.uint8), time_outs.to(torch.uint8)
        bound = steps * envs * BYTES_PER_ELEMENT / bandwidth
        out = NStep(*(torch.empty(steps, envs, dtype=dtype) for dtype in _DTYPES))
        paths = [("compiled", nstep_returns)] if kernel() is not None else []
        if kernel() is not None:
            paths.append(("out=", lambda *a, timeouts="final-value", o=out: nstep_returns(*a, out=o)))
        for name, fn in [*paths, ("torch", nstep_torch)]:
            seconds = best_time(lambda f=fn, r=rewards, d=dones, o=time_outs: f(r, d, args.n, 0.99, o), repeats)
            print(
                f"T={steps:>6} N={envs:>5} K={args.n} {name:>8}: {seconds * 1e3:8.2f} ms, bound {bound * 1e3:6.2f} ms,"
                f" {seconds / bound:5.1f}x of the bound"
            )


if __name__ == "__main__":
    main()
