"""The commands whose promises (README, promises) the ``test_promises_*`` files check, and their shared helpers.

Every fault, bad-input, hostile-file and fuzz table iterates ``COMMANDS``: adding a command to all of them is
one line here. A command is described by how to build its argv from an input and an output path, what it
writes (a file, a folder or only stdout), whether it replaces its input, and which kind of file it reads.
``RECORDERS`` lists the recorders of ``rolloutcli.record`` beside them (``test_promises_recorders.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from rollout_factory import make_rollout, rollout_arrays, write_rollout

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# Temporary outputs are named ``.<name>.rolloutcli-tmp-<random>`` (``-old-<random>`` for a folder moved aside).
TEMP_PATTERN = re.compile(r"^\..+\.rolloutcli-tmp-[A-Za-z0-9_-]+$")
# The test hook of rolloutcli/pipeline/progress.py: sleep this long after the first block, after printing PAUSE_MARKER.
PAUSE_ENV = "ROLLOUTCLI_TEST_PAUSE_AFTER_BLOCK"
PAUSE_MARKER = "rolloutcli: test pause after block 1"


@dataclass(frozen=True)
class Command:
    """One row of the promise tables.

    Attributes:
        args: argv for ``(input, output)``; commands without an output ignore the second argument.
        output: ``"file"``, ``"folder"`` or None (results on stdout only).
        in_place: the command replaces its input (the input *is* the output).
        source: the file it reads: ``"rollout"``, ``"gae"`` (a rollout with advantages and returns),
            ``"split"`` (a file written by ``split``) or ``"d4rl"`` (a D4RL-style flat file, for ``import``).
        strict: extra arguments that turn value problems into failures (``inspect --strict``).
        name: the output's name (``out.h5`` for a file, ``out`` for a folder when None); a Minari dataset
            folder's name must be a Minari id (``out-v0``).
        earlier: makes an earlier output of this command at a folder path: the only kind of folder its
            ``--overwrite`` may replace (``batch``: a shard folder's manifest; ``export``: its marked file).
    """

    args: Callable[[str, str], list[str]]
    output: str | None = "file"
    in_place: bool = False
    source: str = "rollout"
    strict: tuple[str, ...] = ()
    name: str | None = None
    earlier: Callable[[Path], None] | None = None

    @property
    def writes(self) -> bool:
        return self.output is not None

    def argv(self, src: Path | str, dst: Path | str | None = None, *extra: str) -> list[str]:
        return [*self.args(str(src), str(dst)), "-q", *extra]

    def output_path(self, src: Path, folder: Path) -> Path | None:
        """Where the command's result lands (the input itself for in-place commands)."""
        if self.in_place:
            return src
        if self.output is None:
            return None
        return folder / (self.name or ("out.h5" if self.output == "file" else "out"))

    def write_earlier(self, dst: Path) -> None:
        """An earlier output of this command at the folder path ``dst`` (see ``earlier``)."""
        dst.mkdir()
        (self.earlier or _shard_folder)(dst)


def _shard_folder(dst: Path) -> None:
    (dst / "manifest.json").write_text('{"format": "rolloutcli.shards"}')


def _export_file(relative: str) -> Callable[[Path], None]:
    """An earlier export's HDF5 file at ``relative`` in the folder, marked as the writers mark it."""

    def write(dst: Path) -> None:
        (dst / relative).parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(dst / relative, "w") as handle:
            handle.attrs["rolloutcli_export"] = "earlier"

    return write


def _export(target: str, *extra: str) -> Callable[[str, str], list[str]]:
    # The factory's rollouts start mid-episode (no recorded_from_reset) and few lanes end an episode:
    # --partial-episodes keeps every lane's episodes, so that each row has data to write.
    return lambda s, d: ["export", s, "--to", target, "-o", d, "--partial-episodes", *extra]


COMMANDS: dict[str, Command] = {
    "inspect": Command(lambda s, d: ["inspect", s, "--json"], output=None, strict=("--strict",)),
    "gae": Command(lambda s, d: ["gae", s, "-o", d]),
    "gae --in-place": Command(lambda s, d: ["gae", s, "--in-place"], in_place=True),
    "returns": Command(lambda s, d: ["returns", s, "-o", d]),
    "returns --in-place": Command(lambda s, d: ["returns", s, "--in-place"], in_place=True),
    "split": Command(lambda s, d: ["split", s, "-o", d]),
    "split --unpad": Command(lambda s, d: ["split", "--unpad", s, "-o", d], source="split"),
    "batch": Command(lambda s, d: ["batch", s, "-o", d, "-m", "4"], output="folder", source="gae"),
    "import": Command(lambda s, d: ["import", s, "-o", d], source="d4rl"),
    "batch --transitions": Command(
        lambda s, d: ["batch", s, "-o", d, "-m", "2", "--transitions", "--n-step", "2", "--timeouts", "ignore"],
        output="folder",
    ),
    "nstep": Command(lambda s, d: ["nstep", s, "-o", d, "--n", "1", "--timeouts", "ignore"]),
    "batch --offline": Command(lambda s, d: ["batch", s, "-o", d, "-m", "4", "--offline"], output="folder"),
    "export minari": Command(
        _export("minari"), output="folder", name="out-v0", earlier=_export_file("data/main_data.hdf5")
    ),
    "export robomimic": Command(_export("robomimic", "--valid-fraction", "0.5")),
    "export d4rl": Command(_export("d4rl")),
    "export d4rl --valid-fraction": Command(
        _export("d4rl", "--valid-fraction", "0.5", "--split-by", "env"),
        output="folder",
        earlier=_export_file("train.hdf5"),
    ),
}
WRITERS = [name for name, command in COMMANDS.items() if command.writes]
# The slowest promise tables (signals mid-write, the hostile corpus) take one export row (about 30 s saved): the
# targets share the reading (plan_episodes, read_chunks) and the publishing; minari's is the one writing a
# folder with h5py itself. The other tables take every target.
ONE_EXPORT = "export minari"


def one_export(names: Sequence[str]) -> list[str]:
    """``names`` with one export row (``ONE_EXPORT``) of the four."""
    return [name for name in names if not name.startswith("export ") or name == ONE_EXPORT]


WIDTH = 80  # the columns of human output when stdout is not a terminal (issue 41.5)
ROLLOUT_READERS = [name for name, command in COMMANDS.items() if command.source in ("rollout", "gae")]


@dataclass(frozen=True)
class Recorder:
    """One row of the recorders' promise table.

    Attributes:
        library: the module it needs beyond rolloutcli (skipped when missing), or None.
        record: ``record(folder, nan_at=(step, env) | None, fail_at=step | None) -> files`` (``record_factory``):
            ``record_factory.FILES`` files of ``record_factory.T`` steps, ``rollout_<n>.h5``, counting steps over
            all files.
        gae: the ``gae`` arguments its files need (the time-out rule its trainer uses).
        keeps_temporary: an exception the recorder is never told of (SB3 calls a callback at no exception) leaves
            its unfinished file's temporary until the recorder is dropped (or Python exits), not at once.
    """

    library: str | None
    record: Callable[..., list[Path]]
    gae: tuple[str, ...] = ()
    keeps_temporary: bool = False


def _recorders() -> dict[str, Recorder]:
    import record_factory as factory

    final = ("--timeouts", "final-value")
    return {
        "RolloutWriter": Recorder(None, factory.record_writer),
        "rsl_rl.attach": Recorder("rsl_rl", factory.record_rsl_rl),
        "gym.RecordRollouts": Recorder("gymnasium", factory.record_gym, final),
        "sb3.RolloutRecorderCallback": Recorder("stable_baselines3", factory.record_sb3, final, keeps_temporary=True),
        "torchrl.write_tensordict": Recorder("tensordict", factory.record_torchrl, final),
    }


RECORDERS: dict[str, Recorder] = _recorders()


# ---------------------------------------------------------------------------------------------------- inputs


def make_input(source: str, path: Path, **rollout: Any) -> Path:
    """A valid input of kind ``source`` at ``path`` (``rollout_factory.rollout_arrays`` options apply)."""
    dataset_options = rollout.pop("dataset_options", {})
    if source == "rollout":
        return make_rollout(path, dataset_options=dataset_options, **rollout)
    arrays = rollout_arrays(**rollout)
    return input_from_arrays(source, path, arrays, **dataset_options)


def input_from_arrays(
    source: str, path: Path, arrays: dict[str, np.ndarray], attrs: dict | None = None, **dataset_options: Any
) -> Path:
    """An input of kind ``source`` built from (possibly invalid) rollout ``arrays``."""
    if source == "rollout":
        return write_rollout(path, arrays, attrs, **dataset_options)
    if source == "gae":
        shape = arrays["rewards"].shape[:2] if "rewards" in arrays else (1, 1)
        arrays = {**arrays, "advantages": np.zeros(shape, np.float32), "returns": np.zeros(shape, np.float32)}
        gae_attrs = {
            "gae_gamma": 0.99,
            "gae_lambda": 0.95,
            "advantages_normalized": True,
            "timeouts_bootstrapped": True,
            "last_values_mode": "recorded",
        }
        return write_rollout(path, arrays, {**gae_attrs, **(attrs or {})}, **dataset_options)
    if source == "split":
        from rolloutcli.pipeline.options import RunOptions
        from rolloutcli.pipeline.split import SplitOptions, run_split

        rollout = write_rollout(path.with_name(f"rollout-of-{path.name}"), arrays, attrs)
        try:
            run_split(rollout, path, SplitOptions(), RunOptions())
        finally:
            rollout.unlink()
        return path
    if source == "d4rl":
        return write_rollout(path, d4rl_arrays(arrays), attrs, **dataset_options)
    raise ValueError(source)


def d4rl_arrays(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rollout ``arrays`` as a D4RL-style flat file: each env's steps in turn (env-major), observations as a
    group, rewards ``[T*N, 1]``, ``terminals`` and ``timeouts`` from dones and time-outs, ``values`` carried."""

    def env_major(value: np.ndarray) -> np.ndarray:  # a perturbed array of under 2 dims goes in as it is
        return value if value.ndim < 2 else np.swapaxes(value, 0, 1).reshape(-1, *value.shape[2:])

    flat = {}
    for name in ("observations/policy", "observations/critic", "actions", "rewards", "values"):
        if name in arrays:
            flat[name] = env_major(arrays[name])
    if "rewards" in flat:
        flat["rewards"] = flat["rewards"].reshape(-1, 1)
    dones = env_major(arrays["dones"]).reshape(-1).astype(bool)
    time_outs = env_major(arrays["time_outs"]).reshape(-1).astype(bool)
    flat["terminals"], flat["timeouts"] = dones & ~time_outs, time_outs
    return flat


def repack(path: Path, **dataset_options: Any) -> Path:
    """Rewrite every dataset of ``path`` with ``dataset_options`` (e.g. gzip + fletcher32), attributes kept."""
    tmp = path.with_name(path.name + ".repack")
    with h5py.File(path, "r") as source, h5py.File(tmp, "w") as target:
        target.attrs.update(dict(source.attrs))

        def copy(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                data = obj[()]
                options = dataset_options if data.ndim and data.size else {}
                if options.get("chunks") == "thirds":
                    options = {**options, "chunks": (max(1, data.shape[0] // 3), *data.shape[1:])}
                target.create_dataset(name, data=data, **options)
                target[name].attrs.update(dict(obj.attrs))

        source.visititems(copy)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------------- checks


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def temporaries(folder: Path) -> list[str]:
    """Names in ``folder`` carrying the temporary-output marker."""
    return sorted(name for name in os.listdir(folder) if ".rolloutcli-tmp-" in name)


def error_lines(err: str) -> list[str]:
    """stderr lines that are not warnings or the test hook's marker (a failure must leave exactly one)."""
    return [
        line
        for line in err.splitlines()
        if line.strip() and not line.startswith("warning: ") and not line.startswith(PAUSE_MARKER)
    ]


def is_root() -> bool:
    return os.geteuid() == 0


def run_in_process(argv: Sequence[str]) -> tuple[int, str, str]:
    """``rolloutcli.cli.main(argv)`` with stdout and stderr captured (for use outside pytest's capsys)."""
    from rolloutcli.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------------------------------ processes


@dataclass
class Run:
    """A finished ``python -m rolloutcli`` child."""

    returncode: int
    stdout: str
    stderr: str
    paused: bool = False  # the test hook's marker was seen before the signal
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(PAUSE_ENV, None)
    env.update(extra)
    return env


# Runs before rolloutcli in the child, then execs it (same pid): Ctrl-C gets its default meaning even when
# the test runner ignores SIGINT, SIGXFSZ is ignored (a write past the size limit fails with EFBIG instead
# of killing the process) and RLIMIT_FSIZE is set when asked. Used instead of ``preexec_fn``, which is not
# safe in a process with threads (the tests start children from a thread pool).
LAUNCHER = """
import os, resource, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[1])
if limit:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def _where_stuck(pid: int) -> str:
    """What a child that outlived its timeout was doing: each thread's state, kernel wait and signal masks."""
    parts = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int) if os.path.isdir(f"/proc/{pid}/task") else []:
        with contextlib.suppress(OSError):
            fields = dict(
                line.split(":\t", 1) for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines()
            )
            wchan = Path(f"/proc/{pid}/task/{tid}/wchan").read_text()
            keys = ("State", "SigPnd", "ShdPnd", "SigBlk", "SigCgt")
            parts.append(f"thread {tid} wchan={wchan} " + " ".join(f"{k}={fields.get(k, '?').strip()}" for k in keys))
    return "; ".join(parts) or "no /proc entry"


def run_rolloutcli(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    file_size_limit: int = 0,
    signal_after_pause: int | None = None,
    stdout: Any = subprocess.PIPE,
    timeout: float = 120.0,
) -> Run:
    """Run ``python -m rolloutcli *argv`` in a child (``file_size_limit`` bytes per file when non-zero); with
    ``signal_after_pause``, run it with the test hook (``ROLLOUTCLI_TEST_PAUSE_AFTER_BLOCK``), wait for its
    marker on stderr, then send that signal."""
    started = time.perf_counter()
    env = dict(env or child_env())
    if signal_after_pause is not None:
        env[PAUSE_ENV] = "300"
    process = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(file_size_limit), "-m", "rolloutcli", *map(str, argv)],
        cwd=cwd,
        env=env,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    out_parts: list[str] = []

    def pump_err() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.put(line)
        lines.put(None)

    def pump_out() -> None:
        assert process.stdout is not None
        out_parts.append(process.stdout.read())

    pumps = [threading.Thread(target=pump_err, daemon=True)]
    if stdout is subprocess.PIPE:
        pumps.append(threading.Thread(target=pump_out, daemon=True))
    for pump in pumps:
        pump.start()
    err: list[str] = []
    paused = False
    deadline = time.monotonic() + timeout
    if signal_after_pause is not None:
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            err.append(line)
            if line.startswith(PAUSE_MARKER):
                paused = True
                process.send_signal(signal_after_pause)
                break
    try:
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        stuck = _where_stuck(process.pid)
        process.kill()
        process.wait()
        err.append(f"<test: the child was killed after the timeout; {stuck}>\n")
    for pump in pumps:
        pump.join(timeout=10)
    while True:
        try:
            line = lines.get_nowait()
        except queue.Empty:
            break
        if line is not None:
            err.append(line)
    return Run(process.returncode, "".join(out_parts), "".join(err), paused, time.perf_counter() - started)


def assert_fits(text: str, names: Sequence[str]) -> None:
    """Human output: every line within ``WIDTH`` columns, and no name broken across two lines: neither wrapped
    (a line ends with its head, the next starts with its tail) nor folded in a table column (head and tail at
    the same column of consecutive lines)."""
    lines = text.splitlines()
    assert lines, "no output"
    assert not [line for line in lines if len(line) > WIDTH], [line for line in lines if len(line) > WIDTH]
    for a, b in itertools.pairwise(lines):
        for name in names:
            for k in range(1, len(name)):
                head, tail = name[:k], name[k:]
                wrapped = a.rstrip().endswith(head) and b.lstrip().startswith(tail)
                folded = any(b[c : c + len(tail)] == tail and b[c - 1 : c].strip() == "" for c in _cells(a, head))
                assert not (wrapped or folded), f"{name} broken across lines:\n{a}\n{b}"


def _cells(line: str, part: str) -> list[int]:
    """The columns where ``part`` stands as a whole cell of ``line`` (spaces or the line's ends around it)."""
    return [
        c
        for c in range(len(line))
        if line.startswith(part, c)
        and line[c - 1 : c].strip() == ""
        and line[c + len(part) : c + len(part) + 1].strip() == ""
    ]
