"""Read a rollout file: open safely, validate everything up front, then read env blocks as tensors.

Validation happens in two passes before any work: ``schema.describe`` (structure, no data read) and
``check_values`` (streams env blocks: NaN/Inf in rewards/values/last_values, flags outside {0, 1},
time-outs where dones is 0). Every problem is reported at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import numpy as np

from rolloutcli.errors import EXIT_BAD_DATA, RolloutError, problem_line
from rolloutcli.hdf5.limits import DEFAULT_MAX_MEMORY
from rolloutcli.hdf5.safety import HDF5_ERRORS, SafetyOptions, open_hdf5, translate_hdf5_error
from rolloutcli.hdf5.schema import FLAG_FIELDS, FLOAT_COMPUTE_FIELDS, SCALAR_FIELDS, RolloutSchema, describe

if TYPE_CHECKING:  # torch is imported only by the tensor readers, so that `gae` on the CPU never loads it
    import torch


def env_blocks(num_envs: int, bytes_per_env: int, budget: int) -> list[tuple[int, int]]:
    """Split ``range(num_envs)`` into contiguous ``(start, stop)`` blocks of at most ``budget`` bytes.

    A block always holds at least one env (a single env larger than the budget is still processed).
    """
    per_block = max(1, budget // max(bytes_per_env, 1))
    return [(start, min(start + per_block, num_envs)) for start in range(0, num_envs, per_block)]


class RolloutReader:
    """An open, audited, validated rollout file. Use as a context manager or call ``close``.

    ``read(name, start, stop)`` returns the env slice ``[start:stop]`` of a field as a numpy array in
    native byte order; ``tensors(names, start, stop, device)`` returns normalised torch tensors:
    scalar per-step fields ``[T, n]`` (a trailing 1 squeezed), rewards/values/last_values float32,
    dones/time_outs uint8 0/1, everything else in its stored dtype.
    """

    def __init__(
        self,
        path: Path | str,
        options: SafetyOptions | None = None,
        *,
        check: bool = True,
        budget: int = DEFAULT_MAX_MEMORY,
    ) -> None:
        self.path = Path(path)
        self.budget = budget
        self._stack = contextlib.ExitStack()
        self.handle: h5py.File = self._stack.enter_context(open_hdf5(self.path, options))
        try:
            schema, problems = self._guard(lambda: describe(self.path, self.handle))
            if problems or schema is None:
                raise RolloutError.many(self.path, problems, exit_code=EXIT_BAD_DATA)
            self.schema: RolloutSchema = schema
            if check:
                self.check_values()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> RolloutReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    @property
    def T(self) -> int:
        return self.schema.T

    @property
    def N(self) -> int:
        return self.schema.N

    def _guard(self, fn, field: str | None = None):  # noqa: ANN001, ANN202 - internal trampoline
        try:
            return fn()
        except RolloutError:
            raise
        except HDF5_ERRORS as exc:
            raise translate_hdf5_error(self.path, exc, field) from exc

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Env slice ``[start:stop]`` of field ``name`` as stored (native byte order)."""
        spec = self.schema.fields[name]
        stop = self.N if stop is None else stop
        dataset = self.handle[name]
        if spec.env_axis is None:
            data = self._guard(lambda: dataset[()], name)
        else:
            index = [slice(None)] * len(spec.shape)
            index[spec.env_axis] = slice(start, stop)
            data = self._guard(lambda: dataset[tuple(index)], name)
        data = np.asarray(data)
        if not data.dtype.isnative:
            data = data.astype(data.dtype.newbyteorder("="))
        return data

    def array(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Normalised C-contiguous numpy array of a field's env slice (the dtypes and shapes of ``tensor``)."""
        spec = self.schema.fields[name]
        data = self.read(name, start, stop)
        role = spec.role
        if role in SCALAR_FIELDS and data.ndim == 3:
            data = data[..., 0]
        if role == "last_values" and data.ndim == 2:
            data = data[:, 0]
        if role in FLAG_FIELDS:
            data = (data != 0).astype(np.uint8)
        elif role in FLOAT_COMPUTE_FIELDS or role in ("advantages", "returns"):
            data = data.astype(np.float32, copy=False)  # float16 inputs upcast; GAE never runs in float16
        return np.ascontiguousarray(data)

    def normalized(self, name: str, start: int = 0, stop: int | None = None) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape :meth:`array` returns for this env slice, from the metadata alone (no read)."""
        spec = self.schema.fields[name]
        shape = list(spec.shape)
        if spec.env_axis is not None and shape:
            shape[spec.env_axis] = (self.N if stop is None else stop) - start
        role = spec.role
        if role in SCALAR_FIELDS and len(shape) == 3 and shape[2] == 1:
            shape = shape[:2]
        if role == "last_values" and len(shape) == 2 and shape[1] == 1:
            shape = shape[:1]
        dtype = spec.dtype.newbyteorder("=") if not spec.dtype.isnative else spec.dtype
        if role in FLAG_FIELDS:
            dtype = np.dtype(np.uint8)
        elif role in FLOAT_COMPUTE_FIELDS or role in ("advantages", "returns"):
            dtype = np.dtype(np.float32)
        return np.dtype(dtype), tuple(shape)

    def arrays(self, names: Iterable[str], start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
        return {name: self.array(name, start, stop) for name in names}

    def tensor(
        self, name: str, start: int = 0, stop: int | None = None, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """Normalised tensor of a field's env slice (see the class docstring)."""
        import torch

        return torch.from_numpy(self.array(name, start, stop)).to(device)

    def tensors(
        self, names: Iterable[str], start: int = 0, stop: int | None = None, device: torch.device | str = "cpu"
    ) -> dict[str, torch.Tensor]:
        return {name: self.tensor(name, start, stop, device) for name in names}

    def blocks(self, names: Sequence[str], budget: int | None = None) -> list[tuple[int, int]]:
        """Env blocks such that reading ``names`` for one block stays within ``budget`` bytes."""
        per_env = sum(self.schema.fields[n].bytes_per_env() for n in names)
        return env_blocks(self.N, per_env, self.budget if budget is None else budget)

    def check_values(self) -> None:
        """Stream env blocks and raise one ``RolloutError`` listing every value problem."""
        fields = self.schema.fields
        names = [n for n in ("rewards", "values", "last_values", "dones", "time_outs") if n in fields]
        counts: dict[str, int] = {}
        for start, stop in self.blocks(names):
            block = {n: self.read(n, start, stop) for n in names}
            for name in ("rewards", "values", "last_values"):
                if name in block and block[name].dtype.kind == "f":
                    counts[f"nonfinite:{name}"] = counts.get(f"nonfinite:{name}", 0) + int(
                        np.count_nonzero(~np.isfinite(block[name]))
                    )
            for name in FLAG_FIELDS:
                if name in block:
                    data = block[name]
                    if data.dtype.kind != "b":
                        counts[f"flag:{name}"] = counts.get(f"flag:{name}", 0) + int(
                            np.count_nonzero((data != 0) & (data != 1))
                        )
            if "time_outs" in block:
                time_outs = block["time_outs"].reshape(-1) != 0
                orphan = time_outs & (block["dones"].reshape(-1) == 0)
                counts["orphan"] = counts.get("orphan", 0) + int(np.count_nonzero(orphan))
        problems = []
        for name in ("rewards", "values", "last_values"):
            found = counts.get(f"nonfinite:{name}", 0)
            if found:
                problems.append(
                    problem_line(
                        self.path,
                        name,
                        "finite numbers",
                        f"{found} NaN/Inf values",
                        "Fix the recorder or drop the affected envs.",
                    )
                )
        for name in FLAG_FIELDS:
            found = counts.get(f"flag:{name}", 0)
            if found:
                problems.append(
                    problem_line(
                        self.path,
                        name,
                        "only 0 and 1",
                        f"{found} other values",
                        "Store episode-end flags as bool or 0/1.",
                    )
                )
        if counts.get("orphan", 0):
            problems.append(
                problem_line(
                    self.path,
                    "time_outs",
                    "time-outs only where dones is 1",
                    f"{counts['orphan']} time-outs where dones is 0",
                    "A time-out ends the episode: set dones there too.",
                )
            )
        if problems:
            raise RolloutError.many(self.path, problems, exit_code=EXIT_BAD_DATA)


@contextlib.contextmanager
def open_rollout(
    path: Path | str, options: SafetyOptions | None = None, *, check: bool = True, budget: int = DEFAULT_MAX_MEMORY
) -> Iterator[RolloutReader]:
    """Open, audit and validate ``path``; yields a ``RolloutReader``."""
    reader = RolloutReader(path, options, check=check, budget=budget)
    try:
        yield reader
    finally:
        reader.close()
