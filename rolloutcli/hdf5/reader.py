"""Read HDF5 inputs: the one front door for pipelines and the library (no caller holds an h5py object).

``H5Input`` is any audited, read-only file: dataset metadata, root attributes and slices as numpy arrays, every
libhdf5 failure translated to a one-line ``RolloutError`` naming the field. ``RolloutReader`` adds the rollout
contract: the schema, the value checks (streamed in env blocks) and reads normalised by :mod:`rolloutcli.fields`.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import h5py
import numpy as np

from rolloutcli.errors import EXIT_BAD_DATA, RolloutError, problem_line
from rolloutcli.fields import by_flag
from rolloutcli.hdf5.identity import identity, path_identity
from rolloutcli.hdf5.limits import DEFAULT_MAX_MEMORY, check_one_env_fits
from rolloutcli.hdf5.listing import Listing, from_json, list_datasets, read_attrs, selects_all
from rolloutcli.hdf5.probe import probe_metadata
from rolloutcli.hdf5.safety import HDF5_ERRORS, SafetyOptions, open_listed, translate_hdf5_error
from rolloutcli.hdf5.schema import DatasetInfo, RolloutSchema, describe
from rolloutcli.hdf5.typecache import memory_type

if TYPE_CHECKING:  # torch is imported only by the tensor readers, so that `gae` on the CPU never loads it
    import torch

R = TypeVar("R")
_NONFINITE_FIX = "Fix the recorder or drop the affected envs."
_FLAG_FIX = "Store episode-end flags as bool or 0/1."
_ORPHAN_FIX = "A time-out ends the episode: set dones there too."


def env_blocks(num_envs: int, bytes_per_env: int, budget: int) -> list[tuple[int, int]]:
    """Split ``range(num_envs)`` into contiguous ``(start, stop)`` blocks of at most ``budget`` bytes (at least
    one env each, even when one env is larger than the budget)."""
    per_block = max(1, budget // max(bytes_per_env, 1))
    return [(start, min(start + per_block, num_envs)) for start in range(0, num_envs, per_block)]


SMALL_READS = 1 << 20  # bytes of small datasets read whole an open file keeps (see ``H5Input.slice``)
_KEPT: list[Any] = [None]  # inside ``kept_open``: a list of at most one (key, identity, open state); else None


@contextlib.contextmanager
def kept_open() -> Iterator[None]:
    """Inside the block, closing an ``H5Input`` keeps its file open (the last one closed, no more), and the next
    ``H5Input`` of the same path and options takes it over while it is the same file (device, inode, size,
    modification and change times, as the open descriptor had them) instead of probing, opening, auditing and
    listing it again: a dataset's unit opens its input twice (the check of its fields, then the command's own)."""
    if _KEPT[0] is not None:
        yield
        return
    _KEPT[0] = []
    try:
        yield
    finally:
        _drop_kept()
        _KEPT[0] = None


def _keep(key: tuple[Any, ...], state: tuple[Any, ...]) -> bool:
    """Keep ``state`` (an input being closed: its stack, handle, listing, attributes) for the next ``H5Input`` of
    ``key``; False when not keeping."""
    if _KEPT[0] is None:
        return False
    try:
        found = identity(os.fstat(state[1].id.get_vfd_handle()))
    except (OSError, *HDF5_ERRORS):
        return False
    _drop_kept()
    _KEPT[0].append((key, found, state))
    return True


def _take_kept(key: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The kept open state of ``key``'s file when it is still the same file, else None."""
    if not _KEPT[0] or _KEPT[0][0][0] != key:
        return None
    _, kept, state = _KEPT[0].pop()
    if path_identity(key[0]) != kept:
        state[0].close()
        return None
    return state


def _drop_kept() -> None:
    while _KEPT[0]:
        _KEPT[0].pop()[2][0].close()


class H5Input:
    """An audited, read-only HDF5 file. Use as a context manager or call ``close``.

    Attributes:
        path: the file.
        datasets: every dataset reachable by hard links, ``{path: DatasetInfo}`` (as stored).
        named_types: paths of the committed (named) datatypes.
        attrs: root attributes as plain data.
    """

    def __init__(self, path: Path | str, options: SafetyOptions | None = None) -> None:
        self.path = Path(path)
        self._key, self._closed = (os.path.abspath(self.path), options), False
        self._objects: dict[str, h5py.Dataset] = {}
        self._ids: dict[str, Any] = {}  # low-level objects, by name (see ``opened``)
        self._small: dict[str, np.ndarray] = {}  # small datasets read whole (see ``slice``)
        self._small_bytes = 0
        kept = _take_kept(self._key)
        if kept is not None:
            self._stack, self.handle, named_types, datasets, attrs = kept
            self.named_types, self.datasets, self.attrs = list(named_types), dict(datasets), dict(attrs)
            return
        self._stack = contextlib.ExitStack()
        self.handle: h5py.File
        self.handle, listing = self._stack.enter_context(open_listed(self.path, options))
        try:
            if listing is None:  # the probe sent none: listed here
                datasets, named_types = self.guard(lambda: list_datasets(self.handle))
                listing = Listing(datasets, named_types, self.attrs_of(""))
            self.datasets: dict[str, DatasetInfo] = listing.datasets
            self.named_types: list[str] = listing.named_types
            self.attrs: dict[str, Any] = listing.attrs
        except BaseException:
            self._stack.close()
            raise

    def __enter__(self) -> H5Input:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            state = (self._stack, self.handle, self.named_types, self.datasets, self.attrs)
            if not _keep(self._key, state):
                self._stack.close()

    def guard(self, fn: Callable[[], R], field: str | None = None) -> R:
        """Run ``fn`` (h5py calls on this file); an HDF5 failure or MemoryError becomes a ``RolloutError``."""
        try:
            return fn()
        except (*HDF5_ERRORS, MemoryError) as exc:
            raise translate_hdf5_error(self.path, exc, field) from exc

    def raw_attr(self, name: str) -> Any:
        """The root attribute ``name`` as stored (bytes not decoded, an array of any size an array), or None: for a
        reader that must not take a decoded or described value for the real one (a recording's id)."""
        return self.guard(lambda: self.handle.attrs.get(name), None)

    def attrs_of(self, name: str) -> dict[str, Any]:
        """Attributes of the object at ``name`` (``""``: the root) as plain data."""
        obj = self.handle[name] if name else self.handle
        return self.guard(lambda: read_attrs(obj), name or None)

    def dataset(self, name: str) -> h5py.Dataset:
        """The dataset at ``name``, looked up once, through the low-level API (a lookup by path with h5py's
        ``File[name]`` costs about 0.12 ms, this one 0.04: a small file read field by field paid it on every
        read)."""
        found = self._objects.get(name)
        if found is None:
            obj = self.opened(name)
            found = h5py.Dataset(obj) if isinstance(obj, h5py.h5d.DatasetID) else self.handle[name]
            self._objects[name] = found
        return found

    def opened(self, name: str) -> Any:
        """The low-level object at ``name``, opened once (a whole read needs no ``h5py.Dataset``: ~40 us)."""
        found = self._ids.get(name)
        if found is None:
            found = self._ids[name] = h5py.h5o.open(self.handle.id, name.encode() if isinstance(name, str) else name)
        return found

    def slice(self, name: str, index: tuple[Any, ...] = ()) -> np.ndarray:
        """``dataset[index]`` in native byte order (``()``: the whole dataset). A small dataset read whole is
        kept (up to ``SMALL_READS`` bytes a file) and copied on the next read: the value checks read the fields
        a command then reads again, and each read of a small file's field costs about 0.1 ms."""
        info = self.datasets.get(name)
        whole = info is not None and selects_all(index, info.shape)
        if whole and name in self._small:
            return self._small[name].copy()
        if whole and self._plain(name):
            data = self._read_whole(name)
        else:
            data = np.asarray(self.guard(lambda: self.dataset(name)[index], name))
            if not data.dtype.isnative:
                data = data.astype(data.dtype.newbyteorder("="))
        if whole and self._small_bytes + data.nbytes <= SMALL_READS:
            self._small[name], self._small_bytes = data.copy(), self._small_bytes + data.nbytes
        return data

    def _plain(self, name: str) -> bool:
        """Whether dataset ``name`` holds plain numbers (no bool enum, strings, compound), at least one."""
        info = self.datasets[name]
        return info.dtype.kind in "iuf" and info.dtype.metadata is None and math.prod(info.shape) > 0

    def _read_whole(self, name: str) -> np.ndarray:
        """All of a plain numeric dataset, native byte order (libhdf5 converts it), through the low-level read:
        h5py's ``Dataset[()]`` costs ~0.15 ms of a small field's ~0.05 (issue 39)."""
        info = self.datasets[name]
        out = np.empty(info.shape, info.dtype.newbyteorder("="))
        self.guard(lambda: self.opened(name).read(h5py.h5s.ALL, h5py.h5s.ALL, out, memory_type(out.dtype)), name)
        return out

    def read_into(self, name: str, rows: slice, out: np.ndarray) -> None:
        """``out[...] = dataset[rows]`` for a numeric dataset and a native-order ``out`` of that shape (libhdf5
        converts the byte order): a buffer used again for every block is not allocated and faulted in anew."""
        self.guard(lambda: self.dataset(name).read_direct(out, np.s_[rows]), name)


class RolloutShape:
    """``T`` and ``N`` of a rollout file, from its ``schema`` (a reader of it, or its probe's listing)."""

    schema: RolloutSchema

    @property
    def T(self) -> int:
        return self.schema.T

    @property
    def N(self) -> int:
        return self.schema.N


@dataclass(frozen=True)
class Listed(RolloutShape):
    """A rollout file's ``path`` and ``schema`` (``T``, ``N``), as a ``RolloutReader`` of it has them, from the
    listing its metadata probe sent (``listed``): no open, no read."""

    path: Path
    schema: RolloutSchema


def listed(path: Path | str, options: SafetyOptions | None = None) -> Listed | None:
    """``path``'s schema from its probe's listing, without opening it (``batch`` plans each file's blocks after
    its check pass: an open and a close cost ~0.7 ms of a small file's few, issue 39); None unless the probe found
    the file clean as it is now (the same identity: the same bytes), sent its listing, and that listing
    describes a rollout file with no problem (the caller then opens it: ``RolloutReader`` says what is wrong)."""
    probed = probe_metadata(path, options)
    if probed.clean is None or probed.listing is None or probed.clean != path_identity(path):
        return None
    listing = from_json(probed.listing)
    if listing is None:
        return None
    schema, problems = describe(Path(path), listing.datasets, listing.attrs)
    return Listed(Path(path), schema) if schema is not None and not problems else None


class RolloutReader(H5Input, RolloutShape):
    """An open, audited, validated rollout file.

    ``read`` returns a field's env slice as stored (native byte order); ``array`` / ``tensor`` return it
    normalised by the field's row (:mod:`rolloutcli.fields`): a trailing 1 dropped, flags uint8 0/1,
    rewards/values/last_values/advantages/returns float32, others as stored.
    """

    def __init__(
        self,
        path: Path | str,
        options: SafetyOptions | None = None,
        *,
        check: bool = True,
        budget: int = DEFAULT_MAX_MEMORY,
    ) -> None:
        super().__init__(path, options)
        self.budget = budget
        try:
            schema, problems = describe(self.path, self.datasets, self.attrs)
            if problems or schema is None:
                raise RolloutError.many(self.path, problems, exit_code=EXIT_BAD_DATA)
            self.schema: RolloutSchema = schema
            if check:
                self.check_values()
        except BaseException:
            self.close()
            raise

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Env slice ``[start:stop]`` of field ``name`` as stored (native byte order)."""
        spec = self.schema.fields[name]
        if spec.env_axis is None:
            return self.slice(name)
        index: list[slice] = [slice(None)] * len(spec.shape)
        index[spec.env_axis] = slice(start, self.N if stop is None else stop)
        return self.slice(name, tuple(index))

    def normalise(self, name: str, data: np.ndarray) -> np.ndarray:
        """``data`` read from field ``name``, normalised by its row (see the class docstring), C-contiguous."""
        spec = self.schema.fields[name]
        dtype, shape = spec.loaded(data.shape[spec.env_axis] if spec.env_axis is not None else 0)
        row = spec.row
        if row is not None and row.trailing_one and data.ndim > len(shape) and data.shape[-1] == 1:
            data = data[..., 0]
        if row is not None and row.flag:
            data = data != 0
        return np.ascontiguousarray(data.astype(dtype, copy=False))

    def array(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Normalised C-contiguous numpy array of a field's env slice."""
        return self.normalise(name, self.read(name, start, stop))

    def normalized(self, name: str, start: int = 0, stop: int | None = None) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape :meth:`array` returns for this env slice, from the metadata alone (no read)."""
        return self.schema.fields[name].loaded((self.N if stop is None else stop) - start)

    def arrays(self, names: Iterable[str], start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
        return {name: self.array(name, start, stop) for name in names}

    def tensor(
        self, name: str, start: int = 0, stop: int | None = None, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """Normalised tensor of a field's env slice (see the class docstring)."""
        import torch

        return torch.from_numpy(self.array(name, start, stop)).to(device)

    def blocks(self, names: Sequence[str], budget: int | None = None) -> list[tuple[int, int]]:
        """Env blocks such that reading ``names`` for one block stays within ``budget`` bytes (default: all of
        the reader's); a file one env of which does not fit is refused (exit 2)."""
        budget = self.budget if budget is None else budget
        per_env = self.check_fits(names, budget)
        return env_blocks(self.N, per_env, budget)

    def check_fits(self, names: Sequence[str], budget: int | None = None) -> int:
        """Refuse (exit 2) a file one env of whose ``names`` exceeds ``budget``; return the bytes per env."""
        per_env = sum(self.schema.fields[n].bytes_per_env() for n in names)
        check_one_env_fits(self.path, per_env, self.budget if budget is None else budget, self.budget)
        return per_env

    def distribution_order(self) -> list[str]:
        """Distribution parameter names in tuple order (the group's ``order`` attribute, else by name)."""
        names = sorted(n.split("/", 1)[1] for n in self.schema.names("distribution"))
        declared = self.attrs_of("distribution").get("order") if names else None
        if isinstance(declared, list | tuple):
            ordered = [d.decode("utf-8", "replace") if isinstance(d, bytes) else str(d) for d in declared]
            if sorted(ordered) == names:
                return ordered
        return names

    def _value_blocks(self, names: Sequence[str]) -> list[tuple[slice, slice]]:
        """(steps, envs) blocks of ``[T, N]`` fields within a quarter of the budget (the rest: the masks); an
        env longer than that is cut along T, so validation never needs more than the budget."""
        budget = max(self.budget // 4, 1)
        per_env = max(sum(self.schema.fields[n].bytes_per_env() for n in names), 1)
        steps = self.T if per_env <= budget else max(1, budget * self.T // per_env)
        return [
            (slice(t, min(t + steps, self.T)), slice(start, stop))
            for start, stop in env_blocks(self.N, per_env, budget)
            for t in range(0, self.T, steps)
        ]

    def _value_block(self, name: str, steps: slice, envs: slice) -> np.ndarray | None:
        """A ``[T, N, ...]`` field's (steps, envs) block; a field without steps (``[N]``) with its first one."""
        if self.schema.fields[name].env_axis == 1:
            return self.slice(name, (steps, envs))
        return self.read(name, envs.start, envs.stop) if steps.start == 0 else None

    def check_values(self) -> None:
        """Stream env blocks and raise one ``RolloutError`` listing every value problem."""
        fields = self.schema.fields
        finite = [f.name for f in by_flag(finite=True) if f.name in fields]
        flags = [f.name for f in by_flag(flag=True) if f.name in fields]
        counts = dict.fromkeys([*finite, *flags, "orphan"], 0)
        for steps, envs in self._value_blocks([*finite, *flags]):
            block = {n: self._value_block(n, steps, envs) for n in (*finite, *flags)}
            block = {n: data for n, data in block.items() if data is not None}
            for name in finite:
                if name in block and block[name].dtype.kind == "f":
                    counts[name] += int(np.count_nonzero(~np.isfinite(block[name])))
            for name in flags:
                if name in block and block[name].dtype.kind != "b":
                    counts[name] += int(np.count_nonzero((block[name] != 0) & (block[name] != 1)))
            if "time_outs" in block:
                orphan = (block["time_outs"].reshape(-1) != 0) & (block["dones"].reshape(-1) == 0)
                counts["orphan"] += int(np.count_nonzero(orphan))
        lines = [(n, "finite numbers", f"{counts[n]} NaN/Inf values", _NONFINITE_FIX) for n in finite]
        lines += [(n, "only 0 and 1", f"{counts[n]} other values", _FLAG_FIX) for n in flags]
        lines += [("time_outs", "time-outs only where dones is 1", f"{counts['orphan']} time-outs where dones is 0",
                   _ORPHAN_FIX)]  # fmt: skip
        counted = [*finite, *flags, "orphan"]
        problems = [problem_line(self.path, *line) for key, line in zip(counted, lines, strict=True) if counts[key]]
        if problems:
            raise RolloutError.many(self.path, problems, exit_code=EXIT_BAD_DATA)
