"""GAE for ``rolloutcli gae`` on the CPU without numba or torch: the compiled C kernel (``_gae_c.c``, called
through ctypes), RSL-RL's time-out bootstrap and normalisation in numpy.

Everything here loads in milliseconds, against ~0.28 s for numba's import and cached kernel and ~1 s for
torch: on a 1 GB file that start-up is as long as the command's whole work. Shapes: ``[T, N]`` float32 /
uint8 numpy arrays, time first, C-contiguous.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

import numpy as np

NativeGae = Callable[
    [np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, float, float, np.ndarray, np.ndarray], None
]


def cpu_threads() -> int:
    """CPUs this process may run on (its affinity mask), the default thread count of the kernels."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@functools.cache
def native_gae() -> NativeGae | None:
    """The compiled kernel as ``gae(r, v, d, to, lv, gamma, lam, adv, ret)``, or None where it was not built.

    Single-threaded and unchunked: RSL-RL's float32 operations in RSL-RL's order, so its results equal
    RSL-RL's bit for bit at every shape.
    """
    try:
        from rolloutcli.core import _gae_c  # type: ignore[attr-defined]
    except ImportError:
        return None
    library = ctypes.CDLL(_gae_c.__file__)
    if library.rolloutcli_gae_abi_version() != 1:
        return None
    kernel = library.rolloutcli_gae
    pointer = ctypes.c_void_p
    kernel.argtypes = [pointer] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float] * 2 + [pointer] * 3
    kernel.restype = None

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
        and ``lv`` float32 ``[N]`` (all C-contiguous; checked, as C would read past a wrong shape)."""
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


def bootstrap_time_outs_array(
    rewards: np.ndarray, values: np.ndarray, time_outs: np.ndarray, gamma: float
) -> np.ndarray:
    """RSL-RL's time-out bootstrap ``rewards + gamma * (values * time_outs)`` in float32, as a new array.

    Same float32 operations in the same order as torch's (the Python float ``gamma`` is rounded to float32
    first, as torch does for a float32 tensor), so the bits equal :func:`rolloutcli.core.gae.bootstrap_time_outs`.
    """
    flags = (time_outs != 0).astype(np.float32)
    with np.errstate(all="ignore"):  # overflow gives inf, as in torch, which says nothing either
        return rewards.astype(np.float32, copy=False) + np.float32(gamma) * (
            values.astype(np.float32, copy=False) * flags
        )


def normalize_array(advantages: np.ndarray, mean: float, std: float) -> np.ndarray:
    """``(A - mean) / (std + 1e-8)`` in float32 with ``mean``/``std`` rounded to float32 first: the bits of
    :func:`rolloutcli.core.gae.normalize_with` (RSL-RL's expression)."""
    m, s = np.float32(mean), np.float32(std)
    with np.errstate(all="ignore"):  # overflow gives inf, as in torch, which says nothing either
        return (advantages - m) / (s + np.float32(1e-8))
