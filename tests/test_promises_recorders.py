"""Every recorder keeps the commands' promises (README, docs/recording.md): each test iterates
``promises.RECORDERS``.

1. every file it publishes passes ``inspect --strict`` and ``gae``;
2. a NaN reward is refused with ``RolloutWriter``'s one line naming the file, step and env, and no file holding
   it is published;
3. an exception in the training loop mid-recording leaves no temporary and no half file under a final name;
4. a folder holding an earlier recording's files is refused (exit 2), those files untouched;
5. its files are one consecutive recording (format 1.2): one ``recording_id``, ``recording_index`` 0, 1, ... and
   each file's ``last_observations`` the next file's first observations.
"""

from __future__ import annotations

import gc
import importlib.util
import itertools
from pathlib import Path

import h5py
import numpy as np
import pytest
from promises import RECORDERS, Recorder, digest, temporaries
from record_factory import FILES, Boom, T

from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.record.checks import NONFINITE_FIX

NAN_AT = (FILES - 1) * T + 1, 1  # the last file's second step (RSL-RL's update would fail on NaN before a later one)
FAIL_AT = (FILES - 1) * T + 1


def _recorder(name: str) -> Recorder:
    recorder = RECORDERS[name]
    if recorder.library is not None and importlib.util.find_spec(recorder.library) is None:
        pytest.importorskip(recorder.library)
    return recorder


def _file(folder: Path, n: int) -> Path:
    return folder / f"rollout_{n:06d}.h5"


def _check_published(cli, folder: Path, recorder: Recorder, files: list[Path]) -> None:
    """Every file under a final name in ``folder`` is one of ``files`` and passes ``inspect --strict`` and
    ``gae``; no temporary is left."""
    assert temporaries(folder) == []
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in files)
    for path in files:
        code, _, err = cli("inspect", path, "--strict", "-q")
        assert code == 0, err
        code, _, err = cli("gae", path, "-o", folder.parent / f"gae_{path.name}", *recorder.gae, "-q")
        assert code == 0, err
        with h5py.File(path, "r") as handle:
            assert np.isfinite(handle["rewards"][()]).all()


@pytest.mark.parametrize("name", RECORDERS)
def test_published_files_pass_inspect_strict_and_gae(tmp_path: Path, cli, name: str) -> None:
    recorder, folder = _recorder(name), tmp_path / "rec"
    files = recorder.record(folder)
    assert [p.name for p in files] == [_file(folder, n).name for n in range(FILES)]
    _check_published(cli, folder, recorder, files)


@pytest.mark.parametrize("name", RECORDERS)
def test_nan_reward_is_refused_naming_step_and_env(tmp_path: Path, cli, name: str) -> None:
    recorder, folder = _recorder(name), tmp_path / "rec"
    step, env = NAN_AT
    with pytest.raises(RolloutError) as caught:
        recorder.record(folder, nan_at=NAN_AT)
    line = (
        f"{_file(folder, step // T)}: step {step % T}: field 'rewards': expected finite numbers, found nan at env "
        f"{env}. {NONFINITE_FIX}"
    )
    published = [_file(folder, n) for n in range(step // T)]
    if name == "rsl_rl.attach":  # files are written by a child process: the error names what was published
        line += f" Published: {', '.join(map(str, published))}; not published: {_file(folder, step // T)}."
    assert str(caught.value) == line
    assert temporaries(folder) == []  # at once: the recorder refused the step itself
    if name == "gym.RecordRollouts":  # close() publishes the steps recorded before the refused one
        published.append(_file(folder, step // T))
    del caught
    gc.collect()
    _check_published(cli, folder, recorder, published)


@pytest.mark.parametrize("name", RECORDERS)
def test_exception_mid_recording_leaves_no_temporary_or_half_file(tmp_path: Path, cli, name: str) -> None:
    recorder, folder = _recorder(name), tmp_path / "rec"
    with pytest.raises(Boom) as caught:
        recorder.record(folder, fail_at=FAIL_AT)
    published = [_file(folder, n) for n in range(FAIL_AT // T)]
    if name == "gym.RecordRollouts":  # close() in the loop's finally publishes the steps before the failure
        published.append(_file(folder, FAIL_AT // T))
    if not recorder.keeps_temporary:  # at once, while the exception (and the recorder) is still held
        assert temporaries(folder) == []
    del caught
    gc.collect()  # the exception (and with it the recorder) is gone; no half file under a final name:
    _check_published(cli, folder, recorder, published)


@pytest.mark.parametrize("name", RECORDERS)
def test_folder_of_an_earlier_recording_is_refused(tmp_path: Path, name: str) -> None:
    recorder, folder = _recorder(name), tmp_path / "rec"
    files = recorder.record(folder)
    before = {path.name: digest(path) for path in files}
    with pytest.raises(RolloutError) as caught:
        recorder.record(folder)
    assert caught.value.exit_code == EXIT_USAGE and _file(folder, 0).name in str(caught.value)
    del caught
    gc.collect()
    assert {path.name: digest(path) for path in folder.iterdir()} == before


@pytest.mark.parametrize("name", RECORDERS)
def test_files_are_one_consecutive_recording(tmp_path: Path, name: str) -> None:
    files = _recorder(name).record(tmp_path / "rec")
    handles = [h5py.File(path, "r") for path in files]
    try:
        assert len({h.attrs["recording_id"] for h in handles}) == 1
        assert [int(h.attrs["recording_index"]) for h in handles] == list(range(FILES))
        for before, after in itertools.pairwise(handles):
            np.testing.assert_array_equal(before["last_observations/policy"][()], after["observations/policy"][0])
    finally:
        for handle in handles:
            handle.close()
