"""``RolloutWriter``: the one way to write a rollout file from any training loop, one step at a time.

Each :meth:`RolloutWriter.add` takes the step as a dict (or TensorDict) of tensors or arrays on any device,
checks it against the format (and against the first step: the same fields, shapes and dtypes every step) and
copies it into a host block of steps. Full blocks are written on rolloutcli's I/O thread while the loop fills the
next one (two blocks at most: memory stays bounded); an error there is raised by the next ``add``, ``close`` or
``wait``. The file is published atomically by :meth:`RolloutWriter.close`; until then it lives as a temporary
beside its name.

Step fields (per env ``n`` of ``N``, stored ``[T, N, ...]``): ``observations`` (a tensor, stored as the group
``policy``, or a dict of groups), ``actions``, ``rewards`` (raw: the env's reward, no time-out bootstrap),
``dones`` (the episode ended after this step), ``time_outs`` (the training code bootstraps there; implies
``dones``), ``values`` (V(s_t)), ``actions_log_prob``, ``distribution`` (dict of parameters, order kept),
``hidden_states`` (``{"actor": h or (h, c), "critic": ...}``, each ``[layers, N, hidden]``),
``final_observations`` (dict or tensor: the observation that ended the episode, before the reset; may be given
at done steps only), ``final_values`` (V of it) and ``extras`` (a dict of more ``[N, ...]`` datasets).
"""

from __future__ import annotations

import functools
import json
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np

import rolloutcli.record.checks as checks
from rolloutcli.errors import RolloutError
from rolloutcli.hdf5.append import AppendFile
from rolloutcli.hdf5.writer import to_numpy

PER_ENV = ("rewards", "dones", "time_outs", "values", "actions_log_prob", "final_values")  # [N] per step
FLAGS = ("dones", "time_outs")
GROUPS = ("observations", "distribution", "final_observations")
SPARSE = ("final_observations", "final_values")  # may be given at some steps only (zeros elsewhere)
KNOWN = (*PER_ENV, *GROUPS, "actions", "hidden_states", "extras")
_BLOCK_BYTES = 8 << 20  # buffered steps are written when they reach this size


@functools.cache
def _io_pool() -> ThreadPoolExecutor:
    """One thread writing blocks and publishing files in the order they were handed over (h5py's data writes
    and the fsync release the GIL there, so the loop goes on meanwhile)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutcli-record")


def _capacity(step_bytes: int, num_steps: int | None) -> int:
    """Steps per block: a power of two (so whole chunks are written, see ``AppendFile``), at most num_steps."""
    capacity = 1 << max(0, (max(1, _BLOCK_BYTES // max(1, step_bytes))).bit_length() - 1)
    return min(capacity, num_steps or capacity)


@functools.cache
def _versions() -> str:
    import importlib.metadata as metadata

    found = {}
    for name in ("rolloutcli", "numpy", "h5py", "torch"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return json.dumps(found, sort_keys=True)


class RolloutWriter:
    """Write a rollout file step by step: ``add(step)`` per step, then ``close(last_values=...)``.

    ``num_steps``: the most steps accepted (None: any). ``compression``: None, ``"gzip"`` or ``"lzf"``.
    ``gamma``/``lam`` (when given) and ``attrs`` are root attributes (``attrs`` may not set those the writer or the
    format sets: ``format_version``, ``timeouts_bootstrapped``, ...); ``recorded_from_reset``: every env's first
    step starts an episode; ``timeouts_rule``: the trainer's time-out rule (``rsl``, ``final-value``, ``proper``,
    ``ignore``; None: none written); ``recording_id``/``recording_index`` (both or neither): file ``recording_index``
    (0, 1, ...) of the consecutive recording ``recording_id`` (format 1.2). NaN/Inf in ``rewards``, ``values``,
    ``final_values`` (at done steps) or ``last_values`` is refused, naming the step and env, unless
    ``allow_nonfinite`` (kept as given; ``gae`` then refuses the file). Usable as a context manager: an exception
    inside discards the file.
    """

    def __init__(
        self,
        path: str | Path,
        num_envs: int,
        num_steps: int | None = None,
        compression: str | None = None,
        *,
        gamma: float | None = None,
        lam: float | None = None,
        recorded_from_reset: bool = False,
        recorder: str = "rolloutcli.record.RolloutWriter",
        timeouts_rule: str | None = None,
        recording_id: str | None = None,
        recording_index: int | None = None,
        attrs: dict[str, Any] | None = None,
        overwrite: bool = False,
        allow_nonfinite: bool = False,
    ) -> None:
        checks.check_attrs(path, attrs or {})
        if num_envs < 1 or (num_steps is not None and num_steps < 1):
            raise ValueError(f"num_envs and num_steps must be positive, found {num_envs} and {num_steps}")
        self.path, self.num_envs, self.num_steps = Path(path), num_envs, num_steps
        self.steps, self.closed, self.allow_nonfinite = 0, False, allow_nonfinite
        self._pending: Future[Any] | None = None  # the last job handed to the I/O thread
        self._schema: dict[str, tuple[tuple[int, ...], np.dtype]] = {}  # dataset -> per-step shape, dtype
        self._blocks: dict[str, np.ndarray] = {}  # dataset -> [capacity, ...] rows being filled
        self._spare: dict[str, np.ndarray] = {}  # the blocks the I/O thread writes (or wrote) last
        self._capacity, self._count = 0, 0  # rows per block (set at step 0), rows filled
        self._start = 0  # the step of the block's first row
        self._order: list[str] = []
        root = {
            **checks.format_attrs(path, timeouts_rule),
            "recorder": recorder,
            "versions": _versions(),
            "gamma": gamma,
            "lam": lam,
            "recorded_from_reset": bool(recorded_from_reset),
            "timeouts_bootstrapped": False,
            **checks.recording_attrs(path, recording_id, recording_index),
            **(attrs or {}),
        }
        self._file = AppendFile(self.path, compression=compression, overwrite=overwrite)
        self._guard(lambda: self._file.set_attrs(root))

    def __enter__(self) -> RolloutWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if kind is not None:
            self.abort()
        elif not self.closed:
            self.close()

    def _error(self, field: str, expected: str, found: str, fix: str = "", at: int | None = None) -> RolloutError:
        """The one-line problem at step ``at`` (default: the next step to be added)."""
        return RolloutError.field(f"{self.path}: step {self.steps if at is None else at}", field, expected, found, fix)

    def _guard(self, fn: Any) -> Any:
        """Run a write; on failure (disk full, I/O error) discard the file and raise."""
        try:
            return fn()
        except BaseException:
            self.abort()
            raise

    def add(self, step: Any) -> None:
        """Check one step of every env and buffer it (see the module docstring for the fields)."""
        self._add(step, block=False)

    def add_steps(self, steps: Any) -> None:
        """Check and buffer ``k`` steps at once: every field of :meth:`add` with a leading axis of ``k`` steps
        (``[k, N, ...]``; hidden states ``[k, layers, N, hidden]``). The same checks and the same file as ``k``
        calls of :meth:`add`; ``final_observations``/``final_values`` are given for all ``k`` steps or none."""
        self._add(steps, block=True)

    def _add(self, step: Any, block: bool) -> None:
        if self.closed:
            raise self._error("step", "add() before close()", "add() after close()", "Open a new RolloutWriter.")
        self._raise_io_error()
        arrays = self._flatten(step.to_dict() if hasattr(step, "to_dict") else dict(step))
        arrays = arrays if block else {name: value[None] for name, value in arrays.items()}
        k = self._steps_of(arrays)
        if self.num_steps is not None and self.steps + k > self.num_steps:
            more = "one more" if self.steps + k == self.num_steps + 1 else f"{self.steps + k - self.num_steps} more"
            raise self._error("step", f"at most num_steps={self.num_steps} steps", more, at=self.num_steps)
        self._check(arrays)
        if not self._capacity:
            self._capacity = _capacity(sum(a.nbytes for a in arrays.values()) // k, self.num_steps)
        done = 0
        while done < k:  # the one copy: the loop may reuse its tensors in place
            n = min(k - done, self._capacity - self._count)
            for name, value in arrays.items():
                if name not in self._blocks:
                    self._blocks[name] = np.zeros((self._capacity, *value.shape[1:]), value.dtype)
                self._blocks[name][self._count : self._count + n] = value[done : done + n]
            self._count, self.steps, done = self._count + n, self.steps + n, done + n
            if self._count == self._capacity:
                self._flush()

    def _steps_of(self, arrays: dict[str, np.ndarray]) -> int:
        """The steps a block holds: the leading length every field shares."""
        lengths = {value.shape[0] if value.ndim else 0 for value in arrays.values()}
        if len(lengths) != 1 or 0 in lengths:
            found = ", ".join(f"{n} {list(v.shape)}" for n, v in arrays.items())
            raise self._error("steps", "one leading number of steps (at least 1) in every field", found)
        return lengths.pop()

    def _raise_io_error(self) -> None:
        """Raise what went wrong on the I/O thread (the file is discarded first)."""
        pending = self._pending
        if pending is not None and pending.done() and pending.exception() is not None:
            self.abort()
            raise pending.exception()  # type: ignore[misc]

    def _flatten(self, step: dict[str, Any]) -> dict[str, np.ndarray]:
        """Dataset name -> host array (``[N, ...]``; hidden states ``[layers, N, hidden]``): a view where it can be
        (:meth:`add` copies it into its block at once)."""
        arrays: dict[str, np.ndarray] = {}
        for key, value in step.items():
            if key not in KNOWN:
                raise self._error(key, f"one of {', '.join(KNOWN)}", "an unknown field", "Check the name.")
            if value is None:
                continue
            if key in GROUPS and hasattr(value, "items"):  # a dict or TensorDict of groups
                for name, part in value.items():
                    checks.check_group_key(f"{self.path}: step {self.steps}", key, name)
                    arrays[f"{key}/{name}"] = to_numpy(part)
                    if key == "distribution" and name not in self._order:
                        self._order.append(name)
            elif key in GROUPS:
                arrays[f"{key}/policy" if key != "distribution" else key] = to_numpy(value)
            elif key == "extras":  # more [N, ...] datasets, stored under their own names
                for name, part in dict(value).items():
                    checks.check_extras_name(f"{self.path}: step {self.steps}", name)
                    arrays[f"extras:{name}"] = to_numpy(part)
            elif key == "hidden_states":
                for net, state in dict(value).items():
                    checks.check_group_key(f"{self.path}: step {self.steps}", key, net)
                    parts = state if isinstance(state, tuple | list) else (state,)
                    for i, part in enumerate(parts):
                        arrays[f"hidden_states/{net}/{i}"] = to_numpy(part)
            else:
                arrays[key] = to_numpy(value)
        return arrays

    def _first(self, bad: np.ndarray) -> int:
        """The step of the first true entry of ``bad [k, ...]``."""
        return self.steps + int(np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1))[0])

    def _check(self, arrays: dict[str, np.ndarray]) -> None:
        """Check a block (every field ``[k, ...]``) against the format and against step 0."""
        N = self.num_envs
        for name, value in arrays.items():
            if name in PER_ENV and value.shape[1:] == (N, 1):
                arrays[name] = value = value.reshape(value.shape[0], N)
            self._check_one(name, value[0], N)
        missing = [k for k in ("actions", "rewards", "dones") if k not in arrays]
        if not any(n.startswith("observations/") for n in arrays):
            missing.insert(0, "observations")
        for name in missing:
            raise self._error(name, "a value at every step", "nothing", f"Pass step['{name}'].")
        flags = {k: arrays[k] for k in FLAGS if k in arrays}
        for name, value in flags.items():
            bad = (value != 0) & (value != 1) if value.dtype != np.bool_ else None
            if bad is not None and bad.any():
                at = self._first(bad)
                found = f"{np.unique(value[at - self.steps])[:4].tolist()}"
                raise self._error(name, "flags 0/1 (or bool)", found, at=at)
        if "time_outs" in flags:
            bad = flags["time_outs"].astype(bool) & ~flags["dones"].astype(bool)
            if bad.any():
                raise self._error(
                    "time_outs", "time-outs only where dones is 1", "a time-out where dones is 0",
                    "Set dones there too.", at=self._first(bad),
                )  # fmt: skip
        for name, value in flags.items():
            arrays[name] = value.astype(np.uint8)
        self._check_finite(arrays)
        for name, value in arrays.items():
            self._against_schema(name, value[0])
        absent = [n for n in self._schema if n not in arrays and not n.startswith(SPARSE)]
        if absent:
            raise self._error(absent[0], "a value at every step (given at step 0)", "nothing")

    def _check_finite(self, arrays: dict[str, np.ndarray]) -> None:
        """Refuse NaN/Inf where ``gae`` computes with them (final values: at done steps only)."""
        if self.allow_nonfinite:
            return
        for name in ("rewards", "values", "final_values"):
            if name in arrays:
                at = checks.first_nonfinite(name, arrays[name], arrays["dones"] if name == "final_values" else None)
                if at is not None:
                    found = f"{arrays[name][at].reshape(-1)[:1][0]} at env {at[1]}"
                    raise self._error(name, "finite numbers", found, checks.NONFINITE_FIX, at=self.steps + at[0])

    def _check_one(self, name: str, value: np.ndarray, N: int) -> None:
        """Check one step's ``value`` (a step of a block: every step of it has its shape and dtype)."""
        if name.startswith("hidden_states/"):
            if value.ndim != 3 or value.shape[1] != N:
                raise self._error(name, f"[layers, {N}, hidden]", str(list(value.shape)))
        elif name in PER_ENV and value.shape != (N,):
            raise self._error(name, f"shape [{N}] (one per env)", str(list(value.shape)))
        elif name not in PER_ENV and (value.ndim < 1 or value.shape[0] != N):
            raise self._error(name, f"shape [{N}, ...] (envs first)", str(list(value.shape)))
        kind = value.dtype.kind
        if name in FLAGS:  # float flags too (SB3's are float32): their values are checked to be 0/1
            ok = kind in "biuf"
        elif name.startswith(("observations/", "final_observations/", "last_observations/", "extras:")):
            ok = kind in "fiub"
        elif name == "actions":
            ok = kind in "fiub"
        else:
            ok = kind == "f"
        if not ok:
            raise self._error(name, "a float dtype" if name not in FLAGS else "bool or integer flags", str(value.dtype))

    def _against_schema(self, name: str, value: np.ndarray) -> None:
        known = self._schema.get(name)
        if known is None:
            if self.steps and not name.startswith(SPARSE):
                raise self._error(name, "only the fields of step 0", "a new field", "Give it at every step.")
            self._schema[name] = (value.shape, value.dtype)
        elif known != (value.shape, value.dtype):
            raise self._error(name, f"{known[1]} {list(known[0])} as at step 0", f"{value.dtype} {list(value.shape)}")

    def _flush(self, last: bool = False) -> None:
        """Hand the filled block to the I/O thread, once it has written the previous one (whose buffers are
        then filled next): two blocks at most."""
        if not self._count:
            return
        self._wait_io()
        blocks, start, count = self._blocks, self._start, self._count
        self._pending = _io_pool().submit(self._write, blocks, start, count, not last)
        self._blocks, self._spare = self._spare, blocks
        self._start += count
        self._count = 0

    def _wait_io(self) -> None:
        if self._pending is not None:
            try:
                self._pending.result()
            except BaseException:
                self.abort()
                raise

    def _write(self, blocks: dict[str, np.ndarray], start: int, count: int, more: bool) -> None:
        """On the I/O thread: write ``count`` rows of every block at ``start`` (``more``: blocks follow, so the
        disk may start on these now; the last one is left to the publish's fsync)."""
        for name, block in blocks.items():
            self._file.extend(name.removeprefix("extras:"), start, block[:count])
            if name.startswith(SPARSE):  # rows a later step does not give read as zeros
                block[:count] = 0
        if more:
            self._file.sync_early()

    def close(self, last_values: Any = None, last_observations: Any = None, *, background: bool = False) -> Path:
        """Write what is buffered, ``last_values [N]`` and ``last_observations``, and publish the file.

        ``background``: write and publish on rolloutcli's I/O thread (the loop goes on meanwhile); :meth:`wait`
        returns when the file is published and raises what went wrong.
        """
        if self.closed:
            raise self._error("close", "one close()", "a second close()")
        if not self.steps:
            self.abort()
            raise self._error("step", "at least one step before close()", "none", "Call add() first.")
        extra: dict[str, np.ndarray] = {}
        if last_values is not None:
            value = checks.last_values_of(self.path, to_numpy(last_values), self.num_envs, self.allow_nonfinite)
            extra["last_values"] = value
        elif "values" in self._schema:
            warnings.warn(
                f"{self.path}: values were recorded but close() got no last_values; none written.", stacklevel=2
            )
        if last_observations is not None:
            groups = last_observations if isinstance(last_observations, dict) else {"policy": last_observations}
            for key, group in groups.items():
                value = to_numpy(group)
                self._check_one(f"last_observations/{key}", value, self.num_envs)
                extra[f"last_observations/{key}"] = value
        self._flush(last=True)
        self.closed = True
        self._pending = _io_pool().submit(self._finish, extra, self._pending)
        if not background:
            self._wait_io()
        return self.path

    def wait(self) -> Path:
        """The published path, once a background :meth:`close` has finished (raises its error)."""
        self._wait_io()
        return self.path

    def _finish(self, extra: dict[str, np.ndarray], last: Future[Any] | None) -> None:
        """On the I/O thread, after the last block: pad, write ``extra`` and publish (or discard on failure)."""
        try:
            if last is not None:
                last.result()  # done (the thread runs jobs in order): raises the last block's error
            self._finish_file(extra)
        except BaseException:
            self._file.abort()
            raise

    def _finish_file(self, extra: dict[str, np.ndarray]) -> None:
        for name in self._schema:
            self._file.pad(name.removeprefix("extras:"), self.steps)
        for name, value in extra.items():
            self._file.put(name, value)
        if self._order:
            self._file.set_attrs({"order": self._order}, "distribution")
        self._file.commit()

    def abort(self) -> None:
        """Discard the recording: nothing is published (a block being written is waited for first)."""
        self.closed = True
        pending, self._pending = self._pending, None
        if pending is not None:
            wait([pending])
        self._file.abort()
