"""``import``'s computed outputs, written a block of rows at a time like the copied rows: ``dones`` and
``time_outs`` from a flat file's episode-end flags (D4RL ``terminals``/``timeouts``, ikostrikov
``masks``/``bad_masks``, read a block of rows at a time) or from the ends of an episode dataset's episodes (one
index per episode), and the zero ``rewards`` of demos that store none.

No output here is ever whole in memory: a source of a few KB may declare 2**29 steps, so the only memory these
take is one block of rows (``row_bytes`` each, the block sized by ``--max-memory``) and one index per episode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

Read = Callable[[str, slice], np.ndarray]  # rows of a source dataset
FLAG_DTYPE = np.dtype(np.uint8)


@dataclass(frozen=True)
class FlatFlags:
    """``dones``/``time_outs`` [T, N] of a flat file. D4RL: an episode ends where ``terminal`` (terminals) or
    ``truncation`` (timeouts) is set, a truncation only where it did not terminate. ikostrikov: ``dones[t] =
    1 - masks[t + 1]``, ``time_outs[t] = 1 - bad_masks[t + 1]`` (``offset`` 1: the flags have T+1 rows)."""

    T: int
    N: int
    terminal: str
    truncation: str | None
    offset: int = 0
    ended_when_set: bool = True  # D4RL's flags say "ended" when set; ikostrikov's masks when 0

    @property
    def outputs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"dones": ((self.T, self.N), FLAG_DTYPE), "time_outs": ((self.T, self.N), FLAG_DTYPE)}

    def row_bytes(self, listing: dict[str, Any]) -> int:
        """Bytes one row costs: the flag rows read, the comparisons and combinations of their first numbers (a
        byte each, a few alive at once) and the two rows computed; measured about 8 bytes a row for bool flags."""
        names = [n for n in (self.terminal, self.truncation) if n is not None]
        read = sum(math.prod(listing[n].shape[1:]) * listing[n].dtype.itemsize for n in names)
        return 2 * read + 12 * self.N

    def _flag(self, read: Read, name: str, start: int, stop: int) -> np.ndarray:
        """The flag's first number of each row (and env), as "the episode ended here"."""
        rows = read(name, slice(start + self.offset, stop + self.offset))
        first = rows.reshape(stop - start, self.N, -1)[:, :, 0]
        return first != 0 if self.ended_when_set else first == 0

    def rows(self, read: Read, start: int, stop: int) -> dict[str, np.ndarray]:
        ended = self._flag(read, self.terminal, start, stop)
        if self.truncation is None:
            cut = np.zeros_like(ended)
        else:
            cut = self._flag(read, self.truncation, start, stop)
        if self.ended_when_set:  # D4RL: a step both terminal and timed out terminated
            ended, cut = ended | cut, cut & ~ended
        return {"dones": ended.astype(FLAG_DTYPE), "time_outs": cut.astype(FLAG_DTYPE)}

    def episodes(self, read: Read, step: int) -> int:
        """Episodes in the file, counted a block of ``step`` rows at a time: each ``dones`` ends one; in a D4RL
        file, steps after the last end are one more (cut by the recording)."""
        count, last = 0, 1
        for start, stop in blocks(self.T, step):
            dones = self.rows(read, start, stop)["dones"]
            count, last = count + int(np.count_nonzero(dones)), int(dones[-1, 0])
        return count + (not last if self.ended_when_set else 0)


@dataclass(frozen=True)
class EpisodeEnds:
    """``dones``/``time_outs`` [T, 1] of episodes laid end to end: ``ends`` the last step of each (ascending),
    ``truncated`` whether that end was a truncation."""

    T: int
    ends: np.ndarray
    truncated: np.ndarray

    @property
    def outputs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"dones": ((self.T, 1), FLAG_DTYPE), "time_outs": ((self.T, 1), FLAG_DTYPE)}

    def row_bytes(self, listing: dict[str, Any]) -> int:
        return 2

    def rows(self, read: Read, start: int, stop: int) -> dict[str, np.ndarray]:
        first, last = np.searchsorted(self.ends, [start, stop])
        ends, cut = self.ends[first:last] - start, self.truncated[first:last]
        dones, time_outs = np.zeros((stop - start, 1), FLAG_DTYPE), np.zeros((stop - start, 1), FLAG_DTYPE)
        dones[ends], time_outs[ends[cut]] = 1, 1
        return {"dones": dones, "time_outs": time_outs}


@dataclass(frozen=True)
class Zeros:
    """An output of zeros (robomimic demos that store no rewards: zeros stand in, and the file says so)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def outputs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {self.name: (self.shape, self.dtype)}

    def row_bytes(self, listing: dict[str, Any]) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def rows(self, read: Read, start: int, stop: int) -> dict[str, np.ndarray]:
        return {self.name: np.zeros((stop - start, *self.shape[1:]), self.dtype)}


Computed = FlatFlags | EpisodeEnds | Zeros


def blocks(rows: int, step: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive blocks of at most ``step`` rows covering ``rows``."""
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def block_rows(computed: Computed, listing: dict[str, Any], budget: int) -> int:
    """Rows of ``computed`` a block of ``budget`` bytes holds (at least one)."""
    return max(1, budget // max(computed.row_bytes(listing), 1))


def computed_bytes(computed: list[Computed]) -> int:
    """The uncompressed size of the outputs ``computed`` writes."""
    return sum(math.prod(shape) * dtype.itemsize for c in computed for shape, dtype in c.outputs.values())
