"""The metadata probe's prober reads file after file, and still refuses only the file that crashes or hangs it."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rollout_factory import make_rollout
from test_promises_hostile import HOSTILE, make_hostile

from rolloutcli.errors import RolloutError

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the probe needs fork")

# The helper interpreter, its probers' metadata read wrapped: each prober logs "pid name" before reading a file,
# and dies by SIGSEGV (or stops: HOW) on its DIE_AT-th file whatever the file (a prober damaged by an earlier file;
# 0: never).
RECORDING_HELPER = """
import os, signal
from rolloutcli.hdf5 import probe_helper
real, log, die_at, how, count = probe_helper._read_metadata, {log!r}, {die_at}, signal.{how}, 0

def recording(path, request):
    global count
    count += 1  # each prober is forked with the helper's count, 0
    with open(log, "a") as out:
        out.write(f"{{os.getpid()}} {{path.name}}\\n")
    if count == die_at:
        os.kill(os.getpid(), how)
    return real(path, request)

probe_helper._read_metadata = recording
probe_helper.PROBER_SLACK = {slack}
probe_helper.serve()
"""


@pytest.fixture
def recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``start(die_at)`` makes this process's next helper a recording one; returns the log's ``(pid, name)``
    lines as a function. The helper is stopped afterwards."""
    from rolloutcli.hdf5 import probe

    log = tmp_path / "probed.log"
    monkeypatch.delenv(probe.SHARED_ENV, raising=False)
    monkeypatch.setattr(probe, "_HELPER", None)

    def start(die_at: int = 0, how: str = "SIGSEGV", slack: float = 5.0):
        code = RECORDING_HELPER.format(log=str(log), die_at=die_at, how=how, slack=slack)
        monkeypatch.setattr(probe, "HELPER_CODE", code)
        return lambda: [tuple(line.split()) for line in log.read_text().splitlines()]

    yield start
    probe._stop_helper()


def _crashing(path: Path) -> Path:
    """A fuzz mutant whose committed datatype segfaults libhdf5 when the probe copies it."""
    path.write_bytes(gzip.decompress((Path(__file__).parent / "data" / "split_corrupt_named_type.h5.gz").read_bytes()))
    return path


def _hanging(path: Path) -> Path:
    make_rollout(path)
    make_hostile(path, HOSTILE["global heap that hangs libhdf5"][0], path.parent)
    return path


def _outcome(path: Path, timeout: float | None = None) -> str:
    from rolloutcli.hdf5 import probe

    try:
        probe.probe_metadata(path, timeout=timeout)
    except RolloutError as error:
        assert error.exit_code == 1
        return str(error)
    return "ok"


def test_one_prober_reads_file_after_file_and_only_the_bad_ones_are_refused(tmp_path: Path, recording) -> None:
    """Sound files share one prober (no fork per file); a crashing and a hanging file among them are refused
    with the usual words once a fresh prober confirms it, and the files after each go to a fresh prober."""
    lines = recording()
    good = [make_rollout(tmp_path / f"g{i}.h5") for i in range(4)]
    crash, hang = _crashing(tmp_path / "crash.h5"), _hanging(tmp_path / "hang.h5")
    files = [good[0], good[1], crash, good[2], hang, good[3]]
    assert [_outcome(path, 1.0 if path == hang else None) for path in files] == [
        "ok",
        "ok",
        f"{crash}: libhdf5 crashed (SIGSEGV) while reading the file's metadata; the file is corrupt. "
        "Re-export it from its source.",
        "ok",
        f"{hang}: reading the file's metadata did not finish in 1 s (libhdf5 loops forever on some corrupt "
        "files); the file is corrupt. Re-export it from its source.",
        "ok",
    ]
    probed = lines()
    names = ["g0.h5", "g1.h5", "crash.h5", "crash.h5", "g2.h5", "hang.h5", "hang.h5", "g3.h5"]
    assert [name for _, name in probed] == names
    pids = [pid for pid, _ in probed]
    # one prober until the crash; a fresh one confirms it; g2 and the hang in the next; a fresh one confirms it
    assert pids[0] == pids[1] == pids[2] and pids[4] == pids[5]
    assert len({pids[0], pids[3], pids[4], pids[6], pids[7]}) == 5


def test_files_probed_ahead_queue_at_the_prober_and_a_crash_sends_them_to_a_fresh_one(
    tmp_path: Path, recording
) -> None:
    """Probes sent ahead go to the prober as they come (it starts on the next file at once); when it dies, the
    file it died on and those queued behind it go to a fresh prober, in order, and each answer is its file's."""
    from rolloutcli.hdf5 import probe
    from rolloutcli.hdf5.identity import path_identity

    lines = recording(die_at=2)
    files = [make_rollout(tmp_path / f"g{i}.h5") for i in range(5)]
    for path in files[: probe.AHEAD_KEPT]:
        probe.probe_ahead(path)
    assert [probe.probe_metadata(path).clean for path in files] == [path_identity(path) for path in files]
    probed = lines()
    assert [name for _, name in probed] == ["g0.h5", *[f"g{i}.h5" for i in (1, 2, 3, 4) for _ in "ab"]]
    pids = [pid for pid, _ in probed]  # each prober dies on its second file, which a fresh one reads again
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4] == pids[5] != pids[6] == pids[7] != pids[8]


def test_a_stopped_prober_is_killed_past_its_deadline_and_the_files_queued_behind_go_on(
    tmp_path: Path, recording, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prober stopped on its first file (its alarm cannot end it) is killed by the helper past the file's
    deadline and slack: that file is refused as hanging; the file queued behind it goes to a fresh prober."""
    from rolloutcli.hdf5 import probe

    lines = recording(die_at=1, how="SIGSTOP", slack=0.5)
    monkeypatch.setattr(probe, "DEFAULT_PROBE_TIMEOUT", 1.0)
    stopped, good = make_rollout(tmp_path / "stopped.h5"), make_rollout(tmp_path / "good.h5")
    probe.probe_ahead(stopped)
    probe.probe_ahead(good)  # queued behind it at the prober
    started = time.monotonic()
    hanging = "reading the file's metadata did not finish in 1 s (libhdf5 loops forever on some corrupt files)"
    assert _outcome(stopped) == f"{stopped}: {hanging}; the file is corrupt. Re-export it from its source."
    assert 1.0 + 0.5 - 0.2 < time.monotonic() - started < 10
    with pytest.raises(RolloutError, match="did not finish"):  # the fresh prober stops on its first file too
        probe.probe_metadata(good)
    assert [name for _, name in lines()] == ["stopped.h5", "good.h5"]


def test_a_prober_damaged_by_an_earlier_file_does_not_get_an_innocent_file_refused(tmp_path: Path, recording) -> None:
    """Every prober dies on its second file whatever the file (as one an earlier file damaged would): each such
    file is read again by a fresh prober, found sound, and no file is refused."""
    lines = recording(die_at=2)
    files = [make_rollout(tmp_path / f"g{i}.h5") for i in range(4)]
    assert [_outcome(path) for path in files] == ["ok"] * 4
    probed = lines()
    assert [name for _, name in probed] == ["g0.h5", "g1.h5", "g1.h5", "g2.h5", "g2.h5", "g3.h5", "g3.h5"]
    pids = [pid for pid, _ in probed]
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4] == pids[5] != pids[6]


def test_a_crash_in_a_fresh_prober_refuses_the_file(tmp_path: Path, recording) -> None:
    """A fresh prober's death is the file's verdict: not read a third time."""
    lines = recording(die_at=1)
    path = make_rollout(tmp_path / "g.h5")
    assert "libhdf5 crashed (SIGSEGV)" in _outcome(path)
    assert [name for _, name in lines()] == ["g.h5"]


KILLED_OWNER = """
import json, sys, time
from rolloutcli.hdf5 import probe
probe.HELPER_CODE = sys.argv[1]
probe.probe_metadata(sys.argv[2])  # the owner's prober, idle afterwards
worker = probe._connect(probe.shared_env()[probe.SHARED_ENV])  # as a pool worker: a prober of its own
worker.send_bytes(json.dumps({"path": sys.argv[3], "allow_external": False, "timeout": 600}).encode())
print(probe._HELPER.process.pid, flush=True)
time.sleep(600)
"""


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended (its reaper may be slow)
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_nothing_is_left_behind_when_the_owner_is_killed(tmp_path: Path) -> None:
    """SIGKILL of the process that started the helper ends the helper and every prober, an idle one and one
    stuck in libhdf5's loop on a file whose deadline is 10 minutes away."""
    log = tmp_path / "probed.log"
    good, hang = make_rollout(tmp_path / "g.h5"), _hanging(tmp_path / "hang.h5")
    code = RECORDING_HELPER.format(log=str(log), die_at=0, how="SIGSEGV", slack=5.0)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("ROLLOUTCLI_PROBE_HELPER", None)
    owner = subprocess.Popen(
        [sys.executable, "-c", KILLED_OWNER, code, str(good), str(hang)], stdout=subprocess.PIPE, text=True, env=env
    )
    pids: list[int] = []
    try:
        assert owner.stdout is not None
        pids.append(int(owner.stdout.readline()))
        while len(log.read_text().splitlines() if log.exists() else []) < 2:  # the stuck prober has its file
            assert owner.poll() is None
            time.sleep(0.05)
        pids += [int(line.split()[0]) for line in log.read_text().splitlines()]
        assert len(set(pids)) == 3
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 60  # not a timing check: far below the stuck file's 600 s
        while not all(_ended(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in pids if not _ended(pid)] == []
    finally:
        owner.kill()
        for pid in pids:
            if not _ended(pid):
                os.kill(pid, signal.SIGKILL)
