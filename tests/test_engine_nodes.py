"""The Ray engine on a cluster of several nodes on this machine (conftest's ``ray_cluster``: two nodes of one CPU).

Units land on every node and give the bytes of one local worker (``gae``, ``batch``); a task whose worker dies,
or whose node is lost mid-write, is retried to the same bytes; ``--address`` names the cluster or fails in one
line. A node is lost as a machine is: ``Cluster.remove_node`` without grace (SIGKILL to its raylet and workers),
on a node the test added, so the shared cluster keeps its two nodes for the tests after it.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import test_engines
from test_engine_stops import _still_running
from test_engines import OPTIONS, RUN, dying_once, gae_files, run, tree

from rolloutcli.errors import RolloutError
from rolloutcli.hdf5.atomic import TEMP_MARKER
from rolloutcli.pipeline import engine, ray_connect
from rolloutcli.pipeline.dataset_job import partial_folder
from rolloutcli.pipeline.engine import EngineOptions
from rolloutcli.pipeline.gae import run_gae

STORE = 80 * 2**20  # the object store of a node a test adds


@pytest.fixture
def ray_cluster(ray_cluster):
    """The session's two-node cluster (conftest), with the units of these tests pickled by value for its workers
    (they do not import the test modules)."""
    ray, address = ray_cluster
    for module in (sys.modules[__name__], test_engines):
        ray.cloudpickle.register_pickle_by_value(module)
    return ray, address


runs = test_engines.runs  # the same four files as test_engines' tests (a fixture)


def on_nodes(log: Path, doomed: str = "") -> Callable[..., Any]:
    """``engine._call`` for Ray's tasks that appends the task's node to ``log``, then waits (30 s at most) until
    units run on two nodes at once (each node has one CPU), so the check that units land on several nodes does
    not depend on how soon a node asks for the next task.

    With ``doomed`` (a node's id) the units elsewhere wait instead until one runs on that node. There it pauses
    mid-write (the test hook of a dataset's units), after writing its pid and the temporaries it is writing to
    ``log``'s ``.doomed`` file."""

    def call(fn: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str]) -> Any:
        import ray

        from rolloutcli.hdf5.atomic import live_temporaries
        from rolloutcli.pipeline import engine as real
        from rolloutcli.pipeline import progress

        node = ray.get_runtime_context().get_node_id()
        with open(log, "a") as handle:
            handle.write(f"{node}\n")
        marker = log.with_suffix(".doomed")
        if node == doomed:

            def announce(seconds: float) -> None:
                marker.write_text(" ".join([str(os.getpid()), *live_temporaries()]))
                time.sleep(seconds)

            progress.pause_for_test = announce
            return real._call(fn, args, {**env, progress.TEST_PAUSE_ENV: "120"})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (marker.exists() if doomed else len(nodes_used(log)) > 1):
            time.sleep(0.05)
        return real._call(fn, args, env)

    return call


def dying_once_after_writing(marker: Path, src: Path, out: Path) -> dict:
    """A unit whose process dies the first time it runs once it wrote its output (as a node lost before the
    result came back), then does its work again."""
    result = run_gae(src, out, OPTIONS, RUN)
    if src.name == "r1.h5" and not marker.exists():
        marker.write_text("died once")
        os._exit(1)
    return result


def failing_while_another_runs(folder: Path, src: Path, out: Path, stubborn: bool = False) -> dict:
    """r0's unit fails (exit 1) once r1's has started; r1's waits (60 s), noting in ``folder`` when it ends and,
    in ``r1.pid``, its process. ``stubborn``: r1's ignores the interrupt (as a unit inside a C call would)."""
    if src.name == "r1.h5":
        if stubborn:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        (folder / "r1.pid").write_text(str(os.getpid()))
        (folder / "r1.started").touch()
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            (folder / "r1.ended").touch()
    if src.name == "r0.h5":
        while not (folder / "r1.started").exists():
            time.sleep(0.05)
        raise RolloutError(f"{src}: injected failure.", exit_code=1)
    return run_gae(src, out, OPTIONS, RUN)


def nodes_used(log: Path) -> set[str]:
    return set(log.read_text().split())


def alive(ray: Any) -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_ray_two_nodes_same_bytes_and_a_dying_task_retried(
    ray_cluster, runs: Path, tmp_path: Path, monkeypatch
) -> None:
    ray, _ = ray_cluster
    assert len(alive(ray)) == 2
    run(runs, tmp_path / "local", EngineOptions())
    log = tmp_path / "nodes.log"
    monkeypatch.setattr(engine, "_call", on_nodes(log))
    run(runs, tmp_path / "ray", EngineOptions(engine="ray"))
    assert nodes_used(log) == alive(ray)  # both nodes ran units
    assert tree(tmp_path / "ray") == tree(tmp_path / "local")
    marker = tmp_path / "marker"
    run(runs, tmp_path / "retried", EngineOptions(engine="ray"), lambda s, o: (dying_once, (marker, s, o)))
    assert marker.exists() and tree(tmp_path / "retried") == tree(tmp_path / "local")
    marker = tmp_path / "marker_after"  # run again, the unit replaces the output it wrote (was: exit 2, exists)
    unit = (dying_once_after_writing,)
    run(runs, tmp_path / "again", EngineOptions(engine="ray"), lambda s, o: (*unit, (marker, s, o)))
    assert marker.exists() and tree(tmp_path / "again") == tree(tmp_path / "local")


def test_a_failed_ray_run_cancels_its_running_tasks(ray_cluster, runs: Path, tmp_path: Path) -> None:
    """A unit fails while another runs on the other node: the command fails with the unit's error once the
    running task was cancelled and had ended (it ran on for a minute, writing into the folder being removed)."""
    unit = (failing_while_another_runs,)
    with pytest.raises(RolloutError, match="injected failure") as error:
        run(runs, tmp_path / "out", EngineOptions(engine="ray"), lambda s, o: (*unit, (tmp_path, s, o)))
    assert error.value.exit_code == 1 and (tmp_path / "r1.ended").exists()


def test_a_task_is_interruptible_where_sigint_was_ignored() -> None:
    """What Ray's cancel does to a running task (``_thread.interrupt_main``) raises KeyboardInterrupt in it, even
    where SIGINT was ignored; the process's handler is put back after (an interrupt then does nothing)."""

    def cancelled() -> None:
        _thread.interrupt_main()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.01)

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt):
            ray_connect.interruptible(cancelled)()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        _thread.interrupt_main()
    finally:
        signal.signal(signal.SIGINT, previous)


def _started_ignoring_sigint(interruptible: Callable[..., Any]) -> Callable[..., Any]:
    """``ray_connect.interruptible`` whose task starts with SIGINT ignored, as in the workers of a cluster started
    from a script's background job (``ray start ... &``: the shell ignores SIGINT there; a test run started so)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        task = interruptible(fn)

        def started(*args: Any) -> Any:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                return task(*args)
            finally:
                signal.signal(signal.SIGINT, previous)

        return started

    return wrap


def test_a_cancelled_task_ends_in_a_worker_that_ignores_sigint(
    ray_cluster, runs: Path, tmp_path: Path, monkeypatch
) -> None:
    """Ray cancels a running task by simulating SIGINT, which did nothing in a worker that inherited SIGINT
    ignored (the full suite run in the background): the command returned while r1's task ran on."""
    monkeypatch.setattr(ray_connect, "interruptible", _started_ignoring_sigint(ray_connect.interruptible))
    unit = (failing_while_another_runs,)
    with pytest.raises(RolloutError, match="injected failure"):
        run(runs, tmp_path / "out", EngineOptions(engine="ray"), lambda s, o: (*unit, (tmp_path, s, o)))
    assert (tmp_path / "r1.ended").exists()


def test_a_task_that_holds_the_interrupt_back_is_killed(ray_cluster, runs: Path, tmp_path: Path, monkeypatch) -> None:
    """r1's unit ignores the interrupt: the command kills it (its worker with it) ``CLOSE_GRACE_S`` after the
    cancel, and returns once it has ended; its ``finally`` never runs."""
    monkeypatch.setattr(engine, "CLOSE_GRACE_S", 1.0)
    unit = (failing_while_another_runs,)
    with pytest.raises(RolloutError, match="injected failure"):
        run(runs, tmp_path / "out", EngineOptions(engine="ray"), lambda s, o: (*unit, (tmp_path, s, o, True)))
    assert _still_running({int((tmp_path / "r1.pid").read_text())}, within=10) == []
    assert not (tmp_path / "r1.ended").exists()


def test_ray_cli_and_unreachable_address(ray_cluster, cli, runs: Path, tmp_path: Path) -> None:
    _, address = ray_cluster
    assert cli("gae", runs, "-o", tmp_path / "local")[0] == 0
    ray_args = ["--engine", "ray", "--address", address, "--no-hdf5-locking"]
    code, _, err = cli("gae", runs, "-o", tmp_path / "ray", *ray_args)
    assert code == 0, err
    assert tree(tmp_path / "ray") == tree(tmp_path / "local")
    code, _, err = cli("gae", runs, "-o", tmp_path / "x", "--engine", "ray", "--address", "127.0.0.1:9")
    assert code == 3 and "127.0.0.1:9: cannot reach the Ray cluster" in err
    assert not (tmp_path / "x").exists() and not partial_folder(tmp_path / "x").exists()


def test_batch_on_ray_same_bytes(ray_cluster, cli, runs: Path, tmp_path: Path, monkeypatch) -> None:
    ray, address = ray_cluster
    data = gae_files(cli, runs, tmp_path / "gae")
    args = ["-m", 4, "--epochs", 2, "--max-memory", "16K"]
    assert cli("batch", data, "-o", tmp_path / "local", *args)[0] == 0
    log = tmp_path / "nodes.log"
    monkeypatch.setattr(engine, "_call", on_nodes(log))
    code, _, err = cli("batch", data, "-o", tmp_path / "ray", *args, "--engine", "ray", "--address", address)
    assert code == 0, err
    assert nodes_used(log) == alive(ray)  # both nodes ran units
    assert tree(tmp_path / "ray") == tree(tmp_path / "local")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gae", "local", "nodes.log", "ray", "runs"]


def _remove_when_marked(cluster: Any, node: Any, marker: Path) -> threading.Thread:
    """Remove ``node`` without grace once ``marker`` exists (after 60 s without it: the test fails on its own)."""

    def remove() -> None:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        cluster.remove_node(node, allow_graceful=False)

    thread = threading.Thread(target=remove, name="remove-node", daemon=True)
    thread.start()
    return thread


def test_a_node_lost_mid_unit_ends_with_the_same_bytes(
    ray_cluster, ray_nodes, cli, runs: Path, tmp_path: Path, monkeypatch
) -> None:
    """A third node joins; a unit that runs on it stops there mid-write, and the node is lost. The command ends
    with the bytes of one local worker: Ray retries the lost task on the other nodes (the lost attempt's temporary
    is not published), or it exits 3 and ``--resume`` finishes them. The lost node's worker ends, and the cluster
    has its two nodes again. (``batch``, and nodes lost at random moments: tests/fuzz/kill_loop.py.)"""
    ray, address = ray_cluster
    assert cli("gae", runs, "-o", tmp_path / "local")[0] == 0
    node = ray_nodes.add_node(num_cpus=1, object_store_memory=STORE)
    ray_nodes.wait_for_nodes()
    log, marker = tmp_path / "nodes.log", tmp_path / "nodes.doomed"
    monkeypatch.setattr(engine, "_call", on_nodes(log, doomed=node.node_id))
    remover = _remove_when_marked(ray_nodes, node, marker)
    try:
        code, _, err = cli("gae", runs, "-o", tmp_path / "ray", "--engine", "ray", "--address", address)
    finally:
        remover.join()
    pid, *writing = marker.read_text().split()
    assert node.node_id in nodes_used(log) and len(nodes_used(log)) == 3, err  # the lost node ran a unit
    assert len(writing) == 1 and TEMP_MARKER in writing[0]  # lost mid-write
    if code == 3:  # Ray gave the task up
        code, _, err = cli("gae", runs, "-o", tmp_path / "ray", "--engine", "ray", "--address", address, "--resume")
    assert code == 0, err
    assert tree(tmp_path / "ray") == tree(tmp_path / "local")
    assert _still_running({int(pid)}) == []
    deadline = time.monotonic() + 60  # until the cluster has seen the node go (health checks: conftest)
    while len(alive(ray)) > 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(alive(ray)) == 2


def test_ray_holds_a_few_units_per_cluster_cpu_at_a_time(ray_cluster, monkeypatch) -> None:
    """More units than the cluster is given at once: every result, in order; at most ``AHEAD_PER_WORKER`` tasks a
    cluster CPU are in flight (10,000 refs and their arguments were held in the driver for the whole run)."""
    ray, address = ray_cluster
    most, real = [0], ray.wait

    def spy(refs: list, *args: Any, **kwargs: Any) -> Any:
        most[0] = max(most[0], len(refs))
        return real(refs, *args, **kwargs)

    monkeypatch.setattr(ray, "wait", spy)
    count = 6 * engine.AHEAD_PER_WORKER
    units = [(test_engines.square, (i,)) for i in range(count)]
    assert engine.run_units(units, EngineOptions(engine="ray", address=address)) == [i * i for i in range(count)]
    assert most[0] == 2 * engine.AHEAD_PER_WORKER  # two nodes of one CPU
