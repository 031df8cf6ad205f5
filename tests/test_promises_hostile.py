"""Hostile files (README, promises): a generated corpus, every case through every command of ``COMMANDS``.

Each case turns a valid input of the command into a hostile one: links and storage outside the file, virtual
datasets, hard-link cycles, unknown filters, absurd declared sizes, decompression bombs, filtered chunks too
short for their checksum (these crash libhdf5 itself when read), non-regular files. All (case, command) runs
happen in one child process (``fuzzing.run_jobs``), so a crash is reported instead of killing pytest, and
the child's peak memory is measured after each run. Each must be refused with exit 4 (or 1 for files that
are merely not HDF5), in bounded memory, with nothing from outside the file on stdout or in an output.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from fuzzing import Report, run_jobs
from promises import COMMANDS, make_input, one_export

SECRET = np.float32(987654.25)  # exists only outside the hostile file
SECRET_TEXT = "987654"
MEMORY_BOUND_KB = 96 << 10  # peak memory may grow at most this much over the warm-up runs
PROBE_TIMEOUT = 1.0  # seconds before the metadata probe gives up on a file (30 in real runs)

Builder = Callable[[h5py.File, Path], None]


def _secret_file(aux: Path) -> Path:
    path = aux / "secret.h5"
    if not path.exists():
        with h5py.File(path, "w") as handle:
            handle["data"] = np.full((64, 64), SECRET, np.float32)
            for key in ("policy", "critic"):
                handle[f"obs/{key}"] = np.full((16, 6, 4), SECRET, np.float32)
    return path


def _secret_raw(aux: Path, nbytes: int) -> Path:
    path = aux / "secret.bin"
    np.full(nbytes // 4 + 1, SECRET, np.float32).tofile(path)
    return path


def _replace(name: str, make: Callable[[h5py.File, tuple[int, ...], np.dtype], None]) -> Builder:
    """A builder that deletes dataset ``name`` and lets ``make(handle, shape, dtype)`` put something there."""

    def build(handle: h5py.File, aux: Path) -> None:
        shape, dtype = handle[name].shape, handle[name].dtype
        del handle[name]
        make(handle, shape, dtype)

    return build


def _external_link(handle: h5py.File, aux: Path) -> None:
    handle["extra_link"] = h5py.ExternalLink(str(_secret_file(aux)), "/data")


def _external_link_below_group(handle: h5py.File, aux: Path) -> None:
    handle.create_group("deep/er")
    handle["deep/er/link"] = h5py.ExternalLink(str(_secret_file(aux)), "/data")


def _external_link_through_group(handle: h5py.File, aux: Path) -> None:
    """``observations`` is a link to a group of another file: ``observations/policy`` is read through it."""
    del handle["observations"]
    handle["observations"] = h5py.ExternalLink(str(_secret_file(aux)), "/obs")


def _external_field(handle: h5py.File, aux: Path) -> None:
    del handle["rewards"]
    handle["rewards"] = h5py.ExternalLink(str(_secret_file(aux)), "/data")


def _soft_link(handle: h5py.File, aux: Path) -> None:
    del handle["rewards"]
    handle["rewards"] = h5py.SoftLink("/values")


def _soft_to_external(handle: h5py.File, aux: Path) -> None:
    handle["outside"] = h5py.ExternalLink(str(_secret_file(aux)), "/data")
    del handle["rewards"]
    handle["rewards"] = h5py.SoftLink("/outside")


def _dangling_soft_link(handle: h5py.File, aux: Path) -> None:
    del handle["rewards"]
    handle["rewards"] = h5py.SoftLink("/nowhere/at/all")


def _external_storage(target: Callable[[Path, int], str]) -> Builder:
    def make(handle: h5py.File, shape: tuple[int, ...], dtype: np.dtype) -> None:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        handle.create_dataset(
            "rewards", shape=shape, dtype=dtype, external=[(target(aux_of(handle), nbytes), 0, nbytes)]
        )

    return _replace("rewards", make)


def aux_of(handle: h5py.File) -> Path:
    return Path(handle.filename).parent / "aux"


def _fifo(aux: Path, nbytes: int) -> str:
    path = aux / "fifo"
    if not path.exists():
        os.mkfifo(path)
    return str(path)


def _virtual(source: Callable[[Path], str]) -> Builder:
    def make(handle: h5py.File, shape: tuple[int, ...], dtype: np.dtype) -> None:
        layout = h5py.VirtualLayout(shape=shape, dtype=np.float32)
        layout[:] = h5py.VirtualSource(source(aux_of(handle)), "data", shape=shape)
        handle.create_virtual_dataset("rewards", layout, fillvalue=0)

    return _replace("rewards", make)


def _hard_link_cycle(handle: h5py.File, aux: Path) -> None:
    group = handle.create_group("loop/inner")
    group["parent"] = handle["loop"]  # loop/inner/parent is loop: a cycle


def _hard_link_to_root(handle: h5py.File, aux: Path) -> None:
    handle["observations/everything"] = handle["/"]


def _filter(filter_id: int) -> Builder:
    def make(handle: h5py.File, shape: tuple[int, ...], dtype: np.dtype) -> None:
        handle.create_dataset(
            "rewards", shape=shape, dtype=dtype, chunks=shape, compression=filter_id, allow_unknown_filter=True
        )

    return _replace("rewards", make)


def _huge_extra(handle: h5py.File, aux: Path) -> None:
    handle.create_dataset("extra_huge", shape=(2**31, 2**31, 2**31), dtype=np.float32, chunks=(1, 1, 1024))


def _huge_field(handle: h5py.File, aux: Path) -> None:
    shape = handle["rewards"].shape
    del handle["rewards"]
    handle.create_dataset("rewards", shape=(2**40, *shape[1:]), dtype=np.float32, chunks=(1024, *shape[1:]))


@functools.cache
def _zeros_deflated(nbytes: int) -> bytes:
    return zlib.compress(bytes(nbytes), 1)


def _bomb(handle: h5py.File, aux: Path) -> None:
    """One 512 MiB chunk of zeros, really stored: ~0.5 MB on disk, 512 MiB once decompressed."""
    T, N = handle["rewards"].shape[:2]
    chunk = (T, N, (512 << 20) // (4 * T * N))
    dataset = handle.create_dataset(
        "observations/bomb", shape=chunk, dtype=np.float32, chunks=chunk, compression="gzip"
    )
    dataset.id.write_direct_chunk((0, 0, 0), _zeros_deflated(4 * T * N * chunk[2]))


def _short_checksummed_chunk(compression: str | None) -> Builder:
    """A fletcher32 chunk stored in 2 bytes (shorter than its checksum): reading it segfaults libhdf5."""

    def make(handle: h5py.File, shape: tuple[int, ...], dtype: np.dtype) -> None:
        half = (max(1, shape[0] // 2), *shape[1:])
        dataset = handle.create_dataset(
            "rewards", shape=shape, dtype=dtype, chunks=half, fletcher32=True, compression=compression
        )
        dataset[: half[0]] = 1
        dataset.id.write_direct_chunk((half[0] if shape[0] > 1 else 0, *([0] * (len(shape) - 1))), b"\x01\x02")

    return _replace("rewards", make)


class Patch:
    """A hostile change made to the file's bytes after h5py wrote it (``fn(path)``)."""

    def __init__(self, fn: Callable[[Path], None]) -> None:
        self.fn = fn


def _patch_address(name: str) -> Patch:
    """Move where dataset ``name`` stores its data (a chunk address, or the contiguous address) to 2**40."""

    def fn(path: Path) -> None:
        with h5py.File(path, "a") as handle:
            if name not in handle:
                handle.create_dataset(
                    name,
                    data=np.arange(64, dtype=np.float32).reshape(8, 8),
                    chunks=(8, 8) if name.endswith("chunked") else None,
                )
            dataset = handle[name]
            offsets = []
            if dataset.chunks:
                dataset.id.chunk_iter(lambda info: offsets.append(info.byte_offset))
            else:
                offsets.append(dataset.id.get_offset())
        data = path.read_bytes()
        for offset in offsets:
            data = data.replace(offset.to_bytes(8, "little"), (2**40).to_bytes(8, "little"))
        path.write_bytes(data)

    return Patch(fn)


def _empty_heap_object(path: Path) -> None:
    """The first global-heap object (a string attribute's value) gets index 0 and size 0: libhdf5 loops
    forever in H5HG__cache_heap_deserialize when it reads any string stored there."""
    data = bytearray(path.read_bytes())
    at = data.find(b"GCOL")
    assert at >= 0, "no global heap in the file"
    data[at + 16 : at + 18] = (0).to_bytes(2, "little")  # heap object index
    data[at + 24 : at + 32] = (0).to_bytes(8, "little")  # heap object size
    path.write_bytes(bytes(data))


HOSTILE: dict[str, tuple[Builder | Patch | str, int, str]] = {
    # case: (builder or whole-file kind, expected exit code, words the error must contain)
    "external link": (_external_link, 4, "found an external link"),
    "external link below a group": (_external_link_below_group, 4, "field 'deep/er/link'"),
    "external link reached through a group": (_external_link_through_group, 4, "field 'observations'"),
    "external link as a field": (_external_field, 4, "field 'rewards': expected data inside the file"),
    "soft link": (_soft_link, 4, "found a soft link to '/values'"),
    "soft link to an external link": (_soft_to_external, 4, "refusing"),
    "dangling soft link": (_dangling_soft_link, 4, "found a soft link"),
    "external raw storage": (_external_storage(lambda aux, n: str(_secret_raw(aux, n))), 4, "external raw storage"),
    "external raw storage on a FIFO": (_external_storage(_fifo), 4, "external raw storage"),
    "external raw storage on /dev/zero": (_external_storage(lambda aux, n: "/dev/zero"), 4, "external raw storage"),
    "virtual dataset": (_virtual(lambda aux: str(_secret_file(aux))), 4, "virtual dataset"),
    "virtual dataset with a missing source": (_virtual(lambda aux: str(aux / "missing.h5")), 4, "virtual dataset"),
    "hard-link cycle": (_hard_link_cycle, 4, "a cycle"),
    "hard link to the root": (_hard_link_to_root, 4, "a cycle"),
    "unknown filter (blosc 32001)": (_filter(32001), 4, "unknown filter id 32001"),
    "unregistered filter id": (_filter(40000), 4, "unknown filter id 40000"),
    "huge declared shape": (_huge_extra, 4, "declared size"),
    "huge declared field": (_huge_field, 4, "declared size"),
    "decompression bomb": (_bomb, 4, "decompression bomb"),
    "fletcher32 chunk shorter than its checksum": (_short_checksummed_chunk(None), 4, "stored chunk of 2 bytes"),
    "gzip+fletcher32 chunk too short": (_short_checksummed_chunk("gzip"), 4, "stored chunk of 2 bytes"),
    "chunk stored past the end of the file": (_patch_address("extra_chunked"), 4, "stored inside the file"),
    "data stored past the end of the file": (_patch_address("extra_contiguous"), 1, "file corrupt"),
    "global heap that hangs libhdf5": (Patch(_empty_heap_object), 1, "did not finish in"),
    "FIFO as the input": ("fifo", 4, "not a regular file"),
    "/dev/zero as the input": ("devzero", 4, "not a regular file"),
    "not an HDF5 file": ("text", 1, "not an HDF5 file"),
    "truncated file": ("truncated", 1, "truncated"),
}
CASES = [(case, name) for case in HOSTILE for name in one_export(list(COMMANDS))]


def make_hostile(path: Path, builder: Any, aux: Path) -> None:
    """Turn the valid file at ``path`` into one hostile case (``builder``: a name, a ``Patch`` or a function)."""
    if builder == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif builder == "devzero":
        path.unlink()
        path.symlink_to("/dev/zero")
    elif builder == "text":
        path.write_text("not HDF5, just text\n" * 200)
    elif builder == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif isinstance(builder, Patch):
        builder.fn(path)
    else:
        with h5py.File(path, "a") as handle:
            builder(handle, aux)


def _build(folder: Path, case: str, name: str) -> dict[str, Any]:
    command = COMMANDS[name]
    (folder / "aux").mkdir()
    src = make_input(command.source, folder / "in.h5", T=16, N=6)
    make_hostile(src, HOSTILE[case][0], folder / "aux")
    dst = command.output_path(src, folder)
    return {
        "name": f"{case} / {name}",
        "command": name,
        "argv": command.argv(src, dst),
        "src": str(src),
        "dst": None if command.in_place or dst is None else str(dst),
        "in_place": command.in_place,
        "folder": str(folder),
        "secrets": [SECRET_TEXT],
        "secret_bytes": [SECRET.tobytes().hex()],
    }


@pytest.fixture(scope="module")
def hostile_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, dict[tuple[str, str], dict]]:
    jobs = [_build(tmp_path_factory.mktemp("hostile"), case, name) for case, name in CASES]
    warmup = []
    for command in COMMANDS.values():  # imports and JIT before the memory baseline
        folder = tmp_path_factory.mktemp("warm")
        src = make_input(command.source, folder / "in.h5", T=16, N=6)
        dst = command.output_path(src, folder)
        warmup.append({"argv": command.argv(src, dst), "src": str(src), "folder": str(folder), "keep": ["in.h5"]})
    report = run_jobs(jobs, warmup=warmup, probe_timeout=PROBE_TIMEOUT)
    by_case = {case: result for case, result in zip(CASES, report.results, strict=True)}
    return report, by_case


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_hostile_file_refused(hostile_report: tuple[Report, dict], case: tuple[str, str]) -> None:
    report, by_case = hostile_report
    result = by_case[case]
    expected, words = HOSTILE[case[0]][1:]
    assert result.get("outcome") is None, result["problems"]  # no crash, no hang
    assert result["problems"] == []
    assert result["code"] == expected, result["error"]
    assert words in result["error"], result["error"]
    assert result["stdout_bytes"] == 0
    growth = result["maxrss_kb"] - report.baseline_kb
    assert growth < MEMORY_BOUND_KB, f"peak memory grew by {growth} KiB"


LIBRARY_RUNNER = """
import json, sys
import rolloutcli.hdf5.probe as probe
probe.DEFAULT_PROBE_TIMEOUT = float(sys.argv[1])
from rolloutcli import RolloutError, RolloutStorage
for line in sys.stdin:
    try:
        RolloutStorage.from_hdf5(line.strip())
        result = {"code": 0, "error": ""}
    except RolloutError as error:
        result = {"code": error.exit_code, "error": str(error)}
    print(json.dumps(result), flush=True)
"""


def test_hostile_corpus_through_from_hdf5(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Issue 17.9: ``RolloutStorage.from_hdf5`` refuses every hostile case as the CLI does (same exit code, same
    words), in a child process so that a libhdf5 crash or hang would show here instead of killing pytest."""
    import json
    import subprocess
    import sys

    cases = list(HOSTILE)
    sources = [_build(tmp_path_factory.mktemp("library"), case, "inspect")["src"] for case in cases]
    done = subprocess.run(
        [sys.executable, "-c", LIBRARY_RUNNER, str(PROBE_TIMEOUT)],
        input="".join(f"{src}\n" for src in sources),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == len(cases), done.stderr[-2000:]
    for case, result in zip(cases, results, strict=True):
        expected, words = HOSTILE[case][1:]
        assert (result["code"], words in result["error"]) == (expected, True), (case, result)
        assert SECRET_TEXT not in result["error"], case
