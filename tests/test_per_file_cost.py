"""What a dataset pays per file: one probe, one open and audit, one fsync (issue 39). Counted, not timed."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import pytest
from rollout_factory import make_rollout
from test_dataset_journal import NAMES, gae, runs  # noqa: F401 - the fixture

from rolloutcli.errors import RolloutError
from rolloutcli.hdf5 import access, safety
from rolloutcli.hdf5 import reader as reader_module
from rolloutcli.hdf5.access import open_read
from rolloutcli.hdf5.identity import path_identity
from rolloutcli.hdf5.limits import SafetyOptions
from rolloutcli.hdf5.probe import Probed
from rolloutcli.hdf5.reader import RolloutReader, kept_open

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the probe needs fork")


@pytest.fixture
def audited(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files this process audits itself (the probe's own audits, in its prober, are not counted)."""
    calls: list[Path] = []
    real = safety.audit_file
    monkeypatch.setattr(safety, "audit_file", lambda path, handle, opts: calls.append(path) or real(path, handle, opts))
    return calls


def test_a_file_the_probe_found_clean_is_not_audited_again(tmp_path: Path, audited: list[Path], monkeypatch) -> None:
    path = make_rollout(tmp_path / "r.h5")
    with safety.open_hdf5(path):
        pass
    assert audited == []
    # the probe vouches for another file (it changed between the probe and the open): audited here
    monkeypatch.setattr(safety, "probe_metadata", lambda path, options: Probed([0, 0, 0, 0, 0], None))
    with safety.open_hdf5(path):
        pass
    assert audited == [path]


def test_the_probe_audits_under_the_callers_options(tmp_path: Path, audited: list[Path]) -> None:
    """A file clean under the defaults but not under tighter options is refused with the audit's own message."""
    path = make_rollout(tmp_path / "r.h5")
    with pytest.raises(RolloutError) as caught, safety.open_hdf5(path, SafetyOptions(max_dataset_bytes=8)):
        pass
    assert caught.value.exit_code == 4 and "expected at most 8 bytes" in str(caught.value)
    assert audited == [path]


def test_kept_open_opens_an_unchanged_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_rollout(tmp_path / "r.h5")
    opened: list[Path] = []
    real = reader_module.open_listed
    monkeypatch.setattr(reader_module, "open_listed", lambda p, o=None: opened.append(p) or real(p, o))
    with kept_open():
        with RolloutReader(path, check=False) as first:
            rewards = first.array("rewards")
        with RolloutReader(path) as second:
            assert (second.array("rewards") == rewards).all()
        assert len(opened) == 1
        with RolloutReader(path, SafetyOptions(allow_external=True)):  # other options: opened anew
            pass
        os.utime(path, ns=(1, 1))  # another file now: opened anew
        with RolloutReader(path) as third:
            pass
        assert len(opened) == 3
    assert not third.handle.id.valid  # the last one kept is closed with the block
    with RolloutReader(path) as outside, RolloutReader(path):
        assert outside.handle.id.valid
    assert len(opened) == 5


def test_a_dataset_fsyncs_each_output_once(runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Each output is fsynced before it is renamed into the partial folder; the folders are fsynced once, at the
    end (a rename a crash loses only redoes its file on --resume): not a folder fsync per file."""
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    gae(runs, tmp_path / "out")
    folders = 3  # the partial folder and its a/ and b/
    # each output; the journal's start and dataset.json (file and folder each); the folders; the publication
    assert len(synced) == len(NAMES) + 4 + folders + 1


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Each probe request this process sends: (path, "ahead" when sent ahead by ``probe_ahead``, else "now")."""
    from rolloutcli.hdf5 import probe

    calls: list[tuple[str, str]] = []
    real_ask, real_ahead = probe._ask, probe._send_ahead

    def now(request: dict, timeout: float) -> dict | None:
        calls.append((request["path"], "now"))
        return real_ask(request, timeout)

    def ahead(request: dict) -> object:
        calls.append((request["path"], "ahead"))
        return real_ahead(request)

    monkeypatch.setattr(probe, "_ask", now)
    monkeypatch.setattr(probe, "_send_ahead", ahead)
    return calls


def _ahead_done() -> None:
    from rolloutcli.hdf5 import probe

    with probe._LOCK:
        probe._receive_through(None)
    assert not probe._SENT


def test_a_file_probed_ahead_is_not_probed_again_unless_it_changed(tmp_path: Path, asked: list) -> None:
    from rolloutcli.hdf5 import probe

    path = make_rollout(tmp_path / "r.h5")
    probe.probe_ahead(path)
    assert probe.probe_metadata(path).clean == path_identity(path)
    assert asked == [(str(path), "ahead")]
    probe.probe_ahead(path)
    os.utime(path, ns=(1, 1))  # another file now: the answer ahead is not taken
    assert probe.probe_metadata(path).clean == path_identity(path)
    _ahead_done()
    assert sorted(asked) == [*[(str(path), "ahead")] * 2, (str(path), "now")]
    probe.probe_ahead(tmp_path)  # not a file: nothing is asked (the open refuses it)
    _ahead_done()
    assert len(asked) == 3


def test_a_serial_dataset_probes_each_file_once_ahead(runs: Path, tmp_path: Path, asked: list) -> None:  # noqa: F811
    gae(runs, tmp_path / "out")
    _ahead_done()
    files = sorted(str(runs / name) for name in NAMES)
    first = str(runs / NAMES[0])  # the driver reads its fields before the units run
    assert sorted(path for path, _ in asked) == sorted([*files, first])
    assert {kind for path, kind in asked if path != first} == {"ahead"}


def test_inside_probed_once_a_file_is_listed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``batch`` opens a dataset's files three times: the probe's listing, kept packed, serves every open."""
    from rolloutcli.hdf5 import probe

    listed: list[object] = []
    real = reader_module.list_datasets
    monkeypatch.setattr(reader_module, "list_datasets", lambda handle: listed.append(handle) or real(handle))
    path = make_rollout(tmp_path / "r.h5")
    with probe.probed_once():
        readers = []
        for _ in range(3):
            with RolloutReader(path) as reader:
                readers.append((reader.datasets, reader.attrs))
        assert readers[0] == readers[1] == readers[2]
        assert listed == []
        os.utime(path, ns=(1, 1))  # another file now: probed again, its own listing
        with RolloutReader(path):
            pass
        assert listed == []


def test_small_blocks_are_scattered_together_with_the_same_bytes(
    runs: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dataset of small files: their blocks joined before the scatter (``Gathered``) or one by one, the shards
    are the same bytes."""
    from rolloutcli.dataset import resolve
    from rolloutcli.pipeline import shard_export
    from rolloutcli.pipeline.batch import BatchOptions, run_batch
    from rolloutcli.pipeline.options import RunOptions
    from rolloutcli.pipeline.scatter import ShardScatter

    adds = [0]
    real_add = ShardScatter.add

    def counted(self: ShardScatter, *args: object, **kwargs: object) -> None:
        adds[-1] += 1
        real_add(self, *args, **kwargs)

    monkeypatch.setattr(ShardScatter, "add", counted)
    files = resolve([runs]).files  # dataset.Paths, not a list: a dataset all the same
    outs = []
    for limit in (1 << 20, 0):
        monkeypatch.setattr(shard_export, "GATHER_BYTES", limit)
        out = tmp_path / f"shards-{limit}"
        run_batch(files, out, BatchOptions(num_mini_batches=3, epochs=2, offline=True), RunOptions())
        outs.append({p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix == ".h5"})
        adds.append(0)
    assert outs[0] == outs[1] and len(outs[0]) == 6
    assert adds[:2] == [2, 2 * len(files)]  # a scatter per pass, against one per file and pass


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((16, 4, 48), "<f4"), ((16, 4), bool), ((7,), "<i8"), ((), "<f8"), ((0, 3), "<u1"), ((2, 3), ">f4"), ((4,), "S5")],
)
def test_a_dataset_made_low_level_is_h5pys_bytes(tmp_path: Path, shape: tuple[int, ...], dtype: object) -> None:
    """``new_dataset`` + ``write_array`` make the bytes h5py's ``create_dataset(track_times=False)`` and
    ``dataset[...] = array`` make, in a group, beside a committed type, whole or in env columns."""
    import h5py
    import numpy as np

    from rolloutcli.hdf5.writer import new_dataset, write_array

    data = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape).astype(dtype)
    columns = (slice(None), slice(0, 1)) if len(shape) > 1 else ()  # a block of env columns, or all again

    base = tmp_path / "base.h5"  # made once: a committed type records the second it was made
    with h5py.File(base, "w", libver=("v108", "latest")) as handle:
        handle.create_group("observations", track_times=False)
        handle["named"] = np.dtype("<f4")

    def make(path: Path, low: bool) -> bytes:
        path.write_bytes(base.read_bytes())
        with h5py.File(path, "r+", libver=("v108", "latest")) as handle:
            for name, kind in (("observations/policy", dtype), ("typed", handle["named"])):
                if low:
                    target = new_dataset(handle, name, shape, kind)
                    assert target[1:] == (shape, handle[name].dtype)  # the shape and dtype it keeps
                    value = data.astype(target[2])
                else:
                    made = handle.create_dataset(name, shape=shape, dtype=kind, track_times=False)
                    value = data.astype(made.dtype)
                for index in ((), columns):
                    part = np.ascontiguousarray(value[index])
                    if low:
                        write_array(target, index, part)
                    else:
                        made[index] = part
        return path.read_bytes()

    assert make(tmp_path / "low.h5", True) == make(tmp_path / "h5py.h5", False)


def test_a_batch_dataset_checks_each_files_values_once(
    runs: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``batch`` on a dataset checks each file's values with its fields (the first file again with the export's
    own reader), not again when its blocks are planned; a bad value is still refused."""
    import h5py
    import numpy as np

    from rolloutcli.dataset import resolve
    from rolloutcli.pipeline.batch import BatchOptions, run_batch
    from rolloutcli.pipeline.options import RunOptions

    checked: list[str] = []
    real = RolloutReader.check_values
    monkeypatch.setattr(RolloutReader, "check_values", lambda self: checked.append(self.path.name) or real(self))
    files = resolve([runs]).files
    run_batch(files, tmp_path / "shards", BatchOptions(num_mini_batches=3, offline=True), RunOptions())
    names = [path.name for path in files]
    assert sorted(checked) == sorted([*names, names[0]])
    bad = tmp_path / "bad"
    bad.mkdir()
    for path in files:
        (bad / path.name).write_bytes(path.read_bytes())
    with h5py.File(bad / names[-1], "a") as handle:
        rewards = handle["rewards"][()]
        rewards.reshape(-1)[0] = np.nan
        handle["rewards"][...] = rewards
    with pytest.raises(RolloutError, match="field 'rewards': expected finite numbers, found 1 NaN/Inf values"):
        run_batch(resolve([bad]).files, tmp_path / "out", BatchOptions(num_mini_batches=3, offline=True), RunOptions())


def test_a_batch_dataset_opens_each_file_to_check_it_and_to_export_it(
    runs: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its blocks are planned from the probes' listings (``reader.listed``), not from a third open."""
    from rolloutcli.dataset import resolve
    from rolloutcli.pipeline.batch import BatchOptions, run_batch
    from rolloutcli.pipeline.options import RunOptions

    opened: list[str] = []
    real = reader_module.open_listed
    monkeypatch.setattr(reader_module, "open_listed", lambda path, o: opened.append(Path(path).name) or real(path, o))
    files = resolve([runs]).files
    run_batch(files, tmp_path / "shards", BatchOptions(num_mini_batches=3, offline=True), RunOptions())
    names = [path.name for path in files]
    assert sorted(opened) == sorted([*names, *names])


def test_a_listed_file_is_the_probed_one_and_a_rollout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``listed`` gives what a reader of the file has, and None (open it) unless the probe found this very file
    clean and listed it, and the listing is a rollout file's."""
    from rolloutcli.hdf5 import probe

    path = make_rollout(tmp_path / "r.h5")
    found = reader_module.listed(path)
    with RolloutReader(path) as reader:
        assert found is not None and found.schema == reader.schema and (found.T, found.N) == (reader.T, reader.N)
    probed = probe.probe_metadata(path)
    for other in (Probed([0, 0, 0, 0, 0], probed.listing), Probed(probed.clean, None)):
        monkeypatch.setattr(reader_module, "probe_metadata", lambda path, options, other=other: other)
        assert reader_module.listed(path) is None
    not_rollout = {**probed.listing, "datasets": {}}
    monkeypatch.setattr(reader_module, "probe_metadata", lambda path, options: Probed(probed.clean, not_rollout))
    assert reader_module.listed(path) is None


def test_probes_ahead_keep_their_answers_in_order_on_one_thread(tmp_path: Path, asked: list) -> None:
    """Probes sent ahead of many files (more than are kept) leave at most three answers unread on the connection,
    each file gets its own answer, and no thread is started."""
    import threading

    from rolloutcli.hdf5 import probe

    paths = [make_rollout(tmp_path / f"r{i}.h5") for i in range(5)]
    threads = threading.active_count()
    for path in paths:
        probe.probe_ahead(path)
        assert len(probe._SENT) <= probe.AHEAD_KEPT
    for path in reversed(paths):  # the first two were dropped: asked now; the last three answered in turn
        assert probe.probe_metadata(path).clean == path_identity(path)
    assert probe.AHEAD_KEPT == 3 and sorted(kind for _, kind in asked) == ["ahead"] * 5 + ["now"] * 2
    assert threading.active_count() == threads and not probe._SENT


def test_open_read_is_h5pys_read_only_open(tmp_path: Path) -> None:
    """One access list per process (``access.open_read``), and the file object and errors of
    ``h5py.File(path, "r")``, in this process and in a forked child."""
    path = make_rollout(tmp_path / "r.h5")
    (tmp_path / "not.h5").write_bytes(b"not hdf5")

    def check() -> None:
        with open_read(path) as ours, h5py.File(path, "r") as theirs:
            assert (ours.mode, ours.driver, ours.libver, ours.filename) == (
                theirs.mode, theirs.driver, theirs.libver, theirs.filename)  # fmt: skip
            assert ours.id.get_access_plist() == theirs.id.get_access_plist()
            assert dict(ours.attrs) == dict(theirs.attrs) and list(ours) == list(theirs)
        for name, error in (("missing.h5", FileNotFoundError), ("not.h5", OSError)):
            with pytest.raises(error) as ours_raised:
                open_read(tmp_path / name)
            with pytest.raises(error) as theirs_raised:
                h5py.File(tmp_path / name, "r")
            assert type(ours_raised.value) is type(theirs_raised.value)

    check()
    child = os.fork()
    if child == 0:  # the access list made here, not the parent's
        try:
            check()
        finally:
            os._exit(0 if access._ACCESS.keys() == {os.getpid()} else 1)
    assert os.waitpid(child, 0)[1] == 0
