"""A sequence whose items are made when read: for what a dataset command would otherwise hold one Python object a
file of for a whole run (a report's rows, an engine's work units: a few hundred bytes to 1 KB a file each)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


class Lazy(Sequence[T]):
    """``count`` items, item ``i`` made by ``make(i)`` each time it is read (not kept). A report's rows are printed,
    and made JSON, as a list (``cli.render``); an engine takes its units one at a time."""

    def __init__(self, count: int, make: Callable[[int], T]) -> None:
        self.count, self.make = count, make

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> T:  # type: ignore[override]  # no slices: read one at a time
        return self.make(range(self.count)[i])  # a negative index counts from the end; out of range: IndexError
