"""Local engines: the same bytes for 1 or K workers, retries, failures (Ray's cluster: tests/test_engine_nodes.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.dataset import resolve
from rolloutcli.errors import RolloutError
from rolloutcli.pipeline.dataset_job import partial_folder, run_dataset
from rolloutcli.pipeline.dataset_journal import JOURNAL
from rolloutcli.pipeline.engine import EngineOptions
from rolloutcli.pipeline.gae import GaeOptions, run_gae
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.ray_connect import import_ray

OPTIONS, RUN = GaeOptions(), RunOptions()


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    folder = tmp_path / "runs"
    folder.mkdir()
    for i, (T, N) in enumerate([(12, 3), (20, 2), (12, 4), (8, 5)]):
        write_rollout(folder / f"r{i}.h5", rollout_arrays(T=T, N=N, seed=i))
    return folder


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def gae_unit(src: Path, out: Path) -> tuple:
    return (run_gae, (src, out, OPTIONS, RUN))


def dying_once(marker: Path, src: Path, out: Path) -> dict:
    """A unit whose process dies the first time it runs (as a node lost mid-task), then does its work."""
    if src.name == "r1.h5" and not marker.exists():
        marker.write_text("died once")
        os._exit(1)
    return run_gae(src, out, OPTIONS, RUN)


def probing(path: Path) -> tuple[str, bool]:
    """A unit that probes ``path`` in its worker: the outcome, and whether the worker started a helper of its own."""
    from rolloutcli.hdf5 import probe

    try:
        probe.probe_metadata(path)
        outcome = "ok"
    except RolloutError as error:
        outcome = str(error)
    return outcome, probe._HELPER is not None


def failing_once(marker: Path, src: Path, out: Path) -> dict:
    """A unit whose first attempt fails with an I/O error (a flaky file system)."""
    if src.name == "r1.h5" and not marker.exists():
        marker.write_text("failed once")
        raise OSError(5, "injected I/O error")
    return run_gae(src, out, OPTIONS, RUN)


def failing_once_after_writing(marker: Path, src: Path, out: Path) -> dict:
    """A unit whose first attempt writes its output, then fails with an I/O error (the file system failing as
    the output is hashed; a Ray task whose node is lost before its result comes back is run again likewise)."""
    result = run_gae(src, out, OPTIONS, RUN)
    if src.name == "r1.h5" and not marker.exists():
        marker.write_text("failed once")
        raise OSError(5, "injected I/O error")
    return result


def run(runs: Path, dst: Path, engine: EngineOptions, unit=gae_unit) -> dict:
    return run_dataset(resolve([runs]), dst, "gae", {}, unit, engine)


def test_local_workers_1_and_2_same_bytes_and_a_retried_unit(runs: Path, tmp_path: Path) -> None:
    run(runs, tmp_path / "w1", EngineOptions(workers=1))
    run(runs, tmp_path / "w2", EngineOptions(workers=2))
    assert tree(tmp_path / "w1") == tree(tmp_path / "w2")
    marker = tmp_path / "marker"
    run(runs, tmp_path / "retried", EngineOptions(workers=2), lambda s, o: (failing_once, (marker, s, o)))
    assert marker.exists() and tree(tmp_path / "retried") == tree(tmp_path / "w1")
    marker = tmp_path / "marker_after"  # run again, the unit replaces the output its first attempt wrote
    run(runs, tmp_path / "again", EngineOptions(workers=2), lambda s, o: (failing_once_after_writing, (marker, s, o)))
    assert marker.exists() and tree(tmp_path / "again") == tree(tmp_path / "w1")


def square(i: int) -> int:
    return i * i


def test_a_pool_holds_a_few_units_per_worker_at_a_time(monkeypatch) -> None:
    """More units than a pool is given at once: every result, in order, with ``done`` in submission order and no
    result kept; at most ``AHEAD_PER_WORKER`` units per worker are submitted and unfinished at any time."""
    from rolloutcli.pipeline import engine

    most, real = [0], engine._finish_oldest

    def spy(futures, finished) -> None:
        most[0] = max(most[0], len(futures))
        real(futures, finished)

    monkeypatch.setattr(engine, "_finish_oldest", spy)
    count, seen = 6 * engine.AHEAD_PER_WORKER, []
    units = [(square, (i,)) for i in range(count)]
    try:
        assert engine.run_units(units, EngineOptions(workers=2)) == [i * i for i in range(count)]
        assert engine.run_units(units, EngineOptions(workers=2), lambda i, r: seen.append((i, r))) == []
    finally:
        engine.close_pools()
    assert seen == [(i, i * i) for i in range(count)] and most[0] == 2 * engine.AHEAD_PER_WORKER


def test_local_worker_dying_publishes_nothing(runs: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    with pytest.raises(RolloutError, match="a worker process died") as error:
        run(runs, tmp_path / "out", EngineOptions(workers=2), lambda s, o: (dying_once, (marker, s, o)))
    assert error.value.exit_code == 3 and not (tmp_path / "out").exists()
    partial = partial_folder(tmp_path / "out")  # kept for --resume when a file was finished, else removed
    if partial.is_dir():
        assert len((partial / JOURNAL).read_bytes().splitlines()) > 1  # its first line, a finished output's
    assert sorted(p.name for p in runs.iterdir()) == ["r0.h5", "r1.h5", "r2.h5", "r3.h5"]  # inputs untouched


def test_without_ray_engine_ray_exits_2_saying_how_to_install(monkeypatch, cli, runs: Path, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(RolloutError, match=r'pip install "rolloutcli\[ray\]"') as error:
        import_ray()
    assert error.value.exit_code == 2
    code, _, err = cli("gae", runs, "-o", tmp_path / "x", "--engine", "ray")
    assert code == 2 and 'pip install "rolloutcli[ray]"' in err
    code, _, err = cli("gae", runs, "-o", tmp_path / "x", "--address", "auto")
    assert code == 2 and "--address: expected --engine ray" in err


def gae_files(cli, runs: Path, out: Path) -> Path:
    assert cli("gae", runs, "-o", out)[0] == 0
    return out


@pytest.mark.parametrize(
    "args",
    [
        ["-m", 5, "--epochs", 2, "--max-memory", "8K"],  # many blocks of every file, two streamed orders
        ["-m", 3, "--epochs", 2, "--recurrent", "--shuffle-envs"],
    ],
)
def test_batch_on_workers_same_bytes(cli, runs: Path, tmp_path: Path, args: list) -> None:
    data = gae_files(cli, runs, tmp_path / "gae")
    if "--recurrent" in args:  # one T: the files of T = 12
        data = [data / "r0.h5", data / "r2.h5"]
    else:
        data = [data]
    assert cli("batch", *data, "-o", tmp_path / "one", *args)[0] == 0
    code, _, err = cli("batch", *data, "-o", tmp_path / "two", *args, "--workers", 2)
    assert code == 0, err
    assert tree(tmp_path / "one") == tree(tmp_path / "two")


def test_a_reduce_unit_run_again_gives_the_same_shards(cli, runs: Path, tmp_path: Path, monkeypatch) -> None:
    """A reduce unit removes its pieces once its shard is written. Run again after it finished (Ray retries a
    task whose worker died before its result came back), it returns the shard's record from the file; one that
    finds a shard file beside its pieces (an attempt that died writing it) writes the shard anew. The shards
    and manifest are those of the in-process export, and no piece is left."""
    from rolloutcli.pipeline import parallel_export

    data = gae_files(cli, runs, tmp_path / "gae")
    assert cli("batch", data, "-o", tmp_path / "one", "-m", 4, "--max-memory", "8K")[0] == 0
    left: list[list[Path]] = []

    def each_reduce_twice(units: list, engine: object) -> list:
        results = []
        for fn, args in units:
            if fn is parallel_export.reduce_shard:
                spec, _, _, name = args
                (spec.folder / name).write_bytes(b"the start of a shard")  # an attempt that died writing it
                results.append(fn(*args))
                assert fn(*args) == results[-1]
                left.append(list((spec.folder / parallel_export.MAP).iterdir()))
            else:
                results.append(fn(*args))
        return results

    monkeypatch.setattr(parallel_export, "run_units", each_reduce_twice)
    code, _, err = cli("batch", data, "-o", tmp_path / "two", "-m", 4, "--max-memory", "8K", "--workers", 2)
    assert code == 0, err
    assert tree(tmp_path / "one") == tree(tmp_path / "two")
    assert len(left) == 4 and left[-1] == []


def test_batch_distillation_on_workers_same_bytes(cli, tmp_path: Path) -> None:
    from conftest import SAMPLE

    assert cli("batch", SAMPLE, "-o", tmp_path / "one", "-m", 4, "--distillation")[0] == 0
    assert cli("batch", SAMPLE, "-o", tmp_path / "two", "-m", 4, "--distillation", "--workers", 2)[0] == 0
    assert tree(tmp_path / "one") == tree(tmp_path / "two")


PRESTARTED = """
from rolloutcli.pipeline.engine import EngineOptions, prestart, run_units
prestart(EngineOptions(workers={workers}), ["colorsys"])
loaded = "'colorsys' in __import__('sys').modules"  # in the worker: preloaded by its process server?
print(run_units([(eval, (loaded,))] * 2, EngineOptions(workers=2)))
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_prestart_starts_the_process_server_with_the_modules_only_for_several_workers(workers: int) -> None:
    import subprocess

    script = PRESTARTED.format(workers=workers)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("[True, True]" if workers > 1 else "[False, False]")


def test_local_workers_probe_through_the_drivers_helper(runs: Path, tmp_path: Path) -> None:
    """The pool's workers ask the driver's metadata probe helper (no helper interpreter of their own), and a file
    that crashes libhdf5 is still refused from there (the crash happens in a prober, the helper's child), the
    files before and after it in the same worker found sound (its next prober is a fresh one)."""
    import gzip

    from rolloutcli.pipeline.engine import close_pools, run_units

    mutant = tmp_path / "mutant.h5"
    mutant.write_bytes(
        gzip.decompress((Path(__file__).parent / "data" / "split_corrupt_named_type.h5.gz").read_bytes())
    )
    good = sorted(runs.glob("*.h5"))
    files = [*good[:2], mutant, *good[2:]]
    try:
        results = run_units([(probing, (path,)) for path in files], EngineOptions(workers=2))
    finally:
        close_pools()
    crashed = (
        f"{mutant}: libhdf5 crashed (SIGSEGV) while reading the file's metadata; the file is corrupt. "
        "Re-export it from its source."
    )
    assert results == [("ok", False)] * 2 + [(crashed, False)] + [("ok", False)] * 2


@pytest.mark.parametrize(
    ("command", "extra"),
    [("gae", []), ("split", []), ("returns", []), ("nstep", ["--n", 3, "--timeouts", "ignore"]), ("batch", ["-m", 2])],
)
def test_the_early_preload_names_the_modules_the_pool_units_run(
    cli, runs: Path, tmp_path: Path, monkeypatch, command: str, extra: list
) -> None:
    """``preload.PRELOAD`` (what the entry point starts the pool's server with, before the command is parsed)
    holds every module the command's pool units come from."""
    from rolloutcli.pipeline import engine, preload

    seen: set[str] = set()
    real = engine._pool

    def spy(workers: int, modules: list[str]):
        seen.update(modules)
        return real(workers, modules)

    monkeypatch.setattr(engine, "_pool", spy)
    source = runs if command != "batch" else tmp_path / "gae"
    if command == "batch":
        assert cli("gae", runs, "-o", source)[0] == 0
    code, _, err = cli(command, source, "-o", tmp_path / "out", *extra, "--workers", 2)
    assert code == 0, err
    args = [command, str(source), "-o", str(tmp_path / "out"), "--workers", "2"]
    assert seen and seen <= set(preload.pool_modules(args)) == set(preload.PRELOAD[command])


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["gae", "{runs}", "-o", "o", "--workers", "2"], "gae"),
        (["gae", "{runs}", "-o", "o", "--workers=3"], "gae"),
        (["gae", "{runs}/r0.h5", "{runs}/r1.h5", "-o", "o", "--workers", "2"], "gae"),
        (["split", "{runs}/*.h5", "-o", "o", "--workers", "2"], "split"),
        (["gae", "{runs}/r0.h5", "-o", "o.h5", "--workers", "2"], None),  # one file: no pool
        (["batch", "{runs}/r0.h5", "-o", "o", "--workers", "2"], "batch"),  # one file, several workers: a pool
        (["gae", "{runs}", "-o", "o", "--workers", "1"], None),
        (["gae", "{runs}", "-o", "o"], None),
        (["gae", "{runs}", "-o", "o", "--workers", "2", "--engine", "ray"], None),
        (["gae", "{runs}", "-o", "o", "--workers", "x"], None),
        (["inspect", "{runs}", "--workers", "2"], None),
        (["gae", "--help", "--workers", "2"], None),
        ([], None),
    ],
)
def test_the_early_preload_reads_the_command_line(runs: Path, args: list[str], expected: str | None) -> None:
    from rolloutcli.pipeline.preload import PRELOAD, pool_modules

    assert pool_modules([a.format(runs=runs) for a in args]) == (PRELOAD[expected] if expected else ())


def test_the_entry_point_starts_the_pool_server_before_the_command_line_is_imported(runs: Path, tmp_path: Path):
    """``python -m rolloutcli gae DIR --workers 2``: the process server runs (with the units' modules) before
    typer is imported; the outputs are those of one worker."""
    import subprocess

    script = (
        "import sys, multiprocessing.forkserver as fs\n"
        "import rolloutcli.pipeline.preload as p\n"
        "real = p.start_early\n"
        "def early(args):\n"
        "    started = real(args)\n"
        "    print('server', started, fs._forkserver._forkserver_pid is not None, 'typer' in sys.modules, flush=True)\n"
        "    return started\n"
        "p.start_early = early\n"
        "sys.argv = ['rolloutcli', *sys.argv[1:]]\n"
        "from rolloutcli.__main__ import run\n"
        "run()\n"
    )
    for workers in (2, 1):
        args = ["gae", str(runs), "-o", str(tmp_path / f"w{workers}"), "--workers", str(workers)]
        out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=True).stdout
        assert out.splitlines()[0] == f"server {workers > 1} {workers > 1} False"
    assert tree(tmp_path / "w1") == tree(tmp_path / "w2")


MARKER = """
import atexit, os, sys
def _mark():
    open(os.environ["MARK_FILE"], "w").close()
atexit.register(_mark)
"""

SERVER_SCRIPT = """
import multiprocessing, multiprocessing.forkserver as fs, sys
context = multiprocessing.get_context("forkserver")
context.set_forkserver_preload(sys.argv[1:])
fs.ensure_running()
print(fs._forkserver._forkserver_pid, flush=True)
"""


@pytest.mark.parametrize("quick", [True, False])
def test_the_pool_server_ends_without_its_interpreter_shutdown(tmp_path: Path, quick: bool) -> None:
    """Preloaded first, ``pipeline.preload`` ends the process server with ``os._exit`` once the command is gone
    (its shutdown with torch imported kept the command's stdout open for up to 0.75 s): an exit function
    registered before it in the server never runs. Without it (the control) the function runs."""
    import subprocess
    import sys
    import time

    (tmp_path / "marker_module.py").write_text(MARKER)
    mark = tmp_path / "marked"
    preload = ["marker_module", *(["rolloutcli.pipeline.preload"] if quick else [])]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["MARK_FILE"] = str(mark)
    done = subprocess.run([sys.executable, "-c", SERVER_SCRIPT, *preload], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the process server did not end")
    assert mark.exists() is not quick


def test_only_the_pool_server_and_its_workers_end_quickly() -> None:
    from rolloutcli.pipeline import engine, preload

    assert not preload.IN_SERVER  # this process (pytest, the driver) keeps its shutdown
    try:
        assert engine.run_units([(_in_server, ())] * 2, EngineOptions(workers=2)) == [True, True]
    finally:
        engine.close_pools()


def _in_server() -> bool:
    from rolloutcli.pipeline import preload

    return preload.IN_SERVER


def test_ray_address_of_no_cluster_is_our_line_alone(runs: Path, tmp_path: Path) -> None:
    """RAY_ADDRESS naming a dead cluster: Ray retried it for minutes, writing its own log lines on stderr (with
    --address auto, over which Ray takes RAY_ADDRESS; no --address starts a local cluster whatever RAY_ADDRESS
    says). Now one line, exit 3, within the probe's time."""
    address = ["--address", "auto"]
    import subprocess

    from promises import child_env

    dst = tmp_path / "x"
    argv = [sys.executable, "-m", "rolloutcli", "gae", str(runs), "-o", str(dst), "--engine", "ray", *address]
    done = subprocess.run(argv, capture_output=True, text=True, env=child_env(RAY_ADDRESS="127.0.0.1:1"), timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stderr == (
        "error: RAY_ADDRESS=127.0.0.1:1: cannot reach the Ray cluster (Connection refused). Check --address (auto, "
        "host:6379, ray://host:10001) and that the cluster runs.\n"
    )
    assert not dst.exists() and not partial_folder(dst).exists()
