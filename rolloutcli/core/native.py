"""rolloutcli's compiled kernels (``_native.c``), loaded with ctypes: GAE for the ``gae`` command and the row
gathers of the feed-forward export.

The C file is compiled by ``pip install`` where a compiler is available (``setup.py``; optional). Where it
was not, every function here returns None and the callers use numba (GAE) or torch (gathers) instead, with
the same results. This module imports neither torch nor numba. The wrappers check what C would misread:
dtypes, shapes, contiguity and index ranges.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import numpy as np

ABI_VERSION = 2  # rolloutcli_native_abi_version() of the compiled file this module speaks to

NativeGae = Callable[
    [np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, float, float, np.ndarray, np.ndarray], None
]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled library, or None where it was not built (or is from another version of the file)."""
    try:
        from rolloutcli.core import _native  # type: ignore[attr-defined]
    except ImportError:
        return None
    lib = ctypes.CDLL(_native.__file__)
    if lib.rolloutcli_native_abi_version() != ABI_VERSION:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.rolloutcli_gae.argtypes = [pointer] * 5 + [size] * 2 + [ctypes.c_float] * 2 + [pointer] * 3
    lib.rolloutcli_gae.restype = None
    lib.rolloutcli_gather_rows.argtypes = [pointer, pointer, size, size, pointer]
    lib.rolloutcli_gather_rows.restype = None
    lib.rolloutcli_gather_sorted.argtypes = [pointer, pointer, pointer, size, size, pointer]
    lib.rolloutcli_gather_sorted.restype = None
    return lib


@functools.cache
def gae_kernel() -> NativeGae | None:
    """The compiled GAE as ``gae(r, v, d, to, lv, gamma, lam, adv, ret)``, or None where it was not built.

    Single-threaded and unchunked: RSL-RL's float32 operations in RSL-RL's order, so its results equal
    RSL-RL's bit for bit at every shape.
    """
    native = library()
    if native is None:
        return None
    kernel = native.rolloutcli_gae  # argument types set by library()

    def gae(
        r: np.ndarray,
        v: np.ndarray,
        d: np.ndarray,
        to: np.ndarray | None,
        lv: np.ndarray,
        gamma: float,
        lam: float,
        adv: np.ndarray,
        ret: np.ndarray,
    ) -> None:
        """Write ``adv``, ``ret`` float32 ``[T, N]`` from ``r``, ``v`` float32 and ``d``, ``to`` uint8 ``[T, N]``
        and ``lv`` float32 ``[N]`` (all C-contiguous; checked, as C would read past a wrong shape). ``adv`` and
        ``ret`` must be fresh arrays, overlapping no input (the C code assumes it)."""
        steps, envs = r.shape
        for name, array, dtype, shape in (
            ("rewards", r, np.float32, (steps, envs)),
            ("values", v, np.float32, (steps, envs)),
            ("dones", d, np.uint8, (steps, envs)),
            ("time_outs", to, np.uint8, (steps, envs)),
            ("last_values", lv, np.float32, (envs,)),
            ("advantages", adv, np.float32, (steps, envs)),
            ("returns", ret, np.float32, (steps, envs)),
        ):
            if array is None:
                continue
            if array.dtype != dtype or array.shape != shape or not array.flags.c_contiguous:
                raise ValueError(
                    f"{name}: expected a C-contiguous {np.dtype(dtype)} array of shape {list(shape)}, found "
                    f"{array.dtype} {list(array.shape)} (contiguous: {array.flags.c_contiguous})"
                )
        if not (adv.flags.writeable and ret.flags.writeable):
            raise ValueError("advantages, returns: expected writeable arrays")
        carry = np.empty(envs, np.float32)
        kernel(
            r.ctypes.data,
            v.ctypes.data,
            d.ctypes.data,
            None if to is None else to.ctypes.data,
            lv.ctypes.data,
            steps,
            envs,
            gamma,
            lam,
            adv.ctypes.data,
            ret.ctypes.data,
            carry.ctypes.data,
        )

    return gae


def _check_rows(rows: np.ndarray, source_rows: int, name: str) -> None:
    if rows.dtype != np.int64 or rows.ndim != 1 or not rows.flags.c_contiguous:
        raise ValueError(f"{name}: expected a contiguous int64 vector, found {rows.dtype} {list(rows.shape)}")
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= source_rows):
        raise IndexError(f"{name}: expected row numbers in [0, {source_rows}), found {rows.min()}..{rows.max()}")


def _check_bytes(source: np.ndarray, out: np.ndarray, count: int) -> int:
    """Row size in bytes of ``source [R, ...]`` and ``out [count, ...]`` (same row layout, C-contiguous)."""
    if not (source.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("source and out: expected C-contiguous arrays (out writeable)")
    row_bytes = source[:1].nbytes if source.shape[0] else source.itemsize * int(np.prod(source.shape[1:]))
    if source.shape[1:] != out.shape[1:] or source.dtype != out.dtype or out.shape[0] != count:
        raise ValueError(
            f"out: expected {source.dtype} rows of shape {list(source.shape[1:])} and {count} rows, found "
            f"{out.dtype} {list(out.shape)}"
        )
    return int(row_bytes)


def gather_rows(source: np.ndarray, rows: np.ndarray, out: np.ndarray) -> bool:
    """``out[i] = source[rows[i]]`` with prefetching; False (nothing done) where the C file was not built."""
    native = library()
    if native is None:
        return False
    _check_rows(rows, source.shape[0], "rows")
    row_bytes = _check_bytes(source, out, rows.shape[0])
    native.rolloutcli_gather_rows(source.ctypes.data, rows.ctypes.data, rows.shape[0], row_bytes, out.ctypes.data)
    return True


def gather_sorted(source: np.ndarray, sorted_rows: np.ndarray, slots: np.ndarray, out: np.ndarray) -> bool:
    """``out[slots[j]] = source[sorted_rows[j]]`` (rows read in ascending order); False where not built.

    ``slots`` must be a permutation of ``range(len(out))`` (checked by range only: each slot is written once
    when it is a permutation, as the caller's argsort guarantees).
    """
    native = library()
    if native is None:
        return False
    _check_rows(sorted_rows, source.shape[0], "sorted_rows")
    _check_rows(slots, out.shape[0], "slots")
    row_bytes = _check_bytes(source, out, sorted_rows.shape[0])
    native.rolloutcli_gather_sorted(
        source.ctypes.data, sorted_rows.ctypes.data, slots.ctypes.data, sorted_rows.shape[0], row_bytes, out.ctypes.data
    )
    return True
