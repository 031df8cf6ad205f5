"""Per-dimension statistics of a ``[rows, D]`` block (numpy, no torch): one :class:`ExactMoments` per dimension.

The sums are the exact ones of :class:`rolloutcli.core.moments.ExactMoments`, binned by (dimension, exponent) in
one ``bincount`` per term instead of one per dimension, so a block of thousands of dimensions costs a few passes.
Merging is exact: the result never depends on the blocks. Values are taken as float32 (observations of another
width are rounded to float32 first); non-finite values are counted per dimension and left out of the sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from rolloutcli.core.moments import ExactMoments

CHUNK = 1 << 20  # values per piece of a block (see DimMoments.of)


def _binned_sums(weights: np.ndarray, bins: np.ndarray, dims: int, scale: int) -> list[int]:
    """Per dimension, ``sum(weights) * 2**scale`` exactly (the invariant of ``moments._exponent_sums``)."""
    part = np.bincount(bins, weights, dims * 256)
    totals = [0] * dims
    nonzero = np.flatnonzero(part)
    for index, value in zip(nonzero.tolist(), part[nonzero].tolist(), strict=True):
        totals[index >> 8] += int(math.ldexp(value, scale))
    return totals


@dataclass
class DimMoments:
    """One :class:`ExactMoments` per dimension."""

    dims: list[ExactMoments]

    @classmethod
    def empty(cls, dims: int) -> DimMoments:
        return cls([ExactMoments() for _ in range(dims)])

    @classmethod
    def of(cls, values: Any) -> DimMoments:
        """Moments of a block ``[rows, D]`` (rows of any count, dimensions on the last axis), taken in pieces of
        about ``CHUNK`` values: the float64 temporaries stay small whatever the block (the merge is exact)."""
        rows, dims = values.shape
        step = max(1, CHUNK // max(dims, 1))
        if values.dtype.kind in "iub" and values.dtype.itemsize <= 2:
            return cls._of_small_integers(values, step)
        if rows <= step:
            return cls._of(values)
        out = cls.empty(dims)
        for start in range(0, rows, step):
            out = out.merge(cls._of(values[start : start + step]))
        return out

    @classmethod
    def _of_small_integers(cls, values: np.ndarray, step: int) -> DimMoments:
        """Integers of at most 16 bits (images): exact int64 sums, no per-piece objects (every value is finite
        and a float32)."""
        rows, dims = values.shape
        total, squares = np.zeros(dims, np.int64), np.zeros(dims, np.int64)
        for start in range(0, rows, step):
            piece = values[start : start + step].astype(np.int64)
            total += piece.sum(axis=0)
            squares += np.square(piece).sum(axis=0)
        low = values.min(axis=0).astype(np.float64).tolist() if rows else [math.inf] * dims
        high = values.max(axis=0).astype(np.float64).tolist() if rows else [-math.inf] * dims
        return cls(
            [
                ExactMoments(rows, int(t) << 149, int(q) << 298, lo, hi, 0) if rows else ExactMoments()
                for t, q, lo, hi in zip(total.tolist(), squares.tolist(), low, high, strict=True)
            ]
        )

    @classmethod
    def _of(cls, values: Any) -> DimMoments:
        block = np.ascontiguousarray(values, dtype=np.float32)
        rows, dims = block.shape
        exponents = ((block.view(np.uint32) >> 23) & 0xFF).astype(np.intp)
        finite = exponents != 0xFF
        clean = np.where(finite, block, np.float32(0.0))
        bins = (exponents + (np.arange(dims, dtype=np.intp) << 8)).reshape(-1)
        high = (clean.view(np.uint32) & np.uint32(0xFFFFF000)).view(np.float32)
        low = (clean - high).astype(np.float64).reshape(-1)
        high = high.astype(np.float64).reshape(-1)
        # the exponent of a non-finite value is 0xFF: its bin holds only zeros (the value was replaced by 0)
        totals = _binned_sums(clean.astype(np.float64).reshape(-1), bins, dims, 149)
        cross = _binned_sums(high * low, bins, dims, 298)
        squares = [
            h + 2 * c + ll
            for h, c, ll in zip(
                _binned_sums(high * high, bins, dims, 298), cross, _binned_sums(low * low, bins, dims, 298), strict=True
            )
        ]
        counts = finite.sum(axis=0).tolist()
        minimum = np.where(finite, block, np.inf).min(axis=0, initial=np.inf).astype(np.float64).tolist()
        maximum = np.where(finite, block, -np.inf).max(axis=0, initial=-np.inf).astype(np.float64).tolist()
        return cls(
            [
                ExactMoments(counts[d], totals[d], squares[d], minimum[d], maximum[d], rows - counts[d])
                for d in range(dims)
            ]
        )

    def merge(self, other: DimMoments) -> DimMoments:
        return DimMoments([a.merge(b) for a, b in zip(self.dims, other.dims, strict=True)])

    def as_dict(self) -> dict[str, list[float | int | None]]:
        """``{"mean": [D], "std": [D], "min": [D], "max": [D], "count": [D], "nonfinite": [D]}`` (std unbiased;
        None for a dimension without finite values)."""
        rows = [m.as_dict() for m in self.dims]
        return {key: [row[key] for row in rows] for key in ("mean", "std", "min", "max", "count", "nonfinite")}

    def population_variance(self) -> list[float]:
        """The exactly rounded variance over the count (``torch.var(unbiased=False)``), 0 without values."""
        out = []
        for m in self.dims:
            n = m.count
            out.append((n * m.squares - m.total * m.total) / ((n * n) << 298) if n else 0.0)
        return out
