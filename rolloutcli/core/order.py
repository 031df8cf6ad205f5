"""A stateless seeded bijection of ``range(n)``: the default shuffle of every export.

``RowOrder(key, n)`` maps a position ``p`` to the row ``rows(p)`` placed there and back (``positions``), for
any slice of positions or set of rows, without a per-row array of the whole range: a balanced Feistel network
over the smallest even number of bits ``2h`` with ``4**h >= n``, made a bijection of ``range(n)`` by cycle
walking (re-encrypt while the value is ``>= n``; since ``4**h < 4 * n``, four steps are expected). Every value
is a pure function of ``(key, n, p)``, so chunks of positions computed anywhere agree with the whole.

Algorithm ``feistel-cw``, order version 2 (version 1 was ``torch.randperm``): 6 rounds; round ``i`` replaces
``(L, R)`` by ``(R, L ^ F_i(R))`` with
``F_i(x) = mix64(x + k_i) & (2**h - 1)``, ``k_i = mix64(key + (i + 1) * golden)``, ``mix64`` SplitMix64's
finaliser on unsigned 64-bit integers (wrapping arithmetic). Changing any of this changes every shard: bump
``ORDER_VERSION``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ALGORITHM = "feistel-cw"
ORDER_VERSION = 2
ROUNDS = 6
_CHUNK = 1 << 18  # values a pass of the network: its temporaries stay a few MB for any count
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def draw_key(generator: torch.Generator | None) -> int:
    """One order key drawn from ``generator`` (None: the global RNG); epoch e of ``batch --seed S`` uses the
    e-th draw of ``torch.Generator().manual_seed(S)``."""
    return int(torch.randint(0, 2**62, (1,), generator=generator).item())


@dataclass(frozen=True)
class RowOrder:
    """The bijection of ``range(n)`` for ``key`` (see the module docstring)."""

    key: int
    n: int

    @property
    def half_bits(self) -> int:
        """``h``: the network permutes ``4**h >= n`` values (at least 1 bit a half)."""
        return max(1, ((max(self.n, 2) - 1).bit_length() + 1) // 2)

    def _round_keys(self) -> np.ndarray:
        i = np.arange(1, ROUNDS + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            return _mix64(np.uint64(self.key % 2**64) + i * _GOLDEN)

    def _network(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        h = np.uint64(self.half_bits)
        mask = np.uint64((1 << self.half_bits) - 1)
        left, right = x >> h, x & mask
        keys = self._round_keys()
        for k in keys[::-1] if inverse else keys:
            if inverse:  # undo (L, R) -> (R, L ^ F(R))
                left, right = right ^ (_mix64(left + k) & mask), left
            else:
                left, right = right, left ^ (_mix64(right + k) & mask)
        return (left << h) | right

    def _walk(self, values: torch.Tensor | np.ndarray, inverse: bool) -> torch.Tensor:
        shape = tuple(values.shape)
        x = np.asarray(values, dtype=np.int64).reshape(-1)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise ValueError(f"values must lie in [0, {self.n})")
        out = np.empty(x.size, np.int64)
        n = np.uint64(self.n)
        with np.errstate(over="ignore"):
            for start in range(0, x.size, _CHUNK):
                part = self._network(x[start : start + _CHUNK].astype(np.uint64), inverse)
                todo = np.flatnonzero(part >= n)  # cycle walking: values past n step again
                while todo.size:
                    part[todo] = self._network(part[todo], inverse)
                    todo = todo[part[todo] >= n]
                out[start : start + part.size] = part.view(np.int64)  # every value is below n < 2**63
        return torch.from_numpy(out).view(shape)

    def rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """``[stop - start]`` int64: the row at each position ``start <= p < stop`` (default: all)."""
        stop = self.n if stop is None else stop
        return self._walk(np.arange(start, stop, dtype=np.int64), inverse=False)

    def positions(self, rows: torch.Tensor | np.ndarray) -> torch.Tensor:
        """The position of each row (the inverse of :meth:`rows`), same shape, int64."""
        return self._walk(rows, inverse=True)

    def record(self) -> dict[str, int | str]:
        """What a manifest records to name this order."""
        return {"algorithm": ALGORITHM, "version": ORDER_VERSION, "rounds": ROUNDS, "key": self.key, "n": self.n}
