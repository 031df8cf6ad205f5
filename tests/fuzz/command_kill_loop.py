"""SIGKILL of the command itself at random moments: every process it started must end within 5 s and its stderr
close (not part of CI; its small version: tests/test_command_killed.py).

    python tests/fuzz/command_kill_loop.py --kills 50 [--files 24] [--seed N] [--engine local|ray]

Each round starts ``gae`` or ``batch`` (alternately) with ``--workers 2`` on a dataset (``--engine ray``: a local
cluster the command starts itself) and SIGKILLs the command alone a random delay after its start, within the time
an unkilled run takes. Then it counts the processes of the command (found by an environment variable only the
command was given) still running 5 s later, and whether a pipe reading the command's stderr reached its end
(a run that ended before its kill is counted apart).
Prints each round and the totals; exits 1 when a process was left or a stream stayed open.
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from rollout_factory import rollout_arrays, write_rollout  # noqa: E402
from test_command_killed import Killed  # noqa: E402

PROMISE_S = 5.0
BATCH = ["-m", "4", "--epochs", "2", "--max-memory", "64K"]


def prepare(root: Path, files: int, engine: list[str]) -> dict[str, tuple[list[str], float]]:
    """Each command's argv (less ``-o``) and how long an unkilled run of it takes (its window)."""
    runs = root / "runs"
    runs.mkdir()
    for i in range(files):
        write_rollout(runs / f"r{i:03d}.h5", rollout_arrays(T=64 + 8 * (i % 3), N=8, seed=i))
    subprocess.run([sys.executable, "-m", "rolloutcli", "gae", str(runs), "-o", str(root / "gae")], check=True)
    commands = {"gae": ["gae", str(runs), *engine], "batch": ["batch", str(root / "gae"), *BATCH, *engine]}
    windows = {}
    for name, argv in commands.items():
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "rolloutcli", *argv, "-o", str(root / f"timed-{name}"), "-q"], check=True)
        windows[name] = (argv, time.monotonic() - start)
    return windows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--files", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=["local", "ray"], default="local")
    options = parser.parse_args()
    engine = ["--workers", "2"] if options.engine == "local" else ["--engine", "ray"]
    rng = random.Random(options.seed)
    root = Path(tempfile.mkdtemp(prefix="rolloutcli-command-kills-"))
    left_total = open_total = ended = 0
    try:
        windows = prepare(root, options.files, engine)
        for i in range(options.kills):
            name = ("gae", "batch")[i % 2]
            argv, window = windows[name]
            out = root / f"out-{i:04d}"
            delay = rng.uniform(0, 0.8 * window)  # an unkilled run's time varies: most kills land mid-run
            run = Killed([*argv, "-o", str(out), "-q"])
            at = time.monotonic() + delay
            if not run.when(lambda run, at=at: time.monotonic() >= at):
                print(f"round {i}: {name}: ended before the kill at {delay:.2f} s", flush=True)
                ended += 1
            run.kill(settle=PROMISE_S)
            left_total += len(run.left)
            open_total += not run.closed
            verdict = "ok" if not run.left and run.closed else f"LEFT {run.left}, stderr closed: {run.closed}"
            print(f"round {i}: {name} killed at {delay:.2f} s: {verdict}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out.parent / f".{out.name}.rolloutcli-partial", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"processes left {PROMISE_S:.0f} s after {options.kills} random SIGKILLs: {left_total}")
    print(f"runs that had ended before their kill: {ended}")
    print(f"stderr streams still open {PROMISE_S:.0f} s after the kill: {open_total}")
    return 1 if left_total or open_total else 0


if __name__ == "__main__":
    sys.exit(main())
