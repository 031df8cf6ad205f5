"""Save and load a :class:`~rolloutcli.core.circular_buffer.CircularBuffer` state to HDF5, atomically.

File layout (format ``rolloutcli.circular_buffer``, version 1):

* root attributes ``format`` (str), ``format_version`` (int), ``max_length``, ``batch_size`` (ints >= 1),
  ``pointer`` (int in ``[0, max_length)``: storage slot of the newest entry).
* dataset ``num_pushes`` ``[batch_size]`` int64: appends since each environment's last reset.
* dataset ``data`` ``[max_length, batch_size, *entry_shape]`` in storage order (slot ``pointer`` is the
  newest entry, ``(pointer + 1) % max_length`` the oldest); absent when nothing was ever appended. Its
  attribute ``torch_dtype`` names the torch dtype (``"float32"``, ``"bfloat16"``...). Dtypes numpy cannot
  hold (bfloat16, float8...) are stored as their raw bits in a signed integer of the same width, with the
  attribute ``raw_bits = True``.

Writing goes through :func:`rolloutcli.hdf5.atomic.atomic_file`, so an interrupted save leaves the previous
file (or none), never a half-written one. Problems with the user's file raise
:class:`~rolloutcli.errors.RolloutError` (exit 3 when it cannot be opened, exit 1 when its content is wrong).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from rolloutcli.errors import EXIT_BAD_DATA, EXIT_IO, RolloutError, problem_line
from rolloutcli.hdf5.atomic import atomic_file

FORMAT = "rolloutcli.circular_buffer"
FORMAT_VERSION = 1

_BITS_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
    """Write a ``CircularBuffer.state_dict()`` to ``path`` as HDF5, atomically.

    Args:
        state: ``{"max_length", "batch_size", "pointer", "num_pushes" [batch], "data" [max_length, batch, ...]
            or None}``, tensors on any device.
        path: Destination file.
        overwrite: Replace an existing file.

    Raises:
        RolloutError: ``path`` exists without ``overwrite`` (exit 2), is one of the refused destinations of
            :func:`~rolloutcli.hdf5.atomic.check_output_path`, or cannot be written (exit 3).
    """
    path = Path(path)
    num_pushes = state["num_pushes"].detach().to("cpu", torch.int64).numpy()
    data = state["data"]
    with atomic_file(path, overwrite=overwrite) as tmp:
        try:
            with h5py.File(tmp, "w") as handle:
                handle.attrs["format"] = FORMAT
                handle.attrs["format_version"] = FORMAT_VERSION
                handle.attrs["max_length"] = int(state["max_length"])
                handle.attrs["batch_size"] = int(state["batch_size"])
                handle.attrs["pointer"] = int(state["pointer"])
                handle.create_dataset("num_pushes", data=num_pushes)
                if data is not None:
                    array, raw_bits = _to_numpy(data)
                    dataset = handle.create_dataset("data", data=array)
                    dataset.attrs["torch_dtype"] = _dtype_name(data.dtype)
                    dataset.attrs["raw_bits"] = raw_bits
        except OSError as exc:
            raise RolloutError(f"{path}: cannot write the buffer file: {exc}.", exit_code=EXIT_IO) from exc


def _int_attr(attrs: h5py.AttributeManager, name: str, problems: list[str], path: Path) -> int | None:
    """Attribute ``name`` as a Python int, or None after recording a problem."""
    if name not in attrs:
        problems.append(problem_line(path, name, "an integer attribute", "none", "The file was not written by save()."))
        return None
    value = attrs[name]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        problems.append(problem_line(path, name, "an integer", f"{value!r}"))
        return None
    return int(value)


def load_buffer_state(path: Path) -> dict[str, Any]:
    """Read and validate a file written by :func:`save_buffer_state`.

    Returns:
        A state dict for ``CircularBuffer.load_state_dict`` with CPU tensors: ``num_pushes [batch]`` int64 and
        ``data [max_length, batch, *entry_shape]`` (or None).

    Raises:
        RolloutError: The file is missing or cannot be opened as HDF5 (exit 3 / exit 1), or its content is not
            a valid buffer state (exit 1, every problem found listed).
    """
    path = Path(path)
    if not path.exists():
        raise RolloutError(f"{path}: no such file. Check the path of the saved buffer.", exit_code=EXIT_IO)
    if path.is_dir():
        raise RolloutError(f"{path}: is a folder, expected a buffer file written by save().", exit_code=EXIT_IO)
    try:
        handle = h5py.File(path, "r")
    except OSError as exc:
        raise RolloutError.field(
            path, "(file)", "an HDF5 buffer file written by save()", f"a file h5py cannot open ({exc})"
        ) from exc
    with handle:
        fmt = handle.attrs.get("format")
        if isinstance(fmt, bytes):
            fmt = fmt.decode("utf-8", "replace")
        if fmt != FORMAT:
            raise RolloutError.field(
                path, "format", repr(FORMAT), repr(fmt), "This is not a CircularBuffer file written by save()."
            )
        problems: list[str] = []
        version = _int_attr(handle.attrs, "format_version", problems, path)
        if version is not None and version != FORMAT_VERSION:
            raise RolloutError.field(
                path, "format_version", str(FORMAT_VERSION), str(version), "Upgrade rolloutcli to read this file."
            )
        max_length = _int_attr(handle.attrs, "max_length", problems, path)
        batch_size = _int_attr(handle.attrs, "batch_size", problems, path)
        pointer = _int_attr(handle.attrs, "pointer", problems, path)
        for name, value in (("max_length", max_length), ("batch_size", batch_size)):
            if value is not None and value < 1:
                problems.append(problem_line(path, name, "an integer >= 1", str(value)))
        if problems or max_length is None or batch_size is None or pointer is None:
            raise RolloutError.many(path, problems)
        if not 0 <= pointer < max_length:
            problems.append(problem_line(path, "pointer", f"an integer in [0, {max_length})", str(pointer)))

        num_pushes = _read_num_pushes(handle, batch_size, problems, path)
        data = _read_data(handle, max_length, batch_size, problems, path)
        if data is None and num_pushes is not None and bool((num_pushes != 0).any()):
            problems.append(
                problem_line(path, "data", "a dataset (num_pushes counts appends)", "none", "The file is incomplete.")
            )
        if problems:
            raise RolloutError.many(path, problems, exit_code=EXIT_BAD_DATA)
    return {
        "max_length": max_length,
        "batch_size": batch_size,
        "pointer": pointer,
        "num_pushes": num_pushes,
        "data": data,
    }


def _read_num_pushes(handle: h5py.File, batch_size: int, problems: list[str], path: Path) -> torch.Tensor | None:
    node = handle.get("num_pushes")
    if not isinstance(node, h5py.Dataset):
        problems.append(problem_line(path, "num_pushes", f"an integer dataset [{batch_size}]", "none"))
        return None
    if node.dtype.kind not in "iu" or node.shape != (batch_size,):
        problems.append(
            problem_line(path, "num_pushes", f"an integer dataset [{batch_size}]", f"{node.dtype} {list(node.shape)}")
        )
        return None
    values = torch.from_numpy(np.asarray(node[()], dtype=np.int64))
    if bool((values < 0).any()):
        problems.append(problem_line(path, "num_pushes", "counts >= 0", f"minimum {int(values.min())}"))
        return None
    return values


def _read_data(
    handle: h5py.File, max_length: int, batch_size: int, problems: list[str], path: Path
) -> torch.Tensor | None:
    node = handle.get("data")
    if node is None:
        return None
    expected = f"a dataset [{max_length}, {batch_size}, ...]"
    if not isinstance(node, h5py.Dataset) or len(node.shape) < 2 or node.shape[:2] != (max_length, batch_size):
        found = f"shape {list(node.shape)}" if isinstance(node, h5py.Dataset) else "a group"
        problems.append(problem_line(path, "data", expected, found))
        return None
    name = node.attrs.get("torch_dtype")
    if isinstance(name, bytes):
        name = name.decode("utf-8", "replace")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        problems.append(problem_line(path, "data.attrs['torch_dtype']", "a torch dtype name", repr(name)))
        return None
    raw_bits = bool(node.attrs.get("raw_bits", False))
    try:
        array = np.ascontiguousarray(node[()])
    except (OSError, TypeError, ValueError) as exc:
        problems.append(problem_line(path, "data", expected, f"unreadable data ({exc})"))
        return None
    try:
        tensor = torch.from_numpy(array)
    except TypeError:
        problems.append(problem_line(path, "data", f"values of dtype {name}", f"{array.dtype}"))
        return None
    if raw_bits:
        bits = _BITS_DTYPE.get(dtype.itemsize)
        if bits is None or tensor.dtype != bits:
            problems.append(problem_line(path, "data", f"raw bits of {name} ({bits})", f"{tensor.dtype}"))
            return None
        return tensor.view(dtype)
    if tensor.dtype != dtype:
        problems.append(problem_line(path, "data", f"values of dtype {name}", f"{tensor.dtype}"))
        return None
    return tensor
