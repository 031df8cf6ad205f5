"""Kill loops: workers and nodes lost at random moments (not part of CI; its small versions are in the suite:
tests/test_engine_stops.py kills a pool worker mid-unit, tests/test_engine_nodes.py loses a node mid-unit).

    python tests/fuzz/kill_loop.py --rounds 20 [--engine local|ray|both] [--command gae|batch|both] [--seed N]

Each round runs ``python -m rolloutcli`` on a dataset in a child process and, after a random delay within the
command's usual time, SIGKILLs one worker of its local pool (``--workers 2``; the delay counted from the pool's
start), or removes a node of a Ray cluster on this machine without grace (a node added for the round; the
cluster's head and second node stay). The command must end with the bytes of ``--workers 1``, or exit 3 and then
``--resume`` (``batch``: a rerun) must; no process of the command (nor any of the lost node's) may be left.
Prints each round's outcome and the counts; exits 1 when a round broke a promise. Keep the machine otherwise
idle: the cluster's nodes have one CPU each.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from rollout_factory import rollout_arrays, write_rollout  # noqa: E402
from test_engine_stops import _descendants, _still_running  # noqa: E402

# batch: 16 shards of ~35 KB, each within the 64K budget (a shard larger than it is refused), many blocks per file
ARGS = {"gae": [], "batch": ["-m", "16", "--epochs", "2", "--max-memory", "64K"]}
STORE = 80 * 2**20


def rolloutcli(*args: object, **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutcli", *map(str, args), "-q"], capture_output=True, **kwargs)


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def prepare(root: Path, files: int, engines: dict[str, list[str]]) -> tuple[dict, dict]:
    """Inputs; each command's source and reference bytes (one worker); the window of each engine and command:
    how long a run takes from the pool's start (local) or the command's (ray)."""
    runs = root / "runs"
    runs.mkdir()
    for i in range(files):
        write_rollout(runs / f"r{i:03d}.h5", rollout_arrays(T=64 + 8 * (i % 3), N=8, seed=i))
    references, windows = {}, {}
    for command, source in (("gae", runs), ("batch", root / "ref-gae")):
        done = rolloutcli(command, source, "-o", root / f"ref-{command}", *ARGS[command])
        assert done.returncode == 0, done.stderr
        references[command] = (source, tree(root / f"ref-{command}"))
        for engine, extra in engines.items():
            child = _start(command, source, root / f"{engine}-{command}", extra)
            if engine == "local":
                _pool_started(child)
            start = time.monotonic()
            _wait(child)
            assert child.returncode == 0 and tree(root / f"{engine}-{command}") == references[command][1]
            windows[engine, command] = time.monotonic() - start
    return references, windows


def _pool_started(child: subprocess.Popen) -> None:
    """Wait until the command's pool has a worker (after its imports and planning), or the command ended."""
    while child.poll() is None and not pool_workers(child.pid):
        time.sleep(0.02)


def pool_workers(driver: int) -> list[int]:
    """The local pool's workers: children of the process server (itself a child of the driver)."""
    servers = _children(driver)
    return [pid for server in servers for pid in _children(server) if "forkserver" in _cmdline(pid)]


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def _start(command: str, source: Path, out: Path, engine: list[str]) -> subprocess.Popen:
    """The command in a session of its own, its stderr in ``out``'s ``.err`` file (a round's diagnosis)."""
    with open(out.with_suffix(".err"), "wb") as err:
        argv = [sys.executable, "-m", "rolloutcli", command, str(source), "-o", str(out), *ARGS[command], "-q"]
        return subprocess.Popen([*argv, *engine], stderr=err, start_new_session=True)


def local_round(rng: random.Random, command: str, source: Path, out: Path, seconds: float) -> tuple:
    """Start the command on a pool of 2, SIGKILL one worker a random delay after the pool started; what it ended
    with, and what of its processes it left."""
    child = _start(command, source, out, ["--workers", "2"])
    _pool_started(child)
    time.sleep(rng.uniform(0, seconds))
    started = _descendants(child.pid)
    workers = pool_workers(child.pid)
    if workers:
        os.kill(rng.choice(workers), signal.SIGKILL)
    _wait(child)
    what = "killed a worker" if workers else "no worker left to kill"
    return f"{what}, exit {child.returncode}", child.returncode, _still_running(started)


def ray_round(rng: random.Random, cluster: Any, command: str, source: Path, out: Path, seconds: float) -> tuple:
    """Start the command on the cluster with a node added for the round, remove that node after a random delay."""
    node = cluster.add_node(num_cpus=1, object_store_memory=STORE)
    cluster.wait_for_nodes()
    child = _start(command, source, out, ["--engine", "ray", "--address", cluster.address])
    time.sleep(rng.uniform(0, seconds))
    started = _descendants(child.pid)
    pids = map(int, filter(str.isdigit, os.listdir("/proc")))
    lost = [pid for pid in pids if node.raylet_socket_name in _cmdline(pid)]  # its raylet and workers
    cluster.remove_node(node, allow_graceful=False)
    _wait(child)
    return f"node lost, exit {child.returncode}", child.returncode, _still_running(started | set(lost))


def _wait(child: subprocess.Popen) -> None:
    try:
        child.wait(timeout=300)
    finally:
        if child.poll() is None:  # hung: a broken promise, reported by its exit code (-9)
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def check(command: str, source: Path, out: Path, reference: dict, said: str, code: int, engine: list) -> str | None:
    """None when the round kept its promises, else what broke."""
    if code == 3:
        resume = ["--resume"] if command == "gae" else []  # batch: nothing to resume, a rerun
        again = rolloutcli(command, source, "-o", out, *ARGS[command], *engine, *resume)
        if again.returncode != 0:
            return f"{said}; the rerun exited {again.returncode}: {again.stderr.decode()[-300:]}"
    elif code != 0:
        return f"{said}: expected exit 0 or 3"
    if not out.is_dir() or tree(out) != reference:
        return f"{said}: the outputs differ from one worker's"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--engine", choices=["local", "ray", "both"], default="both")
    parser.add_argument("--command", choices=["gae", "batch", "both"], default="both")
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    commands = ["gae", "batch"] if options.command == "both" else [options.command]
    root = Path(tempfile.mkdtemp(prefix="rolloutcli-kill-loop-"))
    cluster = None
    try:
        engines: dict[str, list[str]] = {}
        if options.engine in ("local", "both"):
            engines["local"] = ["--workers", "2"]
        if options.engine in ("ray", "both"):
            cluster = start_cluster()
            engines["ray"] = ["--engine", "ray", "--address", cluster.address]
        references, windows = prepare(root, options.files, engines)
        return loop(options.rounds, random.Random(options.seed), root, references, windows, engines, commands, cluster)
    finally:
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def start_cluster() -> Any:
    """A head and a second node of one CPU (``tests/conftest.py``'s cluster), lost nodes seen in ~2 s."""
    from ray.cluster_utils import Cluster

    lost = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
    head = {"num_cpus": 1, "object_store_memory": STORE, "include_dashboard": False, "_system_config": lost}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.add_node(num_cpus=1, object_store_memory=STORE)
    return cluster


def loop(
    rounds: int,
    rng: random.Random,
    root: Path,
    references: dict,
    windows: dict,
    engines: dict,
    commands: list,
    cluster: Any,
) -> int:
    counts: Counter[str] = Counter()
    broken = 0
    for i in range(rounds):
        engine, command = list(engines)[i % len(engines)], commands[(i // len(engines)) % len(commands)]
        (source, reference), window = references[command], windows[engine, command]
        out = root / f"out-{i:04d}"
        if engine == "local":
            said, code, left = local_round(rng, command, source, out, window)
        else:
            said, code, left = ray_round(rng, cluster, command, source, out, window)
        problem = check(command, source, out, reference, said, code, engines[engine])
        if left:
            problem = f"{said}: processes left: {left}"
        counts[f"{engine} {command}: {said}"] += 1
        broken += problem is not None
        print(f"round {i}: {engine} {command}: {said}: {problem or 'ok'}", flush=True)
        if problem:
            print(out.with_suffix(".err").read_text(errors="replace")[-2000:], flush=True)
        shutil.rmtree(out, ignore_errors=True)
    for outcome, count in sorted(counts.items()):
        print(f"{count:5d}  {outcome}")
    print(f"{broken} of {rounds} rounds broke a promise")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
