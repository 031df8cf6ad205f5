"""Streaming moments in numpy (no torch): ``gae``'s summaries and its global advantage statistics.

Both accumulators are built from one block and merged with the next, so a file larger than memory gives the
same result as a single pass. Inputs are numpy arrays or CPU/GPU tensors (converted to host numpy once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def host_array(values: Any) -> np.ndarray:
    """A numpy view of ``values``: an array as is, a tensor (any device) copied to the host if it must be.

    Duck-typed on ``detach`` so that this module never imports torch.
    """
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    return np.asarray(values)


@dataclass
class Moments:
    """Streaming count/mean/M2/min/max of the finite values, plus the count of non-finite ones.

    Merged with Chan et al.'s parallel update: ``delta = mean_b - mean_a``,
    ``mean = mean_a + delta * n_b / n``, ``M2 = M2_a + M2_b + delta^2 * n_a * n_b / n`` (float64).
    """

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    minimum: float = math.inf
    maximum: float = -math.inf
    nonfinite: int = 0

    @classmethod
    def of(cls, values: Any) -> Moments:
        """Moments of one block (any shape; numpy array or tensor)."""
        flat = host_array(values).reshape(-1).astype(np.float64)
        finite = np.isfinite(flat)
        kept = flat if finite.all() else flat[finite]
        count = int(kept.size)
        if count == 0:
            return cls(nonfinite=int(flat.size))
        mean = float(kept.mean())
        centred = kept - mean
        return cls(
            count,
            mean,
            float(np.dot(centred, centred)),
            float(kept.min()),
            float(kept.max()),
            int(flat.size) - count,
        )

    def merge(self, other: Moments) -> Moments:
        if other.count == 0:
            return Moments(self.count, self.mean, self.m2, self.minimum, self.maximum, self.nonfinite + other.nonfinite)
        if self.count == 0:
            return Moments(
                other.count, other.mean, other.m2, other.minimum, other.maximum, self.nonfinite + other.nonfinite
            )
        count = self.count + other.count
        delta = other.mean - self.mean
        return Moments(
            count,
            self.mean + delta * other.count / count,
            self.m2 + other.m2 + delta * delta * self.count * other.count / count,
            min(self.minimum, other.minimum),
            max(self.maximum, other.maximum),
            self.nonfinite + other.nonfinite,
        )

    @property
    def std(self) -> float:
        """Unbiased standard deviation (as torch's ``std``)."""
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 0.0

    def as_dict(self) -> dict[str, float | int | None]:
        empty = self.count == 0
        return {
            "count": self.count,
            "mean": None if empty else self.mean,
            "std": None if empty else self.std,
            "min": None if empty else self.minimum,
            "max": None if empty else self.maximum,
            "nonfinite": self.nonfinite,
        }


@dataclass
class EnvMoments:
    """Per-env ``count``, ``sum`` and centred ``m2`` (float64, ``[N]``), gathered block by block.

    Each env's numbers depend only on that env's column, and the totals are combined with ``math.fsum``
    (exactly rounded), so the global mean/std are bit-identical whatever the env-block partition.
    """

    counts: list[np.ndarray] = field(default_factory=list)
    sums: list[np.ndarray] = field(default_factory=list)
    m2s: list[np.ndarray] = field(default_factory=list)

    def add(self, values: Any) -> None:
        """Add the envs of one block, ``values`` ``[T, n]`` (float; numpy array or tensor)."""
        column = host_array(values).astype(np.float64)
        T = column.shape[0]
        sums = column.sum(axis=0)
        means = sums / T
        self.counts.append(np.full_like(sums, T))
        self.sums.append(sums)
        self.m2s.append(((column - means) ** 2).sum(axis=0))

    def mean_std(self) -> tuple[float, float]:
        """Global mean and unbiased std (``torch.std`` semantics: ``sqrt(M2 / (n - 1))``)."""
        counts = np.concatenate(self.counts)
        sums = np.concatenate(self.sums)
        m2s = np.concatenate(self.m2s)
        total = math.fsum(counts.tolist())
        mean = math.fsum(sums.tolist()) / total
        env_means = sums / counts
        spread = (counts * (env_means - mean) ** 2).tolist()
        m2 = math.fsum(m2s.tolist()) + math.fsum(spread)
        # one element: torch.std would give NaN (and RSL-RL NaN advantages); 0 normalises it to 0 instead
        std = math.sqrt(m2 / (total - 1)) if total > 1 else 0.0
        return mean, std
