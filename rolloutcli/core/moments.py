"""Streaming moments in numpy (no torch), built per block and merged: ``inspect``'s statistics and ``gae``'s exact
advantage statistics (:class:`ExactMoments` keeps exact sums: its result does not depend on the blocks at all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np


def host_array(values: Any) -> np.ndarray:
    """A numpy view of ``values``: an array as is, a tensor (any device; duck-typed, no torch import) on the host."""
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
        if other.count == 0 or self.count == 0:
            return replace(other if other.count else self, nonfinite=self.nonfinite + other.nonfinite)
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


# Partial sums stay exact in float64 (bincount's accumulator) for this many terms (see ExactMoments).
_EXACT_CHUNK = 1 << 27


def _exponent_sums(weights: np.ndarray, exponents: np.ndarray, scale: int) -> int:
    """``sum(weights) * 2**scale`` exactly, given that the weights sharing an exponent (0..255) are multiples of one
    step (at least ``2**-scale``) below ``2**24`` steps: their partial sums stay exact in float64."""
    total = 0
    for start in range(0, weights.size, _EXACT_CHUNK):
        part = np.bincount(exponents[start : start + _EXACT_CHUNK], weights[start : start + _EXACT_CHUNK], 256)
        total += sum(int(math.ldexp(value, scale)) for value in part[np.flatnonzero(part)].tolist())
    return total


@dataclass
class ExactMoments:
    """Count, exact sum and exact sum of squares of float32 values, min, max and the count of non-finite ones.

    A float32 with exponent field ``e`` is a multiple of ``u = 2**(max(e, 1) - 150)`` below ``2**24 u``; split at
    its 12th mantissa bit, ``x = h + l``, the float64 terms ``x``, ``h * h``, ``h * l`` and ``l * l`` are exact
    multiples of a step (``u``, ``2**24 u**2``, ``2**12 u**2``, ``u**2``) below ``2**24`` steps. Summed per
    exponent they stay exact, and so do the Python integers they are combined into. The mean and the unbiased
    std are therefore exactly rounded, and the same whatever the order, the blocks or the threads the values
    came in.
    """

    count: int = 0
    total: int = 0  # sum of the values, in units of 2**-149
    squares: int = 0  # sum of their squares, in units of 2**-298
    minimum: float = math.inf
    maximum: float = -math.inf
    nonfinite: int = 0

    @classmethod
    def of(cls, values: Any) -> ExactMoments:
        """Moments of one block of float32 values (any shape; numpy array or tensor)."""
        flat = np.ascontiguousarray(host_array(values), dtype=np.float32).reshape(-1)
        exponents = ((flat.view(np.uint32) >> 23) & 0xFF).astype(np.intp)
        nonfinite = int(np.count_nonzero(exponents == 0xFF))
        if nonfinite:
            finite = exponents != 0xFF
            flat, exponents = flat[finite], exponents[finite]
        if flat.size == 0:
            return cls(nonfinite=nonfinite)
        high = (flat.view(np.uint32) & np.uint32(0xFFFFF000)).view(np.float32)
        low = (flat - high).astype(np.float64)
        high = high.astype(np.float64)
        cross = high * low
        squares = (  # x * x = h * h + 2 * h * l + l * l, each sum exact
            _exponent_sums(np.square(high, out=high), exponents, 298)
            + 2 * _exponent_sums(cross, exponents, 298)
            + _exponent_sums(np.square(low, out=low), exponents, 298)
        )
        return cls(
            int(flat.size),
            _exponent_sums(flat.astype(np.float64), exponents, 149),
            squares,
            float(flat.min()),
            float(flat.max()),
            nonfinite,
        )

    def merge(self, other: ExactMoments) -> ExactMoments:
        return ExactMoments(
            self.count + other.count,
            self.total + other.total,
            self.squares + other.squares,
            min(self.minimum, other.minimum),
            max(self.maximum, other.maximum),
            self.nonfinite + other.nonfinite,
        )

    @property
    def mean(self) -> float:
        """The exactly rounded mean (NaN when empty or when any value is not finite, as torch's mean)."""
        if self.count == 0 or self.nonfinite:
            return math.nan
        return self.total / (self.count << 149)  # int / int: correctly rounded

    @property
    def std(self) -> float:
        """The exactly rounded unbiased standard deviation (NaN for fewer than two values, as torch's ``std``,
        or when any value is not finite)."""
        return math.nan if self.count < 2 or self.nonfinite else self._finite_std()

    def _finite_std(self) -> float:
        n = self.count
        # variance = (n * sum(x^2) - sum(x)^2) / (n (n - 1)), in units of 2**-298; the root to 64+ bits, the rest
        # of the digits kept as a sticky bit so that the final rounding to float64 is correct
        numerator, denominator = n * self.squares - self.total * self.total, n * (n - 1)
        if numerator == 0:
            return 0.0
        scale = max(0, 128 - numerator.bit_length() + denominator.bit_length()) // 2 * 2 + 2
        quotient, remainder = divmod(numerator << scale, denominator)
        root = math.isqrt(quotient)
        sticky = int(remainder != 0 or root * root != quotient)
        return math.ldexp(float((root << 1) | sticky), -(scale // 2) - 149 - 1)

    def as_dict(self) -> dict[str, float | int | None]:
        empty = self.count == 0
        return {
            "count": self.count,
            "mean": None if empty else self.total / (self.count << 149),
            "std": None if empty else (self._finite_std() if self.count > 1 else 0.0),
            "min": None if empty else self.minimum,
            "max": None if empty else self.maximum,
            "nonfinite": self.nonfinite,
        }
