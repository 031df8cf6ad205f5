"""Save and load a :class:`~rolloutcli.core.circular_buffer.CircularBuffer` state to HDF5.

File layout (format ``rolloutcli.circular_buffer``, version 1):

* root attributes ``format``, ``format_version``, ``max_length``, ``batch_size`` (>= 1) and ``pointer`` (in
  ``[0, max_length)``: the storage slot of the newest entry).
* dataset ``num_pushes`` ``[batch_size]`` int64: appends since each environment's last reset.
* dataset ``data`` ``[max_length, batch_size, *entry_shape]`` in storage order, absent when nothing was ever
  appended; attribute ``torch_dtype`` names its dtype, and dtypes numpy cannot hold (bfloat16, float8...) are
  stored as raw bits in a signed integer of the same width, with ``raw_bits = True``.

Saving is atomic (:func:`~rolloutcli.hdf5.atomic.atomic_file`). Loading treats the file as untrusted, as every
command does (:func:`~rolloutcli.hdf5.safety.open_hdf5`), and checks the whole state, which must fit in
``max_memory``, before reading any data.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from rolloutcli.errors import EXIT_IO, RolloutError, problem_line
from rolloutcli.hdf5.atomic import atomic_file
from rolloutcli.hdf5.limits import DEFAULT_MAX_MEMORY, SafetyOptions
from rolloutcli.hdf5.safety import HDF5_ERRORS, open_hdf5, translate_hdf5_error

FORMAT = "rolloutcli.circular_buffer"
FORMAT_VERSION = 1

_BITS_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _to_numpy(data: torch.Tensor) -> tuple[np.ndarray, bool]:
    """``data`` on the CPU as numpy, and whether it had to be stored as raw bits."""
    data = data.detach().cpu().contiguous()
    try:
        return data.numpy(), False
    except TypeError:
        bits = _BITS_DTYPE.get(data.element_size())
        if bits is None:
            raise ValueError(f"Cannot store dtype {data.dtype} in HDF5.") from None
        return data.view(bits).numpy(), True


def save_buffer_state(state: dict[str, Any], path: Path, *, overwrite: bool = False) -> None:
    """Write a ``CircularBuffer.state_dict()`` (tensors on any device) to ``path`` as HDF5, atomically; raise
    ``RolloutError`` where ``atomic_file`` refuses ``path`` (exit 2, 3 or 4) or it cannot be written (exit 3)."""
    path = Path(path)
    num_pushes = state["num_pushes"].detach().to("cpu", torch.int64).numpy()
    data = state["data"]
    with atomic_file(path, overwrite=overwrite) as tmp:
        try:
            with h5py.File(tmp, "w") as handle:
                handle.attrs["format"] = FORMAT
                handle.attrs["format_version"] = FORMAT_VERSION
                for name in ("max_length", "batch_size", "pointer"):
                    handle.attrs[name] = int(state[name])
                handle.create_dataset("num_pushes", data=num_pushes)
                if data is not None:
                    array, raw_bits = _to_numpy(data)
                    dataset = handle.create_dataset("data", data=array)
                    dataset.attrs["torch_dtype"] = str(data.dtype).removeprefix("torch.")
                    dataset.attrs["raw_bits"] = raw_bits
        except OSError as exc:
            raise RolloutError(f"{path}: cannot write the buffer file: {exc}.", exit_code=EXIT_IO) from exc


def load_buffer_state(path: Path, *, max_memory: int | None = None, allow_external: bool = False) -> dict[str, Any]:
    """Read and validate a file written by :func:`save_buffer_state`, as safely as the commands read theirs.

    ``max_memory``: the largest state (``num_pushes`` and ``data`` once loaded) to read, in bytes (None: the
    commands' default budget). ``allow_external``: trust what ``--allow-external`` trusts. Returns a state for
    ``CircularBuffer.load_state_dict`` with CPU tensors. Raises ``RolloutError``: not a readable regular file
    (exit 3), not HDF5, corrupt or not a valid state (exit 1, every problem listed), unsafe (exit 4), larger
    than ``max_memory`` (exit 3).
    """
    path = Path(path)
    max_memory = DEFAULT_MAX_MEMORY if max_memory is None else max_memory
    with open_hdf5(path, SafetyOptions(allow_external=allow_external)) as handle:
        try:
            max_length, batch_size, pointer = _read_attrs(handle, path)
            problems: list[str] = []
            if not 0 <= pointer < max_length:
                problems.append(problem_line(path, "pointer", f"an integer in [0, {max_length})", str(pointer)))
            pushes = _find(handle, "num_pushes", (batch_size,), problems, path)
            data, dtype = _find_data(handle, (max_length, batch_size), problems, path)
            if problems:
                raise RolloutError.many(path, problems)
            assert pushes is not None
            _check_memory(path, [pushes] if data is None else [pushes, data], max_memory)
            num_pushes = torch.from_numpy(np.asarray(pushes[()], dtype=np.int64))
            values = None if data is None else torch.from_numpy(np.ascontiguousarray(data[()])).view(dtype)
        except (*HDF5_ERRORS, MemoryError) as exc:
            raise translate_hdf5_error(path, exc) from exc
    if bool((num_pushes < 0).any()):
        problems.append(problem_line(path, "num_pushes", "counts >= 0", f"minimum {int(num_pushes.min())}"))
    if values is None and bool((num_pushes != 0).any()):
        problems.append(
            problem_line(path, "data", "a dataset (num_pushes counts appends)", "none", "The file is incomplete.")
        )
    if problems:
        raise RolloutError.many(path, problems)
    return dict(max_length=max_length, batch_size=batch_size, pointer=pointer, num_pushes=num_pushes, data=values)


def _read_attrs(handle: h5py.File, path: Path) -> tuple[int, int, int]:
    """``max_length``, ``batch_size`` and ``pointer`` after checking the format; RolloutError (exit 1) if wrong."""
    fmt = handle.attrs.get("format")
    if isinstance(fmt, bytes):
        fmt = fmt.decode("utf-8", "replace")
    if fmt != FORMAT:
        raise RolloutError.field(
            path, "format", repr(FORMAT), repr(fmt)[:80], "This is not a CircularBuffer file written by save()."
        )
    problems: list[str] = []
    version = _int_attr(handle.attrs, "format_version", problems, path)
    if version is not None and version != FORMAT_VERSION:
        raise RolloutError.field(
            path, "format_version", str(FORMAT_VERSION), str(version), "Upgrade rolloutcli to read this file."
        )
    values = [_int_attr(handle.attrs, name, problems, path) for name in ("max_length", "batch_size", "pointer")]
    for name, value in zip(("max_length", "batch_size"), values, strict=False):
        if value is not None and value < 1:
            problems.append(problem_line(path, name, "an integer >= 1", str(value)))
    if problems:
        raise RolloutError.many(path, problems)
    return values[0], values[1], values[2]  # type: ignore[return-value]


def _int_attr(attrs: h5py.AttributeManager, name: str, problems: list[str], path: Path) -> int | None:
    """Attribute ``name`` as a Python int, or None after recording a problem."""
    if name not in attrs:
        problems.append(problem_line(path, name, "an integer attribute", "none", "The file was not written by save()."))
        return None
    value = attrs[name]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        problems.append(problem_line(path, name, "an integer", f"{value!r}"[:80]))
        return None
    return int(value)


def _find(handle: h5py.File, name: str, shape: tuple[int, ...], problems: list[str], path: Path) -> h5py.Dataset | None:
    """Dataset ``name`` if it exists with ``shape`` (``num_pushes``: exactly, of integers; ``data``: as its first
    two dims), else None after recording a problem. Reads no data."""
    node = handle.get(name)
    exact = name == "num_pushes"
    expected = f"an integer dataset [{shape[0]}]" if exact else f"a dataset [{shape[0]}, {shape[1]}, ...]"
    if not isinstance(node, h5py.Dataset):
        problems.append(problem_line(path, name, expected, "none" if node is None else "a group"))
        return None
    fits = node.shape == shape and node.dtype.kind in "iu" if exact else node.shape[:2] == shape
    if not fits:
        problems.append(problem_line(path, name, expected, f"{node.dtype} {list(node.shape)}"))
        return None
    return node


def _find_data(
    handle: h5py.File, shape: tuple[int, int], problems: list[str], path: Path
) -> tuple[h5py.Dataset | None, torch.dtype | None]:
    """The ``data`` dataset (None when absent or after recording a problem) and its torch dtype."""
    if "data" not in handle:
        return None, None
    node = _find(handle, "data", shape, problems, path)
    if node is None:
        return None, None
    name = node.attrs.get("torch_dtype")
    name = name.decode("utf-8", "replace") if isinstance(name, bytes) else name
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        problems.append(problem_line(path, "data.attrs['torch_dtype']", "a torch dtype name", f"{name!r}"[:80]))
        return None, None
    # Stored as numpy holds it, or as raw bits in a signed integer of the same width (bfloat16, float8...).
    stored = _BITS_DTYPE.get(dtype.itemsize) if bool(node.attrs.get("raw_bits", False)) else dtype
    try:
        expected = torch.empty(0, dtype=stored).numpy().dtype if stored is not None else None
    except TypeError:
        expected = None
    if expected is None or node.dtype != expected:
        problems.append(problem_line(path, "data", f"values of dtype {name}", f"{node.dtype}"))
        return None, None
    return node, dtype


def _check_memory(path: Path, datasets: list[h5py.Dataset], max_memory: int) -> None:
    """Refuse (exit 3) before reading when the state would not fit in ``max_memory`` bytes once loaded."""
    needed = sum(math.prod(node.shape) * node.dtype.itemsize for node in datasets)
    if needed > max_memory:
        raise RolloutError(
            f"{path}: the buffer needs {needed} bytes in memory, more than max_memory={max_memory}; "
            f"pass max_memory={needed} or more to load it.",
            exit_code=EXIT_IO,
        )
