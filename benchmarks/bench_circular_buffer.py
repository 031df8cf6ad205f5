"""CircularBuffer throughput: appends/s and reads/s (default batch 4096, entry [48], max_len 10, CPU).

Run: ``python benchmarks/bench_circular_buffer.py [--batch 4096] [--dim 48] [--max-len 10] [--device cpu]``;
``--quick`` for a smoke run (short timings).

Cases:
* ``append`` — steady state (no env reset since the last append): one [batch, dim] copy.
* ``append + reset 2%`` — ``reset(ids)`` of 2% of the envs then ``append``: zero + fill only those envs
  (the remembered reset indices; compare with the ``torch.where`` fill below, which the buffer falls back to).
* ``append after load_state_dict`` — the ``torch.where`` fill over the whole history.
* ``getitem`` — ``buffer[key]`` with random keys in [0, max_len).
* ``buffer`` — the [batch, max_len, dim] oldest-to-newest copy.
* ``mini_batch_generator`` — one call, fetch_length = max_len, 4 mini-batches, 1 epoch.

"x of bound" compares the time with the bytes the operation must move at the measured streaming bandwidth.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bandwidth import measure_bandwidth

from rolloutcli.core.circular_buffer import CircularBuffer


def rate(fn: Callable[[], object], device: torch.device, seconds: float = 0.5, repeats: int = 5) -> float:
    """Best calls per second of ``fn`` over ``repeats`` timed runs of about ``seconds`` each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(20):
        fn()
    sync()
    start = time.perf_counter()
    calls = 0
    while time.perf_counter() - start < 0.1:
        fn()
        calls += 1
    sync()
    per_run = max(1, int(calls * seconds / (time.perf_counter() - start)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(per_run):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / per_run)
    return 1.0 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=48)
    parser.add_argument("--max-len", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    parser.add_argument("--quick", action="store_true", help="smoke run: short timings")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    batch, dim, max_len = args.batch, args.dim, args.max_len
    entry_bytes = batch * dim * 4
    bandwidth = measure_bandwidth(0.25) if device.type == "cpu" and not args.quick else None
    timing = (0.02, 1) if args.quick else (0.5, 5)  # seconds per timed run, runs

    gen = torch.Generator(device=device).manual_seed(0)
    data = torch.randn(batch, dim, device=device, generator=gen)
    buf = CircularBuffer(max_len, batch, device)
    for _ in range(max_len):
        buf.append(data)
    key = torch.randint(0, max_len, (batch,), device=device, generator=gen)
    reset_ids = torch.randperm(batch, device=device, generator=gen)[: max(1, batch // 50)]
    restored = CircularBuffer(max_len, batch, device)
    state = buf.state_dict()

    def append_after_load() -> None:
        restored.load_state_dict(state)
        restored.append(data)

    def reload_only() -> None:
        restored.load_state_dict(state)

    def reset_and_append() -> None:
        buf.reset(reset_ids)
        buf.append(data)

    def one_sampling_epoch() -> None:
        for _ in buf.mini_batch_generator(max_len, 4, num_epochs=1, generator=gen):
            pass

    history_bytes = max_len * entry_bytes
    cases: list[tuple[str, Callable[[], object], int]] = [
        ("append", lambda: buf.append(data), 2 * entry_bytes),
        ("append + reset 2%", reset_and_append, 2 * entry_bytes),
        ("getitem", lambda: buf[key], 2 * entry_bytes),
        ("buffer (full copy)", lambda: buf.buffer, 2 * history_bytes),
        ("mini_batch_generator epoch", one_sampling_epoch, 4 * history_bytes),
    ]
    print(f"CircularBuffer on {device}: batch {batch}, entry [{dim}] float32, max_len {max_len}, ", end="")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if bandwidth:
        print(f"streaming bandwidth: {bandwidth / 1e9:.1f} GB/s")
    print(f"{'case':32s} {'calls/s':>12s} {'us/call':>10s} {'x of bound':>11s}")
    for name, fn, moved in cases:
        calls = rate(fn, device, *timing)
        bound = f"{bandwidth / moved / calls:11.1f}" if bandwidth else f"{'-':>11s}"
        print(f"{name:32s} {calls:12,.0f} {1e6 / calls:10.1f} {bound}")
    # The where-fill path: time (load_state_dict + append) minus load_state_dict alone.
    both, load = rate(append_after_load, device, *timing), rate(reload_only, device, *timing)
    extra_us = max(0.0, 1e6 / both - 1e6 / load)
    print(f"{'append after load_state_dict':32s} {'':>12s} {extra_us:10.1f} {'(where fill)':>11s}")


if __name__ == "__main__":
    main()
