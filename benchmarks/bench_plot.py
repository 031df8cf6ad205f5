"""``rolloutcli plot`` on a ~1 GB rollout: time and peak RSS with ``--max-memory 256M`` (issue 16: < 1 GB).

Run: ``python benchmarks/bench_plot.py [--folder DIR] [--gigabytes 1] [--keep]``. The reference is a plot of a tiny
file in the same run (the fixed cost: Python, matplotlib, the figure), so the difference is what the data costs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_commands import child_peak_rss, make_rollout

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/rolloutcli-bench-plot"))
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--max-memory", default="256M")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    N = 1024
    T = max(1, int(args.gigabytes * 1e9 / (N * 600)))
    big, tiny = args.folder / "big.h5", args.folder / "tiny.h5"
    size = make_rollout(big, T, N, 1 / 50)
    make_rollout(tiny, 8, 4, 1 / 5)
    try:
        cmd = [sys.executable, "-m", "rolloutcli", "plot"]
        tiny_s, tiny_rss = child_peak_rss([*cmd, str(tiny), "-o", str(args.folder / "tiny.png"), "--overwrite"])
        big_s, big_rss = child_peak_rss(
            [*cmd, str(big), "-o", str(args.folder / "big.png"), "--max-memory", args.max_memory, "--overwrite"]
        )
        print(f"tiny file: {tiny_s:.2f} s, peak RSS {tiny_rss / MIB:.0f} MiB")
        print(
            f"{size / 1e9:.2f} GB file (T={T}, N={N}), --max-memory {args.max_memory}: {big_s:.2f} s, "
            f"peak RSS {big_rss / MIB:.0f} MiB ({(big_rss - tiny_rss) / MIB:+.0f} MiB over the tiny file; goal < 1024)"
        )
    finally:
        if not args.keep:
            shutil.rmtree(args.folder, ignore_errors=True)


if __name__ == "__main__":
    main()
