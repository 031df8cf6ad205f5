"""Split-and-pad: RSL-RL's ``split_and_pad_trajectories`` vs rolloutcli's vectorised scatter.

Observations ``[T, N, 48]`` float32, dones drawn at a fixed episode end rate. For each shape:

- ``rsl``: ``rsl_rl.utils.split_and_pad_trajectories`` (fresh output; skipped when its output would pass
  6 GB, so that both outputs fit in memory);
- ``fresh``: ``rolloutcli...split_and_pad_trajectories`` (plan + fresh zeroed output + masks), same output;
- ``reuse``: ``scatter_into_trajectories`` into a preallocated buffer with ``zero=True`` (memset + scatter);
- ``reuse+clear``: ``zero=False`` scatter then ``clear_trajectories`` (the streaming steady state: only the
  T * N valid rows are touched, twice);
- ``plan``: ``plan_trajectories`` alone (paid once per block, shared by every field).

Also the ``longest`` layout (L = longest trajectory), which needs far less memory at high end rates.
Every time is the minimum over interleaved rounds, and ratios come from the same run. The floor of issue 11
(split API at 24 x 4096 at least 4x RSL-RL's) is printed last.
Run: ``python benchmarks/bench_split.py [--rounds 3]``; ``--quick`` for a smoke run (24 x 4096 only, 1 round).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _bandwidth import best_time, measure_bandwidth
from rsl_rl.utils import split_and_pad_trajectories as rsl_split

from rolloutcli.core.trajectories import (
    clear_trajectories,
    plan_trajectories,
    scatter_into_trajectories,
    split_and_pad_trajectories,
)

FEATURES = 48
RSL_LIMIT_BYTES = 6e9
LARGE = [(24, 4096, 50), (24, 4096, 5), (1000, 1024, 50), (1000, 1024, 5)]
SMALL = [(1, 1, 5), (1, 64, 5), (2, 2, 5), (4, 8, 5), (8, 16, 5), (24, 1, 5), (100, 1, 50), (1000, 1, 50), (24, 64, 5)]
SMALL += [(24, 256, 50)]


def make_case(num_steps: int, num_envs: int, one_in: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dones = torch.rand(num_steps, num_envs, generator=g) < 1.0 / one_in
    x = torch.randn(num_steps, num_envs, FEATURES, generator=g)
    return x, dones


def interleaved_min(fns: dict[str, object], rounds: int, repeats: int) -> dict[str, float]:
    """Min time of each function over ``rounds`` interleaved rounds of ``best_time(fn, repeats)``."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], best_time(fn, repeats))  # type: ignore[arg-type]
    return best


def fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3f}" if seconds < 0.01 else f"{seconds * 1e3:.1f}"


def gbps(nbytes: int, seconds: float | None) -> str:
    return "-" if seconds is None else f"{nbytes / seconds / 1e9:.1f}"


def bench_large(num_steps: int, num_envs: int, one_in: int, rounds: int) -> list[str]:
    x, dones = make_case(num_steps, num_envs, one_in)
    in_bytes = x.numel() * x.element_size()
    rows = []
    for layout in ("rollout", "longest"):
        plan = plan_trajectories(dones, pad_to=layout)
        out_bytes = plan.padded_length * plan.num_trajectories * FEATURES * 4
        blowup = out_bytes / in_bytes
        label = f"{num_steps} x {num_envs}, 1/{one_in}, {layout}"
        if out_bytes > RSL_LIMIT_BYTES:
            rows.append(
                f"| {label} | {plan.num_trajectories} | {plan.padded_length} | {blowup:.1f}x "
                f"| skipped: output {out_bytes / 1e9:.0f} GB | | | | | | |"
            )
            continue
        repeats = 2 if out_bytes > 1e9 else 5
        fns: dict[str, object] = {}
        if layout == "rollout":
            # Same output as RSL-RL, checked once before timing (then freed: the big case holds 4 GB each).
            expected, expected_masks = rsl_split(x, dones)
            padded, masks = split_and_pad_trajectories(x, dones)
            assert torch.equal(padded, expected) and torch.equal(masks, expected_masks), label
            del expected, expected_masks, padded, masks
            gc.collect()
            fns["rsl"] = lambda: rsl_split(x, dones)
        fns["fresh"] = lambda layout=layout: split_and_pad_trajectories(x, dones, pad_to=layout)
        buffer = torch.zeros(plan.padded_length, plan.num_trajectories, FEATURES)
        fns["reuse"] = lambda plan=plan, buffer=buffer: scatter_into_trajectories(x, plan, buffer)

        def reuse_clear(plan=plan, buffer=buffer) -> None:
            scatter_into_trajectories(x, plan, buffer, zero=False)
            clear_trajectories(buffer, plan)

        fns["reuse+clear"] = reuse_clear
        fns["plan"] = lambda layout=layout: plan_trajectories(dones, pad_to=layout)
        t = interleaved_min(fns, rounds, repeats)
        rsl = t.get("rsl")
        speedup = "-" if rsl is None else f"{rsl / t['fresh']:.1f}x / {rsl / t['reuse']:.1f}x"
        rows.append(
            f"| {label} | {plan.num_trajectories} | {plan.padded_length} | {blowup:.1f}x "
            f"| {fmt_ms(rsl)} | {fmt_ms(t['fresh'])} | {fmt_ms(t['reuse'])} | {fmt_ms(t['reuse+clear'])} "
            f"| {fmt_ms(t['plan'])} "
            f"| {speedup} "
            f"| {gbps(in_bytes, rsl)} / {gbps(in_bytes, t['fresh'])} / {gbps(in_bytes, t['reuse'])} "
            f"/ {gbps(in_bytes, t['reuse+clear'])} |"
        )
        del buffer, fns
        gc.collect()
    return rows


def bench_small(num_steps: int, num_envs: int, one_in: int, rounds: int) -> str:
    x, dones = make_case(num_steps, num_envs, one_in)
    t = interleaved_min(
        {"rsl": lambda: rsl_split(x, dones), "fresh": lambda: split_and_pad_trajectories(x, dones)}, rounds, 200
    )
    return (
        f"| {num_steps} x {num_envs}, 1/{one_in} | {t['rsl'] * 1e6:.1f} | {t['fresh'] * 1e6:.1f} "
        f"| {t['rsl'] / t['fresh']:.2f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each time is the min over them")
    parser.add_argument("--skip-large", action="store_true", help="only the small shapes")
    parser.add_argument("--quick", action="store_true", help="smoke run: 24 x 4096 only, one round")
    args = parser.parse_args()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, obs {FEATURES} float32")
    if args.quick:
        print(floor_ratio(rounds=1, repeats=2))
        return
    print(f"streaming bandwidth (read + write): {measure_bandwidth() / 1e9:.1f} GB/s")
    if not args.skip_large:
        print()
        print(
            "| T x N, end rate, layout | M | L | out/in | RSL-RL ms | fresh ms | reuse ms | reuse+clear ms | plan ms "
            "| RSL / fresh, / reuse | input GB/s: RSL / fresh / reuse / reuse+clear |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for shape in LARGE:
            for row in bench_large(*shape, rounds=args.rounds):
                print(row, flush=True)
    print()
    print("| T x N, end rate | RSL-RL us | fresh us | RSL / fresh |")
    print("|---|---|---|---|")
    for shape in SMALL:
        print(bench_small(*shape, rounds=args.rounds), flush=True)
    print()
    print(floor_ratio(rounds=args.rounds, repeats=5))


def floor_ratio(rounds: int, repeats: int) -> str:
    """Issue 11's floor: the split API at 24 x 4096 (both end rates) against RSL-RL's, at least 4x."""
    parts = []
    for one_in in (50, 5):
        x, dones = make_case(24, 4096, one_in)
        fns = {
            "rsl": lambda x=x, dones=dones: rsl_split(x, dones),
            "ours": lambda x=x, dones=dones: split_and_pad_trajectories(x, dones),
        }
        t = interleaved_min(fns, rounds, repeats)
        parts.append(f"1/{one_in}: {t['rsl'] / t['ours']:.1f}x")
    return "split API at 24 x 4096, RSL-RL time / rolloutcli time (floor 4x): " + ", ".join(parts)


if __name__ == "__main__":
    main()
