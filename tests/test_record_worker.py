"""``rolloutcli.record.worker``: recordings handed to the writing process through shared-memory slots."""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from rolloutcli.errors import RolloutError
from rolloutcli.record import worker

T, N = 6, 3


def _job(path: Path) -> dict:
    g = torch.Generator().manual_seed(0)
    steps = {
        "observations": {"policy": torch.randn(T, N, 4, generator=g), "half": torch.randn(T, N, 2).bfloat16()},
        "actions": np.arange(T * N * 2, dtype=np.float64).reshape(T, N, 2),
        "rewards": torch.randn(T, N, generator=g),
        "dones": torch.zeros(T, N, dtype=torch.bool),
        "values": torch.randn(T, N, generator=g)[:, :, None][..., 0],  # a view
        "hidden_states": {"actor": (torch.randn(T, 1, N, 5, generator=g),)},
    }
    return {
        "writer": {"path": path, "num_envs": N, "num_steps": T, "overwrite": True},
        "steps": steps,
        "close": {"last_values": torch.randn(N, generator=g)},
    }


def _slots() -> set[str]:
    return {p for folder in worker._slot_folders() for p in glob.glob(os.path.join(folder, "rolloutcli-record-*"))}


def test_publish_writes_what_was_handed_and_removes_its_slots(tmp_path: Path) -> None:
    before = _slots()
    publisher = worker._Publisher()
    job = _job(tmp_path / "a.h5")
    futures = [publisher.submit({**job, "writer": {**job["writer"], "path": tmp_path / f"{i}.h5"}}) for i in range(3)]
    assert [f.result(timeout=60) for f in futures] == [tmp_path / f"{i}.h5" for i in range(3)]
    assert len(publisher.slots) == 2  # at most _IN_FLIGHT, reused
    if hasattr(os, "SCHED_IDLE"):  # the writing process and its I/O thread run only where the training leaves a CPU
        tasks = Path(f"/proc/{publisher.child.process.pid}/task")
        policies = {os.sched_getscheduler(int(task.name)) for task in tasks.iterdir()}
        assert policies == {os.SCHED_IDLE} and len(list(tasks.iterdir())) > 1
    publisher.close()
    assert _slots() == before
    steps = job["steps"]
    with h5py.File(tmp_path / "2.h5", "r") as handle:
        assert handle["observations/policy"][()].tobytes() == steps["observations"]["policy"].numpy().tobytes()
        np.testing.assert_array_equal(handle["observations/half"][()], steps["observations"]["half"].float().numpy())
        np.testing.assert_array_equal(handle["actions"][()], steps["actions"])
        np.testing.assert_array_equal(handle["values"][()], steps["values"].numpy())
        np.testing.assert_array_equal(handle["hidden_states/actor/0"][()], steps["hidden_states"]["actor"][0].numpy())
        np.testing.assert_array_equal(handle["last_values"][()], job["close"]["last_values"].numpy())


def test_a_relative_path_is_the_callers_after_a_chdir(tmp_path: Path, monkeypatch) -> None:
    """The writing process starts in one folder; a later publish of a relative path writes where the caller is."""
    publisher = worker._Publisher()
    (tmp_path / "first").mkdir()
    publisher.submit(_job(tmp_path / "first" / "a.h5")).result(timeout=60)  # the child runs from here on
    monkeypatch.chdir(tmp_path / "first")
    (tmp_path / "first" / "rel").mkdir()
    assert publisher.submit(_job(Path("rel/b.h5"))).result(timeout=60) == Path("rel/b.h5")
    assert (tmp_path / "first" / "rel" / "b.h5").is_file()
    publisher.close()


def test_full_shared_memory_falls_back_then_fails_cleanly(tmp_path: Path, monkeypatch) -> None:
    real = os.posix_fallocate
    full = {"/dev/shm"}

    def fallocate(fd: int, offset: int, size: int) -> None:
        if any(os.readlink(f"/proc/self/fd/{fd}").startswith(folder + "/") for folder in full):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    publisher = worker._Publisher()
    try:
        assert publisher.submit(_job(tmp_path / "a.h5")).result(timeout=60) == tmp_path / "a.h5"
        assert publisher.slots[0].folder == tempfile.gettempdir()
        full.add(tempfile.gettempdir())
        publisher.slots.pop().close()  # the next recording needs a new slot
        with pytest.raises(RolloutError) as caught:
            publisher.submit(_job(tmp_path / "b.h5"))
        assert caught.value.exit_code == 3
        assert "no room to hand a recording of" in str(caught.value) and "set TMPDIR" in str(caught.value)
        assert not (tmp_path / "b.h5").exists()
    finally:
        publisher.close()


def test_a_training_process_that_dies_leaves_no_slot_and_its_file_is_published(tmp_path: Path) -> None:
    before = _slots()
    script = (
        "import os, sys, torch\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_record_worker import _job, _slots\n"
        "from rolloutcli.record import worker\n"
        "from pathlib import Path\n"
        "future = worker.publish(_job(Path(sys.argv[2])))\n"
        "print(len(_slots()), worker._publisher().slots[0].folder, flush=True)\n"
        "os._exit(0)  # no atexit: the writing process finishes what it was handed on its own\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path / "k.h5")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert run.stderr == ""  # the writing process, finding no one to tell, says nothing (it printed a traceback)
    out = run.stdout.split()
    assert out[0] == str(len(before)) and out[1] in worker._slot_folders()  # the slot never had a name to leave
    deadline = time.monotonic() + 30
    while not (tmp_path / "k.h5").is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    with h5py.File(tmp_path / "k.h5", "r") as handle:
        assert handle["observations/policy"].shape == (T, N, 4)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_training_job_leaves_no_slot_and_no_half_file(tmp_path: Path, how: int) -> None:
    """The whole job killed mid-run (a scheduler's SIGTERM to the process group; the OOM killer's SIGKILL): no
    slot is left in shared memory, every file under its final name is whole, and on SIGTERM no temporary file
    is left either (the writing process finishes the file it is writing)."""
    before = _slots()
    script = (
        "import itertools, sys, torch\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_record_worker import _job\n"
        "from rolloutcli.record import worker\n"
        "from pathlib import Path\n"
        "for i in itertools.count():\n"
        "    worker.publish(_job(Path(sys.argv[2]) / f'{i}.h5'))\n"
        "    if i == 3:\n"
        "        print('running', flush=True)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout.readline() == "running\n"
        os.killpg(process.pid, how)
        process.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _group_alive(process.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert _slots() == before
    done = sorted(tmp_path.glob("*.h5"))
    assert len(done) >= 2  # at most _IN_FLIGHT of the 4 handed over were unpublished
    for path in done:
        with h5py.File(path, "r") as handle:
            assert handle["last_values"].shape == (N,)
    if how == signal.SIGTERM:
        assert sorted(tmp_path.iterdir()) == done


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_stopped_writing_process_does_not_hold_the_exit_forever(tmp_path: Path) -> None:
    """The writing process SIGSTOPped: the training process's exit (atexit) waited for it forever. Now it waits
    while the process stays stopped for EXIT_STOPPED_WAIT_S (shortened here), then says so, naming what is not
    published, and exits."""
    script = (
        "import os, signal, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from pathlib import Path\n"
        "from test_record_worker import _job\n"
        "from rolloutcli.record import waiting, worker\n"
        "waiting.EXIT_STOPPED_WAIT_S = 0.5\n"
        "worker.publish(_job(Path(sys.argv[2]) / 'a.h5')).result(timeout=60)\n"
        "child = worker._publisher().child.process.pid\n"
        "print(child, flush=True)\n"
        "os.kill(child, signal.SIGSTOP)\n"
        "worker.publish(_job(Path(sys.argv[2]) / 'b.h5'))\n"
    )
    log = tmp_path / "stderr.txt"  # a file: the stopped process holds the stream open (a pipe would never end)
    with open(log, "w") as stderr:
        run = subprocess.Popen(
            [sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    child = int(run.stdout.readline())
    try:
        run.wait(timeout=120)
    finally:
        run.kill()
        run.stdout.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)  # the writing process this test stopped
    err = log.read_text()
    lines = [line for line in err.splitlines() if "rolloutcli:" in line]
    assert run.returncode == 0 and len(lines) == 1, err
    said = lines[0].split("RuntimeWarning: ")[1]
    waited = said.split("after ")[1].split(" s")[0]
    assert said == (
        f"rolloutcli: not waiting any longer at exit for the recording process (pid {child}): after {waited} s it "
        f"is stopped (SIGSTOP or a debugger): resume it with `kill -CONT {child}`; not published: {tmp_path / 'b.h5'}."
    )
    assert (tmp_path / "a.h5").is_file() and not (tmp_path / "b.h5").exists()


def test_recording_attributes_travel_to_the_writing_process(tmp_path: Path) -> None:
    job = _job(tmp_path / "a.h5")
    job["writer"].update(recording_id="0123abcd", recording_index=5)
    assert worker.publish(job).result(timeout=60) == tmp_path / "a.h5"
    with h5py.File(tmp_path / "a.h5", "r") as handle:
        assert handle.attrs["recording_id"] == "0123abcd" and handle.attrs["recording_index"] == 5
