"""rolloutcli's optional compiled kernels (``_native.c``), loaded with ctypes: the CPU GAE kernel and the row
gathers of the feed-forward export. Where the file was not built, :func:`library` returns None and the callers
run numpy or torch (the same bytes). The wrappers check what C would misread: dtypes, shapes, contiguity and
index ranges.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

ABI_VERSION = 3  # rolloutcli_native_abi_version() of the compiled file this module speaks to


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled library, or None where it was not built (or is from another version of the file)."""
    try:
        from rolloutcli.core import _native  # type: ignore[attr-defined]
    except ImportError:
        return None
    lib = ctypes.CDLL(_native.__file__)  # a CDLL call releases the GIL: threads run column blocks in parallel
    if lib.rolloutcli_native_abi_version() != ABI_VERSION:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.rolloutcli_gae.argtypes = [pointer] * 4 + [size] * 3 + [ctypes.c_float] * 2 + [pointer] * 3
    lib.rolloutcli_gae.restype = None
    lib.rolloutcli_gather_rows.argtypes = [pointer, pointer, size, size, pointer]
    lib.rolloutcli_gather_rows.restype = None
    lib.rolloutcli_gather_sorted.argtypes = [pointer, pointer, pointer, size, size, pointer]
    lib.rolloutcli_gather_sorted.restype = None
    return lib


def gae_columns(
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    gamma: float,
    lam: float,
    start: int,
    stop: int,
) -> None:
    """The C kernel on env columns ``[start, stop)`` of ``(r, v, d, lv, adv, ret, carry)``, checked by
    :func:`rolloutcli.core.gae_numpy.gae_arrays`. Releases the GIL while it runs."""
    r, v, d, lv, adv, ret, carry = arrays
    lib = library()
    assert lib is not None
    steps, envs = r.shape
    f, b = 4 * start, start  # byte offsets of the first column: float32 and uint8
    lib.rolloutcli_gae(
        r.ctypes.data + f,
        v.ctypes.data + f,
        d.ctypes.data + b,
        lv.ctypes.data + f,
        steps,
        stop - start,
        envs,
        gamma,
        lam,
        adv.ctypes.data + f,
        ret.ctypes.data + f,
        carry.ctypes.data + f,
    )


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

    ``slots`` must be a permutation of ``range(len(out))`` (checked by range only; the caller's argsort is one).
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
