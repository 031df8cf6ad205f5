"""Run rolloutcli on many hostile or mutated files in a child process, so a crash of libhdf5 is caught.

Parent side: ``run_jobs`` (a fixed list of command lines, e.g. the hostile-file corpus) and ``run_fuzz``
(seeded byte mutants of base files, made in the child). Both start ``python tests/fuzzing.py SPEC.json``,
which calls ``rolloutcli.cli.main(argv)`` in-process for each job and reports one JSON line per job on a
pipe. When the child dies (a signal: segfault, abort) or stops answering (a hang), the parent records the
job it was on and starts a new child at the next job.

For every job the child checks what the README promises on failure and success: only a
``RolloutError`` ends a run (any other exception escaping ``main`` is a problem), failures print exactly one
``error:`` line and nothing on stdout, no output and no temporary file is left after a failure, the input
is unchanged (unless an in-place run succeeded), and no secret string from outside the file shows up.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import resource
import select
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
INTERESTING = [0, 1, 2, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1]


# ------------------------------------------------------------------------------------------------- the child


def _digest(path: Path) -> str | None:
    """SHA-256 of a regular file (a FIFO or a device input is never read: it would hang or never end)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return f"not a regular file: {os.stat(path).st_mode:o}"
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip() and not line.startswith("warning: ")]


def check_run(job: dict[str, Any], code: int, out: str, err: str, before: str | None) -> list[str]:
    """The promises a finished run must keep (an empty list when it kept them all)."""
    problems = []
    src, folder = Path(job["src"]), Path(job["folder"])
    dst = Path(job["dst"]) if job.get("dst") else None
    lines = _error_lines(err)
    if code not in (0, 1, 2, 3, 4):
        problems.append(f"exit code {code}")
    if code == 0:
        if lines:
            problems.append(f"success with error lines: {lines[:2]}")
        if dst is not None and not job.get("in_place") and not os.path.lexists(dst):
            problems.append("success without an output")
    else:
        if len(lines) != 1 or not lines[0].startswith("error: "):
            problems.append(f"expected one 'error:' line, found {lines[:3]}")
        if out:
            problems.append(f"stdout on failure: {out[:80]!r}")
        if dst is not None and not job.get("in_place") and os.path.lexists(dst):
            problems.append("an output was left after a failure")
    left = [name for name in os.listdir(folder) if ".rolloutcli-tmp-" in name]
    if left:
        problems.append(f"temporary files left: {left}")
    if not (job.get("in_place") and code == 0) and _digest(src) != before:
        problems.append("the input was modified")
    written = dst.read_bytes() if dst is not None and os.path.isfile(dst) and not job.get("in_place") else b""
    for secret in job.get("secrets", ()):
        if secret in out or secret in err:
            problems.append(f"secret {secret!r} leaked into stdout/stderr")
    for secret in job.get("secret_bytes", ()):
        if bytes.fromhex(secret) in written:
            problems.append(f"secret bytes {secret} leaked into the output")
    return problems


def _run_job(job: dict[str, Any]) -> dict[str, Any]:
    from rolloutcli.cli.app import main

    src = Path(job["src"])
    before = _digest(src)
    out, err = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    escaped = None
    code = -1
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in job["argv"]])
    except BaseException as exc:  # the promise: only RolloutError ends a run (main turns it into a code)
        escaped = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        escaped += " @ " + " <- ".join(
            f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)[-3:]
        )
    problems = [f"escaped {escaped}"] if escaped else check_run(job, code, out.getvalue(), err.getvalue(), before)
    lines = _error_lines(err.getvalue())
    return {
        "name": job.get("name", ""),
        "command": job.get("command", ""),
        "code": code,
        "error": lines[-1][:300] if lines else "",
        "stdout_bytes": len(out.getvalue()),
        "problems": problems,
        "seconds": time.perf_counter() - started,
        "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def _clean(folder: Path, keep: set[str]) -> None:
    for name in os.listdir(folder):
        if name not in keep:
            path = folder / name
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    import shutil

                    shutil.rmtree(path)
                else:
                    path.unlink()


def mutate(data: bytes, rng: Any, hot: list[tuple[int, int]]) -> bytes:
    """1-3 seeded edits of ``data``: bit flips, bytes, interesting integers, runs, truncation, splices.

    Positions fall in ``hot`` ranges (the file's metadata: everything but stored chunk bytes) 70% of the time.
    """
    buf = bytearray(data)

    def position() -> int:
        if hot and rng.random() < 0.7:
            start, stop = hot[int(rng.integers(len(hot)))]
            return int(rng.integers(start, max(start + 1, stop)))
        return int(rng.integers(len(buf)))

    for _ in range(int(rng.integers(1, 4))):
        if not buf:
            break
        op = int(rng.integers(100))
        at = min(position(), len(buf) - 1)
        if op < 25:
            for _ in range(int(rng.integers(1, 5))):
                bit = min(position(), len(buf) - 1)
                buf[bit] ^= 1 << int(rng.integers(8))
        elif op < 45:
            for k in range(int(rng.integers(1, 5))):
                if at + k < len(buf):
                    buf[at + k] = int(rng.integers(256))
        elif op < 70:
            width = int(rng.choice([1, 2, 4, 8]))
            value = int(rng.choice(INTERESTING)) if rng.random() < 0.8 else int(rng.integers(2**32))
            raw = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
            buf[at : at + width] = raw[: max(0, len(buf) - at)]
        elif op < 85:
            length = int(rng.integers(2, 65))
            fill = int(rng.choice([0, 0xFF, -1]))
            run = bytes(rng.integers(0, 256, length, dtype="uint8")) if fill < 0 else bytes([fill]) * length
            buf[at : at + length] = run[: max(0, len(buf) - at)]
        elif op < 92:
            del buf[at:]
        else:
            source = position()
            length = int(rng.integers(4, 129))
            piece = bytes(buf[source : source + length])
            buf[at : at + len(piece)] = piece[: max(0, len(buf) - at)]
    return bytes(buf)


def _fuzz_job(spec: dict[str, Any], index: int, bases: dict[str, bytes], folder: Path) -> dict[str, Any]:
    import numpy as np

    commands = spec["commands"]
    command = commands[index % len(commands)]
    rng = np.random.default_rng([spec["seed"], index])
    data = mutate(bases[command["source"]], rng, spec["hot"][command["source"]])
    src = folder / f"m{index}.h5"
    src.write_bytes(data)
    dst = folder / command.get("output", "o{index}.h5").format(index=index)
    argv = [a.replace("{src}", str(src)).replace("{dst}", str(dst)) for a in command["argv"]]
    return {
        "name": f"mutant {index}",
        "command": command["name"],
        "argv": argv,
        "src": str(src),
        "dst": None if command["in_place"] or not command["writes"] else str(dst),
        "in_place": command["in_place"],
        "folder": str(folder),
    }


def child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    results = os.fdopen(int(spec["fd"]), "w", buffering=1)
    if spec.get("probe_timeout"):
        import rolloutcli.hdf5.probe

        rolloutcli.hdf5.probe.DEFAULT_PROBE_TIMEOUT = float(spec["probe_timeout"])
    if spec["kind"] == "fuzz":
        _clean(Path(spec["workdir"]), set())  # what a crashed predecessor left
    for job in spec.get("warmup", []):
        _run_job(job)
        _clean(Path(job["folder"]), set(job.get("keep", [])))
    if spec.get("address_space_limit"):
        # bounded memory: an allocation a hostile file asks for fails (MemoryError -> exit 3) instead of
        # swapping the machine; set after the imports and warm-up runs, which map a lot of address space
        limit = _vm_size() + int(spec["address_space_limit"])
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results.write(json.dumps({"baseline_kb": baseline}) + "\n")
    if spec["kind"] == "jobs":
        for index in range(spec["start"], len(spec["jobs"])):
            results.write(json.dumps({"index": index, **_run_job(spec["jobs"][index])}) + "\n")
    else:
        bases = {kind: Path(path).read_bytes() for kind, path in spec["bases"].items()}
        folder = Path(spec["workdir"])
        for index in range(spec["start"], spec["stop"]):
            job = _fuzz_job(spec, index, bases, folder)
            result = _run_job(job)
            _clean(folder, set())
            results.write(json.dumps({"index": index, **result}) + "\n")
    results.write(json.dumps({"done": True, "open_fds": len(os.listdir("/proc/self/fd"))}) + "\n")


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


# ------------------------------------------------------------------------------------------------ the parent


@dataclass
class Report:
    """What a batch of jobs did: one result per job, crashes and hangs included."""

    results: list[dict[str, Any]] = field(default_factory=list)
    baseline_kb: int = 0
    restarts: int = 0
    seconds: float = 0.0
    open_fds: int = 0

    @property
    def problems(self) -> list[str]:
        return [f"{r.get('name')} [{r.get('command')}]: {p}" for r in self.results for p in r["problems"]]

    @staticmethod
    def outcome(result: dict[str, Any]) -> str:
        """``exit N``, ``crash`` or ``hang``; files whose libhdf5 crash or hang the probe contained are marked."""
        if result.get("outcome"):
            return result["outcome"]
        error = result.get("error", "")
        if "libhdf5 crashed" in error:
            return f"exit {result['code']} (libhdf5 crash contained)"
        if "did not finish in" in error:
            return f"exit {result['code']} (libhdf5 hang contained)"
        if "out of memory" in error:
            return f"exit {result['code']} (out of memory)"
        return f"exit {result['code']}"

    def outcomes(self) -> Counter:
        """Counts of ``command: outcome``."""
        return Counter(f"{r['command']}: {self.outcome(r)}" for r in self.results)

    def summary(self) -> str:
        total = len(self.results)
        rate = total / self.seconds if self.seconds else 0.0
        codes = Counter(self.outcome(r) for r in self.results)
        lines = [
            f"{total} runs in {self.seconds:.1f} s ({rate:.0f}/s), {self.restarts} child restarts, "
            f"{len(self.problems)} problems; outcomes: {dict(sorted(codes.items()))}"
        ]
        lines += [f"  {key}: {count}" for key, count in sorted(self.outcomes().items())]
        return "\n".join(lines)


def _drive(
    spec: dict[str, Any], total: int, names: list[str] | None, timeout: float, workdir: Path, start: int = 0
) -> Report:
    """Run jobs ``start`` to ``total - 1`` in children, restarting after a crash or a hang."""
    report = Report()
    started = time.perf_counter()
    by_index: dict[int, dict[str, Any]] = {}
    spec = {**spec, "stop": total}
    while start < total:
        read_fd, write_fd = os.pipe()
        spec_path = workdir / f"spec-{start}.json"
        spec_path.write_text(json.dumps({**spec, "start": start, "fd": write_fd}))
        stderr_log = open(workdir / f"child-{start}.log", "w+b")
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(spec_path)],
            pass_fds=(write_fd,),
            stdin=subprocess.DEVNULL,
            stdout=stderr_log,
            stderr=stderr_log,
            cwd=workdir,
        )
        os.close(write_fd)
        reader = os.fdopen(read_fd, "r")
        current, buffer = start, ""
        finished = False
        # the first answer includes the imports and the warm-up runs
        deadline = time.monotonic() + timeout + 120
        while True:
            ready, _, _ = select.select([reader], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:  # no answer in time: a hang
                process.kill()
                process.wait()
                by_index[current] = {
                    "index": current,
                    "name": names[current] if names else f"mutant {current}",
                    "command": "",
                    "code": None,
                    "outcome": "hang",
                    "problems": [f"no answer within {timeout:.0f} s (hang)"],
                }
                break
            chunk = os.read(reader.fileno(), 1 << 16).decode()
            if not chunk:  # the child exited
                process.wait()
                if not finished:
                    stderr_log.seek(0)
                    tail = stderr_log.read()[-400:].decode(errors="replace").strip().replace("\n", " | ")
                    by_index[current] = {
                        "index": current,
                        "name": names[current] if names else f"mutant {current}",
                        "command": "",
                        "code": process.returncode,
                        "outcome": "crash",
                        "problems": [f"the child died (returncode {process.returncode}): {tail}"],
                    }
                break
            buffer += chunk
            while "\n" in buffer:
                line, buffer = buffer.split("\n", 1)
                message = json.loads(line)
                if "baseline_kb" in message:
                    report.baseline_kb = max(report.baseline_kb, message["baseline_kb"])
                elif message.get("done"):
                    finished = True
                    report.open_fds = message["open_fds"]
                else:
                    by_index[message["index"]] = message
                    current = message["index"] + 1
                deadline = time.monotonic() + timeout
        reader.close()
        stderr_log.close()
        if finished:
            break
        report.restarts += 1
        start = current + 1
    report.results = [by_index[i] for i in sorted(by_index)]
    report.seconds = time.perf_counter() - started
    return report


def run_jobs(
    jobs: list[dict[str, Any]],
    *,
    warmup: list[dict[str, Any]] = (),
    timeout: float = 60.0,
    address_space_limit: int | None = None,
    probe_timeout: float | None = None,
    workdir: Path | None = None,
) -> Report:
    """Run each job (``argv``, ``src``, ``dst``, ``folder``, ``in_place``, ``secrets``...) in a child."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(workdir or scratch)
        spec = {
            "kind": "jobs",
            "jobs": jobs,
            "warmup": list(warmup),
            "address_space_limit": address_space_limit,
            "probe_timeout": probe_timeout,
        }
        return _drive(spec, len(jobs), [job.get("name", str(i)) for i, job in enumerate(jobs)], timeout, folder)


def metadata_ranges(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of ``path`` that are not stored chunk / contiguous data: the HDF5 metadata."""
    import h5py

    data: list[tuple[int, int]] = []
    if not h5py.is_hdf5(path):
        return [(0, path.stat().st_size)]  # a torch.save zip: every byte is structure to mutate
    with h5py.File(path, "r") as handle:

        def visit(name: str, obj: Any) -> None:
            if not isinstance(obj, h5py.Dataset):
                return
            if obj.chunks is None:
                offset = obj.id.get_offset()
                if offset is not None:
                    data.append((offset, offset + obj.id.get_storage_size()))
                return
            obj.id.chunk_iter(lambda info: data.append((info.byte_offset, info.byte_offset + info.size)))

        handle.visititems(visit)
    size = path.stat().st_size
    ranges, cursor = [], 0
    for start, stop in sorted(data):
        if start > cursor:
            ranges.append((cursor, start))
        cursor = max(cursor, stop)
    if cursor < size:
        ranges.append((cursor, size))
    return ranges


def run_fuzz(
    bases: dict[str, Path],
    commands: list[dict[str, Any]],
    *,
    count: int,
    seed: int,
    timeout: float = 60.0,
    address_space_limit: int | None = 4 << 30,
    probe_timeout: float = 5.0,
    workers: int = 1,
    workdir: Path,
) -> Report:
    """Run ``count`` seeded mutants; mutant ``i`` goes to ``commands[i % len(commands)]``.

    ``commands``: ``{"name", "argv" (with {src} and {dst}), "source" (a key of ``bases``), "writes",
    "in_place"}`` and optionally ``"output"``, the output's name with ``{index}`` (``o{index}.h5`` if not given;
    a Minari dataset's folder must be named like an id: ``o{index}-v0``).
    ``workers`` children share the mutants (contiguous ranges), each in its own folder.
    """
    hot = {kind: metadata_ranges(path) for kind, path in bases.items()}
    edges = [count * k // workers for k in range(workers + 1)]
    started = time.perf_counter()

    def one(k: int) -> Report:
        folder = workdir / f"worker-{k}"
        folder.mkdir(parents=True, exist_ok=True)
        mutants = folder / "mutants"
        mutants.mkdir(exist_ok=True)
        warmup = []
        for command in commands:  # each command once on its intact base: imports and JIT before the baseline
            src = mutants / f"warm-{len(warmup)}.h5"
            src.write_bytes(bases[command["source"]].read_bytes())
            dst = mutants / command.get("output", "o{index}.h5").format(index="")
            argv = [a.replace("{src}", str(src)).replace("{dst}", str(dst)) for a in command["argv"]]
            warmup.append({"argv": argv, "src": str(src), "folder": str(mutants)})
        spec = {
            "kind": "fuzz",
            "seed": seed,
            "commands": commands,
            "workdir": str(mutants),
            "bases": {kind: str(path) for kind, path in bases.items()},
            "warmup": warmup,
            "hot": hot,
            "address_space_limit": address_space_limit,
            "probe_timeout": probe_timeout,
        }
        return _drive(spec, edges[k + 1], None, timeout, folder, start=edges[k])

    with ThreadPoolExecutor(max_workers=workers) as pool:
        parts = list(pool.map(one, range(workers)))
    report = Report(
        results=[r for part in parts for r in part.results],
        baseline_kb=max(part.baseline_kb for part in parts),
        restarts=sum(part.restarts for part in parts),
        open_fds=max(part.open_fds for part in parts),
    )
    report.seconds = time.perf_counter() - started
    return report


if __name__ == "__main__":
    sys.path.insert(0, str(TESTS))
    child(sys.argv[1])
