"""Hostile HDF5 files are refused (exit 4) before any data is read, and nothing from outside leaks."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from rollout_factory import make_rollout, rollout_arrays, write_rollout

from rolloutcli import RolloutError, RolloutStorage
from rolloutcli.hdf5.identity import path_identity
from rolloutcli.hdf5.limits import SafetyOptions
from rolloutcli.hdf5.reader import H5Input

SECRET = 987654.25  # a value that only exists in the "other" file


def _secret_file(tmp_path: Path) -> Path:
    target = tmp_path / "secret.h5"
    with h5py.File(target, "w") as handle:
        handle["data"] = np.full((12, 3), SECRET, np.float32)
    return target


def _with_extra(tmp_path: Path, build) -> Path:
    path = make_rollout(tmp_path / "hostile.h5")
    with h5py.File(path, "a") as handle:
        build(handle)
    return path


def _external_link(tmp_path: Path) -> Path:
    target = _secret_file(tmp_path)
    return _with_extra(tmp_path, lambda h: h.__setitem__("extra_link", h5py.ExternalLink(str(target), "/data")))


def _external_link_below_group(tmp_path: Path) -> Path:
    target = _secret_file(tmp_path)

    def build(handle: h5py.File) -> None:
        del handle["rewards"]
        handle.create_group("deep/er")
        handle["deep/er/link"] = h5py.ExternalLink(str(target), "/data")

    return _with_extra(tmp_path, build)


def _external_rewards(tmp_path: Path) -> Path:
    """``rewards`` itself is an external link: reading it would read the other file."""
    target = _secret_file(tmp_path)

    def build(handle: h5py.File) -> None:
        del handle["rewards"]
        handle["rewards"] = h5py.ExternalLink(str(target), "/data")

    return _with_extra(tmp_path, build)


def _soft_link(tmp_path: Path) -> Path:
    def build(handle: h5py.File) -> None:
        del handle["rewards"]
        handle["rewards"] = h5py.SoftLink("/values")

    return _with_extra(tmp_path, build)


def _external_raw_storage(tmp_path: Path) -> Path:
    raw = tmp_path / "raw.bin"
    np.full((12, 3), SECRET, np.float32).tofile(raw)

    def build(handle: h5py.File) -> None:
        del handle["rewards"]
        handle.create_dataset("rewards", shape=(12, 3), dtype=np.float32, external=[(str(raw), 0, 12 * 3 * 4)])

    return _with_extra(tmp_path, build)


def _virtual_dataset(tmp_path: Path) -> Path:
    target = _secret_file(tmp_path)

    def build(handle: h5py.File) -> None:
        del handle["rewards"]
        layout = h5py.VirtualLayout(shape=(12, 3), dtype=np.float32)
        layout[:] = h5py.VirtualSource(str(target), "data", shape=(12, 3))
        handle.create_virtual_dataset("rewards", layout)

    return _with_extra(tmp_path, build)


HOSTILE = {
    "external link": (_external_link, "field 'extra_link': expected data inside the file, found an external link"),
    "external link below a group": (_external_link_below_group, "field 'deep/er/link': expected data inside the file"),
    "external link as a field": (
        _external_rewards,
        "field 'rewards': expected data inside the file, found an "
        "external link to another file; refusing to follow it. Pass --allow-external",
    ),
    "soft link": (_soft_link, "field 'rewards': expected a dataset or group, found a soft link to '/values'"),
    "external raw storage": (
        _external_raw_storage,
        "field 'rewards': expected data stored in the file, found "
        "external raw storage in another file; refusing to read outside the file.",
    ),
    "virtual dataset": (
        _virtual_dataset,
        "field 'rewards': expected data stored in the file, found a virtual dataset that reads other files; refusing.",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_refused_exit_4(tmp_path: Path, cli, case: str) -> None:
    build, message = HOSTILE[case]
    path = build(tmp_path)
    code, out, err = cli("inspect", path)
    assert code == 4
    assert out == ""
    assert message in err
    assert err.startswith(f"error: {path}: ")
    assert len(err.strip().splitlines()) == 1
    assert str(SECRET) not in out + err and "987654" not in out + err
    code, out, err = cli("inspect", path, "--json")
    assert code == 4 and out == ""


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_refused_by_library(tmp_path: Path, case: str) -> None:
    path = HOSTILE[case][0](tmp_path)
    with pytest.raises(RolloutError) as error:
        RolloutStorage.from_hdf5(path)
    assert error.value.exit_code == 4


def test_allow_external_opts_in(tmp_path: Path) -> None:
    path = _external_raw_storage(tmp_path)
    storage = RolloutStorage.from_hdf5(path, allow_external=True)
    assert float(storage.rewards[0, 0, 0]) == SECRET


def test_unknown_filter_refused(tmp_path: Path, cli) -> None:
    path = make_rollout(tmp_path / "filtered.h5")
    with h5py.File(path, "a") as handle:
        del handle["rewards"]
        # 32001 is blosc: not built into h5py, so HDF5 would search plugin folders for it
        handle.create_dataset(
            "rewards", shape=(12, 3), dtype=np.float32, chunks=(12, 3), compression=32001, allow_unknown_filter=True
        )
    code, _, err = cli("inspect", path)
    assert code == 4
    assert (
        "field 'rewards': expected filters gzip/shuffle/fletcher32/lzf/scaleoffset, found unknown filter id "
        "32001" in err
    )


def test_huge_declared_shape_refused(tmp_path: Path, cli) -> None:
    path = make_rollout(tmp_path / "huge.h5")
    with h5py.File(path, "a") as handle:
        handle.create_dataset("extra_huge", shape=(2**31, 2**31, 2**31), dtype=np.float32, chunks=(1, 1, 1024))
    code, _, err = cli("inspect", path)
    assert code == 4
    assert (
        "field 'extra_huge': expected at most 1099511627776 bytes, found a declared size of "
        f"{(2**31) ** 3 * 4} bytes" in err
    )


def test_decompression_bomb_chunk_refused(tmp_path: Path, cli) -> None:
    path = make_rollout(tmp_path / "bomb.h5")
    with h5py.File(path, "a") as handle:
        # one 512 MiB chunk of zeros: a few KB on disk, 512 MiB to decompress on first read
        handle.create_dataset(
            "observations/bomb", shape=(12, 3, 2**27), dtype=np.float32, chunks=(1, 1, 2**27), compression="gzip"
        )
    code, _, err = cli("inspect", path)
    assert code == 4
    assert (
        "field 'observations/bomb': expected chunks of at most 268435456 bytes, found chunks of 536870912 "
        "bytes ((1, 1, 134217728)); refusing (decompression bomb)." in err
    )


def test_fifo_input_refused(tmp_path: Path, cli) -> None:
    fifo = tmp_path / "pipe.h5"
    os.mkfifo(fifo)
    code, _, err = cli("inspect", fifo)
    assert code == 4
    assert (
        err.strip() == f"error: {fifo}: not a regular file (a FIFO, socket or device); refusing to read it. "
        "Copy the data into a regular .h5 file."
    )


def test_not_hdf5(tmp_path: Path, cli) -> None:
    path = tmp_path / "text.h5"
    path.write_text("hello, not HDF5\n" * 100)
    code, out, err = cli("inspect", path)
    assert code == 1 and out == ""
    assert (
        err.strip() == f"error: {path}: not an HDF5 file (file signature not found). rolloutcli reads HDF5 "
        "rollout files; check the path."
    )


def test_truncated(tmp_path: Path, cli) -> None:
    path = write_rollout(tmp_path / "cut.h5", rollout_arrays(T=200, N=8))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    code, _, err = cli("inspect", path)
    assert code == 1
    assert "truncated" in err or "corrupt" in err


def test_missing_file(tmp_path: Path, cli) -> None:
    code, _, err = cli("inspect", tmp_path / "nope.h5")
    assert code == 3
    assert err.strip() == f"error: {tmp_path / 'nope.h5'}: no such file. Check the path."


@pytest.mark.parametrize(
    "failure",
    [MemoryError(), OSError("Can't synchronously read data (memory allocation failed for raw data chunk)")],
    ids=["MemoryError", "libhdf5 allocation"],
)
def test_out_of_memory_is_an_io_error_with_budget_advice(
    tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    """Issue 17.8: running out of memory while reading is exit 3 with the budget advice, never "file corrupt"."""
    path = make_rollout(tmp_path / "r.h5")

    def fail(self, index):
        raise failure

    def fail_whole(self, name):  # a whole field is read through the low-level read, inside the same guard
        return self.guard(lambda: fail(None, ()), name)

    monkeypatch.setattr(h5py.Dataset, "__getitem__", fail)
    monkeypatch.setattr(H5Input, "_read_whole", fail_whole)
    code, _, err = cli("inspect", path)
    assert code == 3, err
    assert "out of memory" in err and "Lower --max-memory" in err and "corrupt" not in err
    with pytest.raises(RolloutError, match="out of memory") as raised:
        RolloutStorage.from_hdf5(path)
    assert raised.value.exit_code == 3


def test_output_side_failure_is_not_blamed_on_the_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error libhdf5 raises while writing the output names the output (exit 3), not a corrupt input."""
    from rolloutcli.hdf5.writer import RolloutOutput

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("Unable to synchronously create dataset (object header message is too large)")

    with RolloutOutput(tmp_path / "tmp.h5", tmp_path / "out.h5") as out:
        monkeypatch.setattr(h5py.h5d, "create", refuse)
        with pytest.raises(RolloutError) as raised:
            out.create("rewards", (3, 2), np.float32)
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'out.h5'}: cannot write the output (Unable to synchronously create")
    assert "corrupt" not in message and raised.value.exit_code == 3


def test_corrupt_committed_datatype_is_refused_not_a_crash(tmp_path: Path) -> None:
    """A fuzz mutant of a split file whose committed datatype crashes libhdf5's object copy (which
    ``split --unpad`` uses): the probe child tries that copy, so the command exits 1 instead of segfaulting."""
    import gzip
    import subprocess
    import sys

    path = tmp_path / "mutant.h5"
    path.write_bytes(gzip.decompress((Path(__file__).parent / "data" / "split_corrupt_named_type.h5.gz").read_bytes()))
    before = path.read_bytes()
    argv = [sys.executable, "-m", "rolloutcli", "split", "--unpad", str(path), "-o", str(tmp_path / "out.h5")]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == (
        f"error: {path}: libhdf5 crashed (SIGSEGV) while reading the file's metadata; the file is corrupt. "
        "Re-export it from its source."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mutant.h5"]
    assert path.read_bytes() == before


def test_helper_started_early_is_the_one_the_probe_asks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m rolloutcli CMD FILE`` starts the probe's helper before its imports; the probe then asks that
    helper (no second start), and a command line naming no existing path, or asking for help, starts none."""
    from rolloutcli import __main__ as entry
    from rolloutcli.hdf5 import probe

    path = tmp_path / "r.h5"
    make_rollout(path)
    assert entry._names_a_path(["inspect", str(path)])
    assert entry._names_a_path(["gae", str(path), "-o", str(tmp_path / "out.h5")])
    assert not entry._names_a_path(["inspect", str(path), "--help"])
    assert not entry._names_a_path(["inspect", str(tmp_path / "missing.h5")])
    assert not entry._names_a_path([str(path)])  # the first argument is the command
    started: list[object] = []
    real = probe._Helper
    monkeypatch.setattr(probe, "_Helper", lambda: started.append(1) or real())
    monkeypatch.setattr(probe, "_HELPER", None)
    assert probe.start_helper() and probe.start_helper()
    probe.probe_metadata(path)
    assert len(started) == 1
    probe._stop_helper()


def test_probed_once_probes_an_unchanged_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``probed_once`` a sound file is probed once while it is unchanged (a dataset unit opens its input
    twice); another modification time, or ``allow_external``, probes again; outside it every open probes."""
    from rolloutcli.hdf5 import probe

    path = make_rollout(tmp_path / "r.h5")
    asked: list[str] = []
    real, ahead = probe._ask, probe._send_ahead
    monkeypatch.setattr(probe, "_ask", lambda request, timeout: asked.append(request["path"]) or real(request, timeout))
    monkeypatch.setattr(probe, "_send_ahead", lambda request: asked.append(request["path"]) or ahead(request))
    probe.probe_metadata(path)
    probe.probe_metadata(path)
    assert len(asked) == 2
    with probe.probed_once():
        probe.probe_metadata(path)
        RolloutStorage.from_hdf5(path)  # opens it through the reader
        assert len(asked) == 3
        probe.probe_metadata(path, SafetyOptions(allow_external=True))
        assert len(asked) == 4
        os.utime(path, ns=(1, 1))
        probe.probe_metadata(path)
        assert len(asked) == 5
    probe.probe_metadata(path)
    assert len(asked) == 6


def test_batch_probes_each_file_of_a_dataset_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``batch`` opens a dataset's files twice in this process (the agreement check, then the export): each is
    probed once (a probe is ~20-30 ms of the command's serial start, before any unit runs)."""
    from rolloutcli.hdf5 import probe
    from rolloutcli.pipeline.batch import BatchOptions, run_batch
    from rolloutcli.pipeline.options import RunOptions

    paths = [make_rollout(tmp_path / f"r{i}.h5") for i in range(3)]
    asked: list[str] = []
    real, ahead = probe._ask, probe._send_ahead
    monkeypatch.setattr(probe, "_ask", lambda request, timeout: asked.append(request["path"]) or real(request, timeout))
    monkeypatch.setattr(probe, "_send_ahead", lambda request: asked.append(request["path"]) or ahead(request))
    run_batch(paths, tmp_path / "shards", BatchOptions(2, offline=True), RunOptions())
    assert sorted(asked) == sorted(str(p.absolute()) for p in paths)


def test_probe_falls_back_to_a_helper_of_its_own_when_the_shared_one_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker told of a shared helper that no longer answers (its socket gone) starts one of its own."""
    from rolloutcli.hdf5 import probe

    path = make_rollout(tmp_path / "r.h5")
    monkeypatch.setenv(probe.SHARED_ENV, "rolloutcli-probe-gone")
    monkeypatch.setattr(probe, "_HELPER", None)
    probe.probe_metadata(path)
    assert probe._HELPER is not None and probe._SHARED == {}
    probe._stop_helper()


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to connect as another user")
def test_shared_helper_answers_only_its_own_user(tmp_path: Path) -> None:
    """The shared helper's abstract socket has no file permissions: a process of another user is not answered."""
    import json

    from rolloutcli.hdf5 import probe

    path = make_rollout(tmp_path / "r.h5")
    address = probe.shared_env()[probe.SHARED_ENV]
    request = json.dumps({"path": str(path), "options": {}, "timeout": 5}).encode()

    def ask(uid: int | None) -> bytes:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a child that becomes another user, then asks
            try:
                if uid is not None:
                    os.setgid(uid)
                    os.setuid(uid)
                with probe._connect(address) as connection:
                    try:
                        connection.send_bytes(request)
                        answer = connection.recv_bytes() if connection.poll(10) else b"no answer in time"
                    except (OSError, EOFError):  # closed without an answer; which errno depends on timing
                        answer = b"closed"
                    os.write(write, b"answer:" + answer)
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as answer:
            data = answer.read()
        os.waitpid(pid, 0)
        return data

    answer = json.loads(ask(None).removeprefix(b"answer:"))
    assert (answer["status"], answer["clean"], "rewards" in answer["listing"]["datasets"]) == (
        "ok",
        path_identity(path),
        True,
    )
    # the behaviour, not the errno: closed before the request is sent (BrokenPipeError), before it is read
    # (ConnectionResetError) or after (EOFError), never answered
    assert ask(65534) == b"answer:closed"


def test_helper_that_cannot_listen_still_serves_its_owner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper whose socket cannot be bound (here: a name over the length limit) still answers its owner on its
    pipes; the owner shares none with workers (they start their own)."""
    from rolloutcli.hdf5 import probe

    path = make_rollout(tmp_path / "r.h5")
    monkeypatch.setattr(probe.secrets, "token_hex", lambda nbytes: "x" * 200)
    monkeypatch.setattr(probe, "LISTEN_WAIT", 0.3)
    monkeypatch.setattr(probe, "_HELPER", None)
    assert probe.shared_env() == {}
    request = {"path": str(path), "options": {}, "timeout": 5.0}
    answer = probe._ask(request, 20.0)
    assert answer is not None and (answer["status"], answer["clean"]) == ("ok", path_identity(path))
    assert probe._HELPER is not None and probe._HELPER.process.poll() is None
    probe._stop_helper()
