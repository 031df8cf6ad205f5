"""Faults never damage data (README, promises): signals mid-write, a full disk, bad output paths, locked inputs.

Every test iterates ``promises.COMMANDS``. Signals and file-size limits need a real process: those tests run
``python -m rolloutcli`` children, all at once from a module fixture (each child spends ~2 s importing torch),
and assert per case. The mid-write moment is made deterministic by the test hook of ``rolloutcli/pipeline/progress.py``:
with ``ROLLOUTCLI_TEST_PAUSE_AFTER_BLOCK=<s>`` a command prints ``rolloutcli: test pause after block 1
(pid P, writing <temporary>)`` on stderr after its first block and sleeps, and the test signals it then.

Permission tests (a folder or an input without write permission) pass vacuously as root, so they are skipped
when ``os.geteuid() == 0``; everything else runs unprivileged.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from promises import (
    COMMANDS,
    PAUSE_MARKER,
    TEMP_PATTERN,
    WRITERS,
    Run,
    digest,
    error_lines,
    is_root,
    make_input,
    one_export,
    run_rolloutcli,
    temporaries,
)

OLD = b"the previous output, which must survive\n"
BIG = {"T": 64, "N": 48, "obs_dim": 32, "critic_dim": 32}  # a few MB: many blocks with --max-memory 64K
TERMINATED = "terminated: no output was written (temporary files removed)."
INTERRUPTED = "interrupted: no output was written (temporary files removed)."
NOT_WRITABLE = pytest.mark.skipif(is_root(), reason="root ignores permission bits: the test would pass vacuously")


def _prepare(folder: Path, name: str, old: bool) -> tuple[Path, Path | None, str]:
    """Input (and optionally a previous output) for command ``name`` in ``folder``; returns src, dst, digest."""
    command = COMMANDS[name]
    src = make_input(command.source, folder / "in.h5", **BIG)
    dst = command.output_path(src, folder)
    if old and dst is not None and not command.in_place:
        _write_old(dst, name)
    return src, dst, digest(src)


def _write_old(dst: Path, name: str) -> None:
    """A previous output of command ``name`` at ``dst``: a file, or a folder holding one (``batch``, ``export``
    to a folder): an earlier output of that command, the only folder --overwrite may replace."""
    command = COMMANDS[name]
    if command.output == "folder":
        command.write_earlier(dst)
        (dst / "old.txt").write_bytes(OLD)
    else:
        dst.write_bytes(OLD)


def _is_old(dst: Path) -> bool:
    """``dst`` is the previous output: the file, or the folder of old.txt beside the earlier output's one entry."""
    if dst.is_dir() and not dst.is_symlink():
        names = set(os.listdir(dst))
        return "old.txt" in names and len(names) == 2 and (dst / "old.txt").read_bytes() == OLD
    return dst.is_file() and dst.read_bytes() == OLD


def _argv(name: str, src: Path, dst: Path | None, old: bool) -> list[str]:
    extra = ["--max-memory", "64K"] + (["--overwrite"] if old and COMMANDS[name].writes else [])
    if name.startswith("batch"):  # a shard is built whole in memory: BIG's (<= 227K) fit this, still many blocks
        extra += ["--max-memory", "256K", *(["-m", "16"] if "transitions" in name else [])]  # (the last one counts)
    return COMMANDS[name].argv(src, dst, *extra)


def _assert_untouched(name: str, folder: Path, src: Path, dst: Path | None, before: str, old: bool) -> None:
    """The input is intact and the final path holds the old output or nothing."""
    command = COMMANDS[name]
    assert digest(src) == before, "the input was modified"
    if dst is not None and not command.in_place:
        if old:
            assert _is_old(dst), "the previous output was damaged"
        else:
            assert not os.path.lexists(dst), "a (half-written) output appeared under the final name"


# ------------------------------------------------------------------------------------------- signals mid-write

SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
# (command, signal, a previous output exists): SIGKILL and SIGINT over an old output, SIGTERM over nothing.
SIGNAL_CASES = [
    (name, sig, sig != "SIGTERM")
    for name in one_export(list(COMMANDS))
    for sig in SIGNALS
    if COMMANDS[name].writes or sig != "SIGKILL"
]


def _signal_case(folder: Path, case: tuple[str, str, bool]) -> dict[str, Any]:
    name, sig, old = case
    src, dst, before = _prepare(folder, name, old)
    run = run_rolloutcli(_argv(name, src, dst, old), cwd=folder, signal_after_pause=SIGNALS[sig])
    return {"run": run, "src": src, "dst": dst, "before": before}


@pytest.fixture(scope="module")
def signal_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, bool], dict[str, Any]]:
    folders = {case: tmp_path_factory.mktemp("signal") for case in SIGNAL_CASES}
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {case: pool.submit(_signal_case, folders[case], case) for case in SIGNAL_CASES}
        return {case: {**future.result(), "folder": folders[case]} for case, future in futures.items()}


@pytest.mark.parametrize("case", SIGNAL_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'old' if c[2] else 'none'}")
def test_signal_mid_write(signal_runs: dict, case: tuple[str, str, bool]) -> None:
    name, sig, old = case
    result = signal_runs[case]
    run: Run = result["run"]
    folder, src, dst = result["folder"], result["src"], result["dst"]
    assert run.paused, f"the command never reached its first block: {run.stderr}"
    marker = next(line for line in run.stderr.splitlines() if line.startswith(PAUSE_MARKER))
    if COMMANDS[name].writes:
        assert ".rolloutcli-tmp-" in marker, f"the signal did not arrive mid-write: {marker}"
    assert run.stdout == ""
    _assert_untouched(name, folder, src, dst, result["before"], old)
    left = temporaries(folder)
    if sig == "SIGKILL":
        assert run.returncode == -signal.SIGKILL
        # nothing can clean up after SIGKILL: what is left is recognisable by its name
        assert left and all(TEMP_PATTERN.match(n) for n in left), left
        assert marker.split("writing ", 1)[1].rstrip(")") in left
    else:
        assert run.returncode == (143 if sig == "SIGTERM" else 130), run.stderr
        assert error_lines(run.stderr) == [TERMINATED if sig == "SIGTERM" else INTERRUPTED]
        assert left == [], "temporary files were left behind"
    expected = {"in.h5"} | ({dst.name} if dst is not None and (old or COMMANDS[name].in_place) else set())
    assert set(os.listdir(folder)) - set(left) == expected


# ------------------------------------------------------------------------------------- disk full (RLIMIT_FSIZE)
# The child gets RLIMIT_FSIZE with SIGXFSZ ignored (promises.LAUNCHER), so writes past the limit fail with
# EFBIG exactly as they fail with ENOSPC on a full disk, without root or a small file system.


# (command, limit): "tiny" fails while the file is being created, "mid" (64 KiB) in the middle of the data
# (every output file of a BIG input, each shard of a batch folder included, is larger)
FSIZE_CASES = [(name, limit) for name in WRITERS for limit in ("tiny", "mid")]


def _fsize_case(folder: Path, case: tuple[str, str]) -> dict[str, Any]:
    name, limit = case
    old = limit == "mid"
    src, dst, before = _prepare(folder, name, old)
    size = 4096 if limit == "tiny" else 64 << 10
    run = run_rolloutcli(_argv(name, src, dst, old), cwd=folder, file_size_limit=size)
    return {"run": run, "src": src, "dst": dst, "before": before, "old": old}


@pytest.fixture(scope="module")
def fsize_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    folders = {case: tmp_path_factory.mktemp("fsize") for case in FSIZE_CASES}
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {case: pool.submit(_fsize_case, folders[case], case) for case in FSIZE_CASES}
        return {case: {**future.result(), "folder": folders[case]} for case, future in futures.items()}


@pytest.mark.parametrize("case", FSIZE_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_file_too_large(fsize_runs: dict, case: tuple[str, str]) -> None:
    name, _ = case
    result = fsize_runs[case]
    run: Run = result["run"]
    folder, src, dst = result["folder"], result["src"], result["dst"]
    assert run.returncode >= 0, f"died by signal {-run.returncode} (h5py crash after a failed write?)"
    assert run.returncode == 3, run.stderr
    lines = error_lines(run.stderr)
    assert len(lines) == 1, run.stderr
    shown = dst if not COMMANDS[name].in_place else Path(os.path.realpath(src))
    assert lines[0].startswith("error: ") and "File too large" in lines[0], lines[0]
    assert shown.name in lines[0], f"the message does not name the output: {lines[0]}"
    assert run.stdout == ""
    _assert_untouched(name, folder, src, dst, result["before"], result["old"])
    assert temporaries(folder) == []


def test_inspect_stdout_on_full_disk(tmp_path: Path) -> None:
    """``inspect --json > report.json`` when the report cannot be written: exit 3, one line, no traceback."""
    src = make_input(COMMANDS["inspect"].source, tmp_path / "in.h5")
    with open(tmp_path / "report.json", "w") as report:
        run = run_rolloutcli(
            COMMANDS["inspect"].argv(src),
            cwd=tmp_path,
            stdout=report,
            file_size_limit=64,
        )
    assert run.returncode == 3, run.stderr
    assert error_lines(run.stderr) == ["error: cannot write the results to stdout: File too large."]


@pytest.mark.parametrize(
    ("code", "words"),
    [(errno.ENOSPC, "Free disk space"), (errno.EDQUOT, "disk quota"), (errno.EROFS, "read-only")],
)
def test_write_faults_are_io_faults(tmp_path: Path, code: int, words: str) -> None:
    """libhdf5 reports the OS error of a failed write only in its message text; it is still exit 3."""
    from rolloutcli.hdf5.safety import translate_write_error

    failure = OSError(f"Can't write data (file write failed: time = now\n, errno = {code}, error message = 'x')")
    error = translate_write_error(tmp_path / "out.h5", failure, tmp_path / "in.h5")
    assert error.exit_code == 3
    assert str(error).startswith(f"{tmp_path / 'out.h5'}: cannot write the output: ") and words in str(error)
    assert "\n" not in str(error)


def test_no_crash_at_exit_on_disk_full_without_hook(tmp_path: Path) -> None:
    """The documented h5py trap: a failed write must not segfault at interpreter exit (rc 139)."""
    src = make_input("rollout", tmp_path / "in.h5", **BIG)
    run = run_rolloutcli(
        COMMANDS["split"].argv(src, tmp_path / "out.h5", "--max-memory", "64K"),
        cwd=tmp_path,
        file_size_limit=2 * src.stat().st_size,
    )
    assert run.returncode == 3, run.stderr
    assert temporaries(tmp_path) == [] and not (tmp_path / "out.h5").exists()


# The commands whose output can be far larger than their input (import of declared or compressed data, split's
# padding): the output's uncompressed size is checked against the free space before any of it is written.
OUTGROWING = ["import", "split"]


@pytest.mark.parametrize("name", OUTGROWING)
def test_output_the_disk_cannot_hold_is_refused_before_writing(tmp_path: Path, cli, monkeypatch, name: str) -> None:
    import shutil

    src = make_input(COMMANDS[name].source, tmp_path / "in.h5")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1 << 40, 1 << 40, 1024))
    dst = tmp_path / "out.h5"
    code, _, err = cli(*COMMANDS[name].argv(src, dst))
    assert code == 3, err
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith(f"error: {dst}: the output needs "), err
    assert lines[0].endswith(
        f"of disk (uncompressed), 1K is free on the file system holding {tmp_path.resolve()}; free some space or "
        "write the output elsewhere."
    )
    assert not dst.exists() and temporaries(tmp_path) == []


# ----------------------------------------------------------------------------------------------- output paths

NOT_IN_PLACE = [name for name in WRITERS if not COMMANDS[name].in_place]
ALIASES = ["same path", "dotted path", "symlink", "hard link"]


def _alias(src: Path, how: str) -> Path:
    if how == "same path":
        return src
    if how == "dotted path":
        (src.parent / "sub").mkdir()
        return src.parent / "sub" / ".." / src.name
    alias = src.parent / "alias.h5"
    if how == "symlink":
        alias.symlink_to(src)
    else:
        alias.hardlink_to(src)
    return alias


@pytest.mark.parametrize("how", ALIASES)
@pytest.mark.parametrize("name", NOT_IN_PLACE)
def test_output_is_the_input_refused(tmp_path: Path, cli, name: str, how: str) -> None:
    command = COMMANDS[name]
    src = make_input(command.source, tmp_path / "in.h5")
    dst = _alias(src, how)
    before, info, listing = digest(src), src.stat(), sorted(os.listdir(tmp_path))
    for extra in ([], ["--overwrite"]):
        code, out, err = cli(*command.argv(src, dst, *extra))
        assert code == 4, err
        assert error_lines(err) == [
            f"error: {dst}: output is the input file {src}; refusing to overwrite the "
            "input. Choose another output path (or use --in-place where the command "
            "offers it)."
        ]
        assert out == ""
    after = src.stat()
    assert digest(src) == before and (after.st_ino, after.st_mtime_ns) == (info.st_ino, info.st_mtime_ns)
    assert sorted(os.listdir(tmp_path)) == listing  # no temporary was even created


@pytest.mark.parametrize("name", NOT_IN_PLACE)
def test_existing_output_needs_overwrite(tmp_path: Path, cli, name: str) -> None:
    command = COMMANDS[name]
    src = make_input(command.source, tmp_path / "in.h5")
    dst = command.output_path(src, tmp_path)
    assert dst is not None
    _write_old(dst, name)
    code, _, err = cli(*command.argv(src, dst))
    assert code == 2
    assert error_lines(err) == [
        f"error: {dst}: output already exists; refusing to overwrite it. Pass --overwrite to replace it."
    ]
    assert _is_old(dst) and temporaries(tmp_path) == []
    code, _, err = cli(*command.argv(src, dst, "--overwrite"))
    assert code == 0, err
    assert not _is_old(dst) and temporaries(tmp_path) == []


@pytest.mark.parametrize("name", NOT_IN_PLACE)
def test_output_folder_missing(tmp_path: Path, cli, name: str) -> None:
    command = COMMANDS[name]
    src = make_input(command.source, tmp_path / "in.h5")
    before = digest(src)
    dst = tmp_path / "missing" / "out.h5"
    code, out, err = cli(*command.argv(src, dst))
    assert code == 3
    assert error_lines(err) == [
        f"error: {dst}: output folder {dst.parent} does not exist. Create it first (mkdir -p {dst.parent})."
    ]
    assert out == "" and digest(src) == before and sorted(os.listdir(tmp_path)) == ["in.h5"]


@NOT_WRITABLE
@pytest.mark.parametrize("name", WRITERS)
def test_output_folder_not_writable(tmp_path: Path, cli, name: str) -> None:
    command = COMMANDS[name]
    inputs, outputs = tmp_path / "inputs", tmp_path / "outputs"
    inputs.mkdir(), outputs.mkdir()
    src = make_input(command.source, (inputs if not command.in_place else outputs) / "in.h5")
    before = digest(src)
    dst = command.output_path(src, outputs)
    outputs.chmod(0o555)
    try:
        code, out, err = cli(*command.argv(src, dst))
    finally:
        outputs.chmod(0o755)
    assert code == 3, err
    assert len(error_lines(err)) == 1 and "not writable" in err
    assert out == "" and digest(src) == before and temporaries(outputs) == []


@NOT_WRITABLE
def test_in_place_refuses_write_protected_input(tmp_path: Path, cli) -> None:
    names = [name for name in WRITERS if COMMANDS[name].in_place]
    for name in names:
        src = make_input(COMMANDS[name].source, tmp_path / f"{name.replace(' ', '_')}.h5")
        src.chmod(0o444)
        before = digest(src)
        code, _, err = cli(*COMMANDS[name].argv(src))
        assert code == 3, err
        assert "write-protected" in err and digest(src) == before


@pytest.mark.parametrize("dangling", [False, True], ids=["link", "dangling-link"])
@pytest.mark.parametrize("name", NOT_IN_PLACE)
def test_output_symlink_is_replaced_not_followed(tmp_path: Path, cli, name: str, dangling: bool) -> None:
    command = COMMANDS[name]
    src = make_input(command.source, tmp_path / "in.h5")
    target = tmp_path / "elsewhere" / "target.h5"
    target.parent.mkdir()
    if not dangling:
        target.write_bytes(OLD)
    dst = command.output_path(src, tmp_path)
    assert dst is not None
    dst.symlink_to(target)
    assert cli(*command.argv(src, dst))[0] == 2  # an existing path (even a dangling link) needs --overwrite
    code, _, err = cli(*command.argv(src, dst, "--overwrite"))
    assert code == 0, err
    assert not dst.is_symlink() and (dst.is_file() or dst.is_dir())
    if dangling:
        assert not os.path.lexists(target)
    else:
        assert target.read_bytes() == OLD  # the link's target is untouched


def test_in_place_through_a_symlink_replaces_the_target(tmp_path: Path, cli) -> None:
    for name in [n for n in WRITERS if COMMANDS[n].in_place]:
        real = make_input(COMMANDS[name].source, tmp_path / "real.h5")
        link = tmp_path / "link.h5"
        link.symlink_to(real)
        before = digest(real)
        code, _, err = cli(*COMMANDS[name].argv(link))
        assert code == 0, err
        assert link.is_symlink() and os.readlink(link) == str(real) and digest(real) != before
        assert temporaries(tmp_path) == []
        link.unlink(), real.unlink()


# ----------------------------------------------------------------------------------------------- locked input


@pytest.fixture
def locked_input(tmp_path: Path):
    """Yield a function that makes an input and keeps it open for writing in another process (HDF5 lock)."""
    holders: list[subprocess.Popen] = []

    def lock(source: str) -> Path:
        src = make_input(source, tmp_path / f"locked-{len(holders)}.h5")
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys, time, h5py; f = h5py.File(sys.argv[1], 'a'); print('locked', flush=True); time.sleep(600)",
                str(src),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        holders.append(holder)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        return src

    yield lock
    for holder in holders:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(
    os.environ.get("HDF5_USE_FILE_LOCKING", "").upper() == "FALSE",
    reason="HDF5 file locking is disabled in this environment",
)
@pytest.mark.parametrize("name", list(COMMANDS))
def test_input_locked_by_a_writer(tmp_path: Path, cli, locked_input, name: str) -> None:
    command = COMMANDS[name]
    src = locked_input(command.source)
    before, listing = digest(src), sorted(os.listdir(tmp_path))
    code, out, err = cli(*command.argv(src, command.output_path(src, tmp_path)))
    assert code == 3, err
    assert error_lines(err) == [
        f"error: {src}: the file is locked by another process. Wait for the writer to finish and try again."
    ]
    assert out == "" and digest(src) == before and sorted(os.listdir(tmp_path)) == listing


# ------------------------------------------------------------------------------------------------ permissions


@pytest.mark.parametrize("mode", [0o640, 0o600, 0o444])
@pytest.mark.parametrize("name", WRITERS)
def test_output_permissions_no_wider_than_input(tmp_path: Path, cli, name: str, mode: int) -> None:
    command = COMMANDS[name]
    src = make_input(command.source, tmp_path / "in.h5")
    src.chmod(mode)
    if command.in_place and not mode & stat.S_IWUSR:
        pytest.skip("--in-place refuses a write-protected input (tested above)")
    dst = command.output_path(src, tmp_path)
    assert dst is not None
    code, _, err = cli(*command.argv(src, dst))
    assert code == 0, err
    paths = [dst] if dst.is_file() else [dst, *dst.iterdir()]
    for path in paths:
        final = stat.S_IMODE(path.stat().st_mode)
        allowed = mode | ((mode & 0o444) >> 2) if path.is_dir() else mode  # folders get x where they have r
        assert final & ~allowed == 0, f"{path.name}: {oct(final)} is wider than the input's {oct(mode)}"
