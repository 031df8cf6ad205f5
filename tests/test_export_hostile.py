"""Hostile recording attributes (format contract 1.2: ``recording_id``, ``recording_index``) through ``export``.

Two files of one recording, ``a.h5`` and ``b.h5`` (``b`` holds ``("run", 1)``); ``a``'s attributes are hostile.
Every case ends with one line naming the file (exit 1), nothing written; a value that could be mistaken for
another (bytes that are not UTF-8, an array too long to list) is refused, never decoded or described.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from promises import digest, error_lines, temporaries
from rollout_factory import make_rollout

EXPECTED = "a non-empty string and an integer >= 0 together"
FIX = "Write both (RolloutWriter) or neither."
GAP_FIX = "Add the missing file, or export the files of each part of the recording separately."

# case -> (recording_id of a.h5, recording_index of a.h5 (None: not written), the error after "error: ")
CASES = {
    "id of a wrong type": (
        np.int64(7),
        0,
        "{a}: attributes 'recording_id'/'recording_index': expected {e}, found 7 and 0. {f}",
    ),
    "id a float": (1.5, 0, "{a}: attributes 'recording_id'/'recording_index': expected {e}, found 1.5 and 0. {f}"),
    "id empty": ("", 0, "{a}: attributes 'recording_id'/'recording_index': expected {e}, found '' and 0. {f}"),
    "id huge": (
        "r" * 100_000,
        0,
        "{a}: attribute 'recording_id': expected at most 256 characters, found 100000. Write a short id "
        "(RolloutWriter writes a UUID).",
    ),
    "id bytes not UTF-8": (
        np.bytes_(b"\xff\xfe run"),
        0,
        "{a}: attribute 'recording_id': expected UTF-8 text, found bytes that are not (b'\\xff\\xfe run'). "
        "Write the id as a string.",
    ),
    "id a long array": (
        np.arange(5000, dtype=np.int64),
        0,
        "{a}: attributes 'recording_id'/'recording_index': expected {e}, found an array of int64 shaped (5000,) "
        "and 0. {f}",
    ),
    "index negative": (
        "run",
        -1,
        "{a}: attribute 'recording_index': expected an integer >= 0, found -1. Write the files' order from 0.",
    ),
    "index a float": (
        "run",
        1.0,
        "{a}: attributes 'recording_id'/'recording_index': expected {e}, found 'run' and 1.0. {f}",
    ),
    "index a bool": (
        "run",
        np.bool_(True),
        "{a}: attributes 'recording_id'/'recording_index': expected {e}, found 'run' and True. {f}",
    ),
    "index a string": (
        "run",
        "0",
        "{a}: attributes 'recording_id'/'recording_index': expected {e}, found 'run' and '0'. {f}",
    ),
    "index missing": (
        "run",
        None,
        "{a}: attributes 'recording_id'/'recording_index': expected {e}, found 'run' and None. {f}",
    ),
    "index huge": (
        "run",
        np.uint64(2**64 - 1),
        "{a}: attribute 'recording_index': expected 2 after {b} (recording_index 1) in recording run, found "
        "recording_index 18446744073709551615. {g}",
    ),
    "index repeated": (
        "run",
        1,
        "{b}: attribute 'recording_index': expected 2 after {a} (recording_index 1) in recording run, found the "
        "same index. Drop the copy.",
    ),
    "index gap": (
        "run",
        3,
        "{a}: attribute 'recording_index': expected 2 after {b} (recording_index 1) in recording run, found "
        "recording_index 3. {g}",
    ),
}


@pytest.mark.parametrize("target", ["minari", "robomimic", "d4rl"])
@pytest.mark.parametrize("case", list(CASES))
def test_hostile_recording_attributes_are_refused(tmp_path, cli, case: str, target: str) -> None:
    rid, index, message = CASES[case]
    a = make_rollout(tmp_path / "a.h5", T=8, N=2, seed=1)
    b = make_rollout(tmp_path / "b.h5", T=8, N=2, seed=2)
    with h5py.File(b, "a") as handle:
        handle.attrs.update({"recording_id": "run", "recording_index": 1})
    with h5py.File(a, "a") as handle:
        handle.attrs["recording_id"] = rid
        if index is not None:
            handle.attrs["recording_index"] = index
    before = {a: digest(a), b: digest(b)}
    dst = tmp_path / ("out-v0" if target == "minari" else "out.h5")
    code, out, err = cli("export", a, b, "--to", target, "-o", dst, "--partial-episodes", "-q")
    assert code == 1 and out == ""
    assert error_lines(err) == ["error: " + message.format(a=a, b=b, e=EXPECTED, f=FIX, g=GAP_FIX)]
    assert not dst.exists() and temporaries(tmp_path) == []
    assert {a: digest(a), b: digest(b)} == before


def test_bytes_that_are_utf8_are_the_id(tmp_path, cli) -> None:
    """An id stored as fixed-length bytes (h5py's ``np.bytes_``) is the same id as the string."""
    a = make_rollout(tmp_path / "a.h5", T=8, N=2, seed=1)
    b = make_rollout(tmp_path / "b.h5", T=8, N=2, seed=2)
    for path, rid, index in ((a, np.bytes_(b"run"), 0), (b, "run", 1)):
        with h5py.File(path, "a") as handle:
            handle.attrs.update({"recording_id": rid, "recording_index": index})
    code, _, err = cli("export", a, b, "--to", "d4rl", "-o", tmp_path / "out.h5", "--partial-episodes", "-q")
    assert code == 0, err
    with h5py.File(tmp_path / "out.h5") as handle:
        assert list(handle.attrs["source_files"]) == ["a.h5", "b.h5"]
