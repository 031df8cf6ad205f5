"""``CircularBuffer.load`` on hostile files: the commands' hostile corpus, plus cases aimed at the buffer's own data.

A loaded file gets the CLI's protection (issue 17.9): nothing outside the file is read (links, external raw
storage, virtual datasets), no plugin is searched for, a file that hangs or crashes libhdf5 is refused by the
metadata probe, non-regular files are refused, and a state larger than ``max_memory`` is refused before it is
read. Every case runs in one child process (a crash or hang there fails the test instead of killing pytest),
which reports the ``RolloutError`` and its peak memory after each load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from test_promises_hostile import HOSTILE, SECRET, SECRET_TEXT, _secret_file, _secret_raw, make_hostile

from rolloutcli.core.circular_buffer import CircularBuffer
from rolloutcli.errors import EXIT_IO, RolloutError

MEMORY_BOUND_KB = 96 << 10  # peak memory may grow at most this much over a valid load
BOMB_ENTRY = 16 << 20  # float32 values per entry of a data field declaring 1.5 GiB, stored as ~2 MB of zeros
BOMB_BYTES = 4 * 6 * BOMB_ENTRY * 4


def _valid(path: Path) -> None:
    """A saved buffer, plus the rollout-like fields the corpus builders turn hostile."""
    buffer = CircularBuffer(4, 6, "cpu")
    for step in range(5):
        buffer.append(torch.full((6, 3), float(step)))
    buffer.save(path)
    with h5py.File(path, "a") as handle:
        handle["rewards"] = np.zeros((16, 6), np.float32)
        handle["values"] = np.ones((16, 6), np.float32)
        handle["observations/policy"] = np.zeros((16, 6, 4), np.float32)


def _replace_data(make: Any) -> Any:
    def build(handle: h5py.File, aux: Path) -> None:
        shape, dtype = handle["data"].shape, handle["data"].dtype
        attrs = dict(handle["data"].attrs)
        del handle["data"]
        make(handle, shape, dtype, aux)
        for key, value in attrs.items():
            handle["data"].attrs[key] = value

    return build


def _data_external_storage(handle: h5py.File, shape: tuple, dtype: np.dtype, aux: Path) -> None:
    nbytes = int(np.prod(shape)) * dtype.itemsize
    handle.create_dataset("data", shape=shape, dtype=dtype, external=[(str(_secret_raw(aux, nbytes)), 0, nbytes)])


def _data_virtual(handle: h5py.File, shape: tuple, dtype: np.dtype, aux: Path) -> None:
    with h5py.File(aux / "secret_state.h5", "w") as other:
        other["data"] = np.full(shape, SECRET, np.float32)
    layout = h5py.VirtualLayout(shape=shape, dtype=np.float32)
    layout[:] = h5py.VirtualSource(str(aux / "secret_state.h5"), "data", shape=shape)
    handle.create_virtual_dataset("data", layout)


def _data_external_link(handle: h5py.File, aux: Path) -> None:
    del handle["data"]
    handle["data"] = h5py.ExternalLink(str(_secret_file(aux)), "/data")


def _data_unknown_filter(handle: h5py.File, shape: tuple, dtype: np.dtype, aux: Path) -> None:
    handle.create_dataset("data", shape=shape, dtype=dtype, chunks=shape, compression=32001, allow_unknown_filter=True)


def _memory_bomb(handle: h5py.File, aux: Path) -> None:
    """``data`` [4, 6, E] float32 declaring 1.5 GiB in 16 gzip chunks of 96 MiB zeros (each chunk is allowed)."""
    del handle["data"]
    piece = BOMB_ENTRY // 16
    dataset = handle.create_dataset(
        "data", shape=(4, 6, BOMB_ENTRY), dtype=np.float32, chunks=(4, 6, piece), compression="gzip"
    )
    zeros = zlib.compress(bytes(4 * 6 * piece * 4), 1)
    for index in range(16):
        dataset.id.write_direct_chunk((0, 0, index * piece), zeros)
    dataset.attrs["torch_dtype"] = "float32"
    dataset.attrs["raw_bits"] = False


BUFFER_CASES: dict[str, tuple[Any, int, str]] = {
    "data in external raw storage": (_replace_data(_data_external_storage), 4, "external raw storage"),
    "data as a virtual dataset": (_replace_data(_data_virtual), 4, "virtual dataset"),
    "data as an external link": (_data_external_link, 4, "external link"),
    "data under an unknown filter": (_replace_data(_data_unknown_filter), 4, "unknown filter id 32001"),
    "data larger than max_memory": (_memory_bomb, 3, f"needs {BOMB_BYTES + 6 * 8} bytes"),
}
# A contiguous extra dataset whose address points past the end of the file: the commands copy extras and fail,
# a buffer load never reads it and loads the valid state.
UNREAD_EXTRA = {"data stored past the end of the file": (HOSTILE["data stored past the end of the file"][0], 0, "")}
CASES = {**HOSTILE, **UNREAD_EXTRA, **BUFFER_CASES}


def _build(folder: Path, case: str) -> Path:
    (folder / "aux").mkdir()
    path = folder / "buffer.h5"
    _valid(path)
    make_hostile(path, CASES[case][0], folder / "aux")
    return path


CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import rolloutcli.hdf5.probe as probe
    from rolloutcli.core.circular_buffer import CircularBuffer
    from rolloutcli.errors import RolloutError

    probe.DEFAULT_PROBE_TIMEOUT = 1.0  # seconds before a hanging file is refused (30 in real use)
    jobs = json.loads(sys.argv[1])
    CircularBuffer.load(jobs["valid"])  # warm-up: imports, the probe's helper
    print(json.dumps({"baseline_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}), flush=True)
    for case, path in jobs["cases"].items():
        result = {"case": case, "code": 0, "error": "", "secret": False}
        try:
            state = CircularBuffer.load(path).state_dict()
            result["secret"] = bool((state["data"] == float(sys.argv[2])).any())
        except RolloutError as exc:
            result["code"], result["error"] = exc.exit_code, str(exc)
        except BaseException as exc:
            result["code"], result["error"] = -1, f"escaped {type(exc).__name__}: {exc}"
        result["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps(result), flush=True)
    """
)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, dict[str, Any]]]:
    valid = tmp_path_factory.mktemp("valid") / "buffer.h5"
    _valid(valid)
    jobs = {"valid": str(valid), "cases": {case: str(_build(tmp_path_factory.mktemp("case"), case)) for case in CASES}}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [sys.executable, "-c", CHILD, json.dumps(jobs), str(float(SECRET))]
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        stdout, ending = run.stdout, f"died (returncode {run.returncode}): {run.stderr[-600:]}"
    except subprocess.TimeoutExpired as exc:  # a hang
        out = exc.stdout or b""
        stdout, ending = out.decode() if isinstance(out, bytes) else out, "hung"
    lines = [json.loads(line) for line in stdout.splitlines()]
    results = {line["case"]: line for line in lines[1:]}
    last = lines[-1].get("case", "the warm-up") if lines else "the start"
    assert len(results) == len(CASES), f"the child {ending} after {last!r}"
    return lines[0]["baseline_kb"], results


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_buffer_file_refused(outcomes: tuple[int, dict[str, dict[str, Any]]], case: str) -> None:
    baseline, results = outcomes
    result = results[case]
    expected, words = CASES[case][1:]
    assert result["code"] == expected, result["error"]
    assert words in result["error"]
    assert "\n" not in result["error"]
    assert SECRET_TEXT not in result["error"] and not result["secret"]
    growth = result["maxrss_kb"] - baseline
    assert growth < MEMORY_BOUND_KB, f"peak memory grew by {growth} KiB"


def test_max_memory_and_allow_external_are_honoured(tmp_path: Path) -> None:
    path = tmp_path / "buffer.h5"
    _valid(path)
    with pytest.raises(RolloutError, match="pass max_memory=336 or more") as err:
        CircularBuffer.load(path, max_memory=335)
    assert err.value.exit_code == EXIT_IO
    assert CircularBuffer.load(path, max_memory=336).state_dict()["data"].shape == (4, 6, 3)  # 4*6*3*4 + 6*8
    (tmp_path / "aux").mkdir()
    with h5py.File(path, "a") as handle:
        _replace_data(_data_external_storage)(handle, tmp_path / "aux")
    trusted = CircularBuffer.load(path, allow_external=True).state_dict()["data"]
    assert bool((trusted == float(SECRET)).all())  # trusted on request, as --allow-external does
