"""A dataset run's progress record: the cost per finished file at 1,000 and 10,000 files done, and the end.

- ``rewrite``: the previous design, reproduced (``dataset.json`` of every entry so far, ``json.dumps`` and written
  through ``atomic_file`` after each file: 18 ms at 1,000 entries, 152 ms at 10,000 when it was replaced).
- ``journal``: ``Journal.add`` (one line appended and flushed) with that many entries already in the journal.
- ``compact``: the journal read back in input order into ``dataset.json`` once, at the end.

Entries as a real run's: an input path of ~40 characters, names ``run/it_00000.h5``. Goal: the journal's cost per
file flat in the files done. The load average is printed.

Usage: python benchmarks/bench_journal.py [--folder F] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from rolloutcli.hdf5.atomic import atomic_file
from rolloutcli.pipeline.dataset_job import DATASET_FORMAT, DATASET_VERSION
from rolloutcli.pipeline.dataset_journal import Journal

HEAD = {"format": DATASET_FORMAT, "format_version": DATASET_VERSION, "command": "gae", "options": {"gamma": 0.99}}


def entry(i: int) -> dict:
    name = f"run/it_{i:05d}.h5"
    output = {"name": name, "size_bytes": 40_000 + i, "xxh3_128": secrets.token_hex(16)}
    source = {"path": f"/data/rollouts/{name}", **output, "xxh3_128": secrets.token_hex(16)}
    return {"input": source, "output": output}


def load() -> str:
    return "load " + " ".join(open("/proc/loadavg").read().split()[:3])


def rewrite(folder: Path, done: int, repeats: int) -> list[float]:
    """The previous design: the whole record rewritten after the file that makes ``done``."""
    entries = [entry(i) for i in range(done)]
    record = {**HEAD, "inputs": [e["input"] for e in entries], "outputs": [e["output"] for e in entries]}
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        with atomic_file(folder / "dataset.json", overwrite=True) as tmp:
            Path(tmp).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        times.append(time.perf_counter() - started)
    return times


def journal(folder: Path, done: int, repeats: int) -> tuple[list[float], float]:
    """``Journal.add`` for the files after the first ``done`` (already journaled), and the compaction."""
    record = Journal(folder, HEAD, done + repeats)
    record.start((i, entry(i)) for i in range(done))
    times = []
    for i in range(done, done + repeats):
        line = entry(i)
        started = time.perf_counter()
        record.add(i, line)
        times.append(time.perf_counter() - started)
    started = time.perf_counter()
    record.compact()
    return times, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.folder) as scratch:
        for done in (1_000, 10_000):
            folder = Path(scratch) / f"n{done}"
            os.mkdir(folder)
            old = rewrite(folder, done, max(10, args.repeats // 10))
            new, compact = journal(folder, done, args.repeats)
            print(
                f"{done} files done: rewrite {statistics.median(old) * 1e3:.1f} ms a file (median of {len(old)}); "
                f"journal {statistics.median(new) * 1e6:.1f} us a file (median of {len(new)}, max "
                f"{max(new) * 1e6:.0f} us); compaction of {done + len(new)} lines {compact * 1e3:.0f} ms; {load()}",
                flush=True,
            )


if __name__ == "__main__":
    main()
