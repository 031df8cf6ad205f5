"""Write rollout files: whole tensors, streamed env blocks, and untouched datasets copied verbatim.

Callers write into the temporary path yielded by ``atomic.atomic_file``; nothing here writes to a
final name. ``copy_datasets`` uses HDF5 object copy, which moves the stored (possibly compressed)
chunks without decoding them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from rolloutcli.hdf5.schema import FORMAT_NAME, FORMAT_VERSION

if TYPE_CHECKING:  # tensors are recognised by duck typing: `gae` on the CPU never imports torch
    import torch


def to_numpy(value: torch.Tensor | np.ndarray) -> np.ndarray:
    """A host numpy view/copy of a tensor (one device-to-host transfer)."""
    if hasattr(value, "detach"):  # a torch.Tensor
        value = value.detach()
        if str(value.dtype) == "torch.bfloat16":  # numpy has no bfloat16
            value = value.float()
        return value.cpu().numpy()
    return np.asarray(value)


def create_file(path: Any) -> h5py.File:
    """Open a fresh output file (the temporary path of an atomic output) and stamp the format."""
    handle = h5py.File(path, "w", libver=("earliest", "latest"))
    handle.attrs["rolloutcli_format"] = FORMAT_NAME
    handle.attrs["format_version"] = FORMAT_VERSION
    return handle


def _no_sieve_access() -> h5py.h5p.PropFAID:
    """File access without HDF5's 1 MiB sieve buffer.

    Streamed outputs are written as strided slabs (``[:, m0:m1]`` of a contiguous ``[L, M, ...]``); with the
    sieve buffer on, libhdf5 reads back and rewrites the bytes around each run (measured: 1.6-2x slower).
    """
    access = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    access.set_libver_bounds(h5py.h5f.LIBVER_EARLIEST, h5py.h5f.LIBVER_LATEST)
    access.set_sieve_buf_size(0)
    return access


def create_output(path: Any) -> h5py.File:
    """Open a fresh, empty output file (the temporary path of an atomic output)."""
    return h5py.File(h5py.h5f.create(os.fsencode(path), h5py.h5f.ACC_TRUNC, fapl=_no_sieve_access()))


def open_for_update(path: Any) -> h5py.File:
    """Open our own temporary copy of a file for adding datasets (never an input)."""
    return h5py.File(h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDWR, fapl=_no_sieve_access()))


def write_attrs(handle: h5py.File, attrs: Mapping[str, Any]) -> None:
    """Set root attributes (None values are skipped)."""
    for key, value in attrs.items():
        if value is not None:
            handle.attrs[key] = value


def write_dataset(handle: h5py.File, name: str, value: torch.Tensor | np.ndarray, **options: Any) -> None:
    """Write one whole dataset (creating intermediate groups)."""
    handle.create_dataset(name, data=to_numpy(value), **options)


def create_empty(
    handle: h5py.File,
    name: str,
    shape: tuple[int, ...],
    dtype: np.dtype | str,
    chunks: tuple[int, ...] | None = None,
    compression: str | None = None,
) -> h5py.Dataset:
    """Create a dataset to be filled block by block (contiguous and uncompressed by default: fastest)."""
    options: dict[str, Any] = {}
    if compression:
        options["compression"] = compression
        options["chunks"] = chunks or True
    elif chunks:
        options["chunks"] = chunks
    return handle.create_dataset(name, shape=shape, dtype=np.dtype(dtype), **options)


def write_env_block(
    dataset: h5py.Dataset, env_axis: int, start: int, stop: int, value: torch.Tensor | np.ndarray
) -> None:
    """Write ``value`` into the env slice ``[start:stop]`` along ``env_axis``."""
    index: list[slice] = [slice(None)] * dataset.ndim
    index[env_axis] = slice(start, stop)
    array = to_numpy(value)
    dataset[tuple(index)] = array.reshape(_slice_shape(dataset.shape, env_axis, stop - start))


def _slice_shape(shape: tuple[int, ...], axis: int, count: int) -> tuple[int, ...]:
    return (*shape[:axis], count, *shape[axis + 1 :])


def copy_datasets(source: h5py.File, target: h5py.File, names: Iterable[str]) -> None:
    """Copy datasets verbatim (stored chunks, filters, attributes) with HDF5 object copy."""
    for name in names:
        parent = name.rsplit("/", 1)[0] if "/" in name else ""
        if parent:
            target.require_group(parent)
        source.copy(source[name], target[parent] if parent else target, name=name.rsplit("/", 1)[-1])


def copy_root_attrs(source: h5py.File, target: h5py.File) -> None:
    for key, value in source.attrs.items():
        target.attrs[key] = value
