"""Byte-mutation fuzzing (README, promises): mutants of a compressed, checksummed file through every command.

2,000 seeded mutants (gzip + shuffle + fletcher32, small chunks; 70% of the edits land in the HDF5 metadata)
run in child processes (``fuzzing.run_fuzz``, two at once where there are two cores); mutant ``i`` goes
through ``COMMANDS[i % len(COMMANDS)]``. The promise: only ``RolloutError`` ends a run, no child dies by a
signal or hangs, and every failure leaves one ``error:`` line, no output, no temporary file and the input
unchanged. Longer runs: ``tests/fuzz/run_fuzz.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

from fuzzing import run_fuzz
from promises import COMMANDS, make_input, repack

SEED = 20260407
MUTANTS = 2000
CHECKSUMMED = {"compression": "gzip", "shuffle": True, "fletcher32": True, "chunks": "thirds"}


def fuzz_bases(folder: Path) -> dict[str, Path]:
    """One compressed, checksummed base file per kind of input the commands read."""
    bases = {}
    for source in sorted({command.source for command in COMMANDS.values()}):
        bases[source] = repack(
            make_input(source, folder / f"base-{source}.h5", T=24, N=4, end_rate=0.25, hidden="lstm"), **CHECKSUMMED
        )
    return bases


def fuzz_commands() -> list[dict]:
    return [
        {
            "name": name,
            "argv": command.argv("{src}", "{dst}", "--max-memory", "4K"),
            "source": command.source,
            "writes": command.writes,
            "in_place": command.in_place,
            **({"output": command.name.replace("out", "o{index}", 1)} if command.name else {}),
        }
        for name, command in COMMANDS.items()
    ]


def test_mutants_fail_cleanly(tmp_path: Path) -> None:
    report = run_fuzz(
        fuzz_bases(tmp_path),
        fuzz_commands(),
        count=MUTANTS,
        seed=SEED,
        timeout=30,
        workers=min(2, os.cpu_count() or 1),
        workdir=tmp_path,
    )
    print(report.summary())  # pytest -s shows the figures
    assert len(report.results) == MUTANTS
    assert report.problems == [], "\n".join(report.problems[:20])
    codes = {r["code"] for r in report.results}
    assert codes <= {0, 1, 3, 4}, codes  # 2 (usage) cannot come from a file
    assert 0 in codes and 1 in codes  # the mutants do reach both sides
