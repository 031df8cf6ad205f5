"""A long byte-mutation fuzz run of every rolloutcli command (not part of CI; the CI test runs 2,000 mutants).

    python tests/fuzz/run_fuzz.py --count 20000 --workers 2 [--seed N] [--keep DIR] [--json FIGURES.json]

Uses the same bases, commands and checks as ``tests/test_promises_fuzz.py``: mutant ``i`` (seeded by
``(seed, i)``, so any mutant can be rebuilt) goes through ``COMMANDS[i % len(COMMANDS)]`` in a child process;
a crash or a hang of the child is recorded and a new child continues. Prints mutants/s and the outcome
counts; exits 1 when any mutant broke a promise. ``--keep DIR`` saves those mutants for reproduction.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

import numpy as np  # noqa: E402
from fuzzing import metadata_ranges, mutate, run_fuzz  # noqa: E402
from test_promises_fuzz import SEED, fuzz_bases, fuzz_commands  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="save the mutants that broke a promise here")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rolloutcli-fuzz-") as scratch:
        workdir = Path(scratch)
        bases = fuzz_bases(workdir)
        commands = fuzz_commands()
        report = run_fuzz(
            bases, commands, count=args.count, seed=args.seed, workers=args.workers, timeout=30, workdir=workdir
        )
        print(report.summary())
        bad = [r for r in report.results if r["problems"]]
        for result in bad[:50]:
            print(f"  mutant {result['index']}: {result['problems']}")
        if args.keep and bad:
            args.keep.mkdir(parents=True, exist_ok=True)
            for result in bad:
                index = result["index"]
                command = commands[index % len(commands)]
                base = bases[command["source"]]
                data = mutate(base.read_bytes(), np.random.default_rng([args.seed, index]), metadata_ranges(base))
                (args.keep / f"mutant-{index}-{command['name'].replace(' ', '_')}.h5").write_bytes(data)
        if args.json:
            figures = {
                "count": len(report.results),
                "seconds": report.seconds,
                "mutants_per_second": len(report.results) / report.seconds,
                "restarts": report.restarts,
                "outcomes": dict(report.outcomes()),
                "problems": report.problems,
            }
            args.json.write_text(json.dumps(figures, indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
