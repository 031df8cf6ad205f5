"""GAE helpers for ``rolloutcli gae`` on the CPU without numba or torch: RSL-RL's time-out bootstrap and
normalisation in numpy (the kernel itself is :func:`rolloutcli.core.native.gae_kernel`).

Everything here loads in milliseconds, against ~0.28 s for numba's import and cached kernel and ~1 s for
torch: on a 1 GB file that start-up is as long as the command's whole work. Shapes: ``[T, N]`` float32 /
uint8 numpy arrays, time first, C-contiguous.
"""

from __future__ import annotations

import os

import numpy as np


def cpu_threads() -> int:
    """CPUs this process may run on (its affinity mask), the default thread count of the kernels."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


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
