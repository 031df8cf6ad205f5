"""The memory-bandwidth limit, measured in the same run as the benchmark that is compared with it.

Same idea as ``shared/tools/bandwidth.py``: the best read+write streaming rate of torch ``copy_`` and
``add(out=)`` on arrays far larger than the caches. "x of the bound" = time / (bytes moved / bandwidth).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_time(fn: Callable[[], object], repeats: int = 7, warmup: int = 1) -> float:
    """Minimum wall time of ``fn`` over ``repeats`` runs after ``warmup`` runs (seconds)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(gib: float = 0.5, repeats: int = 7) -> float:
    """Return the machine's streaming limit in bytes per second (read + write bytes counted)."""
    n = int(gib * (1 << 30)) // 4
    a = torch.ones(n)
    b = torch.ones(n)
    c = torch.empty(n)
    copy_s = best_time(lambda: c.copy_(a), repeats)
    add_s = best_time(lambda: torch.add(a, b, out=c), repeats)
    return max(2 * 4 * n / copy_s, 3 * 4 * n / add_s)
